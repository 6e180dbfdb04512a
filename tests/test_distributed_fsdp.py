"""Sequence parallelism with FSDP2 (hf_dilated.distributed.fsdp) on real gloo processes.

A tiny Llama and a tiny GPT-NeoX (model_configs presets, saved and loaded as safetensors), full
fine-tuning and LoRA, gradient checkpointing on, on 2 x 2 (data x sequence parallel) and 1 x 4
grids, parameters sharded over all ranks ("dp_sp") or over the data-parallel ranks ("dp"): the
loss, the gathered gradients and the weights after an AdamW step equal one process's.

One training step is the mean of two batches' token-mean losses, batch 0 with padding (an
attention mask), batch 1 with packed documents (position ids restarting): with 2 replicas each
takes one batch and FSDP2 averages their gradients, with 1 replica it accumulates both (x 1/2),
and one process computes (loss(batch 0) + loss(batch 1)) / 2 directly.
"""
from __future__ import annotations

import math

import pytest
import torch

from distributed_launch import launch

TOL = 2e-5  # float32, absolute: losses (~5.5) and gradients (largest ~1e-1)
LR = 1e-3
# AdamW's first step moves a weight by lr * g / (|g| + eps): for gradients near eps (1e-8) a float32
# difference in g becomes a difference of up to lr in the weight. A tenth of lr still tells a step
# taken from the right gradient apart from any other (every other weight moves by ~lr).
WEIGHT_TOL = 0.1 * LR
SEQ_LEN = 128
FAMILIES = ("tiny-llama", "tiny-gpt-neox")  # model_configs presets
# (preset, attention name, LoRA, shard): both families, full and LoRA, both shardings, every ring name.
CASES = (
    ("tiny-llama", "dilated_ring", False, "dp_sp"),
    ("tiny-llama", "block_sparse_ring", True, "dp"),
    ("tiny-gpt-neox", "ring", False, "dp"),
    ("tiny-gpt-neox", "dilated_ring", True, "dp_sp"),
)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """preset -> directory of a tiny model saved as safetensors, random weights."""
    import hf_dilated  # noqa: F401
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_dilated.model_configs import load_preset

    out = {}
    for preset in FAMILIES:
        model_config = dict(load_preset(preset)["model_config"])
        config = AutoConfig.for_model(model_config.pop("model_type"), **model_config)
        config.max_position_embeddings = SEQ_LEN
        # Levels of 8, 16 and 32 tokens: over 4 ranks (zigzag chunks of 16) the first levels stay
        # inside a chunk and the last crosses ranks.
        config.hf_dilated = {"segment_lengths": [8, 16, 32], "dilation_rates": [1, 2, 4], "block_size": 4,
                             "pattern": {"type": "global_local", "global_blocks": 1, "window": 2}}
        config.use_cache = False
        torch.manual_seed(0)
        path = tmp_path_factory.mktemp(preset)
        AutoModelForCausalLM.from_config(config).save_pretrained(path, safe_serialization=True)
        assert (path / "model.safetensors").is_file()
        out[preset] = str(path)
    return out


def step_batches(vocab: int, step: int) -> list[dict]:
    """The two batches of a training step: 2 rows each, padded / packed."""
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(3, vocab, (2, SEQ_LEN), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :7] = 0  # left padding
    mask[1, -5:] = 0  # right padding
    padded = dict(input_ids=ids.masked_fill(mask == 0, 0), labels=ids.masked_fill(mask == 0, -100), attention_mask=mask)
    ids = torch.randint(3, vocab, (2, SEQ_LEN), generator=g)
    pos = torch.cat([torch.arange(21), torch.arange(50), torch.arange(57)]).expand(2, SEQ_LEN).clone()
    packed = dict(input_ids=ids, labels=ids.clone(), position_ids=pos)
    return [padded, packed]


def load_model(path, attn, lora):
    import hf_dilated
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn, dtype=torch.float32)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora:
        from peft import get_peft_model

        torch.manual_seed(1)  # the adapter's initialisation, the same in every process
        # init_lora_weights=False: B is random too, so that A's gradient is not zero at step 1.
        model = get_peft_model(model, hf_dilated.lora_config(model, r=4, init_lora_weights=False))
    model.train()
    return model


