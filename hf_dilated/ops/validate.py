"""Argument checks shared by every entry point: they run before any computation and raise
ValueError / TypeError naming the offending argument and the rule it breaks."""
from __future__ import annotations

import math

import torch

# The rules of single settings live with their schema (hf_dilated/config.py, which imports nothing
# of hf_dilated); this module re-exports them for the kernels.
from ..config import DILATED_MODES, check_dilated_config, check_int

__all__ = ["DILATED_MODES", "FLOAT_DTYPES", "check_dilated_config", "check_int", "check_local_band", "check_qkv",
           "check_scale_dropout", "records_grad"]

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def records_grad(*tensors) -> bool:
    """Whether autograd records a call on these tensors: the paths without a backward serve the
    others. Any of them counts: v alone requires grad where LoRA adapts v_proj only (the first
    layer's q and k then come from frozen weights on frozen embeddings)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def check_qkv(q, k, v, attention_mask=None, position_ids=None) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (batch, heads, seq_len, head_dim), got shape {tuple(t.shape)}")
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {t.dtype}")
        if t.shape[1] == 0 or t.shape[3] == 0:  # scale = head_dim ** -0.5 and the GQA ratio divide by them
            raise ValueError(f"{name} must have at least one head and head_dim >= 1, got shape {tuple(t.shape)}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k and v must share a dtype, got q={q.dtype}, k={k.dtype}, v={v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k and v must be on one device, got q={q.device}, k={k.device}, v={v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k={tuple(k.shape)}, v={tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(
            f"q and k must agree in batch and head_dim, got q={tuple(q.shape)}, k={tuple(k.shape)}"
        )
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"q_heads ({q.shape[1]}) must be a multiple of kv_heads ({k.shape[1]})")
    if q.shape[2] > k.shape[2]:
        raise ValueError(f"q_len ({q.shape[2]}) must not exceed kv_len ({k.shape[2]}): the queries are the last q_len "
                         "tokens of the key sequence")
    batch, kv_len = k.shape[0], k.shape[2]
    for name, t in (("attention_mask", attention_mask), ("position_ids", position_ids)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
        if t.dim() != 2 or t.shape[1] != kv_len or t.shape[0] not in (1, batch):
            raise ValueError(f"{name} must have shape (batch, kv_len) = ({batch}, {kv_len}), got {tuple(t.shape)}")
        if t.device != q.device:
            raise ValueError(f"{name} must be on {q.device}, got {t.device}")
    if position_ids is not None and (position_ids.is_floating_point() or position_ids.dtype == torch.bool):
        raise TypeError(f"position_ids must be an integer tensor, got {position_ids.dtype}")
    if attention_mask is not None and attention_mask.is_complex():
        raise TypeError(f"attention_mask must be bool, integer or float (1 = a real token, 0 = padding), got "
                        f"{attention_mask.dtype}")
    # 1 marks a real token (docs/contract.md 3.1); torch's additive float masks use 0 for a kept key, and
    # read as marks they were inverted. (One read back, for float masks alone: transformers passes bool.)
    if attention_mask is not None and attention_mask.is_floating_point() and \
            not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
        raise ValueError("attention_mask: a float mask must hold only 1 (a real token) and 0 (padding): for an "
                         "additive mask (0 = keep, -inf = drop) pass attention_mask == 0")


def check_scale_dropout(scale, dropout_p) -> None:
    if scale is not None and (not isinstance(scale, (int, float)) or isinstance(scale, bool) or not 0 < scale < math.inf):
        raise ValueError(f"scale must be a positive finite number or None, got {scale!r}")
    if not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")


def check_local_band(q, k, mode, local_window, q_far, k_far) -> None:
    """A local band (docs/contract.md 4.1): mode "union", and far projections shaped like q and k, both or neither."""
    if local_window is None:
        raise ValueError("q_far/k_far: far projections need a local_window (the band they lie beyond)")
    check_int("local_window", local_window)
    if mode != "union":
        raise ValueError(f"local_window: a local band is defined for mode 'union' only (docs/contract.md 4.1), "
                         f"got mode {mode!r}")
    if (q_far is None) != (k_far is None):
        raise ValueError("q_far/k_far: pass both far projections or neither (k_far missing)" if k_far is None
                         else "q_far/k_far: pass both far projections or neither (q_far missing)")
    for name, far, like in (("q_far", q_far, q), ("k_far", k_far, k)):
        if far is not None and (far.shape != like.shape or far.dtype != like.dtype or far.device != like.device):
            raise ValueError(f"{name}: must match the shape, dtype and device of {name[0]} "
                             f"{tuple(like.shape)} {like.dtype}, got {tuple(far.shape)} {far.dtype}")


def check_far_reading(local_window, far_band, far_selection, is_causal) -> None:
    """A narrower band past local_window (far_band) and sparse far keys (far_selection, an
    ops.far_selection.FarSelection): docs/contract.md 4.2."""
    if far_band is None and far_selection is None:
        return
    name = "far_band" if far_band is not None else "far_selection"
    if local_window is None:
        raise ValueError(f"{name}: needs a local_window (the band whose far keys it reads)")
    check_int("far_band", far_band, optional=True)
    if far_band is not None and far_band > local_window:
        raise ValueError(f"far_band: at most local_window ({local_window}), got {far_band}")
    if far_selection is not None:
        if not is_causal:
            raise ValueError("far_top_k (far_selection): sparse far keys are defined for causal attention only "
                             "(is_causal=True)")
        band = local_window if far_band is None else far_band
        if far_selection.block_size > band:
            raise ValueError(f"far_block_size: at most the band ({band}) so that a far block lies before its query, "
                             f"got {far_selection.block_size}")
