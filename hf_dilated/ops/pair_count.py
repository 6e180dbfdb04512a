"""Counting the (query, key) pairs a kernel reads, exactly, from the masks it computes with: what
`hf-dilated eval` reports beside loss (pairs read / dense causal pairs). Off by default: a count
reads a sum back to the host, so the kernels count only inside `counting()`."""
from __future__ import annotations

from contextlib import contextmanager

import torch


class _Tally:
    def __init__(self):
        self.active = False
        self.pairs = 0  # (query head, query, key) triples read
        self.counted_calls = 0  # attention calls that counted (0: the path read nothing it could count)


TALLY = _Tally()


@contextmanager
def counting():
    """Count the pairs every counting kernel reads inside the block: yields the tally (its `pairs`
    and `counted_calls` are read after the block)."""
    if TALLY.active:
        raise RuntimeError("counting(): already counting")
    TALLY.active, TALLY.pairs, TALLY.counted_calls = True, 0, 0
    try:
        yield TALLY
    finally:
        TALLY.active = False


def add(read: torch.Tensor, n_heads: int) -> None:
    """Add the pairs of a bool mask (batch, heads or 1, queries, keys) read by `n_heads` heads."""
    if TALLY.active:
        TALLY.pairs += int(read.sum()) * (n_heads // read.shape[1])


def add_call() -> None:
    if TALLY.active:
        TALLY.counted_calls += 1
