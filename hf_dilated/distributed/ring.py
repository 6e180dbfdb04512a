"""Ring attention: exact causal attention with the sequence split over a process group.

Each rank holds the queries, keys and values of its shard (layout.py). K/V travel around the
ring, one hop per step, with the next hop's send/receive posted before the attention of the
block in hand so that both overlap. The partial results of the steps merge in float32 by
log-sum-exp (ops/merge.py). The backward is a ring too: K/V travel again and the gradients
dK/dV travel with their block, arriving back at its owner after the last hop.

Memory falls as 1/P: what a rank holds beyond its inputs and outputs is a small fixed fraction of
them, whatever P. A rank's K/V does not travel as one block but as tiles (`KV_TILES`; ring_plan's
`kv_tiles`), one ring of P hops per tile, so a rank holds one tile in hand and one in flight (and,
in the backward, their dK/dV), never a peer's whole block; and each fused call takes at most
1/`ROW_SPLITS` of the local queries, which bounds its output, log-sum-exp, mask and gradient
temporaries. Every tile still travels P - 1 hops, so the bytes sent are those of whole blocks.

What a call attends is a `RingPattern`: the pairs of global tokens it lets through, and the hooks
ring_plan and the fused calls read. The base class is dense causal attention, what ring_attention
runs; dilated_ring and block_sparse_ring run on this ring with a sparse pattern of their own:
each call gets the pattern between its global tokens as a mask, a call where no query needs a key
of the tile is skipped, and a tile travels on with only the entries some rank further along the
ring needs, zero elsewhere (its dK/dV come back with only the entries that were used), so those
kernels send at most what this one does. A compacted pattern's calls take, per head, only the rows
and keys of its pairs (Piece.compact), so their work falls with the pattern's density instead of
being that of dense attention under a mask.

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
from ..ops.token_layout import visible_pairs
from ..ops.merge import merge_dtype, merge_into
from ..ops.validate import check_int, check_qkv, check_scale_dropout
from .tokens import GlobalTokens, prepare_call
from .utils import Exchange, wait_all, weighted_bias
from .groups import group_size_rank
from .layout import check_layout, chunks_per_rank

# In the backward, a query that sees no key at all gets this log-sum-exp instead of -inf, so the
# recomputed probabilities exp(s - lse) are 0 rather than NaN.
_EMPTY_ROW_LSE = 1e30

# Tiles per rank. A K/V tile in hand plus one in flight are 4 / KV_TILES of q's size (K and V, with
# as many kv heads as query heads), against the output's 1 that one process holds too: more tiles
# hold less, but each is one more ring of P hops, and past a point the fixed costs of a call and a
# message outweigh the memory they save (measurements: docs/benchmarks.md, Distributed).
KV_TILES = 64
# Query rows per fused call: at most 1/ROW_SPLITS of the local queries, which bounds the call's
# output and log-sum-exp (forward), dQ (backward) and mask.
ROW_SPLITS = 32
# But never tiles under MIN_TILE tokens nor calls under MIN_ROWS rows: below that the memory is
# negligible, and each call's dK/dV comes back rounded to the input dtype, so in bfloat16 many tiny
# calls would add up many roundings (the fused kernel accumulates a call in float32).
MIN_TILE, MIN_ROWS = 16, 64


def _max_rows(n_local: int) -> int:
    return max(MIN_ROWS, n_local // ROW_SPLITS)


def _max_pairs(n_local: int) -> int:
    """(query row, key) pairs per head of a compacted call: twice those of a dense call on the
    default tiling, whatever the tiles. Its bias and gathered rows grow with it, and many small
    calls cost more than their work (measurements: docs/benchmarks.md, Distributed)."""
    return 2 * _max_rows(n_local) * max(MIN_TILE, n_local // KV_TILES)


_NO_INDEX = 2**62  # beyond every global index: what a masked-out entry is given before a min or max


@dataclass(eq=False)
class RingPattern:
    """The (query, key) pairs a ring kernel attends, as the hooks ring_plan and the fused calls
    read. q_index and k_index are global token indices, (n,), or per head (batch, heads, n) in a
    compacted call.

    This class is dense causal attention under the kernels' base rule (`visible`), what
    ring_attention runs. A sparse kernel subclasses it, sets `sparse` and gives `needed_keys` and
    `weight`; one whose calls are to be compacted also sets `compacted` and gives `select` and
    `full` (and `calls`, when a call needs more than the base rule and `weight`)."""
    tokens: GlobalTokens
    window: int | None  # sliding window (docs/contract.md 3.3)
    sparse = False  # needed_keys and weight narrow the base rule
    compacted = False  # calls run on, per head, only the rows and keys of the pattern's pairs

    def visible(self, q_index, k_index) -> torch.Tensor:
        """bool (batch, 1 or heads, rows, keys): the base rule (docs/contract.md 3: real keys, same
        document, causal, the sliding window)."""
        return visible_pairs(self.tokens, q_index, k_index, sliding_window=self.window)

    def weight(self, q_index, k_index) -> torch.Tensor | None:
        """How a sparse pattern takes each pair on top of the base rule, (batch or 1, heads or 1,
        rows, keys): bool (lets it through) or a count c (the key is read c times: it weighs
        exp(s + log c)). None: every pair."""
        return None

    def needed_keys(self, query_index) -> torch.Tensor:
        """Sparse patterns: bool (batch, kv_heads, seq_len), a superset of the keys `weight` lets some
        query of `query_index` see. From it every rank knows, for each tile and hop, which calls it
        skips, which entries some rank further along the ring still needs (only those travel on)
        and which entries earlier ranks used (only their gradients travel back), with no message
        about it."""
        raise NotImplementedError

    def select(self, q_index, k_index):
        """Compacted patterns, for a (rows, key tile) call: bool (batch, heads, rows) and (batch,
        heads, keys), for each head a superset of the rows and keys in some pair it lets through;
        and (rows,) ints or None: rows of one value relate alike to the tile (compacted apart)."""
        raise NotImplementedError

    def full(self, q_index, k_index, q_valid, k_valid) -> bool:
        """Compacted patterns: whether `weight` lets every pair of valid entries through (per head
        indices, bool q_valid / k_valid of their shapes)."""
        raise NotImplementedError

    def mask(self, q_index, k_index, dtype):
        """(additive bias (batch, 1 or heads, rows, keys), bool rows with no visible key) of a call."""
        return weighted_bias(self.visible(q_index, k_index), self.weight(q_index, k_index), dtype)

    def calls(self, q_index, k_index, q_valid, k_valid, dtype) -> list:
        """The fused calls on one compacted grid (per head indices; q_valid / k_valid: the selected
        entries, the others pad): [(far, bias, empty)], far: whether the call reads the second pair
        of projections of run_ring (q_far, k_far) instead of (q, k); bias and empty as in mask,
        None when every pair is visible."""
        if self.all_visible(q_index, k_index, q_valid, k_valid) and self.full(q_index, k_index, q_valid, k_valid):
            return [(False, None, None)]
        visible = self.visible(q_index, k_index) & q_valid[..., None] & k_valid[..., None, :]
        return [(False, *weighted_bias(visible, self.weight(q_index, k_index), dtype))]

    def all_visible(self, q_index, k_index, q_valid, k_valid) -> bool:
        """Whether the base rule lets every pair of valid entries of a grid through, told without
        building it: plain tokens (positions are the global indices), no window, every key valid
        and before every valid row."""
        if not (self.tokens.plain and self.window is None and bool(k_valid.all())):
            return False
        first_row = torch.where(q_valid, q_index, _NO_INDEX).amin(-1)
        return bool((k_index.amax(-1) < first_row).all())


@dataclass
class Piece:
    """One fused call of a ring step: local query rows x the whole key tile in hand."""
    rows: slice | torch.Tensor  # local query rows (a tensor of them for a compacted call)
    is_causal: bool = False
    # A masked call: the global indices of the rows and keys, and the pattern to build the mask from
    # when the call runs (built per call, never stored: it is (batch, heads, rows, tile)).
    q_index: torch.Tensor | None = None
    k_index: torch.Tensor | None = None
    pattern: RingPattern | None = None

    @property
    def compacted(self) -> bool:
        return self.pattern is not None and self.pattern.compacted

    def mask(self, dtype):
        """(additive bias (batch, 1 or heads, nq, nk) or None, bool rows with no visible key or None)."""
        if self.q_index is None:
            return None, None
        return self.pattern.mask(self.q_index, self.k_index, dtype)

    def compact(self, dtype):
        """The compacted grids: (rows, keys, valid, calls) for each. rows (batch, heads, n_rows):
        local row indices; keys (batch, heads, n_keys): indices in the tile; valid: which entries of
        rows are selected (the others pad each head to the longest, and see no key); calls: the
        fused calls on that grid (RingPattern.calls). A sparse pattern's work then falls with its
        density: a head reading one key in r of a tile at one query in r runs 1/r^2 of the dense
        call."""
        row_sel, key_sel, group = self.pattern.select(self.q_index, self.k_index)
        if group is None:
            yield from self._compact_grids(self.rows, self.q_index, row_sel, key_sel, dtype)
            return
        for value in torch.unique(group):  # rows that relate alike to the tile: selected again, apart
            part = group == value
            rows, q_index = self.rows[part], self.q_index[part]
            row_sel, key_sel, _ = self.pattern.select(q_index, self.k_index)
            yield from self._compact_grids(rows, q_index, row_sel, key_sel, dtype)

    def _compact_grids(self, local_rows, q_index, row_sel, key_sel, dtype):
        n_rows, n_keys = int(row_sel.sum(-1).max()), int(key_sel.sum(-1).max())
        if n_rows == 0 or n_keys == 0:
            return
        # The selected entries first, in order (a stable sort); the rest pad.
        rows = torch.sort((~row_sel).to(torch.uint8), dim=-1, stable=True).indices[..., :n_rows]
        keys = torch.sort((~key_sel).to(torch.uint8), dim=-1, stable=True).indices[..., :n_keys]
        valid, key_valid = row_sel.gather(-1, rows), key_sel.gather(-1, keys)
        k_index = self.k_index[keys]
        step = max(MIN_ROWS, _max_pairs(self.pattern.tokens.local_index.numel()) // n_keys)
        for start in range(0, n_rows, step):
            part, ok = rows[..., start:start + step], valid[..., start:start + step]
            yield local_rows[part], keys, ok, self.pattern.calls(q_index[part], k_index, ok, key_valid, dtype)


@dataclass
class RingPlan:
    tiles: list  # (start, stop) local index range of each K/V tile, the same on every rank
    steps: list  # steps[j][t]: the Pieces of tile j at hop t (the tile of rank (rank - t) mod P)
    tokens: GlobalTokens  # what the plan was built from
    # Sparse patterns only (None: whole tiles travel). kv_out[j][t] / kv_in[j][t]: bool (batch,
    # kv_heads, tile) entries of the K/V tile this rank sends / receives at hop t; grad_out[j][t] /
    # grad_in[j][t]: entries of the dK/dV message it sends / receives at hop t >= 1.
    kv_out: list | None = None
    kv_in: list | None = None
    grad_out: list | None = None
    grad_in: list | None = None
    # The pattern the pieces read: a kernel whose calls also read data of one call (dilated_ring's
    # sparse far keys) runs a copy of the cached plan on a copy of it.
    pattern: RingPattern | None = None


def ring_tiles(n_local: int, layout: str, kv_tiles: int = KV_TILES) -> list[tuple[int, int]]:
    """The local ranges the shard is cut into (for both keys and queries): kv_tiles in all, as
    equal as can be, each inside one layout chunk (so its global indices are consecutive)."""
    cpr = chunks_per_rank(layout)
    c = n_local // cpr
    per_chunk = max(1, min(c // MIN_TILE, kv_tiles // cpr))
    return [(ch * c + i * c // per_chunk, ch * c + (i + 1) * c // per_chunk)
            for ch in range(cpr) for i in range(per_chunk)]


def _runs(tiles, kinds, max_rows):
    """The calls against one key tile: each causal query tile alone, consecutive fully visible ones
    joined while at most max_rows long; (start, stop) or (start, stop, "causal")."""
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


def ring_plan(pattern: RingPattern, kv_tiles: int = KV_TILES) -> RingPlan:
    """For each tile j and hop t (tile j of rank (rank - t) mod P), the Pieces to compute; a piece
    is left out when the pattern (its sliding window, padding, documents, sparse pairs) hides all
    its pairs. A sparse pattern's needed_keys also decides which entries of each tile travel on and
    which of its gradients travel back (RingPlan.kv_out ..). kv_tiles: tiles per rank."""
    tokens, window = pattern.tokens, pattern.window
    world, rank = tokens.world, tokens.rank
    n_local = tokens.local_index.numel()
    tiles = ring_tiles(n_local, tokens.layout, kv_tiles)
    max_rows = _max_rows(n_local)
    q_first = [int(tokens.local_index[a]) for a, _ in tiles]
    src_index = [tokens.rank_index(r) for r in range(world)]  # the pieces keep views of these
    if pattern.sparse:
        need = _needs(pattern, src_index)
        used = _used_tiles(pattern, tiles, src_index)
    steps = []
    for j, (a, b) in enumerate(tiles):
        hops = []
        for t in range(world):
            src = (rank - t) % world
            kj = src_index[src][a:b]
            k0, k1 = int(kj[0]), int(kj[-1]) + 1
            # Query tiles and key tiles lie on one grid: a query tile is after the key tile (full),
            # is it (causal) or is before it (nothing visible).
            kinds = ["full" if k1 <= q0 else "causal" if q0 == k0 else None for q0 in q_first]
            if pattern.sparse:  # and a query tile that needs no key of this tile skips it
                kinds = [kind if used[i][src][j] else None for i, kind in enumerate(kinds)]
            pieces = []
            for run in _runs(tiles, kinds, max_rows):
                rows = slice(run[0], run[1])
                causal = len(run) == 3
                qi = tokens.local_index[rows]
                if window is not None and int(qi[0]) - k1 + 1 >= window:
                    continue  # the window hides every pair
                cut = window is not None and int(qi[-1]) - k0 >= window  # the window hides some pair
                if pattern.compacted:  # joined below into one compacted call
                    pieces.append(torch.arange(rows.start, rows.stop, device=qi.device))
                elif pattern.sparse:
                    pieces.append(Piece(rows, q_index=qi, k_index=kj, pattern=pattern))
                elif tokens.plain and not cut:
                    pieces.append(Piece(rows, is_causal=causal))
                elif bool(pattern.visible(qi, kj).any()):
                    pieces.append(Piece(rows, q_index=qi, k_index=kj, pattern=pattern))
            if pattern.compacted and pieces:
                # One call per (tile, hop) for all the rows that may read it: compacted, it is as
                # small as the pattern's pairs, and many small calls cost more than their work.
                rows = torch.cat(pieces)
                pieces = [Piece(rows, q_index=tokens.local_index[rows], k_index=kj, pattern=pattern)]
            hops.append(pieces)
        steps.append(hops)
    plan = RingPlan(tiles, steps, tokens, pattern=pattern)
    if pattern.sparse:
        # Tile j of rank s at hop t is held by rank s + t. Onwards go the entries that a rank after
        # it needs; back (dK/dV, hop t >= 1) the entries that ranks s + 1 .. s + t used (the owner
        # keeps its own part).
        def tile_need(s, j, ranks):
            idx = src_index[s][tiles[j][0]:tiles[j][1]]
            out = torch.zeros(need[0].shape[:2] + (idx.numel(),), dtype=torch.bool, device=idx.device)
            for d in ranks:
                out |= need[(s + d) % world][:, :, idx]
            return out

        def ahead(s, j, t):
            return tile_need(s, j, range(t + 1, world))

        def behind(s, j, t):
            return tile_need(s, j, range(1, t + 1))

        rng = range(len(tiles))
        plan.kv_out = [[ahead((rank - t) % world, j, t) for t in range(world)] for j in rng]
        plan.kv_in = [[ahead((rank - 1 - t) % world, j, t) for t in range(world)] for j in rng]
        plan.grad_out = [[behind((rank - t) % world, j, t) for t in range(world)] for j in rng]
        plan.grad_in = [[behind((rank - 1 - t) % world, j, t) for t in range(world)] for j in rng]
    return plan


def _trimmed(pattern: RingPattern, qi):
    """pattern.needed_keys(qi), cut to the keys causality (and a sliding window) leave to those queries."""
    index = torch.arange(pattern.tokens.positions.shape[1], device=qi.device)
    keep = index <= qi.max()
    if pattern.window is not None:
        keep &= index > qi.min() - pattern.window
    return pattern.needed_keys(qi) & keep


def _needs(pattern: RingPattern, src_index):
    """need[d]: bool (batch, kv_heads, seq_len), the keys rank d's queries need."""
    tokens = pattern.tokens
    n = tokens.local_index.numel()
    c = n // chunks_per_rank(tokens.layout)
    out = []
    for d in range(tokens.world):
        mask = None
        for start in range(0, n, c):  # per chunk: its own causal / window cut
            m = _trimmed(pattern, src_index[d][start:start + c])
            mask = m if mask is None else mask | m
        out.append(mask)
    return out


