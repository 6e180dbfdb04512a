"""Point-to-point transport shared by the ring kernels, with a byte count per kernel.

Every send of the package goes through `Exchange.start`, which posts isend/irecv pairs with
`torch.distributed.batch_isend_irecv` and adds the bytes it sends to `bytes_sent()[label]`
(the benchmark reads these counters). Waits run under the group's timeout (see faults.py).

`global_tokens` all-gathers the small per-token metadata (positions, padding flags) once per
call (once per forward pass of a model: `prepare_call` caches the plan built from it for the
next layers), so every rank knows the positions, documents and padding of the whole sequence and
can build any visibility pattern, for its own queries or for a peer's, without further messages.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..ops.plan_cache import PlanCache
from ..ops.token_layout import documents
from .layout import shard_indices, unshard

_BYTES_SENT: Counter = Counter()


def bytes_sent() -> dict:
    """Bytes this process has sent, per kernel label, since the last reset."""
    return dict(_BYTES_SENT)


def reset_bytes_sent() -> None:
    _BYTES_SENT.clear()


class Exchange:
    """Non-blocking point-to-point messages inside one process group (ranks are group ranks)."""

    def __init__(self, group, label: str):
        self.group = group
        self.label = label
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self._global = [dist.get_global_rank(group, r) for r in range(self.world)]

    def start(self, sends: dict, recvs: dict, tag: int = 0) -> list:
        """Posts every send {peer: tensor} and receive {peer: buffer}; returns works to wait on."""
        ops = []
        for peer, t in sends.items():
            ops.append(dist.P2POp(dist.isend, t, self._global[peer], self.group, tag))
            _BYTES_SENT[self.label] += t.numel() * t.element_size()
        for peer, buf in recvs.items():
            ops.append(dist.P2POp(dist.irecv, buf, self._global[peer], self.group, tag))
        return dist.batch_isend_irecv(ops) if ops else []

    def ring_shift(self, tensors, tag: int = 0):
        """Sends each of `tensors` to the next rank and receives the previous rank's into new
        buffers; returns (buffers, works)."""
        nxt, prv = (self.rank + 1) % self.world, (self.rank - 1) % self.world
        bufs, works = [], []
        for i, t in enumerate(tensors):
            buf = torch.empty_like(t)
            works += self.start({nxt: t.contiguous()}, {prv: buf}, tag=2 * tag + i if len(tensors) > 1 else tag)
            bufs.append(buf)
        return bufs, works


def wait_all(works) -> None:
    for w in works:
        w.wait()


@dataclass
class GlobalTokens:
    """Metadata of the whole sequence, identical on every rank of the group."""
    positions: torch.Tensor  # (batch, seq_len) int64
    real: torch.Tensor  # (batch, seq_len) bool
    doc: torch.Tensor  # (batch, seq_len) int64, document number within the row
    plain: bool  # no padding, one document, positions 0..seq_len-1
    local_index: torch.Tensor  # (n_local,) global index of each of this rank's tokens
    world: int
    rank: int
    layout: str

    def rank_index(self, r: int) -> torch.Tensor:
        return shard_indices(self.positions.shape[1], self.world, r, self.layout, self.positions.device)


def global_tokens(batch: int, n_local: int, *, attention_mask, position_ids, group, layout: str,
                  device, any_mask: bool, any_positions: bool) -> GlobalTokens:
    """Global positions / padding / documents (SPEC "Positions, padding, packing") from the local
    shards of attention_mask and position_ids (either may be None). One all-gather, int64,
    2 x batch x n_local per rank, and only when some rank has a mask or positions.

    any_mask / any_positions: whether any rank of the group has one (a rank whose shard has no
    padding may get no mask from transformers; its tokens are then all real)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    seq_len = n_local * world
    local_index = shard_indices(seq_len, world, rank, layout, device)
    if not any_mask and not any_positions:
        arange = torch.arange(seq_len, device=device).expand(batch, seq_len)
        return GlobalTokens(arange, torch.ones(batch, seq_len, dtype=torch.bool, device=device),
                            torch.zeros(batch, seq_len, dtype=torch.long, device=device), True,
                            local_index, world, rank, layout)
    real = (attention_mask.to(torch.bool) if attention_mask is not None
            else torch.ones(1, n_local, dtype=torch.bool, device=device)).expand(batch, n_local)
    pos = (position_ids.long() if position_ids is not None
           else torch.full((1, n_local), -1, dtype=torch.long, device=device)).expand(batch, n_local)
    local = torch.stack([pos, real.long()]).contiguous()  # (2, batch, n_local)
    shards = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(shards, local, group=group)
    full = unshard(shards, layout, dim=2)
    real = full[1].to(torch.bool)
    if any_positions:
        positions = full[0]
    else:
        positions = real.long().cumsum(-1) - 1
    doc = documents(positions, real)
    arange = torch.arange(seq_len, device=device)
    plain = bool(real.all()) and bool((positions == arange).all())
    return GlobalTokens(positions, real, doc, plain, local_index, world, rank, layout)


