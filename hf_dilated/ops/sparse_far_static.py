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

kept_step also serves eager steps on a GPU (sections at the end): replayed as a CUDA graph over
the buffer of a cache that writes in place (`reserved_step`), and compiled, its summaries made
in the step, for a cache that concatenates (`concatenated_step`, transformers' DynamicCache).

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
different grouped positions) are cut in block order, counted in `KeptSummaries.cut`, and reported
by a warning when an eager call summarises the cache again (after compiled steps the next eager
call does; one read of the count there, beside a pass over the whole cache).
"""
from __future__ import annotations

import types
import warnings

import torch

from .far_selection import FarSelection, bound_dtype, bound_operands, bounds, select
from .merge import merge_dtype
from .rope import far_queries_static, rotate_by
from .token_layout import mask_ranks

TIE_SLOTS = 8  # blocks tied at the k-th bound that a kept step reads beyond its top_k
_BUILD_SLOTS = 1 << 14  # slots turned at a time when building (bounds the temporaries)


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


def _far_turned(keys: torch.Tensor, ranks: torch.Tensor, rotation) -> torch.Tensor:
    """keys (batch, kv_heads, n, d) at ranks (batch, n) moved to their grouped far positions."""
    if rotation is None:
        return keys
    group, inv_freq = rotation[1], rotation[2]
    return rotate_by(keys, ranks // group - ranks, inv_freq)


def build(kept: KeptSummaries, k: torch.Tensor, real: torch.Tensor, seen, size: int, rotation) -> None:
    """Every block's summary from the cache: the written real slots (slots < seen) by their mask
    ranks; rows of blocks nobody opened yet +inf / -inf. In place (eager, or in a compiled graph)."""
    batch, kv_heads, n, dim = k.shape
    n_blocks = n // size + 1
    rank = mask_ranks(real)
    written = real & (torch.arange(n, device=k.device) < seen)
    block = torch.where(written, rank.clamp(min=0) // size, n_blocks)  # the others: the dump row
    kept.mn.fill_(float("inf"))
    kept.mx.fill_(float("-inf"))
    for lo in range(0, n, _BUILD_SLOTS):
        hi = min(n, lo + _BUILD_SLOTS)
        far = _far_turned(k[:, :, lo:hi], rank[:, lo:hi].clamp(min=0), rotation).to(kept.mn.dtype)
        index = block[:, None, lo:hi, None].expand(batch, kv_heads, hi - lo, dim)
        kept.mn.scatter_reduce_(2, index, far, "amin")
        kept.mx.scatter_reduce_(2, index, far, "amax")


def fold(kept: KeptSummaries, k: torch.Tensor, real: torch.Tensor, rank: torch.Tensor, slot: torch.Tensor,
         size: int, rotation) -> None:
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
    keys = _far_turned(k.gather(2, slots[:, None, :, None].expand(batch, kv_heads, size, dim)), ranks, rotation)
    keys = keys.to(kept.mn.dtype)
    index = block[:, None, :, None].expand(batch, kv_heads, 1, dim)
    kept.mn.scatter_(2, index, keys.masked_fill(~ok[:, None, :, None], float("inf")).amin(2, keepdim=True))
    kept.mx.scatter_(2, index, keys.masked_fill(~ok[:, None, :, None], float("-inf")).amax(2, keepdim=True))


def keep(k: torch.Tensor, real: torch.Tensor, seen: int, q_len: int, size: int, rotation, few: int) -> None:
    """After an eager call on a static cache whose key tensor is k (the call's q_len tokens already
    written, `seen` slots in all): fold in its tokens where the cache is the one of the last eager
    call, written once since (its version) and grown by exactly them, and there are at most `few`;
    else summarise it again (made on k at the first call)."""
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
            fold(kept, k, real, rank, torch.full((), seen - q_len + t, device=k.device), size, rotation)
    else:
        if int(kept.cut):  # (one read, at a rebuild: after compiled steps every eager call rebuilds)
            warnings.warn(f"hf_dilated: compiled decode steps met more than {TIE_SLOTS} blocks tied at the "
                          f"far_top_k-th bound {int(kept.cut)} times and read the first {TIE_SLOTS} of them "
                          "(docs/contract.md 4.2 reads them all)", RuntimeWarning, stacklevel=3)
            kept.cut.zero_()
        build(kept, k, real, seen, size, rotation)
    kept.seen, kept.version = seen, version


def kept_step(q, k, v, q_far, *, local_window: int, far_band: int | None, selection: FarSelection, scale: float,
              real, seen, rotation, kept: KeptSummaries, refresh: bool = True):
    """A compiled step's output (shaped like q) from kept summaries (module docstring). q (batch,
    heads, q_len, d) the queries at slots seen - q_len .. seen - 1, q_far the same at their far
    positions; k, v (batch, kv_heads, N, d) the cache's slots; real (batch, N) the written slots
    holding tokens; seen a 0-d tensor. q_len > 1 (a compiled prefill) rebuilds the summaries first;
    refresh=False: the caller made them from the whole cache (concatenated_step)."""
    batch, n_heads, q_len, dim = q.shape
    kv_heads, n = k.shape[1], k.shape[2]
    group = n_heads // kv_heads
    size, sinks, top_k = selection.block_size, selection.sinks, selection.top_k
    acc = merge_dtype(q.dtype)
    device = q.device
    rank = mask_ranks(real)
    count = rank + 1  # real tokens up to each slot: the first slot of count r + 1 holds rank r
    if refresh and q_len > 1:
        build(kept, k, real, seen, size, rotation)
    elif refresh:
        fold(kept, k, real, rank, seen - 1, size, rotation)
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
            bound = bounds(q_far[:, :, t:t + 1], None, None, (summary, empty))[:, :, 0]  # (batch, heads, blocks)
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
        if rotation is not None:
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


# --- an eager step on a cache that writes in place (ReservedCache, StaticCache), as one CUDA graph ----

# Where an eager step against a buffer with reserved room replays kept_step as one CUDA graph; a step
# is host-bound on a GPU (its ~100 small launches a layer cost more than the GPU's work: docs/benchmarks.md),
# and kept_step is one fixed-shape function of the buffer. Elsewhere the eager path (sparse_far_decode).
GRAPHED_ON = ("cuda",)
_POOLS = {}  # device -> (memory pool, layers captured into it): one per round of captures


class ReservedStep:
    """One layer's eager decode step against the whole buffer of an in-place cache (module section
    above): kept_step over the buffer's slots, whose only per-step inputs are the query and the
    number of written slots, copied into fixed tensors; on a GPU captured as a CUDA graph at its
    first call and replayed after (elsewhere, for tests, called). Its summaries are rebuilt (eagerly,
    in place) whenever the cache is not the last step's plus one token (reserved_step). Held by its
    key buffer; nothing in it refers back to itself, so it goes (graph and pool included) with the
    buffer."""

    def __init__(self, key, owner: int, q, k_buffer, first, settings: dict, capture: bool):
        self.key, self.owner, self.seen, self.version = key, owner, None, None
        device = q.device
        size = settings["selection"].block_size
        rotation = settings["rotation"]
        if rotation is not None:  # the frequencies on the device once: a copy from the host cannot be captured
            rotation = (rotation[0], rotation[1], rotation[2].to(device))
        settings = dict(settings, rotation=rotation)
        kept = self.kept = KeptSummaries(k_buffer, size, settings_of(size, rotation))
        self.q = torch.empty_like(q)
        self.written = torch.zeros((), dtype=torch.long, device=device)
        slots = torch.arange(k_buffer.shape[2], device=device)
        first = torch.tensor(first, device=device)[:, None]  # (once, when the step is made)
        buffers = self.buffers = [None, None]  # the key and value buffers, during a call only

        def real(written):  # each row's real tokens: one run from its first to the written end (regular rows)
            return (slots >= first) & (slots < written)

        def step(q, written):
            q_far = q if rotation is None else far_queries_static(q, real(written), written, *rotation)
            return kept_step(q, buffers[0], buffers[1], q_far, kept=kept, real=real(written), seen=written,
                             **settings)

        self.real, self.step, self.rotation = real, step, rotation
        self.capture, self.graph, self.out = capture, None, None

    def _capture(self):
        """Capture step() on the current inputs, on its device: warmed up on a side stream first
        (torch.cuda.graphs' rule; its fold of the step's token is the one the replay redoes, the same
        values), then captured on that stream into the memory pool the other layers' steps of this
        round share (each replay's output is copied out before the next layer's replay)."""
        device = self.q.device
        pool, owners = _POOLS.get(device, (None, set()))
        if pool is None or self.owner in owners:  # a layer captures again: a new round
            pool, owners = torch.cuda.graph_pool_handle(), set()
        with torch.cuda.device(device):
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                self.step(self.q, self.written)
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=side):
                self.out = self.step(self.q, self.written)
        owners.add(self.owner)
        _POOLS[device] = (pool, owners)
        self.graph = graph

    def __call__(self, q, k_buffer, v_buffer, seen: int):
        """The step's output; k_buffer, v_buffer the buffers at the addresses of its key (a graph reads
        them there: they are held during the call only, so that a finished cache is freed)."""
        self.q.copy_(q)
        self.written.fill_(seen)
        self.buffers[:] = k_buffer, v_buffer
        try:
            if not self.capture:
                return self.step(self.q, self.written)
            if self.graph is None:
                self._capture()
            with torch.cuda.device(self.q.device):
                self.graph.replay()
            return self.out.clone()
        finally:
            self.buffers[:] = None, None


_STEP_ATTRIBUTE = "_hf_dilated_reserved_step"  # where a buffer holds its ReservedStep (it goes with the buffer)
_GRAPH_FAILED: str | None = None  # why capturing failed in this process (steps then take the eager path)


def reserved_step(q, k, v, *, local_window: int, far_band: int | None, selection: FarSelection, scale: float,
                  first: list[int], shift: list[int], rotation, layer: int):
    """An eager one-query step on a cache whose keys and values are the filled start of larger
    buffers (hf_dilated.ReservedCache; StaticCache's slots): the ReservedStep kept on the key
    buffer (so two caches used in turn keep theirs; `layer` an id of the calling layer, which the
    graphs' memory pools follow). None (nothing done) where it does not apply: other caches
    (DynamicCache concatenates into a new tensor), positions other than the mask ranks (rows
    regular: ops/token_layout.regular_rows), and once a capture failed here (warned once)."""
    global _GRAPH_FAILED
    k_buffer, v_buffer = k._base, v._base
    if (_GRAPH_FAILED is not None or k_buffer is None or v_buffer is None or k_buffer.dim() != 4
            or v_buffer.shape != k_buffer.shape or k_buffer.shape[:2] + k_buffer.shape[3:] != k.shape[:2] + k.shape[3:]
            or k.data_ptr() != k_buffer.data_ptr() or v.data_ptr() != v_buffer.data_ptr()
            or k.stride() != k_buffer.stride() or v.stride() != v_buffer.stride()
            or any(s != -f for f, s in zip(first, shift)) or q.requires_grad or k.requires_grad):
        return None
    seen = k.shape[2]
    settings = dict(local_window=local_window, far_band=far_band, selection=selection, scale=scale, rotation=rotation)
    key = (k_buffer.data_ptr(), v_buffer.data_ptr(), tuple(k_buffer.shape), k_buffer.dtype, tuple(q.shape), q.dtype,
           local_window, far_band, selection, scale, tuple(first),
           None if rotation is None else (rotation[0], rotation[1], rotation[2].data_ptr()))
    runner = getattr(k_buffer, _STEP_ATTRIBUTE, None)
    if runner is None or runner.key != key:
        runner = ReservedStep(key, layer, q, k_buffer, first, settings, capture=q.device.type == "cuda")
        setattr(k_buffer, _STEP_ATTRIBUTE, runner)
    version = k_buffer._version  # (inference-mode views have no _base: not here)
    if runner.seen != seen - 1 or runner.version != version - 1:
        # not the last step's cache plus this token (a first step, a crop, a rewrite): summarise it again
        if int(runner.kept.cut):  # (one read, at a rebuild)
            warnings.warn(f"hf_dilated: decode steps met more than {TIE_SLOTS} blocks tied at the far_top_k-th bound "
                          f"and read the first {TIE_SLOTS} of them (docs/contract.md 4.2 reads them all)",
                          RuntimeWarning, stacklevel=3)
            runner.kept.cut.zero_()
        build(runner.kept, k_buffer, runner.real(seen), seen, selection.block_size, runner.rotation)
    try:
        out = runner(q, k_buffer, v_buffer, seen)
    except torch.OutOfMemoryError:
        raise
    except Exception as exc:  # capturing failed: the eager step from now on
        if runner.graph is not None or not runner.capture:
            raise
        _GRAPH_FAILED = f"{type(exc).__name__}: {exc}"
        delattr(k_buffer, _STEP_ATTRIBUTE)
        warnings.warn(f"hf_dilated: capturing a decode step as a CUDA graph failed ({_GRAPH_FAILED[:500]}); decode "
                      "steps take the eager path from now on (the same results, more launches)", RuntimeWarning,
                      stacklevel=3)
        return None
    runner.seen, runner.version = seen, version
    return out


# --- an eager step on a cache that concatenates (DynamicCache), compiled -----------------------------

# Where an eager one-query step against a cache that concatenates into a new tensor every step
# (transformers' DynamicCache) runs compiled (torch.compile, the cache's length dynamic), with the
# summaries made again from the whole cache in the same call. No graph can hold such a cache (its
# address changes every step), and summaries kept between its steps cannot be trusted without
# reading it (a crop, a beam search's reorder, a rewrite): the eager path (sparse_far_decode) checks
# them by checksums, one pass over the keys and a read back per layer, then ~100 launches. Made in
# the step, fused, they cost the same pass and nothing else: the rotation to grouped positions and
# the blocks' minima and maxima in one kernel, exact whatever happened to the cache, no read back.
# Elsewhere (the CPU: no launches to save, and summaries kept between steps are cheaper there) the
# eager path.
COMPILED_ON = ("cuda",)
BACKEND = "inductor"  # torch.compile's backend for it (tests on the CPU may take a lighter one)
CUT_CHECK_EVERY = 256  # steps between reads of the ties cut (module docstring: Ties), one read per layer
_COMPILED = {}  # settings -> the compiled step
_COMPILE_FAILED: str | None = None  # why compiling failed in this process (steps then take the eager path)
_RECOMPILE_LIMIT = getattr(torch._dynamo.exc, "FailOnRecompileLimitHit", ())  # (what fullgraph raises there)


class MadeSummaries:
    """Summaries made from the whole cache in the call (summarise_rows), and the layer's count of
    ties cut, kept between calls: what kept_step reads as `kept` with refresh=False."""

    def __init__(self, mn, mx, cut):
        self.mn, self.mx, self.cut = mn, mx, cut


def summarise_rows(k: torch.Tensor, first: torch.Tensor, size: int, rotation, dtype, spare: int = 0) -> tuple:
    """(mn, mx) as KeptSummaries holds them, (batch, kv_heads, N // size + 2 + spare, d), of a cache
    whose row b holds its real tokens at slots first[b] .. N - 1 (regular rows; positions their
    ranks): block c of row b is slots first[b] + c B ... One gather, rotation and reduction over the
    keys, which a compiled call fuses into one pass. `spare` empty blocks more past the end (never
    reached: no key) give a compiled step's Python decisions on the block count (top k, ties) one
    answer at every length, so that one graph serves them all."""
    batch, kv_heads, n, dim = k.shape
    n_blocks = n // size + 1 + spare

    def blocks(c0, c1):  # (mn, mx) of blocks c0 .. c1 - 1
        rank = torch.arange(c0 * size, c1 * size, device=k.device)
        slot = first[:, None] + rank  # (batch, (c1 - c0) B)
        ok = (slot < n)[:, None, :, None]
        keys = k.gather(2, slot.clamp(max=n - 1)[:, None, :, None].expand(batch, kv_heads, -1, dim))
        keys = _far_turned(keys, rank.expand(batch, -1), rotation).to(dtype)
        return (keys.masked_fill(~ok, float("inf")).unflatten(2, (c1 - c0, size)).amin(3),
                keys.masked_fill(~ok, float("-inf")).unflatten(2, (c1 - c0, size)).amax(3))

    if torch.compiler.is_compiling():  # one fused pass: no temporaries
        parts = [blocks(0, n_blocks)]
    else:  # uncompiled (under a dispatch mode): in chunks, which bound the temporaries
        step = max(1, _BUILD_SLOTS // size)
        parts = [blocks(c, min(n_blocks, c + step)) for c in range(0, n_blocks, step)]
    dump = torch.full((batch, kv_heads, 1, dim), float("inf"), dtype=dtype, device=k.device)  # kept_step's last row
    return (torch.cat([p[0] for p in parts] + [dump], 2), torch.cat([p[1] for p in parts] + [-dump], 2))


def _concatenated(q, k, v, first, cut, inv_freq, *, local_window: int, far_band: int | None,
                  selection: FarSelection, scale: float, far: tuple | None):
    """The step that concatenated_step compiles: summaries from the whole cache, then kept_step."""
    n = k.shape[2]
    rotation = None if far is None else (*far, inv_freq)
    real = torch.arange(n, device=k.device) >= first[:, None]
    seen = torch.full((), n, dtype=torch.long, device=k.device)
    # spare blocks: at least top_k + TIE_SLOTS + 1 blocks, and two in the reduction (no 0/1 specialisation)
    mn, mx = summarise_rows(k, first, selection.block_size, rotation, bound_dtype(k.dtype),
                            spare=selection.sinks + selection.top_k + TIE_SLOTS + 2)
    q_far = q if rotation is None else far_queries_static(q, real, seen, *rotation)
    return kept_step(q, k, v, q_far, local_window=local_window, far_band=far_band, selection=selection, scale=scale,
                     real=real, seen=seen, rotation=rotation, kept=MadeSummaries(mn, mx, cut), refresh=False)


class ConcatenatedState:
    """What a layer keeps between its compiled steps: the rows' first slots on the device (made once
    per layout, so that no step copies from the host) and the count of ties cut."""

    def __init__(self, device):
        self.first = {}  # rows' first slots (a tuple) -> on the device; a few layouts
        with torch.inference_mode(False):  # written by steps in and out of inference mode alike
            self.cut = torch.zeros((), dtype=torch.int32, device=device)
        self.steps = self.length = 0  # steps in a row, and the cache's length at the last one

    def first_slots(self, first: list[int], device) -> torch.Tensor:
        held = self.first.get(tuple(first))
        if held is None:  # (a copy from the host once per layout, not per step)
            if len(self.first) >= 8:
                self.first.clear()
            with torch.inference_mode(False):
                held = self.first[tuple(first)] = torch.tensor(first, dtype=torch.long, device=device)
        return held


def _compiled(settings: dict):
    key = tuple(sorted(settings.items(), key=lambda item: item[0]))
    step = _COMPILED.get(key)
    if step is None:
        def concatenated(q, k, v, first, cut, inv_freq):
            return _concatenated(q, k, v, first, cut, inv_freq, **settings)

        # A code object of its own per settings: dynamo keeps at most recompile_limit (8) graphs per code
        # object, and each settings' dtypes, batch sizes, grad modes and devices take some.
        code = concatenated.__code__.replace(co_name=f"concatenated_{len(_COMPILED)}")
        own = types.FunctionType(code, concatenated.__globals__, code.co_name, None, concatenated.__closure__)
        step = _COMPILED[key] = torch.compile(own, backend=BACKEND, fullgraph=True)
    return step


def concatenated_step(q, k, v, *, local_window: int, far_band: int | None, selection: FarSelection, scale: float,
                      first: list[int], shift: list[int], rotation, state: dict):
    """An eager one-query step on a cache that concatenates (module section above), compiled, or
    None (nothing done) where it does not apply: a key tensor that is a view (an in-place cache:
    reserved_step's), positions other than the mask ranks, no far key yet, inside an outer
    torch.compile, once compiling failed here (warned once), and with dynamo switched off
    (TORCHDYNAMO_DISABLE=1: the eager path keeps its summaries, cheaper uncompiled). `state` the
    layer's dict (kinds.py)."""
    global _COMPILE_FAILED
    if (_COMPILE_FAILED is not None or torch._dynamo.config.disable or torch.compiler.is_compiling()
            or k._base is not None or v._base is not None or any(s != -f for f, s in zip(first, shift))
            or q.requires_grad or k.requires_grad):
        return None
    if k.shape[2] - 1 - min(first) < local_window:
        # No query has a far key yet (a context within the original one): the eager step reads the band
        # alone, in a few launches; compiling (tens of seconds on a GPU) waits until far keys exist.
        return None
    held = state.get("concatenated")
    if held is None or held.cut.device != q.device:
        held = state["concatenated"] = ConcatenatedState(q.device)
    far = None if rotation is None else (rotation[0], rotation[1])
    inv_freq = (torch.empty(0, device=q.device) if rotation is None else rotation[2]).to(q.device)
    settings = dict(local_window=local_window, far_band=far_band, selection=selection, scale=scale, far=far)
    for t in (k, v):  # the cache's length changes every step: one graph for all of them
        torch._dynamo.maybe_mark_dynamic(t, 2)
    # Under a dispatch mode of the user's (a FLOP counter, a debug mode) dynamo compiles nothing: the
    # same step, called.
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    step = (_compiled(settings) if _get_current_dispatch_mode() is None
            else lambda *a: _concatenated(*a, **settings))
    try:
        out = step(q, k, v, held.first_slots(first, q.device), held.cut, inv_freq)
    except torch.OutOfMemoryError:
        raise
    except _RECOMPILE_LIMIT:  # graphs enough for these settings (dtypes, batches, devices): this call eagerly
        return None
    except Exception as exc:  # compiling failed: the eager step from now on
        _COMPILE_FAILED = f"{type(exc).__name__}: {exc}"
        warnings.warn(f"hf_dilated: compiling the decode step for a concatenating cache failed "
                      f"({_COMPILE_FAILED[:500]}); decode steps take the eager path from now on (the same "
                      "results, more launches)", RuntimeWarning, stacklevel=3)
        return None
    # The ties cut are read back (one read) at a step that does not follow the last one (the next
    # generation's first: a read is due there anyway, after its prefill) and every CUT_CHECK_EVERY steps.
    held.steps = held.steps + 1 if k.shape[2] == held.length + 1 else 0
    held.length = k.shape[2]
    if held.steps % CUT_CHECK_EVERY == 0 and int(held.cut):
        warnings.warn(f"hf_dilated: decode steps met more than {TIE_SLOTS} blocks tied at the far_top_k-th bound "
                      f"{int(held.cut)} times and read the first {TIE_SLOTS} of them (docs/contract.md 4.2 reads "
                      "them all)", RuntimeWarning, stacklevel=3)
        held.cut.zero_()
    return out
