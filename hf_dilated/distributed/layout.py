"""How a global sequence is laid out over the ranks of a sequence-parallel group.

The sequence is cut into equal chunks:
- "contiguous": P chunks, rank r holds chunk r. Simple, but under causal attention the last rank
  does P times the work of the first.
- "zigzag" (the default): 2P chunks, rank r holds chunks r and 2P-1-r, in that order. Every rank
  then holds one early and one late chunk, so the causal work is balanced.

Local shards always keep their tokens in increasing global order. The sequence length must be a
multiple of P (contiguous) or 2P (zigzag); `padded_length` gives the length to pad to.
"""
from __future__ import annotations

import torch

# The one list of layouts and its check are hf_dilated.config's (RING_LAYOUTS, DEFAULT_RING_LAYOUT).
from ..config import check_ring_layout as check_layout  # ValueError naming `layout` unless in RING_LAYOUTS


def chunks_per_rank(layout: str) -> int:
    check_layout(layout)
    return 2 if layout == "zigzag" else 1


def rank_chunks(layout: str, world: int, rank: int) -> list[int]:
    """Global chunk numbers held by `rank`, in increasing order."""
    check_layout(layout)
    return [rank, 2 * world - 1 - rank] if layout == "zigzag" else [rank]


def padded_length(seq_len: int, world: int, layout: str) -> int:
    """The smallest length >= seq_len that the layout can split evenly over `world` ranks."""
    unit = world * chunks_per_rank(layout)
    return -(-seq_len // unit) * unit


def shard_indices(seq_len: int, world: int, rank: int, layout: str, device=None) -> torch.Tensor:
    """Global token indices held by `rank` (int64, increasing). seq_len must divide evenly."""
    n_chunks = world * chunks_per_rank(layout)
    if seq_len % n_chunks:
        raise ValueError(
            f"sequence length {seq_len} must be a multiple of {n_chunks} for layout {layout!r} over "
            f"{world} ranks; pad it (shard_batch does) to padded_length() = {padded_length(seq_len, world, layout)}"
        )
    c = seq_len // n_chunks
    return torch.cat([torch.arange(i * c, (i + 1) * c, device=device) for i in rank_chunks(layout, world, rank)])


def global_order(seq_len: int, world: int, layout: str, device=None) -> torch.Tensor:
    """Global index of every token of the rank-major concatenation of all shards (rank 0's shard,
    then rank 1's...). `x_global[..., order] = cat(shards)` rebuilds the sequence."""
    return torch.cat([shard_indices(seq_len, world, r, layout, device) for r in range(world)])


def shard(x: torch.Tensor, world: int, rank: int, layout: str, dim: int = 1) -> torch.Tensor:
    """The slice of the global tensor `x` (sequence along `dim`) that `rank` holds."""
    return x.index_select(dim, shard_indices(x.shape[dim], world, rank, layout, x.device))


def unshard(shards: list[torch.Tensor], layout: str, dim: int = 1) -> torch.Tensor:
    """Inverse of `shard`: the global tensor from every rank's shard (a list in rank order)."""
    world = len(shards)
    cat = torch.cat(shards, dim=dim)
    order = global_order(cat.shape[dim], world, layout, cat.device)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return cat.index_select(dim, inverse)
