"""Block-sparse attention for a few queries against a long cache (a decode step, a few
speculative tokens), exact to docs/contract.md 5, reading only the key blocks each query may see.

How it is computed. When a row's real tokens are one run at consecutive positions
(ops/token_layout.regular_rows: no padding, or left padding), block number bk holds the keys at
positions [bk * block_size, (bk + 1) * block_size), i.e. one run of cache indices. The query at
position p is in block p // block_size; its layout row (from the pattern, O(blocks) work) names
the allowed blocks, whose keys (up to p, within a sliding window) are gathered once per kv head
and read by the kv head's query heads together: cost O(allowed blocks x block_size), not the
cache. Patterns with a per-head layout (adaptive, a custom layout with a head axis) and rows that
are not regular return None, and the caller runs the general path; `COUNTS` tallies both.
"""
from __future__ import annotations

import torch

from .block_patterns import AdaptivePattern, CustomPattern
from .merge import merge_dtype
from .token_layout import regular_rows

COUNTS = {"gathered": 0, "fallback": 0}


def block_sparse_decode(q, k, v, pattern, *, block_size, scale, attention_mask=None, position_ids=None,
                        sliding_window=None):
    """Inputs as `block_sparse_attention` (validated there; causal, q_len < kv_len). Returns the
    output, or None when the general path must run."""
    batch, kv_len, q_len = k.shape[0], k.shape[2], q.shape[2]
    rows = None
    if not isinstance(pattern, AdaptivePattern) and not (isinstance(pattern, CustomPattern)
                                                         and pattern.layout.shape[0] > 1):
        rows = regular_rows(batch, kv_len, k.device, attention_mask, position_ids)
    if rows is None or min(rows[0]) > kv_len - q_len:
        COUNTS["fallback"] += 1
        return None
    first, shift = rows
    if min(f + s for f, s in zip(first, shift)) < 0:
        return None  # negative positions: the general path raises its error
    num_blocks = max(kv_len - 1 + s for s in shift) // block_size + 1  # as the general path counts them
    if isinstance(pattern, CustomPattern) and min(pattern.layout.shape[1:]) < num_blocks:
        return None  # the general path raises its error
    COUNTS["gathered"] += 1
    group = q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape, dtype=merge_dtype(q.dtype), device=q.device)
    for b in range(batch):
        for t in range(q_len):
            index = kv_len - q_len + t
            keys = _visible_keys(pattern, index, first[b], shift[b], block_size, num_blocks, sliding_window, q.device)
            if keys.numel() == 0:
                continue  # no allowed key: output 0 (docs/contract.md 5)
            kb, vb = k[b].index_select(1, keys), v[b].index_select(1, keys)  # (kv_heads, n, d)
            qb = q[b, :, t].unflatten(0, (k.shape[1], group))  # (kv_heads, group, d)
            scores = torch.matmul(qb, kb.transpose(-1, -2)).to(out.dtype) * scale
            probs = torch.softmax(scores, -1).to(vb.dtype)
            out[b, :, t] = torch.matmul(probs, vb).flatten(0, 1).to(out.dtype)
    return out.to(q.dtype)


def _visible_keys(pattern, index, first, shift, block_size, num_blocks, sliding_window, device):
    """Cache indices of the keys the query at `index` reads, in order."""
    p = index + shift
    bq = p // block_size
    if isinstance(pattern, CustomPattern):
        row = pattern.layout[0, bq, : bq + 1].to(device)
    else:
        row = pattern.block_layout(torch.tensor([bq], device=device), num_blocks)[0, 0, 0, : bq + 1]
    lowest = max(first, 0 if sliding_window is None else index - sliding_window + 1)
    starts = row.nonzero().squeeze(1) * block_size - shift  # cache index of each allowed block's first key
    offsets = torch.arange(block_size, device=device)
    keys = (starts[:, None] + offsets).reshape(-1)
    return keys[(keys >= lowest) & (keys <= index)]


def block_sparse_decode_static(q, k, v, pattern, *, block_size, scale, real, seen, sliding_window=None):
    """`block_sparse_decode` for a compiled decode step against a static cache (see
    dilated_decode.dilated_decode_static for the inputs): no Python value depends on tensor data.
    Static shapes cannot name the allowed blocks, so every cache slot is scored and the layout,
    read at each slot's block number, masks it: exact, at dense cost. Patterns with a per-head
    layout are refused."""
    if isinstance(pattern, AdaptivePattern) or (isinstance(pattern, CustomPattern) and pattern.layout.shape[0] > 1):
        raise NotImplementedError(f"pattern: a compiled decode step supports layouts shared by all heads, not "
                                  f"{type(pattern).__name__} with a head axis")
    batch, q_heads, q_len, dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    count = real.long().cumsum(-1)
    key_block = (count - 1).clamp(min=0) // block_size  # (batch, kv_len) block number of each slot
    slots = torch.arange(kv_len, device=q.device)
    outs = []
    for t in range(q_len):
        index = torch.as_tensor(seen - q_len + t, device=q.device)
        query_block = (count.index_select(1, index.reshape(1)).squeeze(1) - 1) // block_size  # (batch,)
        if isinstance(pattern, CustomPattern):
            rows = pattern.layout[0].to(q.device)[query_block]  # (batch, key blocks)
        else:
            rows = pattern.block_layout(query_block, kv_len // block_size + 1)[0, 0]
        visible = rows.gather(1, key_block.clamp(max=rows.shape[1] - 1)) & real & (slots <= index)
        if sliding_window is not None:
            visible &= slots > index - sliding_window
        scores = torch.matmul(q[:, :, t].unflatten(1, (kv_heads, q_heads // kv_heads)), k.transpose(-1, -2))
        scores = scores.to(merge_dtype(q.dtype)) * scale  # (batch, kv_heads, group, kv_len)
        scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, -1).nan_to_num(0.0).to(v.dtype)  # a row with no key: output 0
        outs.append(torch.matmul(probs, v).flatten(1, 2))
    return torch.stack(outs, 2).to(q.dtype)
