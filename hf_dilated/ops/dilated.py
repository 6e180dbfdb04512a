"""Dilated attention (LongNet), exact to docs/contract.md 4, in the modes "union", "longnet" and
"head_groups".

How it is computed. For each level g (segment w, dilation r) every real token has a *row* (its
batch row, document and segment `p // w`) and, within the row, an offset class `c = p mod r` and a
slot `t = (p mod w) // r`; query head h reads class `h mod r`. Slots are aligned by position, so the
selected tokens of a segment sit in a dense, ordered row of `w / r` slots, and causal order among
them is slot order. Per level the rows are gathered into one dense 4-D batch (rows, heads, slots,
head_dim) and handed to one fused attention call that also returns the log-sum-exp; the levels are
merged in float32 by log-sum-exp (merge.py). Grouped-query attention is kept: query heads are
reordered so that the heads reading one (kv head, class) pair are contiguous, and the fused kernel
maps them onto one gathered K/V head.

"union" counts each key once. With nested levels, the keys level g adds beyond lower levels are
exactly those of its segment that lie in an *earlier* level-(g-1) sub-segment than the query, so
level g >= 2 attends, per sub-segment s, from the queries of sub-segment s to the keys of
sub-segments 0..s-1 (no causal mask needed). "longnet" sums the levels (a multiset), and
"head_groups" gives each contiguous group of heads a single level.

Irregular rows (a document that starts inside a segment, padding inside a document) leave empty
slots before real ones; those keys are masked with an additive -inf bias of shape (rows, heads, 1,
slots). Decode and chunked prefill (q_len < kv_len) gather only the rows that hold queries (a
decode step plans and reads only the last w_g - 1 tokens of each level, so it costs the sum of
w_g / r_g). Few queries per row use an explicit bias over (query slots x key slots); many (a chunk,
a sequence-parallel shard) run those rows as a prefill and keep the query slots.

Plain layouts (no padding, one document per row, whole segments: what a benchmark or an unpadded
batch gives) skip the index arithmetic of the accumulator: slot t of class c in segment s is token
s * w + c + t * r, so the first level's output itself becomes the accumulator and every later call
merges into a strided view of it in place (`_forward_plain`, `_backward_plain`).

The backward is the standard flash backward per call, fed with the merged output and
log-sum-exp, so training memory stays O(N).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .backend import attention_backward, attention_forward
from . import pair_count, sparse_far_plain, sparse_far_train
from .local_band import local_band_attention
from .merge import merge_dtype, merge_into, merge_partial
from .plan_cache import PlanCache
from ..config import DECODE_MAX_QUERIES, DEFAULT_MODE, check_int
from .dilated_decode import dilated_decode
from .head_groups import head_groups
from .strided import as_strided_within
from .token_layout import TokenLayout, first_key_within, plain_documents, token_layout
from .validate import (check_dilated_config, check_far_reading, check_local_band, check_qkv, check_scale_dropout,
                       records_grad)

# Upper bound on the elements of one explicit bias block; larger ones are cut into row chunks.
_BIAS_BUDGET = 1 << 24


@dataclass
class _Call:
    """One fused attention call over a slice of a level's gathered batch."""

    rows: slice
    q_slots: slice
    k_slots: slice
    is_causal: bool
    key_bias: bool = False  # add the (rows, heads, 1, slots) key-validity bias
    explicit_bias: bool = False  # build the full (rows, heads, q_slots, k_slots) bias
    check_empty: bool = False  # some real queries may see no key: fix their lse to -inf


@dataclass
class _Level:
    w: int
    r: int
    prev_w: int | None  # union mode: the lower level's segment length (keys of the query's own
    # level-(g-1) sub-segment are excluded); None otherwise
    causal: bool
    heads: torch.Tensor  # (Hc,) query heads, in call order
    head_pair: torch.Tensor  # (Hc,) index of each call head's (kv head, class) pair
    head_class: torch.Tensor  # (Hc,) offset class of each call head
    tq: torch.Tensor  # (R, Hc, Lq) key-slot coordinate of each gathered query slot
    k_real: torch.Tensor  # (R, P, L) key slot holds a real token
    q_rows: torch.Tensor  # (R, Hc, Lq) row of each query slot in a contiguous (B*Hq*Nq, D) view, clamped
    q_dump: torch.Tensor  # (R, Hc, Lq) the same, with slots that hold no real query sent to a dump row
    k_rows: torch.Tensor  # (R, P, L) row of each key slot in a contiguous (B*Hkv*Nk, D) view, clamped
    k_dump: torch.Tensor  # (R, P, L) the same, with empty key slots sent to a dump row
    calls: list = field(default_factory=list)
    # Set when the level's rows are plain consecutive segments (no padding, positions 0..n-1,
    # dilation 1, n a multiple of w): q, k, v are then *viewed* as (batch * n / w, heads, w, d).
    segment_view: bool = False
    unique_pairs: bool = True  # no two gathered K/V heads are the same (kv head, class) pair
    q0: int = 0  # key-slot coordinate of the first gathered query slot
    # Set when the rows are plain whole segments (no padding, positions 0..n-1, n a multiple of w,
    # q_len == kv_len): query slot t of class c in segment s is token s * w + c + t * r, so a
    # call's query slots are a strided view of any (batch, heads, n, d) tensor (see _strided_slots).
    plain: bool = False
    pairs: list = field(default_factory=list)  # (kv head, class) of each gathered K/V head
    # Sliding window (docs/contract.md 3.3), set only when it hides some key of this level:
    # key j is visible from query i only when j > i - window, by index in the key sequence.
    window: int | None = None
    q_index: torch.Tensor | None = None  # (R, Hc, Lq) key-sequence index of each query slot
    k_index: torch.Tensor | None = None  # (R, P, L) key-sequence index of each key slot (-1: empty)
    order: list = field(default_factory=list)  # `heads` as Python ints (read without a device sync)
    query_groups: dict = field(default_factory=dict)  # _query_groups' result per head count, once built


