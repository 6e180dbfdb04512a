"""Training with sparse far keys on the GPU's path (ops/sparse_far_train.py) against the independent
float64 reference (tests/reference.py), run on the CPU.

FlexAttention has no backward on the CPU, so these tests stand in for its differentiated calls with
its definition (the `gpu_training_path` fixture and `flex_definition` of tests/conftest.py: every pair
of a listed full tile, and the pairs of a listed partial tile that its mask_mod keeps, in float64
torch operations that autograd differentiates); the forward runs torch's own eager FlexAttention.
FlexAttention's backward itself runs in this file's CUDA tests, at the end."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_dilated.config import CONFIG_KEY
from hf_dilated.ops import dilated_attention, sparse_far_flex, sparse_far_train
from hf_dilated.ops.far_selection import FarSelection
from reference import local_band_reference
from test_dilated import make_inputs
from test_sparse_far import BASE, far_inputs, sparse

TOL = 1e-10


# (far_band, far_top_k, far_block_size, far_sinks) with a local_window of 64 over rows of 300 keys
TRAIN_SETTINGS = [(None, 2, 16, 1), (24, 3, 16, 1), (48, 2, 48, 2), (None, 1, 64, 0), (20, 0, 8, 1), (32, 50, 32, 1),
                  (24, 0, 16, 0)]


def _inputs(heads, seed=3):
    case = replace(BASE, layout="plain", kv_len=300, q_heads=heads[0], kv_heads=heads[1], batch=2, seed=seed)
    q, k, v, _, _, _ = make_inputs(case, torch.float64)
    q_far, k_far = far_inputs(q, k, seed + 1)
    return [t.detach().requires_grad_() for t in (q, k, v, q_far, k_far)]


@pytest.mark.parametrize("setting", TRAIN_SETTINGS, ids=lambda s: "band{}_k{}_B{}_s{}".format(*s))
@pytest.mark.parametrize("heads", ((4, 2), (3, 1)), ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("far", (True, False), ids=("far_projections", "same_projections"))
@pytest.mark.parametrize("chunked", (False, True), ids=("one_call", "calls_of_128"))
def test_training_path_matches_reference(setting, heads, far, chunked, gpu_training_path, monkeypatch):
    """Output and the gradients of q, k, v, q_far and k_far, in one call of every query row or in
    calls of 128 (the last moved back over rows the one before wrote: they take no cotangent twice)."""
    if chunked:
        monkeypatch.setattr(sparse_far_flex, "_BOUND_ELEMENTS", 1)  # 128 queries per call
    q, k, v, q_far, k_far = _inputs(heads)
    if not far:
        q_far, k_far = q, k
    kernel, ref_kw = sparse(setting)
    out = dilated_attention(q, k, v, [512], [1], local_window=64, q_far=q_far, k_far=k_far, **kernel)
    assert type(out.grad_fn).__name__ == "_SparseFarBackward"  # (the path under test)
    leaves = [q, k, v] + ([q_far, k_far] if far else [])
    refs = [t.detach().clone().requires_grad_() for t in leaves]
    ref = local_band_reference(*refs[:3], [512], [1], 64, q_far=refs[3] if far else None,
                               k_far=refs[4] if far else None, **ref_kw)
    assert (out - ref).abs().max().item() < TOL
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    mine = torch.autograd.grad((out * grad).sum(), leaves)
    theirs = torch.autograd.grad((ref * grad).sum(), refs)
    for name, a, b in zip(("q", "k", "v", "q_far", "k_far"), mine, theirs):
        assert (a - b).abs().max().item() < TOL, name


def test_training_path_in_half_precision_is_as_close_as_the_masked_calls(gpu_training_path):
    """float32 inputs: the gradients within float32's rounding of the reference's."""
    q, k, v, q_far, k_far = (t.detach().float().requires_grad_() for t in _inputs((4, 2)))
    kernel, ref_kw = sparse((24, 3, 16, 1))
    out = dilated_attention(q, k, v, [512], [1], local_window=64, q_far=q_far, k_far=k_far, **kernel)
    assert type(out.grad_fn).__name__ == "_SparseFarBackward"
    refs = [t.detach().double().requires_grad_() for t in (q, k, v, q_far, k_far)]
    ref = local_band_reference(*refs[:3], [512], [1], 64, q_far=refs[3], k_far=refs[4], **ref_kw)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    mine = torch.autograd.grad((out * grad).sum(), (q, k, v, q_far, k_far))
    theirs = torch.autograd.grad((ref * grad.double()).sum(), refs)
    for name, a, b in zip(("q", "k", "v", "q_far", "k_far"), mine, theirs):
        assert ((a.double() - b).abs().max() / b.abs().max()).item() < 1e-5, name


@pytest.mark.parametrize("far_selection", (FarSelection(2, 16, 1), None), ids=("sparse_far", "every_far_key"))
def test_gradients_reach_v_alone(far_selection):
    """LoRA on v_proj alone: the first layer's q and k come from frozen weights on frozen embeddings
    and do not require grad, v does. The paths without a backward took such calls (they looked at q
    and k alone): the sparse far keys' raised ("functions with out=... arguments don't support
    automatic differentiation")."""
    q, k, v, q_far, k_far = _inputs((4, 2))
    q, k, q_far, k_far = (t.detach() for t in (q, k, q_far, k_far))
    band = None if far_selection is None else 24  # (every far key, no far band: local_band.plain_forward's rows)
    out = dilated_attention(q, k, v, [512], [1], local_window=64, q_far=q_far, k_far=k_far, far_band=band,
                            far_selection=far_selection)
    ref_v = v.detach().clone().requires_grad_()
    ref = local_band_reference(q, k, ref_v, [512], [1], 64, q_far=q_far, k_far=k_far, far_band=band,
                               **({} if far_selection is None else dict(far_top_k=2, far_block_size=16, far_sinks=1)))
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    (mine,) = torch.autograd.grad((out * grad).sum(), (v,))
    (theirs,) = torch.autograd.grad((ref * grad).sum(), (ref_v,))
    assert (out - ref).abs().max().item() < TOL
    assert (mine - theirs).abs().max().item() < TOL


