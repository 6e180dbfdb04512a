"""Sparse far keys (docs/contract.md 4.2) in a compiled decode step on a static cache
(transformers' StaticCache + torch.compile: every shape and Python value comes from the cache's
size, none from tensor data, so one graph serves every step and CUDA graphs can capture it).

Two forms:
- `kept_step` reads what the eager decode step reads (ops/sparse_far_decode.py): the band, the
  sink blocks and the chosen blocks, gathered by rank, against block summaries kept between steps
  (`KeptSummaries`: min/max of each block's far keys over the whole cache, one row of them per
  block a static cache can hold, kept on the cache's key tensor). A step makes its own token's
  block summary again (B keys turned), so it costs O(W + (k + s + TIE_SLOTS) B) keys and O(N / B)
  bounds where a dense step reads all N keys.
- `every_slot_step` scores every slot and masks (O(N) a step): where no summaries are kept on
  the cache (they are made by an eager call on it: transformers' generate() runs the prefill
  eagerly) or a layer reads every far key (far_band without far_top_k).

kept_step also serves eager steps on a GPU: replayed as a CUDA graph over the buffer of a cache
that writes in place (ops/sparse_far_reserved.py: hf_dilated.ReservedCache, StaticCache), and
compiled, its summaries made in the step, for a cache that concatenates
(ops/sparse_far_concatenated.py: transformers' DynamicCache).

The summaries' life: an eager call on a static cache (`keep`) builds them from the cache, or, when
the cache is the one they were built on plus this call's tokens, folds in those tokens; a compiled
call of several queries (a compiled prefill) rebuilds them in its graph; a compiled step of one
query makes its token's block again from the block's keys, exact whatever the block held (keys
cropped since). They live on the cache's key tensor (an attribute), so two caches used in turn keep
their own, a compiled graph reads them through the key tensor it is given, and they go with the
cache; allocated once and written in place (the graph takes them as static inputs, as StaticCache's
own key and value tensors).

Ties. A step reads a fixed number of blocks: the sinks, the top_k by bound, and up to TIE_SLOTS
more tied at the k-th bound (the contract reads every tied block). More ties than that (distinct
blocks whose float32 bounds are bit for bit equal: in practice never, as their far keys sit at
different grouped positions; or a far query of zeros, whose bounds are all 0: the query of a token
whose embedding is zero, such as transformers' pad row at initialisation) are cut in block order,
counted in `KeptSummaries.cut`, and reported by a warning when an eager call summarises the cache
again (after compiled steps the next eager call does; one read of the count there, beside a pass
over the whole cache). Steps that replay one graph (ops/sparse_far_reserved, ops/sparse_far_concatenated)
also read it every CUT_CHECK_EVERY steps and when their next generation starts.
"""
from __future__ import annotations

import warnings

import torch

from .far_selection import FarSelection, bound_dtype, bound_operands, bounds, select
from .merge import merge_dtype
from .rope import rotate_by, rotate_with
from .token_layout import mask_ranks

TIE_SLOTS = 8  # blocks tied at the k-th bound that a kept step reads beyond its top_k
BUILD_SLOTS = 1 << 14  # slots turned at a time when building (bounds the temporaries)


# The attribute of a cache's key tensor that holds its KeptSummaries: they belong to the cache, not to
# the layer, so that two caches used in turn each keep their own (a compiled graph reads them as
# inputs through the key tensor it is given), and they go when the cache goes.
ATTRIBUTE = "_hf_dilated_far_summaries"


