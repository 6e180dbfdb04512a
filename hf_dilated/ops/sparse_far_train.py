"""Sparse far keys (docs/contract.md 4.2) with gradients: training past the original context on a GPU.

The rows are sparse_far_plain's (one document per row, no padding, causal, no sliding window, a
level of dilation 1 holding the row: the default conversion's), the set the same. The forward is
sparse_far_flex.prefill, asked for the merged log-sum-exp too. The backward walks the same chunks
and, as every backward here (backend.py), is fed with the merged output O and log-sum-exp L:
- the queries before `start`: flash's causal backward; the band of the others: flash's
  sliding-window backward, one call (backend.band_backward);
- each chunk's far keys: its FlexAttention calls run again (the selection recomputed from the same
  inputs) and autograd differentiates them, given the cotangents that make each of them a part of
  its row's merged softmax. A part e of query i (output o_e, log-sum-exp l_e) carries the weight
  w_e = exp(l_e - L_i) of the row, so with dO_i the row's output gradient and D_i = dO_i . O_i:
  dLoss/do_e = w_e dO_i and dLoss/dl_e = w_e (dO_i . o_e - D_i). (FlexAttention's backward takes the
  gradient of its log-sum-exp.)
Nothing is read back to the host (plans from shapes and device tensors): a training step of the
default conversion past its context is a fixed sequence of launches, where local_band's masked calls
read each 128-query chunk's width back: 29 reads in a forward and 24 in a backward of a two-layer
model at 2K tokens from 512 (5 and 0 here: transformers' own 4, as under sdpa, and the positions'
one), and dispatched
3,382 operations in that forward (1,072 here, counted on the CPU, where the plans and merges that a
GPU compiles run eagerly; 2026-11-28).

Where it serves: CUDA (DEVICES), FlexAttention built, and flash's sliding window for the band's
backward (half precision: float32 training keeps the masked calls). FlexAttention has no backward on
the CPU: training there keeps local_band's calls, which compute the same set (tests widen DEVICES and
stand in for FlexAttention's differentiated call with its definition). A backward that fails to build
(the first call compiles FlexAttention's) gives that step's gradients from the masked calls, warned
once, and the process's later calls take them.
"""
from __future__ import annotations

import warnings

import torch
from torch.autograd.function import once_differentiable

from . import sparse_far_flex
from .backend import attention_backward, band_backward, band_on_flash, kv_head_grads
from .far_selection import FarSelection
from .local_band import local_band_attention
from .merge import merge_dtype
from .sparse_far_flex import TILE, RowPlan, by_block_mask, by_block_plan, by_block_tiles, by_query_block_mask, key_tile

DEVICES = ("cuda",)  # where training with sparse far keys takes this path
_BACKWARD_FAILED: str | None = None  # why a backward failed in this process (later calls take the masked calls)


def applies(q, k, v) -> bool:
    """Whether this path serves a call with gradients on q's device (the rows checked by the caller):
    FlexAttention there, and on CUDA flash's sliding window for the band's backward (without it,
    the band's backward would be one call over every pair: band_backward)."""
    return (q.device.type in DEVICES and sparse_far_flex.AVAILABLE and sparse_far_flex._FAILED is None
            and _BACKWARD_FAILED is None
            and sparse_far_flex.takes_head_dim(q.device, min(q.shape[-1], v.shape[-1]))
            and (q.device.type != "cuda" or band_on_flash(q, k, needs_grad=True)))


def sparse_far_attention(q, k, v, q_far, k_far, window: int, far_band: int | None, selection: FarSelection,
                         scale: float):
    """The output of sparse_far_plain's rows (q's shape), differentiable; None (nothing computed)
    where FlexAttention failed to build here (prefill warns once): the caller takes the masked calls."""
    n = q.shape[2]
    if n <= window:
        raise ValueError(f"sparse_far_attention: the row ({n} tokens) has no far key within window {window}")
    band = window if far_band is None else far_band
    try:
        return _SparseFar.apply(q, k, v, q_far, k_far, window, band, selection, scale)
    except _Unavailable:
        return None


class _Unavailable(Exception):
    """prefill computed nothing (FlexAttention failed to build in this process)."""


class _SparseFar(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, q_far, k_far, start, band, selection, scale):
        # Autocast off, here and in the backward: the backward's selection must be the forward's, from
        # operations in the same dtypes. (Detached: FlexAttention refuses inputs that require grad where
        # it has no backward, whatever the grad mode.)
        with torch.autocast(q.device.type, enabled=False):
            result = sparse_far_flex.prefill(*(t.detach() for t in (q, k, v, q_far, k_far)), start, band, selection,
                                             scale, with_lse=True)
        if result is None:
            raise _Unavailable
        out, lse = result
        ctx.save_for_backward(q, k, v, q_far, k_far, out, lse)
        ctx.settings = start, band, selection, scale
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        global _BACKWARD_FAILED
        saved = ctx.saved_tensors
        try:
            with torch.autocast(dout.device.type, enabled=False):
                grads = _backward(dout, *saved, *ctx.settings)
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:  # FlexAttention's backward compiles at its first call: a build failure
            if _BACKWARD_FAILED is not None:
                raise
            _BACKWARD_FAILED = f"{type(exc).__name__}: {exc}"
            warnings.warn(f"hf_dilated: the backward of sparse far keys failed here ({_BACKWARD_FAILED[:500]}); this "
                          "step's gradients and every later call's take the masked calls (correct, slower on a GPU)",
                          RuntimeWarning, stacklevel=2)
            grads = _masked_backward(dout, *saved, *ctx.settings)
        return (*grads, None, None, None, None)


