"""Sparse far keys (docs/contract.md 4.2) on plain layouts, on FlexAttention: the CUDA path.

The same set as sparse_far_plain's block-by-block products (every query reads the far keys of its
sink blocks and of its selected blocks, j <= i - band), computed the way a GPU wants it: per chunk
of queries, the selection (bounds, top-k) as a few batched operations, then one FlexAttention call
whose rows are the chosen (query, head, block) entries, per kv head sorted by block (by_block_plan):
a tile of 128 rows then holds one block or a few neighbours and lists one or two 128-key tiles,
so the work is the pairs chosen. Each query's entries and its band (flash's sliding window, one
call a chunk) are merged by log-sum-exp in one compiled pass, written once into the output
(prefill). Nothing is read back to the host: the plan is built on the device.

The other layout, rows = the queries (by_query_mask, LAYOUT = "by_query"), lists per 128 queries
every key tile one of them chose: nearly every far key where queries choose apart (random
weights: 0.94 of them; SmolLM2's layer 2: 0.44). On an H200 at 16K / 64K tokens (2-layer Llama
of 32/8 heads x 128, random weights; scripts/profile_model.py, 2026-11-26) by_block took 63 /
287 ms with its plan compiled (100 / 578 eager), by_query 126 / 1289 (sdpa's best 19 / 163). It
serves the blocks tied beyond a query's top_k + sinks slots (usually none: that call lists no tile).

The block-by-block loop is right for the CPU (its flash kernel does not skip masked keys), but on
a GPU it is one small launch per (kv head, block) and two reads back per chunk: 1.07 s for a
16K prefill of two layers on an H100, where sdpa took 21 ms (gpu-check, 2026-11-26).

Compiled on CUDA (torch.compile of flex_attention, once or twice per power of two of the length:
keys and query rows are padded to the bucket, the blocks scored to one of two counts); elsewhere the eager
FlexAttention, which computes the same set from the same BlockMask (tests run it on the CPU,
whose compiled FlexAttention returns no log-sum-exp).
"""
from __future__ import annotations

import functools
import inspect
import re
import types
import warnings
from dataclasses import dataclass

import torch

try:  # torch >= 2.5
    from torch.nn.attention import flex_attention as _flex
except ImportError:  # pragma: no cover - the package's oldest torch
    _flex = None

from . import far_selection, pair_count
from .backend import attention_forward
from .far_selection import FarSelection
from .local_band import band_rows, merge_band
from .merge import merge_dtype
from .strided import canonical

AVAILABLE = _flex is not None
# A BlockMask's query-block lists (its key-block lists transposed: a sort and a few passes each) serve
# FlexAttention's backward alone; the forward's masks skip them where torch can (compute_q_blocks,
# torch >= 2.7), the backward's (sparse_far_train) have them.
_FORWARD_ONLY = ({"compute_q_blocks": False} if AVAILABLE
                 and "compute_q_blocks" in inspect.signature(_flex.BlockMask.from_kv_blocks).parameters else {})
TILE = 128  # FlexAttention's default tile (queries x keys) of a BlockMask
_BOUND_ELEMENTS = 1 << 27  # bounds per chunk of queries (heads x queries x blocks) at most
_ENTRY_ELEMENTS = 1 << 27  # by-block rows per chunk (heads x queries x slots) x head_dim at most
_MAX_CHUNK = 8192
_FAILED: str | None = None  # why FlexAttention could not run in this process, once it failed
_BLOCK_TILES_FAILED: str | None = None  # why key tiles of a far block failed here (then tiles of 128 keys)
# How a chunk's (query, head, block) pairs become FlexAttention rows: "by_block" (rows are the
# pairs, sorted by block: the work is the pairs chosen) or "by_query" (rows are the queries: the
# work is every key tile some query of a tile chose). Both compute the same set.
LAYOUT = "by_block"
# How merge_entries sums a query's entries (by_block): "by_slot", a sum of one gather per slot (one
# pass over the entries' outputs, each read once); "reduce", one reduction over the (query, slot, d)
# gather, which compiled into two kernels over that gather: on an H200 at 16K they took 4.4 and 8.0 of
# the prefill's 59.5 ms of GPU time (2026-11-27). Compiled on this CPU
# (512 queries, 32/8 heads x 128, 17 slots) by_slot took 7.0 ms, reduce 38.9; not yet timed on a GPU.
MERGE = "by_slot"
MERGES = ("reduce", "by_slot")
# How by_block_plan picks a query's top_k blocks: "maxima", far_selection.top_picks (top_k row
# maxima, fused into one reduction kernel); "sort", far_selection.top_picks_by_sort. The same set.
PICKS = "maxima"
PICKERS = {"maxima": far_selection.top_picks, "sort": far_selection.top_picks_by_sort}


