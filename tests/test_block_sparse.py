"""Block-sparse attention against docs/contract.md 5: every pattern, forward and gradients, checked
against the independent dense float64 evaluation in tests/reference.py of the layout the kernel reports."""
import warnings

import pytest
import torch
import torch.nn.functional as F

from reference import block_sparse_reference

import hf_dilated.ops.block_sparse as block_sparse_module
from hf_dilated.ops import block_sparse_attention
from hf_dilated.ops.block_patterns import (
    AdaptivePattern,
    CustomPattern,
    DilatedPattern,
    GlobalLocalPattern,
    HierarchicalPattern,
    LocalPattern,
    make_pattern,
)

TOL = {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-2}
BATCH, Q_HEADS, KV_HEADS, LENGTH, DIM, BLOCK = 2, 4, 2, 37, 8, 4  # 37: the last block is short


def _custom(heads, seed):
    gen = torch.Generator().manual_seed(seed)
    return CustomPattern(torch.rand(heads, 12, 12, generator=gen) > 0.4)


PATTERNS = {
    "local": LocalPattern(window=3),
    "dilated": DilatedPattern(window=2, stride=3),
    "global_local": GlobalLocalPattern(global_blocks=2, window=2),
    "hierarchical": HierarchicalPattern([(1, 2), (2, 5)]),
    "adaptive": AdaptivePattern(top_k=2, window=2),
    "custom_shared": _custom(1, 0),
    "custom_per_head": _custom(Q_HEADS, 1),
}


def _inputs(scenario):
    """attention_mask, position_ids, q_len, is_causal for each input shape a kernel must handle."""
    if scenario == "plain":
        return None, None, LENGTH, True
    if scenario == "padding":  # left padding in row 0, right padding in row 1
        mask = torch.ones(BATCH, LENGTH, dtype=torch.long)
        mask[0, :6] = 0
        mask[1, 29:] = 0
        return mask, None, LENGTH, True
    if scenario == "packed":  # three documents in row 0, two in row 1, one not starting at 0
        pos = torch.stack([
            torch.cat([torch.arange(11), torch.arange(17), torch.arange(9)]),
            torch.cat([torch.arange(3, 23), torch.arange(17)]),
        ])
        return None, pos, LENGTH, True
    if scenario == "decode":  # the last 5 tokens are queries (KV-cache prefill of a chunk)
        return None, None, 5, True
    if scenario == "packed_padded_decode":
        mask = torch.ones(BATCH, LENGTH, dtype=torch.long)
        mask[0, :3] = 0
        pos = torch.cat([torch.zeros(3, dtype=torch.long), torch.arange(20), torch.arange(14)]).expand(BATCH, LENGTH)
        return mask, pos, 1, True
    if scenario in ("holes", "holes_index_positions"):  # padding in the middle of documents
        # (docs/contract.md 3.1: a padded slot neither starts nor breaks a document, whether
        # positions count it or not)
        mask = torch.ones(BATCH, LENGTH, dtype=torch.long)
        mask[0, [4, 5, 19]] = 0
        mask[1, 30:33] = 0
        pos = torch.arange(LENGTH).expand(BATCH, LENGTH) if scenario == "holes_index_positions" else None
        return mask, pos, LENGTH, True
    if scenario == "not_causal":
        mask = torch.ones(BATCH, LENGTH, dtype=torch.long)
        mask[1, 30:] = 0
        return mask, None, LENGTH, False
    raise ValueError(scenario)


def _qkv(q_len, dtype, seed=0, q_heads=Q_HEADS, kv_heads=KV_HEADS, length=LENGTH, dim=DIM, batch=BATCH):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, q_heads, q_len, dim, generator=gen).to(dtype)
    k = torch.randn(batch, kv_heads, length, dim, generator=gen).to(dtype)
    v = torch.randn(batch, kv_heads, length, dim, generator=gen).to(dtype)
    return q, k, v