def _used_tiles(pattern: RingPattern, tiles, src_index):
    """used[i][s][j]: whether local query tile i needs any key of tile j of rank s."""
    tokens = pattern.tokens
    n = tokens.local_index.numel()
    device = tokens.local_index.device
    tile_of = torch.empty(n, dtype=torch.long, device=device)
    for j, (a, b) in enumerate(tiles):
        tile_of[a:b] = j
    used = []
    for a, b in tiles:
        m = _trimmed(pattern, tokens.local_index[a:b]).any(0).any(0)  # (seq_len,)
        per_src = []
        for s in range(tokens.world):
            hit = torch.zeros(len(tiles), dtype=torch.long, device=device).index_add_(0, tile_of,
                                                                                      m[src_index[s]].long())
            per_src.append((hit > 0).tolist())
        used.append(per_src)
    return used


def _post(exchange: Exchange, tensors, out_mask, in_mask, tag: int):
    """Sends each tile-shaped (batch, kv_heads, tile, head_dim) tensor to the next rank, only the
    entries of out_mask (None: all of it; none: no message), and posts the receive of the previous
    rank's, the entries of in_mask. Returns what _land needs once the messages are in."""
    nxt, prv = (exchange.rank + 1) % exchange.world, (exchange.rank - 1) % exchange.world
    like = tensors[0]
    n_in = None if in_mask is None else int(in_mask.sum())
    bufs, works, payloads = [], [], []
    for i, t in enumerate(tensors):
        payload = t.contiguous() if out_mask is None else t[out_mask] if bool(out_mask.any()) else None
        buf = (torch.empty(t.shape, dtype=t.dtype, device=t.device) if in_mask is None
               else torch.empty((n_in, t.shape[-1]), dtype=t.dtype, device=t.device) if n_in else None)
        works += exchange.start({nxt: payload} if payload is not None else {},
                                {prv: buf} if buf is not None else {}, tag=4 * tag + i)
        bufs.append(buf)
        payloads.append(payload)  # alive until the send is waited on
    return bufs, works, payloads, in_mask, like.shape, like.dtype


