"""Sparse far keys (docs/contract.md 4.2) for a few queries against a long cache (a decode step):
the band, the sinks and the selected blocks only, from block summaries kept between steps.

How it is computed. For a regular row (one document, one run of real tokens to the end of the
row: an unpadded or left-padded cache, ops/token_layout.regular_rows) position p sits at index
p - shift, so block c is a run of indices and everything is arithmetic on Python ints. Per query
(position p, band W): the band is the run of the last W positions, scored with (q, k); the far
keys are the positions <= p - W; Quest's bound (ops/far_selection.bounds) of the query's far
projection against each candidate block's summary picks its blocks, and only the sinks' and the
chosen blocks' keys are rotated to their grouped positions and read. One softmax spans both parts
(the band's scores and the far keys' side by side). Cost per step: O(W + (k + sinks) B) keys and O(N / B) bounds.

The summaries (min/max of each complete block's far keys) live in a `SummaryState` the caller
keeps per layer (the transformers glue: one per attention module). A step extends it by the
blocks completed since the last one, which rotates each key once over a generation; it is rebuilt
from the cache whenever the cache is not the one it was built on plus this step's tokens: the same
buffer object (a weak reference), written exactly once since (its version counter: a crop and
refill, a reset or a rewrite in place count more, or a different length), grown by exactly the
step's queries. hf_dilated.ReservedCache and StaticCache write in place, one write per step.
A DynamicCache concatenates into a new tensor each step: there the summaries are kept when every
summarised block's checksum (the sum of its keys, bit for bit) is that of the keys it was built
on, one pass over the cache without rotating it (a rebuild rotates every key); any other change
rebuilds. Two different blocks with the same sum bit for bit would pass: a DynamicCache's own
growth never makes one. (On a GPU one-query steps take fixed-shape forms instead: a CUDA graph for
an in-place cache, ops/sparse_far_reserved.py; a compiled step for a concatenating one,
ops/sparse_far_concatenated.py.)
"""
from __future__ import annotations

import weakref

import torch

from .far_selection import FarSelection, bound_dtype, bound_operands, plain_slots
from .merge import merge_dtype
from .rope import block_turns, offset_turns, rotate_by, rotate_with, turn_by


class SummaryState:
    """Block summaries of one layer's cache, kept between decode steps (see the module docstring)."""

    def __init__(self):
        self.clear()

    def clear(self):
        self.key = None  # the layout, rows and settings the summaries were built for
        self.buffer = None  # weakref to the cache buffer they were built on
        self.place = None  # the keys' offset and strides in it
        self.version = None  # its version counter then
        self.kv_len = 0
        self.counts = None  # complete blocks summarised per row, from block 0
        self.checks = None  # per row: _checksums of those blocks' keys (kv_heads, counts[b], d)
        self.mn = self.mx = None  # (batch, kv_heads, max(counts), head_dim); +inf / -inf past a row's count
        self.kept = {}  # _kept: values derived from tensors, while those tensors stay as they are


def _kept(state: SummaryState, name: str, tensors: tuple, extra, make):
    """make(), kept in `state` under `name` while `tensors` are the same objects, unwritten since
    (version counters) and `extra` is equal: a step reuses what depends only on the summaries or
    the frequencies (a few launches each). Inference-mode tensors keep no version: made each time."""
    try:
        versions = tuple(t._version for t in tensors)
    except RuntimeError:
        return make()
    held = state.kept.get(name)
    if held is not None and all(a is b for a, b in zip(held[0], tensors)) and held[1] == (versions, extra):
        return held[2]
    value = make()
    state.kept[name] = (tensors, (versions, extra), value)
    return value


def _rotation_delta(positions, rotation, query: bool):
    """How far positions (a tensor or an int) move to their grouped far positions."""
    window, group, _ = rotation
    if query:
        return positions // group + window - window // group - positions
    return positions // group - positions


def _far_keys(k, b, lo, hi, shift, rotation, moved: int = 0):
    """k_far of row b's indices lo..hi-1: (kv_heads, n, head_dim), the keys rotated at their
    positions + `moved` (rope_shift)."""
    keys = k[b:b + 1, :, lo:hi]
    if rotation is None:
        return keys[0]
    positions = torch.arange(lo + shift, hi + shift, device=k.device)[None]
    return rotate_by(keys, _rotation_delta(positions, rotation, False) - moved, rotation[2])[0]