def _check_against_reference(pattern, scenario, dtype, block_size=BLOCK, seed=0):
    mask, pos, q_len, causal = _inputs(scenario)
    q, k, v = (x.requires_grad_() for x in _qkv(q_len, dtype, seed))
    out, layout = block_sparse_attention(
        q, k, v, pattern, block_size=block_size, is_causal=causal, attention_mask=mask, position_ids=pos,
        return_layout=True,
    )
    assert out.shape == q.shape and out.dtype == dtype
    assert layout.dtype == torch.bool and layout.dim() == 4

    q64, k64, v64 = (x.detach().to(torch.float64).requires_grad_() for x in (q, k, v))
    ref = block_sparse_reference(q64, k64, v64, layout, block_size, attention_mask=mask, position_ids=pos,
                                 is_causal=causal)
    # Outputs at padded query slots are unspecified: compare real queries only.
    real = torch.ones(BATCH, LENGTH, dtype=torch.bool) if mask is None else mask.bool()
    real_q = real[:, LENGTH - q_len:][:, None, :, None]
    tol = TOL[dtype]
    assert torch.isfinite(out).all()
    assert ((out.double() - ref) * real_q).abs().max().item() < tol

    grad = torch.randn(ref.shape, generator=torch.Generator().manual_seed(seed + 7), dtype=torch.float64) * real_q
    (out.double() * grad).sum().backward()
    (ref * grad).sum().backward()
    for name, ours, theirs in (("q", q, q64), ("k", k, k64), ("v", v, v64)):
        # Gradients sum over many queries and reach |g| ~ 5 here; a bf16 number of that size is only
        # good to ~0.01 (torch's own bf16 sdpa misses 2e-2 absolute on this test), so gradients
        # are held to the tolerance relative to their scale where it exceeds 1.
        err = (ours.grad.double() - theirs.grad).abs().max().item()
        bound = tol * max(1.0, theirs.grad.abs().max().item())
        assert err < bound, f"d{name} error {err} >= {bound}"
    return layout


SCENARIOS = ["plain", "padding", "packed", "decode", "packed_padded_decode", "holes", "holes_index_positions",
             "not_causal"]


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_matches_reference_float64(name, scenario):
    _check_against_reference(PATTERNS[name], scenario, torch.float64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["global_local", "adaptive", "custom_per_head", "dilated"])
@pytest.mark.parametrize("scenario", ["plain", "packed"])
def test_matches_reference_low_precision(name, scenario, dtype):
    _check_against_reference(PATTERNS[name], scenario, dtype, seed=3)


def test_long_lists_split_into_pieces_merge_exactly(monkeypatch):
    """A key list longer than the gather budget is cut into pieces merged by log-sum-exp."""
    monkeypatch.setattr(block_sparse_module, "_GATHER_BUDGET", 2 * BLOCK * DIM * 2 * KV_HEADS)
    for name in ("custom_shared", "custom_per_head", "adaptive"):
        for scenario in ("plain", "padding"):
            _check_against_reference(PATTERNS[name], scenario, torch.float64)


@pytest.mark.parametrize("blocks_per_run, strip_rows", [(1, 1), (2, 3), (100, 2)])
def test_plain_prefill_runs_and_strips_merge_exactly(monkeypatch, blocks_per_run, strip_rows):
    """Plain prefill runs its zero-copy calls over runs of query blocks and a block's own keys in
    strips of query rows; short runs and strips (uneven ones included, with the whole-sequence
    causal head of a wide window kept whole) change nothing."""
    calls_seen = []
    chunk = block_sparse_module._chunk_view_calls

    def spy(calls, R, size):
        out = chunk(calls, R, size)
        calls_seen.extend(out)
        return out

    monkeypatch.setattr(block_sparse_module, "_chunk_view_calls", spy)
    monkeypatch.setattr(block_sparse_module, "_VIEW_CHUNK", blocks_per_run * Q_HEADS * BLOCK * DIM)
    monkeypatch.setattr(block_sparse_module, "_STRIP_ROWS", strip_rows)
    for name in ("local", "dilated", "global_local", "hierarchical", "custom_shared"):
        calls_seen.clear()
        _check_against_reference(PATTERNS[name], "plain", torch.float64)
        split = [c for c in calls_seen if not (c.kind == "fixed" and c.causal)]
        assert split and all(c.u1 - c.u0 <= blocks_per_run for c in split)
        strips = {(c.r0, c.r1) for c in calls_seen if c.kind == "strip"}
        expected = {(r, min(BLOCK, r + strip_rows)) for r in range(0, BLOCK, strip_rows)}
        assert name == "custom_shared" or strips == expected  # a random layout may lack its diagonal
    _check_against_reference(LocalPattern(window=100), "plain", torch.float64)
    q, k, v = _qkv(64, torch.float32, q_heads=4, kv_heads=1, length=64)
    out, layout = block_sparse_attention(q, k, v, GlobalLocalPattern(1, 2), block_size=16, return_layout=True)
    ref = block_sparse_reference(q.double(), k.double(), v.double(), layout, 16)
    assert (out.double() - ref).abs().max().item() < 1e-4


