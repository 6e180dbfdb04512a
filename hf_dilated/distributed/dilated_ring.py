"""Dilated attention (LongNet) over a sequence sharded across a process group.

Computes exactly the single-process `hf_dilated.ops.dilated_attention` on the global sequence, on
the ring of ring.py: K/V tiles travel around the ring, and each (local query rows, key tile) call
of the fused kernel gets the dilated pattern between those global tokens as its mask
(`dilated_visible`), so a rank holds one tile in hand and one in flight, never a window of a whole
segment, and its memory falls as 1/P. A key counted at several levels ("longnet") weighs
exp(s + log c). Only the K/V entries some rank further along the ring can see travel on
(`dilated_needed_keys`, the ring plan's masks), and only the gradients of entries a rank used come
back:
- a level whose segments do not cross a rank boundary needs nothing from other ranks;
- at a level with dilation r, kv head h needs only the keys selected for the offsets of its
  query heads ((p mod w) mod r == h mod r), so with one query head per kv head the traffic of a
  level falls by r (with grouped-query attention, by r / min(r, query heads per kv head)).
Which entries are needed is decided from positions, documents and padding alone, the same
rules the kernel applies (docs/contract.md 4). A call runs compacted (ring.Piece.compact): per
head only the rows and keys in some pair of the pattern (`dilated_select`), so its work falls with
the pattern's density, and calls where no query needs a key of the tile are skipped.

All of it is one `DilatedPattern`, the ring.RingPattern of the dilated levels (with a local band
and its far keys when asked): the ring itself knows nothing of levels or bands.

Sparse far keys (docs/contract.md 4.2: `far_band`, `far_selection`). The narrower band is a width
per query in the calls' masks. The selection needs, per (head, local query), the far blocks it
reads: every rank summarises the blocks of its own k_far shard by GLOBAL block id (a block may
straddle two ranks' shards: min and max combine by an all-reduce, once per call, n_blocks x
head_dim per kv head), then chooses the blocks of its own queries (`far_choice`: candidates,
Quest bounds, top_k, sinks, bit-packed) before the ring starts, and the far part of each call's
mask also requires the key's block to be chosen (`FarChoice.read`). Which entries travel does not
depend on the choice (it is data, the ring plan is metadata): a tile carries every far key some
rank might choose.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from ..config import DEFAULT_MODE, DEFAULT_RING_LAYOUT
from ..ops import far_selection as selection_rule
from ..ops.far_selection import FarSelection, band_widths
from ..ops.head_groups import levels_of_heads
from ..ops.token_layout import take, token_layout
from ..ops.validate import (check_dilated_config, check_far_reading, check_int, check_local_band, check_qkv,
                            check_scale_dropout)
from .ring import RingPattern, RingPlan, ring_plan, run_ring
from .tokens import GlobalTokens, prepare_call
from .utils import as_bias
from .groups import group_size_rank
from .layout import check_layout


# Tiles per rank, fewer than ring.py's KV_TILES: a compacted call reads about 1/r of a tile per head,
# and calls of a few keys cost more than their work, while larger tiles hold more (the tile in hand
# and in flight are 4 / KV_TILES of q's size). Measurements: docs/benchmarks.md, Distributed.
KV_TILES = 16


@dataclass
class LevelCodes:
    """One level of the pattern on the global tokens: j is in V_g(h, i) when code[i] == code[j]
    and cls[i] == head_class[h], for the heads that read the level (docs/contract.md 4)."""
    bit: int  # the level's index g
    code: torch.Tensor  # (batch, seq_len): the (segment, offset class) id, distinct across batch rows
    cls: torch.Tensor  # (batch, seq_len): the offset class (p mod w) mod r
    head_class: torch.Tensor  # (q_heads,): h mod r
    reads: torch.Tensor  # (q_heads,) bool: the heads that read the level


def level_codes(tokens: GlobalTokens, q_heads: int, segment_lengths, dilation_rates, mode: str) -> list[LevelCodes]:
    """The levels some head reads, computed once per plan for every global token."""
    p = tokens.positions
    heads = torch.arange(q_heads, device=p.device)
    levels = levels_of_heads(q_heads, len(segment_lengths), mode)
    row_code = torch.arange(p.shape[0], device=p.device)[:, None] << 40  # batch rows never meet
    out = []
    for g, (w, r) in enumerate(zip(segment_lengths, dilation_rates)):
        reads = torch.tensor([g in levels[h] for h in range(q_heads)], device=p.device)
        if bool(reads.any()):
            cls = (p % w) % r
            out.append(LevelCodes(g, torch.div(p, w, rounding_mode="floor") * r + cls + row_code, cls, heads % r,
                                  reads))
    return out


def dilated_needed_keys(tokens: GlobalTokens, levels: list[LevelCodes], query_index: torch.Tensor, kv_heads: int,
                        memo: dict | None = None) -> torch.Tensor:
    """bool (batch, kv_heads, seq_len): key j is needed for kv head hk when, for some query head h
    of hk, some level g it reads, and some query i of `query_index`, j is in V_g(h, i): same code
    at g (LevelCodes), both of h's class, same document, j real and not after i."""
    real = tokens.real
    batch, seq_len = real.shape
    index = torch.arange(seq_len, device=real.device).expand(batch, seq_len)
    is_query = torch.zeros(seq_len, dtype=torch.bool, device=real.device)
    is_query[query_index] = True
    queries = is_query.expand(batch, seq_len)
    need = torch.zeros(batch, kv_heads, seq_len, dtype=torch.bool, device=real.device)
    for level in levels:
        if memo is not None and level.bit in memo:  # independent of the queries: computed once per plan
            cell, selected = memo[level.bit]
        else:
            cell, selected = _level_cells(tokens, level, kv_heads)
            if memo is not None:
                memo[level.bit] = cell, selected
        # The last query of each cell; a key needs only its own cell's.
        last_query = torch.full((int(cell.max()) + 1,), -1, dtype=torch.long, device=real.device)
        last_query.scatter_reduce_(0, cell[queries], index[queries], reduce="amax")
        need |= (real & (last_query[cell] >= index))[:, None] & selected
    return need