def dilated_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segment_lengths,
    dilation_rates,
    *,
    mode: str = DEFAULT_MODE,
    is_causal: bool = True,
    scale: float | None = None,
    dropout_p: float = 0.0,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    sliding_window: int | None = None,
    local_window: int | None = None,
    q_far: torch.Tensor | None = None,
    k_far: torch.Tensor | None = None,
    far_band: int | None = None,
    far_selection=None,
) -> torch.Tensor:
    """Dilated attention over q (batch, q_heads, q_len, head_dim) and k, v (batch, kv_heads,
    kv_len, head_dim); the queries are the last q_len tokens. Returns a tensor shaped like q.

    `attention_mask` (batch, kv_len) marks real tokens; `position_ids` (batch, kv_len) give token
    positions (packed documents restart at 0). `sliding_window` W also hides every key more than
    W - 1 indices before its query (docs/contract.md 3.3). See docs/contract.md 4 for the exact key
    sets of each mode. `local_window` W (mode "union" only) unites the levels with a local band:
    every key within W positions of its query (docs/contract.md 4.1); `q_far`/`k_far` (shaped like
    q/k) then score the keys beyond the band instead of q/k. `far_band` (the band of queries at
    positions >= local_window) and `far_selection` (ops.far_selection.FarSelection: sparse far keys)
    are docs/contract.md 4.2.
    """
    check_qkv(q, k, v, attention_mask, position_ids)
    check_scale_dropout(scale, dropout_p)
    check_int("sliding_window", sliding_window, optional=True)
    seg, dil = check_dilated_config(segment_lengths, dilation_rates, mode)
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {is_causal!r}")
    scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
    if local_window is not None or q_far is not None or k_far is not None:
        check_local_band(q, k, mode, local_window, q_far, k_far)
    check_far_reading(local_window, far_band, far_selection, is_causal)
    if far_band == local_window:
        far_band = None
    if q.shape[2] <= DECODE_MAX_QUERIES and far_band is None and far_selection is None and q.shape[2] < k.shape[2] and is_causal and dropout_p == 0.0:
        out = dilated_decode(q, k, v, seg, dil, mode, scale=scale, attention_mask=attention_mask,
                             position_ids=position_ids, sliding_window=sliding_window, local_window=local_window,
                             q_far=q_far, k_far=k_far)
        if out is not None:
            return out
    if (far_selection is not None and dropout_p == 0.0 and is_causal and sliding_window is None
            and q.shape[2] == k.shape[2]):
        documents = plain_documents(k.shape[0], k.shape[2], k.device, attention_mask, position_ids)
        if documents is not None and any(row != [(0, k.shape[2])] for row in documents):
            return _by_document(q, k, v, q_far, k_far, documents, seg, dil, local_window, far_band, far_selection,
                                scale)
    if far_selection is not None and sparse_far_plain.applies(
            token_layout(k.shape[0], k.shape[2], k.device, attention_mask, position_ids).plain, q, k, seg, dil,
            is_causal, sliding_window) and dropout_p == 0.0:
        q_far, k_far = (q, k) if q_far is None else (q_far, k_far)
        if not records_grad(q, k, v, q_far, k_far):
            return sparse_far_plain.sparse_far_forward(q, k, v, q_far, k_far, local_window, far_band, far_selection,
                                                       scale)
        if q.shape[2] > local_window and sparse_far_train.applies(q, k, v):
            out = sparse_far_train.sparse_far_attention(q, k, v, q_far, k_far, local_window, far_band, far_selection,
                                                        scale)
            if out is not None:
                return out
    if local_window is not None:
        return local_band_attention(q, k, v, seg, dil, local_window=local_window, q_far=q_far, k_far=k_far,
                                    is_causal=is_causal, scale=scale, dropout_p=dropout_p,
                                    attention_mask=attention_mask, position_ids=position_ids,
                                    sliding_window=sliding_window, far_band=far_band, far_selection=far_selection)
    key = (tuple(q.shape[:3]), tuple(k.shape[:3]), str(q.device), tuple(seg), tuple(dil), mode, is_causal,
           sliding_window)
    levels = _PLANS.get(key, attention_mask, position_ids)
    if levels is None:
        layout = token_layout(k.shape[0], k.shape[2], k.device, attention_mask, position_ids)
        levels = plan_levels(layout, q.shape[2], q.shape[1], k.shape[1], seg, dil, mode, is_causal, sliding_window)
        _PLANS.put(key, attention_mask, position_ids, levels)
    if dropout_p > 0.0:
        return _dropout_attention(q, k, v, levels, scale, dropout_p)
    return _DilatedAttention.apply(q, k, v, levels, scale)


_PLANS = PlanCache()