def _block_keys(k, b, c0, c1, first, shift, size, rotation, dtype, moved: int = 0):
    """Keys of row b's blocks c0 .. c1 - 1 as (kv_heads, c1 - c0, B, d), far keys (rotated) when
    `rotation` is given; the first block, which may start before the document, padded with its
    first key."""
    lo, hi = max(first, c0 * size - shift), c1 * size - shift
    # unrotated keys (the checksums) straight from the cache: _far_keys is the rotation, counted by a test
    keys = _far_keys(k, b, lo, hi, shift, rotation, moved) if rotation is not None else k[b, :, lo:hi]
    keys = keys.to(dtype)
    lead = lo - (c0 * size - shift)
    if lead:
        keys = torch.cat([keys[:, :1].expand(-1, lead, -1), keys], 1)
    return keys.unflatten(1, (c1 - c0, size))


def _checksums(blocks):
    """(kv_heads, blocks, d): each block's sum of its keys, one pass, summed block by block in one
    order whatever the number of blocks (the same keys give the same bits)."""
    return blocks.sum(2)


def _summaries(state: SummaryState, k, first, shift, needed: list[int], size: int, rotation, dtype, q_len: int,
               moved: list[int] | None = None):
    """(mn, mx) (batch, kv_heads, blocks, head_dim) holding at least blocks 0 .. needed[b] - 1 of
    each row b, every one of them complete; row b's keys were rotated `moved[b]` (None: 0) further
    than their positions (sparse_far_decode's rope_shift)."""
    batch, kv_heads, kv_len, dim = k.shape
    moved = [0] * batch if moved is None else moved
    key = (batch, kv_heads, dim, k.dtype, tuple(first), tuple(shift), size, dtype,
           None if rotation is None else (rotation[0], rotation[1], rotation[2].data_ptr(), tuple(moved)))
    place = (k.storage_offset(), k.stride())  # where the keys sit in their buffer
    buffer = k if k._base is None else k._base
    try:
        version = k._version  # shared by every view of the buffer; +1 per in-place write
    except RuntimeError:  # an inference-mode tensor keeps no version
        version = None
    grown = state.key == key and kv_len == state.kv_len + q_len
    same_buffer = (state.key == key and version is not None and state.buffer is not None
                   and state.buffer() is buffer and state.place == place)
    # The same buffer object, written once since (the cache appending this step's tokens) and grown
    # by exactly them, or not written at all (the same cache queried again: a benchmark's repeated
    # step, candidates scored against one cache): the summarised keys are the ones summarised.
    reuse = same_buffer and ((grown and version == state.version + 1)
                             or (kv_len == state.kv_len and version == state.version))
    # Another buffer grown by this step's tokens (a DynamicCache concatenates every step): the
    # summarised blocks are reused when their checksums match, one pass over their keys, unrotated
    # (a rebuild rotates every key). A crop and refill, a reorder or a rewrite changes them.
    if grown and not reuse:
        reuse = all(
            torch.equal(_checksums(_block_keys(k, b, 0, state.counts[b], first[b], shift[b], size, None, dtype)),
                        state.checks[b]) for b in range(batch) if state.counts[b])
    if not reuse:
        state.clear()
        state.counts = [0] * batch
        state.checks = [None] * batch
        state.mn = torch.empty(batch, kv_heads, 0, dim, dtype=dtype, device=k.device)
        state.mx = state.mn
    grow = max(needed) - state.mn.shape[2]
    if grow > 0:
        pad = torch.full((batch, kv_heads, grow, dim), float("inf"), dtype=dtype, device=k.device)
        state.mn, state.mx = torch.cat([state.mn, pad], 2), torch.cat([state.mx, -pad], 2)
    for b in range(batch):
        if needed[b] > state.counts[b]:
            c0, c1 = state.counts[b], needed[b]
            blocks = _block_keys(k, b, c0, c1, first[b], shift[b], size, rotation, dtype, moved[b])  # (kv_heads, n, B, d)
            state.mn[b, :, c0:c1], state.mx[b, :, c0:c1] = blocks.amin(2), blocks.amax(2)
            checks = _checksums(_block_keys(k, b, c0, c1, first[b], shift[b], size, None, dtype))
            state.checks[b] = checks if c0 == 0 else torch.cat([state.checks[b], checks], 1)
            state.counts[b] = c1
    state.key, state.place, state.kv_len, state.version = key, place, kv_len, version
    state.buffer = weakref.ref(buffer)
    return state.mn, state.mx


