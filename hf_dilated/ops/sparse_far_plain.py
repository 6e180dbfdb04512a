"""Sparse far keys (docs/contract.md 4.2) on plain layouts, without masks over every key.

One document per row, no padding, positions 0..n-1, causal, no sliding window, q_len == kv_len,
and levels that hold every earlier key (one level of dilation 1 covering the row: the default
conversion's). Then block c is keys c*B .. c*B + B - 1, query i's far keys are j <= i - band, and
everything the selection needs is block arithmetic: per few hundred queries the bounds of their
candidate blocks and each (query, head)'s chosen blocks (far_selection.plain_slots); then, per
chunk of queries, block by block, one product of the (query, head) rows that chose the block
against its B keys. The work is the pairs the selection reads: a call
over the union of a chunk's blocks would read every block any of its queries chose (CPU flash
attention does not skip masked keys; 38 blocks per 64 queries on SmolLM2, for 9 chosen each).
Queries before `window` read every key exactly (one causal call); the band of the others is
local_band.near_plain's. On CUDA the row goes to sparse_far_flex.prefill instead (per chunk of
queries the band's flash call, one FlexAttention call and one compiled merge; same set): there a
launch per block is the cost. Used for prefill without autograd (inference); training takes
sparse_far_train on a GPU and local_band's masked calls elsewhere, which compute the same set.
"""
from __future__ import annotations

import torch

from . import far_selection, pair_count, sparse_far_flex
from .backend import attention_forward
from .far_selection import FarSelection
from .local_band import near_plain
from .merge import merge_dtype, merge_into

FLEX_DEVICES = ("cuda",)  # where the far keys take sparse_far_flex by default (tests widen it)
_MIN_CHUNK = 64  # queries per selection at least
_BOUND_ELEMENTS = 1 << 22  # bounds per selection (heads x queries x blocks) at most: they stay in cache
_PAIR_ELEMENTS = 1 << 26  # chosen (query, head, block) rows x head_dim per chunk of queries at most


