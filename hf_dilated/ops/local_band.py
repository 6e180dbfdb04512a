"""Union dilated attention with a local band (docs/contract.md 4.1): every key within `local_window`
positions of its query, united with the union levels' keys further back, which may be read with a
second pair of query/key projections (`q_far`, `k_far`: the same vectors rotated to grouped
positions, Self-Extend style, so that far keys sit at relative positions the model was trained on).

How it is computed. Query chunks of `_CHUNK` tokens; per chunk two fused calls that return the
log-sum-exp (backend.py), merged by it (merge.py): the *near* call reads (q, k) over the keys a
chunk's band can reach (about `local_window` + chunk keys), the *far* call (q_far, k_far) over the
keys before it. Which keys each query may read is an additive mask built from the kernels' token
rule (positions, documents, padding: ops/token_layout.py), so padding, packing, decode and chunked
prefill are exact by construction; a chunk whose far part holds no key skips the call. The
backward is the flash backward of each call fed with the merged output and log-sum-exp, so
training keeps no probability matrix. Cost per query: the band plus the keys before it (the masks
select the levels' share of them; the fused kernel does not skip masked keys).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import backend, far_selection, pair_count
from .backend import attention_backward, attention_forward
from .far_selection import FarSelection, band_widths
from .merge import merge_dtype, merge_into, merge_partial
from .plan_cache import PlanCache
from .strided import canonical
from .token_layout import TokenLayout, first_key_within, token_layout, visible_pairs
from .validate import records_grad

_CHUNK = 512  # queries per call: a (heads x chunk x keys) mask stays a few hundred MB at 16K keys
# Queries per call with sparse far keys (4.2): the far call reads the union of its queries' selected
# blocks, which grows with the chunk.
_SELECT_CHUNK = 128


@dataclass(frozen=True)
class _Call:
    queries: slice  # query rows (of q / q_far)
    keys: slice  # key rows (of k / k_far)
    far: bool  # reads q_far / k_far


@dataclass
class _Plan:
    layout: TokenLayout
    segment_lengths: list
    dilation_rates: list
    window: int
    is_causal: bool
    sliding_window: int | None
    first: int  # key index of the first query
    calls: list
    far_band: int | None = None  # the band of queries at positions >= window (4.2); None: window
    selection: FarSelection | None = None  # sparse far keys (4.2); None: every far key
    blocks: far_selection.Blocks | None = None  # the far blocks, with a selection
    slots: torch.Tensor | None = None  # with a selection and a sliding window: far_selection.slot_table
    # Whether each call has any visible pair, found by the first forward on this plan (a read back
    # to the host); every later layer and the backward skip the empty calls without one.
    nonempty: list | None = None


def local_band_attention(q, k, v, segment_lengths, dilation_rates, *, local_window: int, q_far=None, k_far=None,
                         is_causal: bool = True, scale: float, dropout_p: float = 0.0, attention_mask=None,
                         position_ids=None, sliding_window=None, far_band: int | None = None,
                         far_selection: FarSelection | None = None):
    """Inputs as `dilated_attention` (validated there), mode "union" with a local band of
    `local_window` positions; `q_far`/`k_far` (shaped like q/k, or both None) score the keys beyond it.
    `far_band` and `far_selection`: a narrower band past local_window and sparse far keys (4.2; on
    plain rows without autograd, dilated_attention takes sparse_far_plain instead)."""
    if dropout_p > 0.0:
        raise ValueError(f"dropout_p: a local band (local_window) has no attention dropout yet, got {dropout_p}")
    layout = token_layout(k.shape[0], k.shape[2], k.device, attention_mask, position_ids)
    if q_far is None:
        q_far, k_far = q, k
    if far_band == local_window:
        far_band = None
    every_key = any(w >= k.shape[2] and r == 1 for w, r in zip(segment_lengths, dilation_rates))
    if far_band is None and far_selection is None and (every_key or not pair_count.TALLY.active) and \
            plain_forward_applies(layout, q, k, segment_lengths, dilation_rates, is_causal, sliding_window) and \
            not records_grad(q, k, v, q_far, k_far):
        if pair_count.TALLY.active:  # a level holds every earlier key: dense causal attention's pairs
            pair_count.TALLY.pairs += q.shape[0] * q.shape[1] * q.shape[2] * (q.shape[2] + 1) // 2
            pair_count.add_call()
        return plain_forward(q, k, v, q_far, k_far, list(segment_lengths), list(dilation_rates), local_window, scale)
    key = (k.shape[0], k.shape[2], q.shape[:3], str(k.device), tuple(segment_lengths), tuple(dilation_rates),
           local_window, is_causal, sliding_window, far_band, far_selection)
    plan = _PLANS.get(key, attention_mask, position_ids)
    if plan is None:
        plan = _plan(layout, q.shape[2], list(segment_lengths), list(dilation_rates), local_window, is_causal,
                     sliding_window, far_band, far_selection)
        _PLANS.put(key, attention_mask, position_ids, plan)
    return _LocalBand.apply(q, k, v, q_far, k_far, plan, scale)


# Plans by the identity of the mask and position tensors (plan_cache.py): every layer reuses the
# first one's, with the calls' emptiness it found.
_PLANS = PlanCache()


def _plan(layout, q_len, seg, dil, window, is_causal, sliding_window, far_band=None, selection=None) -> _Plan:
    """The calls: per query chunk, near keys from the first index its band (or sliding window) can
    reach, far keys up to the last one beyond some query's band. In a document positions advance
    at least one per real token, so a key more than `window` - 1 *real tokens* before the chunk's
    first query is beyond every band. With `far_band`, a chunk whose queries all sit at positions
    >= window has bands of far_band (read to the host once, here)."""
    batch, kv_len = layout.real.shape
    first = kv_len - q_len
    chunk = _CHUNK if selection is None else _SELECT_CHUNK
    narrowest = window if far_band is None else min(window, far_band)
    if far_band is not None:
        positions = layout.positions[:, first:].masked_fill(~layout.real[:, first:], 1 << 62)
        chunk_low = [int(positions[:, s:s + chunk].min()) for s in range(0, q_len, chunk)]
    calls = []
    for s in range(0, q_len, chunk):
        e = min(q_len, s + chunk)
        stop = first + e if is_causal else kv_len
        reach = window if far_band is None or chunk_low[s // chunk] < window else far_band
        near_lo = first_key_within(layout, first + s, reach, sliding_window)
        # Within a document a position advances at most as far as the index (3.1), so a key W or more
        # positions before the chunk's last query lies at least W indices before it.
        far_stop = max(0, first + e - narrowest) if is_causal else kv_len
        far_lo = 0 if sliding_window is None else max(0, first + s - (sliding_window - 1))
        calls.append(_Call(slice(s, e), slice(near_lo, stop), False))
        if far_stop > far_lo:
            calls.append(_Call(slice(s, e), slice(far_lo, far_stop), True))
    blocks = slots = None
    if selection is not None:
        blocks = far_selection.blocks_of(layout.positions, layout.real, layout.doc, selection.block_size)
        if sliding_window is not None:
            slots = far_selection.slot_table(blocks, layout.positions, selection.block_size)
    return _Plan(layout, seg, dil, window, is_causal, sliding_window, first, calls, far_band=far_band,
                 selection=selection, blocks=blocks, slots=slots)


def _visible(plan: _Plan, call: _Call, n_heads: int) -> torch.Tensor:
    """bool (batch, heads or 1, queries, keys) of one call: base-visible keys in the band (near) or
    beyond it and held by some union level for the head (far)."""
    pos = plan.layout.positions
    device = pos.device
    i = torch.arange(plan.first + call.queries.start, plan.first + call.queries.stop, device=device)
    j = torch.arange(call.keys.start, call.keys.stop, device=device)
    p_i, p_j = pos[:, i], pos[:, j]
    visible = visible_pairs(plan.layout, i, j, causal=plan.is_causal, sliding_window=plan.sliding_window)
    width = band_widths(p_i, plan.window, plan.far_band)
    in_band = ((p_i[:, :, None] - p_j[:, None, :]).abs() < width[:, :, None])[:, None]
    if not call.far:
        return visible & in_band
    visible = visible & ~in_band
    heads = torch.arange(n_heads, device=device)
    levels = torch.zeros((), dtype=torch.bool, device=device)
    for w, r in zip(plan.segment_lengths, plan.dilation_rates):
        same = ((p_i[:, :, None] // w) == (p_j[:, None, :] // w))[:, None]
        if r == 1:
            levels = levels | same
            continue
        offset = (heads % r)[None, :, None]
        sel_i = ((p_i % w) % r)[:, None, :] == offset  # (batch, heads, q)
        sel_j = ((p_j % w) % r)[:, None, :] == offset  # (batch, heads, k)
        levels = levels | (same & sel_i[..., None] & sel_j[:, :, None, :])
    return visible & levels


def _bias(visible: torch.Tensor, dtype) -> torch.Tensor:
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))


def _summaries(plan: _Plan, k_far):
    """The far blocks' (min, max) summaries of this call's k_far (4.2), or None without a selection."""
    if plan.selection is None:
        return None
    return far_selection.summaries(k_far, plan.blocks)


def _inputs(plan: _Plan, call: _Call, q, k, v, q_far, k_far, summaries):
    """(qs, ks, vs, read, key_rows) of one call: read (batch, heads or 1, queries, keys) the pairs it
    reads; key_rows None, or (with sparse far keys) the rows of the gathered keys in a flat
    (batch * kv_heads * kv_len) view of k, one gather per query head."""
    visible = _visible(plan, call, q.shape[1])
    qs = (q_far if call.far else q)[:, :, call.queries]
    if not call.far or summaries is None:
        ks = (k_far if call.far else k)[:, :, call.keys]
        return qs, ks, v[:, :, call.keys], visible, None
    read = _selected(plan, call, visible.expand(-1, q.shape[1], -1, -1), qs, summaries, k_far)
    return (qs, *_gather_keys(read, call, k_far, v))


def _selected(plan: _Plan, call: _Call, visible, q_far_chunk, summaries, k_far):
    """The far pairs a chunk reads (4.2): its far keys in sink blocks or in selected blocks."""
    sel, blocks = plan.selection, plan.blocks
    ids = blocks.id[:, call.keys]  # (batch, keys), -1: padding (never visible)
    n = blocks.count
    number = plan.layout.positions[:, call.keys] // sel.block_size
    sink_key = number < sel.sinks  # (batch, keys)
    # Candidates: blocks beyond the sinks holding a far key of (head, query).
    cand_keys = visible & ~sink_key[:, None, None, :]
    index = torch.where(ids >= 0, ids, n)[:, None, None, :].expand(cand_keys.shape)
    candidate = torch.zeros((*cand_keys.shape[:3], n + 1), dtype=torch.uint8, device=visible.device)
    candidate.scatter_reduce_(3, index, cand_keys.to(torch.uint8), "amax")
    candidate = candidate[..., :n].bool()
    bound = far_selection.bounds(q_far_chunk, *summaries)
    if plan.sliding_window is not None:  # the block a query's window starts in: bounded by the keys it shows
        i = torch.arange(plan.first + call.queries.start, plan.first + call.queries.stop, device=visible.device)
        edge, slots, shown = far_selection.window_edge_keys(blocks, plan.layout.real, plan.slots,
                                                            i - (plan.sliding_window - 1))
        bound = far_selection.with_window_edges(bound, q_far_chunk, edge,
                                                *far_selection.shown_summaries(k_far, slots, shown))
    chosen = far_selection.select(bound, candidate, sel.top_k)
    chosen = torch.cat([chosen, chosen.new_zeros((*chosen.shape[:3], 1))], -1)  # padding keys: column n
    per_key = torch.stack([chosen[b].index_select(-1, index[b, 0, 0]) for b in range(chosen.shape[0])])
    return visible & (per_key | sink_key[:, None, None, :])


def _gather_keys(read, call: _Call, k_far, v):
    """The keys some query of the chunk reads, per query head, gathered: (ks, vs, read over them,
    their rows in a flat view of k). One read of the widest union to the host."""
    batch, n_heads, _, n_keys = read.shape
    kv_heads, kv_len = k_far.shape[1], k_far.shape[2]
    used = read.any(2)  # (batch, heads, keys)
    width = max(1, int(used.sum(-1).max()))
    order = torch.sort((~used).to(torch.uint8), dim=-1, stable=True).indices[..., :width]  # used keys first
    taken = used.gather(-1, order)  # a slot past a head's union reads nothing
    heads = torch.arange(n_heads, device=read.device) // (n_heads // kv_heads)
    rows = ((torch.arange(batch, device=read.device)[:, None, None] * kv_heads + heads[None, :, None]) * kv_len
            + call.keys.start + order)  # (batch, heads, width)
    flat = rows.reshape(-1)
    dim = k_far.shape[-1]
    ks = k_far.reshape(-1, dim).index_select(0, flat).view(batch, n_heads, width, dim)
    vs = v.reshape(-1, v.shape[-1]).index_select(0, flat).view(batch, n_heads, width, v.shape[-1])
    sub = read.gather(-1, order[:, :, None, :].expand(-1, -1, read.shape[2], -1)) & taken[:, :, None, :]
    return ks, vs, sub, rows


def _forward(q, k, v, q_far, k_far, plan: _Plan, scale):
    acc_dtype = merge_dtype(q.dtype)
    out = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=acc_dtype, device=q.device)
    found = None if plan.nonempty is not None else []  # recorded on the plan only once complete
    summaries = _summaries(plan, k_far)
    for index, call in enumerate(plan.calls):
        if found is None and not plan.nonempty[index]:
            continue
        # The mask depends on the head count: part of the plan's key.
        qs, ks, vs, read, _ = _inputs(plan, call, q, k, v, q_far, k_far, summaries)
        if found is not None:
            found.append(bool(read.any()))
            if not found[-1]:
                continue
        pair_count.add(read, q.shape[1])
        o, part_lse = attention_forward(qs, ks, vs, is_causal=False, scale=scale, attn_bias=_bias(read, q.dtype))
        part_lse = part_lse.masked_fill(~read.any(-1).expand(part_lse.shape), float("-inf"))  # no key: -inf
        merge_into(out[:, :, call.queries], lse[:, :, call.queries], o, part_lse.to(acc_dtype))
    if found is not None:
        plan.nonempty = found
    pair_count.add_call()
    return out.to(q.dtype), lse


class _LocalBand(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, q_far, k_far, plan, scale):
        out, lse = _forward(q, k, v, q_far, k_far, plan, scale)
        ctx.save_for_backward(q, k, v, q_far, k_far, out, lse)
        ctx.plan, ctx.scale, ctx.shared = plan, scale, q_far is q
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, q_far, k_far, out, lse = ctx.saved_tensors
        plan, scale = ctx.plan, ctx.scale
        acc = merge_dtype(q.dtype)
        grads = {name: torch.zeros(t.shape, dtype=acc, device=t.device)
                 for name, t in (("q", q), ("k", k), ("v", v), ("q_far", q_far), ("k_far", k_far))}
        lse_b = lse.masked_fill(lse == float("-inf"), float("inf"))  # rows with no key: probability 0
        dout = dout.to(q.dtype)
        summaries = _summaries(plan, k_far)  # the forward's selection, recomputed from the same inputs
        for call, nonempty in zip(plan.calls, plan.nonempty):  # the forward found which are empty
            if not nonempty:
                continue
            qs, ks, vs, read, key_rows = _inputs(plan, call, q, k, v, q_far, k_far, summaries)
            rows = call.queries
            g_q, g_k, g_v = attention_backward(
                dout[:, :, rows].contiguous(), qs, ks, vs, out[:, :, rows].contiguous(),
                lse_b[:, :, rows].contiguous(),
                is_causal=False, scale=scale, attn_bias=_bias(read, q.dtype))
            grads["q_far" if call.far else "q"][:, :, rows] += g_q
            if key_rows is not None:  # gathered keys: add each back to its row
                flat = key_rows.reshape(-1)
                grads["k_far"].view(-1, k.shape[-1]).index_add_(0, flat, g_k.reshape(-1, k.shape[-1]).to(acc))
                grads["v"].view(-1, v.shape[-1]).index_add_(0, flat, g_v.reshape(-1, v.shape[-1]).to(acc))
                continue
            grads["k_far" if call.far else "k"][:, :, call.keys] += backend.kv_head_grads(g_k, k.shape[1])
            grads["v"][:, :, call.keys] += backend.kv_head_grads(g_v, k.shape[1])
        dq, dk, dv = grads["q"].to(q.dtype), grads["k"].to(k.dtype), grads["v"].to(v.dtype)
        if ctx.shared:  # one projection: its far use adds to the same gradients
            return (dq + grads["q_far"].to(q.dtype), dk + grads["k_far"].to(k.dtype), dv, None, None, None, None)
        return dq, dk, dv, grads["q_far"].to(q.dtype), grads["k_far"].to(k.dtype), None, None


# --- plain layouts: no masks ---------------------------------------------------------------------
# One document per row, no padding, positions 0..n-1, causal, no sliding window, every segment
# whole: then every key set above is a run of "offset-causal" blocks (key y visible from query x
# when y <= x + d), which fused calls compute without a mask. Used for prefill without autograd
# (inference: evaluation, generation); training and every other layout take the masked calls.


def plain_forward_applies(layout: TokenLayout, q, k, segment_lengths, dilation_rates, is_causal,
                          sliding_window) -> bool:
    """plain_forward's rows (it serves them without autograd): plain, causal, and each level's segments tile the row, or
    one segment holds it (a level at least as long as the row whose rate divides it: the default
    conversion's single level of dilation 1 covering the target, which a prompt shorter than the
    target never filled, took the masked calls); and each level's rate divides the segments (within
    the row) of the level before it, whose pieces plain_forward cuts it into in whole classes (the
    union's nesting allows [6, 24] x [1, 4]: cut so, it read the wrong keys, or divided by zero)."""
    n = k.shape[2]
    within = [min(w, n) for w in segment_lengths]
    return (layout.plain and is_causal and sliding_window is None and q.shape[2] == n
            and all(n % w == 0 or (w >= n and n % r == 0) for w, r in zip(segment_lengths, dilation_rates))
            and all(prev % r == 0 for prev, r in zip(within, dilation_rates[1:])))


def _offset_causal(q, k, v, d: int, scale: float):
    """(out, lse) of queries x over keys y <= x + d (float32 lse; -inf and 0 for rows with no key)."""
    n_q, n_k = q.shape[-2], k.shape[-2]
    acc = merge_dtype(q.dtype)
    if d >= n_k - 1:  # every key
        o, lse = attention_forward(q, k, v, is_causal=False, scale=scale)
        return o.to(acc), lse.to(acc)
    out = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
    if d >= 0:
        o, part = attention_forward(q, k[..., :d + 1, :], v[..., :d + 1, :], is_causal=False, scale=scale)
        out.copy_(o), lse.copy_(part)
        if n_q > 1:  # keys d+1.. : query x sees key d+1+y' for y' <= x-1 (top-left causal from query 1)
            o, part = attention_forward(q[..., 1:, :], k[..., d + 1:, :], v[..., d + 1:, :], is_causal=True,
                                        scale=scale)
            merge_into(out[..., 1:, :], lse[..., 1:], o, part.to(acc))
        return out, lse
    if -d < n_q:  # queries x >= -d see keys 0 .. x + d
        o, part = attention_forward(q[..., -d:, :], k, v, is_causal=True, scale=scale)
        out[..., -d:, :] = o.to(acc)
        lse[..., -d:] = part.to(acc)
    return out, lse


def near_plain(q, k, v, out, lse, window: int, start: int, scale: float) -> None:
    """Merge into out/lse (float32 accumulators) the band of the queries from `start` on, for plain
    layouts: every key j with i - window < j <= i. Query blocks of `window` tokens: the diagonal
    block is causal, the block's band before it, with queries and keys reversed, offset-causal.
    On CUDA one call of flash's sliding window instead (backend.band_forward)."""
    n = q.shape[2]
    lo = max(0, start - window + 1)
    band = backend.band_forward(q[:, :, start:], k[:, :, lo:], v[:, :, lo:], window=window, scale=scale)
    if band is not None:
        merge_into(out[:, :, start:], lse[:, :, start:], band[0], band[1].to(lse.dtype))
        return
    block = min(window, n)
    for s in range(start, n, block):
        e = min(n, s + block)
        o, part = attention_forward(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], is_causal=True, scale=scale)
        merge_into(out[:, :, s:e], lse[:, :, s:e], o, part)
        lo = max(0, s - window + 1)
        if lo < s:  # key j in [lo, s) visible from query i in [s, e) when j > i - window
            qr, kr, vr = (t.flip(2) for t in (q[:, :, s:e], k[:, :, lo:s], v[:, :, lo:s]))
            # reversed: query x~ = e-1-i, key y~ = s-1-j; j > i - window  <=>  y~ <= x~ + (window - 1 - (e - s))
            o, part = _offset_causal(qr, kr, vr, window - 1 - (e - s), scale)
            merge_into(out[:, :, s:e], lse[:, :, s:e], o.flip(2), part.flip(2))


