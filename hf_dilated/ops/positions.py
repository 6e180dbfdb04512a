"""Token positions, padding and packed documents, as SPEC.md defines them.

Patterns are functions of positions, never of tensor indices, so that padding never changes what
a real token computes:
- key positions are `position_ids` when given, else `cumsum(attention_mask) - 1`, else 0..n-1;
- a new document starts at every token whose position is not the previous position + 1;
- a key whose mask is 0 is never visible.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TokenLayout:
    positions: torch.Tensor  # (batch, kv_len) int64
    real: torch.Tensor  # (batch, kv_len) bool: not padding
    doc: torch.Tensor  # (batch, kv_len) int64: document index within the row, from 0
    plain: bool  # no padding, one document per row, positions 0..kv_len-1


def token_layout(batch: int, kv_len: int, device, attention_mask=None, position_ids=None) -> TokenLayout:
    if attention_mask is not None:
        real = attention_mask.to(device=device, dtype=torch.bool).expand(batch, kv_len)
    else:
        real = torch.ones(batch, kv_len, dtype=torch.bool, device=device)
    if position_ids is not None:
        positions = position_ids.to(device=device, dtype=torch.long).expand(batch, kv_len)
    elif attention_mask is not None:
        positions = real.long().cumsum(-1) - 1
    else:
        positions = torch.arange(kv_len, device=device).expand(batch, kv_len)
    starts = torch.ones(batch, kv_len, dtype=torch.bool, device=device)
    starts[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
    doc = starts.long().cumsum(-1) - 1
    plain = bool(real.all()) and bool((positions == torch.arange(kv_len, device=device)).all())
    return TokenLayout(positions=positions, real=real, doc=doc, plain=plain)
