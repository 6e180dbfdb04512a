"""Exact counts of the (query, key) pairs each attention pattern computes, for the benchmark's
"useful pairs per second".

All counts are for one prefill (q_len == kv_len == n), one document, no padding, causal, summed
over the query heads; multiply by the batch size. They follow docs/contract.md directly:

- dense causal: n (n + 1) / 2 per head;
- dilated "longnet": the multiset sum of |V_g(h, i)| over levels;
- dilated "head_groups": |V_g(h, i)| for the level g of the head's group;
- dilated "union": |union over g of V_g(h, i)|, counted per query in O(n) using the nesting that
  "union" requires: selection is nested (a token selected at level g is selected at every lower
  level), so the levels a query is selected at form a prefix 1..g*, and the keys V_g adds beyond
  the lower levels are exactly those outside the query's own level-(g-1) segment;
- a block layout: every allowed (query block, key block) pair, causal within the diagonal block.

tests/test_bench.py checks every count against a brute-force evaluation of docs/contract.md's sets.
"""
from __future__ import annotations

import numpy as np


def dense_pair_count(n: int, num_heads: int) -> int:
    return num_heads * n * (n + 1) // 2


def _selected_in(length: int, offset: int, rate: int) -> int:
    """How many local indices t in [0, length) have t % rate == offset."""
    return max(0, (length - offset + rate - 1) // rate)


def _level_pairs(n: int, w: int, r: int, offset: int) -> int:
    """sum_i |V_g(h, i)| for one level: causal pairs among the selected tokens of each segment."""
    full, tail = divmod(n, w)
    m_full = _selected_in(w, offset, r)
    m_tail = _selected_in(tail, offset, r)
    return full * m_full * (m_full + 1) // 2 + m_tail * (m_tail + 1) // 2


def head_groups_sizes(num_heads: int, num_levels: int) -> list[int]:
    """Contiguous groups as equal as possible, the earlier groups taking the extra heads
    (docs/contract.md 4)."""
    base, extra = divmod(num_heads, num_levels)
    return [base + (1 if g < extra else 0) for g in range(num_levels)]


def dilated_pair_count(n: int, num_heads: int, segment_lengths, dilation_rates, mode: str = "union") -> int:
    seg, dil = list(segment_lengths), list(dilation_rates)
    if mode == "longnet":
        return sum(_level_pairs(n, w, r, h % r) for h in range(num_heads) for w, r in zip(seg, dil))
    if mode == "head_groups":
        total, h = 0, 0
        for g, size in enumerate(head_groups_sizes(num_heads, len(seg))):
            for _ in range(size):
                total += _level_pairs(n, seg[g], dil[g], h % dil[g])
                h += 1
        return total
    if mode == "union":
        return sum(_union_pairs_one_head(n, seg, dil, h) for h in range(num_heads))
    raise ValueError(f"mode must be one of 'union', 'longnet', 'head_groups', got {mode!r}")


def _count_congruent(lo, hi, offset: int, rate: int):
    """Elementwise count of t in [lo, hi] with t % rate == offset (numpy int arrays; hi >= lo - 1)."""
    return (hi - offset) // rate - (lo - 1 - offset) // rate


def _union_pairs_one_head(n: int, seg: list[int], dil: list[int], h: int) -> int:
    for g in range(1, len(seg)):
        if seg[g] % seg[g - 1] or dil[g] % dil[g - 1]:
            raise ValueError("union counting needs nested levels, as mode 'union' itself does")
    i = np.arange(n, dtype=np.int64)
    active = np.ones(n, dtype=bool)  # selected at every level so far
    total = 0
    for g, (w, r) in enumerate(zip(seg, dil)):
        o = h % r
        t = i % w
        active &= (t % r) == o
        if not active.any():
            break
        seen_here = t // r + 1  # |V_g(h, i)|: selected keys at or before i in i's level-g segment
        if g > 0:
            # Keys of V_g inside i's own level-(g-1) segment are already in V_{g-1}.
            seen_here = seen_here - _count_congruent(t - i % seg[g - 1], t, o, r)
        total += int(seen_here[active].sum())
    return total


def layout_pair_count(n: int, block_size: int, layout) -> int:
    """Pairs of a block layout (heads or 1, query_blocks, key_blocks), causal, one document.

    `layout` may carry a leading batch dimension; the count is then summed over it. A layout with
    one head is counted once: multiply by the number of heads when it is broadcast over heads.
    """
    lay = np.asarray(layout.cpu() if hasattr(layout, "cpu") else layout, dtype=bool)
    blocks = -(-n // block_size)
    lay = lay[..., :blocks, :blocks]
    sizes = np.minimum(block_size, n - np.arange(blocks) * block_size).astype(np.int64)
    pair = np.tril(np.outer(sizes, sizes), k=-1) + np.diag(sizes * (sizes + 1) // 2)
    return int((lay * pair).sum())