def band_rows(q, k, v, s: int, e: int, band: int, scale: float):
    """(out, lse) of queries s .. e - 1 over their band (keys j with i - band < j <= i), canonical:
    out (batch, rows, heads, d) and lse (batch, heads, rows), each with the strides of a contiguous
    tensor of its shape. Flash's sliding window on CUDA (its out lies as its q does, here (batch,
    rows, heads, d) where q is transformers' layout: one copy where it is not), near_plain's blocks
    elsewhere (in float32 or float64)."""
    lo = max(0, s - band + 1)
    part = backend.band_forward(q[:, :, s:e], k[:, :, lo:e], v[:, :, lo:e], window=band, scale=scale)
    if part is not None:
        return canonical(part[0].transpose(1, 2)), canonical(part[1])
    acc = merge_dtype(q.dtype)
    out = torch.zeros(*q.shape[:2], e - lo, v.shape[-1], dtype=acc, device=q.device)
    lse = torch.full(out.shape[:3], float("-inf"), dtype=acc, device=q.device)
    near_plain(q[:, :, lo:e], k[:, :, lo:e], v[:, :, lo:e], out, lse, band, s - lo, scale)
    return canonical(out[:, :, s - lo:].transpose(1, 2)), canonical(lse[:, :, s - lo:])


