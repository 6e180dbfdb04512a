"""Block-sparse attention (docs/contract.md 5) of a plain prefill on FlexAttention: the CUDA path.

A plain prefill (one unpadded document per row, causal, no sliding window) is one FlexAttention
call whose BlockMask comes from the block layout itself (never from an N x N mask): on a GPU the
block-by-block calls of ops/block_sparse.py are many small launches and host work, where
FlexAttention with the same mask ran 3-8x faster (docs/benchmarks.md, 2026-11-26). Forward and
backward (FlexAttention's own), grouped-query heads without expanding K/V.

The mask's tiles are the blocks where they are a multiple of 128 keys that tiles the padded
length, else FlexAttention's 128 x 128: a tile is listed where a block pair it holds is allowed on
or below the diagonal, and "full" (no mask_mod evaluated) where every pair in it is allowed and it
lies below the diagonal tile; elsewhere mask_mod reads the layout and causality. Compiled (CUDA),
where the tile lists are read and every tile lies in one block, a partial tile is a diagonal one:
for blocks of 256 the tiles and lists FlexAttention gets from the same layout in gpu_table's row
against it, whose mask_mod (causality) agrees with ours on every pair a compiled call evaluates it
on. (On an H200 in the eleventh session block_sparse's forward took 0.76 ms to FlexAttention's
0.39, with tiles of 128 and a mask_mod that read the layout on each partial tile.) Ours keeps the
layout in mask_mod because a compiled call may run eagerly, which ignores the lists.
Block sizes that tile a tile or that tiles tile (32, 64, 128, 256, ...) take this path; others keep
the block-by-block one. Lengths are padded to a power of two (one compile per bucket, as
ops/sparse_far_flex.py): a padded key is seen only by padded queries (causal), whose rows are
dropped. Compiled on CUDA, a function per bucket; elsewhere (tests, FLEX_ON widened) the eager
FlexAttention, which computes the same set from the same BlockMask. Heads narrower than its CUDA
kernel takes (16) keep the block-by-block path.
"""
from __future__ import annotations

import warnings

import torch

try:  # torch >= 2.5
    from torch.nn.attention import flex_attention as _flex
except ImportError:  # pragma: no cover - the package's oldest torch
    _flex = None

from . import sparse_far_flex  # where FlexAttention compiles, and each length bucket's compiled function
# FlexAttention's tile, length buckets, tile lists and the head widths its CUDA kernel takes
from .sparse_far_flex import TILE, length_bucket, takes_head_dim, tile_lists

FLEX_ON = ("cuda",)  # devices whose plain prefill runs here
# Shorter prefills keep the block-by-block path: there the first call of each length bucket would
# spend seconds compiling (forward and backward) to save little.
MIN_TOKENS = 4096
_FAILED: str | None = None  # why FlexAttention could not run in this process, once it failed
_MASKS: dict = {}  # (plan key, padded length) -> BlockMask: every layer of a model reuses the first's
_MAX_MASKS = 4  # (a per-head layout's mask at 128K tokens is hundreds of MB)


def applies(q, k, v, plain: bool, is_causal: bool, sliding_window, block_size: int) -> bool:
    return (_flex is not None and _FAILED is None and q.device.type in FLEX_ON and plain and is_causal
            and sliding_window is None and q.shape[2] == k.shape[2] and q.shape[2] >= MIN_TOKENS
            and (block_size % TILE == 0 or TILE % block_size == 0)
            and takes_head_dim(q.device, min(q.shape[-1], v.shape[-1])))


def _bucket(n: int) -> int:
    return max(TILE, length_bucket(n))