def test_autocast_changes_nothing_in_either_pass(gpu_training_path):
    """Under autocast the backward (run where autocast may be off) must select the forward's blocks
    from operations in the same dtypes: both passes run with autocast off, in the inputs' dtype."""
    leaves = [t.detach().float().requires_grad_() for t in _inputs((4, 2))]
    kernel, _ = sparse(TRAIN_SETTINGS[1])
    runs = []
    for autocast in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = dilated_attention(*leaves[:3], [512], [1], local_window=64, q_far=leaves[3], k_far=leaves[4],
                                    **kernel)
            grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
            runs.append((out, *torch.autograd.grad((out * grad).sum(), leaves)))
    assert type(out.grad_fn).__name__ == "_SparseFarBackward"
    for plain, under_autocast in zip(*runs):
        assert torch.equal(plain, under_autocast)


def test_the_cpu_trains_through_the_masked_calls():
    """FlexAttention has no backward on the CPU: training there keeps local_band's calls."""
    q, k, v, q_far, k_far = _inputs((4, 2))
    kernel, _ = sparse(TRAIN_SETTINGS[1])
    out = dilated_attention(q, k, v, [512], [1], local_window=64, q_far=q_far, k_far=k_far, **kernel)
    assert type(out.grad_fn).__name__ == "_LocalBandBackward"


def test_a_backward_that_fails_to_build_falls_back_to_the_masked_calls(gpu_training_path, monkeypatch):
    """FlexAttention's backward compiles at its first call: where that fails, the step's gradients
    come from the masked calls over the same set (warned once), and later calls take them."""
    def fails(*args):
        raise RuntimeError("no kernel configuration")

    monkeypatch.setattr(sparse_far_train, "_chunk_grads", fails)
    monkeypatch.setattr(sparse_far_train, "_BACKWARD_FAILED", None)
    q, k, v, q_far, k_far = _inputs((4, 2))
    kernel, ref_kw = sparse(TRAIN_SETTINGS[1])
    out = dilated_attention(q, k, v, [512], [1], local_window=64, q_far=q_far, k_far=k_far, **kernel)
    assert type(out.grad_fn).__name__ == "_SparseFarBackward"
    refs = [t.detach().clone().requires_grad_() for t in (q, k, v, q_far, k_far)]
    ref = local_band_reference(*refs[:3], [512], [1], 64, q_far=refs[3], k_far=refs[4], **ref_kw)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    with pytest.warns(RuntimeWarning, match="no kernel configuration"):
        mine = torch.autograd.grad((out * grad).sum(), (q, k, v, q_far, k_far))
    theirs = torch.autograd.grad((ref * grad).sum(), refs)
    for name, a, b in zip(("q", "k", "v", "q_far", "k_far"), mine, theirs):
        assert (a - b).abs().max().item() < TOL, name
    again = dilated_attention(q, k, v, [512], [1], local_window=64, q_far=q_far, k_far=k_far, **kernel)
    assert type(again.grad_fn).__name__ == "_LocalBandBackward"