def make_optimizer(model):
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.01)


def full(t):
    """A copy of the whole of a DTensor (gathered) or tensor. A copy: on a mesh that needs no
    gathering (shards of one rank) full_tensor() returns the parameter's own storage, which the
    next optimizer step would change."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def sharded_step(model, optimizer, batches, sp):
    """One optimizer step on this rank's batches; returns the step's global loss."""
    import torch.distributed as dist

    import hf_dilated.distributed as hd

    mine = batches[sp.dp_rank::sp.dp_size]
    loss_sum = torch.zeros(())
    for batch in mine:
        out = model(**hd.shard_batch(**batch))
        loss = hd.reduce_loss(out.loss)  # grad_reduction "mean": FSDP2 averages over all ranks
        (loss * (sp.dp_size / len(batches))).backward()
        loss_sum += loss.detach()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    dist.all_reduce(loss_sum, group=sp.dp_group)
    return loss_sum / len(batches)


def train_case(path, attn, lora, shard, mesh, sp, steps=2, mp_policy=None):
    """Losses of `steps` steps, the gathered gradients of step 1 and the weights after it, the
    parameters' dtypes, and how often the decoder layers' insides ran per batch (2 with activation
    checkpointing: the forward, then its recomputation in the backward; transformers checkpoints a
    layer's forward, inside the layer's own hooks, so the count is taken on a child module)."""
    import hf_dilated.distributed as hd

    model = load_model(path, attn, lora)
    hd.apply_fsdp2(model, mesh, shard=shard, mp_policy=mp_policy)
    layer_calls = []
    for layer in hd.fsdp.decoder_layers(model):
        next(layer.children()).register_forward_hook(lambda *_: layer_calls.append(1))
    optimizer = make_optimizer(model)
    losses, grads, weights = [], None, None
    vocab = model.config.vocab_size if not lora else model.get_base_model().config.vocab_size
    for step in range(steps):
        keep = optimizer.step

        def step_and_gather():  # gradients are gone after zero_grad: gather them just before the step
            nonlocal grads
            if grads is None:
                grads = {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
            keep()

        optimizer.step = step_and_gather
        losses.append(sharded_step(model, optimizer, step_batches(vocab, step), sp).item())
        optimizer.step = keep
        if step == 0:
            weights = {n: full(p.detach()) for n, p in model.named_parameters() if p.requires_grad}
    dtypes = {p.dtype for p in model.parameters()}
    batches_run = steps * 2 // sp.dp_size
    return losses, grads, weights, dtypes, len(layer_calls) / (batches_run * len(hd.fsdp.decoder_layers(model)))


def run_grid(rank, world, checkpoints, sp_size):
    import torch.distributed as dist
    from accelerate.parallelism_config import ParallelismConfig
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import hf_dilated.distributed as hd

    mesh = hd.build_mesh(sp_size)
    sp = hd.setup_sequence_parallel_from_mesh(mesh)
    timeout = lambda group: group._get_backend(torch.device("cpu")).options._timeout  # noqa: E731
    sharding_mesh = hd.fsdp.fsdp_mesh(mesh, shard="dp")
    # Every group waits as long as the default group (launch's timeout_s), not new_group's 30 minutes.
    results = {"timeouts": {timeout(g).total_seconds() for g in (mesh.get_group("sp"), mesh.get_group("dp_shard"),
                                                                 *(sharding_mesh.get_group(d) for d in range(2)))},
               "grid": (sp.dp_size, sp.sp_size, sp.dp_rank, sp.sp_rank),
               "sp_ranks": dist.get_process_group_ranks(sp.sp_group),
               "dp_ranks": dist.get_process_group_ranks(sp.dp_group)}
    for preset, attn, lora, shard in CASES:
        losses, grads, weights, _, runs_per_batch = train_case(checkpoints[preset], attn, lora, shard, mesh, sp)
        assert runs_per_batch == 2, f"activation checkpointing: each layer ran {runs_per_batch} times per batch"
        if rank == 0:
            results[(preset, attn, lora, shard)] = (losses, grads, weights)
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    losses, _, _, dtypes, _ = train_case(checkpoints["tiny-llama"], "block_sparse_ring", True, "dp_sp", mesh, sp,
                                      mp_policy=bf16)
    results["bf16"] = (losses, dtypes)
    # Accelerate's mesh for the same grid (its "cp" dimension as our SP dimension) and the legacy
    # setup give the same groups.
    accelerate_mesh = ParallelismConfig(dp_shard_size=world // sp_size, cp_size=sp_size).build_device_mesh("cpu")
    from_accelerate = hd.setup_sequence_parallel_from_mesh(accelerate_mesh, sp_dim="cp")
    legacy = hd.setup_sequence_parallel(sp_size)
    results["accelerate_vs_legacy"] = [
        (dist.get_process_group_ranks(a.sp_group), dist.get_process_group_ranks(a.dp_group), a.sp_rank, a.dp_rank)
        for a in (from_accelerate, legacy)]
    errors = {}
    for label, call in (("sp_dim", lambda: hd.setup_sequence_parallel_from_mesh(mesh, sp_dim="seq")),
                        ("not_a_mesh", lambda: hd.setup_sequence_parallel_from_mesh("sp")),
                        ("part", lambda: hd.setup_sequence_parallel_from_mesh(mesh["dp_shard"], sp_dim="dp_shard")),
                        ("shard", lambda: hd.apply_fsdp2(torch.nn.Linear(2, 2), mesh, shard="zero3")),
                        ("layers", lambda: hd.apply_fsdp2(torch.nn.Linear(2, 2), mesh))):
        try:
            call()
        except (ValueError, TypeError) as e:
            errors[label] = str(e)
    results["errors"] = errors
    hd.destroy_sequence_parallel()
    return results


def one_process(path, attn, lora, steps=2):
    """The reference: each step's (loss(batch 0) + loss(batch 1)) / 2 on one process."""
    from hf_dilated.distributed import shard_batch

    model = load_model(path, attn, lora)
    optimizer = make_optimizer(model)
    vocab = model.config.vocab_size if not lora else model.get_base_model().config.vocab_size
    losses, grads, weights = [], None, None
    for step in range(steps):
        batches = step_batches(vocab, step)
        total = 0.0
        for batch in batches:
            loss = model(**shard_batch(**batch)).loss / len(batches)  # no group: the whole batch
            loss.backward()
            total += loss.item()
        losses.append(total)
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step == 0:
            weights = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return losses, grads, weights


