"""Windowed K/V gathers: each local chunk of queries receives, from the other ranks, only the
K/V entries its pattern can see (dilated_ring and block_sparse_ring), and sends the gradients of
those entries back to their owners in the backward.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .tokens import GlobalTokens
from .utils import Exchange, wait_all

# For the sparse kernels (dilated, block-sparse) each local chunk of queries is computed by the
# single-process kernel over a *window* [lo, end) of the global sequence, end = the chunk's end
# (its queries are then the window's last tokens, as the kernels expect) and lo = the first key
# any of its queries can see. The window holds this rank's own K/V plus, from the other ranks,
# exactly the (batch, kv head, token) entries that the pattern makes visible to some local query;
# every other entry is zero and, by construction, invisible. Positions and padding travel as
# explicit position_ids / attention_mask of the window, so the pattern (a function of positions
# and documents) is the same as on the whole sequence. Which entries are needed is computed on
# every rank from the gathered metadata, so no index lists are sent: only K/V values.


@dataclass
class WindowPlan:
    chunks: list  # (start, end) of each local chunk, local indices
    windows: list  # (lo, end) of each chunk's window, global indices
    need_from: dict  # src rank -> bool (batch, kv_heads, n_local): entries of src's tokens needed here
    need_by: dict  # dst rank -> bool (batch, kv_heads, n_local): entries of this rank's tokens dst needs
    tokens: GlobalTokens
    inputs: list = None  # per window: (attention_mask or None, position_ids or None), built once
    placements: list = None  # per window: where local and received entries go (see _placements)


def plan_windows(tokens: GlobalTokens, needed_keys, sliding_window: int | None = None) -> WindowPlan:
    """needed_keys(query_index) -> bool (batch, kv_heads, seq_len): the keys visible to some query
    of `query_index` (global indices) under the kernel's pattern. A sliding window hides every key
    `sliding_window` or more indices before a chunk's first query: none of those is sent (the
    kernel, given the same window, hides them inside the chunk's window of the sequence)."""
    from .layout import chunks_per_rank

    world, rank = tokens.world, tokens.rank
    n = tokens.local_index.numel()
    c = n // chunks_per_rank(tokens.layout)
    chunks = [(i * c, (i + 1) * c) for i in range(n // c)]
    index = torch.arange(tokens.positions.shape[1], device=tokens.positions.device)
    windows, need_from, need_by = [], {}, {}
    for r in range(world):
        r_index = tokens.rank_index(r)
        need_r = None
        for start, end in chunks:
            q_index = r_index[start:end]
            need = needed_keys(q_index) & (index <= q_index.max())  # causal, whatever the pattern says
            if sliding_window is not None:
                need &= index > q_index.min() - sliding_window
            need_r = need if need_r is None else need_r | need
            if r == rank:
                anywhere = need.any(0).any(0)
                first = int(anywhere.nonzero()[0]) if anywhere.any() else int(q_index[0])
                windows.append((min(first, int(q_index[0])), int(q_index[-1]) + 1))
        if r == rank:
            for s in range(world):
                if s != rank:
                    need_from[s] = need_r[:, :, tokens.rank_index(s)]
        else:
            need_by[r] = need_r[:, :, tokens.local_index]
    plan = WindowPlan(chunks, windows, need_from, need_by, tokens)
    plan.inputs = []
    for lo, hi in windows:  # the same tensor objects on every layer: the kernel's plan cache hits
        real = tokens.real[:, lo:hi]
        plan.inputs.append((None if bool(real.all()) else real,
                            None if tokens.plain and lo == 0 else tokens.positions[:, lo:hi]))
    plan.placements = _placements(plan, tokens.positions.device)
    return plan


class _GatherWindows(torch.autograd.Function):
    """(k, v) local shards -> the K/V windows of the local chunks; backward returns each entry's
    gradient to the rank that owns it."""

    @staticmethod
    def forward(ctx, k, v, plan: WindowPlan, exchange: Exchange):
        kv = torch.stack([k, v])
        sends = {d: kv[:, m].contiguous() for d, m in plan.need_by.items() if m.any()}
        recvs = {s: kv.new_empty((2, int(m.sum()), kv.shape[-1])) for s, m in plan.need_from.items() if m.any()}
        wait_all(exchange.start(sends, recvs, tag=10))
        placements = plan.placements
        outs = []
        for (lo, end), (mine, remote) in zip(plan.windows, placements):
            win = kv.new_zeros(kv.shape[:3] + (end - lo, kv.shape[-1]))
            src_cols, dst_cols = mine
            win[:, :, :, dst_cols] = kv[:, :, :, src_cols]
            for s, (bi, hi, cols, entries) in remote.items():
                win[:, bi, hi, cols] = recvs[s][:, entries]
            outs += [win[0], win[1]]
        ctx.plan, ctx.exchange, ctx.placements = plan, exchange, placements
        ctx.kv_shape, ctx.kv_dtype = kv.shape, kv.dtype
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        plan, exchange = ctx.plan, ctx.exchange
        dkv = torch.zeros(ctx.kv_shape, dtype=ctx.kv_dtype, device=plan.tokens.positions.device)
        dsend = {s: dkv.new_zeros((2, int(m.sum()), dkv.shape[-1])) for s, m in plan.need_from.items() if m.any()}
        for i, (mine, remote) in enumerate(ctx.placements):
            dk, dv = grads[2 * i], grads[2 * i + 1]
            if dk is None and dv is None:
                continue
            dwin = torch.stack([dk if dk is not None else torch.zeros_like(dv),
                                dv if dv is not None else torch.zeros_like(dk)])
            src_cols, dst_cols = mine
            dkv[:, :, :, src_cols] += dwin[:, :, :, dst_cols]
            for s, (bi, hi, cols, entries) in remote.items():
                dsend[s][:, entries] += dwin[:, bi, hi, cols]
        recvs = {d: dkv.new_empty((2, int(m.sum()), dkv.shape[-1])) for d, m in plan.need_by.items() if m.any()}
        wait_all(exchange.start(dsend, recvs, tag=11))
        for d, buf in recvs.items():
            dkv[:, plan.need_by[d]] += buf
        return dkv[0], dkv[1], None, None


def _placements(plan: WindowPlan, device):
    """Per window: where this rank's tokens go ((local cols, window cols)) and, per source rank,
    where its received entries go ((batch idx, head idx, window cols, entry mask))."""
    tokens = plan.tokens
    out = []
    for lo, end in plan.windows:
        local = tokens.local_index
        inside = (local >= lo) & (local < end)
        mine = (inside.nonzero().flatten(), local[inside] - lo)
        remote = {}
        for s, need in plan.need_from.items():
            s_index = tokens.rank_index(s)
            sel = need & ((s_index >= lo) & (s_index < end))[None, None, :]
            if not sel.any():
                continue
            bi, hi, ji = sel.nonzero(as_tuple=True)
            remote[s] = (bi, hi, s_index[ji] - lo, sel[need])
        out.append((mine, remote))
    return out


def windowed_attention(q, k, v, plan: WindowPlan, exchange: Exchange, kernel):
    """Runs kernel(q_chunk, k_window, v_window, attention_mask=..., position_ids=...) for every local
    chunk over its window and concatenates the chunks' outputs (this rank's shard of the output)."""
    wins = _GatherWindows.apply(k, v, plan, exchange)
    outs = []
    for i, ((start, end), (mask, positions)) in enumerate(zip(plan.chunks, plan.inputs)):
        outs.append(kernel(q[:, :, start:end], wins[2 * i], wins[2 * i + 1], attention_mask=mask,
                           position_ids=positions))
    return torch.cat(outs, dim=2)
