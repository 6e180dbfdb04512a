"""Exact dense causal attention with padding and documents honoured: what "ring" computes on one
process (docs/contract.md 6) and what `create_attention("dense")` returns."""
from __future__ import annotations

import torch.nn.functional as F

from .dilated import dilated_attention
from .plan_cache import PlanCache
from .token_layout import ranks_in_document, token_layout
from .validate import check_int, check_qkv, check_scale_dropout


def dense_attention(q, k, v, *, is_causal: bool = True, scale=None, dropout_p: float = 0.0, attention_mask=None,
                    position_ids=None, sliding_window=None):
    """Attention (causal unless is_causal=False) over q (batch, q_heads, q_len, head_dim) and k, v (batch, kv_heads, kv_len,
    head_dim), the queries being the last q_len tokens; `attention_mask`, `position_ids` (batch,
    kv_len) and `sliding_window` as in `dilated_attention`. Positions only decide the documents here."""
    check_qkv(q, k, v, attention_mask, position_ids, longer_queries=not is_causal)
    check_scale_dropout(scale, dropout_p)
    check_int("sliding_window", sliding_window, optional=True)
    if q.shape[2] > k.shape[2]:  # (non-causal: queries that are not tokens of the key sequence)
        return _cross_attention(q, k, v, scale, dropout_p, attention_mask, position_ids, sliding_window)
    if sliding_window is not None and sliding_window >= k.shape[2]:
        sliding_window = None  # a window over the whole key sequence hides nothing
    if (attention_mask is None and position_ids is None and sliding_window is None
            and (q.shape[2] == k.shape[2] or not is_causal)):
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale, dropout_p=dropout_p,
                                              enable_gqa=bool(q.shape[1] != k.shape[1]))  # (a bool under jit.trace too)
    # One segment of kv_len slots is dense causal attention, when every document's positions fit
    # in it: renumber each document from 0 (given positions may exceed kv_len, e.g. 100..163).
    positions = _RANKS.get(tuple(k.shape[:3]), attention_mask, position_ids)
    if positions is None:
        layout = token_layout(k.shape[0], k.shape[2], k.device, attention_mask, position_ids)
        positions = ranks_in_document(layout)
        _RANKS.put(tuple(k.shape[:3]), attention_mask, position_ids, positions)
    return dilated_attention(q, k, v, [k.shape[2]], [1], is_causal=is_causal, scale=scale, dropout_p=dropout_p,
                             attention_mask=attention_mask, position_ids=positions, sliding_window=sliding_window)


def _cross_attention(q, k, v, scale, dropout_p, attention_mask, position_ids, sliding_window):
    """Non-causal attention of q_len > kv_len queries over the keys (nn.MultiheadAttention's
    cross-attention): padding alone applies; positions and windows, which place the queries in the
    key sequence, cannot."""
    for name, value in (("position_ids", position_ids), ("sliding_window", sliding_window)):
        if value is not None:
            raise ValueError(f"{name}: q_len ({q.shape[2]}) > kv_len ({k.shape[2]}) is cross-attention, whose queries "
                             f"have no place in the key sequence; pass {name}=None")
    mask = None if attention_mask is None else attention_mask.bool()[:, None, None, :]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, dropout_p=dropout_p,
                                         enable_gqa=bool(q.shape[1] != k.shape[1]))
    # a row without a real key reads nothing (0, as the kernels give it), where sdpa's softmax gives NaN
    return out if mask is None else out.masked_fill(~mask.any(-1, keepdim=True), 0.0)


# The same renumbered tensor for every layer of a model, so that dilated_attention's plan cache hits.
_RANKS = PlanCache()
