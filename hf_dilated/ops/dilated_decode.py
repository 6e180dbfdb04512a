"""Dilated attention for a few queries against a long cache (a decode step, a few speculative
tokens), exact to docs/contract.md 4 and 4.1, reading only the keys each query may see.

How it is computed. For the query at position p, level g (segment w, dilation r) involves only
the heads of offset o = (p mod w) mod r (h mod r == o), and each of those reads one residue class
of its segment: positions S + o, S + o + r, ... with S = p - p mod w, up to p ("union" stops
level g >= 2 before the query's level-(g-1) sub-segment, whose keys the lower levels already
hold; a local band takes the last `local_window` positions and leaves the levels the keys before
it). When a row's real tokens are one run at consecutive positions (no padding, or left padding:
ops/token_layout.regular_rows), those keys are a *strided view* of the cache,
`k[..., start : stop : r, :]`, so a step plans in O(levels) from p alone and reads
sum_g w_g / r_g keys per participating kv head, not the cache. When every row of the batch is
alike (the usual case), the step's parts are one attention: their cache slots gathered once, a
bias keeping each head to its own parts, one softmax (_gather_plan, _gathered_step: 9 launches a
layer whatever the number of levels) on a GPU, where a decode step is host-bound (GATHERED_ON).
Otherwise (the CPU, or rows that differ), per (query, level) one small attention over the view
gives (out, lse), merged by log-sum-exp (merge.py) into the query's participating heads. Heads that read the same class from one kv head stay batched: with r
dividing the group size they are the kv head's heads o, o + r, ...; with the group size dividing
r they sit on kv heads o // G, o // G + r / G, ... (a strided view of the kv heads too).

Rows that are not regular (holes in the mask, packed documents, right padding) return None: the
caller runs the general path. `COUNTS` tallies both outcomes so that a benchmark can say how
often its layouts fell back.
"""
from __future__ import annotations

from array import array

import torch

from .head_groups import head_group_bounds
from .merge import merge_dtype, merge_into, merge_partial
from .plan_cache import PlanCache
from .token_layout import regular_rows

COUNTS = {"strided": 0, "fallback": 0}
# Where a step whose rows are alike takes one gathered attention for all its parts: on a GPU a step
# is host-bound (launches), on the CPU it is bound by memory, and the gather copies what the
# strided views read in place (float32 at 128K: 92 ms a step where the views took 18).
GATHERED_ON = ("cuda",)


def dilated_decode(q, k, v, seg, dil, mode, *, scale, attention_mask=None, position_ids=None,
                   sliding_window=None, local_window=None, q_far=None, k_far=None):
    """Inputs as `dilated_attention` (validated there; causal, no dropout, q_len < kv_len).
    Returns the output, or None when some row is not regular."""
    batch, kv_len = k.shape[0], k.shape[2]
    rows = regular_rows(batch, kv_len, k.device, attention_mask, position_ids)
    q_len = q.shape[2]
    if rows is None or min(rows[0]) > kv_len - q_len:  # a padded query: not one run to the end
        COUNTS["fallback"] += 1
        return None
    COUNTS["strided"] += 1
    first, shift = rows
    if q_len == 1 and len(set(zip(first, shift))) == 1:
        parts = _parts(kv_len - 1, first[0], shift[0], q.shape[1], k.shape[1], seg, dil, mode, sliding_window,
                       local_window)
        if len(parts) == 1 and parts[0].step == 1 and parts[0].n_heads == q.shape[1] and not parts[0].far:
            # One run of keys read by every head (a context within the first segment, or the band):
            # dense attention over it, one fused call, as sdpa runs a step (heads packed per kv head).
            return _dense_step(q, k, v, parts[0], scale)
    far = (q, k) if q_far is None else (q_far, k_far)
    alike = len(set(zip(first, shift))) == 1
    if alike and q.device.type in GATHERED_ON:  # one gathered attention for all parts
        key = (kv_len, q_len, first[0], shift[0], q.shape[1], k.shape[1], tuple(seg), tuple(dil), mode,
               sliding_window, local_window, str(q.device))
        plan = _PLANS.get(key, None, None)  # every layer of a step has the same one
        if plan is None:
            plan = _gather_plan([_parts(kv_len - q_len + t, first[0], shift[0], q.shape[1], k.shape[1], seg, dil, mode,
                                        sliding_window, local_window) for t in range(q_len)], q.shape[1], q.device)
            _PLANS.put(key, None, None, plan)
        return _gathered_step(q, k, v, *far, *plan, scale)
    acc = torch.zeros(q.shape, dtype=merge_dtype(q.dtype), device=q.device)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=acc.dtype, device=q.device)
    groups = [list(range(batch))] if alike else [[b] for b in range(batch)]
    for rows_ in groups:
        b = slice(rows_[0], rows_[-1] + 1)
        for t in range(q_len):
            index = kv_len - q_len + t
            for part in _parts(index, first[rows_[0]], shift[rows_[0]], q.shape[1], k.shape[1], seg, dil, mode,
                               sliding_window, local_window):
                qq, kk = far if part.far else (q, k)
                _attend(acc[b, :, t], lse[b, :, t], qq[b, :, t], kk[b], v[b], part, scale)
    return acc.to(q.dtype)


