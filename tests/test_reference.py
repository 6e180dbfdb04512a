"""Sanity of the float64 reference itself: hand-enumerated K sets, and agreement with sdpa where
docs/contract.md says the variants reduce to dense causal attention."""
import pytest
import torch
import torch.nn.functional as F

from reference import (
    attention_from_counts,
    base_visible,
    block_sparse_reference,
    dense_causal_reference,
    dilated_key_counts,
    dilated_reference,
    head_groups,
    token_positions,
)


def sets_of(counts):
    """counts (heads, q_len, kv_len) -> {head: [ {key: count} per query ]}"""
    return {
        h: [{j: int(c) for j, c in enumerate(row) if c} for row in counts[h]]
        for h in range(counts.shape[0])
    }


# 6 tokens at positions 0..5, segment_lengths=[2, 4], dilation_rates=[1, 2], two heads.
# Level 1 (w=2, r=1): segments {0,1} {2,3} {4,5}, every token selected.
# Level 2 (w=4, r=2): segments {0..3} {4,5}; head 0 selects positions 0,2,4; head 1 selects 1,3,5.
LEVEL1 = [{0: 1}, {0: 1, 1: 1}, {2: 1}, {2: 1, 3: 1}, {4: 1}, {4: 1, 5: 1}]
LEVEL2 = {
    0: [{0: 1}, {}, {0: 1, 2: 1}, {}, {4: 1}, {}],
    1: [{}, {1: 1}, {}, {1: 1, 3: 1}, {}, {5: 1}],
}
HAND = {
    "union": {
        0: [{0: 1}, {0: 1, 1: 1}, {0: 1, 2: 1}, {2: 1, 3: 1}, {4: 1}, {4: 1, 5: 1}],
        1: [{0: 1}, {0: 1, 1: 1}, {2: 1}, {1: 1, 2: 1, 3: 1}, {4: 1}, {4: 1, 5: 1}],
    },
    "longnet": {
        0: [{0: 2}, {0: 1, 1: 1}, {0: 1, 2: 2}, {2: 1, 3: 1}, {4: 2}, {4: 1, 5: 1}],
        1: [{0: 1}, {0: 1, 1: 2}, {2: 1}, {1: 1, 2: 1, 3: 2}, {4: 1}, {4: 1, 5: 2}],
    },
    # two heads, two groups: head 0 uses level 1 alone, head 1 level 2 alone.
    "head_groups": {0: LEVEL1, 1: LEVEL2[1]},
}


@pytest.mark.parametrize("mode", ["union", "longnet", "head_groups"])
def test_hand_enumerated_six_tokens(mode):
    counts = dilated_key_counts([2, 4], [1, 2], mode, q_heads=2, batch=1, q_len=6, kv_len=6)
    assert sets_of(counts[0]) == HAND[mode]


def test_hand_enumerated_single_levels():
    assert sets_of(dilated_key_counts([2], [1], "union", 2, 1, 6, 6)[0]) == {0: LEVEL1, 1: LEVEL1}
    assert sets_of(dilated_key_counts([4], [2], "union", 2, 1, 6, 6)[0]) == LEVEL2


def test_hand_enumerated_packed_documents_not_on_segment_boundary():
    # Documents A (positions 5,6,7 at tokens 0-2) and B (positions 0,1,2 at tokens 3-5); w=4, r=2.
    # Segments: positions 5,6,7 -> segment 1; 0,1,2 -> segment 0. Head 0 selects positions with
    # (p mod 4) mod 2 == 0 -> 6, 0, 2; head 1 selects 5, 7, 1.
    pos = torch.tensor([[5, 6, 7, 0, 1, 2]])
    counts = dilated_key_counts([4], [2], "union", 2, 1, 6, 6, position_ids=pos)
    assert sets_of(counts[0]) == {
        0: [{}, {1: 1}, {}, {3: 1}, {}, {3: 1, 5: 1}],
        1: [{0: 1}, {}, {0: 1, 2: 1}, {}, {4: 1}, {}],
    }


