"""Sparse far keys (docs/contract.md 4.2) on plain layouts, on FlexAttention: the CUDA path.

The same set as sparse_far_plain's block-by-block products (every query reads the far keys of its
sink blocks and of its selected blocks, j <= i - band), computed the way a GPU wants it: per chunk
of queries, the selection (bounds, top-k) as a few batched operations, then ONE FlexAttention call
whose BlockMask lists, per (head, 128 queries), the 128-key tiles some query of the tile selected
and whose mask_mod reads each query's own selection. FlexAttention skips every tile not listed, so
the work is the union of a query tile's selections (not every far key), and nothing is read back
to the host: the plan is built on the device.

The block-by-block loop is right for the CPU (its flash kernel does not skip masked keys), but on
a GPU it is one small launch per (kv head, block) and two reads back per chunk: 1.07 s for a
16K prefill of two layers on an H100, where sdpa took 21 ms (gpu-check, 2026-11-26).

Compiled on CUDA (torch.compile of flex_attention, once per power of two of the length: keys and
query rows are padded to one shape per bucket); elsewhere the eager
FlexAttention, which computes the same set from the same BlockMask (tests run it on the CPU,
whose compiled FlexAttention returns no log-sum-exp).
"""
from __future__ import annotations

import functools
import warnings

import torch

try:  # torch >= 2.5
    from torch.nn.attention import flex_attention as _flex
except ImportError:  # pragma: no cover - the package's oldest torch
    _flex = None

from . import far_selection, pair_count
from .far_selection import FarSelection
from .merge import merge_into

AVAILABLE = _flex is not None
TILE = 128  # FlexAttention's default tile (queries x keys) of a BlockMask
_BOUND_ELEMENTS = 1 << 27  # bounds per chunk of queries (heads x queries x blocks) at most
_MAX_CHUNK = 8192
_FAILED: str | None = None  # why FlexAttention could not run in this process, once it failed


