"""Rotating vectors that already carry rotary position embeddings to other positions.

RoPE turns a vector at position p by the angles p * inv_freq (pairs (t, t + rot/2) of its first
`rot` = 2 * len(inv_freq) dims, the rotate-half convention of Llama, Mistral, Qwen2 and GPT-NeoX);
rotations compose, so a vector rotated at p is moved to p + delta by one more rotation by delta.
The angles are computed in float64: at a million tokens float32 angles would be off by ~0.1 rad.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .token_layout import mask_ranks


class RopeOffset(NamedTuple):
    """How much further than their kernel positions the model rotated q and k (its RoPE ran at its
    own position_ids: a left-padded row's default ones are its indices, not its mask ranks).
    per_key (batch, kv_len) int64, 0 at padded slots; per_row: one int a row, its last key's (a
    regular row's every real key's: the decode steps')."""

    per_key: torch.Tensor
    per_row: list[int]


def rotate_by(x: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """x (batch, heads, n, head_dim) moved by `delta` (batch, n) positions; dims beyond the rotary
    ones (partial rotary, GPT-NeoX) are left as they are."""
    rot = 2 * inv_freq.shape[-1]
    if rot > x.shape[-1]:
        raise ValueError(f"inv_freq: {inv_freq.shape[-1]} frequencies rotate {rot} dims, more than head_dim "
                         f"{x.shape[-1]}")
    angle = delta.to(torch.float64)[:, None, :, None] * inv_freq.to(device=x.device, dtype=torch.float64)
    return rotate_with(x, angle.cos().to(x.dtype), angle.sin().to(x.dtype))


def rotate_with(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (..., head_dim) turned by the angles whose cos and sin are given (..., rot / 2), one per
    frequency: rotate-half, (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)."""
    half = cos.shape[-1]
    x1, x2 = x[..., :half], x[..., half:2 * half]
    if torch.compiler.is_compiling() or (torch.is_grad_enabled() and (x.requires_grad or cos.requires_grad
                                                                       or sin.requires_grad)):
        # (compiled, the out= form below breaks the graph: a StaticCache decode step compiles this)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., 2 * half:]], -1)
    # Eager without autograd: written into one output (the concatenation of three temporaries was a
    # third of a CPU decode step's time)
    shape = torch.broadcast_shapes(x1.shape, cos.shape)
    out = torch.empty(shape[:-1] + x.shape[-1:], dtype=torch.result_type(x, cos), device=x.device)
    o1, o2 = out[..., :half], out[..., half:2 * half]
    if out.numel() >= _WHOLE_WIDTH_ELEMENTS:
        # (x2, x1) * (-sin, sin) + x * (cos, cos) over the whole rotary width: products into half of
        # each row (below) ran at a third of the speed on the CPU
        o1.copy_(x2.expand_as(o1))
        o2.copy_(x1.expand_as(o2))
        out[..., :2 * half].mul_(torch.cat([-sin, sin], -1)).addcmul_(x[..., :2 * half], torch.cat([cos, cos], -1))
    else:  # (fewer launches)
        torch.mul(x1, cos, out=o1)
        o1.sub_(x2 * sin)
        torch.mul(x2, cos, out=o2)
        o2.add_(x1 * sin)
    out[..., 2 * half:] = x[..., 2 * half:]
    return out


# From this many elements rotate_with works over the whole rotary width (faster on the CPU from
# about 100K: a decode step's far keys, a prefill's far projections).
_WHOLE_WIDTH_ELEMENTS = 1 << 17


def turn_by(delta: int, inv_freq: torch.Tensor, dtype, device):
    """(cos, sin), each (rot / 2,): the turn by `delta` positions, a Python int; rotate_by's angles
    (the same float64 products) without making the delta a tensor first."""
    angle = inv_freq.to(device=device, dtype=torch.float64) * delta
    return angle.cos().to(dtype), angle.sin().to(dtype)


def offset_turns(size: int, group: int, inv_freq: torch.Tensor, device):
    """The per-offset part of far_turns, float64 (cos, sin), each (size, rot / 2): it depends on
    the block size, the group and the frequencies only, so a decode step may keep it."""
    offsets = torch.arange(size, device=device)
    per_offset = (offsets // group - offsets).to(torch.float64)[:, None] * inv_freq.to(device=device,
                                                                                       dtype=torch.float64)
    return per_offset.cos(), per_offset.sin()


def block_turns(blocks: torch.Tensor, size: int, group: int, inv_freq: torch.Tensor, dtype):
    """The per-block part of the move of far keys to their grouped positions (grouped_far_positions),
    (cos, sin), each (*blocks.shape, rot / 2), when `group` divides `size`: a key at offset t of
    block c moves by p // group - p = c (size / group - size) + (t // group - t), one angle per
    block plus one per offset (offset_turns). Rotations compose, so q . R(block + offset) k =
    R(-block) q . R(offset) k: a decode step turns each key by its offset's angle (one table for
    every block) and the query back by each chosen block's, where evaluating the sum's angle per
    key took most of a step on the CPU."""
    if size % group:
        raise ValueError(f"block_turns: group {group} must divide the block size {size}")
    freq = inv_freq.to(device=blocks.device, dtype=torch.float64)
    angle = (blocks.to(torch.float64) * (size // group - size))[..., None] * freq
    return angle.cos().to(dtype), angle.sin().to(dtype)


def far_turn_table(length: int, group: int, inv_freq: torch.Tensor, dtype, device):
    """(cos, sin), each (length, rot / 2) in dtype: the turns moving keys at positions 0 .. length - 1
    to their grouped far positions (p // group - p, grouped_far_positions), rotate_by's own values
    (the same float64 products, then dtype). A decode step that turns every key of a cache reads
    them by position (rotate_with) instead of a float64 cos and sin per key and head: that pass,
    compiled, took 0.48 ms a layer at 16K tokens on an H200 (2026-11-27)."""
    positions = torch.arange(length, device=device)
    angle = (positions // group - positions).to(torch.float64)[:, None] * inv_freq.to(device=device,
                                                                                     dtype=torch.float64)
    return angle.cos().to(dtype), angle.sin().to(dtype)


def grouped_far_positions(positions: torch.Tensor, q_len: int, window: int, group: int):
    """Self-Extend's grouped positions (Jin et al., 2024) for keys beyond its neighbour window of
    `window` positions: a far key at position p sits at p // group, a query at p // group + window -
    window // group, so a far key d back sits at relative position about d // group + window -
    window // group: it continues the neighbour window's distances at its edge and grows `group`
    times more slowly. Returns (query delta (batch, q_len), key delta (batch, kv_len)): how far each
    query and key moves from its own position."""
    p = positions.long()
    key_delta = p // group - p
    p_q = p[:, p.shape[1] - q_len:]
    query_delta = p_q // group + window - window // group - p_q
    return query_delta, key_delta


def far_projections(query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor, window: int, group: int,
                    inv_freq: torch.Tensor, offset: torch.Tensor | None = None):
    """(q_far, k_far) of a local band (docs/contract.md 4.1): query (batch, heads, q_len, d) and key
    (batch, kv_heads, kv_len, d), already rotated at their positions `positions` (batch, kv_len;
    the kernels' rule, ops/token_layout.py) + `offset` (batch, kv_len; None: 0: where the model's
    RoPE positions are not the kernels', a left-padded row's default position_ids), moved on to
    Self-Extend's grouped positions of `positions` for the neighbour window `window`
    (config.far_keys)."""
    query_delta, key_delta = grouped_far_positions(positions, query.shape[2], window, group)
    if offset is not None:
        offset = offset.to(key_delta.device, torch.long).expand_as(key_delta)
        query_delta, key_delta = query_delta - offset[:, offset.shape[1] - query.shape[2]:], key_delta - offset
    return rotate_by(query, query_delta, inv_freq), rotate_by(key, key_delta, inv_freq)


def far_queries_static(query: torch.Tensor, real: torch.Tensor, seen: torch.Tensor, window: int, group: int,
                       inv_freq: torch.Tensor, shift: torch.Tensor | None = None) -> torch.Tensor:
    """q_far of far_projections_static alone: the queries (slots seen - q_len .. seen - 1) moved to
    their grouped far positions (a step that turns only the keys it reads)."""
    positions = mask_ranks(real).clamp(min=0)
    query_slots = seen - query.shape[2] + torch.arange(query.shape[2], device=query.device)
    query_delta, _ = grouped_far_positions(positions.index_select(1, query_slots), query.shape[2], window, group)
    return rotate_by(query, query_delta if shift is None else query_delta - shift[:, None], inv_freq)


def far_projections_static(query: torch.Tensor, key: torch.Tensor, real: torch.Tensor, seen: torch.Tensor,
                           window: int, group: int, inv_freq: torch.Tensor, shift: torch.Tensor | None = None):
    """far_projections for a compiled decode step on a static cache (ops/dilated_decode.py:
    dilated_decode_static): the positions are mask ranks of the written slots `real`, found without
    any Python value from tensor data (`seen` is a 0-d tensor). shift (batch,): how much further
    than its mask ranks each row was rotated by the model (None: 0; far_projections' offset, one a
    row)."""
    positions = mask_ranks(real).clamp(min=0)
    key_delta = positions // group - positions
    if shift is not None:
        key_delta = key_delta - shift[:, None]
    return far_queries_static(query, real, seen, window, group, inv_freq, shift), rotate_by(key, key_delta, inv_freq)