def _masked_backward(dout, q, k, v, q_far, k_far, out, lse, start, band, selection, scale):
    """(dq, dk, dv, dq_far, dk_far) from local_band's masked calls over the same set (a level of
    dilation 1 holding the row: every earlier key, then the band and the selection of 4.2)."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v, q_far, k_far)]
    with torch.enable_grad():
        again = local_band_attention(*leaves[:3], [q.shape[2]], [1], local_window=start, q_far=leaves[3],
                                     k_far=leaves[4], scale=scale, far_band=None if band == start else band,
                                     far_selection=selection)
        return torch.autograd.grad(again, leaves, dout)


def _backward(dout, q, k, v, q_far, k_far, out, lse, start: int, band: int, selection: FarSelection, scale: float):
    """(dq, dk, dv, dq_far, dk_far) of _SparseFar, in the inputs' dtypes."""
    acc = merge_dtype(q.dtype)
    dout = dout.to(q.dtype)
    dq, dq_far = (torch.zeros(q.shape, dtype=acc, device=q.device) for _ in range(2))
    dk, dk_far, dv = (torch.zeros(k.shape, dtype=acc, device=k.device) for _ in range(3))
    # The queries before start read every key before them (one causal call).
    g_q, g_k, g_v = attention_backward(dout[:, :, :start].contiguous(), q[:, :, :start], k[:, :, :start],
                                       v[:, :, :start], out[:, :, :start].contiguous(), lse[:, :, :start].contiguous(),
                                       is_causal=True, scale=scale)
    dq[:, :, :start] += g_q
    dk[:, :, :start] += kv_head_grads(g_k, k.shape[1])
    dv[:, :, :start] += kv_head_grads(g_v, k.shape[1])
    # The band of the later ones: keys j with i - band < j <= i.
    lo = max(0, start - band + 1)
    g_q, g_k, g_v = band_backward(dout[:, :, start:], q[:, :, start:], k[:, :, lo:], v[:, :, lo:],
                                  out[:, :, start:], lse[:, :, start:], window=band, scale=scale)
    dq[:, :, start:] += g_q
    dk[:, :, lo:] += g_k
    dv[:, :, lo:] += g_v
    if selection.top_k + selection.sinks:
        _far_backward(dout, q_far.detach(), k_far.detach(), v.detach(), out, lse, start, band, selection, scale,
                      dq_far, dk_far, dv)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dq_far.to(q_far.dtype), dk_far.to(k_far.dtype)


def _far_backward(dout, q_far, k_far, v, out, lse, start, band, selection, scale, dq_far, dk_far, dv) -> None:
    """Add the far keys' gradients into dq_far, dk_far, dv (float32 or float64), chunk by chunk as
    prefill wrote the rows. A call whose first rows were written by the call before (the last one,
    moved back) gives them no cotangent; nor do the rows padding a short row."""
    batch, n_heads, n, dim = q_far.shape
    acc = dq_far.dtype
    rows_of = RowPlan.of(q_far, k_far, v, band, selection)
    chunk = rows_of.chunk
    k_leaf = rows_of.k_far.detach().requires_grad_()
    v_leaf = rows_of.v_far.detach().requires_grad_()
    dk_keys = torch.zeros(k_leaf.shape, dtype=acc, device=k_leaf.device)
    dv_keys = torch.zeros(v_leaf.shape, dtype=acc, device=v_leaf.device)
    lo = start
    while lo < n:
        s, e = rows_of.chunk_rows(lo, start, n)
        pad = (0, chunk - (e - s))
        # Rows s .. lo - 1 were written by the call before: weight 0 (log-sum-exp +inf), as the padding.
        row_lse = lse[:, :, s:e].to(acc).clone()
        row_lse[:, :, :lo - s].fill_(float("inf"))
        row_lse = torch.nn.functional.pad(row_lse, pad, value=float("inf"))
        row_dout = torch.nn.functional.pad(dout[:, :, s:e].to(acc), (0, 0, *pad))
        row_dot = torch.nn.functional.pad((dout[:, :, s:e].to(acc) * out[:, :, s:e].to(acc)).sum(-1), pad)  # dO_i . O_i
        g_q, g_k, g_v = _chunk_grads(rows_of.query_rows(q_far, s, e), k_leaf, v_leaf, rows_of, s, selection, scale,
                                     row_dout, row_dot, row_lse)
        dq_far[:, :, s:e] += g_q[:, :, :e - s]
        dk_keys += g_k
        dv_keys += g_v
        lo = e
    dk_far += dk_keys[:, :, :n]
    dv += dv_keys[:, :, :n]