def test_hand_enumerated_union_rate_not_dividing_lower_segment():
    # w=[4, 8], r=[1, 8], 8 tokens, one head (offset 0 at both levels): level 2 selects only
    # position 0, so it adds key 0 to query 0 only, which level 1 already has.
    counts = dilated_key_counts([4, 8], [1, 8], "union", 1, 1, 8, 8)
    level1 = dilated_key_counts([4], [1], "union", 1, 1, 8, 8)
    assert torch.equal(counts, level1)
    # Head 1 of 2: level 2 selects position 1 only; level 1 gives every head the full w=4 block.
    counts2 = dilated_key_counts([4, 8], [1, 8], "longnet", 2, 1, 8, 8)
    assert sets_of(counts2[0])[1][1] == {0: 1, 1: 2}
    assert sets_of(counts2[0])[1][5] == {4: 1, 5: 1}


def test_token_positions_and_documents():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0]])
    tp = token_positions(mask, None, 2, 5)
    assert tp.positions.tolist() == [[-1, -1, 0, 1, 2], [0, 1, 2, 2, 2]]
    assert tp.real.tolist() == [[False, False, True, True, True], [True, True, True, False, False]]
    pos = torch.tensor([[0, 1, 0, 1, 2], [5, 6, 7, 8, 0]])
    tp = token_positions(None, pos, 2, 5)
    assert tp.doc.tolist() == [[0, 0, 1, 1, 1], [0, 0, 0, 0, 1]]
    assert token_positions(None, None, 1, 4).positions.tolist() == [[0, 1, 2, 3]]


def test_base_visible_hand():
    pos = torch.tensor([[0, 1, 2, 0, 1]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    vis = base_visible(mask, pos, 1, 5, 5)[0].int().tolist()
    assert vis == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [0, 0, 0, 1, 0],
        [0, 0, 0, 1, 0],  # padded key 4 is never visible, not even to itself
    ]
    # q_len < kv_len: the queries are the last tokens.
    assert base_visible(None, None, 1, 2, 4)[0].int().tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]


def test_head_groups_split():
    assert head_groups(5, 2) == [0, 0, 0, 1, 1]
    assert head_groups(7, 3) == [0, 0, 0, 1, 1, 2, 2]
    assert head_groups(4, 4) == [0, 1, 2, 3]
    assert head_groups(2, 3) == [0, 1]


def _qkv(b, hq, hk, n, d, seed=0, q_len=None):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, q_len or n, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, hk, n, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, hk, n, d, generator=g, dtype=torch.float64)
    return q, k, v


def test_dense_matches_sdpa_causal_gqa():
    q, k, v = _qkv(2, 6, 2, 37, 8)
    ref = dense_causal_reference(q, k, v)
    sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(ref, sdpa, atol=1e-12, rtol=0)
    # dilated with one segment covering everything and rate 1 is dense causal attention.
    torch.testing.assert_close(dilated_reference(q, k, v, [64], [1]), sdpa, atol=1e-12, rtol=0)
    torch.testing.assert_close(dilated_reference(q, k, v, [37], [1], "longnet"), sdpa, atol=1e-12, rtol=0)


def test_dense_matches_sdpa_with_scale_and_decode():
    q, k, v = _qkv(1, 2, 2, 20, 8, q_len=3)
    ref = dense_causal_reference(q, k, v, scale=0.37)
    # queries are the last 3 tokens: bottom-right aligned causal mask
    mask = torch.ones(3, 20, dtype=torch.bool).tril(diagonal=17)
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.37)
    torch.testing.assert_close(ref, sdpa, atol=1e-12, rtol=0)


def test_dense_packed_documents_match_per_document_sdpa():
    q, k, v = _qkv(1, 2, 1, 11, 8)
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 0, 1]])
    ref = dense_causal_reference(q, k, v, position_ids=pos)
    for lo, hi in [(0, 4), (4, 9), (9, 11)]:
        part = F.scaled_dot_product_attention(
            q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi], is_causal=True, enable_gqa=True
        )
        torch.testing.assert_close(ref[:, :, lo:hi], part, atol=1e-12, rtol=0)


