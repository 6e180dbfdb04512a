"""The one merge rule every kernel shares: combine partial attentions by their log-sum-exp.

Two partial results over disjoint key sets (out_a, lse_a) and (out_b, lse_b) combine exactly as
    lse = log(exp(lse_a) + exp(lse_b)),  out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse).
A part with lse = -inf saw no key and contributes nothing; when both are -inf the result is
(0, -inf), never NaN. Merging happens in float32 (float64 for float64 inputs).
"""
from __future__ import annotations

import torch


def merge_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def merge_partial(out_a, lse_a, out_b, lse_b):
    """Returns the merged (out, lse); out_* are (..., head_dim), lse_* are (...)."""
    lse = torch.logaddexp(lse_a, lse_b)
    finite = torch.isfinite(lse)
    safe = torch.where(finite, lse, torch.zeros_like(lse))
    w_a = torch.where(finite, torch.exp(lse_a - safe), torch.zeros_like(lse))
    w_b = torch.where(finite, torch.exp(lse_b - safe), torch.zeros_like(lse))
    out = out_a * w_a.unsqueeze(-1) + out_b.to(out_a.dtype) * w_b.unsqueeze(-1)
    return out, lse
