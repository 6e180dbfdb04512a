"""Sparse far keys (docs/contract.md 4.2): which far keys of a local band a query reads.

The band's far keys (docs/contract.md 4.1) are cut into blocks of `block_size` positions of their
document (block c holds positions c * B .. c * B + B - 1). A query reads the far keys of the first
`sinks` blocks of its document always (the attention sinks a pretrained model leans on) and of the
`top_k` other blocks that score highest for its *query block* (the block of its own position).
The score of block c is Quest's bound (Tang et al., 2024) with the far projections (k_far) of
every real key of the block just before the query block (its *scoring block*) as the queries: with mn, mx the elementwise min and max of
block c's far keys, max_j x . k_j <= sum_d max(x_d mn_d, x_d mx_d) = relu(x) . mx + min(x, 0) . mn,
and the score is the largest of these over the scoring block's far keys x.

Why the keys before the query block and not the query itself. Every query of a block then shares
one choice (per kv head), so a prefill reads each block's chosen keys in one dense call, with no
union of per-query choices (with a choice per query, 64 neighbouring queries chose 38 blocks on
average on SmolLM2, and the union cost more than dense attention on the CPU: docs/benchmarks.md);
and those keys are in the cache, so a decode step or a chunk computes the same choice with no
state carried between calls. Ties go to the lower block number, so the number of blocks read
is fixed (top_k, or every candidate when fewer): the inference path (sparse_far_plain) gathers
them with static shapes and no read back to the host. It is not differentiated (like the
`adaptive` block pattern): the attention over the chosen keys is.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..checks import check_int
from .merge import merge_dtype


@dataclass(frozen=True)
class FarSelection:
    """The selection of far keys (DilatedConfig.far_top_k, far_block_size, far_sinks)."""

    top_k: int
    block_size: int
    sinks: int

    def __post_init__(self):
        check_int("far_top_k", self.top_k, minimum=0)
        check_int("far_block_size", self.block_size)
        check_int("far_sinks", self.sinks, minimum=0)


def band_widths(query_positions: torch.Tensor, local_window: int, far_band: int | None) -> torch.Tensor:
    """The band width of each query (docs/contract.md 4.2): `local_window` for a query at a position
    before it (its band holds its whole document: it reads as the model was trained), `far_band`
    (default `local_window`) for the others."""
    if far_band is None or far_band == local_window:
        return torch.full_like(query_positions, local_window)
    return torch.where(query_positions < local_window, local_window, far_band)


@dataclass
class Blocks:
    """The far blocks of a layout: id[b, j] the block of key j in its row (-1: padding), blocks
    numbered per row in key order; number[b, c] its block number within its document (position // B)."""

    id: torch.Tensor  # (batch, kv_len) int64
    number: torch.Tensor  # (batch, n_blocks) int64; -1 past the row's last block
    count: int  # n_blocks: the most blocks of any row
    scoring: torch.Tensor | None = None  # (batch, n_blocks): the id of each block's scoring block, -1: none


def blocks_of(positions: torch.Tensor, real: torch.Tensor, doc: torch.Tensor, block_size: int) -> Blocks:
    """The blocks of every key (one read of the block count to the host)."""
    number = torch.div(positions, block_size, rounding_mode="floor")
    # A real key starts a block when its (document, number) differs from the last real key's before
    # it: padding neither starts nor ends one (positions advance within a document, 3.1).
    key = number * (int(doc.max()) + 1 if doc.numel() else 1) + doc
    index = torch.arange(real.shape[1], device=real.device).expand_as(key)
    last_real = torch.where(real, index, -1).cummax(1).values
    before = torch.cat([torch.full_like(last_real[:, :1], -1), last_real[:, :-1]], 1)
    prev = torch.where(before >= 0, key.gather(1, before.clamp(min=0)), -1)
    new = real & ((key != prev) | (before < 0))
    ids = new.long().cumsum(1) - 1
    ids = torch.where(real, ids, -1)
    count = int(ids.max()) + 1 if ids.numel() else 0
    count = max(count, 1)
    at = torch.where(real, ids, count)
    numbers = torch.full((key.shape[0], count + 1), -1, dtype=torch.long, device=key.device)
    numbers.scatter_(1, at, torch.where(real, number, -1))
    docs = torch.full_like(numbers, -1).scatter_(1, at, torch.where(real, doc, -1))[:, :count]
    # A block's scoring block: the block before it in its document (ids follow key order, so the
    # previous id, when it is of the same document).
    own = torch.arange(count, device=key.device)
    before = torch.cat([torch.full_like(docs[:, :1], -2), docs[:, :-1]], 1)
    scoring = torch.where((docs >= 0) & (before == docs), own - 1, -1)
    return Blocks(ids, numbers[:, :count], count, scoring)


def bound_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype every path computes summaries and bounds in (float64 inputs: float64, else float32),
    so that they rank blocks alike."""
    return merge_dtype(dtype)


def summaries(k_far: torch.Tensor, blocks: Blocks) -> tuple[torch.Tensor, torch.Tensor]:
    """(mn, mx), each (batch, kv_heads, n_blocks, head_dim) in bound_dtype: the elementwise min and
    max of each block's far keys (rows of blocks past a row's last: +inf / -inf, never selected)."""
    batch, kv_heads, _, dim = k_far.shape
    dtype = bound_dtype(k_far.dtype)
    n = blocks.count
    index = torch.where(blocks.id >= 0, blocks.id, n)[:, None, :, None].expand(batch, kv_heads, -1, dim)
    src = k_far.to(dtype)
    mn = torch.full((batch, kv_heads, n + 1, dim), float("inf"), dtype=dtype, device=k_far.device)
    mx = torch.full((batch, kv_heads, n + 1, dim), float("-inf"), dtype=dtype, device=k_far.device)
    mn.scatter_reduce_(2, index, src, "amin")
    mx.scatter_reduce_(2, index, src, "amax")
    return mn[:, :, :n], mx[:, :, :n]


def bounds(q_far: torch.Tensor, mn: torch.Tensor, mx: torch.Tensor) -> torch.Tensor:
    """(batch, q_heads, queries, n_blocks): Quest's bound on each query's best score in each block
    (blocks with no key: -inf)."""
    group = q_far.shape[1] // mn.shape[1]
    q = q_far.to(mn.dtype)
    mx_h = mx.repeat_interleave(group, 1) if group > 1 else mx
    mn_h = mn.repeat_interleave(group, 1) if group > 1 else mn
    empty = torch.isinf(mx_h[..., 0])  # no key in the block
    up = q.clamp(min=0) @ mx_h.nan_to_num(neginf=0.0).transpose(-1, -2) \
        + q.clamp(max=0) @ mn_h.nan_to_num(posinf=0.0).transpose(-1, -2)
    return up.masked_fill(empty[:, :, None, :], float("-inf"))


def select(score: torch.Tensor, candidate: torch.Tensor, top_k: int) -> torch.Tensor:
    """bool like `candidate` (..., n_blocks): the top_k candidates by score, ties to the lower
    block (every candidate when there are at most top_k)."""
    k = min(top_k, score.shape[-1])
    if k == 0:
        return torch.zeros_like(candidate)
    ranked = score.masked_fill(~candidate, float("-inf")).expand(candidate.shape)
    top = torch.sort(ranked, dim=-1, descending=True, stable=True).indices[..., :k]
    return torch.zeros_like(candidate).scatter_(-1, top, True) & candidate


# Key rows per step of scores_of_rows: its bounds are (batch, kv_heads, rows, n_blocks) floats.
_SCORE_ROWS = 4096


def block_scores(rows: torch.Tensor, mn: torch.Tensor, mx: torch.Tensor) -> torch.Tensor:
    """(batch, kv_heads, n_blocks): the score of each block for the scoring block whose far keys are
    `rows` (batch, kv_heads, n, head_dim): the largest bound over them (no row: -inf)."""
    return bounds(rows, mn, mx).amax(2) if rows.shape[2] else mn.new_full(mn.shape[:3], float("-inf"))


def all_block_scores(k_far: torch.Tensor, blocks: Blocks, mn: torch.Tensor, mx: torch.Tensor) -> torch.Tensor:
    """(batch, kv_heads, n_blocks + 1, n_blocks): row r the scores of every block for scoring block
    r (block_scores of its far keys), and a last row of zeros for a query with no scoring block."""
    rows = torch.arange(blocks.count, device=k_far.device).expand(k_far.shape[0], -1)
    out = scores_of_rows(k_far, blocks.id, rows, mn, mx)
    return torch.cat([out, torch.zeros_like(out[:, :, :1])], 2)


def scores_of_rows(k_far: torch.Tensor, key_block: torch.Tensor, rows: torch.Tensor, mn: torch.Tensor,
                   mx: torch.Tensor) -> torch.Tensor:
    """(batch, kv_heads, m, n_blocks): for the blocks `rows` (batch, m; -1: none) as scoring blocks,
    the largest bound over those of their far keys given here (k_far with key_block (batch, keys)
    their block ids, -1: padding) against every block; -inf where none is given (the maximum over
    several parts of a block's keys is then the maximum of their results)."""
    batch, kv_heads, kv_len, _ = k_far.shape
    n, m = mn.shape[2], rows.shape[1]
    slot = torch.full((batch, n + 1), m, dtype=torch.long, device=k_far.device)  # block id -> row slot
    slot.scatter_(1, torch.where(rows >= 0, rows, n), torch.arange(m, device=k_far.device).expand(batch, m))
    slot[:, n] = m
    out = mn.new_full((batch, kv_heads, m + 1, n), float("-inf"))
    for s in range(0, kv_len, _SCORE_ROWS):
        e = min(kv_len, s + _SCORE_ROWS)
        at = slot.gather(1, torch.where(key_block[:, s:e] >= 0, key_block[:, s:e], n))  # m: not wanted
        bound = bounds(k_far[:, :, s:e].to(mn.dtype), mn, mx)  # (batch, kv_heads, keys, n)
        out.scatter_reduce_(2, at[:, None, :, None].expand_as(bound), bound, "amax")
    return out[:, :, :m]


def query_scores(scores: torch.Tensor, blocks: Blocks, key_index: torch.Tensor) -> torch.Tensor:
    """(batch, kv_heads, queries, n_blocks): the scores (all_block_scores) each query reads, the
    query being the token at `key_index` (queries,) of the keys: its own block's scoring block's
    row (none, or padding: zeros)."""
    own = blocks.id[:, key_index]  # (batch, queries)
    row = torch.where(own >= 0, blocks.scoring.gather(1, own.clamp(min=0)), -1)
    row = torch.where(row >= 0, row, blocks.count)
    index = row[:, None, :, None].expand(-1, scores.shape[1], -1, scores.shape[-1])
    return scores.gather(2, index)