def merge_band(band_out, band_lse, far_out, far_lse, dtype, with_lse: bool = False):
    """Rows of the output, (batch, rows, heads, d) in `dtype`: the band's (band_rows': band_out
    (batch, rows, heads, d), band_lse (batch, heads, rows)), merged with the far keys' (far_out,
    far_lse: (batch, heads, rows, d) / (batch, heads, rows); both None where no far key is read) by
    merge_partial; with_lse: (rows, their merged log-sum-exp (batch, heads, rows) in float32 or
    float64), which a backward takes. sparse_far_flex.prefill's merge: compiled there on CUDA
    (alone, or inside its merge of the entries), one pass over the rows."""
    acc = merge_dtype(dtype)
    out, lse = band_out.transpose(1, 2).to(acc), band_lse.to(acc)
    if far_out is not None:
        out, lse = merge_partial(out, lse, far_out, far_lse.to(acc))
    rows = out.to(dtype).transpose(1, 2).contiguous()
    return (rows, lse) if with_lse else rows


def _every_far(q, q_far, k_far, v, band, window: int, scale: float):
    """plain_forward where a level of dilation 1 holds the whole row (the default conversion reading
    every far key; union's rates divide the next, so the levels before it have rate 1 too: every
    earlier key is read), on a GPU: `band` (out, lse) of every query from flash's sliding window, and
    every key beyond it in one more call (query i >= window reads the far keys j <= i - window: causal
    between the last n - window queries and the first n - window keys, as many of each, so flash's
    alignment is the contract's), merged by merge_partial and written once into an output in q's
    dtype and transformers' layout, returned as its (batch, heads, n, d) view. (Into float32
    accumulators of the whole row, then cast, it moved about twice the bytes.)"""
    n = q.shape[2]
    acc = merge_dtype(q.dtype)
    out = torch.empty(q.shape[0], n, q.shape[1], v.shape[-1], dtype=q.dtype, device=q.device)
    band_out, band_lse = band
    out[:, :window] = band_out[:, :, :window].transpose(1, 2)
    far_out, far_lse = attention_forward(q_far[:, :, window:], k_far[:, :, :n - window], v[:, :, :n - window],
                                         is_causal=True, scale=scale)
    merged = merge_partial(band_out[:, :, window:].to(acc), band_lse[:, :, window:].to(acc), far_out,
                           far_lse.to(acc))[0]
    out[:, window:] = merged.transpose(1, 2)  # (cast to q's dtype in the copy)
    return out.transpose(1, 2)