@pytest.mark.parametrize("mode", ["union", "longnet", "head_groups"])
def test_padding_does_not_change_real_tokens(mode):
    q, k, v = _qkv(1, 4, 2, 13, 8)
    plain = dilated_reference(q, k, v, [4, 8], [1, 2], mode)
    pad = 5
    qp, kp, vp = (torch.cat([torch.randn(1, t.shape[1], pad, 8, dtype=torch.float64), t], 2) for t in (q, k, v))
    mask = torch.cat([torch.zeros(1, pad), torch.ones(1, 13)], 1).long()
    left = dilated_reference(qp, kp, vp, [4, 8], [1, 2], mode, attention_mask=mask)
    torch.testing.assert_close(left[:, :, pad:], plain, atol=1e-12, rtol=0)
    qr, kr, vr = (torch.cat([t, torch.randn(1, t.shape[1], pad, 8, dtype=torch.float64)], 2) for t in (q, k, v))
    right = dilated_reference(qr, kr, vr, [4, 8], [1, 2], mode, attention_mask=mask.flip(-1))
    torch.testing.assert_close(right[:, :, :13], plain, atol=1e-12, rtol=0)


def test_longnet_is_denominator_weighted_mix_of_levels():
    # docs/contract.md 4: each level is an attention of its own, combined with weights proportional to
    # their softmax denominators. Rebuild that independently from per-level outputs.
    q, k, v = _qkv(1, 2, 2, 16, 8)
    scale = 8 ** -0.5
    outs, dens = [], []
    for w, r in [(4, 1), (8, 2), (16, 4)]:
        c = dilated_key_counts([w], [r], "union", 2, 1, 16, 16).double()
        e = c * torch.exp(scale * q @ k.transpose(-1, -2))
        den = e.sum(-1, keepdim=True)
        outs.append((e @ v) / den.clamp_min(1e-300))
        dens.append(den)
    mixed = sum(o * d for o, d in zip(outs, dens)) / sum(dens)
    ref = dilated_reference(q, k, v, [4, 8, 16], [1, 2, 4], "longnet")
    torch.testing.assert_close(ref, mixed, atol=1e-12, rtol=0)


def test_empty_key_set_gives_zero_output_and_zero_gradient():
    q, k, v = _qkv(1, 2, 1, 6, 8)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    counts = dilated_key_counts([2, 4], [1, 2], "head_groups", 2, 1, 6, 6)
    out = attention_from_counts(q, k, v, counts)
    empty = counts.sum(-1) == 0
    assert empty[0, 1].tolist() == [True, False, True, False, True, False]
    assert torch.all(out[empty] == 0)
    out.pow(2).sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    assert torch.all(q.grad[empty] == 0)


def test_reference_gradients_match_sdpa():
    q, k, v = _qkv(1, 2, 1, 9, 4)
    grads = []
    for fn in (lambda a, b, c: dense_causal_reference(a, b, c),
               lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True, enable_gqa=True)):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        fn(*leaves).sin().sum().backward()
        grads.append([t.grad for t in leaves])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


def test_block_sparse_reference_reductions():
    q, k, v = _qkv(2, 2, 1, 24, 8)
    n_blocks = 6
    # all-true (causal handled by base visibility) layout == dense causal
    full = torch.ones(1, 1, n_blocks, n_blocks, dtype=torch.bool)
    torch.testing.assert_close(block_sparse_reference(q, k, v, full, 4), dense_causal_reference(q, k, v),
                               atol=1e-12, rtol=0)
    # diagonal layout (local window 1) == one dilated level with w = block_size, r = 1
    diag = torch.eye(n_blocks, dtype=torch.bool)[None, None]
    torch.testing.assert_close(block_sparse_reference(q, k, v, diag, 4), dilated_reference(q, k, v, [4], [1]),
                               atol=1e-12, rtol=0)
    # per-head layout: head 1 gets an empty layout -> zeros
    per_head = torch.stack([full[0, 0], torch.zeros(n_blocks, n_blocks, dtype=torch.bool)])[None]
    out = block_sparse_reference(q, k, v, per_head, 4)
    assert torch.all(out[:, 1] == 0)
    torch.testing.assert_close(out[:, 0], dense_causal_reference(q, k, v)[:, 0], atol=1e-12, rtol=0)
    # blocks follow positions within each packed document
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]])
    packed = block_sparse_reference(q, k, v, diag, 4, position_ids=pos)
    torch.testing.assert_close(packed, dilated_reference(q, k, v, [4], [1], position_ids=pos), atol=1e-12, rtol=0)
    with pytest.raises(ValueError):
        block_sparse_reference(q, k, v, diag[..., :3, :3], 4)
