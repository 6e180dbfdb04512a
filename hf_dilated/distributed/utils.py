"""What the ring kernels share: point-to-point messaging, with a byte count per kernel, and the
additive masks of their fused calls.

Every send of the package goes through `Exchange.start`, which posts isend/irecv pairs with
`torch.distributed.batch_isend_irecv` and adds the bytes it sends to `bytes_sent()[label]`
(the benchmarks read these counters). Waits run under the group's timeout (see faults.py).
"""
from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist

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
            buf = torch.empty(t.shape, dtype=t.dtype, device=t.device)  # contiguous, as gloo needs, whatever t's strides
            works += self.start({nxt: t.contiguous()}, {prv: buf}, tag=2 * tag + i if len(tensors) > 1 else tag)
            bufs.append(buf)
        return bufs, works


def wait_all(works) -> None:
    for w in works:
        w.wait()


def as_bias(visible: torch.Tensor, dtype):
    """(additive bias: 0 where `visible`, -inf elsewhere; bool rows with no visible key)."""
    bias = torch.where(visible, torch.zeros((), dtype=dtype, device=visible.device),
                       torch.full((), float("-inf"), dtype=dtype, device=visible.device))
    return bias, ~visible.any(-1)


def weighted_bias(visible: torch.Tensor, weight, dtype):
    """as_bias of `visible` narrowed by a pattern's `weight`: None (dense), bool (the pairs it lets
    through) or a count c (the key weighs exp(s + log c), c = 0 hides it)."""
    if weight is None:
        return as_bias(visible, dtype)
    if weight.dtype == torch.bool:
        return as_bias(visible & weight, dtype)
    weight = weight.to(dtype) * visible
    return torch.log(weight), (weight == 0).all(-1)
