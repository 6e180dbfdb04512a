"""Fused attention calls that return the log-sum-exp, and their backward.

Every kernel of the package reduces its work to dense 4-D batches handed to `attention_forward`
and merges the partial results by log-sum-exp (see `merge.py`). The backward takes the *merged*
output and log-sum-exp (the standard flash / ring backward), so no probability matrix is kept.

Layout: q (batch, q_heads, q_len, head_dim); k, v (batch, kv_heads, kv_len, head_dim), with
q_heads a multiple of kv_heads (grouped-query attention handled by the kernel, K/V never
repeated on CPU). `is_causal` is aligned top-left (query t sees keys 0..t), as in PyTorch.
`attn_bias` is an additive float mask broadcastable to (batch, q_heads, q_len, kv_len).

Backends: on CPU PyTorch's fused flash kernel (`_scaled_dot_product_flash_attention_for_cpu`);
on CUDA PyTorch's memory-efficient kernel (it takes a bias and returns the log-sum-exp).
A row whose keys are all masked comes back from the CPU kernel with log-sum-exp 0 and output 0;
callers that can produce such rows correct the log-sum-exp to -inf themselves.
"""
from __future__ import annotations

import torch

_aten = torch.ops.aten


def attention_forward(q, k, v, *, is_causal: bool, scale: float, attn_bias=None):
    """Returns (out in q.dtype, lse in float32 or float64 shaped (batch, q_heads, q_len))."""
    if q.device.type == "cuda":
        return _cuda_forward(q, k, v, is_causal=is_causal, scale=scale, attn_bias=attn_bias)
    out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, is_causal, attn_mask=attn_bias, scale=scale
    )
    return out, lse


def attention_backward(dout, q, k, v, out, lse, *, is_causal: bool, scale: float, attn_bias=None):
    """Gradients (dq, dk, dv) of one fused call, given the merged out and lse of its rows."""
    if q.device.type == "cuda":
        return _cuda_backward(dout, q, k, v, out, lse, is_causal=is_causal, scale=scale, attn_bias=attn_bias)
    return _aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, is_causal, attn_mask=attn_bias, scale=scale
    )


def _expand_kv(q, k, v):
    # The CUDA efficient kernel has no grouped-query mode: expand (a view) to the query heads.
    groups = q.shape[1] // k.shape[1]
    if groups == 1:
        return k, v, 1
    b, hk, n, d = k.shape
    k = k[:, :, None].expand(b, hk, groups, n, d).reshape(b, hk * groups, n, d)
    v = v[:, :, None].expand(b, hk, groups, n, d).reshape(b, hk * groups, n, d)
    return k, v, groups


def _cuda_bias(attn_bias, q, k, is_causal):
    if attn_bias is None:
        return None
    shape = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    n, aligned = k.shape[2], -(-k.shape[2] // 16) * 16
    if n == aligned:
        return attn_bias.to(q.dtype).expand(shape)
    # The memory-efficient kernel wants the bias rows 16-element aligned (sdpa pads its mask the
    # same way before this kernel); compacted ring calls have any number of keys.
    buf = torch.empty(shape[:3] + (aligned,), dtype=q.dtype, device=q.device)
    buf[..., :n] = attn_bias
    return buf[..., :n]


def _cuda_forward(q, k, v, *, is_causal, scale, attn_bias):
    k, v, _ = _expand_kv(q, k, v)
    bias = _cuda_bias(attn_bias, q, k, is_causal)
    out, lse, _, _ = _aten._scaled_dot_product_efficient_attention(
        q, k, v, bias, True, 0.0, is_causal, scale=scale
    )
    return out, lse[..., : q.shape[2]].float()


def _pad_lse(lse):
    # The efficient kernel stores its log-sum-exp padded to a multiple of 32 queries.
    pad = (-lse.shape[-1]) % 32
    return torch.nn.functional.pad(lse.float(), (0, pad)).contiguous()


def _cuda_backward(dout, q, k, v, out, lse, *, is_causal, scale, attn_bias):
    kv_heads = k.shape[1]
    k, v, groups = _expand_kv(q, k, v)
    bias = _cuda_bias(attn_bias, q, k, is_causal)
    seed = torch.zeros((), dtype=torch.int64, device=q.device)
    offset = torch.zeros((), dtype=torch.int64, device=q.device)
    dq, dk, dv, _ = _aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, bias, out, _pad_lse(lse), seed, offset, 0.0, (True, True, True, False),
        is_causal, scale=scale,
    )
    if groups > 1:
        b, _, n, d = dk.shape
        dk = dk.view(b, kv_heads, groups, n, d).sum(2)
        dv = dv.view(b, kv_heads, groups, n, d).sum(2)
    return dq, dk, dv
