"""A tiny Llama (model_configs/tiny-llama.json, saved and loaded as safetensors) under sequence
parallelism on 2 real gloo processes gives the same loss and parameter gradients as one process,
for each registered ring name, with padding, packed documents and a length that 2 ranks x 2
zigzag chunks do not divide."""
from __future__ import annotations

import pytest
import torch

from distributed_launch import launch

NAMES = ("ring", "dilated_ring", "block_sparse_ring")
TOL = 1e-5


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    import hf_dilated  # noqa: F401  (registers the attention names)
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_dilated.model_configs import load_preset

    preset = load_preset("tiny-llama")
    config = LlamaConfig(**{k: v for k, v in preset["model_config"].items() if k != "model_type"})
    # Levels of 8, 16 and 32 tokens: with 38-40 tokens over 2 ranks (zigzag chunks of ~10) the
    # first level stays mostly inside a chunk and the others cross ranks.
    config.hf_dilated = {"segment_lengths": [8, 16, 32], "dilation_rates": [1, 2, 4], "block_size": 4,
                         "pattern": {"type": "global_local", "global_blocks": 1, "window": 2}}
    config.use_cache = False
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    assert (path / "model.safetensors").is_file()
    return str(path)


def batches():
    g = torch.Generator().manual_seed(1)
    plain = torch.randint(3, 256, (2, 40), generator=g)
    out = {"plain": dict(input_ids=plain, labels=plain.clone())}
    ids = torch.randint(3, 256, (2, 38), generator=g)  # 38: shard_batch pads to 40
    mask = torch.ones_like(ids)
    mask[0, :6] = 0  # left padding
    mask[1, -4:] = 0  # right padding
    labels = ids.masked_fill(mask == 0, -100)
    out["padded_uneven"] = dict(input_ids=ids.masked_fill(mask == 0, 0), labels=labels, attention_mask=mask)
    ids = torch.randint(3, 256, (2, 40), generator=g)
    pos = torch.cat([torch.arange(13), torch.arange(19), torch.arange(8)]).expand(2, 40).clone()
    out["packed"] = dict(input_ids=ids, labels=ids.clone(), position_ids=pos)
    return out


def loss_and_grads(model, batch):
    model.zero_grad()
    out = model(**batch)
    return out, {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def run_sp(rank, world, path, names=NAMES):
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    import hf_dilated.distributed as hd

    sp = hd.setup_sequence_parallel(world)
    results = {}
    for name in names:
        model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=name)
        for case, batch in batches().items():
            local = hd.shard_batch(**batch)
            model.zero_grad()
            out = model(**local)
            loss = hd.reduce_loss(out.loss, grad_reduction="sum")
            loss.backward()
            grads = {}
            for n, p in model.named_parameters():
                dist.all_reduce(p.grad, group=sp.sp_group)
                grads[n] = p.grad
            logits = hd.gather_sequence(out.logits.detach(), seq_len=batch["input_ids"].shape[1])
            results[(name, case)] = (loss.detach(), grads, logits)
    return results if sp.sp_rank == 0 else None


def test_tiny_llama_sequence_parallel_matches_one_process(checkpoint):
    check_against_one_process(checkpoint, NAMES)


@pytest.fixture(scope="module")
def band_checkpoint(checkpoint, tmp_path_factory):
    """The conversion's default pattern (docs/contract.md 4.1): a band of 12 positions united with
    dilated levels, far keys at grouped positions (G = 4)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = tmp_path_factory.mktemp("tiny-llama-band")
    config = AutoConfig.from_pretrained(checkpoint)
    config.hf_dilated = {"segment_lengths": [8, 16, 32], "dilation_rates": [1, 2, 4], "local_window": 12,
                         "far_group": 4}
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path, safe_serialization=True)
    return str(path)


def test_a_local_band_with_grouped_far_positions_under_sequence_parallelism(band_checkpoint):
    """dilated_ring with the conversion's band and far projections on 2 ranks: the loss, logits and
    gradients of one process (it refused a band across ranks before)."""
    check_against_one_process(band_checkpoint, ("dilated_ring",))


def check_against_one_process(checkpoint, names):
    from transformers import AutoModelForCausalLM

    from hf_dilated.distributed import shard_batch

    got = launch(run_sp, 2, checkpoint, names, join_s=300)[0]["result"]
    for name in names:
        model = AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation=name)
        for case, batch in batches().items():
            # One process, same global position ids as shard_batch gives the ranks.
            batch = dict(batch, position_ids=shard_batch(**batch)["position_ids"][:, : batch["input_ids"].shape[1]])
            model.zero_grad()
            out = model(**batch)
            out.loss.backward()
            loss, grads, logits = got[(name, case)]
            assert abs(loss.item() - out.loss.item()) < TOL, (name, case, loss.item(), out.loss.item())
            real = batch.get("attention_mask", torch.ones_like(batch["input_ids"])).bool()
            assert (logits - out.logits.detach())[real].abs().max() < 1e-4, (name, case)
            for n, p in model.named_parameters():
                err = (grads[n] - p.grad).abs().max().item()
                assert err < TOL, f"{name} {case}: gradient of {n} differs by {err}"


def _windowed_mistral():
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    return MistralForCausalLM(MistralConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                            num_key_value_heads=2, intermediate_size=37, sliding_window=13,
                                            use_cache=False)).eval()


def _windowed_ids():
    return torch.randint(3, 99, (2, 40), generator=torch.Generator().manual_seed(0))


def windowed_under_sequence_parallelism(rank, world):
    """Child: a Mistral whose 13-token window is shorter than the 40-token sequence (and than a
    rank's 20-token shard), under each ring name; returns the gathered logits."""
    import hf_dilated  # noqa: F401
    import hf_dilated.distributed as hd

    model = _windowed_mistral()
    hd.setup_sequence_parallel(world)
    ids = _windowed_ids()
    logits = {}
    for name in NAMES:
        model.set_attn_implementation(name)
        with torch.no_grad():
            out = model(**hd.shard_batch(ids))
        logits[name] = hd.gather_sequence(out.logits, seq_len=ids.shape[1])
    return logits


def test_a_sliding_window_under_sequence_parallelism_matches_sdpa():
    """It used to be refused (and, before that, checked against a shard's length only)."""
    model = _windowed_mistral()
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        want = model(_windowed_ids()).logits
    for outcome in launch(windowed_under_sequence_parallelism, 2):
        for name, got in outcome["result"].items():
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=name)


