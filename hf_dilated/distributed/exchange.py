"""Point-to-point transport shared by the ring kernels, with a byte count per kernel.

Every send of the package goes through `Exchange.start`, which posts isend/irecv pairs with
`torch.distributed.batch_isend_irecv` and adds the bytes it sends to `bytes_sent()[label]`
(the benchmark reads these counters). Waits run under the group's timeout (see faults.py).

`global_tokens` all-gathers the small per-token metadata (positions, padding flags) once per
call, so every rank knows the positions, documents and padding of the whole sequence and can
build any visibility pattern, for its own queries or for a peer's, without further messages.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist

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

    def ring_shift(self, t: torch.Tensor, tag: int = 0):
        """Sends `t` to the next rank and receives the previous rank's into a new buffer."""
        buf = torch.empty_like(t)
        nxt, prv = (self.rank + 1) % self.world, (self.rank - 1) % self.world
        return buf, self.start({nxt: t.contiguous()}, {prv: buf}, tag)


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
                  device) -> GlobalTokens:
    """Global positions / padding / documents (SPEC "Positions, padding, packing") from the local
    shards of attention_mask and position_ids (either may be None). One all-gather, int64,
    2 x batch x n_local per rank, and only when a mask or positions are given."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    seq_len = n_local * world
    local_index = shard_indices(seq_len, world, rank, layout, device)
    if attention_mask is None and position_ids is None:
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
    if position_ids is not None:
        positions = full[0]
    else:
        positions = real.long().cumsum(-1) - 1
    starts = torch.ones_like(real)
    starts[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
    doc = starts.long().cumsum(-1) - 1
    arange = torch.arange(seq_len, device=device)
    plain = bool(real.all()) and bool((positions == arange).all())
    return GlobalTokens(positions, real, doc, plain, local_index, world, rank, layout)
