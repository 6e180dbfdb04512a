"""Independent dense float64 reference for every attention variant, written from docs/contract.md
alone.

Nothing here imports hf_dilated: the tests compare kernels against these formulas, never against
another kernel of the project. Everything is deliberately naive: a dense (batch, heads, q_len,
kv_len) matrix of how many times each key counts in K(h, i), then one float64 softmax-weighted sum.
Clarity over speed; fine up to a few hundred tokens.

Layout (docs/contract.md 1): q (batch, q_heads, q_len, head_dim), k and v
(batch, kv_heads, kv_len, head_dim); the queries are the last q_len tokens; attention_mask and
position_ids are (batch or 1, kv_len).

Public functions:
    token_positions(attention_mask, position_ids, batch, kv_len) -> TokenPositions
    base_visible(attention_mask, position_ids, batch, q_len, kv_len, is_causal=True, sliding_window=None)
        -> bool (batch, q_len, kv_len)
    dilated_key_counts(segment_lengths, dilation_rates, mode, q_heads, batch, q_len, kv_len, *,
                       attention_mask=None, position_ids=None, is_causal=True)
        -> int64 (batch, q_heads, q_len, kv_len)
    block_sparse_key_counts(layout, block_size, q_heads, batch, q_len, kv_len, *, ...)
        -> int64 (batch, q_heads, q_len, kv_len)
    attention_from_counts(q, k, v, counts, scale=None) -> float64 tensor shaped like q
    dilated_reference(q, k, v, segment_lengths, dilation_rates, mode="union", *, scale=None,
                      attention_mask=None, position_ids=None, is_causal=True)
    dense_causal_reference(q, k, v, *, scale=None, attention_mask=None, position_ids=None)
    block_sparse_reference(q, k, v, layout, block_size, *, scale=None, attention_mask=None,
                           position_ids=None, is_causal=True)

Every function that builds key sets also takes `sliding_window` (docs/contract.md 3.3): with a
window W, base-visible also requires key index j > query index i - W.

The *_reference functions return float64 and are differentiable: pass float64 leaves with
requires_grad=True to get reference gradients.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

MODES = ("union", "longnet", "head_groups")


class TokenPositions(NamedTuple):
    positions: torch.Tensor  # (batch, kv_len) int64: p_i
    real: torch.Tensor  # (batch, kv_len) bool: not padding
    doc: torch.Tensor  # (batch, kv_len) int64: document number within the row, from 0


def token_positions(attention_mask, position_ids, batch: int, kv_len: int) -> TokenPositions:
    """docs/contract.md 3.1 (the kernels' rule): positions are position_ids when
    given, else cumsum(attention_mask) - 1 when a mask is given, else 0..kv_len-1. Documents come
    from the real tokens only: a real token starts a new document unless its position continues
    the previous real token's, either as the next position (+1) or as the position its index
    implies (+ the index distance, when the positions count the padded slots between them). A
    padded slot neither starts nor breaks a document (it gets the document of the real token
    before it, which nothing reads)."""
    if attention_mask is not None:
        real = attention_mask.detach().cpu().to(torch.bool).expand(batch, kv_len).clone()
    else:
        real = torch.ones(batch, kv_len, dtype=torch.bool)
    if position_ids is not None:
        positions = position_ids.detach().cpu().to(torch.int64).expand(batch, kv_len).clone()
    elif attention_mask is not None:
        positions = torch.cumsum(real.to(torch.int64), dim=-1) - 1
    else:
        positions = torch.arange(kv_len, dtype=torch.int64).expand(batch, kv_len).clone()

    doc = torch.zeros(batch, kv_len, dtype=torch.int64)
    for b in range(batch):  # plain loop: this is the definition, word for word
        current, prev = 0, None  # prev: index of the previous real token
        for t in range(kv_len):
            if real[b, t]:
                if prev is not None:
                    step = int(positions[b, t] - positions[b, prev])
                    if step not in (1, t - prev):
                        current += 1
                prev = t
            doc[b, t] = current
    return TokenPositions(positions, real, doc)


def _query_slice(kv_len: int, q_len: int) -> slice:
    if not 0 < q_len <= kv_len:
        raise ValueError(f"reference: need 0 < q_len <= kv_len, got q_len={q_len}, kv_len={kv_len}")
    return slice(kv_len - q_len, kv_len)


def base_visible(attention_mask, position_ids, batch: int, q_len: int, kv_len: int, is_causal: bool = True,
                 sliding_window=None):
    """bool (batch, q_len, kv_len): key j visible to query i when same document, key not padding,
    (causal) j at or before i in the sequence, and (sliding window W) j > i - W, by index in the
    key sequence, padded slots counted. Query i is sequence index kv_len - q_len + i."""
    tp = token_positions(attention_mask, position_ids, batch, kv_len)
    qs = _query_slice(kv_len, q_len)
    q_index = torch.arange(kv_len)[qs]  # sequence index of each query
    k_index = torch.arange(kv_len)
    same_doc = tp.doc[:, qs, None] == tp.doc[:, None, :]
    key_real = tp.real[:, None, :]
    visible = same_doc & key_real
    if is_causal:
        visible = visible & (k_index[None, None, :] <= q_index[None, :, None])
    if sliding_window is not None:
        visible = visible & (k_index[None, None, :] > q_index[None, :, None] - sliding_window)
    return visible


def head_groups(q_heads: int, num_groups: int) -> list[int]:
    """Group (level) of every head: G contiguous groups, as equal as possible, earlier groups take
    the extra heads. With fewer heads than groups the last groups are empty."""
    sizes = [q_heads // num_groups + (1 if g < q_heads % num_groups else 0) for g in range(num_groups)]
    group_of_head = []
    for g, size in enumerate(sizes):
        group_of_head += [g] * size
    assert len(group_of_head) == q_heads
    return group_of_head


def level_visible(tp: TokenPositions, visible, w: int, r: int, q_heads: int, q_len: int):
    """bool (batch, q_heads, q_len, kv_len): membership of j in V_g(h, i) for one level (w, r)."""
    kv_len = tp.positions.shape[1]
    qs = _query_slice(kv_len, q_len)
    p = tp.positions
    offsets = torch.arange(q_heads) % r  # o = h mod r
    # selected[b, h, t]: (p_t mod w) mod r == h mod r   (torch % and // are floor ops, like Python)
    selected = ((p % w) % r)[:, None, :] == offsets[None, :, None]
    segment = p // w
    same_segment = segment[:, qs, None] == segment[:, None, :]  # (batch, q_len, kv_len)
    return (
        visible[:, None, :, :]
        & same_segment[:, None, :, :]
        & selected[:, :, qs, None]
        & selected[:, :, None, :]
    )


def dilated_key_counts(segment_lengths, dilation_rates, mode, q_heads, batch, q_len, kv_len, *,
                       attention_mask=None, position_ids=None, is_causal=True, sliding_window=None):
    """int64 (batch, q_heads, q_len, kv_len): how many times key j counts in K(h, i).
    union: set union of the V_g (0/1); longnet: multiset sum (number of levels that contain j);
    head_groups: head h of group g uses V_g alone."""
    if mode not in MODES:
        raise ValueError(f"reference: unknown mode {mode!r}")
    if len(segment_lengths) != len(dilation_rates):
        raise ValueError("reference: segment_lengths and dilation_rates differ in length")
    tp = token_positions(attention_mask, position_ids, batch, kv_len)
    visible = base_visible(attention_mask, position_ids, batch, q_len, kv_len, is_causal, sliding_window)
    levels = [
        level_visible(tp, visible, w, r, q_heads, q_len).to(torch.int64)
        for w, r in zip(segment_lengths, dilation_rates)
    ]
    if mode == "union":
        return (torch.stack(levels).sum(0) > 0).to(torch.int64)
    if mode == "longnet":
        return torch.stack(levels).sum(0)
    group_of_head = head_groups(q_heads, len(levels))
    return torch.stack([levels[g][:, h] for h, g in enumerate(group_of_head)], dim=1)


def block_sparse_key_counts(layout, block_size: int, q_heads: int, batch: int, q_len: int, kv_len: int, *,
                            attention_mask=None, position_ids=None, is_causal=True, sliding_window=None):
    """int64 0/1 (batch, q_heads, q_len, kv_len) for a block-sparse pattern.

    layout: bool tensor (batch or 1, q_heads or 1, q_blocks, k_blocks); layout[b, h, bq, bk] says
    whether key block bk is allowed for query block bq. The block of token t is
    positions[t] // block_size (docs/contract.md 5: counted within its document, i.e. from the
    document's positions, which restart with each packed document). A key counts when it is base-visible and
    its block is allowed for the query's block. Padding tokens (which may have negative positions)
    are clamped to block 0; padded keys are never visible anyway and padded queries are unspecified.
    The layout must cover every block a real token of the input falls in (else ValueError).
    """
    layout = torch.as_tensor(layout).detach().cpu().to(torch.bool)
    if layout.dim() != 4:
        raise ValueError(f"reference: layout must be 4-D (batch|1, heads|1, q_blocks, k_blocks), got {tuple(layout.shape)}")
    if layout.shape[0] not in (1, batch) or layout.shape[1] not in (1, q_heads):
        raise ValueError(f"reference: layout shape {tuple(layout.shape)} does not broadcast to batch={batch}, heads={q_heads}")
    tp = token_positions(attention_mask, position_ids, batch, kv_len)
    visible = base_visible(attention_mask, position_ids, batch, q_len, kv_len, is_causal, sliding_window)
    qs = _query_slice(kv_len, q_len)
    block = torch.where(tp.real, tp.positions // block_size, torch.zeros_like(tp.positions)).clamp_min(0)
    n_q_blocks, n_k_blocks = layout.shape[2], layout.shape[3]
    if int(block.max()) >= min(n_q_blocks, n_k_blocks):
        raise ValueError(
            f"reference: layout has {n_q_blocks}x{n_k_blocks} blocks but tokens reach block {int(block.max())}"
        )
    layout = layout.expand(batch, q_heads, n_q_blocks, n_k_blocks)
    qb = block[:, qs]  # (batch, q_len)
    kb = block  # (batch, kv_len)
    b_idx = torch.arange(batch)[:, None, None, None]
    h_idx = torch.arange(q_heads)[None, :, None, None]
    allowed = layout[b_idx, h_idx, qb[:, None, :, None], kb[:, None, None, :]]
    return (allowed & visible[:, None]).to(torch.int64)


def attention_from_counts(q, k, v, counts, scale=None):
    """out[h, i] = sum_j c_ij exp(s_ij) v_j / sum_j c_ij exp(s_ij), s_ij = scale * q_i . k_j, in
    float64, with query head h reading kv head h // (q_heads // kv_heads). A row with no key
    (all c_ij == 0) gets output 0, and the double `where` keeps its gradient exactly 0 (no NaN)."""
    q, k, v = q.to(torch.float64), k.to(torch.float64), v.to(torch.float64)
    q_heads, kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[3]
    if q_heads % kv_heads:
        raise ValueError("reference: q_heads must be a multiple of kv_heads")
    if scale is None:
        scale = head_dim ** -0.5
    group = q_heads // kv_heads
    k = k.repeat_interleave(group, dim=1)  # head h -> kv head h // group
    v = v.repeat_interleave(group, dim=1)
    counts = counts.to(device=q.device)
    present = counts > 0
    scores = scale * torch.einsum("bhid,bhjd->bhij", q, k)
    # Subtract the row maximum over *present* keys (a constant, not differentiated) for stability.
    row_max = torch.where(present, scores.detach(), torch.full_like(scores, -torch.inf)).amax(-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    safe = torch.where(present, scores - row_max, torch.zeros_like(scores))
    weights = torch.where(present, counts.to(torch.float64) * torch.exp(safe), torch.zeros_like(scores))
    denom = weights.sum(-1, keepdim=True)
    denom = torch.where(denom > 0, denom, torch.ones_like(denom))
    return torch.einsum("bhij,bhjd->bhid", weights, v) / denom


def dilated_reference(q, k, v, segment_lengths, dilation_rates, mode="union", *, scale=None,
                      attention_mask=None, position_ids=None, is_causal=True, sliding_window=None):
    batch, q_heads, q_len, _ = q.shape
    counts = dilated_key_counts(
        segment_lengths, dilation_rates, mode, q_heads, batch, q_len, k.shape[2],
        attention_mask=attention_mask, position_ids=position_ids, is_causal=is_causal,
        sliding_window=sliding_window,
    )
    return attention_from_counts(q, k, v, counts, scale)


def dense_causal_reference(q, k, v, *, scale=None, attention_mask=None, position_ids=None, sliding_window=None):
    """K(h, i) = all base-visible keys (what "ring" and sdpa compute)."""
    batch, q_heads, q_len, _ = q.shape
    visible = base_visible(attention_mask, position_ids, batch, q_len, k.shape[2], True, sliding_window)
    counts = visible[:, None].expand(batch, q_heads, q_len, k.shape[2]).to(torch.int64)
    return attention_from_counts(q, k, v, counts, scale)


def block_sparse_reference(q, k, v, layout, block_size, *, scale=None, attention_mask=None,
                           position_ids=None, is_causal=True, sliding_window=None):
    """Block-sparse attention: layout bool (batch or 1, q_heads or 1, q_blocks, k_blocks), block of
    token t = positions[t] // block_size; see block_sparse_key_counts."""
    batch, q_heads, q_len, _ = q.shape
    counts = block_sparse_key_counts(
        layout, block_size, q_heads, batch, q_len, k.shape[2],
        attention_mask=attention_mask, position_ids=position_ids, is_causal=is_causal,
        sliding_window=sliding_window,
    )
    return attention_from_counts(q, k, v, counts, scale)


def local_band_reference(q, k, v, segment_lengths, dilation_rates, local_window, *, q_far=None, k_far=None,
                         scale=None, attention_mask=None, position_ids=None, is_causal=True, sliding_window=None,
                         far_band=None, far_top_k=None, far_block_size=64, far_sinks=1):
    """docs/contract.md 4.1: union dilated attention with a local band. K(h, i) is the set of
    base-visible keys j with |p_i - p_j| < local_window (near), united with the union levels' keys
    (far: the others). Near keys score q_i . k_j; far keys score q_far_i . k_far_j when the far
    projections are given, else q_i . k_j. One float64 softmax over K(h, i); no key: output 0.
    docs/contract.md 4.2 (far_band, far_top_k, far_block_size, far_sinks): see local_band_key_sets."""
    batch, q_heads, q_len, head_dim = q.shape
    near, far = local_band_key_sets(q, k, segment_lengths, dilation_rates, local_window, q_far=q_far, k_far=k_far,
                                    attention_mask=attention_mask, position_ids=position_ids, is_causal=is_causal,
                                    sliding_window=sliding_window, far_band=far_band, far_top_k=far_top_k,
                                    far_block_size=far_block_size, far_sinks=far_sinks)
    if scale is None:
        scale = head_dim ** -0.5
    group = q_heads // k.shape[1]

    def scores(qq, kk):
        kk = kk.to(torch.float64).repeat_interleave(group, dim=1)
        return scale * torch.einsum("bhid,bhjd->bhij", qq.to(torch.float64), kk)

    near_scores = scores(q, k)
    far_scores = near_scores if q_far is None else scores(q_far, k_far)
    s = torch.where(near, near_scores, far_scores)
    present = near | far
    row_max = torch.where(present, s.detach(), torch.full_like(s, -torch.inf)).amax(-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    weights = torch.where(present, torch.exp(torch.where(present, s - row_max, torch.zeros_like(s))),
                          torch.zeros_like(s))
    denom = weights.sum(-1, keepdim=True)
    denom = torch.where(denom > 0, denom, torch.ones_like(denom))
    vv = v.to(torch.float64).repeat_interleave(group, dim=1)
    return torch.einsum("bhij,bhjd->bhid", weights, vv) / denom


def local_band_key_sets(q, k, segment_lengths, dilation_rates, local_window, *, q_far=None, k_far=None,
                        attention_mask=None, position_ids=None, is_causal=True, sliding_window=None, far_band=None,
                        far_top_k=None, far_block_size=64, far_sinks=1):
    """(near, far), bool (batch, q_heads, q_len, kv_len): the keys local_band_reference reads in
    the band and beyond it. docs/contract.md 4.2: with `far_band`, a query at a position >=
    local_window has a band of far_band instead; with `far_top_k`, far keys are read only in the
    first `far_sinks` blocks of far_block_size positions of the document and in the far_top_k other
    blocks holding a far key of (h, i) whose bound sum_d max(qf_d mn_d, qf_d mx_d) is highest (ties
    at the k-th all read)."""
    batch, q_heads, q_len, _ = q.shape
    kv_len = k.shape[2]
    tp = token_positions(attention_mask, position_ids, batch, kv_len)
    visible = base_visible(attention_mask, position_ids, batch, q_len, kv_len, is_causal, sliding_window)
    p_q = tp.positions[:, _query_slice(kv_len, q_len)]
    width = torch.full_like(p_q, local_window)
    if far_band is not None:
        width = torch.where(p_q < local_window, local_window, far_band)
    near = visible & ((p_q[:, :, None] - tp.positions[:, None, :]).abs() < width[:, :, None])  # (batch, q, k)
    union = dilated_key_counts(segment_lengths, dilation_rates, "union", q_heads, batch, q_len, kv_len,
                               attention_mask=attention_mask, position_ids=position_ids, is_causal=is_causal,
                               sliding_window=sliding_window) > 0
    near = near[:, None].expand_as(union)
    far = union & ~near
    if far_top_k is not None:
        far = far & _far_selected(far, q if q_far is None else q_far, k if k_far is None else k_far, tp,
                                  far_top_k, far_block_size, far_sinks, sliding_window)
    return near, far


def _far_selected(far, q_far, k_far, tp: TokenPositions, top_k, block_size, sinks, sliding_window=None):
    """bool (batch, heads, q_len, kv_len): the far keys docs/contract.md 4.2 reads, by its words: a
    block is (document, position // block_size) of real keys; its summary the elementwise min/max
    of their k_far (with a sliding window W, of those the query's window shows: index > i - W); a
    query reads its far keys in sink blocks (number < sinks) and in the top_k candidate blocks
    (holding one of its far keys, not a sink) by the bound."""
    batch, q_heads, q_len, _ = q_far.shape
    kv_len = k_far.shape[2]
    group = q_heads // k_far.shape[1]
    out = torch.zeros_like(far)
    for b in range(batch):
        blocks = {}
        for j in range(kv_len):
            if tp.real[b, j]:
                blocks.setdefault((int(tp.doc[b, j]), int(tp.positions[b, j]) // block_size), []).append(j)
        for h in range(q_heads):
            keys = k_far[b, h // group].detach().to(torch.float64)
            whole = {blk: (keys[js].amin(0), keys[js].amax(0)) for blk, js in blocks.items()}
            for i in range(q_len):
                shown_from = 0 if sliding_window is None else kv_len - q_len + i - sliding_window + 1
                summary = {blk: whole[blk] if js[0] >= shown_from else (keys[shown].amin(0), keys[shown].amax(0))
                           for blk, js in blocks.items() if (shown := [j for j in js if j >= shown_from])}
                qf = q_far[b, h, i].detach().to(torch.float64)
                scored = []
                for blk, js in blocks.items():
                    if not far[b, h, i, js].any():
                        continue
                    if blk[1] < sinks:
                        out[b, h, i, js] = True
                        continue
                    if blk not in summary:  # every key hidden by the window: no far key of the query
                        continue
                    mn, mx = summary[blk]
                    scored.append((float(torch.maximum(qf * mn, qf * mx).sum()), js))
                if not scored or top_k == 0:
                    continue
                kth = sorted((bound for bound, _ in scored), reverse=True)[min(top_k, len(scored)) - 1]
                for bound, js in scored:
                    if bound >= kth:
                        out[b, h, i, js] = True
    return out