def test_larger_blocks_and_multiple_of_block_length():
    q, k, v = _qkv(64, torch.float32, q_heads=4, kv_heads=1, length=64)
    for pattern in (GlobalLocalPattern(1, 2), DilatedPattern(1, 2), LocalPattern(2)):
        out, layout = block_sparse_attention(q, k, v, pattern, block_size=16, return_layout=True)
        ref = block_sparse_reference(q.double(), k.double(), v.double(), layout, 16)
        assert (out.double() - ref).abs().max().item() < 1e-4


def test_window_covering_everything_equals_sdpa():
    q, k, v = _qkv(LENGTH, torch.float32, seed=5)
    out = block_sparse_attention(q, k, v, LocalPattern(window=100), block_size=BLOCK)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert (out - expected).abs().max().item() < 1e-5


def test_gradcheck_float64():
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(1, 2, 7, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 1, 7, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 1, 7, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[0, 1, 1, 1, 1, 1, 1]])
    for pattern, kwargs in (
        (GlobalLocalPattern(1, 1), {}),
        (AdaptivePattern(top_k=1, window=1), {"attention_mask": mask}),
        (CustomPattern(torch.rand(2, 4, 4, generator=gen) > 0.3), {}),
    ):
        def fn(q, k, v):
            out = block_sparse_attention(q, k, v, pattern, block_size=2, **kwargs)
            return out if "attention_mask" not in kwargs else out[:, :, 1:]  # padded query: unspecified
        assert torch.autograd.gradcheck(fn, (q, k, v), fast_mode=True)


