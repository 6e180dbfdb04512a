"""The ring's pattern hooks (distributed/ring.py RingPattern), checked on plans alone: no process group."""
from __future__ import annotations

from dataclasses import fields

import pytest
import torch

from hf_dilated.distributed.block_sparse_ring import BlockSparsePattern
from hf_dilated.distributed.dilated_ring import DilatedPattern, level_codes
from hf_dilated.distributed.layout import shard_indices
from hf_dilated.distributed.ring import RingPattern, ring_plan
from hf_dilated.distributed.tokens import GlobalTokens
from hf_dilated.ops.block_patterns import make_pattern
from hf_dilated.ops.token_layout import visible_pairs
from hf_dilated.ops.token_layout import TokenLayout, token_layout

N = 256


def tokens_of(world, rank, layout, attention_mask=None, position_ids=None, batch=1):
    rule = token_layout(batch, N, torch.device("cpu"), attention_mask=attention_mask, position_ids=position_ids)
    return GlobalTokens(**{f.name: getattr(rule, f.name) for f in fields(TokenLayout)},
                        local_index=shard_indices(N, world, rank, layout), world=world, rank=rank, layout=layout)


def inputs():
    """Padding with a hole, and two packed documents in the second row."""
    mask = torch.ones(2, N, dtype=torch.long)
    mask[0, 40:50] = 0
    mask[1, 200:] = 0
    positions = torch.stack([torch.arange(N), torch.cat([torch.arange(100), torch.arange(N - 100)])])
    return {"plain": {}, "padded": {"attention_mask": mask},
            "packed": {"attention_mask": mask, "position_ids": positions}}


def brute_force_visible(tokens, window):
    """(batch, N, N): the base rule written pair by pair."""
    i, j = torch.arange(N)[:, None], torch.arange(N)[None, :]
    same_doc = tokens.doc[:, :, None] == tokens.doc[:, None, :]
    visible = tokens.real[:, None, :] & same_doc & (j <= i)
    return visible & (j > i - window) if window is not None else visible


@pytest.mark.parametrize("case", list(inputs()))
@pytest.mark.parametrize("window", [None, 37])
def test_visible_pairs_is_the_base_rule(case, window):
    tokens = tokens_of(2, 0, "contiguous", batch=2, **inputs()[case])
    index = torch.arange(N)
    assert torch.equal(visible_pairs(tokens, index, index, sliding_window=window)[:, 0],
                       brute_force_visible(tokens, window))
    # per head indices: each head's own rows and keys
    qi, kj = torch.randperm(N)[:64], torch.randperm(N)[:48]
    per_head = visible_pairs(tokens, qi.expand(2, 3, 64), kj.expand(2, 3, 48), sliding_window=window)
    assert torch.equal(per_head, visible_pairs(tokens, qi, kj, sliding_window=window).expand(2, 3, 64, 48))


@pytest.mark.parametrize("case", list(inputs()))
@pytest.mark.parametrize("layout,world", [("zigzag", 2), ("contiguous", 4)])
@pytest.mark.parametrize("window", [None, 37])
def test_dense_plan_computes_every_visible_pair_once(case, layout, world, window):
    """The plan of the dense pattern: over all ranks, hops and pieces, each pair the base rule lets
    through is in exactly one call, unmasked there, and no other pair is."""
    count = torch.zeros(2, N, N, dtype=torch.long)
    for rank in range(world):
        tokens = tokens_of(world, rank, layout, batch=2, **inputs()[case])
        plan = ring_plan(RingPattern(tokens, window), kv_tiles=8)
        for j, (a, b) in enumerate(plan.tiles):
            for t, pieces in enumerate(plan.steps[j]):
                kj = tokens.rank_index((rank - t) % world)[a:b]
                for piece in pieces:
                    qi = tokens.local_index[piece.rows]
                    bias, _ = piece.mask(torch.float32)
                    if bias is not None:
                        seen = (bias == 0)[:, 0]
                    else:
                        seen = torch.ones(len(qi), len(kj), dtype=torch.bool)
                        seen = seen.tril(int(kj[0]) - int(qi[0])) if piece.is_causal else seen
                    count[:, qi[:, None], kj[None, :]] += seen.expand(2, -1, -1).long()
    assert torch.equal(count, brute_force_visible(tokens, window).long())