def _level_cells(tokens: GlobalTokens, level: LevelCodes, kv_heads: int):
    """For dilated_needed_keys: one id per (code, document) of the level, (batch, seq_len), and
    bool (batch, kv_heads, seq_len): the tokens of the class of some query head of each kv head
    that reads the level."""
    doc = tokens.doc
    batch, seq_len = doc.shape
    # A code less its class is a batch row's level-g segment. Within a document positions rise by
    # one per token, so each (segment, document) is a run of consecutive tokens: number the runs.
    segment = level.code - level.cls
    starts = torch.ones(batch, seq_len, dtype=torch.bool, device=doc.device)
    starts[:, 1:] = (doc[:, 1:] != doc[:, :-1]) | (segment[:, 1:] != segment[:, :-1])
    run = starts.flatten().long().cumsum(0).view(batch, seq_len) - 1
    cell = run * (int(level.cls.max()) + 1) + level.cls
    selected = (level.cls[:, None] == level.head_class[None, :, None]) & level.reads[None, :, None]
    return cell, selected.unflatten(1, (kv_heads, -1)).any(2)


def band_needed_keys(count: torch.Tensor, real: torch.Tensor, query_index: torch.Tensor, band: int) -> torch.Tensor:
    """bool (batch, seq_len): keys within `band` positions of some query of `query_index` and not
    after it (a superset: fewer than `band` real tokens before it; count: real tokens up to each
    index, non-decreasing). The queries at or after key j within that reach form the index range
    [j, e_j), e_j the first index with count >= count_j + band."""
    batch, seq_len = count.shape
    is_query = torch.zeros(batch, seq_len + 1, dtype=torch.long, device=count.device)
    is_query[:, query_index + 1] = 1
    queries_before = is_query.cumsum(-1)  # [:, i]: queries at indices < i
    reach = torch.searchsorted(count.contiguous(), count + band)  # e_j
    return real & (queries_before.gather(-1, reach) > queries_before[:, :seq_len])