def _land(posted):
    """Waits for _post's messages; returns the received tiles (zero outside the mask received)."""
    bufs, works, _, in_mask, shape, dtype = posted
    wait_all(works)
    if in_mask is None:
        return bufs
    tiles = []
    for buf in bufs:
        tile = torch.zeros(shape, dtype=dtype, device=in_mask.device)
        if buf is not None:
            tile[in_mask] = buf
        tiles.append(tile)
    return tiles


def _at(masks, j, t):
    return None if masks is None else masks[j][t]


# Every fused call runs in the merge dtype (float32 for bfloat16 / float16 inputs): a row's output
# and a key's dK/dV are sums over many calls, and rounding each call's part to bfloat16 would add
# one rounding per call. The copies are of one call's rows and one tile, a few percent of q.
class _RingAttention(torch.autograd.Function):
    """q_far, k_far: None, or a second pair of projections (run_ring): k_far travels with K and V,
    and the compacted calls that say so (RingPattern.calls) read (q_far, k_far) instead of (q, k)."""

    @staticmethod
    def forward(ctx, q, k, v, q_far, k_far, exchange: Exchange, plan: RingPlan, scale):
        acc = merge_dtype(q.dtype)
        out = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)
        world = exchange.world
        keys = (k, v) if k_far is None else (k, v, k_far)
        for j, ((a, b), hops) in enumerate(zip(plan.tiles, plan.steps)):
            # K and V (and K far) travel as separate messages (no stacked copy), from a copy of the own tile.
            kv = tuple(t[:, :, a:b].contiguous() for t in keys)
            for t, pieces in enumerate(hops):
                if t + 1 < world:  # post the next hop before computing on the tile in hand
                    posted = _post(exchange, kv, _at(plan.kv_out, j, t), _at(plan.kv_in, j, t), tag=0)
                for piece in pieces:
                    if piece.compacted:
                        _compact_forward(piece, (q, q_far), kv, out, lse, scale, acc)
                        continue
                    bias, empty_rows = piece.mask(acc)
                    o, l = attention_forward(q[:, :, piece.rows].to(acc), kv[0].to(acc), kv[1].to(acc),
                                             is_causal=piece.is_causal, scale=scale, attn_bias=bias)
                    o, l = o.to(acc), l.to(acc)
                    if empty_rows is not None:  # the kernel reports lse 0 for a row with no key
                        l = l.masked_fill(empty_rows, float("-inf"))
                    merge_into(out[:, :, piece.rows], lse[:, :, piece.rows], o, l)
                    del o, l, bias
                if t + 1 < world:
                    kv = _land(posted)
                    del posted
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, q_far, k_far, out, lse)
        ctx.exchange, ctx.plan, ctx.scale = exchange, plan, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, q_far, k_far, out, lse = ctx.saved_tensors
        exchange, plan, scale = ctx.exchange, ctx.plan, ctx.scale
        world = exchange.world
        acc = merge_dtype(q.dtype)
        dout = dout.contiguous()
        lse = torch.where(torch.isfinite(lse), lse, torch.full_like(lse, _EMPTY_ROW_LSE)).to(
            torch.float32 if q.dtype != torch.float64 else torch.float64)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dq_far = None if q_far is None else torch.zeros(q.shape, dtype=acc, device=q.device)
        keys = (k, v) if k_far is None else (k, v, k_far)
        grads = [torch.empty_like(t) for t in keys]  # dK, dV (, dK far)
        for j, ((a, b), hops) in enumerate(zip(plan.tiles, plan.steps)):
            kv = tuple(t[:, :, a:b].contiguous() for t in keys)
            # The owner keeps its own part of its tile's dK/dV; the message that travels from hop 1
            # on carries the parts of the ranks that held the tile since, back to the owner at the end.
            own, incoming = None, None
            for t, pieces in enumerate(hops):
                if t + 1 < world:
                    posted = _post(exchange, kv, _at(plan.kv_out, j, t), _at(plan.kv_in, j, t), tag=0)
                mine = None  # this rank's part of the dK/dV of the tile in hand
                for piece in pieces:
                    if piece.compacted:
                        mine = _compact_backward(piece, (q, q_far), kv, out, lse, dout, (dq, dq_far), mine, scale,
                                                 acc)
                        continue
                    r = piece.rows
                    bias, _ = piece.mask(acc)
                    gq, gk, gv = attention_backward(dout[:, :, r].to(acc), q[:, :, r].to(acc), kv[0].to(acc),
                                                    kv[1].to(acc), out[:, :, r].to(acc), lse[:, :, r],
                                                    is_causal=piece.is_causal, scale=scale, attn_bias=bias)
                    dq[:, :, r] += gq
                    if mine is None:  # it may be sent on: a contiguous buffer (the kernel's may be strided)
                        mine = [gk.to(acc).contiguous(), gv.to(acc).contiguous()]
                    else:
                        mine[0] += gk
                        mine[1] += gv
                    del gq, gk, gv, bias
                if t == 0:
                    own = mine
                else:  # add this rank's part to what came from the previous rank (hop t - 1), send it on
                    dkv = _land(incoming) if incoming is not None else None
                    if dkv is None:
                        dkv = mine if mine is not None else [x.new_zeros(x.shape, dtype=acc) for x in kv]
                    elif mine is not None:
                        for got, part in zip(dkv, mine):
                            got += part
                    incoming = _post(exchange, dkv, _at(plan.grad_out, j, t), _at(plan.grad_in, j, t), tag=1)
                    del dkv
                del mine
                if t + 1 < world:
                    kv = _land(posted)
                    del posted
            back = _land(incoming)  # hop P - 1 of the previous rank: this rank's own tile
            for i, grad in enumerate(grads):
                grad[:, :, a:b] = back[i] if own is None else back[i] + own[i]
        dk_far = grads[2] if k_far is not None else None
        return (dq.to(q.dtype), grads[0], grads[1], None if dq_far is None else dq_far.to(q.dtype), dk_far,
                None, None, None)