def query_chunk(n_heads: int, n_blocks: int) -> int:
    """Queries selected at once: their bounds (heads x queries x blocks) are held together."""
    return max(_MIN_CHUNK, _BOUND_ELEMENTS // (n_heads * n_blocks))


def pair_chunk(n_heads: int, selection: FarSelection, dim: int) -> int:
    """Queries whose chosen blocks are read together: each (query, head) holds a copy of its query
    per block (sinks + top_k of them, ties aside). Few chunks: each loops over the (kv head, block)
    pairs its queries chose."""
    return max(_MIN_CHUNK, _PAIR_ELEMENTS // (n_heads * max(1, selection.sinks + selection.top_k) * dim))


def applies(plain: bool, q, k, segment_lengths, dilation_rates, is_causal, sliding_window) -> bool:
    """Whether a call's rows are this module's (its forward serves them without autograd; with it,
    sparse_far_train on a GPU)."""
    n = k.shape[2]
    return (plain and is_causal and sliding_window is None and q.shape[2] == n
            and any(w >= n and r == 1 for w, r in zip(segment_lengths, dilation_rates)))


def sparse_far_forward(q, k, v, q_far, k_far, window: int, far_band: int | None, selection: FarSelection,
                       scale: float, far_kernel: str | None = None):
    """far_kernel: "blocks" (the products below) or "flex" (sparse_far_flex: one FlexAttention
    call per chunk of queries); None: flex on CUDA (where torch has it), blocks elsewhere. Both
    compute the same set."""
    if far_kernel is None:
        far_kernel = "flex" if q.device.type in FLEX_DEVICES and sparse_far_flex.AVAILABLE else "blocks"
    if far_kernel not in ("blocks", "flex"):
        raise ValueError(f"far_kernel must be 'blocks' or 'flex', got {far_kernel!r}")
    batch, n_heads, n, dim = q.shape
    head = min(n, window)  # queries whose band holds every key before them
    band = window if far_band is None else far_band
    if pair_count.TALLY.active:
        tail = torch.arange(head, n)
        pair_count.TALLY.pairs += n_heads * batch * (head * (head + 1) // 2 + int(torch.clamp(tail + 1, max=band).sum()))
        pair_count.add_call()
    if far_kernel == "flex" and n > window:
        out = sparse_far_flex.prefill(q, k, v, q_far, k_far, head, band, selection, scale)
        if out is not None:
            return out
    acc = merge_dtype(q.dtype)
    out = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)
    o, part = attention_forward(q[:, :, :head], k[:, :, :head], v[:, :, :head], is_causal=True, scale=scale)
    out[:, :, :head], lse[:, :, :head] = o.to(acc), part.to(acc)
    if n <= window:
        return out.to(q.dtype)
    near_plain(q, k, v, out, lse, band, head, scale)
    mn, mx = far_selection.plain_summaries(k_far, selection.block_size, -(-n // selection.block_size))
    for b in range(batch):
        _far_by_block(q_far[b], k_far[b], v[b], out[b], lse[b], head, band, selection, scale,
                      mn[b], mx[b])
    return out.to(q.dtype)


def _far_by_block(q_far, k_far, v, out, lse, start: int, band: int, selection: FarSelection, scale: float, mn, mx):
    """Merge into out/lse (heads, n, d) / (heads, n) of one row the far keys its queries from `start`
    on select, block by block: per chunk of queries, the (kv head, block) pairs some query chose,
    and for each one product of the rows (query, head of that kv head) that chose it against the
    block's B keys. The products read the chosen pairs only (and the masked tail of the block a
    query's band starts in), not the union of a chunk's blocks; each (query, head) then merges its
    blocks' partial softmaxes in one pass, kv head by kv head."""
    n_heads, n, dim = q_far.shape
    kv_heads, n_blocks = k_far.shape[0], mn.shape[1]
    group = n_heads // kv_heads
    size = selection.block_size
    acc = out.dtype
    device = q_far.device
    offsets = torch.arange(size, device=device)
    queries = q_far.reshape(n_heads * n, dim)  # row h * n + i
    # The scale goes on the far keys, once: a query's blocks are gathered per block anyway, and the
    # keys are a fraction of the queries (no scaled copy of every query, hundreds of MB at 32K).
    reach = min(n, (max(0, n - 1 - band) // size + 1) * size)  # the far keys' blocks end here
    keys, values = k_far[:, :reach].to(acc) * scale, v[:, :reach].to(acc)
    summary = far_selection.bound_operands(mn[None], mx[None], group)[0][0]
    chunk = pair_chunk(n_heads, selection, dim)
    select_chunk = query_chunk(n_heads, n_blocks)
    part_out = None
    for s in range(start, n, chunk):
        e = min(n, s + chunk)
        parts = [far_selection.plain_slots(q_far[:, t:min(e, t + select_chunk)], summary, t, band, selection)
                 for t in range(s, e, select_chunk)]
        slots = torch.cat([p[0] for p in parts], 1)  # (heads, queries, sinks + top_k), -1: none
        queries_here, width = e - s, slots.shape[-1]
        slot_head = torch.arange(n_heads, device=device)[:, None, None]
        slot_query = torch.arange(queries_here, device=device)[None, :, None]
        # Each (head, query, slot) as (kv head, block) pair and the offset in the block of the last key
        # it reads (size - 1 or more: the whole block; less: the block its band starts in); slots
        # without a block go to pair `none`, after every real one, which the loop below never reads.
        none = kv_heads * n_blocks
        pair = torch.where(slots >= 0, (slot_head // group) * n_blocks + slots, none).flatten()
        limit = (slot_query + (s - band) - slots * size).flatten()
        row = None  # each entry's (head, query) as head * queries_here + query, where not entry // width
        if any(p[1].numel() for p in parts):  # the rows tied at the k-th bound: every block reaching it
            tied = torch.cat([p[1] + torch.tensor([0, t - s, 0], device=device)
                              for p, t in zip(parts, range(s, e, select_chunk))])
            h, t, c = tied.unbind(1)
            pair = torch.cat([pair, (h // group) * n_blocks + c])
            limit = torch.cat([limit, t + (s - band) - c * size])
            row = torch.cat([torch.arange(slots.numel(), device=device) // width, h * queries_here + t])
        # One sort: (kv head, block) runs, in each the rows whose band starts inside the block first.
        key, order = torch.sort(pair * size + limit.clamp(0, size - 1))  # (no slot: below 0)
        pair, limit = key.div(size, rounding_mode="floor"), key.remainder(size)  # limit clamped to size - 1
        row = order.div(width, rounding_mode="floor") if row is None else row[order]
        if pair_count.TALLY.active:
            pair_count.TALLY.pairs += int((limit[pair < none] + 1).sum())
        # Per (kv head, block): its rows, and how many of them stop inside it: the one read back.
        counts = torch.zeros(2, none + 1, dtype=torch.long, device=device)
        counts[0].index_add_(0, pair, torch.ones_like(pair))
        counts[1].index_add_(0, pair, (limit < size - 1).long())
        counts, partials = counts.tolist()
        head, query = row.div(queries_here, rounding_mode="floor"), row.remainder(queries_here)
        q_row = head * n + query + s  # each entry's row of queries, gathered per block (a copy in cache)
        per_kv_head = [sum(counts[g * n_blocks:(g + 1) * n_blocks]) for g in range(kv_heads)]
        if part_out is None or part_out.shape[0] < max(per_kv_head):
            # each entry's (unnormalised) sum_j e^(s_j - m) v_j, m and sum_j e^(s_j - m), one kv head
            # at a time; one buffer for the call's chunks (the OS zeroes a fresh one page by page)
            part_out = torch.empty(max(per_kv_head), dim, dtype=acc, device=device)
            part_max, part_sum = torch.empty(2, part_out.shape[0], dtype=acc, device=device)
        at = 0
        for g in range(kv_heads):  # its pairs are one run of the sorted rows
            first = at
            for c in range(n_blocks):
                count = counts[g * n_blocks + c]
                if not count:
                    continue
                local = slice(at - first, at - first + count)
                lo, hi = c * size, min(n, (c + 1) * size)
                scores = queries.index_select(0, q_row[at:at + count]).to(acc) @ keys[g, lo:hi].T
                if partials[g * n_blocks + c]:  # the first rows
                    cut = partials[g * n_blocks + c]
                    scores[:cut].masked_fill_(offsets[None, :hi - lo] > limit[at:at + cut, None], float("-inf"))
                top = torch.amax(scores, -1, out=part_max[local])
                scores = scores.sub_(top[:, None]).exp_()
                torch.sum(scores, -1, out=part_sum[local])
                torch.mm(scores, values[g, lo:hi], out=part_out[local])
                at += count
            heads, done = slice(g * group, (g + 1) * group), at - first
            _merge_blocks(out[heads, s:e], lse[heads, s:e], row[first:at] - g * group * queries_here,
                          part_out[:done], part_max[:done], part_sum[:done])


def _merge_blocks(out, lse, row, part_out, part_max, part_sum) -> None:
    """Merge into out/lse (heads, queries, d) / (heads, queries) the partial softmaxes of their
    blocks: part_* of the (head, query) numbered `row` (head * queries + query), each unnormalised
    (sum_j e^(s_j - m) v_j, m, sum_j e^(s_j - m)); a row's lse = M + log sum_t e^(m_t - M) l_t."""
    n_heads, queries, dim = out.shape
    n_rows = n_heads * queries
    top = torch.full((n_rows,), float("-inf"), dtype=part_max.dtype, device=row.device).scatter_reduce_(
        0, row, part_max, "amax")
    weight = torch.exp(part_max - top.index_select(0, row))
    total = torch.zeros(n_rows, dtype=part_max.dtype, device=row.device).index_add_(0, row, part_sum.mul_(weight))
    far_out = torch.zeros(n_rows, dim, dtype=part_out.dtype, device=row.device).index_add_(
        0, row, part_out.mul_(weight[:, None]))
    far_out = far_out.div_(total[:, None]).nan_to_num_(0.0)  # a row with no block: 0, lse -inf
    merge_into(out, lse, far_out.view(n_heads, queries, dim), (top + torch.log(total)).view(n_heads, queries))
