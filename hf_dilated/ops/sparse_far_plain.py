"""Sparse far keys (docs/contract.md 4.2) on plain layouts, without masks over every key.

One document per row, no padding, positions 0..n-1, causal, no sliding window, q_len == kv_len,
and levels that hold every earlier key (one level of dilation 1 covering the row: the default
conversion's). Then block c is keys c*B .. c*B + B - 1, query i's far keys are j <= i - band, and
everything the selection needs is block arithmetic: per chunk of queries the bounds (batch, heads,
queries, blocks), the selected blocks, and one fused call over the union of the chunk's blocks per
head, gathered, with a mask over those keys only. Queries before `window` read every key exactly
(one causal call); the band of the others is local_band.near_plain's. Used for prefill without
autograd (inference); training takes local_band's masked calls, which compute the same set.
"""
from __future__ import annotations

import torch

from . import far_selection, pair_count
from .backend import attention_forward
from .far_selection import FarSelection
from .local_band import near_plain
from .merge import merge_dtype, merge_into

_CHUNK = 256  # queries per far call: the union of their selected blocks grows with the chunk


def applies(plain: bool, q, k, segment_lengths, dilation_rates, is_causal, sliding_window) -> bool:
    n = k.shape[2]
    return (plain and is_causal and sliding_window is None and q.shape[2] == n
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
    size = selection.block_size
    n_blocks = -(-n // size)
    blocks = far_selection.Blocks(torch.arange(n, device=q.device).div(size, rounding_mode="floor").expand(batch, n),
                                  None, n_blocks)
    mn, mx = far_selection.summaries(k_far, blocks)
    number = torch.arange(n_blocks, device=q.device)
    offsets = torch.arange(size, device=q.device)
    for s in range(head, n, _CHUNK):
        e = min(n, s + _CHUNK)
        last = torch.arange(s, e, device=q.device) - band  # the last far key of each query
        # Every query here (position >= window >= band) has a far key: block 0 always reaches.
        reach = number[None, :] * size <= last[:, None]  # (queries, blocks): the block holds a far key
        sink = reach & (number[None, :] < selection.sinks)
        candidate = reach & ~sink
        chosen = far_selection.select(far_selection.bounds(q_far[:, :, s:e], mn, mx),
                                      candidate.expand(batch, n_heads, -1, -1), selection.top_k) | sink
        if selection.sinks == 0:  # with a sink every query here reads a far key; without, some may read none
            reads_none = ~chosen.any(-1)
        # One call per (row, head) over the union of its queries' blocks: heads choose apart, and one
        # call for all would pad every head to the widest union.
        # The blocks some query of each (row, head) chose, on the device and as Python ints: the one
        # read back of the chunk (nonzero's count and its list), no copy back to the device.
        found = chosen.any(2).flatten(0, 1).nonzero()  # (m, 2): (row * heads + head, block), sorted
        used = [[] for _ in range(batch * n_heads)]
        for at, (row_head, c) in enumerate(found.tolist()):
            used[row_head].append((at, c))
        for b in range(batch):
            for h in range(n_heads):
                entries = used[b * n_heads + h]
                if not entries:  # no query of this head reads a far key (top_k 0, no sink)
                    continue
                blocks_used = [c for _, c in entries]
                listed = found[entries[0][0]:entries[-1][0] + 1, 1]
                # their keys, in order; only the last block can run past the row's end
                keys = (listed[:, None] * size + offsets).flatten()
                keys = keys[:len(blocks_used) * size - max(0, (blocks_used[-1] + 1) * size - n)]
                kv = h // (n_heads // kv_heads)  # this head's kv head (any strides: no flat view)
                ks, vs = k_far[b, kv].index_select(0, keys), v[b, kv].index_select(0, keys)
                picked = chosen[b, h].index_select(-1, listed).repeat_interleave(size, -1)[:, :keys.shape[0]]
                read = picked & (keys[None, :] <= last[:, None])  # (queries, keys)
                pair_count.add(read[None, None], 1)
                bias = torch.where(read, 0.0, float("-inf")).to(q.dtype)
                o, part = attention_forward(q_far[b:b + 1, h:h + 1, s:e], ks[None, None], vs[None, None],
                                            is_causal=False, scale=scale, attn_bias=bias[None, None])
                if selection.sinks == 0:
                    part = part.masked_fill(reads_none[b:b + 1, h:h + 1], float("-inf"))
                merge_into(out[b:b + 1, h:h + 1, s:e], lse[b:b + 1, h:h + 1, s:e], o, part.to(acc))
    return out.to(q.dtype)