def query_chunk(rows: int, n_blocks: int, entry_elements: int = 0) -> int:
    """Queries per FlexAttention call: a multiple of TILE whose bounds (`rows` = batch x heads of
    them per query) stay under _BOUND_ELEMENTS, and whose by-block entries (`entry_elements` per
    query: rows x slots x head_dim) under _ENTRY_ELEMENTS."""
    fit = _BOUND_ELEMENTS // (rows * n_blocks)
    if entry_elements:
        fit = min(fit, _ENTRY_ELEMENTS // entry_elements)
    return max(TILE, min(_MAX_CHUNK, fit // TILE * TILE))


COMPILED_ON = ("cuda",)  # where FlexAttention, the plan and the merge are compiled (tests widen it)
BACKEND = "inductor"  # torch.compile's backend for them (tests on the CPU take a lighter one)
# FlexAttention's CUDA kernel (Triton's tl.dot) takes no head narrower than this: torch raises "NYI:
# embedding dimension ... must be at least 16". Such heads take the other paths, which leaves
# FlexAttention open to the process's other calls (a failed build closes it).
CUDA_MIN_HEAD_DIM = 16


def takes_head_dim(device: torch.device, head_dim: int) -> bool:
    """Whether FlexAttention's kernel on `device` takes heads of head_dim."""
    return device.type != "cuda" or head_dim >= CUDA_MIN_HEAD_DIM


# One function per kind of call, each compiled on its own and per length bucket (compiled_for_bucket).
def _flex_by_block(*args, **kwargs):
    return _flex.flex_attention(*args, **kwargs)


def _flex_by_query(*args, **kwargs):
    return _flex.flex_attention(*args, **kwargs)


# sparse_far_train's calls under autograd: compiled apart (another graph each, forward and backward,
# which would otherwise count against the inference calls' recompile limit)
def _flex_by_block_grad(*args, **kwargs):
    return _flex.flex_attention(*args, **kwargs)


def _flex_by_query_grad(*args, **kwargs):
    return _flex.flex_attention(*args, **kwargs)


_KINDS = {"by_block": _flex_by_block, "by_query": _flex_by_query, "by_block_grad": _flex_by_block_grad,
          "by_query_grad": _flex_by_query_grad}


@functools.lru_cache(maxsize=None)
def compiled_for_bucket(fn, bucket):
    """fn compiled (dynamic=False) for the calls of one length bucket, as a code object of its own:
    dynamo keeps at most recompile_limit (8) graphs per code object, and each bucket takes one or two
    shapes (prefill) per dtype and batch size; sharing one, a few buckets reached the limit,
    past which the plan ran eagerly and FlexAttention materialised its full scores. (Raising the
    limit per call instead, with torch._dynamo.config.patch, cost 0.5 ms of host time a call on the
    CPU.) `bucket`: the length bucket, or a tuple that starts with it and holds whatever else would
    make dynamo compile another graph (block_sparse_flex: one graph a code object)."""
    suffix = bucket if isinstance(bucket, int) else "_".join(re.findall(r"[A-Za-z0-9]+", repr(bucket)))
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{suffix}")
    own = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
    return torch.compile(own, backend=BACKEND, dynamic=False)


def _kernel(device: torch.device, kind: str, bucket: int):
    """FlexAttention compiled on CUDA, one function per kind (_KINDS) and length bucket; eager
    elsewhere (the CPU's compiled form returns no lse)."""
    if device.type not in COMPILED_ON:
        return _flex.flex_attention
    return compiled_for_bucket(_KINDS[kind], bucket)


def _flex_call(q, k, v, block_mask, scale, kind: str = "by_query"):
    """(out, lse) of one FlexAttention call; lse natural-log, -inf (out 0) for a row with no key."""
    fn = _kernel(q.device, kind, k.shape[2])
    kw = dict(block_mask=block_mask, scale=scale, enable_gqa=True,
              **kernel_options(q.device, q.dtype, q.shape[-1], block_mask))
    aux = getattr(_flex, "AuxRequest", None)
    if aux is not None:
        out, extra = fn(q, k, v, return_aux=aux(lse=True), **kw)
        return out, extra.lse
    return fn(q, k, v, return_lse=True, **kw)


def kernel_options(device: torch.device, dtype: torch.dtype, head_dim: int, block_mask) -> dict:
    """flex_attention's keyword for a call with queries of (device, dtype, head_dim): on CUDA,
    where the BlockMask's key tiles are under 128 keys, the kernel's key tile (BLOCK_N) set to one
    that divides them (the compiled kernel's own goes up to 128 keys: an H100's for bfloat16 with
    head_dim 64, where torch raises), and never above the kernel's own choice in torch's tables (64
    for 16-bit dtypes with head_dim up to 128, 32 for wider heads or 32/64-bit dtypes, 16 for both:
    a larger tile may not fit the GPU's shared memory)."""
    key_tile = block_mask.BLOCK_SIZE[1]
    if device.type != "cuda" or key_tile >= TILE:
        return {}
    narrow, small = dtype.itemsize <= 2, head_dim <= 128
    return {"kernel_options": {"BLOCK_N": min(key_tile, 64 if narrow and small else 32 if narrow or small else 16)}}


def scored_blocks(n: int, band: int, size: int) -> int:
    """The blocks whose bounds a call over n keys computes: every block a query can reach (keys up
    to n - 1 - band), in one of two counts per length bucket: the blocks of its first half where
    they all lie in it (at n = 16K + 64, band 4K: 256 blocks of 64, not 512), else those of its keys
    up to n_keys - 1 - band. So a bucket compiles the plan and FlexAttention for one or two shapes
    (the chunk follows)."""
    n_keys = length_bucket(n)
    half = n_keys // 2
    return -(-max(1, half if n - band <= half else n_keys - band) // size)


def length_bucket(n: int) -> int:
    """The key length a FlexAttention call is compiled for: the power of two at or above n."""
    return 1 << max(0, n - 1).bit_length()


def _tile_overlap(n_blocks: int, n_tiles: int, block_size: int, device) -> torch.Tensor:
    """float (n_blocks, n_tiles): 1 where selection block c shares a key with key tile t."""
    c = torch.arange(n_blocks, device=device)[:, None]
    t = torch.arange(n_tiles, device=device)[None, :]
    return ((c * block_size < (t + 1) * TILE) & (t * TILE < (c + 1) * block_size)).float()


def tile_lists(listed: torch.Tensor):
    """A BlockMask's (count, indices) of the key tiles marked in listed (..., tiles): int32, the
    listed tiles first, in key order."""
    return (listed.sum(-1, dtype=torch.int32),
            torch.argsort((~listed).to(torch.uint8), dim=-1, stable=True).to(torch.int32))


def listed_tiles(chosen: torch.Tensor, n_tiles: int, block_size: int) -> torch.Tensor:
    """bool (..., n_tiles): the key tiles holding a key of a chosen block, for chosen (..., blocks)
    over the blocks of n_tiles tiles ((n_tiles * TILE - 1) // block_size + 1 of them). Blocks that
    tile a tile, or tiles that tile a block: one reshape; other sizes: a product with the overlap
    of every block and tile (blocks x tiles: per chunk, quadratic in the length)."""
    if TILE % block_size == 0:
        return chosen.unflatten(-1, (n_tiles, TILE // block_size)).any(-1)
    if block_size % TILE == 0:
        return chosen.repeat_interleave(block_size // TILE, -1)[..., :n_tiles]
    return (chosen.float() @ _tile_overlap(chosen.shape[-1], n_tiles, block_size, chosen.device)) > 0


def prefill(q, k, v, q_far, k_far, start: int, band: int, selection: FarSelection, scale: float,
            with_lse: bool = False):
    """The output (shaped like q, in q's dtype) of sparse_far_plain's rows on FlexAttention, or None
    (nothing computed) where FlexAttention does not take heads this narrow here (takes_head_dim) or
    failed to build its kernel in this process (warned once): the caller then takes the block-by-block
    path. Queries before `start` (> 0) read every key before them (one causal call); each later query
    its band (keys j > i - band) and the far keys it selects: keys j <= i - band in its sink blocks and
    its top_k blocks by Quest's bound from the blocks' summaries (far_selection). with_lse: (output,
    its log-sum-exp (batch, heads, n) in float32 or float64), what sparse_far_train's backward takes.

    Per chunk of queries: the band's call (flash's sliding window on CUDA), the far keys' calls, and
    one compiled merge of both by log-sum-exp, written once into the output, in the memory layout
    transformers' attention interface returns ((batch, n, heads, d): its transpose is then free).
    (The band and the far keys' chunks merged eagerly into a float32 accumulator of the whole row,
    cast at the end, moved 40% more bytes in eager passes and took 31% more launches:
    scripts/far_prefill_work.py, 16K tokens in chunks of 1,280 queries, 2026-11-27.)"""
    global _FAILED, _BLOCK_TILES_FAILED
    check_choices()
    if _FAILED is not None or not takes_head_dim(q_far.device, min(q_far.shape[-1], v.shape[-1])):
        return None
    batch, n_heads, n = q_far.shape[:3]
    dim = v.shape[-1]
    rows_of = RowPlan.of(q_far, k_far, v, band, selection)
    out = torch.empty(batch, n, n_heads, dim, dtype=q.dtype, device=q.device)  # (the layout transformers returns)
    lse = torch.empty(batch, n_heads, n, dtype=merge_dtype(q.dtype), device=q.device) if with_lse else None
    head_out, head_lse = attention_forward(q[:, :, :start], k[:, :, :start], v[:, :, :start], is_causal=True,
                                           scale=scale)
    out[:, :start] = head_out.transpose(1, 2)
    if with_lse:
        lse[:, :, :start] = head_lse
    size, slots, chunk = selection.block_size, rows_of.slots, rows_of.chunk
    lo = start
    while lo < n:
        s, e = rows_of.chunk_rows(lo, start, n)
        q_chunk = rows_of.query_rows(q_far, s, e)
        band_out, band_lse = band_rows(q, k, v, s, e, band, scale)
        if e - s < chunk:
            band_out = torch.nn.functional.pad(band_out, (0, 0, 0, 0, 0, chunk - (e - s)))
            band_lse = torch.nn.functional.pad(band_lse, (0, chunk - (e - s)))
        last = rows_of.lasts[s:s + chunk]
        pairs = None
        if slots and (pair_count.TALLY.active or LAYOUT != "by_block"):
            chosen = far_selection.plain_choice(q_chunk[:, :, :e - s], None, None, s, band, selection,
                                                rows_of.operands)
            chosen = torch.nn.functional.pad(chosen, (0, 0, 0, chunk - (e - s)), value=False)
            if pair_count.TALLY.active:
                pairs = pairs_read(chosen, s, band, size, lo - s)
        try:
            if not slots:  # no far key is read
                rows = _fused(merge_band, rows_of.n_keys)(band_out, band_lse, None, None, q.dtype, with_lse)
            elif LAYOUT == "by_block":
                rows = _by_block_call(q_chunk, rows_of.k_far, rows_of.v_far, rows_of.operands, last, selection, scale,
                                      band_out, band_lse, with_lse)
            else:
                far = _flex_call(q_chunk, rows_of.k_far, rows_of.v_far,
                                 by_query_mask(chosen, last, rows_of.n_keys, size), scale)
                rows = _fused(merge_band, rows_of.n_keys)(band_out, band_lse, *far, q.dtype, with_lse)
        except _KeyTilesFailed as exc:  # the by-block call, with key tiles of a far block: first without them
            if lo != start:
                raise
            _BLOCK_TILES_FAILED = str(exc)
            warnings.warn(f"hf_dilated: FlexAttention failed with key tiles of {size} ({_BLOCK_TILES_FAILED[:500]}); "
                          "sparse far keys take tiles of 128 keys from now on (the same results, more work)",
                          RuntimeWarning, stacklevel=2)
            continue
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:  # the first call compiles (every call has its shape): a build failure
            if lo != start:
                raise
            _FAILED = f"{type(exc).__name__}: {exc}"
            warnings.warn(f"hf_dilated: FlexAttention failed here ({_FAILED[:500]}); sparse far keys take the "
                          "block-by-block path from now on (correct, but slow on a GPU)", RuntimeWarning, stacklevel=2)
            return None
        if with_lse:
            rows, rows_lse = rows
            lse[:, :, lo:e] = rows_lse[:, :, lo - s:e - s]
        out[:, lo:e] = rows[:, lo - s:e - s]
        if pairs is not None:  # counted once written: a fallback counts its own
            pair_count.TALLY.pairs += pairs
        lo = e
    return (out.transpose(1, 2), lse) if with_lse else out.transpose(1, 2)


@dataclass
class RowPlan:
    """What every chunk of one prefill shares, from shapes alone (prefill, and sparse_far_train's
    backward, which walks the same chunks). Every call has one shape per power of two of the length
    (one compile for all the lengths in it, where one per length would recompile at each new
    prompt): the keys are padded to it (no query reaches a padded key, and no tile of them is
    listed: they cost memory, not work), the blocks' summaries to a bucket of their own
    (scored_blocks; empty ones: never chosen), every call takes `chunk` query rows, the last chunk
    moved back to end at n (writing only the rows not written yet), a row shorter than a chunk
    padded with queries that read nothing. Every operand has a contiguous tensor's strides
    (canonical): a compiled call specialises on strides too, a size-1 dimension's included, and a
    slice of a longer row has others."""

    n_keys: int  # the length bucket
    slots: int  # sinks + top_k
    chunk: int  # query rows per call
    operands: tuple | None  # the far blocks' bound_operands (None without slots)
    k_far: torch.Tensor  # padded to n_keys (with slots)
    v_far: torch.Tensor
    lasts: torch.Tensor  # each query's last far key (i - band); -1 on the rows past n

    @classmethod
    def of(cls, q_far, k_far, v, band: int, selection: FarSelection) -> "RowPlan":
        batch, n_heads, n = q_far.shape[:3]
        n_keys = length_bucket(n)
        size = selection.block_size
        slots = selection.top_k + selection.sinks
        n_blocks = scored_blocks(n, band, size)
        operands = None
        v_far = v
        if slots:
            product = far_selection.product_dtype(k_far.device, k_far.dtype)  # bounds on the tensor cores where exact
            summaries = far_selection.plain_summaries(k_far[:, :, :n_blocks * size], size, n_blocks, product)
            operands = far_selection.bound_operands(*summaries, n_heads // k_far.shape[1])
            k_far, v_far = (torch.nn.functional.pad(t, (0, 0, 0, n_keys - n)) if n_keys > n else canonical(t)
                            for t in (k_far, v))
        entry_elements = batch * n_heads * slots * q_far.shape[-1] if LAYOUT == "by_block" else 0
        chunk = min(query_chunk(batch * n_heads, n_blocks, entry_elements), max(TILE, n_keys))
        position = torch.arange(n + chunk, device=q_far.device)
        lasts = torch.where(position < n, position - band, -1)
        return cls(n_keys, slots, chunk, operands, k_far, v_far, lasts)

    def chunk_rows(self, lo: int, start: int, n: int) -> tuple[int, int]:
        """(s, e): the rows of the call that writes rows lo .. e - 1 (s <= lo: a last chunk moved back)."""
        e = min(n, lo + self.chunk)
        return max(start, e - self.chunk), e

    def query_rows(self, q_far, s: int, e: int):
        """The call's query rows s .. e - 1, padded to `chunk` rows, with a contiguous tensor's strides."""
        rows = canonical(q_far[:, :, s:e])
        return rows if e - s == self.chunk else torch.nn.functional.pad(rows, (0, 0, 0, self.chunk - (e - s)))


def check_choices() -> None:
    """LAYOUT, MERGE and PICKS each one of their values (a ValueError naming the one that is not)."""
    for name, value, allowed in (("LAYOUT", LAYOUT, ("by_block", "by_query")), ("MERGE", MERGE, MERGES),
                                 ("PICKS", PICKS, tuple(PICKERS))):
        if value not in allowed:
            raise ValueError(f"sparse_far_flex.{name}: {value!r} is not one of {', '.join(map(repr, allowed))}")


def pairs_read(chosen, s: int, band: int, size: int, tally_from: int = 0) -> int:
    """The (query, key) pairs the rows from `tally_from` on of `chosen` (queries s, s + 1, ...)
    read: per chosen block, its keys up to the query's last far key (one read back: counting only)."""
    last = torch.arange(s, s + chosen.shape[2], device=chosen.device) - band
    keys = (last[:, None] - torch.arange(chosen.shape[3], device=chosen.device)[None, :] * size + 1).clamp(0, size)
    return int((chosen * keys)[:, :, tally_from:].sum())


# --- by query: FlexAttention's rows are the queries ------------------------------------------

def by_query_mask(chosen, last, n: int, size: int):
    """The BlockMask of a chunk's queries (rows of chosen: (batch, heads, rows, blocks)) over n
    keys, rows as they are: its mask_mod reads each query's own selection (keys j <= last[query]
    of its chosen blocks); its tiles are those some query of a 128-query tile chose a block of."""
    return by_query_block_mask(*by_query_lists(chosen, last, n, size), size, n, chosen.shape[2])


def by_query_lists(chosen, last, n: int, size: int):
    """by_query_mask's tensors: (chosen, last) padded so that the mask_mod's index of every (query,
    key) of the listed tiles stays inside them, and the BlockMask's (kv_count, kv_indices)."""
    batch, n_heads, rows, n_blocks = chosen.shape
    n_tiles = -(-n // TILE)
    q_rows = -(-rows // TILE) * TILE
    padded_blocks = (n_tiles * TILE - 1) // size + 1
    if padded_blocks > n_blocks or q_rows > rows:
        chosen = torch.nn.functional.pad(chosen, (0, max(0, padded_blocks - n_blocks), 0, q_rows - rows), value=False)
        last = torch.nn.functional.pad(last, (0, q_rows - rows), value=-1)
    # Per (query tile, key tile): whether some query of the tile chose a block overlapping the key
    # tile; the listed tiles first, in key order.
    per_tile = chosen[..., :padded_blocks].unflatten(2, (q_rows // TILE, TILE)).any(3)  # (batch, heads, q tiles, blocks)
    return (chosen, last, *tile_lists(listed_tiles(per_tile, n_tiles, size)))


def by_query_block_mask(chosen, last, kv_count, kv_indices, size: int, n: int, rows: int, grad: bool = False):
    """The BlockMask over n keys of by_query_lists' tensors for `rows` queries (before padding);
    grad: with the query-tile lists FlexAttention's backward reads."""
    def mask_mod(b, h, q_idx, kv_idx):
        return chosen[b, h, q_idx, kv_idx // size] & (kv_idx <= last[q_idx])

    return _flex.BlockMask.from_kv_blocks(kv_count, kv_indices, BLOCK_SIZE=TILE, mask_mod=mask_mod,
                                          seq_lengths=(rows, n), **({} if grad else _FORWARD_ONLY))


# --- by block: FlexAttention's rows are (query, head, chosen block), sorted by block ----------

def by_block_plan(q_chunk, summary, empty, last, top_k: int, sinks: int, size: int, n: int, kv_tile: int | None = None):
    """One chunk's selection and FlexAttention rows, when the rows are the chosen (query, head,
    block) entries themselves, per kv head sorted by block: a 128-row tile then holds entries of
    one block or of a few neighbours and lists one or two key tiles, whatever the queries chose (by
    query, a tile lists every key tile any of its 128 queries chose: nearly all of them where the
    queries choose apart). All of it on the device, from tensors (the chunk's first query is in
    `last`, not a Python int): compiled on CUDA, one graph per shape (_fused).

    q_chunk (batch, heads, rows, d), rows a multiple of TILE; (summary, empty) the far blocks'
    bound_operands (at least the blocks holding a far key of the last query; n keys, padded); last
    (rows,) each query's last far key (-1: a padding query, reads nothing). Each (query, head) gets
    min(sinks, blocks) + top_k slots: its sink blocks, then top_picks' blocks (-1: none). Returns
    q_entries (batch, kv_heads, rows', d): the query of each FlexAttention row (rows' the entries
    padded to a tile); row_block, row_last (batch, kv_heads, rows'): its block and last far key (-1
    on padding rows: they read nothing); kv_count, kv_indices, full_count: by_block_mask's tile
    lists; inverse (batch, kv_heads, entries): the FlexAttention row of each entry, entry
    ((head in group) * rows + query) * slots + slot; tied_lists: by_query_lists of the blocks tied
    at a query's top_k-th bound beyond its slots (read by query: usually none, no tile listed)."""
    batch, n_heads, rows, dim = q_chunk.shape
    kv_heads, n_blocks = summary.shape[1], summary.shape[2]
    device = q_chunk.device
    candidate, sink = far_selection.plain_candidates(last, n_blocks, size, sinks)
    scores = far_selection.bounds(q_chunk, None, None, (summary, empty)).masked_fill_(~candidate, float("-inf"))
    picks, tied = PICKERS[PICKS](scores, top_k)
    sinks = min(sinks, n_blocks)
    sink_picks = torch.where(sink[:, :sinks], torch.arange(sinks, device=device), -1).expand(batch, n_heads, rows, sinks)
    block = torch.cat([sink_picks, picks], -1)
    slots = block.shape[-1]
    entries = n_heads // kv_heads * rows * slots
    padded = -(-entries // TILE) * TILE
    block = block.reshape(batch, kv_heads, entries)
    key = torch.where(block >= 0, block, n_blocks).to(sort_key_dtype(n_blocks))  # untaken last
    order = torch.argsort(key, dim=-1, stable=True)
    block = block.gather(-1, order)
    row_last = torch.where(block >= 0, last[(order // slots) % rows], -1)
    row_block = torch.nn.functional.pad(block, (0, padded - entries), value=-1)
    row_last = torch.nn.functional.pad(row_last, (0, padded - entries), value=-1)
    source = torch.nn.functional.pad(order // slots, (0, padded - entries))  # padding rows: query 0, read nothing
    q_entries = q_chunk.reshape(batch, kv_heads, -1, dim).gather(2, source[..., None].expand(-1, -1, -1, dim))
    inverse = torch.empty_like(order).scatter_(-1, order, torch.arange(entries, device=device).expand_as(order))
    tied_lists = by_query_lists(tied, last, n, size)
    return (q_entries, row_block, row_last, *by_block_tiles(row_block, row_last, n_blocks, size, n, kv_tile), inverse,
            tied_lists)


def by_block_tiles(row_block, row_last, n_blocks: int, size: int, n: int, kv_tile: int | None = None):
    """by_block_plan's tile lists (kv_count, kv_indices, full_count) of its rows over n keys in key
    tiles of kv_tile (key_tile(size) unless given): per 128-row tile its entries' blocks are a
    sorted run lo .. hi, and the key tiles they overlap are listed."""
    kv_tile = kv_tile or key_tile(size)
    n_tiles = -(-n // kv_tile)
    per_tile = row_block.unflatten(-1, (row_block.shape[-1] // TILE, TILE))
    hi = per_tile.amax(-1)
    lo = torch.where(per_tile >= 0, per_tile, n_blocks).amin(-1)
    first = (lo * size // kv_tile).clamp(max=n_tiles - 1)
    last_tile = (((hi + 1) * size - 1) // kv_tile).clamp(max=n_tiles - 1)
    kv_count = torch.where(hi >= 0, last_tile - first + 1, 0).to(torch.int32)
    kv_indices = (first[..., None] + torch.arange(n_tiles, device=row_block.device)).clamp(max=n_tiles - 1).to(torch.int32)
    full_count = None
    if kv_tile == size:  # a row tile of one block whose rows all reach its last key reads every key of it
        full = (hi >= 0) & (per_tile.amin(-1) == hi) & (row_last.unflatten(-1, per_tile.shape[-2:]).amin(-1)
                                                        >= (hi + 1) * size - 1)
        full_count = full.to(torch.int32)
        kv_count = kv_count.masked_fill(full, 0)  # listed as full, where FlexAttention skips the mask_mod
    return kv_count, kv_indices, full_count


def sort_key_dtype(n_blocks: int) -> torch.dtype:
    """The narrowest integer dtype holding block numbers 0 .. n_blocks (by_block_plan's sort keys): a
    GPU's radix sort makes one pass per 8 bits of its keys, so int64 block numbers took 8 passes
    where int16 takes 2 (the sort was 3.4 of a 16K prefill's 59 ms of GPU time on an H200, 2026-11-27)."""
    return torch.int16 if n_blocks < 1 << 15 else torch.int32 if n_blocks < 1 << 31 else torch.int64


def merge_entries(o, part, inverse, heads: int, rows: int, tied_out, tied_lse, band_out, band_lse,
                  by_slot: bool = False, with_lse: bool = False):
    """A chunk's rows of the output, as merge_band returns them (o's dtype; with_lse, and their
    log-sum-exp): each query's entries (FlexAttention rows `inverse` of o / part) and its tied
    blocks' part (tied_out, tied_lse) in one softmax by their log-sum-exp, then merged with its band
    (band_out, band_lse). Compiled on CUDA (_fused): the gather, the weights and the sums are one
    pass over o."""
    batch, kv_heads, _, dim = o.shape
    acc = merge_dtype(o.dtype)
    lse_e = part.gather(2, inverse).view(batch, heads, rows, -1).to(acc)
    lse_all = torch.cat([lse_e, tied_lse[..., None].to(acc)], -1)
    far_lse = torch.logsumexp(lse_all, -1)
    weight = torch.exp(lse_all - far_lse[..., None]).nan_to_num_(0.0)  # a query with no entry: 0, lse -inf
    far_out = weight[..., -1:] * tied_out.to(acc)
    if by_slot:  # entry ((head in group) * rows + query) * slots + slot: one gather of rows per slot
        slots = lse_e.shape[-1]
        rows_of = inverse.view(batch, kv_heads, -1, slots)
        for slot in range(slots):
            o_s = o.gather(2, rows_of[..., slot, None].expand(-1, -1, -1, dim)).view(batch, heads, rows, dim)
            far_out = far_out + weight[..., slot, None] * o_s.to(acc)
    else:
        o_e = o.gather(2, inverse[..., None].expand(-1, -1, -1, dim)).view(batch, heads, rows, -1, dim).to(acc)
        far_out = far_out + (weight[..., :-1, None] * o_e).sum(-2)
    return merge_band(band_out, band_lse, far_out, far_lse, o.dtype, with_lse)


def merge_entries_by_slot(o, part, inverse, heads: int, rows: int, tied_out, tied_lse, band_out, band_lse,
                          with_lse: bool = False):
    """merge_entries summing slot by slot (MERGE "by_slot"): compiled apart from it."""
    return merge_entries(o, part, inverse, heads, rows, tied_out, tied_lse, band_out, band_lse, True, with_lse)


def _by_block_call(q_chunk, k_far, v, operands, last, selection: FarSelection, scale: float, band_out, band_lse,
                   with_lse: bool = False):
    """One chunk's rows of the output (merge_band's), from FlexAttention over by_block_plan's rows,
    merged per (query, head) by merge_entries with the blocks tied beyond the slots (one more call,
    by query: its tiles are those some query has a tied block in, usually none, which cost nothing)
    and with the band."""
    batch, n_heads, rows, _ = q_chunk.shape
    n = k_far.shape[2]
    size = selection.block_size
    tile = key_tile(size)  # an argument of the compiled plan: it compiles again when it changes
    q_entries, *plan, inverse, tied_lists = _fused(by_block_plan, n)(q_chunk, *operands, last, selection.top_k,
                                                                      selection.sinks, size, n, tile)
    try:
        o, part = _flex_call(q_entries, k_far, v, by_block_mask(*plan, size, n, tile), scale, "by_block")
    except torch.OutOfMemoryError:
        raise
    except Exception as exc:
        if tile < TILE:  # prefill tries 128-key tiles next
            raise _KeyTilesFailed(f"{type(exc).__name__}: {exc}") from exc
        raise
    o2, part2 = _flex_call(q_chunk, k_far, v, by_query_block_mask(*tied_lists, size, n, rows), scale)
    merge = merge_entries if MERGE == "reduce" else merge_entries_by_slot  # (a compiled function each)
    return _fused(merge, n)(o, part, inverse, n_heads, rows, o2, part2, band_out, band_lse, with_lse)


class _KeyTilesFailed(Exception):
    """FlexAttention failed on a by-block call with key tiles of a far block (the message: why)."""


def key_tile(block_size: int) -> int:
    """The keys of a by-block BlockMask's tile: the far block itself where it is 32, 64 or 128 keys
    (a row tile of one block then lists one key tile, all of it that block's: with 128-key tiles and
    blocks of 64, half of every tile read was another block's, masked), else TILE (and once such
    tiles failed to build here: prefill)."""
    return block_size if block_size in (32, 64, 128) and _BLOCK_TILES_FAILED is None else TILE


def by_block_mask(row_block, row_last, kv_count, kv_indices, full_count, size: int, n: int, kv_tile: int | None = None,
                  grad: bool = False):
    """The BlockMask of by_block_plan's rows over n keys: row r reads the keys of block row_block[r]
    up to row_last[r], in the key tiles listed for its tile (tiles of key_tile(size) keys), and
    every key of a full tile (full_count: one, or None where a key tile is not a block); grad: with
    the query-tile lists FlexAttention's backward reads."""
    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx // size == row_block[b, h, q_idx]) & (kv_idx <= row_last[b, h, q_idx])

    full = {} if full_count is None else {"full_kv_num_blocks": full_count, "full_kv_indices": kv_indices}
    return _flex.BlockMask.from_kv_blocks(kv_count, kv_indices, BLOCK_SIZE=(TILE, kv_tile or key_tile(size)),
                                          mask_mod=mask_mod, seq_lengths=(row_block.shape[-1], n), **full,
                                          **({} if grad else _FORWARD_ONLY))


# The selection and the entries' plan and merge (elementwise passes and row reductions over
# (query, head, block) scores and (entry, d) outputs) compiled on CUDA: eagerly they were most of a
# 16K prefill's GPU time (an H200, 2026-11-26: 81 of 89 ms beside FlexAttention's 4 and the band's
# 4); compiled, the prefill's GPU time went to 42 ms at 16K, and at 64K the selection's fused
# reduction was 66 of 281 ms, the bounds' float32 products 48 (both since cut: far_selection.top_picks,
# product_dtype).
_FUSED_FAILED: str | None = None  # why compiling them failed in this process (they then run eagerly)


def _fused(fn, bucket: int):
    """fn compiled (dynamic=False: one graph per chunk shape) for the length bucket where its inputs
    are on CUDA; eager elsewhere and once compiling failed (warned once: the same results, slower)."""
    def call(*args):
        global _FUSED_FAILED
        if args[0].device.type not in COMPILED_ON or _FUSED_FAILED is not None:
            return fn(*args)
        try:
            return compiled_for_bucket(fn, bucket)(*args)
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:
            _FUSED_FAILED = f"{type(exc).__name__}: {exc}"
            warnings.warn(f"hf_dilated: compiling {fn.__name__} failed ({_FUSED_FAILED[:500]}); it runs eagerly "
                          "from now on (the same results, slower)", RuntimeWarning, stacklevel=3)
            return fn(*args)
    return call