def _flat_rows(index, heads: int, n: int):
    """index (batch, heads, m) into dim 2 of a contiguous (batch, heads, n, d) tensor: the indices of
    those rows in its (batch * heads * n, d) view (row copies there are far faster than gather)."""
    b = index.shape[0]
    base = torch.arange(b * heads, device=index.device).view(b, heads, 1) * n
    return (index + base).reshape(-1)


def _gather_rows(x, index):
    """x (batch, heads, n, d), contiguous, at index (batch, heads, m): (batch, heads, m, d)."""
    flat = _flat_rows(index, x.shape[1], x.shape[2])
    return x.view(-1, x.shape[-1]).index_select(0, flat).view(*index.shape, x.shape[-1])


def _tile_per_query_head(tile, q_heads):
    """A K/V tile (batch, kv_heads, tile, d) with one head per query head (the heads of a
    compacted call read different keys) and the kv head of each query head."""
    kv_head = torch.arange(q_heads, device=tile.device) // (q_heads // tile.shape[1])
    return tile.index_select(1, kv_head), kv_head


def _compact_forward(piece, queries, kv, out, lse, scale, acc):
    """A compacted Piece: each head's rows against its keys (Piece.compact), merged into out
    and lse at those rows (padding rows left out). queries: (q, q_far or None); kv: the tile's
    (K, V) or (K, V, K far)."""
    tiles = [_tile_per_query_head(t, queries[0].shape[1])[0] for t in kv]
    for rows, keys, valid, calls in piece.compact(acc):
        keep = valid.reshape(-1)
        at = _flat_rows(rows, out.shape[1], out.shape[2])[keep]
        values = _gather_rows(tiles[1], keys).to(acc)
        for far, bias, empty in calls:
            q_src, k_src = (queries[1], tiles[2]) if far else (queries[0], tiles[0])
            o, l = attention_forward(_gather_rows(q_src, rows).to(acc), _gather_rows(k_src, keys).to(acc), values,
                                     is_causal=False, scale=scale, attn_bias=bias)
            l = l.to(acc) if empty is None else l.to(acc).masked_fill(empty, float("-inf"))
            cur_o = out.view(-1, out.shape[-1]).index_select(0, at)
            cur_l = lse.view(-1).index_select(0, at)
            merge_into(cur_o, cur_l, o.to(acc).reshape(-1, o.shape[-1])[keep], l.reshape(-1)[keep])
            out.view(-1, out.shape[-1]).index_copy_(0, at, cur_o)
            lse.view(-1).index_copy_(0, at, cur_l)


