"""The decode paths (ops/dilated_decode.py, ops/block_sparse_decode.py): a few queries against a
long cache read only the keys they may see. Checked against the independent float64 reference of
tests/reference.py in every layout a decode step meets (no padding, left padding, positions that
do not start at 0, sliding windows, a local band with far projections, GQA in every head/class
arrangement, every mode), and each test asserts which path ran: the strided path where the rows
allow it, the general path (counted as a fallback) where they do not."""
from __future__ import annotations

import itertools

import pytest
import torch

from hf_dilated.ops import block_sparse_attention, dilated_attention
from hf_dilated.ops import block_sparse_decode as bs_decode
from hf_dilated.ops import dilated_decode
from reference import block_sparse_reference, dilated_reference, local_band_reference

F64_TOL = 1e-10
LOW_TOL = 2e-2  # docs/contract.md 8: bfloat16 / float16
N, BATCH, DIM = 75, 3, 8

# (segment_lengths, dilation_rates), all nested (as "union" needs): dilation below, equal to and
# above the GQA group, and one where neither divides the other (the generic head mapping)
LEVELS = [((8,), (1,)), ((8, 16, 32), (1, 2, 4)), ((4, 16, 64), (2, 4, 16)), ((8, 16, 32, 64), (1, 2, 4, 8)),
          ((6, 12), (1, 3))]
HEADS = [(8, 2), (4, 4), (6, 3), (8, 1), (6, 2)]


def _layout(kind: str):
    """(attention_mask, position_ids) of a regular cache: none, left padding (row lengths 75, 70,
    58), left padding with explicit positions, or positions starting at 0, 3 and 40."""
    if kind == "plain":
        return None, None
    mask = torch.ones(BATCH, N, dtype=torch.long)
    mask[1, :5] = 0
    mask[2, :17] = 0
    if kind == "left":
        return mask, None
    if kind == "left_positions":
        return mask, (mask.cumsum(-1) - 1).clamp(min=0)
    return None, torch.arange(N).expand(BATCH, N) + torch.tensor([0, 3, 40])[:, None]


def _qkv(q_heads, kv_heads, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(BATCH, h, N, DIM, generator=g, dtype=dtype) for h in (q_heads, kv_heads, kv_heads))


def _strided_runs(fn):
    before = dilated_decode.COUNTS["strided"]
    out = fn()
    return out, dilated_decode.COUNTS["strided"] - before


CASES = list(itertools.product(LEVELS, ("union", "longnet", "head_groups"), HEADS))


@pytest.fixture(params=["strided", "gathered"])
def step_path(request, monkeypatch):
    """Both ways a step whose rows are alike runs: per part over strided views (the CPU's), and
    one gathered attention (the GPU's, dilated_decode.GATHERED_ON), here on the CPU."""
    monkeypatch.setattr(dilated_decode, "GATHERED_ON", ("cpu", "cuda") if request.param == "gathered" else ())
    return request.param


def test_gathered_plan_sends_its_parts_not_its_keys(monkeypatch):
    """The gathered step's plan (dilated_decode._gather_plan, the GPU's): the host sends a few integers
    per part, the same for a step reading 2,055 keys and one reading 14,237 (union levels from 4,096
    at 16K and 128K, 32/8 heads), and the device spreads them into the columns: each part's slots,
    near parts before far ones, and a bias that keeps each head to its own parts. Built column by
    column on the host, the plan's copy grew with the keys (and its host's work: 0.50 to 0.98 ms a
    step between 5,049 and 14,237 keys on this CPU with its tensor ops on the meta device; 0.46-0.48
    now)."""
    sent = []
    real = torch.frombuffer
    monkeypatch.setattr(torch, "frombuffer", lambda buffer, **kw: sent.append(len(buffer)) or real(buffer, **kw))
    plans = {}
    for n, seg, dil in ((16384, [4096, 8192, 16384, 32768], [1, 2, 4, 8]),
                        (130972, [4096, 8192, 16384, 32768, 65536, 131072, 262144], [1, 2, 4, 8, 16, 32, 64])):
        parts = dilated_decode._parts(n, 0, 0, 32, 8, seg, dil, "union", None, 512)
        plans[n] = parts, dilated_decode._gather_plan([parts], 32, torch.device("cpu"))
    (few, (small, *_)), (many, (large, n_near, bias, keep)) = plans[16384], plans[130972]
    assert small.numel() < 3000 < 14000 < large.numel() and keep is None
    assert sent[0] == 4 * len(few) + len(few) * 32 and sent[1] == 4 * len(many) + len(many) * 32
    ordered = [p for p in many if not p.far] + [p for p in many if p.far]
    assert n_near == sum(p.count for p in many if not p.far) and any(p.far for p in many)
    assert large.tolist() == [p.start + p.step * j for p in ordered for j in range(p.count)]
    column = 0
    for p in ordered:  # bias (heads, 1, keys): 0 for the part's heads on its columns, -inf elsewhere
        heads = set(range(p.h0, p.h0 + (p.n_heads - 1) * p.h_step + 1, p.h_step))
        block = bias[:, 0, column:column + p.count]
        assert all((block[h] == 0).all() if h in heads else (block[h] == float("-inf")).all() for h in range(32))
        column += p.count