def dilated_visible(levels: list[LevelCodes], q_index, k_index, mode: str) -> torch.Tensor:
    """(batch, q_heads, rows, keys): for each query head, how the pattern counts key j for query i
    (docs/contract.md 4), before causality, documents and padding: bool for "union" (in some
    V_g(h, i)) and "head_groups" (in V_g(h, i) of the head's level), the number of levels g with j
    in V_g(h, i) for "longnet". q_index, k_index: global indices, (n,) or per head (batch, q_heads, n)."""
    # Level by level: bit g of pairs[i, j] (codes equal) and of heads_of[h, i] (i selected for h at
    # g); one AND over (heads, rows, keys) at the end, instead of one per level (the mask costs
    # more than the attention call it serves otherwise).
    bits = torch.uint8 if levels[-1].bit < 8 else torch.int64
    pairs = heads_of = None
    for level in levels:
        code_q, code_k = take(level.code, q_index), take(level.code, k_index)
        pair = (code_q[..., :, None] == code_k[..., None, :]).to(bits) << level.bit
        head = ((take(level.cls, q_index) == level.head_class[None, :, None])
                & level.reads[None, :, None]).to(bits) << level.bit
        pairs = pair if pairs is None else pairs | pair
        heads_of = head if heads_of is None else heads_of | head
    both = heads_of[..., None] & pairs
    if mode != "longnet":
        return both != 0
    count = torch.zeros(both.shape, dtype=torch.int32, device=both.device)  # levels counted: the set bits
    for level in levels:
        count += ((both >> level.bit) & 1).to(torch.int32)
    return count


def dilated_select(levels: list[LevelCodes], tokens: GlobalTokens, q_index, k_index, band: int | None = None,
                   count=None):
    """For a (rows, key tile) call: bool (batch, q_heads, rows), (batch, q_heads, keys), the rows and
    keys of each head in some pair of dilated_visible: at a level it reads, a row of the head's
    offset class with a key of the same code in the tile, and such a key (real, not after the last
    row), and with a local `band` (count: real tokens up to each index, from level_codes' plan),
    rows and keys within it on every head; and (rows,) the levels (and band) at which each row has
    such a key, as bits (rows alike compact alike), or None. Without the pairwise mask: per level,
    each side's codes looked up in the other's."""
    rows = keys = group = None
    for level in levels:
        code_q, code_k = level.code[:, q_index], level.code[:, k_index]
        hit_q = torch.isin(code_q, code_k)
        r = hit_q[:, None] & (level.cls[:, None, q_index] == level.head_class[None, :, None]) & level.reads[None, :, None]
        k = (torch.isin(code_k, code_q)[:, None] & (level.cls[:, None, k_index] == level.head_class[None, :, None])
             & level.reads[None, :, None])
        rows, keys = (r, k) if rows is None else (rows | r, keys | k)
        hit = hit_q.long() << level.bit
        group = hit if group is None else group | hit
    batch, n_bits = group.shape[0], levels[-1].bit + 1
    if band is not None:
        # The band, on every head: a key within `band` positions of a row, found through `count`
        # (real tokens up to each index): in a document positions advance at least one per real
        # token, so such a pair is less than `band` real tokens apart (a superset).
        c_q, c_k = count[:, q_index], count[:, k_index]
        hit_q = c_q - band < c_k.amax(-1, keepdim=True)
        rows |= hit_q[:, None]
        keys |= (c_k > c_q.amin(-1, keepdim=True) - band)[:, None]
        group = group | (hit_q.long() << n_bits)
        n_bits += 1
    keys &= (tokens.real[:, k_index] & (k_index <= q_index.max()))[:, None]
    rows &= (q_index >= k_index.min())[None, None]
    # Rows alike: a same-code key at the same levels (and the band), in every batch row.
    if batch * n_bits > 62:
        return rows, keys, None
    return rows, keys, (group << (torch.arange(batch, device=group.device)[:, None] * n_bits)).sum(0)


def dilated_pattern_full(levels: list[LevelCodes], q_index, k_index, q_valid, k_valid, mode: str) -> bool:
    """Whether dilated_visible lets every pair of valid entries through (q_index, k_index: per head
    (batch, q_heads, n), with bool q_valid, k_valid of the same shapes): for "union" and
    "head_groups", when for each head some level it reads gives all its valid rows and keys one
    code, of its own class. Never for "longnet" (its counts differ by pair)."""
    if mode == "longnet":
        return False
    full = ~q_valid.any(-1) | ~k_valid.any(-1)  # a head without a valid row or key has no pair
    far = 2**62
    for level in levels:
        code_q, code_k = take(level.code, q_index), take(level.code, k_index)
        low = torch.minimum(torch.where(q_valid, code_q, far).amin(-1), torch.where(k_valid, code_k, far).amin(-1))
        high = torch.maximum(torch.where(q_valid, code_q, -far).amax(-1),
                             torch.where(k_valid, code_k, -far).amax(-1))
        own_class = (take(level.cls, q_index) == level.head_class[None, :, None]) | ~q_valid
        full |= (low == high) & own_class.all(-1) & level.reads[None]
    return bool(full.all())


