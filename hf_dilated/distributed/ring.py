"""Ring attention: exact causal attention with the sequence split over a process group.

Each rank holds the queries, keys and values of its shard (layout.py). K/V blocks travel around
the ring, one hop per step, with the next hop's send/receive posted before the attention of the
block in hand so that both overlap. The partial results of the steps merge in float32 by
log-sum-exp (ops/merge.py). The backward is a ring too: K/V travel again and the gradients
dK/dV travel with their block, arriving back at its owner after the last step.

Visibility (docs/contract.md 6: dense causal with padding and documents) is a function of
global token indices and the gathered metadata (tokens.global_tokens), so padding and packed
documents are honoured whatever rank a key comes from. Without padding or packing the blocks of
a step are either fully visible, causal (the rank's own block) or invisible, so no mask is built.
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
from .layout import check_layout, chunks_per_rank, rank_chunks

# In the backward, a query that sees no key at all gets this log-sum-exp instead of -inf, so the
# recomputed probabilities exp(s - lse) are 0 rather than NaN.
_EMPTY_ROW_LSE = 1e30


@dataclass
class Piece:
    """The part of one ring step that has visible pairs: local query rows x the block's key cols."""
    rows: slice
    cols: slice
    is_causal: bool
    # Padding / documents: the global indices of the rows and cols, to build the mask when the
    # step runs (built per step, never stored: it is (batch, nq, nk)).
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


def _visible(tokens: GlobalTokens, qi, kj, window=None):
    visible = (kj[None, None, :] <= qi[None, :, None]) & tokens.real[:, None, kj]
    if window is not None:
        visible = visible & (kj[None, None, :] > qi[None, :, None] - window)
    return visible & (tokens.doc[:, qi, None] == tokens.doc[:, None, kj])


def ring_pieces(tokens: GlobalTokens, window: int | None = None) -> list[Piece | None]:
    """For each ring step t (block of rank (rank - t) mod P), the Piece to compute, or None (also
    when a sliding `window` hides the whole block from this rank's queries)."""
    world, rank, layout = tokens.world, tokens.rank, tokens.layout
    n_local = tokens.local_index.numel()
    c = n_local // chunks_per_rank(layout)
    q_chunks = rank_chunks(layout, world, rank)
    pieces = []
    for step in range(world):
        src = (rank - step) % world
        k_chunks = rank_chunks(layout, world, src)
        rel = [[(b < a) + 2 * (b == a) for b in k_chunks] for a in q_chunks]  # 0 none, 1 full, 2 causal
        rows = [i for i in range(len(q_chunks)) if any(rel[i])]
        cols = [j for j in range(len(k_chunks)) if any(rel[i][j] for i in rows)]
        if not rows:
            pieces.append(None)
            continue
        rsl = slice(rows[0] * c, (rows[-1] + 1) * c)
        csl = slice(cols[0] * c, (cols[-1] + 1) * c)
        all_full = all(rel[i][j] == 1 for i in rows for j in cols)
        qi = tokens.local_index[rsl]
        kj = tokens.rank_index(src)[csl]
        cut = window is not None and int(qi.max()) - int(kj.min()) >= window  # the window hides some pair
        if tokens.plain and not cut and (all_full or src == rank):
            pieces.append(Piece(rsl, csl, is_causal=not all_full))
            continue
        if not _visible(tokens, qi, kj, window).any():
            pieces.append(None)
            continue
        pieces.append(Piece(rsl, csl, False, qi, kj, tokens, window))
    return pieces


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, exchange: Exchange, pieces, scale):
        acc = merge_dtype(q.dtype)
        out = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)
        kv = (k, v)  # K and V travel as two messages: no stacked copy
        for step, piece in enumerate(pieces):
            if step + 1 < len(pieces):  # post the next hop before computing on the block in hand
                kv_next, works = exchange.ring_shift(kv, tag=0)
            if piece is not None:
                bias, empty_rows = piece.mask(q.dtype)
                o, l = attention_forward(q[:, :, piece.rows], kv[0][:, :, piece.cols], kv[1][:, :, piece.cols],
                                         is_causal=piece.is_causal, scale=scale, attn_bias=bias)
                o, l = o.to(acc), l.to(acc)
                if empty_rows is not None:  # the kernel reports lse 0 for a row with no key
                    l = l.masked_fill(empty_rows, float("-inf"))
                merge_into(out[:, :, piece.rows], lse[:, :, piece.rows], o, l)
            if step + 1 < len(pieces):
                wait_all(works)
                kv = kv_next
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.exchange, ctx.pieces, ctx.scale = exchange, pieces, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        exchange, pieces, scale = ctx.exchange, ctx.pieces, ctx.scale
        acc = merge_dtype(q.dtype)
        dout = dout.contiguous()
        lse = torch.where(torch.isfinite(lse), lse, torch.full_like(lse, _EMPTY_ROW_LSE)).to(
            torch.float32 if q.dtype != torch.float64 else torch.float64)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dkv = [torch.zeros(k.shape, dtype=acc, device=k.device) for _ in range(2)]  # travels with its block
        kv = (k, v)
        dkv_in, dkv_works = None, []  # set at the end of every step: the dK/dV arriving from the previous rank
        for step, piece in enumerate(pieces):
            if step + 1 < len(pieces):
                kv_next, kv_works = exchange.ring_shift(kv, tag=0)
            grads = None
            if piece is not None:
                r, c = piece.rows, piece.cols
                bias, _ = piece.mask(q.dtype)
                grads = attention_backward(dout[:, :, r], q[:, :, r], kv[0][:, :, c], kv[1][:, :, c],
                                           out[:, :, r], lse[:, :, r], is_causal=piece.is_causal,
                                           scale=scale, attn_bias=bias)
                dq[:, :, r] += grads[0]
            if step > 0:  # the accumulated dK/dV of the block in hand, from the previous rank
                wait_all(dkv_works)
                dkv = dkv_in
            if grads is not None:
                dkv[0][:, :, c] += grads[1]
                dkv[1][:, :, c] += grads[2]
            dkv_in, dkv_works = exchange.ring_shift(dkv, tag=1)
            if step + 1 < len(pieces):
                wait_all(kv_works)
                kv = kv_next
        wait_all(dkv_works)  # after P hops every block's gradient is back with its owner
        return dq.to(q.dtype), dkv_in[0].to(k.dtype), dkv_in[1].to(v.dtype), None, None, None


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
    pieces = prepare_call("ring_attention", q, k, v, attention_mask=attention_mask, position_ids=position_ids,
                          group=group, layout=layout, scale=scale, sliding_window=sliding_window,
                          build=lambda tokens: ring_pieces(tokens, sliding_window))
    return _RingAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), Exchange(group, "ring"),
                                pieces, scale)