def test_rows_within_the_window_are_refused_by_name():
    q = torch.randn(1, 2, 40, 8)
    with pytest.raises(ValueError, match="no far key within window 64"):
        sparse_far_train.sparse_far_attention(q, q[:, :1], q[:, :1], q, q[:, :1], 64, None, FarSelection(2, 16, 1),
                                              0.3)


# --- on CUDA: FlexAttention's own backward (compiled), flash's windowed backward ----------------------


# top_k 50: every candidate block chosen (no near tie of bfloat16 bounds decides a block); far bands
# below and at the window (flash's sliding window of 32 and of 64 in the backward)
CUDA_SETTINGS = [(32, 50, 32, 1), (None, 50, 64, 0), (24, 50, 16, 2)]


@pytest.mark.cuda
@pytest.mark.parametrize("setting, layout", [(s, "one_document") for s in CUDA_SETTINGS]
                         + [(CUDA_SETTINGS[2], "packed"), (CUDA_SETTINGS[2], "right_padded")],
                         ids=lambda x: x if isinstance(x, str) else "band{}_k{}_B{}_s{}".format(*x))
def test_cuda_training_path_matches_reference(setting, layout):
    """bfloat16 on CUDA (FlexAttention compiled, with the gradient of its log-sum-exp; flash's
    causal and sliding-window backward) against the float64 reference of the same rounded inputs;
    rows of one document, of three packed (120, 40 and 140 tokens), or right-padded (260 and 50
    real tokens): document by document."""
    q, k, v, q_far, k_far = (t.detach().bfloat16().cuda().requires_grad_() for t in _inputs((4, 2)))
    position_ids = torch.cat([torch.arange(n) for n in (120, 40, 140)])[None].expand(2, -1) \
        if layout == "packed" else None
    mask = None
    if layout == "right_padded":
        mask = torch.ones(2, 300, dtype=torch.long)
        mask[0, 260:], mask[1, 50:] = 0, 0
    kernel, ref_kw = sparse(setting)
    out = dilated_attention(q, k, v, [512], [1], local_window=64, q_far=q_far, k_far=k_far,
                            position_ids=None if position_ids is None else position_ids.cuda(),
                            attention_mask=None if mask is None else mask.cuda(), **kernel)
    assert type(out.grad_fn).__name__ == ("_SparseFarBackward" if layout == "one_document" else "CatBackward0")
    refs = [t.detach().double().cpu().requires_grad_() for t in (q, k, v, q_far, k_far)]
    ref = local_band_reference(*refs[:3], [512], [1], 64, q_far=refs[3], k_far=refs[4], position_ids=position_ids,
                               attention_mask=mask, **ref_kw)
    real = torch.ones(2, 1, 300, 1, dtype=torch.bool) if mask is None else mask.bool()[:, None, :, None]
    ref = ref * real
    out = out * real.cuda()
    assert ((out.double().cpu() - ref).abs().max() / ref.abs().max()).item() < 2e-2
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)) * real
    mine = torch.autograd.grad((out * grad.bfloat16().cuda()).sum(), (q, k, v, q_far, k_far))
    theirs = torch.autograd.grad((ref * grad.bfloat16().double()).sum(), refs)
    for name, a, b in zip(("q", "k", "v", "q_far", "k_far"), mine, theirs):
        assert ((a.double().cpu() - b).abs().max() / b.abs().max()).item() < 5e-2, name


@pytest.mark.cuda
def test_cuda_float32_training_takes_the_masked_calls():
    """Flash takes no float32: its sliding window would not serve the band's backward, which would
    then be one call over every pair (band_backward's bias). The masked calls serve it."""
    q, k, v, q_far, k_far = (t.detach().float().cuda().requires_grad_() for t in _inputs((4, 2)))
    kernel, _ = sparse(CUDA_SETTINGS[0])
    out = dilated_attention(q, k, v, [512], [1], local_window=64, q_far=q_far, k_far=k_far, **kernel)
    assert type(out.grad_fn).__name__ == "_LocalBandBackward"