def _by_document(q, k, v, q_far, k_far, documents, seg, dil, local_window, far_band, far_selection, scale):
    """Sparse far keys (4.2) over rows whose documents are each a plain row of its own
    (token_layout.plain_documents: packed end to end, or one run of real tokens beside padding):
    document by document, so that each takes the plain paths (prefill and, on a GPU, training on
    FlexAttention: sparse_far_plain, sparse_far_train), which read nothing back, where the masked
    calls over the whole row read back per chunk of queries. A document within the band
    (local_window tokens or fewer) reads every earlier key of its own: causal attention (sdpa). A
    padded query slot, whose output docs/contract.md 3.1 leaves open, gets 0."""
    n = k.shape[2]
    rows = []
    for b, row in enumerate(documents):
        parts, at = [], 0
        for s, e in row:
            if s > at:  # padding before the document
                parts.append(q.new_zeros(1, q.shape[1], s - at, v.shape[-1]))
            at = e
            take = (slice(b, b + 1), slice(None), slice(s, e))
            if e - s <= local_window:
                if pair_count.TALLY.active:
                    pair_count.TALLY.pairs += q.shape[1] * (e - s) * (e - s + 1) // 2
                    pair_count.add_call()
                # (K/V repeated to the query heads: sdpa's enable_gqa needs torch 2.5; the document is short)
                kd, vd = (t[take].repeat_interleave(q.shape[1] // k.shape[1], 1) for t in (k, v))
                parts.append(torch.nn.functional.scaled_dot_product_attention(q[take], kd, vd, is_causal=True,
                                                                              scale=scale))
                continue
            parts.append(dilated_attention(q[take], k[take], v[take], seg, dil, scale=scale, local_window=local_window,
                                           q_far=None if q_far is None else q_far[take],
                                           k_far=None if k_far is None else k_far[take], far_band=far_band,
                                           far_selection=far_selection))
        if n > at:  # padding after the last document (or a row of padding)
            parts.append(q.new_zeros(1, q.shape[1], n - at, v.shape[-1]))
        rows.append(torch.cat(parts, 2))
    return torch.cat(rows, 0)


@dataclass(frozen=True)
class _Shape:
    """What every level of one call's plan shares: the call's shapes and options."""

    batch: int
    kv_len: int
    q_len: int  # the queries are the last q_len of the kv_len tokens
    q_heads: int
    kv_heads: int
    is_causal: bool
    window: int | None = None  # sliding window (docs/contract.md 3.3)

    @property
    def first_query(self) -> int:
        """The key index of the first query (0 for a prefill)."""
        return self.kv_len - self.q_len


def plan_levels(layout: TokenLayout, q_len, q_heads, kv_heads, seg, dil, mode, is_causal,
                window=None) -> list[_Level]:
    """The plans of the levels (seg[g], dil[g]) that have something to compute, in level order."""
    shape = _Shape(*layout.positions.shape, q_len, q_heads, kv_heads, is_causal, window)
    if mode == "head_groups":
        level_heads = head_groups(q_heads, len(seg))
    else:
        level_heads = [list(range(q_heads))] * len(seg)
    levels = []
    for g, (w, r) in enumerate(zip(seg, dil)):
        if not level_heads[g]:
            continue
        prev_w = seg[g - 1] if (mode == "union" and g > 0) else None
        level = _plan_level(layout, shape, w, r, prev_w, level_heads[g])
        if level is not None:
            levels.append(level)
    return levels


@dataclass
class _Rows:
    """A level's real tokens as rows (module docstring): table[c, i, t] is the key index of the
    token of offset class c in slot t of row i, -1 where empty, and b_row[i] is row i's batch row.
    Decode and chunked prefill keep only the rows that hold a query and mark those in is_query."""

    table: torch.Tensor  # (r, R, L)
    b_row: torch.Tensor  # (R,)
    is_query: torch.Tensor | None = None  # (r, R, L) the slot holds a query; None: every real token does


def _level_rows(layout: TokenLayout, lo: int, w: int, r: int) -> _Rows | None:
    """The rows of the real tokens from key index `lo` on, for segment `w` and dilation `r`: one
    row per (batch row, document, segment), r classes of w / r slots each (as many as the fullest
    row uses). None when there is no real token."""
    kv_len = layout.real.shape[1]
    planned = kv_len - lo
    flat = layout.real[:, lo:].reshape(-1).nonzero().squeeze(1)  # real tokens, in (batch, index) order
    if flat.numel() == 0:
        return None
    pos = layout.positions[:, lo:].reshape(-1)[flat]
    doc = layout.doc[:, lo:].reshape(-1)[flat]
    b = torch.div(flat, planned, rounding_mode="floor")
    j = flat - b * planned + lo
    segment = torch.div(pos, w, rounding_mode="floor")
    # Real tokens sorted by (batch, document, segment): a row starts where any of them changes.
    new_row = torch.ones_like(flat, dtype=torch.bool)
    new_row[1:] = (b[1:] != b[:-1]) | (doc[1:] != doc[:-1]) | (segment[1:] != segment[:-1])
    row = new_row.long().cumsum(0) - 1
    cls = torch.remainder(pos, r)
    slot = torch.div(torch.remainder(pos, w), r, rounding_mode="floor")
    table = torch.full((r, int(row[-1]) + 1, int(slot.max()) + 1), -1, dtype=torch.long, device=flat.device)
    table[cls, row, slot] = j  # key index of every (class, row, slot); -1 where empty
    return _Rows(table, b[new_row])


def _rows_with_queries(rows: _Rows, first_query: int) -> _Rows | None:
    """Decode and chunked prefill: only the rows that hold a query (a token at key index
    >= first_query), with those slots marked; None when no row does."""
    is_query = rows.table >= first_query  # empty slots hold -1
    keep = is_query.any(2).any(0)
    table, is_query, b_row = rows.table[:, keep], is_query[:, keep], rows.b_row[keep]
    if table.shape[1] == 0:
        return None
    return _Rows(table, b_row, is_query)


@dataclass
class _Queries:
    """The query slots gathered for each (class, row) of a level."""

    tq: torch.Tensor  # (r, R, Lq) key-slot coordinate of each query slot
    index: torch.Tensor  # (r, R, Lq) index of its query among the q_len queries; 0 where none
    real: torch.Tensor  # (r, R, Lq) the slot holds a real query
    decode: bool  # few queries per row: explicit-bias calls over (query slots x key slots)


def _query_slots(rows: _Rows, first_query: int, whole_rows: bool) -> _Queries:
    """A prefill's query slots are all slots. Decode and chunked prefill gather, per (class, row),
    the slots from its first query to its last real token; but when there are many queries per row
    (a chunk, a sequence-parallel shard) and `whole_rows` (causal, and union sub-segments aligned
    with the slots), the whole rows run as a prefill whose results are kept for the query slots only:
    fused causal calls beat an explicit (queries x keys) bias, whose kernel cannot skip masked blocks."""
    table, is_query = rows.table, rows.is_query
    r, n_rows, n_slots = table.shape
    slots = torch.arange(n_slots, device=table.device)
    if is_query is None:  # prefill: every real token is a query
        return _Queries(slots.expand(r, n_rows, n_slots), table.clamp(min=0), table >= 0, decode=False)
    qstart = torch.where(is_query, slots, n_slots).amin(2)  # (r, R)
    qend = torch.where(table >= 0, slots, -1).amax(2)  # (r, R)
    n_q = int((qend - qstart + 1).clamp(min=0).max())
    if whole_rows and 4 * n_q >= n_slots:
        return _Queries(slots.expand(r, n_rows, n_slots), torch.where(is_query, table - first_query, 0), is_query,
                        decode=False)
    tq = qstart[..., None] + torch.arange(n_q, device=table.device)  # (r, R, Lq)
    key = table.gather(2, tq.clamp(max=n_slots - 1))
    real = (tq < n_slots) & (key >= first_query)
    return _Queries(tq, torch.where(real, key - first_query, 0), real, decode=True)


def _window_hides_keys(table: torch.Tensor, window: int, kv_len: int) -> bool:
    """Whether a sliding window hides any key of these rows (a row that spans fewer than `window`
    key indices loses none)."""
    span = table.amax((0, 2)) - torch.where(table >= 0, table, kv_len).amin((0, 2))
    return bool((span >= window).any())


def _pairs(heads, q_heads, kv_heads, r):
    """Order the heads so that those reading one (kv head, class) pair are contiguous and every pair
    has the same number of heads (the fused kernel's grouped-query mapping); else one pair a head."""
    group = q_heads // kv_heads
    by_pair: dict[tuple[int, int], list[int]] = {}
    for h in heads:
        by_pair.setdefault((h // group, h % r), []).append(h)
    sizes = {len(hs) for hs in by_pair.values()}
    if len(sizes) == 1:
        keys = sorted(by_pair)
        order = [h for key in keys for h in by_pair[key]]
        head_pair = [i for i, key in enumerate(keys) for _ in by_pair[key]]
    else:
        keys = [(h // group, h % r) for h in heads]
        order = list(heads)
        head_pair = list(range(len(heads)))
    return order, head_pair, [kvh for kvh, _ in keys], [c for _, c in keys]


@dataclass
class _Heads:
    """A level's query heads in call order and the (kv head, class) pairs gathered for them (_pairs)."""

    order: list[int]  # query heads, in call order
    pairs: list[tuple[int, int]]  # (kv head, class) of each gathered K/V head
    heads: torch.Tensor  # (Hc,) `order`
    head_pair: torch.Tensor  # (Hc,) index of each call head's pair
    head_class: torch.Tensor  # (Hc,) offset class of each call head
    pair_kvh: torch.Tensor  # (P,) kv head of each pair
    pair_cls: torch.Tensor  # (P,) class of each pair


def _call_heads(heads, q_heads: int, kv_heads: int, r: int, device) -> _Heads:
    """`heads` ordered by _pairs, with the index tensors of that order on `device`."""
    order, head_pair, pair_kvh, pair_cls = _pairs(heads, q_heads, kv_heads, r)
    head_pair_t = torch.tensor(head_pair, dtype=torch.long, device=device)
    pair_cls_t = torch.tensor(pair_cls, dtype=torch.long, device=device)
    return _Heads(
        order, list(zip(pair_kvh, pair_cls)), torch.tensor(order, dtype=torch.long, device=device), head_pair_t,
        pair_cls_t[head_pair_t], torch.tensor(pair_kvh, dtype=torch.long, device=device), pair_cls_t,
    )


def _per_head(x: torch.Tensor, heads: _Heads) -> torch.Tensor:
    """(r, R, L) per class -> (R, Hc, L) per call head."""
    return x[heads.head_class].transpose(0, 1)


def _flat_rows(b_row, heads, n_heads: int, length: int, index):
    """The row of (batch b_row[i], head heads[h], token index[i, h, t]) in a contiguous
    (batch * n_heads * length, head_dim) view."""
    return (b_row[:, None, None] * n_heads + heads[None, :, None]) * length + index


def _plan_level(layout: TokenLayout, shape: _Shape, w: int, r: int, prev_w: int | None, heads) -> _Level | None:
    """The plan of one level (segment w, dilation r; prev_w as in _Level) for the query heads
    `heads`: its rows, query slots, head order, calls and gather indices. None when the level has
    no real token (decode, chunked prefill: no row that holds a query)."""
    first_query = shape.first_query
    # A decode step or chunk plans only the keys some query's segment (or window) can reach.
    rows = _level_rows(layout, first_key_within(layout, first_query, w, shape.window), w, r)
    if rows is not None and first_query > 0:
        rows = _rows_with_queries(rows, first_query)
    if rows is None:
        return None
    queries = _query_slots(rows, first_query, whole_rows=shape.is_causal and (prev_w is None or prev_w % r == 0))
    window = shape.window
    if window is not None and not _window_hides_keys(rows.table, window, shape.kv_len):
        window = None
    hs = _call_heads(heads, shape.q_heads, shape.kv_heads, r, rows.table.device)
    k_table = rows.table[hs.pair_cls].transpose(0, 1)  # (R, P, L)
    k_real = k_table >= 0
    n_slots = k_table.shape[-1]
    if window is not None:
        q_index = _per_head(torch.where(queries.real, queries.index + first_query, torch.iinfo(torch.long).max), hs)
        calls, q0 = _band_calls(k_table, q_index, _per_head(queries.tq, hs), window, shape.is_causal, r,
                                hs.head_pair.numel()), 0
    else:
        calls, q0 = _plan_calls(k_real, hs.head_pair, queries.tq.shape[-1], queries.decode, shape.is_causal,
                                prev_w, r, n_slots)
    # Gather only the key slots some call reads (union levels >= 2 never read the last sub-segment)
    # and the query slots some call reads (they skip the first sub-segment).
    k_end = max((n_slots if c.k_slots.stop is None else c.k_slots.stop) for c in calls) if calls else 0
    k_table, k_real = k_table[..., :k_end], k_real[..., :k_end]
    jq, q_real = _per_head(queries.index[..., q0:], hs), _per_head(queries.real[..., q0:], hs)
    q_rows = _flat_rows(rows.b_row, hs.heads, shape.q_heads, shape.q_len, jq)
    k_rows = _flat_rows(rows.b_row, hs.pair_kvh, shape.kv_heads, shape.kv_len, k_table.clamp(min=0))
    level = _Level(
        w, r, prev_w, shape.is_causal, hs.heads, hs.head_pair, hs.head_class,
        tq=_per_head(queries.tq[..., q0:], hs), k_real=k_real,
        q_rows=q_rows, q_dump=q_rows.masked_fill(~q_real, shape.batch * shape.q_heads * shape.q_len),
        k_rows=k_rows, k_dump=k_rows.masked_fill(~k_real, shape.batch * shape.kv_heads * shape.kv_len), calls=calls,
        unique_pairs=len(set(hs.pairs)) == len(hs.pairs), q0=q0, pairs=hs.pairs, order=hs.order,
    )
    if window is not None:  # banded calls: none of the fast paths of whole segments applies
        level.window, level.q_index, level.k_index = window, q_index, k_table
    else:
        _mark_fast_paths(level, layout, shape, hs)
    return level


def _mark_fast_paths(level: _Level, layout: TokenLayout, shape: _Shape, hs: _Heads) -> None:
    """Set level.plain and level.segment_view (see _Level) where the rows are whole plain segments."""
    whole = layout.plain and shape.q_len == shape.kv_len and shape.kv_len % level.w == 0 and shape.kv_len >= level.w
    level.plain = whole
    level.segment_view = (
        whole and level.r == 1 and level.q0 == 0 and hs.order == list(range(shape.q_heads))
        and shape.q_heads == shape.kv_heads * (shape.q_heads // shape.kv_heads)
        and [kvh for kvh, _ in hs.pairs] == list(range(shape.kv_heads))
    )


def _plan_calls(k_real, head_pair, n_q, decode, is_causal, prev_w, r, n_slots):
    """The fused calls of one level, and the first query slot they read."""
    all_rows, all_slots = slice(None), slice(None)
    n_rows, n_heads = k_real.shape[0], head_pair.shape[0]
    irregular = bool((k_real[..., 1:] & ~k_real[..., :-1]).any())
    if decode or not is_causal or (prev_w is not None and prev_w % r != 0):
        # General case: an explicit bias over (query slots x key slots), cut into row chunks.
        step = max(1, _BIAS_BUDGET // max(1, n_heads * n_q * n_slots))
        calls = [
            _Call(slice(s, min(s + step, n_rows)), all_slots, all_slots, False, explicit_bias=True, check_empty=True)
            for s in range(0, n_rows, step)
        ]
        return calls, 0
    if prev_w is None:
        return [_Call(all_rows, all_slots, all_slots, True, key_bias=irregular)], 0
    # union, level >= 2: queries of sub-segment s see the keys of sub-segments 0..s-1.
    sub = prev_w // r
    calls = [
        _Call(all_rows, slice(s - sub, min(s + sub, n_slots) - sub), slice(0, s), False,
              key_bias=irregular, check_empty=irregular)
        for s in range(sub, n_slots, sub)
    ]
    return calls, sub


def _band_calls(k_index, q_index, tq, window, is_causal, r, n_heads):
    """The calls of a level whose sliding window hides keys: explicit-bias calls over chunks of
    query slots, each reading only the key slots from the first one its window reaches to the last
    one its causality allows, so a query never touches keys far outside its window.

    k_index (R, P, L) key-sequence index of each key slot (-1: empty); q_index (R, Hc, Lq) that of
    each query slot (int64 max where no real query); tq (R, Hc, Lq) key-slot coordinate of each
    query slot (the last key slot a causal query may read)."""
    n_rows, n_q, n_k = k_index.shape[0], q_index.shape[-1], k_index.shape[-1]
    # Query-slot chunk: about a window of slots, smaller when the bias of one row would not fit.
    reach = -(-window // r) + 1  # key slots one query's window spans, at most (plain rows)
    bias_heads = 1 if r == 1 else n_heads
    chunk = max(16, min(n_q, reach))
    while chunk > 16 and bias_heads * chunk * (chunk + reach) > _BIAS_BUDGET:
        chunk //= 2
    starts = list(range(0, n_q, chunk))
    # First key slot within reach of each chunk, over every row and pair: real key indices rise
    # with the slot, so a reverse cumulative min fills the empty slots and the search is sorted.
    big = torch.iinfo(torch.long).max
    filled = torch.where(k_index >= 0, k_index, big).flip(-1).cummin(-1).values.flip(-1).reshape(-1, n_k)
    q_min = torch.stack([q_index[..., s:s + chunk].amin() for s in starts])
    bounds = (q_min - window + 1).clamp(min=0)
    k_lo = torch.searchsorted(filled.contiguous(), bounds.expand(filled.shape[0], -1).contiguous()).amin(0).tolist()
    if is_causal:
        last = torch.stack([tq[..., min(s + chunk, n_q) - 1].amax() for s in starts]).clamp(max=n_k - 1)
        k_hi = (last + 1).tolist()
    else:
        k_hi = [n_k] * len(starts)
    calls = []
    for s, lo, hi in zip(starts, k_lo, k_hi):
        if lo >= hi:
            continue
        step = max(1, _BIAS_BUDGET // max(1, bias_heads * min(chunk, n_q - s) * (hi - lo)))
        calls += [_Call(slice(b, min(b + step, n_rows)), slice(s, min(s + chunk, n_q)), slice(lo, hi), False,
                        explicit_bias=True, check_empty=True) for b in range(0, n_rows, step)]
    return calls


def _key_bias(level: _Level, call: _Call, dtype):
    valid = level.k_real[call.rows][:, level.head_pair][..., call.k_slots]  # (R, Hc, Lk)
    return torch.zeros(valid.shape, dtype=dtype, device=valid.device).masked_fill_(~valid, float("-inf"))[:, :, None, :]


def _explicit_visible(level: _Level, call: _Call):
    """(R, Hc or 1, Lq, Lk) visibility of the call's key slots from its query slots, for the
    general case. With dilation 1 every head reads the same slots: one head, broadcast."""
    heads = slice(None) if level.r > 1 else slice(0, 1)
    head_pair = level.head_pair[heads]
    valid = level.k_real[call.rows][:, head_pair][..., call.k_slots]  # (R, Hc, Lk)
    tq = level.tq[call.rows][:, heads][..., call.q_slots]  # (R, Hc, Lq)
    tk = torch.arange(level.k_real.shape[-1], device=valid.device)[call.k_slots]
    visible = valid[:, :, None, :].expand(*tq.shape, valid.shape[-1])
    if level.causal:
        visible = visible & (tk <= tq[..., None])
    if level.window is not None:
        qi = level.q_index[call.rows][:, heads][..., call.q_slots]
        ki = level.k_index[call.rows][:, head_pair][..., call.k_slots]
        visible = visible & (ki[:, :, None, :] > qi[..., None] - level.window)
    if level.prev_w is not None:
        c = level.head_class[heads][None, :, None]
        sub_q = torch.div(c + level.r * tq, level.prev_w, rounding_mode="floor")[..., None]
        sub_k = torch.div(c[..., None] + level.r * tk, level.prev_w, rounding_mode="floor")
        visible = visible & ((sub_k < sub_q) if level.causal else (sub_k != sub_q))
    return visible


def _call_inputs(level: _Level, call: _Call, q_l, k_l, v_l):
    """Slices of the gathered batch and the bias (and empty-query mask) of one call."""
    qs = q_l[call.rows][:, :, call.q_slots]
    ks = k_l[call.rows][:, :, call.k_slots]
    vs = v_l[call.rows][:, :, call.k_slots]
    bias, empty = None, None
    if call.explicit_bias:
        visible = _explicit_visible(level, call)
        bias = torch.zeros(visible.shape, dtype=q_l.dtype, device=q_l.device).masked_fill_(~visible, float("-inf"))
        empty = ~visible.any(-1)
    elif call.key_bias:
        bias = _key_bias(level, call, q_l.dtype)
        if call.check_empty:
            empty = (bias[:, :, 0] == float("-inf")).all(-1)[..., None].expand(qs.shape[:3])
    return qs, ks, vs, bias, empty


def _row_view(t: torch.Tensor):
    """A (tokens, head_dim) view of a 4-D tensor and the row strides of its (batch, head, token)
    dims, without copying when its memory is dense in any dim order (e.g. HF's transposed q)."""
    d = t.shape[-1]
    strides, sizes = t.stride(), t.shape
    order = sorted(range(3), key=lambda i: strides[i])
    dense = strides[3] == 1 and all(s % d == 0 for s in strides[:3])
    expect = d
    for i in order:
        dense = dense and (sizes[i] == 1 or strides[i] == expect)
        expect *= sizes[i]
    if not dense:
        t = t.contiguous()
        strides = t.stride()
    base = as_strided_within(t, (t.numel() // d, d), (d, 1), t.storage_offset())
    return base, tuple(s // d for s in strides[:3])


def _rows_for(index: torch.Tensor, shape, row_strides):
    """Re-express contiguous-layout row indices for a tensor with other (dense) row strides."""
    h, n = shape[1], shape[2]
    if row_strides == (h * n, n, 1):
        return index
    sb, sh, sn = row_strides
    bh = torch.div(index, n, rounding_mode="floor")
    return torch.div(bh, h, rounding_mode="floor") * sb + torch.remainder(bh, h) * sh + (index - bh * n) * sn


def _gather(t, index):
    base, strides = _row_view(t)
    rows = _rows_for(index, t.shape, strides)
    return base.index_select(0, rows.reshape(-1)).view(*index.shape, t.shape[-1])


def _gather_level(level: _Level, q, k, v):
    if level.segment_view:
        return _segment_view(q, level.w), _segment_view(k, level.w), _segment_view(v, level.w)
    return _gather(q, level.q_rows), _gather(k, level.k_rows), _gather(v, level.k_rows)


def _nonempty_calls(levels: list[_Level], q, k, v):
    """Every call with queries and keys, level by level: (level, call, q/k/v slices, bias, empty)."""
    for level in levels:
        q_l, k_l, v_l = _gather_level(level, q, k, v)
        for call in level.calls:
            qs, ks, vs, bias, empty = _call_inputs(level, call, q_l, k_l, v_l)
            if ks.shape[2] and qs.shape[2]:
                yield level, call, qs, ks, vs, bias, empty


def _plain_levels(levels: list[_Level], q) -> bool:
    """Every level is plain, every call covers all of its level's rows, and the first level covers
    every head and token with one causal call."""
    return (
        bool(levels) and all(level.plain for level in levels) and levels[0].segment_view
        and levels[0].heads.numel() == q.shape[1] and len(levels[0].calls) == 1 and q.stride(-1) == 1
        and all(call.rows.indices(level.k_real.shape[0]) == (0, level.k_real.shape[0], 1)
                for level in levels for call in level.calls)
    )


def _unsegment(x: torch.Tensor, batch: int) -> torch.Tensor:
    """Inverse of _segment_view: (batch * n / w, heads, w, ...) -> (batch, heads, n, ...); a view
    when batch is 1 or the layout allows it, else a copy."""
    return x.unflatten(0, (batch, x.shape[0] // batch)).transpose(1, 2).flatten(2, 3)


def _strided_slots(x, head0, head_step, n_heads, class0, class_step, t0, n_slots, w, r):
    """A view of x (batch, heads, n[, d]) shaped (batch, n / w, n_heads, n_slots[, d]): element
    (b, s, i, t) is x[b, head0 + i * head_step, s * w + c + (t0 + t) * r], c = class0 + i * class_step.
    Raises if some element would lie outside x (another head, the next segment, past the storage)."""
    last_class = class0 + (n_heads - 1) * class_step
    if n_heads and n_slots and not (
            x.shape[2] % w == 0 and head0 >= 0 and head0 + (n_heads - 1) * head_step < x.shape[1]
            and class0 >= 0 and last_class + (t0 + n_slots - 1) * r < w and t0 >= 0):
        raise IndexError(f"strided slots outside x {tuple(x.shape)}: heads {head0}+{head_step}k (x{n_heads}), "
                         f"class {class0}..{last_class}, slots {t0}..{t0 + n_slots - 1} of segment {w} / {r}")
    sb, sh, sn = x.stride()[:3]
    sizes = (x.shape[0], x.shape[2] // w, n_heads, n_slots) + tuple(x.shape[3:])
    strides = (sb, w * sn, head_step * sh + class_step * sn, r * sn) + tuple(x.stride()[3:])
    return as_strided_within(x, sizes, strides, x.storage_offset() + head0 * sh + (class0 + t0 * r) * sn)


def _query_groups(level: _Level, n_heads: int):
    """The query heads of a plain level in groups whose slots form one strided view: yields
    (pick: their places in the call's head order, view arguments of _strided_slots). Head h reads
    class h mod r: for r < heads the heads of class c are c, c + r, ...; for r >= heads head h is
    class h. Built once per plan (from Python ints: no device sync, no host-to-device copy after it)."""
    if n_heads not in level.query_groups:
        level.query_groups[n_heads] = list(_build_query_groups(level, n_heads))
    return level.query_groups[n_heads]


def _build_query_groups(level: _Level, n_heads: int):
    r, order = level.r, level.order or level.heads.tolist()
    if r >= n_heads:
        groups = [(list(range(n_heads)), (0, 1, n_heads, 0, 1))]
    else:
        groups = [(list(range(c, n_heads, r)), (c, r, len(range(c, n_heads, r)), c, 0)) for c in range(r)]
    for heads, args in groups:
        pos = [order.index(h) for h in heads]
        step = pos[1] - pos[0] if len(pos) > 1 else 1
        if step > 0 and pos == list(range(pos[0], pos[0] + step * len(pos), step)):
            yield slice(pos[0], pos[-1] + 1, step), args
        else:
            yield torch.tensor(pos, device=level.heads.device), args


def _plain_query_parts(level: _Level, call: _Call, targets, parts):
    """Pair a plain level's call results (rows, heads, query slots[, d]) with the slots of the
    (batch, heads, n[, d]) targets they belong to: yields ([target views], [result parts])."""
    batch, n_heads = targets[0].shape[:2]
    t0, n_q = level.q0 + (call.q_slots.start or 0), parts[0].shape[2]
    parts = [x.unflatten(0, (batch, x.shape[0] // batch)) for x in parts]
    for pick, args in _query_groups(level, n_heads):
        yield ([_strided_slots(t, *args, t0, n_q, level.w, level.r) for t in targets],
               [x[:, :, pick] for x in parts])


def _plain_key_parts(level: _Level, call: _Call, target, part):
    """The key-side twin of _plain_query_parts: runs of gathered (kv head, class) pairs whose slots
    form one strided view (_key_groups), one view per run."""
    batch = target.shape[0]
    t0, n_k = call.k_slots.start or 0, part.shape[2]
    part = part.unflatten(0, (batch, part.shape[0] // batch))
    for p0, n, (kvh, head_step, c, class_step) in _key_groups(level):
        yield (_strided_slots(target, kvh, head_step, n, c, class_step, t0, n_k, level.w, level.r),
               part[:, :, p0:p0 + n])


def _key_groups(level: _Level):
    """level.pairs cut into runs of consecutive pairs that advance by one constant (kv head, class)
    step: (first pair, pairs, (kv head, head step, class, class step)). Distinct pairs hold disjoint
    key slots, so one strided view per run adds exactly what one view per pair would. Built once."""
    if "keys" not in level.query_groups:
        pairs, runs, p = level.pairs, [], 0
        while p < len(pairs):
            n, step = 1, None
            if p + 1 < len(pairs):
                step = (pairs[p + 1][0] - pairs[p][0], pairs[p + 1][1] - pairs[p][1])
                if min(step) < 0 or step == (0, 0):
                    step = None
            while step and p + n < len(pairs) and (pairs[p + n][0] - pairs[p + n - 1][0],
                                                    pairs[p + n][1] - pairs[p + n - 1][1]) == step:
                n += 1
            head_step, class_step = step or (1, 0)
            runs.append((p, n, (pairs[p][0], head_step, pairs[p][1], class_step)))
            p += n
        level.query_groups["keys"] = runs
    return level.query_groups["keys"]


def _forward_plain(q, k, v, levels: list[_Level], scale):
    """_forward for plain levels: the first level's output *is* the accumulator and later calls
    merge into strided views of it in place, instead of index_select / index_copy_ round trips
    (serial passes over the accumulator that cost more, relatively, the more threads run)."""
    acc_dtype = merge_dtype(q.dtype)
    acc = lse_acc = None
    finite = False
    for level, call, qs, ks, vs, bias, empty in _nonempty_calls(levels, q, k, v):
        o, lse = attention_forward(qs, ks, vs, is_causal=call.is_causal, scale=scale, attn_bias=bias)
        if empty is not None:
            lse = lse.masked_fill(empty, float("-inf"))
        if acc is None:  # the first level: one causal call over plain segments of every head
            acc, lse_acc = _to_accumulator(o, q, level.w, acc_dtype), _unsegment(lse.to(acc_dtype), q.shape[0])
            finite = empty is None  # it gave every query a key (its own): the accumulator's lse is finite
            continue
        for (acc_v, lse_v), (o_part, lse_part) in _plain_query_parts(level, call, (acc, lse_acc), (o, lse)):
            merge_into(acc_v, lse_v, o_part, lse_part.to(acc_dtype), acc_finite=finite)
    return acc.to(q.dtype), lse_acc


def _forward(q, k, v, levels: list[_Level], scale):
    if _plain_levels(levels, q):
        return _forward_plain(q, k, v, levels, scale)
    batch, q_heads, q_len, head_dim = q.shape
    acc_dtype = merge_dtype(q.dtype)
    # One extra dump row receives the slots that hold no real query. A first level of plain
    # segments over every head writes every row, so it needs no zero-fill.
    covered = bool(levels) and levels[0].segment_view and levels[0].heads.numel() == q_heads
    alloc = torch.empty if covered else torch.zeros
    acc_out = alloc(batch * q_heads * q_len + 1, head_dim, dtype=acc_dtype, device=q.device)
    acc_lse = torch.full((batch * q_heads * q_len + 1,), float("-inf"), dtype=acc_dtype, device=q.device)
    fresh = True  # nothing merged yet: the first call writes instead of merging
    for level, call, qs, ks, vs, bias, empty in _nonempty_calls(levels, q, k, v):
        o, lse = attention_forward(qs, ks, vs, is_causal=call.is_causal, scale=scale, attn_bias=bias)
        if empty is not None:
            lse = lse.masked_fill(empty, float("-inf"))
        dst = level.q_dump[call.rows][:, :, call.q_slots].reshape(-1)
        if fresh:
            acc_out.index_copy_(0, dst, o.reshape(-1, head_dim).to(acc_dtype))
            acc_lse.index_copy_(0, dst, lse.reshape(-1).to(acc_dtype))
            fresh = False
            continue
        new_out, new_lse = merge_partial(
            acc_out.index_select(0, dst), acc_lse.index_select(0, dst),
            o.reshape(-1, head_dim), lse.reshape(-1).to(acc_dtype),
        )
        acc_out.index_copy_(0, dst, new_out)
        acc_lse.index_copy_(0, dst, new_lse)
    out = acc_out[:-1].view(batch, q_heads, q_len, head_dim).to(q.dtype)
    return out, acc_lse[:-1].view(batch, q_heads, q_len)


def _segment_view(t: torch.Tensor, w: int) -> torch.Tensor:
    """(batch, heads, n, ...) -> (batch * n / w, heads, w, ...): a view for dense layouts."""
    return t.unflatten(2, (t.shape[2] // w, w)).transpose(1, 2).flatten(0, 1)


def _segment_add(target: torch.Tensor, grad: torch.Tensor, w: int, overwrite: bool = False) -> None:
    """target (batch, heads, n, d) += grad laid out as _segment_view(target, w), in place
    (or = grad, when `overwrite`)."""
    b, h, n, d = target.shape
    view = target.view(b, h, n // w, w, d).transpose(1, 2)
    grad = grad.reshape(b, n // w, h, w, d)
    view.copy_(grad) if overwrite else view.add_(grad)


def _add_rows(target: torch.Tensor, index: torch.Tensor, grad: torch.Tensor, unique: bool = True) -> None:
    """target[index] += grad rows. When a real row occurs once in `index` (only the dump row
    repeats) a gather-add-scatter is exact, and much faster than index_add_ on CPU."""
    if not unique:
        target.index_add_(0, index, grad.reshape(-1, target.shape[-1]).to(target.dtype))
        return
    rows = target.index_select(0, index)
    rows += grad.reshape(rows.shape)
    target.index_copy_(0, index, rows)


def _backward_calls(dout, q, k, v, out, lse, levels: list[_Level], scale):
    """The flash backward of every non-empty call: yields (level, call, dq part, dk part, dv part)."""
    n_q_rows = q.numel() // q.shape[-1]
    dout = dout.to(q.dtype)
    lse_flat = lse.reshape(-1)
    for level in levels:
        q_l, k_l, v_l = _gather_level(level, q, k, v)
        if level.segment_view:
            do_l, o_l = _segment_view(dout, level.w), _segment_view(out, level.w)
            lse_l = _segment_view(lse, level.w)
        else:
            # Slots without a real query read dout = 0 and lse = +inf: probability 0, no gradient.
            no_query = level.q_dump == n_q_rows
            do_l = _gather(dout, level.q_rows).masked_fill_(no_query[..., None], 0.0)
            o_l = _gather(out, level.q_rows)
            lse_l = lse_flat[level.q_rows].masked_fill_(no_query, float("inf"))
        for call in level.calls:
            qs, ks, vs, bias, _ = _call_inputs(level, call, q_l, k_l, v_l)
            if ks.shape[2] == 0 or qs.shape[2] == 0:
                continue
            rows, q_slots = call.rows, call.q_slots
            g_q, g_k, g_v = attention_backward(
                do_l[rows][:, :, q_slots], qs, ks, vs, o_l[rows][:, :, q_slots],
                lse_l[rows][:, :, q_slots].contiguous(), is_causal=call.is_causal, scale=scale, attn_bias=bias,
            )
            yield level, call, g_q, g_k, g_v


def _backward(dout, q, k, v, out, lse, levels: list[_Level], scale):
    if _plain_levels(levels, q):
        return _backward_plain(dout, q, k, v, out, lse, levels, scale)
    head_dim = q.shape[-1]
    acc_dtype = merge_dtype(q.dtype)
    # A first level of plain segments over every head writes every gradient row: no zero-fill.
    fresh = bool(levels) and levels[0].segment_view and levels[0].heads.numel() == q.shape[1]
    alloc = torch.empty if fresh else torch.zeros
    dq = alloc(q.numel() // head_dim + 1, head_dim, dtype=acc_dtype, device=q.device)
    dk = alloc(k.numel() // head_dim + 1, head_dim, dtype=acc_dtype, device=q.device)
    dv = alloc(k.numel() // head_dim + 1, head_dim, dtype=acc_dtype, device=q.device)
    for level, call, g_q, g_k, g_v in _backward_calls(dout, q, k, v, out, lse, levels, scale):
        if level.segment_view:
            _segment_add(dq[:-1].view(q.shape), g_q, level.w, overwrite=fresh)
            _segment_add(dk[:-1].view(k.shape), g_k, level.w, overwrite=fresh)
            _segment_add(dv[:-1].view(v.shape), g_v, level.w, overwrite=fresh)
            fresh = False
            continue
        dst = level.q_dump[call.rows][:, :, call.q_slots].reshape(-1)
        kd = level.k_dump[call.rows][:, :, call.k_slots].reshape(-1)
        _add_rows(dq, dst, g_q)
        _add_rows(dk, kd, g_k, unique=level.unique_pairs)
        _add_rows(dv, kd, g_v, unique=level.unique_pairs)
    return (dq[:-1].view(q.shape).to(q.dtype), dk[:-1].view(k.shape).to(k.dtype), dv[:-1].view(v.shape).to(v.dtype))


def _backward_plain(dout, q, k, v, out, lse, levels: list[_Level], scale):
    """_backward for plain levels (see _forward_plain): the first level's gradients are the
    accumulators (float32 copies for lower precisions), and later calls add into strided views."""
    acc_dtype = merge_dtype(q.dtype)
    dq = dk = dv = None
    for level, call, g_q, g_k, g_v in _backward_calls(dout, q, k, v, out, lse, levels, scale):
        if dq is None:  # the first level: one causal call over plain segments of every head
            dq, dk, dv = (_to_accumulator(g, like, level.w, acc_dtype) for g, like in ((g_q, q), (g_k, k), (g_v, v)))
            continue
        for (dq_v,), (g,) in _plain_query_parts(level, call, (dq,), (g_q,)):
            dq_v += g
        for grad, g_kv in ((dk, g_k), (dv, g_v)):
            for view, g in _plain_key_parts(level, call, grad, g_kv):
                view += g
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _to_accumulator(x, like, w, dtype):
    """A first-level result laid out as _segment_view(like, w), as a (batch, heads, n, d) tensor of
    `dtype`: a view of x itself when it already has that dtype (no copy), else a converted copy."""
    if x.dtype == dtype:
        return _unsegment(x, like.shape[0])
    acc = torch.empty_like(like, dtype=dtype)
    _segment_add(acc, x, w, overwrite=True)
    return acc


def _dropout_attention(q, k, v, levels: list[_Level], scale: float, dropout_p: float):
    """Dropout on the attention probabilities. The fused kernels have no dropout, so this path
    materialises each call's scores (memory O(rows * q_slots * k_slots), i.e. O(N * w / r)) and
    lets autograd differentiate plain torch ops. Probabilities are exp(s - m) / Z, with m the exact
    log-sum-exp of the fused forward (a constant: it cancels) and Z summed over all levels."""
    batch, q_heads, q_len, head_dim = q.shape
    acc_dtype = merge_dtype(q.dtype)
    with torch.no_grad():
        _, m = _forward(q, k, v, levels, scale)
    m_rows = torch.cat([m.reshape(-1).nan_to_num(neginf=0.0), m.new_zeros(1)])
    numer = torch.zeros(batch * q_heads * q_len + 1, head_dim, dtype=acc_dtype, device=q.device)
    denom = torch.zeros(batch * q_heads * q_len + 1, dtype=acc_dtype, device=q.device)
    for level, call, qs, ks, vs, bias, _ in _nonempty_calls(levels, q, k, v):
        groups = qs.shape[1] // ks.shape[1]
        ks, vs = ks.repeat_interleave(groups, 1), vs.repeat_interleave(groups, 1)
        scores = (qs.to(acc_dtype) @ ks.to(acc_dtype).transpose(-1, -2)) * scale
        if bias is not None:
            scores = scores + bias.to(acc_dtype)
        if call.is_causal:
            n_q, n_k = scores.shape[-2:]
            scores = scores.masked_fill(torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        dst = level.q_dump[call.rows][:, :, call.q_slots]
        weights = torch.exp(scores - m_rows[dst][..., None])
        dropped = torch.nn.functional.dropout(weights, p=dropout_p, training=True)
        numer = numer.index_add(0, dst.reshape(-1), (dropped @ vs.to(acc_dtype)).reshape(-1, head_dim))
        denom = denom.index_add(0, dst.reshape(-1), weights.sum(-1).reshape(-1))
    out = numer[:-1] / denom[:-1].clamp(min=torch.finfo(acc_dtype).tiny)[:, None]
    return out.view(batch, q_heads, q_len, head_dim).to(q.dtype)


class _DilatedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, levels, scale):
        out, lse = _forward(q, k, v, levels, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.levels, ctx.scale = levels, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(dout, q, k, v, out, lse, ctx.levels, ctx.scale)
        return dq, dk, dv, None, None
