"""The attention variants the kernel benchmark compares. Each builder takes (spec, q, k, v) and
returns (fn(q, k, v) -> out, visible pairs over the batch, reason the backward is unsupported or
None); it raises Unavailable for a variant that cannot run here."""
from __future__ import annotations

import torch

from .counts import dense_pair_count, dilated_pair_count, layout_pair_count

# create_block_mask evaluates a mask_mod on the whole (heads, N, N) grid.
FLEX_MASK_LIMIT = 1 << 28


class Unavailable(Exception):
    """A variant that cannot run here (missing module, wrong device); the reason is reported."""


def _dense_pairs(spec) -> int:
    return spec["batch"] * dense_pair_count(spec["n"], spec["heads"])


def _build_sdpa(spec, q, k, v):
    def fn(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1]
        )
    return fn, _dense_pairs(spec), None


def _build_flash_attn(spec, q, k, v):
    """The flash-attn package's kernel (CUDA, float16/bfloat16), where installed."""
    if q.device.type != "cuda":
        raise Unavailable("flash-attn runs on CUDA devices only")
    try:
        from flash_attn import flash_attn_func
    except ImportError as e:
        raise Unavailable(f"flash-attn is not installed ({e})")

    def fn(q, k, v):
        # flash-attn takes (batch, seq, heads, dim); the transposed views keep the last dim
        # contiguous, which is all it requires, so no copy is timed.
        out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
        return out.transpose(1, 2)

    return fn, _dense_pairs(spec), None


def _flex_available():
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError as e:  # pragma: no cover - old torch
        raise Unavailable(f"torch {torch.__version__} has no FlexAttention ({e})")
    return create_block_mask, flex_attention


def _compiled_flex(block_mask, device):
    _, flex_attention = _flex_available()
    compiled = torch.compile(flex_attention)

    def fn(q, k, v):
        return compiled(q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1])

    no_backward = f"FlexAttention has no CPU backward (torch {torch.__version__})" if device.type == "cpu" else None
    return fn, no_backward


def _build_flex(spec, q, k, v):
    create_block_mask, _ = _flex_available()

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    block_mask = create_block_mask(causal, None, None, spec["n"], spec["n"], device=q.device)
    fn, no_backward = _compiled_flex(block_mask, q.device)
    return fn, _dense_pairs(spec), no_backward


def union_mask_mod(segment_lengths, dilation_rates):
    """FlexAttention mask_mod of the "union" pattern (docs/contract.md 4) for one plain document
    (positions = indices)."""
    def union(b, h, q_idx, kv_idx):
        visible = q_idx < 0  # all False, as a tensor
        for w, r in zip(segment_lengths, dilation_rates):
            o = h % r
            level = ((q_idx // w) == (kv_idx // w)) & ((q_idx % w) % r == o) & ((kv_idx % w) % r == o)
            visible = visible | level
        return visible & (q_idx >= kv_idx)

    return union


def _build_flex_union(spec, q, k, v):
    """The "union" pattern as a FlexAttention mask (what a user would otherwise write), compiled."""
    create_block_mask, _ = _flex_available()
    n, seg, dil = spec["n"], spec["segment_lengths"], spec["dilation_rates"]
    if spec["heads"] * n * n > FLEX_MASK_LIMIT:
        # Its compiled construction (_compile=True) fails to build for this mask in torch 2.13 on CPU.
        raise Unavailable(f"flex_union stops at heads x N^2 <= 2^28 (create_block_mask materialises the "
                          f"(heads, N, N) mask; N={n} would need {spec['heads'] * n * n / 2**30:.1f} Gi entries)")
    block_mask = create_block_mask(union_mask_mod(seg, dil), None, spec["heads"], n, n, device=q.device)
    fn, no_backward = _compiled_flex(block_mask, q.device)
    return fn, spec["batch"] * dilated_pair_count(n, spec["heads"], seg, dil, "union"), no_backward


def _build_dilated(spec, q, k, v):
    from ..ops import dilated_attention
    mode, seg, dil = spec["variant"], spec["segment_lengths"], spec["dilation_rates"]

    def fn(q, k, v):
        return dilated_attention(q, k, v, seg, dil, mode=mode)

    return fn, spec["batch"] * dilated_pair_count(spec["n"], spec["heads"], seg, dil, mode), None


def _build_block_sparse(spec, q, k, v):
    from ..ops import block_sparse_attention
    pattern, bs = spec["block_pattern"], spec["block_size"]
    with torch.no_grad():  # the layout of these very inputs (adaptive patterns depend on them)
        _, layout = block_sparse_attention(q, k, v, pattern, block_size=bs, return_layout=True)
    layout_batch, layout_heads = layout.shape[0], layout.shape[1]
    pairs = layout_pair_count(spec["n"], bs, layout) * (spec["heads"] // layout_heads) * (spec["batch"] // layout_batch)

    def fn(q, k, v):
        return block_sparse_attention(q, k, v, pattern, block_size=bs)

    return fn, pairs, None


def _build_ring(spec, q, k, v):
    from ..distributed import ring_attention

    def fn(q, k, v):
        return ring_attention(q, k, v, group=None)

    return fn, _dense_pairs(spec), None


def _build_dilated_ring(spec, q, k, v):
    from ..distributed import dilated_ring_attention
    seg, dil = spec["segment_lengths"], spec["dilation_rates"]

    def fn(q, k, v):
        return dilated_ring_attention(q, k, v, seg, dil, mode="union", group=None)

    return fn, spec["batch"] * dilated_pair_count(spec["n"], spec["heads"], seg, dil, "union"), None


def _build_auto(spec, q, k, v):
    """create_attention("auto") as DilatedMultiheadAttention uses it by default (its own pattern:
    dense up to the device's dense_max_len, dilated beyond; the run's segment_lengths do not apply)."""
    from ..nn import create_attention

    attn = create_attention("auto")
    kind, cfg = attn.choose(spec["n"], q.device)
    if kind == "dense":
        pairs = dense_pair_count(spec["n"], spec["heads"])
    else:
        pairs = dilated_pair_count(spec["n"], spec["heads"], cfg["segment_lengths"], cfg["dilation_rates"], "union")
    return attn, spec["batch"] * pairs, None


# Every kernel variant the benchmark knows, in report order.
BUILDERS = {
    "sdpa": _build_sdpa,
    "flash_attn": _build_flash_attn,
    "flex": _build_flex,
    "union": _build_dilated,
    "flex_union": _build_flex_union,
    "longnet": _build_dilated,
    "head_groups": _build_dilated,
    "block_sparse": _build_block_sparse,
    "ring": _build_ring,
    "dilated_ring": _build_dilated_ring,
    "auto": _build_auto,
}
KERNEL_VARIANTS = tuple(BUILDERS)