def _compact_backward(piece, queries, kv, out, lse, dout, dqs, mine, scale, acc):
    """The backward of _compact_forward: dQ (dQ far) added at the rows, dK/dV (dK far) at the keys
    of each head's kv head into `mine` (this rank's part of the tile's gradients, created if None),
    returned. A padding key sees nothing (bias -inf); a padding row gets a zero dO and the empty
    row's lse (P = 0), so the gradients through it are zero, with or without a mask."""
    q_heads = queries[0].shape[1]
    k_tile, kv_head = _tile_per_query_head(kv[0], q_heads)
    tiles = [k_tile] + [_tile_per_query_head(x, q_heads)[0] for x in kv[1:]]
    b, hk, t, d = kv[0].shape
    for rows, keys, valid, calls in piece.compact(acc):
        dout_rows = _gather_rows(dout, rows).to(acc) * valid[..., None]
        # A padding row's own lse never counted these keys: with no mask, exp(s - lse) could
        # overflow (inf * 0 = NaN); the empty-row lse makes its probabilities exactly 0.
        lse_rows = torch.where(valid, lse.gather(2, rows), torch.full((), _EMPTY_ROW_LSE, dtype=lse.dtype,
                                                                        device=lse.device))
        out_rows = _gather_rows(out, rows).to(acc)
        values = _gather_rows(tiles[1], keys).to(acc)
        if mine is None:
            mine = [x.new_zeros(x.shape, dtype=acc) for x in kv]
        at = _flat_rows(rows, q_heads, dout.shape[2])
        # key k of query head h lands on its kv head's row: (batch * hk + kv_head[h]) * t + k
        flat = ((torch.arange(b, device=keys.device).view(b, 1, 1) * hk + kv_head.view(1, -1, 1)) * t
                + keys).reshape(-1)
        for far, bias, _ in calls:
            q_src, k_src = (queries[1], tiles[2]) if far else (queries[0], tiles[0])
            gq, gk, gv = attention_backward(dout_rows, _gather_rows(q_src, rows).to(acc),
                                            _gather_rows(k_src, keys).to(acc), values, out_rows, lse_rows,
                                            is_causal=False, scale=scale, attn_bias=bias)
            dqs[1 if far else 0].view(-1, d).index_add_(0, at, gq.reshape(-1, d).to(acc))
            mine[2 if far else 0].view(-1, d).index_add_(0, flat, gk.reshape(-1, d).to(acc))
            mine[1].view(-1, d).index_add_(0, flat, gv.reshape(-1, d).to(acc))
    return mine


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
                          build=lambda tokens: ring_plan(RingPattern(tokens, sliding_window)))
    return run_ring(q, k, v, plan, group=group, label="ring", scale=scale)


def run_ring(q, k, v, plan: RingPlan, *, group, label: str, scale: float, q_far=None, k_far=None):
    """This rank's shard of the attention output by `plan` (ring_plan), differentiable in q, k, v
    (and q_far, k_far). The ring kernels' common entry: q, k, v are this rank's shards as in
    ring_attention, `label` names the kernel in bytes_sent(); q_far, k_far (shaped like q and k, or
    None): a second pair of projections, read by the calls whose pattern says so (RingPattern.calls)."""
    def contiguous(t):
        return None if t is None else t.contiguous()

    return _RingAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), contiguous(q_far), contiguous(k_far),
                                Exchange(group, label), plan, scale)