def query_chunk(rows: int, n_blocks: int) -> int:
    """Queries per FlexAttention call: a multiple of TILE whose bounds (`rows` = batch x heads of
    them per query) stay under _BOUND_ELEMENTS."""
    fit = _BOUND_ELEMENTS // (rows * n_blocks)
    return max(TILE, min(_MAX_CHUNK, fit // TILE * TILE))


@functools.lru_cache(maxsize=None)
def _compiled():
    return torch.compile(_flex.flex_attention, dynamic=False)


def _kernel(device: torch.device):
    """FlexAttention compiled on CUDA; eager elsewhere (the CPU's compiled form returns no lse)."""
    return _compiled() if device.type == "cuda" else _flex.flex_attention


def _flex_call(q, k, v, block_mask, scale):
    """(out, lse) of one FlexAttention call; lse natural-log, -inf (out 0) for a row with no key."""
    fn = _kernel(q.device)
    aux = getattr(_flex, "AuxRequest", None)
    if aux is not None:
        out, extra = fn(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True, return_aux=aux(lse=True))
        return out, extra.lse
    return fn(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True, return_lse=True)


def _length_bucket(n: int) -> int:
    """The key length a FlexAttention call is compiled for: the power of two at or above n."""
    return 1 << max(0, n - 1).bit_length()


def _tile_overlap(n_blocks: int, n_tiles: int, block_size: int, device) -> torch.Tensor:
    """float (n_blocks, n_tiles): 1 where selection block c shares a key with key tile t."""
    c = torch.arange(n_blocks, device=device)[:, None]
    t = torch.arange(n_tiles, device=device)[None, :]
    return ((c * block_size < (t + 1) * TILE) & (t * TILE < (c + 1) * block_size)).float()


def far_attention(q_far, k_far, v, out, lse, start: int, band: int, selection: FarSelection, scale: float,
                  mn, mx) -> bool:
    """Merge into out/lse ((batch, heads, n, d) / (batch, heads, n), float32) the far keys every
    query from `start` on selects: keys j <= i - band in its sink blocks and its top_k blocks by
    Quest's bound from the summaries (mn, mx) (far_selection). Returns False, having merged
    nothing, where FlexAttention failed to build its kernel in this process (warned once): the
    caller then takes the block-by-block path."""
    global _FAILED
    if _FAILED is not None:
        return False
    batch, n_heads, n = q_far.shape[:3]
    # Every call has one shape per power of two of the length (one compile for all the lengths in
    # it, where one per length would recompile at each new prompt): the keys are padded to it (no
    # query reaches a padded key, and no tile of them is listed: they cost memory, not work), every
    # call takes `chunk` query rows, the last chunk moved back to end at n (merging only the rows
    # not merged yet), a row shorter than a chunk padded with queries that read nothing. Every
    # operand is contiguous: a compiled call specialises on strides too, and a slice of a longer
    # row has other strides.
    n_keys = _length_bucket(n)
    k_far, v = (torch.nn.functional.pad(t, (0, 0, 0, n_keys - n)) if n_keys > n else t.contiguous()
                for t in (k_far, v))
    chunk = min(query_chunk(batch * n_heads, -(-n_keys // selection.block_size)), max(TILE, n_keys))
    lo = start
    while lo < n:
        e = min(n, lo + chunk)
        s = max(start, e - chunk)
        q_chunk = q_far[:, :, s:e].contiguous()
        if e - s < chunk:
            q_chunk = torch.nn.functional.pad(q_chunk, (0, 0, 0, chunk - (e - s)))
        block_mask, pairs = chunk_block_mask(q_chunk, mn, mx, s, n_keys, band, selection, tally_from=lo - s,
                                             queries=e - s)
        try:
            o, part = _flex_call(q_chunk, k_far, v, block_mask, scale)
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:  # the first call compiles (every call has its shape): a build failure
            if lo != start:
                raise
            _FAILED = f"{type(exc).__name__}: {exc}"
            warnings.warn(f"hf_dilated: FlexAttention failed here ({_FAILED[:500]}); sparse far keys take the "
                          "block-by-block path from now on (correct, but slow on a GPU)", RuntimeWarning, stacklevel=2)
            return False
        merge_into(out[:, :, lo:e], lse[:, :, lo:e], o[:, :, lo - s:e - s], part[:, :, lo - s:e - s].to(lse.dtype))
        if pairs is not None:  # counted once merged: a fallback counts its own
            pair_count.TALLY.pairs += pairs
        lo = e
    return True


def chunk_block_mask(q_chunk, mn, mx, s: int, n: int, band: int, selection: FarSelection, tally_from: int = 0,
                     queries: int | None = None):
    """The BlockMask of the queries s, s + 1, ... (rows of q_chunk; the first `queries` of them
    real, the others padding that reads nothing) over n keys: its mask_mod reads each query's own
    selection (sink blocks and top_k blocks, keys j <= i - band); its tiles are those some query of
    a 128-query tile selected a block of. Returns (block_mask, pairs): the pairs its rows from
    `tally_from` on read, counted while pair_count is tallying (else None)."""
    length = q_chunk.shape[2]
    queries = length if queries is None else queries
    size, n_blocks, device = selection.block_size, mn.shape[2], q_chunk.device
    # Captured tensors are indexed by every (query, key) of the padded tiles: pad them so that no
    # index past the sequence reads outside them.
    n_tiles = -(-n // TILE)
    rows = -(-length // TILE) * TILE
    padded_blocks = (n_tiles * TILE - 1) // size + 1
    chosen = far_selection.plain_choice(q_chunk[:, :, :queries], mn, mx, s, band, selection)
    pairs = None
    if pair_count.TALLY.active:  # per chosen block, its keys up to the query's last far key
        last = torch.arange(s, s + queries, device=device) - band
        keys = (last[:, None] - torch.arange(n_blocks, device=device)[None, :] * size + 1).clamp(0, size)
        pairs = int((chosen * keys)[:, :, tally_from:].sum())
    # padding rows and blocks read nothing
    chosen = torch.nn.functional.pad(chosen, (0, padded_blocks - n_blocks, 0, rows - queries), value=False)
    # Per (query tile, key tile): whether some query of the tile chose a block overlapping the key
    # tile; the listed tiles first, in key order.
    per_tile = chosen.unflatten(2, (rows // TILE, TILE)).any(3)  # (batch, heads, q tiles, blocks)
    listed = (per_tile.float() @ _tile_overlap(padded_blocks, n_tiles, size, device)) > 0
    kv_indices = torch.argsort((~listed).to(torch.uint8), dim=-1, stable=True).to(torch.int32)
    kv_count = listed.sum(-1, dtype=torch.int32)
    # key <= query + first; a tensor (filled on the device: no copy from the host): one compile per shape
    first = torch.full((), s - band, dtype=torch.long, device=device)

    def mask_mod(b, h, q_idx, kv_idx):
        return chosen[b, h, q_idx, kv_idx // size] & (kv_idx <= q_idx + first)

    return _flex.BlockMask.from_kv_blocks(kv_count, kv_indices, BLOCK_SIZE=TILE, mask_mod=mask_mod,
                                          seq_lengths=(length, n)), pairs