def run_generate(rank, world, path):
    import hf_dilated.distributed as hd
    from transformers import AutoModelForCausalLM

    hd.setup_sequence_parallel(world)
    messages = {}
    for name in NAMES:
        model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=name).eval()
        prompt = hd.shard_batch(torch.randint(3, 256, (1, 16), generator=torch.Generator().manual_seed(2)))
        try:
            model.generate(**{k: v for k, v in prompt.items() if k != "labels"}, max_new_tokens=2,
                           do_sample=False, use_cache=True)
        except NotImplementedError as exc:
            messages[name] = str(exc)
    return messages


def test_generate_under_a_sequence_parallel_group_is_refused_by_name(checkpoint):
    """Each rank's cache holds its shard alone: a decode step under a group used to fail on an
    unrelated check ("position_ids are 0..n-1", or a shape error), or not at all."""
    for messages in launch(run_generate, 2, checkpoint, join_s=120.0):
        assert sorted(messages["result"]) == sorted(NAMES), messages
        assert all("a call against a KV cache" in m and "sequence-parallel group" in m
                   for m in messages["result"].values())


def _packed_by_boundaries(rank, world, path):
    """Per ring name: (logits of three documents packed with cu_seq_lens only, as
    DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_position_ids=False) gives them,
    each document's logits alone), under a group of `world` processes; or the error raised."""
    from transformers import AutoModelForCausalLM

    import hf_dilated.distributed as hd

    hd.setup_sequence_parallel(world)
    lengths = [7, 13, 20]
    ids = torch.randint(3, 256, (1, sum(lengths)), generator=torch.Generator().manual_seed(2))
    cu = torch.tensor([0, 7, 20, 40], dtype=torch.int32)
    out = {}
    for name in NAMES:
        model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=name).eval()
        try:
            with torch.no_grad():
                packed = model(ids, cu_seq_lens_q=cu, cu_seq_lens_k=cu.clone(), max_length_q=20, max_length_k=20,
                               use_cache=False).logits
                starts = [0, 7, 20]
                alone = [model(ids[:, s:s + n], use_cache=False).logits for s, n in zip(starts, lengths)]
            out[name] = max((a[0] - packed[0, s:s + n]).abs().max().item() for a, s, n in zip(alone, starts, lengths))
        except ValueError as exc:
            out[name] = str(exc)
    return out


def test_ring_names_under_a_group_honour_or_refuse_cu_seq_lens(checkpoint):
    """cu_seq_lens (without position_ids) were dropped under a sequence-parallel group: the packed
    documents read each other (0.52 off each alone with a group of one process). A group of one
    holds the whole row and takes the single-process rules; on several processes each rank
    refuses them, naming them (position_ids carry a shard's documents)."""
    one = launch(_packed_by_boundaries, 1, checkpoint, join_s=300)[0]["result"]
    for name in NAMES:
        assert isinstance(one[name], float) and one[name] < 1e-4, (name, one[name])
    for outcome in launch(_packed_by_boundaries, 2, checkpoint, join_s=300):
        for name in NAMES:
            assert "cu_seq_lens_q/cu_seq_lens_k: under a sequence-parallel group" in outcome["result"][name], name


def _one_process_name_under_a_group(rank, world, path):
    """The log lines of a `dilated` (one-process name) forward of shard_batch's shards under a group."""
    import logging

    from transformers import AutoModelForCausalLM
    from transformers.utils.logging import get_logger

    import hf_dilated.distributed as hd

    hd.setup_sequence_parallel(world)
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    get_logger("transformers").addHandler(handler)
    ids = torch.randint(3, 256, (1, 40), generator=torch.Generator().manual_seed(2))
    for name in ("dilated_ring", "dilated"):
        model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=name).eval()
        with torch.no_grad():
            model(**hd.shard_batch(ids))
        lines.append(f"-- after {name}")
    return lines


def test_a_one_process_name_under_a_sequence_parallel_group_says_so(checkpoint):
    """Shards of one sequence under `dilated` were attended rank by rank without a word (a review:
    loss 4.155742 against one process's 4.154078): the one-process names say so once."""
    for outcome in launch(_one_process_name_under_a_group, 2, checkpoint, join_s=120.0):
        lines = outcome["result"]
        said = [i for i, line in enumerate(lines) if "attn_implementation='dilated' attends within this process" in line]
        assert len(said) == 1 and said[0] > lines.index("-- after dilated_ring"), lines