# A rank uses its cached plan only when every rank of the group has one (agreed in the signature
# message), so the ranks always run the same collectives.
_PLANS = PlanCache()


def prepare_call(what: str, q, k, v, *, attention_mask, position_ids, group, layout: str, build, **config):
    """The prologue every ring kernel runs before its first exchange: checks that the ranks agree
    on shapes, dtype, layout and configuration (faults.py), gathers the token metadata and returns
    build(tokens), the kernel's plan (or the cached plan of an earlier layer with the same inputs)."""
    from .faults import check_same_on_all_ranks, fingerprint
    from .layout import chunks_per_rank

    if q.shape[2] != k.shape[2]:
        raise ValueError(f"{what}: q_len ({q.shape[2]}) must equal kv_len ({k.shape[2]}) under sequence "
                         "parallelism: q, k and v are this rank's shards of the same tokens")
    n = q.shape[2]
    if n % chunks_per_rank(layout):
        raise ValueError(f"{what}: the local length ({n}) must be a multiple of {chunks_per_rank(layout)} for "
                         f"layout {layout!r}; pad the global sequence to layout.padded_length() (shard_batch does)")
    # The group by its members and this rank's place in it (a plan depends on nothing else of it).
    members = (tuple(dist.get_process_group_ranks(group)), dist.get_rank(group))
    key = (what, tuple(q.shape), tuple(k.shape), q.dtype, str(q.device), layout, members, fingerprint(config))
    cached = _PLANS.get(key, attention_mask, position_ids)
    flags = check_same_on_all_ranks(group, what, flags={"mask": attention_mask is not None,
                                                        "positions": position_ids is not None,
                                                        "cached": cached is not None},
                                    q=q, k=k, v=v, layout=layout, **config)
    if all(flags["cached"]):
        return cached
    if any(flags["positions"]) and not all(flags["positions"]):
        raise ValueError(f"{what}: position_ids given on some ranks of the group and not on others "
                         f"(per rank: {flags['positions']}); pass them on every rank or on none")
    tokens = global_tokens(q.shape[0], n, attention_mask=attention_mask, position_ids=position_ids, group=group,
                           layout=layout, device=q.device, any_mask=any(flags["mask"]),
                           any_positions=all(flags["positions"]))
    if all(flags["positions"]) and tokens.world > 1 and layout == "zigzag":
        _check_not_local_default(what, tokens, n)
    value = build(tokens)
    _PLANS.put(key, attention_mask, position_ids, value)
    return value


def _check_not_local_default(what: str, tokens: GlobalTokens, n: int) -> None:
    # transformers models fill in position_ids = 0..n-1 when none are passed. Under sequence
    # parallelism that means every rank numbers its own shard from 0, which in the zigzag layout
    # puts documents starting at position n/2 in the middle of the sequence: never a real input.
    local = torch.arange(n, device=tokens.positions.device)
    if all(bool((tokens.positions[:, tokens.rank_index(r)] == local).all()) for r in range(tokens.world)):
        raise ValueError(
            f"{what}: position_ids are 0..{n - 1} on every rank, the model's default when no position_ids "
            "are passed; under sequence parallelism pass the *global* positions of the rank's tokens "
            "(hf_dilated.distributed.shard_batch returns them)")


# --- windowed attention: exchange only the keys some query needs ------------------------------
#
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


def plan_windows(tokens: GlobalTokens, needed_keys) -> WindowPlan:
    """needed_keys(query_index) -> bool (batch, kv_heads, seq_len): the keys visible to some query
    of `query_index` (global indices) under the kernel's pattern."""
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