@pytest.mark.parametrize("mode", ["union", "head_groups", "longnet"])
@pytest.mark.parametrize("case", list(inputs()))
def test_dilated_needed_keys_are_the_keys_of_the_pattern(mode, case):
    """DilatedPattern.needed_keys, read from the levels' codes: exactly the keys the pattern's
    weight and the base rule let some query of the set see, per kv head."""
    q_heads, kv_heads = 8, 2
    tokens = tokens_of(2, 1, "zigzag", batch=2, **inputs()[case])
    levels = level_codes(tokens, q_heads, [16, 64, 256], [1, 2, 8], mode)
    pattern = DilatedPattern(tokens, None, levels=levels, mode=mode, kv_heads=kv_heads)
    index = torch.arange(N)
    pairs = (pattern.weight(index, index) != 0) & pattern.visible(index, index)  # (batch, q_heads, N, N)
    for queries in (tokens.local_index[:32], tokens.local_index, torch.arange(100, 140)):
        want = pairs[:, :, queries].any(2).unflatten(1, (kv_heads, -1)).any(2)
        assert torch.equal(pattern.needed_keys(queries), want)


BLOCK_PATTERNS = {"local": {"type": "local", "window": 2}, "dilated": {"type": "dilated", "window": 2, "stride": 3},
                  "global_local": {"type": "global_local", "global_blocks": 1, "window": 2},
                  "hierarchical": {"type": "hierarchical", "levels": [[1, 2], [2, 5]]}}


@pytest.mark.parametrize("name", [*BLOCK_PATTERNS, "custom"])
@pytest.mark.parametrize("case", list(inputs()))
def test_block_sparse_needed_keys_are_the_keys_of_the_pattern(name, case):
    """BlockSparsePattern.needed_keys: exactly the keys the layout and the base rule let some query
    of the set see, per kv head (a per-head custom layout too)."""
    q_heads, kv_heads, block_size = 8, 2, 8
    tokens = tokens_of(2, 1, "zigzag", batch=2, **inputs()[case])
    if name == "custom":
        blocks = N // block_size
        spec = {"type": "custom", "layout": torch.rand(q_heads, blocks, blocks, generator=torch.Generator().manual_seed(0)) < 0.3}
    else:
        spec = BLOCK_PATTERNS[name]
    pattern = BlockSparsePattern(tokens, None, block_pattern=make_pattern(spec), block_size=block_size,
                                 q_heads=q_heads, kv_heads=kv_heads)
    index = torch.arange(N)
    pairs = pattern.weight(index, index) & pattern.visible(index, index)  # (batch, heads, N, N)
    for queries in (tokens.local_index[:32], tokens.local_index, torch.arange(100, 140)):
        want = pairs[:, :, queries].any(2).expand(-1, q_heads, -1).unflatten(1, (kv_heads, -1)).any(2)
        assert torch.equal(pattern.needed_keys(queries), want)


def test_block_sparse_ring_plans_in_memory_of_the_layout_not_tokens_times_blocks():
    """The keys a rank's queries need were found through a (tokens x blocks) tensor: at a million
    tokens in blocks of 64, 16 G entries (2026-11-28: 0.97 GB of peak memory at 64K tokens, 0.48 s).
    Now nothing the plan makes is larger than the (blocks x blocks) layout or the (batch, kv heads,
    tokens) answer."""
    n, block_size, kv_heads = 65536, 64, 2
    rule = token_layout(1, n, torch.device("cpu"))
    tokens = GlobalTokens(**{f.name: getattr(rule, f.name) for f in fields(TokenLayout)},
                          local_index=shard_indices(n, 2, 0, "zigzag"), world=2, rank=0, layout="zigzag")
    pattern = BlockSparsePattern(tokens, None, block_pattern=make_pattern(BLOCK_PATTERNS["global_local"]),
                                 block_size=block_size, q_heads=8, kv_heads=kv_heads)
    from conftest import LargestTensor

    with LargestTensor() as largest:
        need = pattern.needed_keys(tokens.local_index)
    # rank 0 holds the first and last quarters: their keys, and the block before the last quarter
    assert int(need.sum()) == kv_heads * (n // 2 + block_size)
    assert largest.entries <= max(kv_heads * n, (n // block_size) ** 2)
