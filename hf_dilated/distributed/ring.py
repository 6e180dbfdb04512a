"""Ring attention: exact causal attention with the sequence split over a process group.

Each rank holds the queries, keys and values of its shard (layout.py). K/V travel around the
ring, one hop per step, with the next hop's send/receive posted before the attention of the
block in hand so that both overlap. The partial results of the steps merge in float32 by
log-sum-exp (ops/merge.py). The backward is a ring too: K/V travel again and the gradients
dK/dV travel with their block, arriving back at its owner after the last hop.

Memory falls as 1/P: what a rank holds beyond its inputs and outputs is a small fixed fraction of
them, whatever P. A rank's K/V does not travel as one block but as `KV_TILES` tiles, one ring of
P hops per tile, so a rank holds one tile in hand and one in flight (and, in the backward, their
dK/dV), never a peer's whole block; and each fused call takes at most 1/`ROW_SPLITS` of the local
queries, which bounds its output, log-sum-exp, mask and gradient temporaries. Every tile still
travels P - 1 hops, so the bytes sent are those of whole blocks.

Visibility (docs/contract.md 6: dense causal with padding and documents) is a function of
global token indices and the gathered metadata (tokens.global_tokens), so padding and packed
documents are honoured whatever rank a key comes from. Tiles lie inside one layout chunk, and the
queries are cut on the same grid, so without padding or packing a (query rows, key tile) pair is
fully visible, causal (the tile's own rows) or invisible, and no mask is built.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import DEFAULT_RING_LAYOUT
from ..ops.backend import attention_backward, attention_forward
from ..ops.merge import merge_dtype, merge_into
from ..ops.validate import check_int, check_qkv, check_scale_dropout
from .tokens import GlobalTokens, prepare_call
from .utils import Exchange, wait_all
from .groups import group_size_rank
from .layout import check_layout, chunks_per_rank

# In the backward, a query that sees no key at all gets this log-sum-exp instead of -inf, so the
# recomputed probabilities exp(s - lse) are 0 rather than NaN.
_EMPTY_ROW_LSE = 1e30

# Tiles per rank: a K/V tile in hand plus one in flight are 4 / KV_TILES of q's size (K and V, with
# as many kv heads as query heads), against the output's 1 that one process holds too. Measured at
# 16K tokens over 2 ranks (forward, float32): 32 tiles left 0.7 of q's size above the output, 64
# tiles 0.3, 128 tiles 0.23 for twice the steps; 64 keeps the forward within 1.25 / P of one process.
KV_TILES = 64
# Query rows per fused call: at most 1/ROW_SPLITS of the local queries, which bounds the call's
# output and log-sum-exp (forward), dQ (backward) and mask.
ROW_SPLITS = 32


@dataclass
class Piece:
    """One fused call of a ring step: local query rows x the whole key tile in hand."""
    rows: slice
    is_causal: bool
    # Padding / documents / window: the global indices of the rows and keys, to build the mask when
    # the call runs (built per call, never stored: it is (batch, rows, tile)).
    q_index: torch.Tensor | None = None
    k_index: torch.Tensor | None = None
    tokens: GlobalTokens | None = None
    window: int | None = None  # sliding window (docs/contract.md 3.3)

    def mask(self, dtype):
        """(additive bias (batch, 1, nq, nk) or None, bool rows with no visible key or None)."""
        if self.q_index is None:
            return None, None
        visible = _visible(self.tokens, self.q_index, self.k_index, self.window)
        bias = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
        bias.masked_fill_(~visible, float("-inf"))
        return bias[:, None], ~visible.any(-1)[:, None]


@dataclass
class RingPlan:
    tiles: list  # (start, stop) local index range of each K/V tile, the same on every rank
    steps: list  # steps[j][t]: the Pieces of tile j at hop t (the tile of rank (rank - t) mod P)


def _visible(tokens: GlobalTokens, qi, kj, window=None):
    visible = (kj[None, None, :] <= qi[None, :, None]) & tokens.real[:, None, kj]
    if window is not None:
        visible = visible & (kj[None, None, :] > qi[None, :, None] - window)
    return visible & (tokens.doc[:, qi, None] == tokens.doc[:, None, kj])


def ring_tiles(n_local: int, layout: str) -> list[tuple[int, int]]:
    """The local ranges the shard is cut into (for both keys and queries): KV_TILES in all, as
    equal as can be, each inside one layout chunk (so its global indices are consecutive)."""
    cpr = chunks_per_rank(layout)
    c = n_local // cpr
    per_chunk = max(1, min(c, KV_TILES // cpr))
    return [(ch * c + i * c // per_chunk, ch * c + (i + 1) * c // per_chunk)
            for ch in range(cpr) for i in range(per_chunk)]


def _runs(tiles, kinds, max_rows):
    """Consecutive local query tiles of one kind ("full"), joined while at most max_rows long."""
    runs, cur = [], None
    for (a, b), kind in zip(tiles, kinds):
        if kind == "full" and cur is not None and cur[1] == a and b - cur[0] <= max_rows:
            cur = (cur[0], b)
            continue
        if cur is not None:
            runs.append(cur)
        cur = (a, b) if kind == "full" else None
        if kind == "causal":
            runs.append((a, b, "causal"))
    if cur is not None:
        runs.append(cur)
    return runs


def ring_plan(tokens: GlobalTokens, window: int | None = None) -> RingPlan:
    """For each tile j and hop t (tile j of rank (rank - t) mod P), the Pieces to compute; a piece
    is left out when a sliding `window`, padding or documents hide all its pairs."""
    world, rank = tokens.world, tokens.rank
    n_local = tokens.local_index.numel()
    tiles = ring_tiles(n_local, tokens.layout)
    max_rows = max(1, n_local // ROW_SPLITS)
    q_first = [int(tokens.local_index[a]) for a, _ in tiles]
    src_index = [tokens.rank_index(r) for r in range(world)]  # the pieces keep views of these
    steps = []
    for a, b in tiles:
        hops = []
        for t in range(world):
            src = (rank - t) % world
            kj = src_index[src][a:b]
            k0, k1 = int(kj[0]), int(kj[-1]) + 1
            # Query tiles and key tiles lie on one grid: a query tile is after the key tile (full),
            # is it (causal) or is before it (nothing visible).
            kinds = ["full" if k1 <= q0 else "causal" if q0 == k0 else None for q0 in q_first]
            pieces = []
            for run in _runs(tiles, kinds, max_rows):
                rows = slice(run[0], run[1])
                causal = len(run) == 3
                qi = tokens.local_index[rows]
                if window is not None and int(qi[0]) - k1 + 1 >= window:
                    continue  # the window hides every pair
                cut = window is not None and int(qi[-1]) - k0 >= window  # the window hides some pair
                if tokens.plain and not cut:
                    pieces.append(Piece(rows, is_causal=causal))
                elif bool(_visible(tokens, qi, kj, window).any()):
                    pieces.append(Piece(rows, False, qi, kj, tokens, window))
            hops.append(pieces)
        steps.append(hops)
    return RingPlan(tiles, steps)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, exchange: Exchange, plan: RingPlan, scale):
        acc = merge_dtype(q.dtype)
        out = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)
        world = exchange.world
        for (a, b), hops in zip(plan.tiles, plan.steps):
            # K and V travel as two messages (no stacked copy); the own tile is copied out of the
            # shard once, so the message is a live tensor until its send completes.
            kv = (k[:, :, a:b].contiguous(), v[:, :, a:b].contiguous())
            for t, pieces in enumerate(hops):
                if t + 1 < world:  # post the next hop before computing on the tile in hand
                    kv_next, works = exchange.ring_shift(kv, tag=0)
                for piece in pieces:
                    bias, empty_rows = piece.mask(q.dtype)
                    o, l = attention_forward(q[:, :, piece.rows], kv[0], kv[1], is_causal=piece.is_causal,
                                             scale=scale, attn_bias=bias)
                    o, l = o.to(acc), l.to(acc)
                    if empty_rows is not None:  # the kernel reports lse 0 for a row with no key
                        l = l.masked_fill(empty_rows, float("-inf"))
                    merge_into(out[:, :, piece.rows], lse[:, :, piece.rows], o, l)
                    del o, l, bias
                if t + 1 < world:
                    wait_all(works)
                    kv = kv_next
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.exchange, ctx.plan, ctx.scale = exchange, plan, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        exchange, plan, scale = ctx.exchange, ctx.plan, ctx.scale
        world = exchange.world
        acc = merge_dtype(q.dtype)
        dout = dout.contiguous()
        lse = torch.where(torch.isfinite(lse), lse, torch.full_like(lse, _EMPTY_ROW_LSE)).to(
            torch.float32 if q.dtype != torch.float64 else torch.float64)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        for (a, b), hops in zip(plan.tiles, plan.steps):
            kv = (k[:, :, a:b].contiguous(), v[:, :, a:b].contiguous())
            dkv_in, dkv_works = None, []  # set at every hop: the tile's dK/dV arriving from the previous rank
            for t, pieces in enumerate(hops):
                if t + 1 < world:
                    kv_next, kv_works = exchange.ring_shift(kv, tag=0)
                mine = None  # this rank's contribution to the dK/dV of the tile in hand
                for piece in pieces:
                    r = piece.rows
                    bias, _ = piece.mask(q.dtype)
                    gq, gk, gv = attention_backward(dout[:, :, r], q[:, :, r], kv[0], kv[1], out[:, :, r],
                                                    lse[:, :, r], is_causal=piece.is_causal, scale=scale,
                                                    attn_bias=bias)
                    dq[:, :, r] += gq
                    if mine is None:  # it is sent on: a contiguous buffer (the kernel's may be strided)
                        mine = [gk.to(acc).contiguous(), gv.to(acc).contiguous()]
                    else:
                        mine[0] += gk
                        mine[1] += gv
                    del gq, gk, gv, bias
                if t == 0:  # the tile's first hop: its dK/dV start here
                    dkv = mine if mine is not None else [kv[0].new_zeros(kv[0].shape, dtype=acc),
                                                         kv[1].new_zeros(kv[1].shape, dtype=acc)]
                else:  # the accumulated dK/dV of the tile in hand, from the previous rank
                    wait_all(dkv_works)
                    dkv = dkv_in
                    if mine is not None:
                        dkv[0] += mine[0]
                        dkv[1] += mine[1]
                del mine
                dkv_in, dkv_works = exchange.ring_shift(dkv, tag=1)
                del dkv
                if t + 1 < world:
                    wait_all(kv_works)
                    kv = kv_next
            wait_all(dkv_works)  # after P hops the tile's gradient is back with its owner
            dk[:, :, a:b] = dkv_in[0]
            dv[:, :, a:b] = dkv_in[1]
        return dq.to(q.dtype), dk, dv, None, None, None


def ring_attention(q, k, v, *, group=None, layout: str = DEFAULT_RING_LAYOUT, scale=None, attention_mask=None,
                   position_ids=None, dropout_p: float = 0.0, sliding_window: int | None = None):
    """Exact causal attention over a sequence sharded across `group`.

    q (batch, q_heads, n, head_dim), k/v (batch, kv_heads, n, head_dim): this rank's shard of the
    global sequence in `layout` ("zigzag" or "contiguous", see layout.py); attention_mask and
    position_ids (batch or 1, n): this rank's shards of the global ones; sliding_window: as in
    docs/contract.md 3.3, by global index. Returns this rank's shard of the output. Every rank of the group must call it with the same shapes and arguments.
    With group None or of size 1 this is `hf_dilated.ops.dense_attention` (exact dense causal
    attention, whatever the positions).
    """
    check_layout(layout)
    check_qkv(q, k, v, attention_mask, position_ids)
    check_scale_dropout(scale, dropout_p)
    check_int("sliding_window", sliding_window, optional=True)
    world, _ = group_size_rank(group)
    if world == 1:
        from ..ops.dense import dense_attention

        return dense_attention(q, k, v, scale=scale, dropout_p=dropout_p, attention_mask=attention_mask,
                               position_ids=position_ids, sliding_window=sliding_window)
    if dropout_p:
        raise ValueError(f"dropout_p: ring attention does not implement attention dropout, got {dropout_p}")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    plan = prepare_call("ring_attention", q, k, v, attention_mask=attention_mask, position_ids=position_ids,
                          group=group, layout=layout, scale=scale, sliding_window=sliding_window,
                          build=lambda tokens: ring_plan(tokens, sliding_window))
    return _RingAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), Exchange(group, "ring"),
                                plan, scale)