def sparse_far_decode(q, k, v, *, local_window: int, far_band: int | None, selection: FarSelection, scale: float,
                      first: list[int], shift: list[int], rotation=None, state: SummaryState | None = None,
                      rope_shift: list[int] | None = None):
    """q (batch, heads, q_len, d) the last q_len tokens of k, v (batch, kv_heads, kv_len, d), rows
    regular (first, shift: regular_rows); `rotation` (window, group, inv_freq) moves q and k to the
    far keys' grouped positions (None: far keys score q . k); `rope_shift[b]`: how much further than
    its positions row b's q and k were rotated (None: 0). The bounds are taken at the grouped
    positions themselves (they are not relative); the scores, relative, as the keys were rotated.
    Returns the output shaped like q."""
    further = [0] * q.shape[0] if rope_shift is None else rope_shift  # per row
    batch, n_heads, q_len, dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    group = n_heads // kv_heads
    size = selection.block_size
    acc_dtype = merge_dtype(q.dtype)
    out = torch.empty(q.shape, dtype=acc_dtype, device=q.device)
    queries = [(b, t, kv_len - q_len + t) for b in range(batch) for t in range(q_len)]
    bands = {}
    for b, t, index in queries:
        p = index + shift[b]
        bands[b, t] = local_window if p < local_window or far_band is None else far_band
    # Summaries of every block a query may select: blocks 0 .. (p - W) // B.
    needed = [0] * batch
    for (b, t), width in bands.items():
        p = kv_len - q_len + t + shift[b]
        if p - width >= first[b] + shift[b]:
            needed[b] = max(needed[b], (p - width) // size + 1)
    summaries = None
    state = SummaryState() if state is None else state
    if max(needed):
        summaries = _summaries(state, k, first, shift, needed, size, rotation, bound_dtype(k.dtype), q_len, further)
        operands = _kept(state, "bounds", summaries, group, lambda: bound_operands(*summaries, group))
    if rotation is not None and size % rotation[1] == 0:  # whole blocks: one angle per block and offset
        offset_turn = _kept(state, "turns", (rotation[2],), (size, rotation[1], q.device),
                            lambda: offset_turns(size, rotation[1], rotation[2], q.device))
    for b, t, index in queries:
        p, width = index + shift[b], bands[b, t]
        lo = max(first[b], index - width + 1)
        qb = q[b:b + 1, :, t:t + 1]  # (1, heads, 1, d)
        # The band's scores (heads, W); with the far keys' after them, one softmax over both.
        near = (qb[0, :, 0].view(kv_heads, group, dim).to(acc_dtype) * scale) @ k[b, :, lo:index + 1].to(
            acc_dtype).transpose(-1, -2)
        last_far = index - width  # the last far key's index
        if last_far < first[b]:
            out[b, :, t] = (torch.softmax(near, -1) @ v[b, :, lo:index + 1].to(acc_dtype)).view(n_heads, dim)
            continue
        n_blocks = (p - width) // size + 1
        q_far = qb if rotation is None else rotate_with(  # the query's move, a Python int here
            qb, *turn_by(_rotation_delta(p, rotation, True), rotation[2], qb.dtype, qb.device))
        q_bound = q_far if rotation is None or not further[b] else rotate_with(  # at its grouped position itself
            qb, *turn_by(_rotation_delta(p, rotation, True) - further[b], rotation[2], qb.dtype, qb.device))
        slots, tied = plain_slots(q_bound[0], operands[0][b, :, :n_blocks], p, width, selection,
                                  first_position=first[b] + shift[b])
        listed = slots[:, 0]  # (heads, sinks + k) each head's blocks; -1: none
        if tied.numel():  # a head whose k-th bound is tied reads every block reaching it (usually none)
            more = torch.zeros(n_heads, n_blocks, dtype=torch.bool, device=q.device)
            more[tied[:, 0], tied[:, 2]] = True
            extra = torch.sort((~more).to(torch.uint8), dim=-1, stable=True).indices[:, :int(more.sum(-1).max())]
            listed = torch.cat([listed, torch.where(more.gather(-1, extra), extra, -1)], -1)
        width_blocks = listed.shape[-1]
        listed_ok, listed = listed >= 0, listed.clamp(min=0)
        offsets = torch.arange(size, device=q.device)
        index_of = (listed[..., None] * size + offsets - shift[b]).flatten(1)  # (heads, n * B)
        read = listed_ok.repeat_interleave(size, -1) & (index_of >= first[b]) & (index_of <= last_far)
        whole = shift[b] <= 0  # block c starts at index c * B - shift >= 0: whole blocks of B rows
        # (else rows, those before the row's first index clamped, and not read)
        per_kv = (listed if whole else index_of.clamp(first[b], last_far)).unflatten(0, (kv_heads, group)).flatten(1)

        def chosen(x, h0, h1):  # x's chosen keys (or values) of kv heads h0 .. h1 - 1: (their heads, n * B, d)
            if whole:
                return _blocks(x[b, h0:h1], per_kv[h0:h1], -shift[b], size, n_blocks).view((h1 - h0) * group, -1, dim)
            return _rows(x[b, h0:h1], per_kv[h0:h1]).view((h1 - h0) * group, -1, dim)

        step = _kv_heads_at_once(q.device, group * width_blocks * size * dim * k.element_size(), kv_heads)
        spans = [(h0, min(h0 + step, kv_heads)) for h0 in range(0, kv_heads, step)]
        if rotation is not None and size % rotation[1] == 0:
            # whole blocks: each key turned by its offset's angle, the query back by each block's
            cos, sin = block_turns(listed, size, rotation[1], rotation[2], acc_dtype)  # (heads, n, rot / 2)
            q_blocks = rotate_with((q_far[0, :, 0, None, :].to(acc_dtype) * scale).expand(-1, width_blocks, -1), cos,
                                   -sin)  # (heads, n, d)
            turn = tuple(t.to(k.dtype) for t in offset_turn)
            parts = [(q_blocks[h0 * group:h1 * group, :, None, :] @ rotate_with(
                chosen(k, h0, h1).unflatten(1, (width_blocks, size)), *turn).to(acc_dtype).transpose(-1, -2))
                .flatten(1) for h0, h1 in spans]  # (their heads, n * B)
        else:
            q_scaled = q_far[0, :, 0, None, :].to(acc_dtype) * scale
            parts = []
            for h0, h1 in spans:
                keys = chosen(k, h0, h1)
                if rotation is not None:  # per head: (heads, 1, n, d) moved by (heads, n)
                    moved = _rotation_delta(index_of[h0 * group:h1 * group] + shift[b], rotation, False)
                    keys = rotate_by(keys[:, None], moved, rotation[2])[:, 0]
                parts.append((q_scaled[h0 * group:h1 * group] @ keys.to(acc_dtype).transpose(-1, -2))[:, 0])
        far = parts[0] if len(parts) == 1 else torch.cat(parts)  # (heads, n * B); one span: no copy (a GPU's)
        probs = torch.softmax(torch.cat([near.view(n_heads, -1), far.masked_fill(~read, float("-inf"))], -1), -1)
        band = near.shape[-1]  # the band always holds the query's own key: no row without a key
        out[b, :, t] = (probs[:, :band].view(kv_heads, group, band) @ v[b, :, lo:index + 1].to(acc_dtype)).view(
            n_heads, dim)
        for h0, h1 in spans:
            heads = slice(h0 * group, h1 * group)
            out[b, heads, t] += (probs[heads, None, band:] @ chosen(v, h0, h1).to(acc_dtype))[:, 0]
    return out.to(q.dtype)


# The bytes of chosen keys (or values) a CPU step copies at once. Copies of every kv head at once were
# fresh allocations past glibc's largest heap block (32 MiB), mapped and faulted in page by page at
# every step (31 of a 49 ms step at 128K, 32/8 heads x 128, float32); copies of 8 MiB were trimmed
# from the heap between steps often enough to double some steps at 32K; a kv head at a time there
# (3-5 MiB) is steady.
_CPU_CHOSEN_BYTES = 2 << 20


def _kv_heads_at_once(device: torch.device, bytes_per_kv_head: int, kv_heads: int) -> int:
    """How many kv heads' chosen keys a step copies at once: every one on a GPU (a launch per copy is
    the cost there), on the CPU as many as fit _CPU_CHOSEN_BYTES (one at least)."""
    if device.type == "cuda":
        return kv_heads
    return max(1, min(kv_heads, _CPU_CHOSEN_BYTES // max(1, bytes_per_kv_head)))


def _blocks(x, blocks, start: int, size: int, count: int):
    """x (kv_heads, n, d) as blocks of `size` rows from index `start` (count of them), at blocks
    (kv_heads, m) per kv head: (kv_heads, m, size, d), runs of B rows copied whole (a third faster
    than _rows' row by row on the CPU, from a cache in memory). On a GPU one index for every kv head
    (a launch per kv head is the cost there)."""
    view = x[:, start:start + count * size].unflatten(1, (count, size))
    return (_blocks_at_once if x.device.type == "cuda" else _per_kv_head)(view, blocks)


def _blocks_at_once(view, blocks):
    return view[torch.arange(view.shape[0], device=view.device)[:, None], blocks]


def _rows(x, index):
    """x (kv_heads, n, d) at rows index (kv_heads, m), per kv head: one gather on a GPU (where a
    launch per kv head is the cost); _per_kv_head elsewhere (contiguous rows, 2-4x faster than the
    gather on the CPU, and no copy of a cache that is a view)."""
    return (_rows_at_once if x.device.type == "cuda" else _per_kv_head)(x, index)


def _rows_at_once(x, index):
    return x.gather(1, index[..., None].expand(-1, -1, x.shape[-1]))


def _per_kv_head(x, index):
    """x (kv_heads, n, ...) at index (kv_heads, m) along dim 1: an index_select per kv head, into one
    output (stacking copied every entry once more)."""
    out = x.new_empty(index.shape + x.shape[2:])
    for g in range(x.shape[0]):
        torch.index_select(x[g], 0, index[g], out=out[g])
    return out

