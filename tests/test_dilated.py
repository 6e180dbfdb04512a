"""hf_dilated.ops.dilated_attention against the independent float64 reference (tests/reference.py).

Every failure message carries the Case; to reproduce one outside pytest:
    python -c "import sys; sys.path.insert(0, 'tests'); from test_dilated import *; \
               print(compare(Case(...), torch.float32))"
"""
from __future__ import annotations

import random
from dataclasses import dataclass, replace

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from hf_dilated.ops import dilated_attention
from reference import dilated_key_counts, dilated_reference

MODES = ("union", "longnet", "head_groups")
F32_TOL = 1e-4  # docs/contract.md 8: float32 vs float64 reference, forward and gradients
LOW_TOL = 2e-2  # docs/contract.md 8: bfloat16 / float16


@dataclass(frozen=True)
class Case:
    mode: str
    segment_lengths: tuple
    dilation_rates: tuple
    batch: int = 1
    q_heads: int = 2
    kv_heads: int = 1
    kv_len: int = 16
    q_len: int | None = None  # None: q_len == kv_len (prefill)
    head_dim: int = 8
    layout: str = "plain"  # plain | left | right | packed | offset | pad_packed | shared_pos | holes | holes_index
    scale: float | None = None
    seed: int = 0


def make_inputs(case: Case, dtype=torch.float32, device="cpu"):
    """q, k, v (in dtype, leaves), attention_mask, position_ids, real_query (batch, q_len) bool."""
    g = torch.Generator().manual_seed(case.seed)
    rng = random.Random(case.seed)
    n = case.kv_len
    q_len = case.q_len or n
    q = torch.randn(case.batch, case.q_heads, q_len, case.head_dim, generator=g, dtype=torch.float64)
    k = torch.randn(case.batch, case.kv_heads, n, case.head_dim, generator=g, dtype=torch.float64)
    v = torch.randn(case.batch, case.kv_heads, n, case.head_dim, generator=g, dtype=torch.float64)
    mask = pos = None
    if case.layout in ("left", "right", "pad_packed"):
        mask = torch.ones(case.batch, n, dtype=torch.long)
        for b in range(case.batch):
            pad = rng.randint(1 if b == 0 else 0, max(1, n // 3)) if n > 1 else 0
            if case.layout == "right" and b == 0:  # row 0 keeps a real query slot
                pad = min(pad, q_len - 1)
            if pad:
                if case.layout == "right":
                    mask[b, n - pad:] = 0
                else:
                    mask[b, :pad] = 0
    if case.layout in ("packed", "offset", "pad_packed", "shared_pos"):
        rows = 1 if case.layout == "shared_pos" else case.batch
        pos = torch.zeros(rows, n, dtype=torch.long)
        for b in range(rows):
            t = 0
            while t < n:
                length = rng.randint(1, max(1, n // 2))
                start = rng.choice([0, 1, 5, 7]) if case.layout == "offset" else 0
                if t > 0 and start == int(pos[b, t - 1]) + 1:  # would continue the previous document
                    start += 1
                seg = torch.arange(start, start + min(length, n - t))
                pos[b, t:t + len(seg)] = seg
                t += len(seg)
        if mask is not None:  # Hugging Face style: padded slots get position 1
            pos = pos.masked_fill(mask == 0, 1)
    if case.layout in ("holes", "holes_index"):  # padding inside the document; positions are the
        # mask ranks, or the indices (which count the padded slots): one document either way
        mask = torch.ones(case.batch, n, dtype=torch.long)
        for b in range(case.batch):
            mask[b, rng.sample(range(n - 1), max(1, n // 5))] = 0
        if case.layout == "holes_index":
            pos = torch.arange(n).expand(case.batch, n)
    real_query = (mask.bool() if mask is not None else torch.ones(case.batch, n, dtype=torch.bool))[:, n - q_len:]
    q, k, v = (t.to(device=device, dtype=dtype).requires_grad_() for t in (q, k, v))
    if mask is not None:
        mask = mask.to(device)
    if pos is not None:
        pos = pos.to(device)
    return q, k, v, mask, pos, real_query.to(device)


def kernel(case: Case, q, k, v, mask, pos, **kw):
    return dilated_attention(
        q, k, v, list(case.segment_lengths), list(case.dilation_rates), mode=case.mode,
        scale=case.scale, attention_mask=mask, position_ids=pos, **kw,
    )


def compare(case: Case, dtype=torch.float32, grads=True, device="cpu"):
    """Max abs errors {out, dq, dk, dv} of the kernel against the float64 reference evaluated on the
    very same (rounded) inputs. Padded query slots are unspecified: excluded from the output error
    and given zero output-gradient. Also asserts the whole output is finite."""
    q, k, v, mask, pos, real_query = make_inputs(case, dtype, device)
    out = kernel(case, q, k, v, mask, pos)
    assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device, case
    assert torch.isfinite(out).all(), f"non-finite output (padded slots must be finite too): {case}"
    refs = [t.detach().double().cpu().requires_grad_() for t in (q, k, v)]
    ref = dilated_reference(
        *refs, list(case.segment_lengths), list(case.dilation_rates), case.mode, scale=case.scale,
        attention_mask=None if mask is None else mask.cpu(), position_ids=None if pos is None else pos.cpu(),
    )
    rows = real_query.cpu()[:, None, :, None]
    assert real_query.any(), f"no real query slot: the case checks nothing: {case}"
    errors = {"out": ((out.detach().double().cpu() - ref) * rows).abs().max().item()}
    if grads:
        g = torch.Generator().manual_seed(case.seed + 1)
        grad_out = torch.randn(ref.shape, generator=g, dtype=torch.float64) * rows
        out.backward(grad_out.to(device=device, dtype=dtype))
        ref.backward(grad_out)
        for name, t, r in zip(("dq", "dk", "dv"), (q, k, v), refs):
            assert t.grad is not None and torch.isfinite(t.grad).all(), f"{name} missing or non-finite: {case}"
            errors[name] = (t.grad.double().cpu() - r.grad).abs().max().item()
        errors["ref_grad_max"] = max(r.grad.abs().max().item() for r in refs)
    return errors


def assert_within(errors, tol, case, dtype):
    bad = {k: v for k, v in errors.items() if k != "ref_grad_max" and not v < tol}
    assert not bad, f"{dtype} errors above {tol}: {errors}\n  reproduce: compare({case!r}, {dtype})"


# ---------------------------------------------------------------------------------------------
# Configurations


def divisors(x):
    return [d for d in range(1, x + 1) if x % d == 0]


def random_case(seed: int, mode: str, max_len: int = 160, min_len: int = 1) -> Case:
    rng = random.Random(1000 * MODES.index(mode) + seed)
    n_levels = rng.choice([1, 2, 2, 3, 3, 4])
    if mode == "union" or rng.random() < 0.5:  # nested levels (the only ones union accepts)
        w = rng.choice([1, 2, 3, 4, 5, 6, 8])
        r = rng.choice(divisors(w))
        levels = [(w, r)]
        for _ in range(n_levels - 1):
            w = w * rng.choice([1, 2, 2, 3, 4])
            r = rng.choice([d for d in divisors(w) if d % r == 0])
            levels.append((w, r))
    else:  # anything valid: longnet and head_groups accept non-nested levels
        levels = []
        for _ in range(n_levels):
            w = rng.randint(1, 40)
            levels.append((w, rng.choice(divisors(w))))
    kv_heads = rng.choice([1, 1, 2, 3])
    q_heads = kv_heads * rng.choice([1, 2, 3, 4])
    kv_len = rng.randint(min_len, max_len)
    q_len = rng.choice([None, None, 1, min(7, kv_len), rng.randint(1, kv_len)])
    return Case(
        mode=mode,
        segment_lengths=tuple(w for w, _ in levels),
        dilation_rates=tuple(r for _, r in levels),
        batch=rng.choice([1, 2]),
        q_heads=q_heads,
        kv_heads=kv_heads,
        kv_len=kv_len,
        q_len=q_len,
        head_dim=rng.choice([8, 16]),
        layout=rng.choice(["plain", "left", "right", "packed", "offset", "pad_packed"]),
        scale=rng.choice([None, None, 0.3]),
        seed=seed,
    )


SWEEP = [random_case(s, m) for m in MODES for s in range(24)]

# Named configurations for the situations the issue lists, each in every mode.
NAMED = {
    "gqa_kv1_heads_not_div_by_rate": dict(segment_lengths=(4, 8, 16), dilation_rates=(1, 2, 4), q_heads=3, kv_heads=1, kv_len=37),
    "gqa_4_to_2": dict(segment_lengths=(8, 16), dilation_rates=(1, 2), q_heads=4, kv_heads=2, kv_len=45, batch=2),
    "mha": dict(segment_lengths=(6, 12), dilation_rates=(2, 4), q_heads=4, kv_heads=4, kv_len=29),
    "odd_lengths": dict(segment_lengths=(5, 15), dilation_rates=(1, 5), q_heads=5, kv_heads=1, kv_len=53),
    "left_padding": dict(segment_lengths=(4, 8), dilation_rates=(1, 2), q_heads=2, kv_len=33, batch=2, layout="left"),
    "right_padding": dict(segment_lengths=(4, 8), dilation_rates=(1, 2), q_heads=2, kv_len=33, batch=2, layout="right"),
    "packed_docs": dict(segment_lengths=(4, 8, 16), dilation_rates=(1, 2, 4), q_heads=4, kv_heads=2, kv_len=61, batch=2, layout="packed"),
    "docs_off_segment_boundary": dict(segment_lengths=(4, 8), dilation_rates=(1, 2), q_heads=2, kv_len=40, batch=2, layout="offset"),
    "padding_and_packing": dict(segment_lengths=(4, 8), dilation_rates=(2, 4), q_heads=4, kv_heads=2, kv_len=41, batch=2, layout="pad_packed"),
    "position_ids_shared_by_batch": dict(segment_lengths=(4, 8), dilation_rates=(1, 2), q_heads=2, kv_len=30, batch=2, layout="shared_pos"),
    "holes_mask_ranks": dict(segment_lengths=(4, 8, 16), dilation_rates=(1, 2, 4), q_heads=4, kv_heads=2, kv_len=45, batch=2, layout="holes"),
    "holes_index_positions": dict(segment_lengths=(4, 8, 16), dilation_rates=(1, 2, 4), q_heads=4, kv_heads=2, kv_len=45, batch=2, layout="holes_index"),
    "decode_q1": dict(segment_lengths=(4, 8, 16), dilation_rates=(1, 2, 4), q_heads=4, kv_heads=2, kv_len=50, q_len=1),
    "decode_q1_padded": dict(segment_lengths=(4, 8), dilation_rates=(1, 2), q_heads=2, kv_len=23, q_len=1, batch=2, layout="left"),
    "chunked_q7": dict(segment_lengths=(4, 8, 16), dilation_rates=(1, 2, 4), q_heads=2, kv_len=50, q_len=7, layout="packed"),
    "rate_exceeds_heads": dict(segment_lengths=(8, 16), dilation_rates=(4, 8), q_heads=2, kv_heads=1, kv_len=40),
    "rate_exceeds_heads_gqa": dict(segment_lengths=(16, 32), dilation_rates=(8, 16), q_heads=4, kv_heads=2, kv_len=70, layout="right", batch=2),
    "union_rate_not_dividing_lower_segment": dict(segment_lengths=(4, 8), dilation_rates=(1, 8), q_heads=8, kv_heads=2, kv_len=35),
    "union_rate_not_dividing_lower_segment_2": dict(segment_lengths=(2, 4, 16), dilation_rates=(1, 4, 16), q_heads=4, kv_heads=1, kv_len=41),
    "equal_segments": dict(segment_lengths=(8, 8), dilation_rates=(1, 2), q_heads=2, kv_len=19),
    "segment_of_one": dict(segment_lengths=(1, 4), dilation_rates=(1, 2), q_heads=2, kv_len=11),
    "single_token": dict(segment_lengths=(4, 8), dilation_rates=(1, 2), q_heads=2, kv_len=1),
    "segment_longer_than_sequence": dict(segment_lengths=(64, 128), dilation_rates=(1, 2), q_heads=2, kv_len=50),
    "nondefault_scale": dict(segment_lengths=(4, 8), dilation_rates=(1, 2), q_heads=2, kv_len=20, scale=0.55),
    # Whole segments, no padding, one document per row: the strided fast path (_forward_plain).
    "whole_segments_mha_batch2": dict(segment_lengths=(8, 16, 32), dilation_rates=(1, 2, 4), q_heads=4, kv_heads=4, kv_len=64, batch=2),
    "whole_segments_gqa_heads_permuted": dict(segment_lengths=(8, 16, 32), dilation_rates=(1, 2, 4), q_heads=8, kv_heads=2, kv_len=64, batch=2),
    "whole_segments_rate_not_dividing_lower_segment": dict(segment_lengths=(4, 8), dilation_rates=(1, 8), q_heads=8, kv_heads=2, kv_len=32, batch=2),
    "whole_segments_rate_exceeds_heads": dict(segment_lengths=(8, 16, 32), dilation_rates=(1, 2, 8), q_heads=4, kv_heads=2, kv_len=96, batch=2),
    "head_dim_16_longer": dict(segment_lengths=(16, 32, 64), dilation_rates=(1, 2, 4), q_heads=4, kv_heads=2, kv_len=200, head_dim=16),
}
NAMED_CASES = [
    pytest.param(Case(mode=m, seed=i, **kw), id=f"{m}-{name}")
    for i, (name, kw) in enumerate(NAMED.items()) for m in MODES
]


# ---------------------------------------------------------------------------------------------
# Forward and gradients in float32


@pytest.mark.parametrize("case", NAMED_CASES)
def test_named_float32(case):
    assert_within(compare(case, torch.float32), F32_TOL, case, torch.float32)


@pytest.mark.parametrize("case", SWEEP, ids=[f"{c.mode}-{c.seed}" for c in SWEEP])
def test_sweep_float32(case):
    assert_within(compare(case, torch.float32), F32_TOL, case, torch.float32)


def test_longnet_accepts_non_nested_levels():
    # Non-nested levels are a union-only error; the other modes accept any valid configuration.
    for mode in ("longnet", "head_groups"):
        case = Case(mode=mode, segment_lengths=(6, 4, 10), dilation_rates=(3, 2, 5), q_heads=6, kv_heads=2, kv_len=31)
        assert_within(compare(case, torch.float32), F32_TOL, case, torch.float32)


WHOLE_SEGMENTS = [name for name in NAMED if name.startswith("whole_segments")]


@pytest.mark.parametrize("name", WHOLE_SEGMENTS)
def test_whole_segments_take_the_strided_path(monkeypatch, name):
    """The whole-segment cases above do exercise the strided accumulators (union and longnet;
    head_groups' first level covers only some heads, so it keeps the indexed path)."""
    from hf_dilated.ops import dilated as dilated_module

    taken = []
    forward, backward = dilated_module._forward_plain, dilated_module._backward_plain
    monkeypatch.setattr(dilated_module, "_forward_plain", lambda *a: taken.append("forward") or forward(*a))
    monkeypatch.setattr(dilated_module, "_backward_plain", lambda *a: taken.append("backward") or backward(*a))
    for mode in ("union", "longnet"):
        case = Case(mode=mode, seed=9, **NAMED[name])
        assert_within(compare(case, torch.float32), F32_TOL, case, torch.float32)
    assert taken == ["forward", "backward"] * 2


# ---------------------------------------------------------------------------------------------
# Low precision

LOW_CASES = [random_case(s, m, max_len=96, min_len=8) for m in MODES for s in range(100, 104)] + [
    Case(mode=m, seed=7, **NAMED[name]) for m in MODES
    for name in ("packed_docs", "left_padding", "decode_q1", "whole_segments_mha_batch2", "whole_segments_rate_exceeds_heads")
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", LOW_CASES, ids=[f"{c.mode}-{c.seed}-{c.layout}" for c in LOW_CASES])
def test_low_precision_forward(case, dtype):
    assert_within(compare(case, dtype, grads=False), LOW_TOL, case, dtype)


BF16_GRAD_CASES = [random_case(s, m, max_len=40, min_len=16) for m in MODES for s in range(200, 203)] + [
    Case(mode=m, seed=8, **NAMED[name]) for m in MODES for name in ("whole_segments_mha_batch2", "whole_segments_gqa_heads_permuted")
]


@pytest.mark.parametrize("case", BF16_GRAD_CASES, ids=[f"{c.mode}-{c.seed}" for c in BF16_GRAD_CASES])
def test_bf16_gradients_small(case):
    errors = compare(case, torch.bfloat16)
    # gradients of k and v sum over many queries: the tolerance is 2e-2 relative to their scale
    tol = LOW_TOL * max(1.0, errors["ref_grad_max"])
    assert_within(errors, tol, case, torch.bfloat16)


# ---------------------------------------------------------------------------------------------
# gradcheck in float64


GRADCHECK_CASES = [
    Case(mode=m, segment_lengths=(2, 4), dilation_rates=(1, 2), q_heads=2, kv_heads=1, kv_len=6, head_dim=2, seed=3)
    for m in MODES
] + [
    Case(mode=m, segment_lengths=(2, 4), dilation_rates=(1, 2), q_heads=3, kv_heads=1, kv_len=10, q_len=4,
         head_dim=4, batch=2, layout="pad_packed", seed=4)
    for m in MODES
] + [
    Case(mode="longnet", segment_lengths=(3, 5), dilation_rates=(1, 5), q_heads=2, kv_heads=2, kv_len=8, head_dim=4, seed=5),
]


@pytest.mark.parametrize("case", GRADCHECK_CASES, ids=[f"{c.mode}-{c.layout}-{c.seed}" for c in GRADCHECK_CASES])
def test_gradcheck_float64(case):
    # Full Jacobians on the smallest cases; the larger ones use gradcheck's fast mode (random
    # projections of the Jacobian) to keep the kernel-call count down.
    fast = case.kv_len > 6
    q, k, v, mask, pos, real_query = make_inputs(case, torch.float64)
    rows = real_query[:, None, :, None].expand(case.batch, case.q_heads, q.shape[2], case.head_dim)

    def fn(q, k, v):  # padded query slots are unspecified: check real rows only
        return kernel(case, q, k, v, mask, pos)[rows]

    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-6, atol=1e-6, rtol=1e-4, fast_mode=fast)


# ---------------------------------------------------------------------------------------------
# Union is dense causal attention while a document fits in its first segment


@pytest.mark.parametrize("levels", [((64,), (1,)), ((32, 64), (1, 2)), ((40, 80, 160), (1, 4, 8))])
def test_union_equals_sdpa_within_first_segment(levels):
    seg, dil = levels
    g = torch.Generator().manual_seed(11)
    n = 32
    q = torch.randn(2, 6, n, 16, generator=g)
    k = torch.randn(2, 2, n, 16, generator=g)
    v = torch.randn(2, 2, n, 16, generator=g)
    out = dilated_attention(q, k, v, list(seg), list(dil))
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
    # decode: the last 5 queries against the whole cache (bottom-right aligned causal mask)
    out = dilated_attention(q[:, :, -5:], k, v, list(seg), list(dil))
    mask = torch.ones(5, n, dtype=torch.bool).tril(diagonal=n - 5)
    expected = F.scaled_dot_product_attention(q[:, :, -5:], k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)


def test_union_equals_sdpa_for_packed_documents_each_within_first_segment():
    g = torch.Generator().manual_seed(12)
    lengths = [9, 16, 3, 12]  # each document <= w_1 = 16, positions restart at 0
    n = sum(lengths)
    pos = torch.cat([torch.arange(L) for L in lengths])[None].expand(2, n)
    q, k, v = (torch.randn(2, 2, n, 8, generator=g) for _ in range(3))
    out = dilated_attention(q, k, v, [16, 32], [1, 2], position_ids=pos)
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    mask = (doc[:, None] == doc[None, :]) & torch.ones(n, n, dtype=torch.bool).tril()
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------------------
# Prefix consistency and decode


PREFIX_CASES = [
    Case(mode=m, segment_lengths=(4, 8, 16), dilation_rates=(1, 2, 4), q_heads=4, kv_heads=2, kv_len=45,
         layout=layout, batch=2, seed=21)
    for m in MODES for layout in ("plain", "packed", "right")
]


@pytest.mark.parametrize("case", PREFIX_CASES, ids=[f"{c.mode}-{c.layout}" for c in PREFIX_CASES])
def test_prefix_consistency_and_decode(case):
    q, k, v, mask, pos, real_query = make_inputs(case, torch.float32)
    q, k, v = q.detach(), k.detach(), v.detach()
    n = case.kv_len
    full = kernel(case, q, k, v, mask, pos)
    rows = real_query[:, None, :, None]

    def cut(t, m):
        return None if t is None else t[:, :m]

    for m in (1, 7, 16, 17, 30, 44):  # appending tokens never changes earlier outputs
        prefix = kernel(case, q[:, :, :m], k[:, :, :m], v[:, :, :m], cut(mask, m), cut(pos, m))
        err = ((prefix - full[:, :, :m]) * rows[:, :, :m]).abs().max().item()
        assert err < 1e-5, f"prefix {m}: max err {err}: {case}"
    for t in range(n - 6, n):  # KV-cache decode step == last row of full recomputation
        step = kernel(case, q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1], cut(mask, t + 1), cut(pos, t + 1))
        err = ((step - full[:, :, t:t + 1]) * rows[:, :, t:t + 1]).abs().max().item()
        assert err < 1e-5, f"decode step {t}: max err {err}: {case}"
    for lo in (0, 7, 21):  # chunked prefill: 7 queries against the cache so far
        hi = lo + 7
        chunk = kernel(case, q[:, :, lo:hi], k[:, :, :hi], v[:, :, :hi], cut(mask, hi), cut(pos, hi))
        err = ((chunk - full[:, :, lo:hi]) * rows[:, :, lo:hi]).abs().max().item()
        assert err < 1e-5, f"chunk {lo}:{hi}: max err {err}: {case}"


HOLE_CHUNK_LEVELS = [((64,), (1,)), ((32, 64), (1, 2)), ((8, 16, 32), (1, 2, 4))]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("levels", HOLE_CHUNK_LEVELS, ids=lambda lv: "x".join(map(str, lv[0])))
@pytest.mark.parametrize("positions", ["mask_only", "indices"])
def test_chunked_prefill_with_holes_matches_reference(mode, levels, positions):
    """Chunks of every length (q_len from 1 to kv_len) against a cache whose mask has holes
    anywhere: a key of the queries' segment can lie more than w - 1 indices back, since holes
    count as indices but not as positions. Planning by index lost those keys (a silent wrong
    result for chunks that straddle a segment boundary)."""
    seg, dil = levels
    n = 105
    g = torch.Generator().manual_seed(7)
    mask = (torch.rand(2, n, generator=g) > 0.25).long()
    mask[:, 0] = mask[:, -1] = 1
    # positions from the mask (its ranks, what generate passes) or the indices (counting the holes)
    pos = None if positions == "mask_only" else torch.arange(n).expand(2, n)
    q = torch.randn(2, 4, n, 16, generator=g, dtype=torch.float64)
    k = torch.randn(2, 2, n, 16, generator=g, dtype=torch.float64)  # GQA: 4 query / 2 kv heads
    v = torch.randn(2, 2, n, 16, generator=g, dtype=torch.float64)
    ref = dilated_reference(q, k, v, list(seg), list(dil), mode, attention_mask=mask, position_ids=pos)
    real = mask.bool()[:, None, :, None]
    q32, k32, v32 = q.float(), k.float(), v.float()
    for q_len in range(1, n + 1):
        out = dilated_attention(q32[:, :, -q_len:], k32, v32, list(seg), list(dil), mode=mode,
                                attention_mask=mask, position_ids=pos)
        err = ((out.double() - ref[:, :, -q_len:]) * real[:, :, -q_len:]).abs().max().item()
        assert err < F32_TOL, f"q_len {q_len}: max err {err} ({mode}, {seg} x {dil}, {positions})"


# ---------------------------------------------------------------------------------------------
# Empty key sets and padded slots


EMPTY_CASES = [
    Case(mode="head_groups", segment_lengths=(4, 8), dilation_rates=(1, 2), q_heads=2, kv_len=20, seed=31),
    Case(mode="union", segment_lengths=(4,), dilation_rates=(2,), q_heads=1, kv_len=20, seed=32),
    Case(mode="union", segment_lengths=(8, 16), dilation_rates=(4, 8), q_heads=2, kv_len=33, seed=33),
    Case(mode="longnet", segment_lengths=(8, 16), dilation_rates=(4, 8), q_heads=2, kv_heads=2, kv_len=33, seed=34),
    Case(mode="head_groups", segment_lengths=(4, 8, 16), dilation_rates=(1, 2, 4), q_heads=2, kv_len=25, seed=35),
    Case(mode="longnet", segment_lengths=(4,), dilation_rates=(4,), q_heads=3, kv_heads=1, kv_len=26, q_len=9,
         batch=2, layout="left", seed=36),
]


@pytest.mark.parametrize("case", EMPTY_CASES, ids=[f"{c.mode}-{c.seed}" for c in EMPTY_CASES])
def test_empty_key_set_gives_zero_output_and_zero_gradient(case):
    q, k, v, mask, pos, real_query = make_inputs(case, torch.float32)
    counts = dilated_key_counts(
        list(case.segment_lengths), list(case.dilation_rates), case.mode, case.q_heads, case.batch, q.shape[2],
        case.kv_len, attention_mask=mask, position_ids=pos,
    )
    empty = (counts.sum(-1) == 0) & real_query[:, None, :]
    assert empty.any() and not empty.all()  # the case exercises both kinds of row
    out = kernel(case, q, k, v, mask, pos)
    assert torch.isfinite(out).all()
    assert torch.all(out[empty] == 0), f"max |out| on empty rows {out[empty].abs().max().item()}"
    out.sum().backward()  # nonzero output-gradient on every row, empty ones included
    for name, t in (("q", q), ("k", k), ("v", v)):
        assert torch.isfinite(t.grad).all(), f"d{name} has non-finite values"
    assert torch.all(q.grad[empty] == 0), f"max |dq| on empty rows {q.grad[empty].abs().max().item()}"
    assert_within(compare(case, torch.float32), F32_TOL, case, torch.float32)


def test_padded_query_slots_are_finite_in_every_dtype():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for mode in MODES:
            case = Case(mode=mode, segment_lengths=(4, 8), dilation_rates=(1, 2), q_heads=2, kv_len=24,
                        batch=2, layout="left", seed=41)
            q, k, v, mask, pos, _ = make_inputs(case, dtype)
            mask[1, :] = 0  # a row with no real token at all
            mask[1, -1] = 1
            out = kernel(case, q, k, v, mask, pos)
            out.float().sum().backward()
            for t in (out, q.grad, k.grad, v.grad):
                assert torch.isfinite(t).all(), (mode, dtype)


# ---------------------------------------------------------------------------------------------
# Arguments the kernel may or may not support must never be silently ignored


def test_non_causal_matches_reference_or_is_refused():
    case = Case(mode="union", segment_lengths=(4, 8), dilation_rates=(1, 2), q_heads=2, kv_len=20, layout="packed")
    q, k, v, mask, pos, _ = make_inputs(case, torch.float32)
    try:
        out = kernel(case, q, k, v, mask, pos, is_causal=False)
    except ValueError as err:
        assert "is_causal" in str(err)
        return
    refs = [t.detach().double() for t in (q, k, v)]
    for mode in MODES:
        out = kernel(replace(case, mode=mode), q, k, v, mask, pos, is_causal=False)
        ref = dilated_reference(*refs, [4, 8], [1, 2], mode, position_ids=pos, is_causal=False)
        assert (out.double() - ref).abs().max().item() < F32_TOL, mode


@pytest.mark.parametrize("mode", MODES)
def test_dropout_is_applied_or_refused(mode):
    case = Case(mode=mode, segment_lengths=(4, 8), dilation_rates=(1, 2), q_heads=2, kv_len=20, layout="left",
                batch=2, seed=51)
    q, k, v, mask, pos, real_query = make_inputs(case, torch.float32)
    p = 0.5
    torch.manual_seed(0)
    try:
        dropped = kernel(case, q, k, v, mask, pos, dropout_p=p)
    except ValueError as err:
        assert "dropout_p" in str(err)
        return
    plain = kernel(case, q, k, v, mask, pos).detach()
    rows = real_query[:, None, :, None]
    assert torch.isfinite(dropped).all()
    assert ((dropped - plain) * rows).abs().max().item() > 1e-3  # dropout_p is not silently ignored
    dropped.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    # Dropout acts on the attention probabilities: a query whose K is the single key j gets
    # v_j / (1 - p) or 0. Head 0 at the first real token (level 1 has r=1) is such a query.
    counts = dilated_key_counts([4, 8], [1, 2], mode, 2, 2, case.kv_len, case.kv_len, attention_mask=mask)
    single = (counts.sum(-1) == 1) & real_query[:, None, :]
    assert single.any()
    draws = torch.stack([kernel(case, q, k, v, mask, pos, dropout_p=p).detach() for _ in range(100)])
    kept = torch.isclose(draws[:, single], plain[single] / (1 - p), atol=1e-5).all(-1)
    dropped_out = (draws[:, single] == 0).all(-1)
    assert (kept | dropped_out).all()
    assert 0.3 < kept.float().mean().item() < 0.7
    # Unbiased: the mean over draws approaches the output without dropout.
    mean, std = draws.mean(0), draws.std(0)
    err = ((mean - plain).abs() - 5 * std / 100 ** 0.5) * rows
    assert err.max().item() < 1e-4


# ---------------------------------------------------------------------------------------------
# Inputs as Hugging Face hands them over, and the kernel's plan cache


def test_non_contiguous_inputs():
    # Hugging Face passes q/k/v as transposes of (batch, seq, heads, head_dim) projections.
    case = Case(mode="union", segment_lengths=(4, 8, 16), dilation_rates=(1, 2, 4), q_heads=4, kv_heads=2,
                kv_len=37, batch=2, layout="pad_packed", seed=61)
    _, _, _, mask, pos, real_query = make_inputs(case)
    g = torch.Generator().manual_seed(61)
    for mode in MODES:
        base = [torch.randn(2, 37, h, 16, generator=g) for h in (4, 2, 2)]
        leaves = [t.requires_grad_() for t in base]
        # transposed, and sliced in head_dim (a strided last dimension for q)
        views = [leaves[0].transpose(1, 2)[..., ::2], leaves[1].transpose(1, 2)[..., :8],
                 leaves[2].transpose(1, 2)[..., 8:]]
        assert not any(t.is_contiguous() for t in views)
        out = dilated_attention(*views, [4, 8, 16], [1, 2, 4], mode=mode, attention_mask=mask, position_ids=pos)
        refs = [t.detach().double().requires_grad_() for t in views]
        ref = dilated_reference(*refs, [4, 8, 16], [1, 2, 4], mode, attention_mask=mask, position_ids=pos)
        rows = real_query[:, None, :, None]
        assert ((out.double() - ref) * rows).abs().max().item() < F32_TOL, mode
        grad_out = torch.randn(ref.shape, generator=g, dtype=torch.float64) * rows
        out.backward(grad_out.float())
        ref.backward(grad_out)
        for view_grad, r in zip(
            [leaves[0].grad.transpose(1, 2)[..., ::2], leaves[1].grad.transpose(1, 2)[..., :8],
             leaves[2].grad.transpose(1, 2)[..., 8:]], refs,
        ):
            assert (view_grad.double() - r.grad).abs().max().item() < F32_TOL, mode


def test_bool_and_integer_masks_agree():
    case = Case(mode="longnet", segment_lengths=(4, 8), dilation_rates=(1, 2), q_heads=2, kv_len=25, batch=2,
                layout="left", seed=62)
    q, k, v, mask, pos, real_query = make_inputs(case)
    a = kernel(case, q, k, v, mask.long(), pos)
    b = kernel(case, q, k, v, mask.bool(), pos)
    c = kernel(case, q, k, v, mask.int(), pos)
    rows = real_query[:, None, :, None]
    assert torch.equal(a * rows, b * rows) and torch.equal(a * rows, c * rows)


@pytest.mark.parametrize("pad", [0, 3])
@pytest.mark.parametrize("mode", MODES)
def test_mask_of_batch_one_broadcasts(mode, pad):
    # The argument checks accept a (1, kv_len) mask for any batch: it must mean the same mask
    # for every row, exactly as the expanded (batch, kv_len) mask.
    case = Case(mode=mode, segment_lengths=(4, 8), dilation_rates=(1, 2), q_heads=2, kv_len=16, batch=2, seed=65)
    q, k, v, _, _, _ = make_inputs(case)
    mask = torch.ones(1, 16, dtype=torch.long)
    mask[0, :pad] = 0
    ref = dilated_reference(*(t.detach().double() for t in (q, k, v)), [4, 8], [1, 2], mode, attention_mask=mask)
    out = kernel(case, q, k, v, mask, None)
    assert (out.double() - ref)[:, :, pad:].abs().max().item() < F32_TOL


def test_inference_mode():
    # Pipelines and servers run under torch.inference_mode(): masks built there are inference
    # tensors (no version counter).
    case = Case(mode="union", segment_lengths=(4, 8), dilation_rates=(1, 2), q_heads=2, kv_len=20, batch=2,
                layout="pad_packed", seed=63)
    q, k, v, mask, pos, real_query = make_inputs(case)
    expected = kernel(case, q, k, v, mask, pos).detach()
    with torch.inference_mode():
        q_i, k_i, v_i, mask_i, pos_i = (t.detach().clone() for t in (q, k, v, mask, pos))
        out = kernel(case, q_i, k_i, v_i, mask_i, pos_i)
        again = kernel(case, q_i, k_i, v_i, mask_i, pos_i)
    rows = real_query[:, None, :, None]
    assert torch.equal(out * rows, expected * rows) and torch.equal(again * rows, expected * rows)


def test_result_follows_mask_and_position_contents():
    # Plans may be cached, but a mask or position tensor changed in place, or a new tensor with
    # other contents, must give the result for the new contents.
    case = Case(mode="union", segment_lengths=(4, 8), dilation_rates=(1, 2), q_heads=2, kv_len=20, seed=64)
    q, k, v, _, _, _ = make_inputs(case)
    q, k, v = q.detach(), k.detach(), v.detach()
    refs = [t.double() for t in (q, k, v)]
    mask = torch.ones(1, 20, dtype=torch.long)
    pos = torch.arange(20)[None].clone()
    for step in range(4):
        out = kernel(case, q, k, v, mask, pos)
        ref = dilated_reference(*refs, [4, 8], [1, 2], attention_mask=mask, position_ids=pos)
        rows = mask.bool()[:, None, :, None]
        assert ((out.double() - ref) * rows).abs().max().item() < F32_TOL, step
        mask[0, step] = 0  # in place
        pos[0, 10:] = torch.arange(10) + step  # in place: a second document
    for start in range(3):  # fresh tensors, same shapes
        pos = torch.cat([torch.arange(start, start + 7), torch.arange(13)])[None]
        out = kernel(case, q, k, v, None, pos)
        ref = dilated_reference(*refs, [4, 8], [1, 2], position_ids=pos)
        assert (out.double() - ref).abs().max().item() < F32_TOL, start


# ---------------------------------------------------------------------------------------------
# Errors: raised before any attention computation, naming the argument


class AttentionSpy(TorchDispatchMode):
    """Records every aten op that computes attention or a matrix product."""

    HEAVY = ("scaled_dot_product", "bmm", "mm.", "matmul", "einsum", "softmax", "baddbmm", "addmm")

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if any(h in name for h in self.HEAVY):
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


def _good():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 16, 8, generator=g)
    k = torch.randn(1, 2, 16, 8, generator=g)
    v = torch.randn(1, 2, 16, 8, generator=g)
    return q, k, v


def _call(q=None, k=None, v=None, seg=(4, 8), dil=(1, 2), **kw):
    gq, gk, gv = _good()
    return dilated_attention(
        gq if q is None else q, gk if k is None else k, gv if v is None else v, list(seg) if isinstance(seg, tuple) else seg,
        list(dil) if isinstance(dil, tuple) else dil, **kw,
    )


ERROR_CASES = {
    "lengths_differ": (ValueError, "segment_lengths|dilation_rates", dict(seg=(4, 8), dil=(1,))),
    "rate_not_dividing_segment": (ValueError, "dilation_rates", dict(seg=(6,), dil=(4,))),
    "rate_not_dividing_segment_longnet": (ValueError, "dilation_rates", dict(seg=(4, 6), dil=(1, 4), mode="longnet")),
    "zero_segment": (ValueError, "segment_lengths", dict(seg=(0, 8), dil=(1, 2))),
    "negative_segment": (ValueError, "segment_lengths", dict(seg=(-4,), dil=(1,))),
    "zero_rate": (ValueError, "dilation_rates", dict(seg=(4,), dil=(0,))),
    "negative_rate": (ValueError, "dilation_rates", dict(seg=(4, 8), dil=(1, -2))),
    "empty_levels": (ValueError, "segment_lengths", dict(seg=[], dil=[])),
    "non_int_segment": ((TypeError, ValueError), "segment_lengths", dict(seg=(4.0,), dil=(1,))),
    "union_segments_not_nested": (ValueError, "segment_lengths", dict(seg=(4, 6), dil=(1, 2))),
    "union_rates_not_nested": (ValueError, "dilation_rates", dict(seg=(4, 12), dil=(2, 3))),
    "union_not_nested_explicit_mode": (ValueError, "segment_lengths", dict(seg=(8, 4), dil=(1, 1), mode="union")),
    "unknown_mode": (ValueError, "mode", dict(mode="dense")),
    "q_heads_not_multiple_of_kv_heads": (ValueError, "q_heads|kv_heads", dict(q=torch.randn(1, 3, 16, 8))),
    "q_len_exceeds_kv_len": (ValueError, "q_len|kv_len", dict(q=torch.randn(1, 4, 17, 8))),
    "dtype_mismatch": (ValueError, "dtype", dict(k=torch.randn(1, 2, 16, 8, dtype=torch.float64))),
    "dtype_mismatch_v_half": (ValueError, "dtype", dict(v=torch.randn(1, 2, 16, 8).half())),
    "integer_inputs": (TypeError, r"\bq\b", dict(q=torch.ones(1, 4, 16, 8, dtype=torch.long))),
    "device_mismatch": (ValueError, "device", dict(k=torch.randn(1, 2, 16, 8, device="meta"))),
    "mask_device_mismatch": (ValueError, "attention_mask", dict(attention_mask=torch.ones(1, 16, device="meta"))),
    "mask_wrong_length": (ValueError, "attention_mask", dict(attention_mask=torch.ones(1, 15))),
    "mask_wrong_rank": (ValueError, "attention_mask", dict(attention_mask=torch.ones(1, 1, 16, 16))),
    "mask_wrong_batch": (ValueError, "attention_mask", dict(attention_mask=torch.ones(3, 16))),
    "position_ids_wrong_shape": (ValueError, "position_ids", dict(position_ids=torch.arange(16))),
    "position_ids_float": (TypeError, "position_ids", dict(position_ids=torch.arange(16.0)[None])),
    "q_not_4d": (ValueError, r"\bq\b", dict(q=torch.randn(4, 16, 8))),
    "k_v_shape_mismatch": (ValueError, r"\bk\b|\bv\b", dict(v=torch.randn(1, 2, 15, 8))),
    "head_dim_mismatch": (ValueError, "head_dim", dict(k=torch.randn(1, 2, 16, 4), v=torch.randn(1, 2, 16, 4))),
    "bad_scale": (ValueError, "scale", dict(scale=-1.0)),
    "bad_dropout": (ValueError, "dropout_p", dict(dropout_p=1.5)),
}


@pytest.mark.parametrize("name", list(ERROR_CASES))
def test_bad_input_raises_before_computing(name):
    exc, pattern, kw = ERROR_CASES[name]
    spy = AttentionSpy()
    with spy, pytest.raises(exc, match=pattern):
        _call(**kw)
    assert not spy.calls, f"computed before raising: {spy.calls[:5]}"


def test_spy_sees_a_real_call():
    # guards the check above: a valid call does go through ops the spy records
    spy = AttentionSpy()
    with spy:
        _call()
    assert spy.calls


# ---------------------------------------------------------------------------------------------
# CUDA: the same checks on the GPU backend


CUDA_CASES = SWEEP[::6] + [Case(mode=m, seed=i, **NAMED[n]) for i, n in enumerate(NAMED) for m in MODES][::4]


@pytest.mark.cuda
@pytest.mark.parametrize("case", CUDA_CASES, ids=[f"{c.mode}-{c.seed}-{c.layout}" for c in CUDA_CASES])
def test_cuda_matches_reference(case):
    assert_within(compare(case, torch.float32, device="cuda"), F32_TOL, case, torch.float32)
    assert_within(compare(case, torch.bfloat16, grads=False, device="cuda"), LOW_TOL, case, torch.bfloat16)
    assert_within(compare(case, torch.float16, grads=False, device="cuda"), LOW_TOL, case, torch.float16)


class OpNames(TorchDispatchMode):
    """The names of the aten ops dispatched."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("acc_finite", (False, True))
def test_merge_into_is_the_log_sum_exp_rule(acc_finite):
    """ops/merge.py's merge_into against its rule in float64: lse = log(e^a + e^b), out = out_a e^(a -
    lse) + out_b e^(b - lse); a part with lse -inf adds nothing, and two such parts give (out_a,
    -inf) with no NaN. acc_finite (every accumulator lse finite, as after a first level where each
    query saw its own key) skips the pass that clears NaN weights and gives the same."""
    from hf_dilated.ops.merge import merge_into

    g = torch.Generator().manual_seed(0)
    out_a, out_b = (torch.randn(3, 5, 4, generator=g, dtype=torch.float64) for _ in range(2))
    lse_a, lse_b = (torch.randn(3, 5, generator=g, dtype=torch.float64) * 3 for _ in range(2))
    lse_b[0, :2] = float("-inf")
    if not acc_finite:
        lse_a[1, 0] = lse_b[1, 0] = float("-inf")
    lse = torch.logaddexp(lse_a, lse_b)
    expect = (out_a * torch.exp(lse_a - lse)[..., None] + out_b * torch.exp(lse_b - lse)[..., None])
    both_empty = torch.isinf(lse_a) & torch.isinf(lse_b)
    expect[both_empty] = out_a[both_empty]
    acc, acc_lse = out_a.clone(), lse_a.clone()
    with OpNames() as ops:
        merge_into(acc, acc_lse, out_b, lse_b, acc_finite=acc_finite)
    assert not acc.isnan().any() and torch.allclose(acc, expect, atol=1e-12)
    assert torch.equal(acc_lse, lse)
    assert ("aten.nan_to_num_" in ops.names) != acc_finite


def test_plain_union_forward_merges_into_a_finite_accumulator():
    """On a plain layout the first level's causal call gives every query its own key, so the later
    levels merge into an accumulator whose lse is finite, without the pass that clears NaN weights:
    4 launches a merge where there were 5 (a GPU's short calls are host-bound: 8 merges at 5
    levels). The result stays the reference's, the first queries of a segment (which see no key at
    the upper levels) included."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 4, 256, 8, generator=g, dtype=torch.float64) for _ in range(3))
    levels = ([32, 64, 128, 256], [1, 2, 4, 8])
    with OpNames() as ops:
        out = dilated_attention(q, k, v, *levels)
    assert "aten.nan_to_num_" not in ops.names and ops.names.count("aten.lerp_") >= 3
    assert (out - dilated_reference(q, k, v, *levels)).abs().max().item() < 1e-10