@dataclass
class FarBlocks:
    """The far blocks of the global sequence (docs/contract.md 4.2), numbered per batch row as
    far_selection.blocks_of numbers them, with what the candidate rule reads of each: a block is a
    run of consecutive real tokens of one document (positions rise within a document, 3.1)."""
    id: torch.Tensor  # (batch, seq_len): each token's block, -1 for padding
    count: int  # the blocks of the row with the most
    number: torch.Tensor  # (batch, count): position // block_size within its document; -1 past a row's last
    doc: torch.Tensor  # (batch, count): its document
    last: torch.Tensor  # (batch, count): the index of its last real token
    low: torch.Tensor  # (batch, count): its lowest position, that of its first real token


_NO_POSITION = 2**62  # above every position: a block past a row's last holds no far key


def far_blocks(tokens: GlobalTokens, block_size: int) -> FarBlocks:
    """The FarBlocks of the gathered tokens (one read of the block count to the host)."""
    blocks = selection_rule.blocks_of(tokens.positions, tokens.real, tokens.doc, block_size)
    batch, seq_len = tokens.real.shape
    n, device = blocks.count, tokens.real.device
    at = torch.where(blocks.id >= 0, blocks.id, n)  # padding: a spare column, dropped

    def per_block(values, how, fill):
        out = torch.full((batch, n + 1), fill, dtype=torch.long, device=device)
        return out.scatter_reduce_(1, at, values, how)[:, :n]

    index = torch.arange(seq_len, device=device).expand(batch, seq_len)
    return FarBlocks(blocks.id, n, blocks.number, per_block(tokens.doc, "amax", -1), per_block(index, "amax", -1),
                     per_block(tokens.positions, "amin", _NO_POSITION))


def far_candidates(blocks: FarBlocks, tokens: GlobalTokens, query_index, band: int, far_band: int | None,
                   sinks: int, window: int | None) -> torch.Tensor:
    """bool (batch, rows, count): the candidate blocks of the queries at global indices
    `query_index` (docs/contract.md 4.2): beyond the sinks, holding a far key of the query. Where
    the levels hold every earlier key (DilatedPattern checks it) a far key is any base-visible key
    at a position at most p - width (the query's band, far_selection.band_widths), the same on every
    head: a real key of the query's document, within its sliding window. By position, not by block
    number: a hole may leave a block's first positions empty."""
    p = tokens.positions[:, query_index]
    reach = (p - band_widths(p, band, far_band))[:, :, None]  # a far key's position is at most this
    holds = blocks.low[:, None, :] <= reach
    if window is not None:
        # A key in the window too (index > i - window). Where the window starts inside the block, its
        # lowest key may lie outside the window; but if the block's keys in the window are all in the
        # band, so is every key of the document in the window (they come later): the query reads no
        # far key, and its choice changes nothing.
        holds &= blocks.last[:, None, :] > (query_index - window)[None, :, None]
    same_doc = blocks.doc[:, None, :] == tokens.doc[:, query_index, None]
    return holds & same_doc & (blocks.number >= sinks)[:, None, :] & tokens.real[:, query_index, None]


