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
    check_qkv(q, k, v, attention_mask, position_ids)
    check_scale_dropout(scale, dropout_p)
    check_int("sliding_window", sliding_window, optional=True)
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


# The same renumbered tensor for every layer of a model, so that dilated_attention's plan cache hits.
_RANKS = PlanCache()