def test_layouts_follow_spec_formulas():
    q, k, v = _qkv(LENGTH, torch.float64)
    nb = -(-LENGTH // BLOCK)
    bq = torch.arange(nb)[:, None]
    bk = torch.arange(nb)[None, :]
    d = bq - bk
    expected = {
        "local": (d >= 0) & (d < 3),
        "dilated": ((d >= 0) & (d < 2)) | (d % 3 == 0),
        "global_local": (bk < 2) | ((d >= 0) & (d < 2)),
        "hierarchical": ((d >= 0) & (d < 1)) | (d % 2 == 0) | ((d >= 0) & (d < 2)) | (d % 5 == 0),
    }
    for name, want in expected.items():
        _, layout = block_sparse_attention(q, k, v, PATTERNS[name], block_size=BLOCK, return_layout=True)
        assert layout.shape == (1, 1, nb, nb)
        assert torch.equal(layout[0, 0], want), name
    _, layout = block_sparse_attention(q, k, v, PATTERNS["custom_per_head"], block_size=BLOCK, return_layout=True)
    assert torch.equal(layout[0], PATTERNS["custom_per_head"].layout)


def test_adaptive_selects_top_k_by_pooled_scores():
    """Independent float64 recomputation of the selection rule (docs/contract.md 5): local window
    plus, per (batch, head, query block), the top_k earlier blocks outside the window by pooled q . k."""
    q, k, v = _qkv(LENGTH, torch.float64, seed=9)
    top_k, window = 3, 2
    _, layout = block_sparse_attention(q, k, v, AdaptivePattern(top_k, window), block_size=BLOCK, return_layout=True)
    nb = -(-LENGTH // BLOCK)
    assert layout.shape == (BATCH, Q_HEADS, nb, nb)
    group = Q_HEADS // KV_HEADS
    for b in range(BATCH):
        for h in range(Q_HEADS):
            for n in range(nb):
                pooled_q = q[b, h, n * BLOCK:(n + 1) * BLOCK].mean(0)
                scores = {m: float(pooled_q @ k[b, h // group, m * BLOCK:(m + 1) * BLOCK].mean(0))
                          for m in range(0, n - window + 1)}
                chosen = sorted(scores, key=scores.get, reverse=True)[:top_k]
                want = {m for m in range(max(0, n - window + 1), n + 1)} | set(chosen)
                got = set(layout[b, h, n].nonzero()[:, 0].tolist())
                assert got == want, (b, h, n)


def test_padding_does_not_change_real_tokens():
    q, k, v = _qkv(LENGTH, torch.float32, seed=2)
    pad = 5
    qp, kp, vp = (F.pad(x, (0, 0, pad, 0)) for x in (q, k, v))
    mask = torch.ones(BATCH, LENGTH + pad, dtype=torch.long)
    mask[:, :pad] = 0
    for name in ("global_local", "adaptive", "custom_per_head"):
        plain = block_sparse_attention(q, k, v, PATTERNS[name], block_size=BLOCK)
        padded = block_sparse_attention(qp, kp, vp, PATTERNS[name], block_size=BLOCK, attention_mask=mask)
        assert (padded[:, :, pad:] - plain).abs().max().item() < 1e-5, name


def test_row_with_no_allowed_block_gives_zero_and_zero_grad():
    layout = torch.ones(1, 3, 3, dtype=torch.bool)
    layout[0, 1] = False  # query block 1 reads nothing, not even itself
    q, k, v = (x.requires_grad_() for x in _qkv(12, torch.float32, batch=1, length=12))
    out = block_sparse_attention(q, k, v, CustomPattern(layout), block_size=4)
    assert torch.isfinite(out).all() and out[:, :, 4:8].abs().max() == 0
    out.sum().backward()
    assert torch.isfinite(q.grad).all() and q.grad[:, :, 4:8].abs().max() == 0


def test_pattern_dicts_round_trip():
    for pattern in PATTERNS.values():
        rebuilt = make_pattern(pattern.to_dict())
        if isinstance(pattern, CustomPattern):
            assert torch.equal(rebuilt.layout, pattern.layout)
        else:
            assert rebuilt == pattern
    assert make_pattern({"type": "global_local", "global_blocks": 1, "window": 4}) == GlobalLocalPattern(1, 4)
    assert make_pattern({"type": "hierarchical", "levels": [{"window": 2, "stride": 4}]}) == HierarchicalPattern([(2, 4)])


@pytest.mark.parametrize("spec, exc, words", [
    ({"type": "banded", "window": 2}, ValueError, "unknown type"),
    ({"window": 2}, ValueError, "'type'"),
    ("local", TypeError, "pattern"),
    ({"type": "local"}, ValueError, "window"),
    ({"type": "local", "window": 2, "stride": 1}, ValueError, "window"),
    ({"type": "local", "window": 0}, ValueError, "window must be a positive int"),
    ({"type": "local", "window": True}, TypeError, "window"),
    ({"type": "dilated", "window": 2, "stride": -1}, ValueError, "stride must be a positive int"),
    ({"type": "global_local", "global_blocks": -1, "window": 2}, ValueError, "global_blocks"),
    ({"type": "adaptive", "top_k": 1.5, "window": 2}, TypeError, "top_k"),
    ({"type": "hierarchical", "levels": []}, ValueError, "levels"),
    ({"type": "hierarchical", "levels": [(1, 2, 3)]}, ValueError, "levels"),
    ({"type": "custom", "layout": torch.ones(3, 3, dtype=torch.bool)}, ValueError, "layout must be 3-D"),
    ({"type": "custom", "layout": torch.ones(1, 3, 3)}, TypeError, "torch.bool"),
])
def test_bad_patterns_are_rejected(spec, exc, words):
    q, k, v = _qkv(LENGTH, torch.float32)
    with pytest.raises(exc, match=words):
        block_sparse_attention(q, k, v, spec, block_size=BLOCK)


def test_bad_arguments_are_rejected():
    q, k, v = _qkv(LENGTH, torch.float32)
    pattern = LocalPattern(2)
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        block_sparse_attention(q, k, v, pattern, block_size=0)
    with pytest.raises(TypeError, match="block_size"):
        block_sparse_attention(q, k, v, pattern, block_size=4.0)
    with pytest.raises(ValueError, match="layout covers"):
        block_sparse_attention(q, k, v, CustomPattern(torch.ones(1, 3, 3, dtype=torch.bool)), block_size=BLOCK)
    with pytest.raises(ValueError, match="custom layout needs 1 or q_heads"):
        block_sparse_attention(q, k, v, CustomPattern(torch.ones(3, 12, 12, dtype=torch.bool)), block_size=BLOCK)
    with pytest.raises(ValueError, match="q_heads"):
        block_sparse_attention(q[:, :3], k, v, pattern, block_size=BLOCK)
    with pytest.raises(ValueError, match="attention_mask"):
        block_sparse_attention(q, k, v, pattern, block_size=BLOCK, attention_mask=torch.ones(BATCH, 5))
    with pytest.raises(ValueError, match="position_ids"):
        block_sparse_attention(q, k, v, pattern, block_size=BLOCK,
                               position_ids=torch.arange(LENGTH).expand(BATCH, LENGTH) - 3)
    with pytest.raises(ValueError, match="scale"):
        block_sparse_attention(q, k, v, pattern, block_size=BLOCK, scale=-1.0)
    with pytest.raises(TypeError, match="is_causal"):
        block_sparse_attention(q, k, v, pattern, block_size=BLOCK, is_causal=None)
    with pytest.raises(ValueError, match="dtype"):
        block_sparse_attention(q, k.double(), v, pattern, block_size=BLOCK)


# --- the CUDA path of a plain prefill: one FlexAttention call (ops/block_sparse_flex.py) --------

FLEX_PATTERNS = ["local", "dilated", "global_local", "hierarchical", "adaptive", "custom_per_head", "custom_shared"]


def _flex_pattern_call(name, q, k, v, block_size):
    """block_sparse_attention of PATTERNS[name] (a custom one sized for the blocks of the input), and
    its layout."""
    pattern = PATTERNS[name]
    if name.startswith("custom"):
        blocks = -(-q.shape[2] // block_size)
        gen = torch.Generator().manual_seed(5)
        pattern = CustomPattern(torch.rand(pattern.layout.shape[0], blocks, blocks, generator=gen) > 0.4)
    return block_sparse_attention(q, k, v, pattern, block_size=block_size, return_layout=True)


def _flex_case(name, block_size, n, device="cpu", dtype=torch.float64, grad=False, dim=DIM):
    """A plain prefill of n tokens (heads of `dim`) through the FlexAttention path (FLEX_ON widened
    to the CPU, whose eager FlexAttention has no backward: forwards there) against the float64
    reference of the layout the kernel reports; a custom layout sized for the blocks of n."""
    from hf_dilated.ops import block_sparse_flex

    q, k, v = (x.to(device).requires_grad_(grad) for x in _qkv(n, dtype, seed=4, length=n, dim=dim))
    with torch.set_grad_enabled(grad):
        out, layout = _flex_pattern_call(name, q, k, v, block_size)
    q64, k64, v64 = (x.detach().cpu().double().requires_grad_(grad) for x in (q, k, v))
    ref = block_sparse_reference(q64, k64, v64, layout.cpu(), block_size)
    assert (out.detach().cpu().double() - ref).abs().max().item() < TOL[dtype] * (10 if device == "cuda" else 1)
    if grad:
        g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
        (out.double() * g.to(device)).sum().backward()
        (ref * g).sum().backward()
        for ours, theirs in ((q, q64), (k, k64), (v, v64)):
            err = (ours.grad.cpu().double() - theirs.grad).abs().max().item()
            assert err < TOL[dtype] * 10 * max(1.0, theirs.grad.abs().max().item()), err
    return block_sparse_flex


@pytest.mark.parametrize("block_size", [32, 128, 256])
@pytest.mark.parametrize("name", FLEX_PATTERNS)
def test_flex_path_matches_reference(name, block_size, monkeypatch):
    from hf_dilated.ops import block_sparse_flex

    monkeypatch.setattr(block_sparse_flex, "FLEX_ON", ("cuda", "cpu"))
    monkeypatch.setattr(block_sparse_flex, "MIN_TOKENS", 1)
    calls = []
    real = block_sparse_flex.attention
    monkeypatch.setattr(block_sparse_flex, "attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    _flex_case(name, block_size, 300)
    assert calls and block_sparse_flex._FAILED is None  # the FlexAttention path ran


def test_flex_path_leaves_other_block_sizes_layouts_and_short_prefills_to_the_blocks(monkeypatch):
    from hf_dilated.ops import block_sparse_flex

    monkeypatch.setattr(block_sparse_flex, "FLEX_ON", ("cuda", "cpu"))
    monkeypatch.setattr(block_sparse_flex, "MIN_TOKENS", 1)
    calls = []
    real = block_sparse_flex.attention
    monkeypatch.setattr(block_sparse_flex, "attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    with torch.no_grad():
        q, k, v = _qkv(300, torch.float64, length=300)
        block_sparse_attention(q, k, v, PATTERNS["local"], block_size=48)  # neither tiles nor is tiled by 128
        mask, pos, q_len, causal = _inputs("padding")
        q, k, v = _qkv(q_len, torch.float64)
        block_sparse_attention(q, k, v, PATTERNS["local"], block_size=BLOCK, attention_mask=mask)  # not plain
        monkeypatch.setattr(block_sparse_flex, "MIN_TOKENS", 4096)
        q, k, v = _qkv(300, torch.float64, length=300)
        block_sparse_attention(q, k, v, PATTERNS["local"], block_size=128)  # shorter than MIN_TOKENS
    assert not calls


@pytest.mark.parametrize("shape", [(1, 4, 3), (1, 3, 5)], ids=("more_query_blocks", "more_key_blocks"))
def test_flex_path_takes_a_custom_layout_of_other_sides(monkeypatch, shape):
    """A custom layout whose two block axes differ (accepted by the block path where each covers the
    input's 3 blocks) on the FlexAttention path: the reference's result (4 x 3 raised: both axes
    were cut by the first's length)."""
    from hf_dilated.ops import block_sparse_flex

    monkeypatch.setattr(block_sparse_flex, "FLEX_ON", ("cuda", "cpu"))
    monkeypatch.setattr(block_sparse_flex, "MIN_TOKENS", 1)
    layout = torch.rand(shape, generator=torch.Generator().manual_seed(3)) > 0.3
    q, k, v = _qkv(300, torch.float64, length=300)
    with torch.no_grad():
        out, reported = block_sparse_attention(q, k, v, CustomPattern(layout), block_size=128, return_layout=True)
    ref = block_sparse_reference(q, k, v, reported, 128)
    assert (out - ref).abs().max().item() < TOL[torch.float64] and block_sparse_flex._FAILED is None


@pytest.mark.parametrize("block_size", [32, 64, 128, 256])
@pytest.mark.parametrize("name", ["global_local", "custom_per_head", "dilated"])
def test_flex_block_mask_lists_exactly_the_allowed_pairs(name, block_size):
    """The BlockMask's tiles (FlexAttention's eager form reads mask_mod everywhere, so the CPU
    results alone do not check them): every allowed causal pair of a real query lies in a listed
    tile, a "full" tile holds allowed pairs only, and no tile lists a pair a real query may not read.
    Read as compiled FlexAttention reads it (the full tiles whole, mask_mod on the partial ones), it
    gives exactly the allowed pairs of every real query; read as the eager form does (mask_mod on
    every pair, the lists ignored), too."""
    from hf_dilated.ops import block_sparse_flex

    n = 300
    blocks = -(-n // block_size)
    if name.startswith("custom"):
        layout = (torch.rand(Q_HEADS, blocks, blocks, generator=torch.Generator().manual_seed(2)) > 0.4)[None]
    else:
        layout = PATTERNS[name].block_layout(torch.arange(blocks), blocks)
    mask = block_sparse_flex.block_mask(layout, n, block_size)
    padded, tile = 512, mask.BLOCK_SIZE[0]
    assert tile == (block_size if block_size >= block_sparse_flex.TILE else block_sparse_flex.TILE)
    i = torch.arange(padded)
    for h in range(layout.shape[1]):
        lay = layout[0, h]
        allowed = torch.zeros(padded, padded, dtype=torch.bool)
        allowed[:n, :n] = lay[i[:n, None] // block_size, i[None, :n] // block_size] & (i[None, :n] <= i[:n, None])
        listed = torch.zeros(padded, padded, dtype=torch.bool)
        full = torch.zeros_like(listed)
        hh = min(h, mask.kv_num_blocks.shape[1] - 1)
        for qt in range(padded // tile):
            rows = slice(qt * tile, (qt + 1) * tile)
            for j in range(int(mask.kv_num_blocks[0, hh, qt])):
                kt = int(mask.kv_indices[0, hh, qt, j])
                listed[rows, kt * tile:(kt + 1) * tile] = True
            for j in range(int(mask.full_kv_num_blocks[0, hh, qt])):
                kt = int(mask.full_kv_indices[0, hh, qt, j])
                full[rows, kt * tile:(kt + 1) * tile] = True
        assert not (listed & full).any()
        assert (allowed <= (listed | full)).all()  # every allowed pair is read
        assert not (full[:n] & ~allowed[:n]).any()  # a full tile of a real query: allowed pairs only
        modded = mask.mask_mod(torch.tensor(0), torch.tensor(h), i[:, None], i[None, :])
        read = full | (listed & modded)  # what a compiled call reads
        assert torch.equal(read[:n], allowed[:n]), (h, (read[:n] ^ allowed[:n]).nonzero()[:5])
        assert torch.equal(modded[:n], allowed[:n])  # what the eager form reads


@pytest.mark.parametrize("run", ("eager_backend", "force_eager"))
def test_flex_path_reads_the_layout_in_mask_mod_where_the_graph_runs_eagerly(monkeypatch, run):
    """A compiled FlexAttention call that runs eagerly evaluates mask_mod on every pair and ignores
    the tile lists: a backend that runs dynamo's graph eagerly (tests' counting ones), or inductor
    under `torch.compiler.set_stance("force_eager")`, where the causal-only mask_mod a compiled call
    got before gave dense causal attention (2.23 off the reference). Blocks of 256 (the tiles),
    the CUDA branch taken on the CPU: the reference's result."""
    from hf_dilated.ops import block_sparse_flex, sparse_far_flex

    torch._dynamo.reset()
    sparse_far_flex.compiled_for_bucket.cache_clear()
    backend = "eager" if run == "eager_backend" else "inductor"
    for module, name, value in ((block_sparse_flex, "FLEX_ON", ("cuda", "cpu")), (block_sparse_flex, "MIN_TOKENS", 1),
                                (block_sparse_flex, "_FAILED", None), (block_sparse_flex, "_MASKS", {}),
                                (sparse_far_flex, "COMPILED_ON", ("cuda", "cpu")), (sparse_far_flex, "BACKEND", backend)):
        monkeypatch.setattr(module, name, value)
    blocks = 5  # each row: its own block and the first (the blocks between them not read)
    layout = torch.eye(blocks, dtype=torch.bool)
    layout[:, 0] = True
    try:
        q, k, v = _qkv(1100, torch.float64, seed=4, length=1100, dim=16)
        with torch.compiler.set_stance("force_eager" if run == "force_eager" else "default"):
            out, layout = block_sparse_attention(q, k, v, CustomPattern(layout[None]), block_size=256,
                                                 return_layout=True)
    finally:
        torch._dynamo.reset()
        sparse_far_flex.compiled_for_bucket.cache_clear()
    assert (out - block_sparse_reference(q, k, v, layout, 256)).abs().max().item() < TOL[torch.float64]
    assert block_sparse_flex._FAILED is None


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.parametrize("name, dtype, block_size", [("custom_per_head", torch.bfloat16, 256),
                                                     ("global_local", torch.float32, 128)])
def test_cuda_flex_path_forward_and_gradients_match_reference(name, dtype, block_size, monkeypatch):
    """On CUDA the plain prefill is compiled FlexAttention, forward and backward, against the
    float64 reference of the reported layout (1,000 tokens, heads of 64; two cases: each compiles):
    blocks of 256 as its tiles (a random layout per head: blocks left out between the read ones),
    blocks of 128.
    (With the file's heads of 8 it failed on an H200, 2026-11-27: the CUDA kernel takes none
    narrower than 16.)"""
    from hf_dilated.ops import block_sparse_flex

    monkeypatch.setattr(block_sparse_flex, "MIN_TOKENS", 1)
    calls = []
    real = block_sparse_flex.attention
    monkeypatch.setattr(block_sparse_flex, "attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    flex = _flex_case(name, block_size, 1000, device="cuda", dtype=dtype, grad=True, dim=64)
    assert calls and flex._FAILED is None  # FlexAttention ran, and did not fail


def test_flex_path_compiles_each_length_bucket_and_leaves_dynamos_settings_alone(monkeypatch):
    """The compiled FlexAttention call (COMPILED_ON widened to the CPU, a counting backend) is a
    function of its own per length bucket and per everything else that compiles another graph: with
    dynamo's limit at 2 graphs per function (failing past it), two dtypes in each of three buckets,
    and in one bucket other head widths and another layout, all compile. (A function per bucket
    alone held 5 graphs in the bucket of 512 here, past that limit; past the default 8, FlexAttention
    runs eagerly, its full scores, with nothing said.) A steady-state call patches no config: raising
    the limit per call (torch._dynamo.config.patch) costs 0.5 ms of host time a call on the CPU,
    where block_sparse took 0.76 ms against FlexAttention's 0.39 with the same BlockMask (an H200, 32K)."""
    from hf_dilated.ops import block_sparse_flex, sparse_far_flex

    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    from torch.utils._config_module import ConfigModule

    patches = []
    real_patch = ConfigModule.patch

    def counted_patch(self, *a, **kw):
        patches.append(self.__name__)
        return real_patch(self, *a, **kw)

    torch._dynamo.reset()
    sparse_far_flex.compiled_for_bucket.cache_clear()
    for module, name, value in ((block_sparse_flex, "FLEX_ON", ("cuda", "cpu")), (block_sparse_flex, "MIN_TOKENS", 1),
                                (block_sparse_flex, "_FAILED", None), (sparse_far_flex, "COMPILED_ON", ("cuda", "cpu")),
                                (sparse_far_flex, "BACKEND", counting), (torch._dynamo.config, "recompile_limit", 2),
                                (torch._dynamo.config, "fail_on_recompile_limit_hit", True),
                                (ConfigModule, "patch", counted_patch)):
        monkeypatch.setattr(module, name, value)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # no "FlexAttention failed here"
            for n in (200, 300, 600):  # buckets of 256, 512 and 1024 tokens
                for dtype in (torch.float64, torch.float32):
                    q, k, v = _qkv(n, dtype, seed=4, length=n, dim=16)
                    out, layout = block_sparse_attention(q, k, v, PATTERNS["global_local"], block_size=32,
                                                         return_layout=True)
                    ref = block_sparse_reference(q.double(), k.double(), v.double(), layout, 32)
                    assert (out.double() - ref).abs().max().item() < TOL[dtype]
            for name, dim in (("global_local", 32), ("custom_per_head", 16), ("custom_per_head", 32)):  # bucket 512
                q, k, v = _qkv(300, torch.float32, seed=4, length=300, dim=dim)
                out, layout = _flex_pattern_call(name, q, k, v, 32)
                ref = block_sparse_reference(q.double(), k.double(), v.double(), layout, 32)
                assert (out.double() - ref).abs().max().item() < TOL[torch.float32]
        assert len(graphs) == 9 and block_sparse_flex._FAILED is None, (len(graphs), block_sparse_flex._FAILED)
        patches.clear()
        _flex_pattern_call("custom_per_head", q, k, v, 32)  # a steady-state call
        assert not patches and len(graphs) == 9, patches
    finally:
        torch._dynamo.reset()
        sparse_far_flex.compiled_for_bucket.cache_clear()


@pytest.mark.cuda
def test_cuda_heads_narrower_than_flex_takes_keep_the_block_path_and_flex_open(monkeypatch):
    """Heads of 8 on CUDA, which FlexAttention's CUDA kernel does not take, go the block-by-block
    way without trying it (trying failed, and closed FlexAttention to every later call of the
    process: the H200's run of 2026-11-27), and match the reference; FlexAttention stays open."""
    from hf_dilated.ops import block_sparse_flex

    monkeypatch.setattr(block_sparse_flex, "MIN_TOKENS", 1)
    monkeypatch.setattr(block_sparse_flex, "_FAILED", None)
    calls = []
    real = block_sparse_flex.attention
    monkeypatch.setattr(block_sparse_flex, "attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no "FlexAttention failed here"
        flex = _flex_case("global_local", 128, 1000, device="cuda", dtype=torch.float32, grad=True, dim=8)
    assert not calls and flex._FAILED is None


def test_flex_path_takes_heads_its_cuda_kernel_takes(monkeypatch):
    """block_sparse_flex.applies on (fake) CUDA tensors: heads of 16 and wider, in q and in v, take
    FlexAttention; narrower ones, which its CUDA kernel refuses (a failure that closed it to the
    process on an H200), do not. On the CPU's eager FlexAttention every width does."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from hf_dilated.ops import block_sparse_flex

    monkeypatch.setattr(block_sparse_flex, "_FAILED", None)

    def takes(q_dim, v_dim, device):
        q, k = torch.empty(1, 4, 4096, q_dim, device=device), torch.empty(1, 2, 4096, q_dim, device=device)
        v = torch.empty(1, 2, 4096, v_dim, device=device)
        return block_sparse_flex.applies(q, k, v, True, True, None, 128)

    with FakeTensorMode():
        assert takes(16, 16, "cuda") and takes(64, 64, "cuda")
        assert not takes(8, 8, "cuda") and not takes(64, 8, "cuda") and not takes(8, 64, "cuda")
    monkeypatch.setattr(block_sparse_flex, "FLEX_ON", ("cuda", "cpu"))
    assert takes(8, 8, "cpu")


@pytest.mark.parametrize("spec", [{"type": "local", "window": 2}, {"type": "hierarchical", "levels": [[1, 2], [2, 5]]}])
def test_rows_at_large_positions_plan_from_their_blocks_not_every_block_number(spec):
    """A document whose positions start far from 0 (contract 3.1 allows any start) has few blocks
    at large block numbers: the plan built the (blocks x blocks) layout up to the largest number
    (16 tokens at positions 40,000..: 100 M entries; at 10 M: an allocation of 50 TB that failed),
    where the rows of its own blocks are all it reads. The result is the reference's (these patterns
    depend on bq - bk alone, and the offsets are whole blocks: the layout of 4 blocks from 0)."""
    from conftest import LargestTensor

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 8, dtype=torch.float64, generator=g) for _ in range(3))
    d = torch.arange(4)[:, None] - torch.arange(4)[None, :]  # bq - bk
    layout = ((d >= 0) & (d < 2) if spec["type"] == "local"
              else (d == 0) | (d % 2 == 0) | ((d >= 0) & (d < 2)) | (d % 5 == 0))
    for offset in (40_000, 10_000_000):
        positions = torch.arange(16)[None] + offset
        with LargestTensor() as largest:
            out = block_sparse_attention(q, k, v, spec, block_size=4, position_ids=positions)
        assert largest.entries <= 4 * (offset // 4 + 5)  # rows of the query blocks over the block numbers
        want = block_sparse_reference(q, k, v, layout[None, None], block_size=4)
        torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