@pytest.mark.parametrize("levels,mode,heads", CASES, ids=[f"{l[0]}x{l[1]}-{m}-{h[0]}/{h[1]}" for l, m, h in CASES])
def test_dilated_decode_matches_reference(levels, mode, heads, step_path):
    seg, dil = levels
    q, k, v = _qkv(*heads, seed=sum(seg) + heads[0])
    for kind, q_len, window in itertools.product(("plain", "left", "left_positions", "shifted"), (1, 3), (None, 20)):
        mask, pos = _layout(kind)
        ref = dilated_reference(q, k, v, list(seg), list(dil), mode, attention_mask=mask, position_ids=pos,
                                sliding_window=window)
        out, strided = _strided_runs(lambda: dilated_attention(
            q[:, :, -q_len:], k, v, list(seg), list(dil), mode=mode, attention_mask=mask, position_ids=pos,
            sliding_window=window))
        assert strided == 1, (kind, q_len, window)
        err = (out - ref[:, :, -q_len:]).abs().max().item()
        assert err < F64_TOL, (kind, q_len, window, err)


@pytest.mark.parametrize("far", [False, True], ids=["same_projections", "far_projections"])
def test_local_band_decode_matches_reference(far, step_path):
    for (seg, dil), heads, kind, q_len, band, window in itertools.product(
            LEVELS[:4], HEADS[:3], ("plain", "left", "shifted"), (1, 2), (5, 16), (None, 12)):
        q, k, v = _qkv(*heads, seed=band + q_len)
        q_far, k_far = (torch.randn_like(q), torch.randn_like(k)) if far else (None, None)
        mask, pos = _layout(kind)
        ref = local_band_reference(q, k, v, list(seg), list(dil), band, q_far=q_far, k_far=k_far,
                                   attention_mask=mask, position_ids=pos, sliding_window=window)
        out, strided = _strided_runs(lambda: dilated_attention(
            q[:, :, -q_len:], k, v, list(seg), list(dil), local_window=band,
            q_far=None if q_far is None else q_far[:, :, -q_len:], k_far=k_far,
            attention_mask=mask, position_ids=pos, sliding_window=window))
        assert strided == 1
        err = (out - ref[:, :, -q_len:]).abs().max().item()
        assert err < F64_TOL, (seg, heads, kind, q_len, band, window, err)


def test_irregular_rows_fall_back_and_stay_exact():
    """Holes in the mask, right padding and packed documents are not one run at consecutive
    positions: the general path runs, and is counted."""
    q, k, v = _qkv(8, 2, seed=3)
    seg, dil = [8, 16, 32], [1, 2, 4]
    holes = torch.ones(BATCH, N, dtype=torch.long)
    holes[0, 30:33] = 0
    packed = torch.cat([torch.arange(40), torch.arange(N - 40)]).expand(BATCH, N)
    for mask, pos in ((holes, None), (None, packed)):
        ref = dilated_reference(q, k, v, seg, dil, attention_mask=mask, position_ids=pos)
        before = dict(dilated_decode.COUNTS)
        out = dilated_attention(q[:, :, -2:], k, v, seg, dil, attention_mask=mask, position_ids=pos)
        assert dilated_decode.COUNTS["fallback"] == before["fallback"] + 1
        assert dilated_decode.COUNTS["strided"] == before["strided"]
        assert (out - ref[:, :, -2:]).abs().max().item() < F64_TOL


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dilated_decode_low_precision(dtype, step_path):
    q, k, v = _qkv(8, 2, seed=5)
    seg, dil = [8, 16, 32], [1, 2, 4]
    mask, _ = _layout("left")
    ref = dilated_reference(q, k, v, seg, dil, attention_mask=mask)
    out, strided = _strided_runs(lambda: dilated_attention(
        q[:, :, -1:].to(dtype), k.to(dtype), v.to(dtype), seg, dil, attention_mask=mask))
    assert strided == 1 and out.dtype == dtype
    assert (out.double() - ref[:, :, -1:]).abs().max().item() < LOW_TOL


