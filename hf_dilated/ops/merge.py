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
    """Returns the merged (out, lse); out_* are (..., head_dim), lse_* are (...).

    out_a (the accumulator) sets the dtype. The weight of part b is exp(lse_b - lse) =
    sigmoid(lse_b - lse_a), and out = lerp(out_a, out_b, weight): one fused pass over the outputs.
    """
    lse = torch.logaddexp(lse_a, lse_b)
    # both -inf: nothing to take from b (out of place: autograd keeps the sigmoid for its backward)
    weight_b = torch.sigmoid(lse_b - lse_a).nan_to_num(0.0)
    out = torch.lerp(out_a, out_b.to(out_a.dtype), weight_b.unsqueeze(-1).to(out_a.dtype))
    return out, lse


def merge_into(out_acc, lse_acc, out_b, lse_b, acc_finite: bool = False) -> None:
    """merge_partial in place: (out_acc, lse_acc) becomes the merge of itself and (out_b, lse_b).
    acc_finite: every lse_acc is finite (each query saw a key already), so no weight is NaN and the
    pass that clears them is skipped (a launch per merge on a GPU, where short calls are host-bound)."""
    weight_b = torch.sigmoid(lse_b - lse_acc)
    if not acc_finite:
        weight_b.nan_to_num_(0.0)
    out_acc.lerp_(out_b.to(out_acc.dtype), weight_b.unsqueeze(-1).to(out_acc.dtype))
    torch.logaddexp(lse_acc, lse_b, out=lse_acc)