def block_mask(layout: torch.Tensor, n: int, block_size: int):
    """The BlockMask of `layout` (batch or 1, heads or 1, blocks, blocks) over n tokens padded to
    their bucket (module docstring). Blocks of a multiple of 128 that tile the bucket are its tiles
    (the tiles and lists dense attention's FlexAttention gets from the same layout: gpu_table's
    baseline). mask_mod reads the layout: a compiled call evaluates it on the partial tiles alone
    (there, where every tile lies in one block, the diagonal ones: causality), but FlexAttention's
    eager form evaluates it on every pair and ignores the lists, and a compiled call may run
    eagerly (`torch.compiler.set_stance("force_eager")`): with causality alone it read every
    earlier key."""
    padded = _bucket(n)
    tile = block_size if block_size % TILE == 0 and padded % block_size == 0 else TILE
    tiles = padded // tile
    blocks = -(-padded // block_size)
    b, h = layout.shape[0], layout.shape[1]
    rows, cols = min(layout.shape[2], blocks), min(layout.shape[3], blocks)  # (a custom layout may be wider)
    device = layout.device
    allowed = torch.zeros(b, h, blocks, blocks, dtype=torch.bool, device=device)
    allowed[..., :rows, :cols] = layout[..., :rows, :cols]
    if block_size % tile == 0:  # each block is r x r tiles
        r = block_size // tile
        some = every = allowed.repeat_interleave(r, 2).repeat_interleave(r, 3)[..., :tiles, :tiles]
    else:  # each tile is s x s blocks
        s = tile // block_size
        per_tile = allowed.view(b, h, tiles, s, tiles, s)
        some, every = per_tile.any(5).any(3), per_tile.all(5).all(3)
    q_tile = torch.arange(tiles, device=device)[:, None]
    kv_tile = torch.arange(tiles, device=device)[None, :]
    full = every & (kv_tile < q_tile)
    partial = some & (kv_tile <= q_tile) & ~full

    def mask_mod(b_idx, h_idx, q_idx, kv_idx):
        return allowed[b_idx if b > 1 else 0, h_idx if h > 1 else 0, q_idx // block_size, kv_idx // block_size] & (
            kv_idx <= q_idx)

    return _flex.BlockMask.from_kv_blocks(*tile_lists(partial), *tile_lists(full), BLOCK_SIZE=tile,
                                          mask_mod=mask_mod,
                                          seq_lengths=(padded, padded))


def _flex_block_sparse(*args, **kwargs):
    return _flex.flex_attention(*args, **kwargs)


def _flex_call(q, k, v, mask, scale: float, layout_key: tuple):
    """The FlexAttention call: compiled where sparse_far_flex compiles (CUDA), eager elsewhere. A
    code object per length bucket and per everything else dynamo would compile another graph for
    (dtypes, shapes, grad mode, scale, the mask's layout shape and block size: `layout_key`), so
    each holds one graph: past dynamo's limit of 8 per code object FlexAttention would run eagerly,
    the full N x N scores, with nothing said."""
    gqa = q.shape[1] != k.shape[1]
    if q.device.type not in sparse_far_flex.COMPILED_ON:
        return _flex.flex_attention(q, k, v, block_mask=mask, scale=scale, enable_gqa=gqa)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    key = (k.shape[2], q.dtype, tuple(q.shape), tuple(k.shape), v.shape[-1], grad, scale, layout_key)
    return sparse_far_flex.compiled_for_bucket(_flex_block_sparse, key)(q, k, v, block_mask=mask, scale=scale,
                                                                      enable_gqa=gqa)


def attention(q, k, v, layout, block_size: int, scale: float, key=None):
    """Shaped like q: the plain prefill's block-sparse attention in one FlexAttention call; None
    (nothing done) where FlexAttention failed to build here (warned once: the caller then takes
    the block-by-block path). `key`: the call's plan key (ops/block_sparse._plan_key), under which
    the BlockMask is kept (None: made for this call, as an adaptive layout's)."""
    global _FAILED
    n = q.shape[2]
    padded = _bucket(n)
    if padded > n:
        q, k, v = (torch.nn.functional.pad(t, (0, 0, 0, padded - n)) for t in (q, k, v))
    try:
        mask = None if key is None else _MASKS.get((key, padded))
        if mask is None:
            mask = block_mask(layout, n, block_size)
            if key is not None:
                if len(_MASKS) >= _MAX_MASKS:
                    _MASKS.clear()
                _MASKS[(key, padded)] = mask
        out = _flex_call(q, k, v, mask, scale, (tuple(layout.shape[:2]), block_size))
    except torch.OutOfMemoryError:
        raise
    except Exception as exc:  # a build failure of the compiled kernel
        _FAILED = f"{type(exc).__name__}: {exc}"
        warnings.warn(f"hf_dilated: FlexAttention failed here ({_FAILED[:500]}); block_sparse takes its "
                      "block-by-block path from now on (correct, but slower on a GPU)", RuntimeWarning, stacklevel=3)
        return None
    return out[:, :, :n]