def test_dilated_decode_gradients_match_reference(step_path):
    """The strided path is plain torch ops: autograd gives the gradients (a decode step under
    training, e.g. a few tokens scored against a cache)."""
    q, k, v = _qkv(8, 2, seed=9)
    seg, dil = [8, 16, 32], [1, 2, 4]
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out, strided = _strided_runs(lambda: dilated_attention(q[:, :, -3:], k, v, seg, dil))
    assert strided == 1
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    ref = dilated_reference(q, k, v, seg, dil)[:, :, -3:]
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for g, r in zip(grads, ref_grads):
        assert (g - r).abs().max().item() < F64_TOL


PATTERNS = [{"type": "local", "window": 2}, {"type": "dilated", "window": 1, "stride": 3},
            {"type": "global_local", "global_blocks": 1, "window": 2},
            {"type": "hierarchical", "levels": [[2, 1], [1, 3]]}]


@pytest.mark.parametrize("pattern", PATTERNS, ids=[p["type"] for p in PATTERNS])
def test_block_sparse_decode_matches_reference(pattern):
    for heads, kind, q_len, window, block in itertools.product(HEADS[:3], ("plain", "left", "shifted"), (1, 3),
                                                               (None, 20), (4, 8)):
        q, k, v = _qkv(*heads, seed=block + q_len)
        mask, pos = _layout(kind)
        _, layout = block_sparse_attention(q, k, v, pattern, block_size=block, attention_mask=mask, position_ids=pos,
                                           sliding_window=window, return_layout=True)
        ref = block_sparse_reference(q, k, v, layout, block, attention_mask=mask, position_ids=pos,
                                     sliding_window=window)
        before = bs_decode.COUNTS["gathered"]
        out = block_sparse_attention(q[:, :, -q_len:], k, v, pattern, block_size=block, attention_mask=mask,
                                     position_ids=pos, sliding_window=window)
        assert bs_decode.COUNTS["gathered"] == before + 1
        err = (out - ref[:, :, -q_len:]).abs().max().item()
        assert err < F64_TOL, (heads, kind, q_len, window, block, err)


def test_block_sparse_decode_custom_layout_and_fallbacks():
    q, k, v = _qkv(8, 2, seed=11)
    shared = torch.rand(1, 10, 10, generator=torch.Generator().manual_seed(1)) > 0.5
    per_head = torch.rand(8, 10, 10, generator=torch.Generator().manual_seed(2)) > 0.5
    holes = torch.ones(BATCH, N, dtype=torch.long)
    holes[1, 20:25] = 0
    for layout, mask, path in ((shared, None, "gathered"), (per_head, None, "fallback"), (shared, holes, "fallback")):
        pattern = {"type": "custom", "layout": layout}
        _, used = block_sparse_attention(q, k, v, pattern, block_size=8, attention_mask=mask, return_layout=True)
        ref = block_sparse_reference(q, k, v, used, 8, attention_mask=mask)
        before = dict(bs_decode.COUNTS)
        out = block_sparse_attention(q[:, :, -2:], k, v, pattern, block_size=8, attention_mask=mask)
        assert bs_decode.COUNTS[path] == before[path] + 1
        assert (out - ref[:, :, -2:]).abs().max().item() < F64_TOL


# ---------------------------------------------------------------------------------------------
# ReservedCache: transformers' DynamicCache behaviour without the copy per step


def _tiny_llama(tmp_path):
    from transformers import AutoModelForCausalLM

    from hf_dilated.convert import convert_checkpoint
    from hf_dilated.model_configs import build_model_config

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(build_model_config("tiny-llama")).save_pretrained(tmp_path / "base")
    return convert_checkpoint(tmp_path / "base", tmp_path / "long", preset="tiny-llama")


def test_reserved_cache_generates_as_dynamic_cache_and_writes_in_place(tmp_path):
    import hf_dilated
    from transformers import AutoModelForCausalLM

    path = _tiny_llama(tmp_path)
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(3, 200, (2, 37), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    common = dict(attention_mask=mask, max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)
    for name in ("sdpa", "dilated", "block_sparse"):
        model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=name).eval()
        with torch.no_grad():
            want = model.generate(ids, **common)
            cache = hf_dilated.ReservedCache(config=model.config)
            got = model.generate(ids, cache=cache, **common)
            beams = model.generate(ids, num_beams=3, **common)
            beams_reserved = model.generate(ids, num_beams=3, cache=hf_dilated.ReservedCache(), **common)
        assert torch.equal(got, want), name
        assert torch.equal(beams_reserved, beams), name  # beam search reorders the cache between steps
        layer = cache.layers[0]
        assert layer.keys.shape[-2] == 37 + 11  # the last token is generated, not cached
        assert layer.keys.data_ptr() == layer._room[0].data_ptr()  # a view of the reserved buffer, not a copy