class _Part:
    """Keys start, start + step, ... (count of them) of the cache, read by the query heads
    h0, h0 + h_step, ... (n_heads of them); `far`: scored with q_far / k_far."""

    __slots__ = ("start", "step", "count", "h0", "h_step", "n_heads", "far")

    def __init__(self, start, step, count, h0, h_step, n_heads, far):
        self.start, self.step, self.count = start, step, count
        self.h0, self.h_step, self.n_heads, self.far = h0, h_step, n_heads, far


def _parts(index, first, shift, q_heads, kv_heads, seg, dil, mode, sliding_window, local_window):
    """The key runs the query at cache index `index` reads (docs/contract.md 4, 4.1), disjoint
    for "union" (a key once), one per level for "longnet" (a multiset)."""
    p = index + shift
    lowest = max(first, 0 if sliding_window is None else index - sliding_window + 1)  # first visible index
    parts = []
    levels_end = index  # last index the levels read: all, or the keys before a band
    if local_window is not None:
        start = max(lowest, index - local_window + 1)
        parts.append(_Part(start, 1, index - start + 1, 0, 1, q_heads, False))
        levels_end = index - local_window
    if mode == "head_groups":
        bounds = head_group_bounds(q_heads, len(seg))
    for g, (w, r) in enumerate(zip(seg, dil)):
        o = (p % w) % r
        lo_h, hi_h = bounds[g] if mode == "head_groups" else (0, q_heads)
        h0 = lo_h + (o - lo_h) % r  # first head of offset o in [lo_h, hi_h)
        if h0 >= hi_h:
            continue
        n_heads = (hi_h - 1 - h0) // r + 1
        end = levels_end
        if mode == "union" and g > 0:
            end = min(end, index - p % seg[g - 1] - 1)  # before the query's level-(g-1) sub-segment
        start = index - p % w + o  # the first key of offset o in the query's segment
        if start < lowest:
            start += -(-(lowest - start) // r) * r
        if end < start:
            continue
        parts.append(_Part(start, r, (end - start) // r + 1, h0, r, n_heads, local_window is not None))
    return parts


def _dense_step(q, k, v, part: _Part, scale):
    batch, q_heads, _, dim = q.shape
    kv_heads = k.shape[1]
    keys = slice(part.start, part.start + part.count)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.reshape(batch, kv_heads, q_heads // kv_heads, dim), k[:, :, keys], v[:, :, keys], scale=scale)
    # Not .view: the CUDA kernels return (batch, kv_heads, group, dim) laid out sequence-major,
    # (batch, group, kv_heads, dim) in memory, whose heads do not flatten into one dimension.
    return out.reshape(batch, q_heads, 1, dim)


# The last steps' gather plans, by their Python integers (built on the host, copied to the device
# once, without waiting for the device).
_PLANS = PlanCache(size=2)


def _gather_plan(parts_by_query: list[list[_Part]], q_heads: int, device):
    """(index, n_near, bias, keep) of a step's parts (parts_by_query[t]: query t's): index (keys,)
    the cache slots every part reads, those scored with q / k first (n_near of them), then those
    scored with q_far / k_far; bias (q_heads, q_len, keys) float32, 0 where the query head reads
    the column (its query's part, one of the part's heads), -inf elsewhere; keep None, or (q_heads
    * q_len, 1) 0 for the (head, query) pairs that read no key. The host sends a table of the parts
    (a few integers each, in one copy) and the device spreads it into the columns (a dozen launches,
    once a step: every layer shares the plan). Built column by column on the host, its work and its
    copy grew with the keys: on this project's CPU, with its tensor ops on the meta device (a GPU
    host's bill), 0.50 ms a step at 5,049 keys and 0.98 at 14,237 (union levels from 4,096 at 19K and
    128K); 0.46-0.48 at both now, run one after the other, alone. On an H200 a union levels step took
    3.7-5.2 ms at 16K (2026-11-27)."""
    q_len = len(parts_by_query)
    parts = [part for query_parts in parts_by_query for part in query_parts]  # numbered in this order
    reads = [[0] * (q_len * q_heads) for _ in parts]  # per part: the (query, head) pairs that read it
    reads_some = [0] * (q_len * q_heads)
    i = 0
    for t, query_parts in enumerate(parts_by_query):
        for part in query_parts:
            for h in range(part.h0, part.h0 + (part.n_heads - 1) * part.h_step + 1, part.h_step):
                reads[i][t * q_heads + h] = reads_some[t * q_heads + h] = 1
            i += 1
    columns = [i for i, part in enumerate(parts) if not part.far] + [i for i, part in enumerate(parts) if part.far]
    starts, steps, counts = [p.start for p in parts], [p.step for p in parts], [p.count for p in parts]
    # A (head, query) that reads no key (head_groups: a level of other heads' only) gets output 0,
    # as the merge gives it: it reads one column of its own (a softmax over none would be NaN, and
    # so would its gradient), then its output is multiplied by 0.
    some_read_none = not all(reads_some)
    if some_read_none:
        columns.append(len(parts))
        reads.append([1 - r for r in reads_some])
        starts, steps, counts = starts + [0], steps + [1], counts + [1]
    n_near = sum(counts[i] for i in columns if i < len(parts) and not parts[i].far)
    first_column, at = [0] * len(counts), 0  # each part's first column
    for i in columns:
        first_column[i], at = at, at + counts[i]
    n = at
    # One tensor over host memory (no torch op on the host), one copy to the device: pinned on
    # CUDA, so the copy is queued behind the device's work, not waited for.
    # column c of part i reads slot start_i + step_i (c - first_column_i) = base_i + step_i c
    base = [start - step * first for start, step, first in zip(starts, steps, first_column)]
    table = array("q", base + steps + columns + [counts[i] for i in columns])
    for row in reads:
        table.extend(row)
    packed = torch.frombuffer(table, dtype=torch.long)
    packed = packed.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else packed.to(device)
    m = len(counts)
    base, step, order, ordered_counts = packed[:4 * m].split([m, m, m, m])
    owner = torch.repeat_interleave(order, ordered_counts, output_size=n)  # each column's part
    index = base[owner] + step[owner] * torch.arange(n, device=device)
    reads = packed[4 * m:].view(m, q_len, q_heads)
    bias = torch.zeros((), device=device).masked_fill(reads.index_select(0, owner) == 0, float("-inf"))
    keep = (reads[:-1].sum(0) > 0).T.reshape(-1, 1).float() if some_read_none else None  # (q_heads * q_len, 1)
    return index, n_near, bias.permute(2, 1, 0).contiguous(), keep  # bias (q_heads, q_len, keys)


def _gathered_step(q, k, v, q_far, k_far, index, n_near: int, bias, keep, scale):
    """Every query's parts in one attention: the cache rows `index` gathered once (near columns
    scored with q / k, far ones with q_far / k_far), the bias keeping each head to its own parts, one
    softmax. A few launches a layer whatever the number of levels (one small attention and a merge
    per level before: 5 levels took 1.1 ms a layer at 32K on an H200, host-bound)."""
    batch, q_heads, q_len, dim = q.shape
    kv_heads = k.shape[1]
    rows = (q_heads // kv_heads) * q_len  # per kv head: (head in group, query)
    scores = []
    for qq, kk, cols in ((q, k, index[:n_near]), (q_far, k_far, index[n_near:])):
        if cols.numel():
            scores.append(torch.matmul(qq.reshape(batch, kv_heads, rows, dim), kk.index_select(2, cols).transpose(-1, -2)))
    scores = scores[0] if len(scores) == 1 else torch.cat(scores, -1)
    acc = merge_dtype(q.dtype)
    scores = scores.to(acc) * scale + bias.view(kv_heads, rows, -1)
    out = torch.matmul(torch.softmax(scores, -1).to(v.dtype), v.index_select(2, index))  # (batch, kv_heads, rows, dim)
    if keep is not None:
        out = out * keep.view(kv_heads, rows, 1).to(out.dtype)
    return out.view(batch, q_heads, q_len, dim)


def _attend(acc, lse, q, k, v, part: _Part, scale):
    """Merges one part into acc (rows, heads, d) / lse (rows, heads): q (rows, heads, d), k and v
    (rows, kv_heads, n, d), all views."""
    group = q.shape[1] // k.shape[1]
    h0, hs, nh = part.h0, part.h_step, part.n_heads
    stop = part.start + (part.count - 1) * part.step + 1
    keys, values = k[:, :, part.start:stop:part.step], v[:, :, part.start:stop:part.step]
    heads = slice(h0, h0 + (nh - 1) * hs + 1, hs)
    qh = q[:, heads]  # (rows, nh, d)
    if group % hs == 0 and h0 % group < hs and nh % (group // hs) == 0:
        # the heads of one kv head that read this class are consecutive in `heads`
        per_kv = group // hs
        kv = slice(h0 // group, h0 // group + nh // per_kv)
        qh = qh.unflatten(1, (nh // per_kv, per_kv))  # (rows, kv, per_kv, d)
        keys, values = keys[:, kv], values[:, kv]
    elif hs % group == 0:  # one head per kv head, on kv heads h0 // G, h0 // G + hs / G, ...
        kv0, ks = h0 // group, hs // group
        qh = qh.unsqueeze(2)  # (rows, nh, 1, d)
        keys, values = keys[:, kv0:kv0 + (nh - 1) * ks + 1:ks], values[:, kv0:kv0 + (nh - 1) * ks + 1:ks]
    else:
        kv = torch.arange(h0, h0 + (nh - 1) * hs + 1, hs, device=q.device) // group
        qh = qh.unsqueeze(2)
        keys, values = keys.index_select(1, kv), values.index_select(1, kv)
    scores = torch.matmul(qh, keys.transpose(-1, -2)).to(acc.dtype) * scale  # (rows, kv, per_kv, n)
    part_lse = torch.logsumexp(scores, -1)
    probs = torch.exp(scores - part_lse.unsqueeze(-1)).to(values.dtype)
    out = torch.matmul(probs, values)  # (rows, kv, per_kv, d)
    out, part_lse = out.flatten(1, 2), part_lse.flatten(1, 2)
    if torch.is_grad_enabled() and (out.requires_grad or acc.requires_grad):
        # merge_into writes through out=, which autograd refuses: merge copies out of place (the
        # backward keeps them), then write the result in
        out, part_lse = merge_partial(acc[:, heads].clone(), lse[:, heads].clone(), out, part_lse)
        acc[:, heads], lse[:, heads] = out, part_lse
    else:
        merge_into(acc[:, heads], lse[:, heads], out, part_lse)


# --- the same with static shapes, for torch.compile ------------------------------------------


def dilated_decode_static(q, k, v, seg, dil, mode, *, scale, real, seen, local_window=None, q_far=None, k_far=None,
                          sliding_window=None):
    """`dilated_decode` for a compiled decode step against a static cache: no Python value depends
    on tensor data, so `torch.compile(fullgraph=True)` traces it once for every step.

    k, v hold `kv_len` cache slots of which the first `seen` (a 0-d tensor) are written; the q_len
    queries are slots seen - q_len .. seen - 1. `real` (batch, kv_len) bool marks the written slots
    that hold tokens; positions are mask ranks (one document per row, docs/contract.md 3.2). Per
    level the query's w / r candidate keys (positions S + o + m r) are found with a search over the
    running count of real tokens, so holes in the mask are exact too, and gathered for every kv head
    (which heads take part is data, so each level reads w / r rows of every kv head); keys past the
    level's end and heads of another offset are masked."""
    batch, q_heads, q_len, dim = q.shape
    kv_heads = k.shape[1]
    group = q_heads // kv_heads
    count = real.long().cumsum(-1)  # (batch, kv_len): real tokens up to each slot
    acc = q.new_zeros(q.shape, dtype=merge_dtype(q.dtype))
    lse = torch.full(q.shape[:3], float("-inf"), dtype=acc.dtype, device=q.device)
    heads = torch.arange(q_heads, device=q.device)
    bounds = head_group_bounds(q_heads, len(seg)) if mode == "head_groups" else [(0, q_heads)] * len(seg)
    far = (q, k) if q_far is None else (q_far, k_far)
    outs, lses = [], []
    for t in range(q_len):
        index = torch.as_tensor(seen - q_len + t, device=q.device)  # 0-d tensor: the query's slot
        p = count.index_select(1, index.reshape(1)).squeeze(1) - 1  # (batch,) its position
        lowest = None if sliding_window is None else index - sliding_window + 1
        parts = []  # (first candidate position (batch,), count, step, end position (batch,), head mask, far)
        levels_end = p
        if local_window is not None:
            parts.append((p - local_window + 1, local_window, 1, p, None, False))
            levels_end = p - local_window
        for g, (w, r) in enumerate(zip(seg, dil)):
            o = (p % w) % r
            end = levels_end
            if mode == "union" and g > 0:
                end = torch.minimum(end, p - p % seg[g - 1] - 1)
            lo, hi = bounds[g]
            takes_part = ((heads[None, :] % r) == o[:, None]) & (heads >= lo) & (heads < hi)  # (batch, q_heads)
            parts.append((p - p % w + o, w // r, r, end, takes_part, local_window is not None))
        out_t = acc[:, :, t]
        lse_t = lse[:, :, t]
        for start, n, step, end, takes_part, is_far in parts:
            qq, kk = far if is_far else (q, k)
            pos = start[:, None] + step * torch.arange(n, device=q.device)  # (batch, n) candidate positions
            slot = torch.searchsorted(count, pos + 1).clamp(max=k.shape[2] - 1)  # first slot holding rank pos
            ok = (pos >= 0) & (pos <= end[:, None]) & (slot < seen)
            if lowest is not None:
                ok &= slot >= lowest
            gather = slot[:, None, :, None].expand(batch, kv_heads, n, dim)
            keys, values = kk.gather(2, gather), v.gather(2, gather)
            scores = torch.matmul(qq[:, :, t].unflatten(1, (kv_heads, group)), keys.transpose(-1, -2))
            scores = scores.to(acc.dtype) * scale  # (batch, kv_heads, group, n)
            mask = ok[:, None, None, :]
            if takes_part is not None:
                mask = mask & takes_part.view(batch, kv_heads, group, 1)
            scores = scores.masked_fill(~mask, float("-inf"))
            part_lse = torch.logsumexp(scores, -1)  # -inf where no key
            probs = torch.exp(scores - part_lse.nan_to_num(neginf=0.0).unsqueeze(-1)).to(values.dtype)
            part_out = torch.matmul(probs, values).flatten(1, 2)
            out_t, lse_t = merge_partial(out_t, lse_t, part_out, part_lse.flatten(1, 2))
        outs.append(out_t)
        lses.append(lse_t)
    return torch.stack(outs, 2).to(q.dtype)
