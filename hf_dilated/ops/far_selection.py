"""Sparse far keys (docs/contract.md 4.2): which far keys of a local band a query reads.

The band's far keys (docs/contract.md 4.1) are cut into blocks of `block_size` positions of their
document (block c holds positions c * B .. c * B + B - 1). A query reads the far keys of the first
`sinks` blocks of its document always (the attention sinks a pretrained model leans on) and of the
`top_k` other blocks whose bound on its best far score is highest. The bound is Quest's (Tang et
al., 2024): with mn, mx the elementwise min and max of a block's far keys (k_far, over all its real
tokens; under a sliding window, the block a query's window starts in over the keys it shows),
max_j q . k_j <= sum_d max(q_d mn_d, q_d mx_d) = relu(q) . mx + min(q, 0) . mn, two matrix
products per query and block. Ties at the k-th bound all count (the set is "every candidate
whose bound is at least the k-th largest"), so the set does not depend on a sort's order.

The selection is per query (and head), from its own far query and summaries of keys before its
band, so it is causal and a decode step computes the same set as a prefill. It is not
differentiated (like the `adaptive` block pattern): the attention over the selected keys is.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..checks import check_int
from .merge import merge_dtype


@dataclass(frozen=True)
class FarSelection:
    """The selection of far keys (DilatedConfig.far_top_k, far_block_size, far_sinks)."""

    top_k: int
    block_size: int
    sinks: int

    def __post_init__(self):
        check_int("far_top_k", self.top_k, minimum=0)
        check_int("far_block_size", self.block_size)
        check_int("far_sinks", self.sinks, minimum=0)


def band_widths(query_positions: torch.Tensor, local_window: int, far_band: int | None) -> torch.Tensor:
    """The band width of each query (docs/contract.md 4.2): `local_window` for a query at a position
    before it (its band holds its whole document: it reads as the model was trained), `far_band`
    (default `local_window`) for the others."""
    if far_band is None or far_band == local_window:
        return torch.full_like(query_positions, local_window)
    return torch.where(query_positions < local_window, local_window, far_band)


@dataclass
class Blocks:
    """The far blocks of a layout: id[b, j] the block of key j in its row (-1: padding), blocks
    numbered per row in key order; number[b, c] its block number within its document (position // B)."""

    id: torch.Tensor  # (batch, kv_len) int64
    number: torch.Tensor  # (batch, n_blocks) int64; -1 past the row's last block
    count: int  # n_blocks: the most blocks of any row


def blocks_of(positions: torch.Tensor, real: torch.Tensor, doc: torch.Tensor, block_size: int) -> Blocks:
    """The blocks of every key (one read of the block count to the host)."""
    number = torch.div(positions, block_size, rounding_mode="floor")
    # A real key starts a block when its (document, number) differs from the last real key's before
    # it: padding neither starts nor ends one (positions advance within a document, 3.1).
    key = number * (int(doc.max()) + 1 if doc.numel() else 1) + doc
    index = torch.arange(real.shape[1], device=real.device).expand_as(key)
    last_real = torch.where(real, index, -1).cummax(1).values
    before = torch.cat([torch.full_like(last_real[:, :1], -1), last_real[:, :-1]], 1)
    prev = torch.where(before >= 0, key.gather(1, before.clamp(min=0)), -1)
    new = real & ((key != prev) | (before < 0))
    ids = new.long().cumsum(1) - 1
    ids = torch.where(real, ids, -1)
    count = int(ids.max()) + 1 if ids.numel() else 0
    count = max(count, 1)
    numbers = torch.full((key.shape[0], count + 1), -1, dtype=torch.long, device=key.device)
    numbers.scatter_(1, torch.where(real, ids, count), torch.where(real, number, -1))
    return Blocks(ids, numbers[:, :count], count)


def plain_summaries(k_far: torch.Tensor, block_size: int, n_blocks: int,
                    dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """summaries() of plain rows (block c: keys c * B .. c * B + B - 1), by one reshape instead of
    a scatter; n_blocks * B >= the keys, blocks past the last key (+inf / -inf) never selected.
    dtype: theirs (default bound_dtype; product_dtype's keeps the keys' own: a minimum or maximum
    is one of the values, so either holds the same numbers)."""
    batch, kv_heads, n, dim = k_far.shape
    src = k_far.to(dtype or bound_dtype(k_far.dtype))

    def blocks(fill):  # (batch, kv_heads, n_blocks, B, d), the keys past the last one `fill`
        padded = torch.nn.functional.pad(src, (0, 0, 0, n_blocks * block_size - n), value=fill)
        return padded.view(batch, kv_heads, n_blocks, block_size, dim)

    return blocks(float("inf")).amin(3), blocks(float("-inf")).amax(3)


def bound_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype every path computes summaries and bounds in (float64 inputs: float64, else float32),
    so that they rank blocks alike."""
    return merge_dtype(dtype)


# torch.bmm(..., out_dtype=torch.float32) of 16-bit floats on CUDA (torch >= 2.8): their products on the
# tensor cores, summed and returned in float32.
_SUMS_IN_FLOAT32 = "dtype" in torch.ops.aten.bmm.overloads()
_SIXTEEN_BIT = (torch.float16, torch.bfloat16)


def product_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The dtype bounds() multiplies queries and summaries of far keys of `dtype` in: theirs where the
    products are exact and summed in float32 (16-bit floats on NVIDIA's CUDA: two 8- or 11-bit
    significands make at most 22 bits, which float32 holds, and the tensor cores sum in float32),
    else bound_dtype. The same bounds either way up to float32's rounding of the sums (which 4.2
    allows): a summary is a minimum or maximum of the keys, so one of their values, and a query of
    that dtype is too (finite values, and products within float32's range, as float32's own products
    need). Not float16 where torch.backends.cuda.matmul.allow_fp16_accumulation is set (torch then
    refuses a float32 output), nor on ROCm (not tried). On an H200 (2026-11-26/27) the float32
    products, off the tensor cores, took 3.0 of a 16K prefill's 59.5 ms of GPU time and 48 of 281
    at 64K: they grow with the square of the length."""
    if (device.type == "cuda" and dtype in _SIXTEEN_BIT and _SUMS_IN_FLOAT32 and torch.version.hip is None
            and not (dtype == torch.float16 and _fp16_accumulation())):
        return dtype
    return bound_dtype(dtype)


def _fp16_accumulation() -> bool:
    """torch.backends.cuda.matmul.allow_fp16_accumulation, read eagerly only: dynamo cannot trace its
    getter, and a compiled plan calling bounds() broke into three graphs on float16 (one of them
    bounds() alone, shared by every length and shape: past dynamo's limit it ran eagerly). Compiled,
    bounds() trusts the 16-bit summaries its eager caller made by product_dtype (sparse_far_flex.prefill)."""
    if torch.compiler.is_compiling():
        return False
    return getattr(torch.backends.cuda.matmul, "allow_fp16_accumulation", False)


def summaries(k_far: torch.Tensor, blocks: Blocks) -> tuple[torch.Tensor, torch.Tensor]:
    """(mn, mx), each (batch, kv_heads, n_blocks, head_dim) in bound_dtype: the elementwise min and
    max of each block's far keys (rows of blocks past a row's last: +inf / -inf, never selected)."""
    batch, kv_heads, _, dim = k_far.shape
    dtype = bound_dtype(k_far.dtype)
    n = blocks.count
    index = torch.where(blocks.id >= 0, blocks.id, n)[:, None, :, None].expand(batch, kv_heads, -1, dim)
    src = k_far.to(dtype)
    mn = torch.full((batch, kv_heads, n + 1, dim), float("inf"), dtype=dtype, device=k_far.device)
    mx = torch.full((batch, kv_heads, n + 1, dim), float("-inf"), dtype=dtype, device=k_far.device)
    mn.scatter_reduce_(2, index, src, "amin")
    mx.scatter_reduce_(2, index, src, "amax")
    return mn[:, :, :n], mx[:, :, :n]


def slot_table(blocks: Blocks, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """(batch, n_blocks, block_size) int64: the index of the key at each position of each block (slot
    position % block_size: positions rise within a document, 3.1, so a block holds each at most once), -1 none."""
    batch, kv_len = blocks.id.shape
    size = blocks.count * block_size
    slot = torch.where(blocks.id >= 0, blocks.id * block_size + positions % block_size, size)  # padding: a spare
    table = torch.full((batch, size + 1), -1, dtype=torch.long, device=blocks.id.device)
    table.scatter_(1, slot, torch.arange(kv_len, device=blocks.id.device).expand(batch, kv_len))
    return table[:, :size].view(batch, blocks.count, block_size)


def window_edges(blocks: Blocks, real: torch.Tensor, first_shown: torch.Tensor) -> torch.Tensor:
    """(batch, queries) int64: under a sliding window (docs/contract.md 3.3), the block each query's
    window starts in, that of the first real key at an index >= first_shown (queries,), the first
    index the window shows (i - W + 1; at most 0: it hides nothing). -1: no such key."""
    batch, kv_len = real.shape
    index = torch.arange(kv_len, device=real.device)
    after = torch.where(real, index, kv_len).flip(1).cummin(1).values.flip(1)  # the first real index >= j
    after = torch.cat([after, after.new_full((batch, 1), kv_len)], 1)
    at = after.gather(1, first_shown.clamp(0, kv_len)[None].expand(batch, -1))
    return torch.cat([blocks.id, blocks.id.new_full((batch, 1), -1)], 1).gather(1, at)


def window_edge_keys(blocks: Blocks, real: torch.Tensor, table: torch.Tensor, first_shown: torch.Tensor):
    """(edge, slots, shown) of queries whose windows show keys from first_shown (queries,) on: the
    block each window starts in (window_edges), its keys by position (batch, queries, B; from
    slot_table `table`; -1 none) and which of them the window shows (bool, like slots)."""
    edge = window_edges(blocks, real, first_shown)
    slots = table.gather(1, edge.clamp(min=0)[..., None].expand(-1, -1, table.shape[-1]))
    return edge, slots, (slots >= first_shown[None, :, None]) & (slots >= 0)  # (-1: a position with no key)


def shown_summaries(k_far: torch.Tensor, slots: torch.Tensor, shown: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mn, mx), each (batch, kv_heads, queries, head_dim) in bound_dtype: per query, the elementwise
    min and max of k_far (batch, kv_heads, n, d) at the key rows `slots` (batch, queries, S) where
    `shown` (+inf / -inf where none is)."""
    batch, kv_heads, _, dim = k_far.shape
    queries, width = slots.shape[1:]
    rows = slots.clamp(min=0).reshape(batch, 1, queries * width, 1).expand(batch, kv_heads, -1, dim)
    keys = k_far.gather(2, rows).view(batch, kv_heads, queries, width, dim).to(bound_dtype(k_far.dtype))
    hidden = ~shown[:, None, :, :, None]
    return keys.masked_fill(hidden, float("inf")).amin(3), keys.masked_fill(hidden, float("-inf")).amax(3)


def with_window_edges(bound: torch.Tensor, q_far: torch.Tensor, edge: torch.Tensor, mn: torch.Tensor,
                      mx: torch.Tensor) -> torch.Tensor:
    """`bound` (batch, q_heads, queries, n_blocks) with each query's bound of its window's edge block
    (edge (batch, queries), -1 none) taken from that query's own summary of the keys its window shows
    (mn, mx: shown_summaries), not the whole block's (docs/contract.md 4.2)."""
    batch, n_heads, queries, dim = q_far.shape
    group = n_heads // mn.shape[1]
    q = q_far.to(mn.dtype).unflatten(1, (mn.shape[1], group))  # (batch, kv_heads, group, queries, d)
    own = (q.clamp(min=0) * mx[:, :, None].nan_to_num(neginf=0.0)
           + q.clamp(max=0) * mn[:, :, None].nan_to_num(posinf=0.0)).sum(-1).flatten(1, 2)
    own = torch.where(torch.isinf(mx[..., 0]).repeat_interleave(group, 1), float("-inf"), own)
    at = edge.clamp(min=0)[:, None, :, None].expand(batch, n_heads, queries, 1)
    own = torch.where((edge >= 0)[:, None, :], own.to(bound.dtype), bound.gather(3, at)[..., 0])
    return bound.scatter(3, at, own[..., None])


def bound_operands(mn: torch.Tensor, mx: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What bounds() needs of the summaries, for query heads in groups of `group` per kv head:
    [mx, mn] side by side (batch, kv_heads, blocks, 2 d), and (batch, q_heads, blocks) whether a
    block holds no key. A decode step keeps them with the summaries (sparse_far_decode)."""
    summary = torch.cat([mx.nan_to_num(neginf=0.0), mn.nan_to_num(posinf=0.0)], -1)
    return summary, torch.isinf(mx[..., 0]).repeat_interleave(group, 1)


def bounds(q_far: torch.Tensor, mn: torch.Tensor | None, mx: torch.Tensor | None, operands=None) -> torch.Tensor:
    """(batch, q_heads, queries, n_blocks): Quest's bound on each query's best score in each block
    (blocks with no key: -inf). operands: bound_operands(mn, mx, group), when at hand (then mn and
    mx may be None); its `empty` None where every block holds a key."""
    batch, n_heads, n, dim = q_far.shape
    if operands is None:
        operands = bound_operands(mn, mx, n_heads // mn.shape[1])
    # one product per kv head for its group of query heads: [relu(q), min(q, 0)] . [mx, mn]
    summary, empty = operands
    kv_heads, n_blocks = summary.shape[1], summary.shape[2]
    group = n_heads // kv_heads
    sixteen_bit = summary.dtype in _SIXTEEN_BIT
    if sixteen_bit and not (q_far.dtype == summary.dtype == product_dtype(summary.device, summary.dtype)):
        summary, sixteen_bit = summary.to(bound_dtype(summary.dtype)), False  # exact: product_dtype
    q = q_far.to(summary.dtype)
    q2 = torch.cat([q.clamp(min=0), q.clamp(max=0)], -1).reshape(batch, kv_heads, group * n, 2 * dim)
    if sixteen_bit:  # product_dtype: exact products on the tensor cores, summed in float32
        summary = summary.expand(batch, -1, -1, -1)  # (bmm does not broadcast a batch of one, as @ does)
        up = torch.bmm(q2.flatten(0, 1), summary.flatten(0, 1).transpose(1, 2), out_dtype=torch.float32)
    else:
        up = q2 @ summary.transpose(-1, -2)
    up = up.view(batch, n_heads, n, n_blocks)
    return up if empty is None else up.masked_fill_(empty[:, :, None, :], float("-inf"))


def select(bound: torch.Tensor, candidate: torch.Tensor, top_k: int) -> torch.Tensor:
    """bool like `bound`: the candidates whose bound is at least the top_k-th largest candidate
    bound (every candidate when there are at most top_k of them)."""
    if top_k == 0:
        return torch.zeros_like(candidate)
    scores = bound.masked_fill(~candidate, float("-inf"))
    k = min(top_k, scores.shape[-1])
    many = scores[..., 0].numel() >= _MANY_ROWS
    kth = kth_by_maxima(scores, k) if scores.is_cuda and many else scores.topk(k, dim=-1).values[..., -1:]
    return candidate & (scores >= kth)


def top_picks(scores: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """select()'s set as top_k picks and the rest: picks (..., top_k) the index of each row's
    largest, second largest, ... score (ties: the first index; -1 where fewer than top_k scores are
    above -inf), and tied (bool like scores) the others that reach the top_k-th (the ties select()
    also reads: usually none). Picks plus tied is select(scores, scores > -inf, top_k). Written so
    that torch.compile fuses it into a few passes over each row (sparse_far_flex, on CUDA), where a
    topk is one slow radix select: float32 scores (the bounds') become one int64 key each
    (_order_keys), and pick j is the largest key below pick j - 1's, one row maximum that reads the
    keys and one number. (Masking each pick out instead chained a mask per pick: top_k = 32 over
    rows of 1,024 blocks, compiled on this CPU, took 2.3x as long.) Rows without
    NaN (a bound of finite queries and keys has none)."""
    if top_k == 0:
        return scores.new_empty(scores.shape[:-1] + (0,), dtype=torch.long), torch.zeros_like(scores, dtype=torch.bool)
    if scores.dtype != torch.float32:  # no key holds a wider score and its index: argmax and a mask per pick
        index = torch.arange(scores.shape[-1], device=scores.device)
        rest, picks = scores, []
        for _ in range(top_k):
            kth, at = rest.max(-1)
            picks.append(torch.where(kth > float("-inf"), at, -1))
            rest = rest.masked_fill(index == at[..., None], float("-inf"))
        return torch.stack(picks, -1), (rest >= kth[..., None]) & (rest > float("-inf"))
    keys = _order_keys(scores)
    top, below = [], None
    for _ in range(min(top_k, scores.shape[-1])):
        below = (keys if below is None else torch.where(keys < below, keys, _NO_KEY)).amax(-1, keepdim=True)
        top.append(below)
    top = torch.cat(top, -1)
    index = _INDEX_BITS - (top & 0xFFFFFFFF)
    valid = top >= _ABOVE_MINUS_INF
    picks = torch.where(valid, index, -1)
    if picks.shape[-1] < top_k:
        picks = torch.nn.functional.pad(picks, (0, top_k - picks.shape[-1]), value=-1)
    last_valid = valid[..., -1:]
    kth = torch.where(last_valid, scores.gather(-1, torch.where(last_valid, index[..., -1:], 0)), float("-inf"))
    real = scores > float("-inf")
    picked = (keys >= top[..., -1:]) & real  # the picks are the top_k largest keys
    return picks, (scores >= kth) & real & ~picked


# top_picks' keys: a float32 score's order-preserving bits times 2**32 plus _INDEX_BITS - its index, so
# that a larger key is a larger score or an equal one at a smaller index (argmax's first index).
_INDEX_BITS = (1 << 31) - 1


def _order_keys(scores: torch.Tensor) -> torch.Tensor:
    """int64 (like scores, float32): top_picks' keys. The bits of a float32 as an int32 order the
    non-negative floats; flipping all but the sign bit of the negative ones orders those too. -0.0 is
    made 0.0 first, which the float order holds equal."""
    bits = torch.where(scores == 0, 0.0, scores).view(torch.int32)
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)  # all but the sign bit
    return ordered * (1 << 32) + (_INDEX_BITS - torch.arange(scores.shape[-1], device=scores.device))


_MINUS_INF_ORDER = _order_keys(torch.tensor([float("-inf")])).item() >> 32
_ABOVE_MINUS_INF = (_MINUS_INF_ORDER + 1) << 32  # the keys of scores above -inf are at least this
# below every key of a score (rows without NaN): a pass with nothing left; not int64's minimum, which
# a generated kernel's source may not spell as a literal
_NO_KEY = (_MINUS_INF_ORDER - 1) << 32


def top_picks_by_sort(scores: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """top_picks' (picks, tied), the same tensors, from one stable descending sort per row (equal
    scores keep their index order, as top_picks' first-index argmax does). Compiled, a row of at most
    512 blocks is one bitonic sort in the kernel, where top_picks' top_k passes are top_k reductions
    (7.7 of a 16K prefill's 59 ms of GPU time on an H200, 2026-11-27); longer rows call aten's sort.
    sparse_far_flex.PICKS chooses."""
    k = min(top_k, scores.shape[-1])
    if k == 0:
        return top_picks(scores, 0)
    values, index = scores.sort(dim=-1, descending=True, stable=True)
    values, index = values[..., :k], index[..., :k]
    valid = values > float("-inf")
    picks = torch.where(valid, index, -1)
    if k < top_k:
        picks = torch.nn.functional.pad(picks, (0, top_k - k), value=-1)
    picked = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, index, valid)
    return picks, (scores >= values[..., -1:]) & (scores > float("-inf")) & ~picked


_MANY_ROWS = 4096  # a prefill chunk's (query, head) rows; a decode step has a few (one topk launch)


def kth_by_maxima(scores: torch.Tensor, k: int) -> torch.Tensor:
    """(..., 1): the k-th largest of each row of scores, counted with multiplicity (topk(k)'s last
    value; rows without NaN), from at most k passes of max and count. On a GPU, with a few hundred
    thousand rows of a few hundred blocks, torch.topk's radix select took 41% of the default
    conversion's prefill (4.9 ms a call at 16K on an H200, 2026-11-26); a pass here is a row
    reduction. With a few rows (a decode step) one topk is fewer launches: select() keeps it there."""
    kth = torch.full_like(scores[..., :1], float("-inf"))
    done = torch.zeros_like(kth, dtype=torch.bool)
    rest = scores
    for _ in range(k):  # the distinct values from the top, with how many scores reach each
        top = rest.amax(-1, keepdim=True)
        reached = (scores >= top).sum(-1, keepdim=True) >= k
        kth = torch.where(reached & ~done, top, kth)
        done |= reached
        rest = rest.masked_fill(rest >= top, float("-inf"))
    return kth


def plain_candidates(last: torch.Tensor, n_blocks: int, block_size: int, sinks: int):
    """On a plain row (one document, positions the indices, block c the keys c * B .. c * B + B - 1),
    for queries whose last far key is last (queries,) (i - band; below 0: none): (candidate, sink),
    bool (queries, n_blocks), the blocks holding a far key of the query beyond the first `sinks`
    (ranked by their bounds), and its sink blocks (read always)."""
    number = torch.arange(n_blocks, device=last.device)
    reach = number * block_size <= last[:, None]
    sink = reach & (number < sinks)
    return reach & ~sink, sink


def plain_choice(q_far: torch.Tensor, mn: torch.Tensor | None, mx: torch.Tensor | None, first_query: int,
                 band: int, selection: FarSelection, operands=None) -> torch.Tensor:
    """bool (batch, heads, queries, blocks of mn): on a plain row, the blocks that query
    i = first_query + t reads beyond its band: its sink blocks and its top_k other blocks
    (plain_candidates). The one rule of the plain inference paths (sparse_far_plain and a decode step,
    sparse_far_decode, read the same set by plain_slots; sparse_far_flex by top_picks in its
    by_block_plan). operands: bound_operands(mn, mx, group)."""
    batch, n_heads, queries, _ = q_far.shape
    n_blocks = (mn if operands is None else operands[0]).shape[2]
    last = torch.arange(first_query, first_query + queries, device=q_far.device) - band  # each query's last far key
    candidate, sink = plain_candidates(last, n_blocks, selection.block_size, selection.sinks)
    return select(bounds(q_far, mn, mx, operands), candidate.expand(batch, n_heads, -1, -1), selection.top_k) | sink


def plain_slots(q_far: torch.Tensor, summary: torch.Tensor, first_query: int, band: int,
                selection: FarSelection, first_position: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """plain_choice()'s set for one row, as slots instead of a mask over every block: q_far (heads,
    queries, d), summary (kv_heads, n_blocks, 2 d) bound_operands()' first half, queries at
    positions first_query, first_query + 1, ... of a document whose first key sits at
    `first_position` (a decode step's row; blocks before the one holding it hold no key). Returns (slots,
    tied): slots (heads, queries, s + k) the blocks each (head, query) reads (its sink blocks, then
    its top_k candidates by bound; -1: none), and tied (m, 3) the (head, query, block) of rows whose
    k-th bound is tied, every candidate reaching it (their slots are -1: usually no row).

    Bounds are computed for the candidate blocks only (from the sinks to the last block a query
    reaches) and masked only where the queries differ (the blocks their bands' edges cross); top_k + 1
    largest per row tell ties apart; no pass over a (heads, queries, blocks) mask: on the CPU these
    passes, a topk of every block and a nonzero of the chosen mask took most of the far keys' time."""
    n_heads, queries, _ = q_far.shape
    n_blocks = summary.shape[1]
    size, sinks, top_k = selection.block_size, selection.sinks, selection.top_k
    device = q_far.device
    last = torch.arange(first_query - band, first_query - band + queries, device=device)  # last far key
    reach = max(0, min(n_blocks, (first_query + queries - 1 - band) // size + 1))  # blocks a query reaches
    first_block = first_position // size  # the blocks before the one holding the document's first key hold none
    start = max(sinks, first_block)  # the first candidate
    sink = torch.arange(sinks, device=device)
    slots = [torch.where((sink * size <= last[:, None]) & (sink >= first_block), sink, -1).expand(n_heads, -1, -1),
             torch.full((n_heads, queries, top_k), -1, device=device)]
    tied = torch.empty(0, 3, dtype=torch.long, device=device)
    if top_k == 0 or reach <= start:
        return torch.cat(slots, -1), tied
    bound = bounds(q_far[None], None, None, (summary[None, :, start:reach], None))[0]  # these blocks hold keys
    every = max(start, (first_query - band) // size + 1)  # blocks every query reaches
    if every < reach:  # the others are candidates of the later queries only
        number = torch.arange(every, reach, device=device)
        bound[:, :, every - start:].masked_fill_(number * size > last[:, None], float("-inf"))
    values, index = bound.topk(min(top_k + 1, reach - start), -1)
    picks, m = slots[1], min(top_k, values.shape[-1])  # fewer candidates than top_k: every one
    picks[..., :m] = torch.where(values[..., :m] > float("-inf"), index[..., :m] + start, -1)
    if values.shape[-1] > top_k:  # ties at the k-th: that row reads every candidate reaching it
        kth = values[..., top_k - 1]
        rows = ((values[..., top_k] == kth) & (kth > float("-inf"))).nonzero()
        if rows.numel():
            h, t = rows.unbind(1)
            picks[h, t] = -1
            row, block = (bound[h, t] >= kth[h, t, None]).nonzero().unbind(1)
            tied = torch.stack([h[row], t[row], block + start], 1)
    return torch.cat(slots, -1), tied