def test_reserved_cache_goes_on_outside_inference_mode(tmp_path):
    """A ReservedCache filled under torch.inference_mode (its buffer an inference tensor, which no
    write outside inference mode may touch) takes the next tokens outside it, in a new buffer, as a
    DynamicCache does (it raised "Inplace update to inference tensor outside InferenceMode")."""
    import hf_dilated
    from transformers import AutoModelForCausalLM, DynamicCache

    model = AutoModelForCausalLM.from_pretrained(_tiny_llama(tmp_path), attn_implementation="sdpa").eval()
    ids = torch.randint(3, 200, (1, 12), generator=torch.Generator().manual_seed(5))
    logits = []
    for cache in (hf_dilated.ReservedCache(config=model.config), DynamicCache(config=model.config)):
        with torch.inference_mode():
            model(ids[:, :10], past_key_values=cache, use_cache=True)
        with torch.no_grad():
            logits.append(model(ids[:, 10:], past_key_values=cache, use_cache=True).logits)
        assert cache.get_seq_length() == 12
    assert torch.allclose(logits[0], logits[1], atol=1e-6)


def test_reserved_layer_appends_crops_and_reorders():
    from hf_dilated.integrations.cache import ReservedLayer

    layer = ReservedLayer()
    g = torch.Generator().manual_seed(0)
    parts = [torch.randn(2, 3, n, 4, generator=g) for n in (5, 1, 1, 300)]
    want = []
    for p in parts:
        keys, values = layer.update(p, -p)
        want.append(p)
        assert torch.equal(keys, torch.cat(want, 2)) and torch.equal(values, -torch.cat(want, 2))
    first = layer._room[0].data_ptr()
    held = torch.cat(want + [parts[1]], 2)
    layer.update(parts[1], -parts[1])
    assert layer._room[0].data_ptr() == first  # room was left: written in place
    layer.crop(-2)  # a view of the same buffer, shorter: the next tokens overwrite the cropped ones
    keys, values = layer.update(parts[0], -parts[0])
    assert torch.equal(keys, torch.cat([held[..., :-2, :], parts[0]], 2)) and torch.equal(values, -keys)
    before = keys.clone()
    layer.reorder_cache(torch.tensor([1, 0]))  # beam search: rows reordered in place, in the same room
    assert layer.keys.data_ptr() == first and torch.equal(layer.keys, before[[1, 0]])
    assert torch.equal(layer.values, -before[[1, 0]])
    layer.reorder_cache(torch.tensor([1, 0]))
    layer.batch_select_indices(torch.tensor([1]))  # rebinds keys to a new tensor: taken into new room
    keys, values = layer.update(parts[1][1:], -parts[1][1:])
    assert keys.shape == (1, 3, held.shape[2] - 2 + 5 + 1, 4)
    assert torch.equal(keys[..., -1:, :], parts[1][1:]) and torch.equal(values, -keys)


# ---------------------------------------------------------------------------------------------
# The static-shape decode steps (what a compiled step on a static cache runs), against the reference


def _static_cache(x, extra=6):
    """x with `extra` unwritten slots (random values) after its tokens, as a static cache holds them."""
    return torch.cat([x, torch.randn(*x.shape[:2], extra, x.shape[3], dtype=x.dtype)], 2)


