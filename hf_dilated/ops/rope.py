"""Rotating vectors that already carry rotary position embeddings to other positions.

RoPE turns a vector at position p by the angles p * inv_freq (pairs (t, t + rot/2) of its first
`rot` = 2 * len(inv_freq) dims, the rotate-half convention of Llama, Mistral, Qwen2 and GPT-NeoX);
rotations compose, so a vector rotated at p is moved to p + delta by one more rotation by delta.
The angles are computed in float64: at a million tokens float32 angles would be off by ~0.1 rad.
"""
from __future__ import annotations

import torch

from .token_layout import mask_ranks


def rotate_by(x: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """x (batch, heads, n, head_dim) moved by `delta` (batch, n) positions; dims beyond the rotary
    ones (partial rotary, GPT-NeoX) are left as they are."""
    rot = 2 * inv_freq.shape[-1]
    if rot > x.shape[-1]:
        raise ValueError(f"inv_freq: {inv_freq.shape[-1]} frequencies rotate {rot} dims, more than head_dim "
                         f"{x.shape[-1]}")
    angle = delta.to(torch.float64)[:, None, :, None] * inv_freq.to(device=x.device, dtype=torch.float64)
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)  # (..., rot / 2): each frequency once
    half = rot // 2
    x1, x2 = x[..., :half], x[..., half:rot]  # rotate-half: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., rot:]], -1)


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
                    inv_freq: torch.Tensor):
    """(q_far, k_far) of a local band (docs/contract.md 4.1): query (batch, heads, q_len, d) and key
    (batch, kv_heads, kv_len, d), already rotated at their positions `positions` (batch, kv_len;
    the kernels' rule, ops/token_layout.py), moved on to Self-Extend's grouped positions for the
    neighbour window `window` (config.far_keys)."""
    query_delta, key_delta = grouped_far_positions(positions, query.shape[2], window, group)
    return rotate_by(query, query_delta, inv_freq), rotate_by(key, key_delta, inv_freq)


def far_projections_static(query: torch.Tensor, key: torch.Tensor, real: torch.Tensor, seen: torch.Tensor,
                           window: int, group: int, inv_freq: torch.Tensor):
    """far_projections for a compiled decode step on a static cache (ops/dilated_decode.py:
    dilated_decode_static): the positions are mask ranks of the written slots `real`, found without
    any Python value from tensor data (`seen` is a 0-d tensor)."""
    positions = mask_ranks(real).clamp(min=0)
    query_slots = seen - query.shape[2] + torch.arange(query.shape[2], device=key.device)
    query_delta, _ = grouped_far_positions(positions.index_select(1, query_slots), query.shape[2], window, group)
    key_delta = positions // group - positions
    return rotate_by(query, query_delta, inv_freq), rotate_by(key, key_delta, inv_freq)