@pytest.mark.cuda
@pytest.mark.slow
def test_cuda_default_conversion_training_step_at_16k_tokens(training_calls):
    """The default conversion from 4,096 tokens (band 4,096, far band 2,048, sparse far keys) in
    bfloat16, a Llama of 8 query / 2 kv heads of 64: one forward and backward at 16,384 tokens takes
    this path in both layers, with a finite loss and finite gradients."""
    from hf_dilated.bench.gpu_table import _model_entry

    n = 16384
    config = LlamaConfig(hidden_size=512, num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=2,
                         intermediate_size=1024, vocab_size=1024, max_position_embeddings=4096)
    setattr(config, CONFIG_KEY, _model_entry("default", 4096, n))
    torch.manual_seed(0)
    model = LlamaForCausalLM._from_config(config, attn_implementation="dilated", dtype=torch.bfloat16).cuda().train()
    ids = torch.randint(0, 1024, (1, n), generator=torch.Generator().manual_seed(0)).cuda()
    loss = model(ids, labels=ids).loss
    loss.backward()
    torch.cuda.synchronize()
    assert len(training_calls) == 2
    assert torch.isfinite(loss).item()
    assert all(torch.isfinite(p.grad).all().item() for p in model.parameters() if p.grad is not None)


@pytest.mark.parametrize("lengths", ((120, 40, 140), (30, 270), (300,)), ids=("three_docs", "short_then_long",
                                                                             "one_doc_by_positions"))
def test_packed_documents_train_document_by_document(lengths, gpu_training_path, training_calls):
    """Documents packed end to end, each at positions 0, 1, ... (DataCollatorWithFlattening's rows):
    each is a plain row of its own, so a document past the window trains on this path (reading
    nothing back) and a shorter one is causal attention; output and gradients against the
    reference over the packed row."""
    q, k, v, q_far, k_far = (t[:1].detach().requires_grad_() for t in _inputs((4, 2)))
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    kernel, ref_kw = sparse(TRAIN_SETTINGS[1])
    out = dilated_attention(q, k, v, [512], [1], local_window=64, q_far=q_far, k_far=k_far, position_ids=position_ids,
                            **kernel)
    assert training_calls == [n for n in lengths if n > 64]
    refs = [t.detach().clone().requires_grad_() for t in (q, k, v, q_far, k_far)]
    ref = local_band_reference(*refs[:3], [512], [1], 64, q_far=refs[3], k_far=refs[4], position_ids=position_ids,
                               **ref_kw)
    assert (out - ref).abs().max().item() < TOL
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    mine = torch.autograd.grad((out * grad).sum(), (q, k, v, q_far, k_far))
    theirs = torch.autograd.grad((ref * grad).sum(), refs)
    for name, a, b in zip(("q", "k", "v", "q_far", "k_far"), mine, theirs):
        assert (a - b).abs().max().item() < TOL, name


@pytest.mark.parametrize("padding", ("left", "right", "a_row_of_padding"))
def test_padded_rows_train_document_by_document(padding, gpu_training_path, training_calls):
    """Rows whose real tokens are one run beside padding (an SFT batch): the run is a plain row of
    its own (positions are the mask's ranks), so past the window it trains on this path; a shorter
    run is causal attention. Real queries' outputs and every gradient against the reference; a
    padded query slot (docs/contract.md 3.1 leaves it open) gets 0."""
    q, k, v, q_far, k_far = _inputs((4, 2))
    mask = torch.ones(2, 300, dtype=torch.long)
    if padding == "left":
        mask[0, :40], mask[1, :250] = 0, 0
    elif padding == "right":
        mask[0, 260:], mask[1, 50:] = 0, 0
    else:
        mask[0, :40], mask[1] = 0, 0
    kernel, ref_kw = sparse(TRAIN_SETTINGS[1])
    out = dilated_attention(q, k, v, [512], [1], local_window=64, q_far=q_far, k_far=k_far, attention_mask=mask,
                            **kernel)
    assert training_calls == [260]
    real = mask.bool()[:, None, :, None]
    refs = [t.detach().clone().requires_grad_() for t in (q, k, v, q_far, k_far)]
    ref = local_band_reference(*refs[:3], [512], [1], 64, q_far=refs[3], k_far=refs[4], attention_mask=mask,
                               **ref_kw)
    assert ((out - ref) * real).abs().max().item() < TOL
    assert not (out * ~real).any()
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * real
    mine = torch.autograd.grad((out * grad).sum(), (q, k, v, q_far, k_far))
    theirs = torch.autograd.grad((ref * grad).sum(), refs)
    for name, a, b in zip(("q", "k", "v", "q_far", "k_far"), mine, theirs):
        assert (a - b).abs().max().item() < TOL, name
