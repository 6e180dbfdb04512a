"""Union dilated attention with a local band (docs/contract.md 4.1): every key within `local_window`
positions of its query, united with the union levels' keys further back, which may be read with a
second pair of query/key projections (`q_far`, `k_far`: the same vectors rotated to grouped
positions, Self-Extend style, so that far keys sit at relative positions the model was trained on).

How it is computed. Query chunks of `_CHUNK` tokens; for each chunk one fused softmax over the keys
it may read: the near copies of the keys within the band, and, with far projections, the far copies
of the keys beyond it. Near and far scores come from one call by concatenating along head_dim:
queries [q | q_far], near keys [k | 0], far keys [0 | k_far], so q_i . k_j or q_far_i . k_far_j is
each key copy's score and one softmax spans both. The key sets are boolean masks built from the
kernels' token rule (positions, documents, padding: ops/token_layout.py), so padding, packing,
decode and chunked prefill are exact by construction. PyTorch's scaled_dot_product_attention
differentiates it. Cost per query: the band plus the far keys' share of the levels; memory per
chunk O(chunk x keys).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .token_layout import token_layout

_CHUNK = 512  # queries per fused call: (heads x chunk x keys) masks and scores stay a few hundred MB at 16K


def local_band_attention(q, k, v, segment_lengths, dilation_rates, *, local_window: int, q_far=None, k_far=None,
                         is_causal: bool = True, scale: float, dropout_p: float = 0.0, attention_mask=None,
                         position_ids=None, sliding_window=None):
    """Inputs as `dilated_attention` (validated there), mode "union" with a local band of
    `local_window` positions; `q_far`/`k_far` (shaped like q/k, or both None) score the keys beyond it."""
    batch, q_heads, q_len, head_dim = q.shape
    kv_len = k.shape[2]
    layout = token_layout(batch, kv_len, k.device, attention_mask, position_ids)
    first = kv_len - q_len
    two = q_far is not None
    if two:  # [q | q_far] . [k | 0] = q . k (near copies); [q | q_far] . [0 | k_far] = q_far . k_far (far copies)
        q_cat = torch.cat([q, q_far], -1)
        k_near, k_far_cat = torch.cat([k, torch.zeros_like(k_far)], -1), torch.cat([torch.zeros_like(k), k_far], -1)
    out = torch.empty_like(q)
    heads = torch.arange(q_heads, device=q.device)
    for s in range(0, q_len, _CHUNK):
        e = min(q_len, s + _CHUNK)
        i = torch.arange(first + s, first + e, device=q.device)  # key-sequence index of each query
        keys = torch.arange(0, first + e, device=q.device) if is_causal else torch.arange(kv_len, device=q.device)
        near, far = _key_sets(layout, i, keys, heads, segment_lengths, dilation_rates, local_window, is_causal,
                              sliding_window)
        if two:
            qs = q_cat[:, :, s:e]
            ks = torch.cat([k_near[:, :, keys], k_far_cat[:, :, keys]], 2)
            vs = torch.cat([v[:, :, keys], v[:, :, keys]], 2)
            mask = torch.cat([near.expand_as(far), far], -1)
        else:
            qs, ks, vs, mask = q[:, :, s:e], k[:, :, keys], v[:, :, keys], near | far
        out[:, :, s:e] = _masked_attention(qs, ks, vs, mask, scale, dropout_p)
    return out


def _key_sets(layout, i, keys, heads, seg, dil, window, is_causal, sliding_window):
    """(near, far): bool (batch, heads or 1, queries, keys). near: base-visible keys within the band
    (p_i - p_j < window); far: base-visible keys beyond it that some union level holds for the head."""
    pos, doc, real = layout.positions, layout.doc, layout.real
    p_i, p_j = pos[:, i], pos[:, keys]
    base = real[:, None, keys] & (doc[:, i, None] == doc[:, None, keys])
    if is_causal:
        base = base & (keys[None, None, :] <= i[None, :, None])
    if sliding_window is not None:
        base = base & (keys[None, None, :] > i[None, :, None] - sliding_window)
    in_band = (p_i[:, :, None] - p_j[:, None, :]).abs() < window
    near = (base & in_band)[:, None]
    levels = torch.zeros(1, dtype=torch.bool, device=pos.device)
    for w, r in zip(seg, dil):
        same = (p_i[:, :, None] // w) == (p_j[:, None, :] // w)  # (batch, q, k)
        offset = (heads % r)[None, :, None]
        sel_i = ((p_i % w) % r)[:, None, :] == offset  # (batch, heads, q)
        sel_j = ((p_j % w) % r)[:, None, :] == offset  # (batch, heads, k)
        levels = levels | (same[:, None] & sel_i[..., None] & sel_j[:, :, None, :])
    far = (base & ~in_band)[:, None] & levels
    return near, far


def _masked_attention(q, k, v, mask, scale, dropout_p):
    """One softmax of q over the keys `mask` allows (broadcast over heads); rows with no key give 0."""
    empty = ~mask.any(-1, keepdim=True)  # (batch, heads or 1, queries, 1)
    safe = mask | empty  # a row with no key reads every key, then is zeroed: finite values and gradients
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=safe, scale=scale, dropout_p=dropout_p,
                                         enable_gqa=q.shape[1] != k.shape[1])
    return out.masked_fill(empty, 0.0)
