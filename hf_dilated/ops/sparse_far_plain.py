"""Sparse far keys (docs/contract.md 4.2) on plain layouts: one dense call per group of query blocks.

One document per row, no padding, positions 0..n-1, causal, no sliding window, q_len == kv_len,
levels that hold every earlier key (one level of dilation 1 covering the row: the default
conversion's), and `window` and the band multiples of the block size B. Then query block
[s, s + B) (s >= window) has far keys j <= i - band in blocks 0 .. P = (s - band) / B, the same
candidates for all its queries, and one choice per kv head (its scoring block is block s / B - 1):
the sinks and the top_k blocks, a fixed (sinks + top_k) B keys per kv head, read by every query of
the block (only block P's keys past i - band are masked). So a call gathers those keys for a few
query blocks and reads them with no union and no read back to the host. Queries before `window`
read every key exactly (one causal call); the band of the others is local_band.near_plain's.
Used for prefill without autograd (inference); training takes local_band's masked calls, which
compute the same set.
"""
from __future__ import annotations

import torch

from . import far_selection, pair_count
from .backend import attention_forward
from .far_selection import FarSelection
from .local_band import near_plain
from .merge import merge_dtype, merge_into

# Query blocks per far call: its gathered keys are (blocks, kv heads, (sinks + k) B, dim), its mask
# (blocks, heads, B, (sinks + k) B).
_QUERY_BLOCKS = 8


def applies(plain: bool, q, k, segment_lengths, dilation_rates, is_causal, sliding_window, window: int,
            far_band: int | None, selection: FarSelection) -> bool:
    n = k.shape[2]
    band = window if far_band is None else far_band
    return (plain and is_causal and sliding_window is None and q.shape[2] == n
            and window % selection.block_size == 0 and band % selection.block_size == 0
            and any(w >= n and r == 1 for w, r in zip(segment_lengths, dilation_rates))
            and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)))


def sparse_far_forward(q, k, v, q_far, k_far, window: int, far_band: int | None, selection: FarSelection,
                       scale: float):
    batch, n_heads, n, dim = q.shape
    kv_heads = k.shape[1]
    acc = merge_dtype(q.dtype)
    out = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)
    head = min(n, window)  # queries whose band holds every key before them
    o, part = attention_forward(q[:, :, :head], k[:, :, :head], v[:, :, :head], is_causal=True, scale=scale)
    out[:, :, :head], lse[:, :, :head] = o.to(acc), part.to(acc)
    band = window if far_band is None else far_band
    if pair_count.TALLY.active:
        tail = torch.arange(head, n)
        pair_count.TALLY.pairs += n_heads * batch * (head * (head + 1) // 2 + int(torch.clamp(tail + 1, max=band).sum()))
        pair_count.add_call()
    if n <= window:
        return out.to(q.dtype)
    near_plain(q, k, v, out, lse, band, head, scale)
    if selection.top_k == 0 and selection.sinks == 0:  # no far key is read: no far call (it would have no key)
        return out.to(q.dtype)
    size, sinks = selection.block_size, selection.sinks
    n_blocks = -(-n // size)
    blocks = far_selection.Blocks(torch.arange(n, device=q.device).div(size, rounding_mode="floor").expand(batch, n),
                                  None, n_blocks)
    mn, mx = far_selection.summaries(k_far, blocks)
    number = torch.arange(n_blocks, device=q.device)
    offsets = torch.arange(size, device=q.device)
    rows = torch.arange(batch, device=q.device)[:, None, None, None]
    kv = torch.arange(kv_heads, device=q.device)[None, :, None, None]
    group = n_heads // kv_heads
    top_k = min(selection.top_k, n_blocks)
    for s in range(head, n, size * _QUERY_BLOCKS):
        e = min(n, s + size * _QUERY_BLOCKS)
        starts = torch.arange(s, e, size, device=q.device)  # the query blocks' first positions
        m = starts.shape[0]
        last = starts - band  # the last far key of each block's first query; block P = last // B
        # Scores from each query block's scoring block (the B keys before it): (batch, kv, m, blocks).
        scoring = k_far[:, :, s - size:s - size + m * size].to(mn.dtype).unflatten(2, (m, size))
        score = far_selection.bounds(scoring.flatten(2, 3), mn, mx).unflatten(2, (m, size)).amax(3)
        candidate = (number[None, :] * size <= last[:, None]) & (number[None, :] >= sinks)  # (m, blocks)
        ranked = score.masked_fill(~candidate, float("-inf"))
        top = torch.sort(ranked, dim=-1, descending=True, stable=True).indices[..., :top_k]
        taken = candidate.expand(batch, kv_heads, -1, -1).gather(-1, top)
        sink = torch.arange(min(sinks, n_blocks), device=q.device).expand(batch, kv_heads, m, -1)
        ids = torch.cat([sink, top], -1)  # (batch, kv, m, slots)
        ok = torch.cat([sink * size <= last[None, None, :, None], taken], -1)
        # (batch, kv, m, slots * B); a slot not taken may name a block past the row's end: clamped, masked
        keys = (ids[..., None] * size + offsets).flatten(-2).clamp(max=n - 1)
        # query t of the block reads key j when j <= first query's last far key + t
        read = ok.repeat_interleave(size, -1)[..., None, :] & \
            (keys[..., None, :] <= (last[:, None] + offsets[None, :])[None, None, :, :, None])
        ks, vs = k_far[rows, kv, keys], v[rows, kv, keys]  # (batch, kv, m, keys, dim)
        qs = q_far[:, :, s:s + m * size].unflatten(2, (m, size)) if e - s == m * size else \
            torch.nn.functional.pad(q_far[:, :, s:e], (0, 0, 0, m * size - (e - s))).unflatten(2, (m, size))
        read = read.expand(-1, -1, -1, size, -1)
        if e - s < m * size:  # queries past the row's end (padding of the last block) read nothing
            read = read & (starts[:, None] + offsets[None, :] < n)[None, None, :, :, None]
        read_h = read.repeat_interleave(group, 1)  # (batch, heads, m, B, keys)
        pair_count.add(read_h.transpose(1, 2).flatten(0, 1), n_heads)
        bias = torch.zeros(read_h.shape, dtype=q.dtype, device=q.device).masked_fill_(~read_h, float("-inf"))
        o, part = attention_forward(qs.transpose(1, 2).flatten(0, 1), ks.transpose(1, 2).flatten(0, 1),
                                    vs.transpose(1, 2).flatten(0, 1), is_causal=False, scale=scale,
                                    attn_bias=bias.transpose(1, 2).flatten(0, 1))
        o = o.unflatten(0, (batch, m)).transpose(1, 2).flatten(2, 3)[:, :, :e - s]
        part = part.unflatten(0, (batch, m)).transpose(1, 2).flatten(2, 3)[:, :, :e - s]
        part = part.masked_fill(~read_h.any(-1).flatten(2, 3)[:, :, :e - s], float("-inf"))
        merge_into(out[:, :, s:e], lse[:, :, s:e], o, part.to(acc))
    return out.to(q.dtype)