class KeptSummaries:
    """The block summaries of one static cache layer's keys (module docstring), kept between steps."""

    def __init__(self, k: torch.Tensor, size: int, settings: tuple):
        batch, kv_heads, n, dim = k.shape
        self.settings = settings  # (block size, rotation's window and group): what they summarise
        # (batch, kv_heads, blocks + 1, head_dim) in bound_dtype; the last row: where padding and unwritten slots go
        self.mn = torch.empty((batch, kv_heads, n // size + 2, dim), dtype=bound_dtype(k.dtype), device=k.device)
        self.mx = torch.empty_like(self.mn)
        self.cut = torch.zeros((), dtype=torch.int32, device=k.device)  # ties cut since the last eager call
        self.seen = self.version = None  # the cache after the last eager call (keep)
        mark = getattr(torch._dynamo, "mark_static_address", None)
        if mark is not None:  # a compiled step mutates them: static inputs, like StaticCache's tensors
            for t in (self.mn, self.mx, self.cut):
                mark(t)

    def fits(self, k: torch.Tensor, size: int, settings: tuple) -> bool:
        batch, kv_heads, n, dim = k.shape
        return (self.settings == settings and self.mn.shape == (batch, kv_heads, n // size + 2, dim)
                and self.mn.device == k.device and self.mn.dtype == bound_dtype(k.dtype))


def settings_of(size: int, rotation) -> tuple:
    return (size,) if rotation is None else (size, rotation[0], rotation[1])


def kept_for(k: torch.Tensor, size: int, rotation) -> KeptSummaries | None:
    """The summaries kept on the cache tensor k for these settings, or None."""
    kept = getattr(k, ATTRIBUTE, None)
    return kept if kept is not None and kept.fits(k, size, settings_of(size, rotation)) else None


def far_turned(keys: torch.Tensor, ranks: torch.Tensor, rotation, shift=None) -> torch.Tensor:
    """keys (batch, kv_heads, n, d) at ranks (batch, n) moved to their grouped far positions; shift
    (batch,) how much further than its ranks each row was rotated by the model (None: 0). Scores
    are the same either way, the summaries (and so the blocks chosen) are not (docs/contract.md 4.1)."""
    if rotation is None:
        return keys
    group, inv_freq = rotation[1], rotation[2]
    delta = ranks // group - ranks
    return rotate_by(keys, delta if shift is None else delta - shift[:, None], inv_freq)


def build(kept: KeptSummaries, k: torch.Tensor, real: torch.Tensor, seen, size: int, rotation, shift=None) -> None:
    """Every block's summary from the cache: the written real slots (slots < seen) by their mask
    ranks; rows of blocks nobody opened yet +inf / -inf. In place (eager, or in a compiled graph)."""
    batch, kv_heads, n, dim = k.shape
    n_blocks = n // size + 1
    rank = mask_ranks(real)
    written = real & (torch.arange(n, device=k.device) < seen)
    block = torch.where(written, rank.clamp(min=0) // size, n_blocks)  # the others: the dump row
    kept.mn.fill_(float("inf"))
    kept.mx.fill_(float("-inf"))
    for lo in range(0, n, BUILD_SLOTS):
        hi = min(n, lo + BUILD_SLOTS)
        far = far_turned(k[:, :, lo:hi], rank[:, lo:hi].clamp(min=0), rotation, shift).to(kept.mn.dtype)
        index = block[:, None, lo:hi, None].expand(batch, kv_heads, hi - lo, dim)
        kept.mn.scatter_reduce_(2, index, far, "amin")
        kept.mx.scatter_reduce_(2, index, far, "amax")


def fold(kept: KeptSummaries, k: torch.Tensor, real: torch.Tensor, rank: torch.Tensor, slot: torch.Tensor,
         size: int, rotation, shift=None) -> None:
    """The summary of the block holding the key at `slot` (a 0-d tensor), made again from that
    block's keys up to it (B keys), per row: exact whatever the row held before (an earlier fill of
    the cache, keys cropped since); a padding slot changes nothing (it goes to the dump row)."""
    batch, kv_heads, n, dim = k.shape
    n_blocks = kept.mn.shape[2] - 1
    at = slot.reshape(1)
    r = rank.index_select(1, at)  # (batch, 1)
    block = torch.where(real.index_select(1, at), r.clamp(min=0) // size, n_blocks)
    ranks = (r.clamp(min=0) // size) * size + torch.arange(size, device=k.device)  # (batch, B): the block's
    ok = ranks <= r
    slots = torch.where(ok, torch.searchsorted(rank + 1, ranks + 1).clamp(max=n - 1), at)
    keys = far_turned(k.gather(2, slots[:, None, :, None].expand(batch, kv_heads, size, dim)), ranks, rotation, shift)
    keys = keys.to(kept.mn.dtype)
    index = block[:, None, :, None].expand(batch, kv_heads, 1, dim)
    kept.mn.scatter_(2, index, keys.masked_fill(~ok[:, None, :, None], float("inf")).amin(2, keepdim=True))
    kept.mx.scatter_(2, index, keys.masked_fill(~ok[:, None, :, None], float("-inf")).amax(2, keepdim=True))


def keep(k: torch.Tensor, real: torch.Tensor, seen: int, q_len: int, size: int, rotation, few: int,
         shift=None) -> None:
    """After an eager call on a static cache whose key tensor is k (the call's q_len tokens already
    written, `seen` slots in all): fold in its tokens where the cache is the one of the last eager
    call, written once since (its version) and grown by exactly them, and there are at most `few`;
    else summarise it again (made on k at the first call). shift: far_turned's."""
    kept = kept_for(k, size, rotation)
    if kept is None:
        kept = KeptSummaries(k, size, settings_of(size, rotation))
        setattr(k, ATTRIBUTE, kept)
    try:
        version = k._version
    except RuntimeError:  # an inference-mode tensor keeps no version
        version = None
    grown = (version is not None and kept.version is not None and kept.seen == seen - q_len
             and version == kept.version + 1)
    if grown and q_len <= few:  # (no compiled step since the last eager call: nothing cut)
        rank = mask_ranks(real)
        for t in range(q_len):
            fold(kept, k, real, rank, torch.full((), seen - q_len + t, device=k.device), size, rotation, shift)
    else:
        warn_ties_cut(kept.cut, stacklevel=4)  # (one read, at a rebuild: after compiled steps every eager call rebuilds)
        build(kept, k, real, seen, size, rotation, shift)
    kept.seen, kept.version = seen, version


CUT_CHECK_EVERY = 256  # steps of one graph between reads of the ties cut (one read per layer)


def warn_ties_cut(cut: torch.Tensor, stacklevel: int) -> None:
    """Warn of the decode steps whose ties were cut (module docstring: Ties), counted in `cut` (one
    read back), and count from zero again."""
    count = int(cut)
    if count:
        warnings.warn(f"hf_dilated: decode steps met more than {TIE_SLOTS} blocks tied at the far_top_k-th bound "
                      f"{count} times and read the first {TIE_SLOTS} of them (docs/contract.md 4.2 reads them all)",
                      RuntimeWarning, stacklevel=stacklevel)
        cut.zero_()


def kept_step(q, k, v, q_far, *, local_window: int, far_band: int | None, selection: FarSelection, scale: float,
              real, seen, rotation, kept: KeptSummaries, refresh: bool = True, turns=None, q_bound=None, shift=None):
    """A compiled step's output (shaped like q) from kept summaries (module docstring). q (batch,
    heads, q_len, d) the queries at slots seen - q_len .. seen - 1, q_far the same at their far
    positions; k, v (batch, kv_heads, N, d) the cache's slots; real (batch, N) the written slots
    holding tokens; seen a 0-d tensor. q_len > 1 (a compiled prefill) rebuilds the summaries first;
    refresh=False: the caller made them from the whole cache (concatenated_step). turns: where given,
    rope.far_turn_table's (cos, sin) by rank, of at least the blocks' ranks: the chosen far keys are
    turned by reading it, not by a float64 cos and sin per key and head. shift (batch,): how much
    further than its mask ranks the model rotated each row (far_turned's; None: 0), which the
    summaries it folds follow; q_bound: q_far moved by it too, what the bounds read (None: q_far).
    The scores read q_far and the keys turned from the ranks: the same either way."""
    batch, n_heads, q_len, dim = q.shape
    q_bound = q_far if q_bound is None else q_bound
    kv_heads, n = k.shape[1], k.shape[2]
    group = n_heads // kv_heads
    size, sinks, top_k = selection.block_size, selection.sinks, selection.top_k
    acc = merge_dtype(q.dtype)
    device = q.device
    rank = mask_ranks(real)
    count = rank + 1  # real tokens up to each slot: the first slot of count r + 1 holds rank r
    if refresh and q_len > 1:
        build(kept, k, real, seen, size, rotation, shift)
    elif refresh:
        fold(kept, k, real, rank, seen - 1, size, rotation, shift)
    n_blocks = kept.mn.shape[2] - 1
    summary, empty = bound_operands(kept.mn[:, :, :n_blocks], kept.mx[:, :, :n_blocks], group)
    number = torch.arange(n_blocks, device=device)
    sinks = min(sinks, n_blocks)
    picks = min(top_k + TIE_SLOTS, n_blocks)
    band_offsets = torch.arange(local_window, device=device)
    key_offsets = torch.arange(size, device=device)

    def gather(x, slots):  # x (batch, kv_heads, N, d) at slots (batch, kv_heads, m)
        return x.gather(2, slots[..., None].expand(-1, -1, -1, dim))

    def slot_of(ranks, ok):  # (batch, m) ranks -> the slots holding them; where not ok, the query's own
        # (a slot past the written ones may hold anything, NaN included: reserved room is not cleared)
        return torch.where(ok, torch.searchsorted(count, ranks + 1).clamp(max=n - 1), slot)

    outs = []
    for t in range(q_len):
        slot = (seen - q_len + t).reshape(1)
        p = rank.index_select(1, slot)  # (batch, 1): the query's position
        width = torch.where(p < local_window, local_window, local_window if far_band is None else far_band)
        last_far = p - width  # (batch, 1)
        # The band: the last `local_window` ranks (every query's widest band), those within its own kept.
        band_rank = p - band_offsets  # (batch, W)
        band_ok = (band_rank > last_far) & (band_rank >= 0)
        band_slot = slot_of(band_rank, band_ok)[:, None].expand(-1, kv_heads, -1)
        qt = q[:, :, t].unflatten(1, (kv_heads, group)).to(acc) * scale  # (batch, kv_heads, group, d)
        near = (qt @ gather(k, band_slot).to(acc).transpose(-1, -2)).masked_fill(~band_ok[:, None, None], float("-inf"))
        # The far blocks: the sinks, then the top_k candidates by bound and up to TIE_SLOTS tied at the k-th.
        reach = number * size <= last_far  # (batch, blocks): the block holds a far key
        chosen = [number[:sinks].expand(batch, n_heads, sinks)]
        taken = [reach[:, None, :sinks].expand(batch, n_heads, sinks)]
        if top_k:
            bound = bounds(q_bound[:, :, t:t + 1], None, None, (summary, empty))[:, :, 0]  # (batch, heads, blocks)
            bound = bound.masked_fill(~(reach & (number >= sinks))[:, None], float("-inf"))
            values, index = bound.topk(min(picks + 1, n_blocks), -1)
            if top_k < n_blocks:
                kth = values[..., top_k - 1:top_k]
                keep_it = (values > float("-inf")) & ((torch.arange(values.shape[-1], device=device) < top_k)
                                                       | (values >= kth))
                if values.shape[-1] > picks:  # one more than read: a tie there was cut
                    cut = (values[..., picks] >= kth[..., 0]) & (kth[..., 0] > float("-inf"))
                    kept.cut.add_(cut.sum().to(kept.cut.dtype))
            else:
                keep_it = values > float("-inf")
            chosen.append(index[..., :picks])
            taken.append(keep_it[..., :picks])
        blocks, ok = torch.cat(chosen, -1), torch.cat(taken, -1)  # (batch, heads, S)
        key_rank = (blocks[..., None] * size + key_offsets).flatten(2)  # (batch, heads, S * B)
        key_ok = ok.repeat_interleave(size, -1) & (key_rank <= last_far[:, :, None])
        key_slot = slot_of(key_rank.flatten(1), key_ok.flatten(1)).view(batch, kv_heads, -1)  # per kv head
        keys = gather(k, key_slot).view(batch, n_heads, -1, dim)
        if rotation is not None and turns is not None:  # (the table's values are rotate_by's)
            keys = rotate_with(keys, turns[0][key_rank], turns[1][key_rank])
        elif rotation is not None:
            keys = rotate_by(keys.flatten(0, 1)[:, None], (key_rank // rotation[1] - key_rank).flatten(0, 1),
                             rotation[2])[:, 0].view(batch, n_heads, -1, dim)
        qf = q_far[:, :, t, None].to(acc) * scale  # (batch, heads, 1, d)
        far = (qf @ keys.to(acc).transpose(-1, -2))[:, :, 0].masked_fill(~key_ok, float("-inf"))
        width_band = near.shape[-1]
        # (a padding query of a compiled prefill reads no key: its row is 0, as every_slot_step's)
        probs = torch.softmax(torch.cat([near.flatten(1, 2), far], -1), -1).nan_to_num(0.0)
        # values of slots not read are 0, not merely weighted 0 (a padding slot's may be NaN)
        band_values = gather(v, band_slot).to(acc).masked_fill(~band_ok[:, None, :, None], 0.0)
        out = (probs[..., :width_band].unflatten(1, (kv_heads, group)) @ band_values).flatten(1, 2)
        far_values = gather(v, key_slot).view(batch, n_heads, -1, dim).to(acc).masked_fill(~key_ok[..., None], 0.0)
        out = out + (probs[:, :, None, width_band:] @ far_values)[:, :, 0]
        outs.append(out)
    return torch.stack(outs, 2).to(q.dtype)


def every_slot_step(q, k, v, q_far, k_far, *, local_window: int, far_band: int | None, selection: FarSelection,
                    scale: float, real, seen):
    """The step without kept summaries: one level holding every earlier key, positions the mask
    ranks, every slot scored and masked (O(N) a step), the summaries rebuilt from k_far (the far
    projections of every slot) each step."""
    batch, n_heads, q_len, dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    group = n_heads // kv_heads
    size = selection.block_size
    acc = merge_dtype(q.dtype)
    dtype = bound_dtype(k_far.dtype)
    slots = torch.arange(kv_len, device=q.device)
    written = real & (slots < seen)  # (batch, kv_len)
    position = real.long().cumsum(-1) - 1  # mask ranks: one document per row
    n_blocks = kv_len // size + 1  # blocks of the positions a static cache can hold
    block = torch.where(written, position // size, n_blocks)  # unwritten slots: a dump block
    index = block[:, None, :, None].expand(batch, kv_heads, kv_len, dim)
    mn = torch.full((batch, kv_heads, n_blocks + 1, dim), float("inf"), dtype=dtype, device=q.device)
    mx = torch.full_like(mn, float("-inf"))
    mn = mn.scatter_reduce(2, index, k_far.to(dtype), "amin")[:, :, :n_blocks]
    mx = mx.scatter_reduce(2, index, k_far.to(dtype), "amax")[:, :, :n_blocks]
    number = torch.arange(n_blocks, device=q.device)
    outs = []
    for t in range(q_len):
        slot = seen - q_len + t
        p = position.index_select(1, slot.reshape(1)).squeeze(1)  # (batch,)
        width = torch.where(p < local_window, local_window, local_window if far_band is None else far_band)
        seen_key = written & (slots <= slot)
        near = seen_key & (position > (p - width)[:, None])  # (batch, kv_len)
        far = seen_key & ~near
        holds = torch.zeros(batch, n_blocks + 1, dtype=torch.uint8, device=q.device)
        holds = holds.scatter_reduce(1, torch.where(far, block, n_blocks), far.to(torch.uint8), "amax")[:, :n_blocks]
        holds = holds.bool()  # (batch, blocks): the block holds a far key of this query
        sink = holds & (number < selection.sinks)
        chosen = select(bounds(q_far[:, :, t:t + 1], mn, mx)[:, :, 0], (holds & ~sink)[:, None].expand(-1, n_heads, -1),
                        selection.top_k) | sink[:, None]  # (batch, heads, blocks)
        chosen = torch.cat([chosen, chosen.new_zeros(batch, n_heads, 1)], -1)
        read_far = far[:, None] & chosen.gather(2, block[:, None].expand(-1, n_heads, -1))  # (batch, heads, kv_len)
        qh, qfh = q[:, :, t].unflatten(1, (kv_heads, group)), q_far[:, :, t].unflatten(1, (kv_heads, group))
        near_scores = torch.matmul(qh, k.transpose(-1, -2)).to(acc).flatten(1, 2) * scale  # (batch, heads, kv_len)
        far_scores = torch.matmul(qfh, k_far.transpose(-1, -2)).to(acc).flatten(1, 2) * scale
        scores = torch.where(near[:, None], near_scores, far_scores).masked_fill(~(near[:, None] | read_far),
                                                                                   float("-inf"))
        probs = torch.softmax(scores, -1).nan_to_num(0.0).to(v.dtype).unflatten(1, (kv_heads, group))
        outs.append(torch.matmul(probs, v).flatten(1, 2))  # (batch, heads, dim)
    return torch.stack(outs, 2).to(q.dtype)
