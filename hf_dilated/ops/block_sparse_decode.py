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

from .block_patterns import (AdaptivePattern, CustomPattern, DilatedPattern, GlobalLocalPattern, HierarchicalPattern,
                             LocalPattern)
from .merge import merge_dtype
from .plan_cache import PlanCache
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
            runs = _visible_runs(pattern, index, first[b], shift[b], block_size, sliding_window)
            if not runs:
                continue  # no allowed key: output 0 (docs/contract.md 5)
            # (kv_heads, n, d): a view for one run of keys, else the runs joined in order
            kb, vb = (x[b, :, runs[0][0]:runs[0][1]] if len(runs) == 1
                      else torch.cat([x[b, :, lo:hi] for lo, hi in runs], 1) for x in (k, v))
            qb = q[b, :, t].unflatten(0, (k.shape[1], group))  # (kv_heads, group, d)
            scores = torch.matmul(qb, kb.transpose(-1, -2)).to(out.dtype) * scale
            probs = torch.softmax(scores, -1).to(vb.dtype)
            out[b, :, t] = torch.matmul(probs, vb).flatten(0, 1).to(out.dtype)
    return out.to(q.dtype)


def _visible_runs(pattern, index, first, shift, block_size, sliding_window):
    """Runs [lo, hi) of the cache indices the query at `index` reads, in order, as Python ints:
    planned from the query's position alone (no tensor is read, so no device synchronisation)."""
    p = index + shift
    lowest = max(first, 0 if sliding_window is None else index - sliding_window + 1)
    runs = []
    for bk in allowed_blocks(pattern, p // block_size):
        lo, hi = max(bk * block_size - shift, lowest), min((bk + 1) * block_size - shift, index + 1)
        if lo >= hi:
            continue
        if runs and runs[-1][1] == lo:
            runs[-1][1] = hi
        else:
            runs.append([lo, hi])
    return runs


def allowed_blocks(pattern, bq: int) -> list[int]:
    """The key blocks bk <= bq that `pattern` allows for query block bq, ascending, as Python ints
    (block_patterns.py's rules, evaluated on integers; a custom layout is read once per version)."""
    if isinstance(pattern, CustomPattern):
        return [bk for bk, ok in enumerate(_custom_rows(pattern)[bq][: bq + 1]) if ok]
    rule = _RULES.get(type(pattern))
    if rule is None:  # a pattern type without an integer rule: its tensor rule, on the host
        row = pattern.block_layout(torch.tensor([bq]), bq + 1)[0, 0, 0]
        return [bk for bk, ok in enumerate(row.tolist()) if ok]
    return [bk for bk in range(bq + 1) if rule(pattern, bq - bk, bk)]


def _dilated_rule(pattern, d, bk):
    return d < pattern.window or d % pattern.stride == 0


_RULES = {  # whether key block bk at distance d = bq - bk >= 0 is allowed (block_patterns.py)
    LocalPattern: lambda pattern, d, bk: d < pattern.window,
    DilatedPattern: _dilated_rule,
    GlobalLocalPattern: lambda pattern, d, bk: bk < pattern.global_blocks or d < pattern.window,
    HierarchicalPattern: lambda pattern, d, bk: any(_dilated_rule(level, d, bk) for level in pattern.levels),
}

_CUSTOM_ROWS = PlanCache()


def _custom_rows(pattern: CustomPattern) -> list:
    """pattern.layout[0] as nested Python lists, read from the device once per layout version."""
    rows = _CUSTOM_ROWS.get(id(pattern), pattern.layout, None)
    if rows is None:
        rows = pattern.layout[0].tolist()
        _CUSTOM_ROWS.put(id(pattern), pattern.layout, None, rows)
    return rows


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