def plain_forward(q, k, v, q_far, k_far, segment_lengths, dilation_rates, window: int, scale: float):
    """The same result as the masked calls, for plain layouts (plain_forward_applies). (On a GPU,
    every far key read: a (batch, heads, n, d) view of transformers' layout, _every_far.)"""
    batch, n_heads, n, head_dim = q.shape
    if n > window and any(r == 1 and w >= n for w, r in zip(segment_lengths, dilation_rates)):
        band = backend.band_forward(q, k, v, window=window, scale=scale)
        if band is not None:
            return _every_far(q, q_far, k_far, v, band, window, scale)
    group = n_heads // k.shape[1]
    acc = merge_dtype(q.dtype)
    out = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)
    near_plain(q, k, v, out, lse, window, 0, scale)
    # Far: each union level's keys beyond the band, class by class (heads h = c mod r read class c).
    prev_w = None
    for w, r in zip(segment_lengths, dilation_rates):
        w = min(w, n)  # a segment longer than the row holds it whole (plain_forward_applies); nested levels
        # that both hold it: the later one adds no key (each of its classes lies in one of the earlier's)
        for c in range(r):
            if c >= n_heads:  # no head reads this class
                continue
            heads = torch.arange(c, n_heads, r, device=q.device)
            kv_heads = heads // group
            slots = w // r

            def classed(t, idx=None):  # (batch, heads, n, d) -> (batch * n / w, heads, w / r, d), class c
                t = t if idx is None else t.index_select(1, idx)
                return t.unflatten(2, (n // w, slots, r))[:, :, :, :, c].transpose(1, 2).flatten(0, 1)

            qc = classed(q_far[:, c::r])
            kc, vc = classed(k_far, kv_heads), classed(v, kv_heads)
            out_c = out[:, c::r].unflatten(2, (n // w, slots, r))[:, :, :, :, c].transpose(1, 2)  # views
            lse_c = lse[:, c::r].unflatten(2, (n // w, slots, r))[:, :, :, :, c].transpose(1, 2)
            sub = slots if prev_w is None else prev_w // r
            for s in range(0 if prev_w is None else 1, slots // sub):
                # keys of sub-segments 0..s-1 (a level's own segment when prev_w is None: itself)
                for s_key in range(0, s) if prev_w is not None else [0]:
                    # slot distance t_a - t_b of class-c tokens is (position distance - gap) / r, so a key
                    # is beyond the band (distance >= window) when t_b <= t_a + floor((gap - window) / r)
                    gap = (s - s_key) * prev_w if prev_w is not None else 0
                    d = (gap - window) // r
                    q_part = qc[:, :, s * sub:(s + 1) * sub]
                    k_slice = slice(s_key * sub, (s_key + 1) * sub)
                    o, part = _offset_causal(q_part, kc[:, :, k_slice], vc[:, :, k_slice], d, scale)
                    o, part = o.unflatten(0, (batch, n // w)), part.unflatten(0, (batch, n // w))
                    merge_into(out_c[:, :, :, s * sub:(s + 1) * sub], lse_c[:, :, :, s * sub:(s + 1) * sub], o, part)
        prev_w = w
    return out.to(q.dtype)