@pytest.mark.parametrize("kind", ["plain", "left", "holes"])
def test_static_decode_steps_match_reference(kind):
    from hf_dilated.ops.block_sparse_decode import block_sparse_decode_static
    from hf_dilated.ops.block_patterns import make_pattern
    from hf_dilated.ops.dilated_decode import dilated_decode_static

    mask = torch.ones(BATCH, N, dtype=torch.long)
    if kind == "left":
        mask[1, :5], mask[2, :17] = 0, 0
    if kind == "holes":  # positions are mask ranks: the search over the running count is exact here too
        mask[0, 30:33], mask[2, :4], mask[1, 50] = 0, 0, 0
    real = torch.cat([mask.bool(), torch.zeros(BATCH, 6, dtype=torch.bool)], 1)
    seen = torch.tensor(N)
    keep = mask[:, None, :, None].bool()
    for (seg, dil), mode, heads, q_len, window in itertools.product(
            LEVELS[1:3], ("union", "longnet", "head_groups"), HEADS[:2], (1, 3), (None, 20)):
        q, k, v = _qkv(*heads, seed=q_len + len(seg))
        ref = dilated_reference(q, k, v, list(seg), list(dil), mode, attention_mask=mask, sliding_window=window)
        out = dilated_decode_static(q[:, :, -q_len:], _static_cache(k), _static_cache(v), list(seg), list(dil), mode,
                                    scale=DIM ** -0.5, real=real, seen=seen, sliding_window=window)
        err = ((out - ref[:, :, -q_len:]) * keep[:, :, -q_len:]).abs().max().item()
        assert err < F64_TOL, (seg, mode, heads, q_len, window, err)
    q, k, v = _qkv(8, 2, seed=21)
    q_far, k_far = torch.randn_like(q), torch.randn_like(k)
    ref = local_band_reference(q, k, v, [8, 16, 32], [1, 2, 4], 5, q_far=q_far, k_far=k_far, attention_mask=mask)
    out = dilated_decode_static(q[:, :, -2:], _static_cache(k), _static_cache(v), [8, 16, 32], [1, 2, 4], "union",
                                scale=DIM ** -0.5, real=real, seen=seen, local_window=5, q_far=q_far[:, :, -2:],
                                k_far=_static_cache(k_far))
    assert ((out - ref[:, :, -2:]) * keep[:, :, -2:]).abs().max().item() < F64_TOL
    for pattern in PATTERNS:
        _, layout = block_sparse_attention(q, k, v, pattern, block_size=8, attention_mask=mask, return_layout=True)
        ref = block_sparse_reference(q, k, v, layout, 8, attention_mask=mask)
        out = block_sparse_decode_static(q[:, :, -2:], _static_cache(k), _static_cache(v), make_pattern(pattern),
                                         block_size=8, scale=DIM ** -0.5, real=real, seen=seen)
        assert ((out - ref[:, :, -2:]) * keep[:, :, -2:]).abs().max().item() < F64_TOL, pattern["type"]


class _OpCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the aten ops that are not views (each a kernel launch on a GPU)."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += not func.is_view
        return func(*args, **(kwargs or {}))


def test_decode_step_launches_do_not_grow_with_the_levels(monkeypatch):
    """A decode step whose rows are alike gathers every level's keys into one attention (on a GPU
    a step was host-bound: one small attention and a merge per level), from a plan built once per
    step and shared by the layers: a second layer's call builds none, and two parts or five cost
    the same launches. The results stay the reference's. (On the CPU, run here, the strided
    views are faster: dilated_decode.GATHERED_ON.)"""
    monkeypatch.setattr(dilated_decode, "GATHERED_ON", ("cpu",))
    plans = []
    real = torch.frombuffer
    monkeypatch.setattr(torch, "frombuffer", lambda *a, **kw: plans.append(1) or real(*a, **kw))
    counts = []
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(BATCH, h, 127, DIM, generator=g, dtype=torch.float64) for h in (8, 2, 2))
    q = q[:, :, -1:]  # position 126: every level below 128 reads a part (126 mod w >= w / 2)
    for levels in (((64, 128), (1, 2)), ((8, 16, 32, 64, 128), (1, 2, 4, 8, 16))):  # 2 parts, 5 parts
        for layer in range(2):
            counter = _OpCounter()
            with counter:
                out = dilated_attention(q, k, v, *levels, mode="union")
            counts.append(counter.ops)
        ref = dilated_reference(q, k, v, *levels, mode="union")
        assert (out - ref).abs().max().item() < F64_TOL
    assert len(plans) == 2  # one per step (the first layer's), none for the second layer
    assert counts[1] == counts[3] <= 12, counts


@pytest.mark.cuda
def test_cuda_decode_step_does_not_synchronise():
    """A decode step on CUDA (union levels with a band and far projections, and without) runs under
    torch.cuda's sync debug mode set to error: nothing waits for the device, the step's plan
    copy included (pinned, non-blocking)."""
    g = torch.Generator().manual_seed(0)
    q, q_far = (torch.randn(2, 8, 1, 64, generator=g).cuda() for _ in range(2))
    k, v, k_far = (torch.randn(2, 2, 5000, 64, generator=g).cuda() for _ in range(3))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for kw in ({}, dict(local_window=256, q_far=q_far, k_far=k_far)):
            for _ in range(2):
                dilated_attention(q, k, v, [1024, 2048, 4096, 8192], [1, 2, 4, 8], **kw)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    out = dilated_attention(q, k, v, [1024, 2048, 4096, 8192], [1, 2, 4, 8])
    ref = dilated_reference(*(t.cpu().double() for t in (q, k, v)), [1024, 2048, 4096, 8192], [1, 2, 4, 8])
    assert (out.cpu().double() - ref).abs().max().item() < 1e-4
