"""Union dilated attention with a local band (docs/contract.md 4.1): every key within `local_window`
positions of its query, united with the union levels' keys further back, which may be read with a
second pair of query/key projections (`q_far`, `k_far`: the same vectors rotated to grouped
positions, Self-Extend style, so that far keys sit at relative positions the model was trained on).

How it is computed. Query chunks of `_CHUNK` tokens; per chunk two fused calls that return the
log-sum-exp (backend.py), merged by it (merge.py): the *near* call reads (q, k) over the keys a
chunk's band can reach (about `local_window` + chunk keys), the *far* call (q_far, k_far) over the
keys before it. Which keys each query may read is an additive mask built from the kernels' token
rule (positions, documents, padding: ops/token_layout.py), so padding, packing, decode and chunked
prefill are exact by construction; a chunk whose far part holds no key skips the call. The
backward is the flash backward of each call fed with the merged output and log-sum-exp, so
training keeps no probability matrix. Cost per query: the band plus the keys before it (the masks
select the levels' share of them; the fused kernel does not skip masked keys).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .backend import attention_backward, attention_forward
from .merge import merge_dtype, merge_into
from .token_layout import TokenLayout, token_layout

_CHUNK = 512  # queries per call: a (heads x chunk x keys) mask stays a few hundred MB at 16K keys


@dataclass(frozen=True)
class _Call:
    queries: slice  # query rows (of q / q_far)
    keys: slice  # key rows (of k / k_far)
    far: bool  # reads q_far / k_far


@dataclass
class _Plan:
    layout: TokenLayout
    segment_lengths: list
    dilation_rates: list
    window: int
    is_causal: bool
    sliding_window: int | None
    first: int  # key index of the first query
    calls: list


def local_band_attention(q, k, v, segment_lengths, dilation_rates, *, local_window: int, q_far=None, k_far=None,
                         is_causal: bool = True, scale: float, dropout_p: float = 0.0, attention_mask=None,
                         position_ids=None, sliding_window=None):
    """Inputs as `dilated_attention` (validated there), mode "union" with a local band of
    `local_window` positions; `q_far`/`k_far` (shaped like q/k, or both None) score the keys beyond it."""
    if dropout_p > 0.0:
        raise ValueError(f"dropout_p: a local band (local_window) has no attention dropout yet, got {dropout_p}")
    layout = token_layout(k.shape[0], k.shape[2], k.device, attention_mask, position_ids)
    plan = _plan(layout, q.shape[2], list(segment_lengths), list(dilation_rates), local_window, is_causal,
                 sliding_window)
    if q_far is None:
        q_far, k_far = q, k
    return _LocalBand.apply(q, k, v, q_far, k_far, plan, scale)


def _plan(layout, q_len, seg, dil, window, is_causal, sliding_window) -> _Plan:
    """The calls: per query chunk, near keys from the first index its band (or sliding window) can
    reach, far keys up to the last one beyond some query's band. In a document positions advance
    at least one per real token, so a key more than `window` - 1 *real tokens* before the chunk's
    first query is beyond every band."""
    batch, kv_len = layout.real.shape
    first = kv_len - q_len
    real = layout.real.long()
    before = real.cumsum(1) - real  # real tokens before each index
    calls = []
    for s in range(0, q_len, _CHUNK):
        e = min(q_len, s + _CHUNK)
        stop = first + e if is_causal else kv_len
        need = (before[:, first + s] - (window - 1)).clamp(min=0)
        near_lo = int(torch.searchsorted(before.contiguous(), need[:, None].contiguous()).min())
        if sliding_window is not None:
            near_lo = max(near_lo, first + s - (sliding_window - 1))
        # Within a document a position advances at most as far as the index (3.1), so a key W or more
        # positions before the chunk's last query lies at least W indices before it.
        far_stop = max(0, first + e - window) if is_causal else kv_len
        far_lo = 0 if sliding_window is None else max(0, first + s - (sliding_window - 1))
        calls.append(_Call(slice(s, e), slice(near_lo, stop), False))
        if far_stop > far_lo:
            calls.append(_Call(slice(s, e), slice(far_lo, far_stop), True))
    return _Plan(layout, seg, dil, window, is_causal, sliding_window, first, calls)


def _visible(plan: _Plan, call: _Call, n_heads: int) -> torch.Tensor:
    """bool (batch, heads or 1, queries, keys) of one call: base-visible keys in the band (near) or
    beyond it and held by some union level for the head (far)."""
    pos, doc, real = plan.layout.positions, plan.layout.doc, plan.layout.real
    device = pos.device
    i = torch.arange(plan.first + call.queries.start, plan.first + call.queries.stop, device=device)
    j = torch.arange(call.keys.start, call.keys.stop, device=device)
    p_i, p_j = pos[:, i], pos[:, j]
    visible = real[:, None, j] & (doc[:, i, None] == doc[:, None, j])
    if plan.is_causal:
        visible = visible & (j[None, None, :] <= i[None, :, None])
    if plan.sliding_window is not None:
        visible = visible & (j[None, None, :] > i[None, :, None] - plan.sliding_window)
    in_band = (p_i[:, :, None] - p_j[:, None, :]).abs() < plan.window
    if not call.far:
        return (visible & in_band)[:, None]
    visible = (visible & ~in_band)[:, None]
    heads = torch.arange(n_heads, device=device)
    levels = torch.zeros((), dtype=torch.bool, device=device)
    for w, r in zip(plan.segment_lengths, plan.dilation_rates):
        same = ((p_i[:, :, None] // w) == (p_j[:, None, :] // w))[:, None]
        if r == 1:
            levels = levels | same
            continue
        offset = (heads % r)[None, :, None]
        sel_i = ((p_i % w) % r)[:, None, :] == offset  # (batch, heads, q)
        sel_j = ((p_j % w) % r)[:, None, :] == offset  # (batch, heads, k)
        levels = levels | (same & sel_i[..., None] & sel_j[:, :, None, :])
    return visible & levels


def _bias(visible: torch.Tensor, dtype) -> torch.Tensor:
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))


def _inputs(call: _Call, q, k, v, q_far, k_far):
    qs = (q_far if call.far else q)[:, :, call.queries]
    ks = (k_far if call.far else k)[:, :, call.keys]
    return qs, ks, v[:, :, call.keys]


def _forward(q, k, v, q_far, k_far, plan: _Plan, scale):
    acc_dtype = merge_dtype(q.dtype)
    out = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=acc_dtype, device=q.device)
    for call in plan.calls:
        visible = _visible(plan, call, q.shape[1])
        if not bool(visible.any()):
            continue
        qs, ks, vs = _inputs(call, q, k, v, q_far, k_far)
        o, part_lse = attention_forward(qs, ks, vs, is_causal=False, scale=scale, attn_bias=_bias(visible, q.dtype))
        part_lse = part_lse.masked_fill(~visible.any(-1).expand(part_lse.shape), float("-inf"))  # no key: -inf
        merge_into(out[:, :, call.queries], lse[:, :, call.queries], o, part_lse.to(acc_dtype))
    return out.to(q.dtype), lse


class _LocalBand(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, q_far, k_far, plan, scale):
        out, lse = _forward(q, k, v, q_far, k_far, plan, scale)
        ctx.save_for_backward(q, k, v, q_far, k_far, out, lse)
        ctx.plan, ctx.scale, ctx.shared = plan, scale, q_far is q
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, q_far, k_far, out, lse = ctx.saved_tensors
        plan, scale = ctx.plan, ctx.scale
        acc = merge_dtype(q.dtype)
        grads = {name: torch.zeros(t.shape, dtype=acc, device=t.device)
                 for name, t in (("q", q), ("k", k), ("v", v), ("q_far", q_far), ("k_far", k_far))}
        lse_b = lse.masked_fill(lse == float("-inf"), float("inf"))  # rows with no key: probability 0
        dout = dout.to(q.dtype)
        for call in plan.calls:
            visible = _visible(plan, call, q.shape[1])
            if not bool(visible.any()):
                continue
            qs, ks, vs = _inputs(call, q, k, v, q_far, k_far)
            rows = call.queries
            g_q, g_k, g_v = attention_backward(
                dout[:, :, rows].contiguous(), qs, ks, vs, out[:, :, rows].contiguous(),
                lse_b[:, :, rows].contiguous(),
                is_causal=False, scale=scale, attn_bias=_bias(visible, q.dtype))
            grads["q_far" if call.far else "q"][:, :, rows] += g_q
            grads["k_far" if call.far else "k"][:, :, call.keys] += _sum_groups(g_k, k.shape[1])
            grads["v"][:, :, call.keys] += _sum_groups(g_v, k.shape[1])
        dq, dk, dv = grads["q"].to(q.dtype), grads["k"].to(k.dtype), grads["v"].to(v.dtype)
        if ctx.shared:  # one projection: its far use adds to the same gradients
            return (dq + grads["q_far"].to(q.dtype), dk + grads["k_far"].to(k.dtype), dv, None, None, None, None)
        return dq, dk, dv, grads["q_far"].to(q.dtype), grads["k_far"].to(k.dtype), None, None


def _sum_groups(g, kv_heads):
    """A key gradient with one head per query head (a backend that repeats K/V) summed per kv head."""
    if g.shape[1] == kv_heads:
        return g
    return g.unflatten(1, (kv_heads, g.shape[1] // kv_heads)).sum(2)