def check_against_one_process(got, checkpoints):
    for preset, attn, lora, shard in CASES:
        case = (preset, attn, lora, shard)
        losses, grads, weights = got[case]
        want_losses, want_grads, want_weights = one_process(checkpoints[preset], attn, lora)
        assert losses == pytest.approx(want_losses, abs=TOL), case
        assert grads.keys() == want_grads.keys() and len(grads) > 0, case
        assert max(g.abs().max().item() for g in want_grads.values()) > 1e-3, case  # not all zero
        for n, g in want_grads.items():
            err = (grads[n] - g).abs().max().item()
            assert err < TOL, f"{case}: gradient of {n} differs by {err}"
        for n, w in want_weights.items():
            err = (weights[n] - w).abs().max().item()
            assert err < WEIGHT_TOL, f"{case}: weight {n} after AdamW differs by {err}"


@pytest.mark.slow
@pytest.mark.parametrize("dp,sp", [(2, 2), (1, 4)])
def test_fsdp2_with_sequence_parallelism_matches_one_process(checkpoints, dp, sp):
    outcomes = launch(run_grid, dp * sp, checkpoints, sp, join_s=400, timeout_s=120)
    got = outcomes[0]["result"]
    assert got["timeouts"] == {120.0}
    assert [o["result"]["grid"] for o in outcomes] == [(dp, sp, r // sp, r % sp) for r in range(dp * sp)]
    for o in outcomes:
        r = o["rank"]
        assert o["result"]["sp_ranks"] == list(range(r - r % sp, r - r % sp + sp))
        assert o["result"]["dp_ranks"] == list(range(r % sp, dp * sp, sp))
        a, legacy = o["result"]["accelerate_vs_legacy"]
        assert a == legacy, (r, a, legacy)
        errors = o["result"]["errors"]
        assert "sp_dim 'seq'" in errors["sp_dim"] and "shard must be one of" in errors["shard"]
        assert "no decoder layers" in errors["layers"]
        assert errors["not_a_mesh"] == "mesh must be a torch.distributed.device_mesh.DeviceMesh, got str"
        assert errors["part"].startswith(f"mesh spans {dp} processes, the default group {dp * sp}")
    check_against_one_process(got, checkpoints)
    bf16_losses, dtypes = got["bf16"]
    reference = got[("tiny-llama", "block_sparse_ring", True, "dp")][0]  # same model in float32
    assert all(math.isfinite(x) for x in bf16_losses)
    assert abs(bf16_losses[0] - reference[0]) < 0.1 * reference[0]  # bf16 compute, same model
    assert dtypes == {torch.float32}  # FSDP2 keeps float32 master weights, computes in bf16


def load_into_full_finetuning(rank, world, path, checkpoint_dir):
    """A LoRA run's checkpoint loaded into a fully fine-tuned model: the error it gives."""
    import hf_dilated.distributed as hd

    model = load_model(path, "dilated_ring", lora=False)
    hd.apply_fsdp2(model, hd.build_mesh(2))
    try:
        hd.load_sharded_state(checkpoint_dir, model, make_optimizer(model))
    except ValueError as e:
        return str(e)
    return None


def train_with_checkpoint(rank, world, path, checkpoint_dir, sp_size, shard, resume):
    """LoRA Llama on a (world / sp_size) x sp_size grid: either 2 steps with the sharded state
    saved after step 1 (resume False), or the state loaded, then step 2 (resume True). Returns
    the losses this run computed and the trainable weights at the end."""
    import hf_dilated.distributed as hd

    mesh = hd.build_mesh(sp_size)
    sp = hd.setup_sequence_parallel_from_mesh(mesh)
    model = load_model(path, "dilated_ring", lora=True)
    hd.apply_fsdp2(model, mesh, shard=shard)
    optimizer = make_optimizer(model)
    vocab = model.get_base_model().config.vocab_size
    losses = []
    if resume:
        hd.load_sharded_state(checkpoint_dir, model, optimizer)
    else:
        losses.append(sharded_step(model, optimizer, step_batches(vocab, 0), sp).item())
        hd.save_sharded_state(checkpoint_dir, model, optimizer)
    losses.append(sharded_step(model, optimizer, step_batches(vocab, 1), sp).item())
    weights = {n: full(p) for n, p in model.named_parameters() if p.requires_grad}
    steps = {float(s["step"]) for s in optimizer.state.values()}
    return losses, weights, steps


@pytest.mark.slow
def test_sharded_checkpoint_resumes_exactly(checkpoints, tmp_path):
    """Saved after step 1 on 2 x 2 (parameters over all ranks), step 2 in a fresh launch gives
    the uninterrupted run's loss and weights: on the same grid bit for bit, on 1 x 4 with the
    SP ranks as replicas (DCP reshards on load) within TOL."""
    path, saved = checkpoints["tiny-llama"], tmp_path / "step-1"
    straight = launch(train_with_checkpoint, 4, path, str(saved), 2, "dp_sp", False, join_s=300, timeout_s=120)[0]
    assert (saved / ".metadata").is_file()
    (loss_1, loss_2), weights, steps = straight["result"]
    assert steps == {2.0} and loss_1 != loss_2
    resumed = launch(train_with_checkpoint, 4, path, str(saved), 2, "dp_sp", True, join_s=300, timeout_s=120)[0]
    (loss, ), resumed_weights, resumed_steps = resumed["result"]
    assert loss == loss_2 and resumed_steps == {2.0}
    for n, w in weights.items():
        assert torch.equal(resumed_weights[n], w), n
    resharded = launch(train_with_checkpoint, 4, path, str(saved), 4, "dp", True, join_s=300, timeout_s=120)[0]
    (loss, ), resharded_weights, _ = resharded["result"]
    assert abs(loss - loss_2) < TOL
    for n, w in weights.items():
        assert (resharded_weights[n] - w).abs().max().item() < WEIGHT_TOL, n
    mismatch = launch(load_into_full_finetuning, 4, path, str(saved), join_s=300, timeout_s=120)[0]["result"]
    assert mismatch is not None and f"path: {saved} does not hold this model's trainable weights" in mismatch