@dataclass
class FarChoice:
    """The far blocks each (head, local query) reads in one call (docs/contract.md 4.2): its sinks
    and its chosen candidates, one bit per block (a bool per block would weigh up to n_blocks / (2
    head_dim) times q in bfloat16, and it is kept until the backward)."""
    bits: torch.Tensor  # (batch, q_heads, n_local, ceil(count / 8)) uint8: block c at bit c % 8 of byte c // 8
    block: torch.Tensor  # (batch, seq_len): each token's block (0 for padding, which no mask lets through)
    row: torch.Tensor  # (seq_len,): each global index's row in this rank's shard, -1 on another rank

    def read(self, q_index, k_index) -> torch.Tensor:
        """bool (batch, heads, rows, keys): whether the block of each key is chosen for each query
        (global indices, per head (batch, heads, n); the queries this rank's)."""
        rows = self.row[q_index]
        block = take(self.block, k_index)
        batch, heads, n_rows = rows.shape
        block = block.expand(batch, heads, block.shape[-1])
        low, high = int(block.min()) // 8, int(block.max()) // 8 + 1  # only the bytes of the tile's blocks
        bits = self.bits[..., low:high].gather(2, rows[..., None].expand(-1, -1, -1, high - low))
        byte = (block // 8 - low)[:, :, None, :].expand(-1, -1, n_rows, -1)
        shift = (block % 8).to(torch.uint8)[:, :, None, :]
        return ((bits.gather(3, byte) >> shift) & 1).bool()


def _pack_bits(flags: torch.Tensor) -> torch.Tensor:
    """bool (..., n) as uint8 (..., ceil(n / 8)): flag c at bit c % 8 of byte c // 8."""
    n = flags.shape[-1]
    padded = torch.nn.functional.pad(flags.to(torch.uint8), (0, -n % 8)).unflatten(-1, (-1, 8))
    weights = 2 ** torch.arange(8, dtype=torch.uint8, device=flags.device)
    return (padded * weights).sum(-1, dtype=torch.uint8)


# Local queries per step of far_choice: its bounds are (batch, heads, rows, n_blocks) floats.
_CHOICE_ROWS = 256


def far_choice(pattern: "DilatedPattern", q_far, k_far, group) -> FarChoice:
    """The far blocks this rank's queries read (docs/contract.md 4.2; far_selection's summaries,
    bounds and select on the global blocks): the block summaries of this rank's k_far shard by
    global block id, combined over the group (two all-reduces: a block may straddle shards), then
    per local query its candidates, bounds and chosen blocks, with the sinks. Not differentiated."""
    tokens, blocks, sel = pattern.tokens, pattern.blocks, pattern.selection
    batch, heads, n_local = q_far.shape[:3]
    with torch.no_grad():
        mine = selection_rule.Blocks(blocks.id[:, tokens.local_index], blocks.number, blocks.count)
        low, high = (t.contiguous() for t in selection_rule.summaries(k_far.detach(), mine))
        dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
        dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
        sink = ((blocks.number >= 0) & (blocks.number < sel.sinks))[:, None, None, :]
        edges = None if pattern.window is None else _window_edges(pattern, k_far.detach(), group)
        bits = torch.empty(batch, heads, n_local, -(-blocks.count // 8), dtype=torch.uint8, device=q_far.device)
        for s in range(0, n_local, _CHOICE_ROWS):
            e = min(n_local, s + _CHOICE_ROWS)
            candidate = far_candidates(blocks, tokens, tokens.local_index[s:e], pattern.band, pattern.far_band,
                                       sel.sinks, pattern.window)
            bound = selection_rule.bounds(q_far[:, :, s:e].detach(), low, high)
            if edges is not None:
                bound = selection_rule.with_window_edges(bound, q_far[:, :, s:e].detach(), edges[0][:, s:e],
                                                         edges[1][:, :, s:e], edges[2][:, :, s:e])
            chosen = selection_rule.select(bound, candidate[:, None].expand(-1, heads, -1, -1), sel.top_k)
            bits[:, :, s:e] = _pack_bits(chosen | sink)
    row = torch.full((tokens.real.shape[1],), -1, dtype=torch.long, device=q_far.device)
    row[tokens.local_index] = torch.arange(n_local, device=q_far.device)
    return FarChoice(bits, blocks.id.clamp(min=0), row)


def _window_edges(pattern: "DilatedPattern", k_far, group):
    """Under a sliding window, per local query the block its window starts in (batch, n_local; -1
    none) and its summary of the keys of that block the window shows ((batch, kv_heads, n_local, d)
    min and max; far_selection.with_window_edges). Those keys may lie on any rank: each rank's k_far
    shard is broadcast in turn (this rank holds one other shard at a time), and every rank takes
    from it the keys of its own queries' edge blocks."""
    tokens = pattern.tokens
    batch, kv_heads, n_local, dim = k_far.shape
    edge, slots, shown = selection_rule.window_edge_keys(pattern.blocks, tokens.real, pattern.slots,
                                                         tokens.local_index - (pattern.window - 1))  # global indices
    dtype = selection_rule.bound_dtype(k_far.dtype)
    low = torch.full((batch, kv_heads, n_local, dim), float("inf"), dtype=dtype, device=k_far.device)
    high = torch.full_like(low, float("-inf"))
    world = dist.get_world_size(group)
    for r in range(world):
        shard = k_far.contiguous() if r == tokens.rank else torch.empty_like(k_far.contiguous())
        dist.broadcast(shard, src=dist.get_global_rank(group, r), group=group)
        row = torch.full((tokens.real.shape[1],), -1, dtype=torch.long, device=k_far.device)
        row[tokens.rank_index(r)] = torch.arange(n_local, device=k_far.device)
        rows = row[slots.clamp(min=0)]
        for s in range(0, n_local, _CHOICE_ROWS):  # (batch, kv_heads, rows, block_size, d) keys at a time
            e = min(n_local, s + _CHOICE_ROWS)
            mn, mx = selection_rule.shown_summaries(shard, rows[:, s:e], shown[:, s:e] & (rows[:, s:e] >= 0))
            low[:, :, s:e] = torch.minimum(low[:, :, s:e], mn)
            high[:, :, s:e] = torch.maximum(high[:, :, s:e], mx)
    return edge, low, high


def with_far_choice(plan: RingPlan, q_far, k_far, group) -> RingPlan:
    """A copy of `plan` (cached across layers) whose calls read this call's FarChoice."""
    pattern = copy.copy(plan.pattern)
    pattern.choice = far_choice(pattern, q_far, k_far, group)
    steps = [[[replace(piece, pattern=pattern) for piece in pieces] for pieces in hops] for hops in plan.steps]
    return replace(plan, steps=steps, pattern=pattern)


def _holds_every_earlier_key(tokens: GlobalTokens, segment_lengths, dilation_rates) -> bool:
    """Whether some level of dilation 1 holds each document in one segment: then the union levels
    hold every base-visible key (docs/contract.md 4), on every head."""
    row = torch.arange(tokens.doc.shape[0], device=tokens.doc.device)[:, None]
    doc = (row * tokens.doc.shape[1] + tokens.doc)[tokens.real]  # distinct across rows
    for w, r in zip(segment_lengths, dilation_rates):
        if r != 1:
            continue
        segment = torch.div(tokens.positions, w, rounding_mode="floor")[tokens.real]
        size = tokens.doc.numel()
        low = torch.full((size,), _NO_POSITION, dtype=torch.long, device=doc.device).scatter_reduce_(
            0, doc, segment, "amin")
        high = torch.full((size,), -1, dtype=torch.long, device=doc.device).scatter_reduce_(0, doc, segment, "amax")
        if bool((low[doc] == high[doc]).all()):
            return True
    return False


@dataclass(eq=False)
class DilatedPattern(RingPattern):
    """The ring pattern of dilated_ring_attention: the dilated `levels` (docs/contract.md 4) and,
    with a local `band` of that many positions (docs/contract.md 4.1, mode "union"), every key
    within it on every head, the keys beyond it read with the far projections if `far`; with
    `far_band` a band of that many positions for queries at positions >= band, and with a
    `selection` only the far keys of the blocks `choice` holds (docs/contract.md 4.2)."""
    levels: list[LevelCodes]
    mode: str
    kv_heads: int
    band: int | None = None
    far: bool = False
    far_band: int | None = None
    selection: FarSelection | None = None
    # One call's choice (with_far_choice). The cached plan's pattern has none: a call with a
    # selection runs on a copy that has one.
    choice: FarChoice | None = None
    segment_lengths: tuple = ()
    dilation_rates: tuple = ()
    sparse = True
    compacted = True

    def __post_init__(self):
        self._cells = {}  # dilated_needed_keys' per-level ids, the same for every query set
        # real tokens up to each index: how dilated_select and band_needed_keys bound the band
        self._count = None if self.band is None else self.tokens.real.long().cumsum(-1)
        # The band every query has at least (far_band is at most band). The masks' superset bounds
        # (select, needed_keys) keep `band`, the widest.
        self._narrowest = self.band if self.far_band is None else min(self.band, self.far_band)
        self.blocks = self.slots = None
        if self.selection is not None:
            # The candidate rule needs the blocks holding a far key of each (head, query). Where the
            # levels hold every earlier key that is arithmetic on each block's document, last index
            # and lowest position (far_candidates); in general it is the levels' pattern between
            # every local query and every global key, which costs as much as a dense mask.
            if not _holds_every_earlier_key(self.tokens, self.segment_lengths, self.dilation_rates):
                raise ValueError(
                    "far_selection: dilated_ring reads sparse far keys (far_top_k, docs/contract.md 4.2) only where "
                    "the levels hold every earlier key: some level of dilation 1 whose segment holds each document "
                    "(e.g. one segment of dilation 1 covering the sequence, as the default conversion writes); got "
                    f"segment_lengths={list(self.segment_lengths)}, dilation_rates={list(self.dilation_rates)}. "
                    "Use 'dilated' for other levels")
            self.blocks = far_blocks(self.tokens, self.selection.block_size)
            if self.window is not None:  # the blocks' keys by position, for the windows' edges (_window_edges)
                self.slots = selection_rule.slot_table(self.blocks, self.tokens.positions, self.selection.block_size)

    def needed_keys(self, query_index):
        need = dilated_needed_keys(self.tokens, self.levels, query_index, self.kv_heads, self._cells)
        if self.band is not None:
            need |= band_needed_keys(self._count, self.tokens.real, query_index, self.band)[:, None]
        return need

    def weight(self, q_index, k_index):
        return dilated_visible(self.levels, q_index, k_index, self.mode)

    def select(self, q_index, k_index):
        return dilated_select(self.levels, self.tokens, q_index, k_index, self.band, self._count)

    def full(self, q_index, k_index, q_valid, k_valid):
        return dilated_pattern_full(self.levels, q_index, k_index, q_valid, k_valid, self.mode)

    def calls(self, q_index, k_index, q_valid, k_valid, dtype):
        """RingPattern.calls with the band: a grid wholly within it runs dense with (q, k); one
        wholly beyond it, the levels letting every pair through, runs with no mask, with the far
        projections if `far`; any other grid runs masked, with `far` as two calls: the band with
        (q, k), the levels beyond it with (q_far, k_far)."""
        if self.band is None:
            return super().calls(q_index, k_index, q_valid, k_valid, dtype)
        qi, kj = q_index, k_index
        if self.all_visible(qi, kj, q_valid, k_valid):  # plain tokens: positions are the global indices
            no_index = 2**62  # beyond every index: a padding row's, out of the min and max
            first_row = torch.where(q_valid, qi, no_index).amin(-1)
            last_row = torch.where(q_valid, qi, -no_index).amax(-1)
            if bool((last_row - kj.amin(-1) < self._narrowest).all()):
                return [(False, None, None)]  # every pair in the band
            if (self.choice is None and bool((first_row - kj.amax(-1) >= self.band).all())
                    and self.full(qi, kj, q_valid, k_valid)):
                return [(self.far, None, None)]  # every pair visible, none in the band
        visible = self.visible(qi, kj) & q_valid[..., None] & k_valid[..., None, :]
        pq, pk = take(self.tokens.positions, qi), take(self.tokens.positions, kj)
        in_band = (pq[..., :, None] - pk[..., None, :]).abs() < band_widths(pq, self.band, self.far_band)[..., None]
        far_keys = visible & self.weight(qi, kj) & ~in_band
        if self.choice is not None:
            far_keys &= self.choice.read(qi, kj)
        if not self.far:
            return [(False, *as_bias((visible & in_band) | far_keys, dtype))]
        parts = ((False, visible & in_band), (True, far_keys))
        return [(far, *as_bias(part, dtype)) for far, part in parts if bool(part.any())]


def dilated_ring_plan(tokens: GlobalTokens, q_heads: int, kv_heads: int, segment_lengths, dilation_rates,
                      mode: str, sliding_window: int | None = None, local_window: int | None = None,
                      far: bool = False, far_band: int | None = None, far_selection: FarSelection | None = None):
    """The ring plan of dilated_ring_attention: the dilated pattern (with a local band of
    `local_window` positions, its far keys read with far projections if `far`; `far_band` and
    `far_selection` as in docs/contract.md 4.2) as each call's compacted mask and as the entries
    that travel. With a selection, run a call on with_far_choice(plan, ...)."""
    levels = level_codes(tokens, q_heads, segment_lengths, dilation_rates, mode)
    pattern = DilatedPattern(tokens, sliding_window, levels=levels, mode=mode, kv_heads=kv_heads, band=local_window,
                             far=far, far_band=far_band, selection=far_selection,
                             segment_lengths=tuple(segment_lengths), dilation_rates=tuple(dilation_rates))
    return ring_plan(pattern, kv_tiles=KV_TILES)


def dilated_ring_attention(q, k, v, segment_lengths, dilation_rates, *, mode: str = DEFAULT_MODE, group=None,
                           layout: str = DEFAULT_RING_LAYOUT, scale=None, attention_mask=None, position_ids=None,
                           dropout_p: float = 0.0, sliding_window: int | None = None,
                           local_window: int | None = None, q_far=None, k_far=None, far_at=None,
                           far_band: int | None = None, far_selection: FarSelection | None = None):
    """Dilated attention over a sequence sharded across `group` (docs/contract.md 6).

    q, k, v, attention_mask, position_ids: this rank's shards of the global tensors in `layout`
    (see ring_attention); sliding_window: as in docs/contract.md 3.3, by global index;
    local_window, q_far, k_far: a local band and the far projections (docs/contract.md 4.1), the
    latter this rank's shards too; or far_at(positions) -> (q_far, k_far), given this rank's tokens'
    positions (batch, n_local) under the kernels' rule on the whole sequence (docs/contract.md 3.1),
    for a caller that cannot tell them from its shard of a padding mask. far_band, far_selection
    (ops.far_selection.FarSelection): a narrower band past local_window and sparse far keys
    (docs/contract.md 4.2), the selection only where the levels hold every earlier key (some level of
    dilation 1 holding each document) when the group has several ranks. Returns this rank's shard
    of `dilated_attention` on the global sequence. With group None or of size 1 this is
    `hf_dilated.ops.dilated_attention` itself.
    """
    from ..ops import dilated_attention

    seg, dil = check_dilated_config(segment_lengths, dilation_rates, mode)
    check_layout(layout)
    check_qkv(q, k, v, attention_mask, position_ids)
    check_scale_dropout(scale, dropout_p)
    check_int("sliding_window", sliding_window, optional=True)
    if far_at is not None and (q_far is not None or k_far is not None):
        raise ValueError("far_at: pass far_at or q_far/k_far, not both")
    if local_window is not None or q_far is not None or k_far is not None or far_at is not None:
        check_local_band(q, k, mode, local_window, q_far, k_far)
    check_far_reading(local_window, far_band, far_selection, is_causal=True)
    if far_band == local_window:
        far_band = None
    world, _ = group_size_rank(group)
    if world == 1:
        if far_at is not None:
            q_far, k_far = far_at(token_layout(k.shape[0], k.shape[2], k.device, attention_mask, position_ids).positions)
        return dilated_attention(q, k, v, seg, dil, mode=mode, scale=scale, dropout_p=dropout_p,
                                 attention_mask=attention_mask, position_ids=position_ids,
                                 sliding_window=sliding_window, local_window=local_window, q_far=q_far, k_far=k_far,
                                 far_band=far_band, far_selection=far_selection)
    if dropout_p:
        raise ValueError(f"dropout_p: dilated_ring_attention does not implement attention dropout, got {dropout_p}")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    q_heads, kv_heads = q.shape[1], k.shape[1]
    far = q_far is not None or far_at is not None
    plan = prepare_call("dilated_ring_attention", q, k, v, attention_mask=attention_mask, position_ids=position_ids,
                        group=group, layout=layout, scale=scale, segment_lengths=seg,
                        build=lambda tokens: dilated_ring_plan(tokens, q_heads, kv_heads, seg, dil, mode,
                                                               sliding_window, local_window, far, far_band,
                                                               far_selection),
                        dilation_rates=dil, mode=mode, sliding_window=sliding_window, local_window=local_window,
                        far=far, sparse_far=(far_band, far_selection))
    if far_at is not None:
        q_far, k_far = far_at(plan.tokens.positions[:, plan.tokens.local_index])
        check_local_band(q, k, mode, local_window, q_far, k_far)
    if far_selection is not None:  # without far projections q and k score far keys, and so the bounds
        plan = with_far_choice(plan, q if q_far is None else q_far, k if k_far is None else k_far, group)
    return run_ring(q, k, v, plan, group=group, label="dilated_ring", scale=scale, q_far=q_far, k_far=k_far)