def _chunk_grads(q_chunk, k_leaf, v_leaf, rows_of: RowPlan, s: int, selection: FarSelection, scale: float,
                 row_dout, row_dot, row_lse):
    """(dq_chunk, dk, dv) of one chunk's far keys (the by-block entries and the tied blocks' call):
    its FlexAttention calls again, from the forward's plan (the same compiled graph: the same
    selection), with the query-tile lists of their backward and key tiles of 128 (FlexAttention's
    backward kernel on a Hopper GPU takes key tiles of 128: those of a far block of 32 or 64 keys,
    the forward's, leave it no configuration), differentiated with the cotangents of the module's
    docstring. row_dout, row_dot, row_lse: (batch, heads, rows[, d]) of the chunk's rows."""
    batch, n_heads, rows, dim = q_chunk.shape
    kv_heads = k_leaf.shape[1]
    group = n_heads // kv_heads
    n_keys, size = rows_of.n_keys, selection.block_size
    last = rows_of.lasts[s:s + rows]
    tile = key_tile(size)
    with torch.no_grad():
        q_entries, row_block, row_last, kv_count, kv_indices, full_count, inverse, tied = sparse_far_flex._fused(
            by_block_plan, n_keys)(q_chunk, *rows_of.operands, last, selection.top_k, selection.sinks, size, n_keys,
                                   tile)
        if tile != TILE:
            kv_count, kv_indices, full_count = by_block_tiles(row_block, row_last, rows_of.operands[0].shape[2], size,
                                                              n_keys, TILE)
    entries = inverse.shape[-1]
    slots = entries // (group * rows)
    # Each FlexAttention row's (query, head) row, in the kv heads' order ((head in group) * rows + query);
    # rows past the entries (padding) take row 0: they read no key, so their weight is 0.
    source = torch.zeros(row_block.shape, dtype=inverse.dtype, device=inverse.device).scatter_(
        2, inverse, (torch.arange(entries, device=inverse.device) // slots).expand_as(inverse))

    def by_kv_head(t):  # (batch, heads, rows, ...) -> (batch, kv_heads, group * rows, ...)
        return t.reshape(batch, kv_heads, group * rows, *t.shape[3:])

    with torch.enable_grad():
        q_leaf = q_entries.detach().requires_grad_()
        chunk_leaf = q_chunk.detach().requires_grad_()
        mask = by_block_mask(row_block, row_last, kv_count, kv_indices, full_count, size, n_keys, TILE, grad=True)
        o, part = sparse_far_flex._flex_call(q_leaf, k_leaf, v_leaf, mask, scale, "by_block_grad")
        o_tied, part_tied = sparse_far_flex._flex_call(
            chunk_leaf, k_leaf, v_leaf, by_query_block_mask(*tied, size, n_keys, rows, grad=True), scale, "by_query_grad")
        dout_e = by_kv_head(row_dout).gather(2, source[..., None].expand(-1, -1, -1, row_dout.shape[-1]))
        cotangents = (*_part_cotangents(o, part, dout_e, by_kv_head(row_dot).gather(2, source),
                                        by_kv_head(row_lse).gather(2, source)),
                      *_part_cotangents(o_tied, part_tied, row_dout, row_dot, row_lse))
        g_entries, g_chunk, g_k, g_v = torch.autograd.grad((o, part, o_tied, part_tied),
                                                           (q_leaf, chunk_leaf, k_leaf, v_leaf), cotangents)
    # Entry ((head in group) * rows + query) * slots + slot is FlexAttention row inverse[entry].
    g_q = g_entries.gather(2, inverse[..., None].expand(-1, -1, -1, dim)).view(batch, kv_heads, group * rows, slots, dim)
    g_q = g_q.to(row_dout.dtype).sum(3).view(batch, n_heads, rows, dim) + g_chunk.to(row_dout.dtype)
    return g_q, g_k.to(row_dout.dtype), g_v.to(row_dout.dtype)


def _part_cotangents(o, part, row_dout, row_dot, row_lse):
    """(d o, d part) of a part of the rows' merged softmax (module docstring), in o's / part's dtypes:
    weight exp(part - L), 0 where the part read nothing (-inf) or L is +inf (a row without cotangent).
    d part from d o as rounded to o's dtype: FlexAttention's backward takes (d o) . o - d part for the
    row's w D, which it then is exactly."""
    weight = torch.exp(part.to(row_lse.dtype) - row_lse)
    d_o = (weight[..., None] * row_dout).to(o.dtype)
    d_part = (d_o.to(row_dout.dtype) * o.to(row_dout.dtype)).sum(-1) - weight * row_dot
    return d_o, d_part.to(part.dtype)
