"""Failing fast instead of hanging.

- `check_same_on_all_ranks`: before any exchange, every rank all-gathers a small fixed-size
  signature of its call (shapes, dtype, configuration). Ranks that disagree all raise the same
  ValueError naming the field, instead of deadlocking in mismatched point-to-point messages.
- Timeouts: every collective and point-to-point wait of this package runs under the timeout of
  its process group (`init_process_group(timeout=...)`, or `setup_sequence_parallel(timeout=...)`
  for the groups it creates). A rank that dies closes its sockets and its peers fail at once; a
  rank that raises and lingers, or hangs, makes its peers fail when the timeout expires.
"""
from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

_SIGNATURE_SIZE = 64
_DTYPES = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3, torch.float64: 4}


def fingerprint(value) -> int:
    """A stable 31-bit integer for any repr-able configuration value."""
    return zlib.crc32(repr(value).encode()) & 0x7FFFFFFF


def collective_device(group) -> torch.device:
    """Where a collective of `group` takes a tensor made on the host: the CPU where its backend has
    gloo ("gloo", or "cpu:gloo,cuda:nccl", torch's default), else this process's CUDA device: NCCL,
    which accelerate and the fine-tuning example choose on GPUs, takes CUDA tensors only."""
    backend = str(dist.get_backend(group))
    if "gloo" in backend or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def tensor_signature(t) -> list[int]:
    if t is None:
        return [-1] * 6
    shape = list(t.shape)[:4] + [0] * (4 - min(t.dim(), 4))
    return shape + [t.dim(), _DTYPES.get(t.dtype, 0) if t.is_floating_point() else 9]


def check_same_on_all_ranks(group, what: str, flags: dict | None = None, **fields) -> dict:
    """Raises ValueError on every rank when any field differs between the ranks of `group`.

    Each field is an int, a tensor (its shape and dtype are compared), None, or anything with a
    stable repr (compared by fingerprint). `flags` (name -> bool) travel in the same message but
    may differ: the result maps each flag to its per-rank values."""
    flags = flags or {}
    names, rows = [], []
    for name, value in fields.items():
        if value is None or isinstance(value, torch.Tensor):
            sig = tensor_signature(value)
        elif isinstance(value, bool) or not isinstance(value, int):
            sig = [fingerprint(value)]
        else:
            sig = [value]
        names.append(name)
        rows.append(sig)
    # Fixed size, so that even ranks running different kernels exchange matching messages; the
    # first entry says which kernel and which fields the rest describes.
    body = [int(bool(f)) for f in flags.values()] + [x for sig in rows for x in sig]
    if len(body) + 1 > _SIGNATURE_SIZE:
        raise AssertionError(f"signature of {what} too long ({len(body)} entries)")
    head = [fingerprint((what, list(flags), names))]
    flat = torch.tensor(head + body + [0] * (_SIGNATURE_SIZE - 1 - len(body)), dtype=torch.int64,
                        device=collective_device(group))
    world = dist.get_world_size(group)
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat, group=group)
    gathered = [g.cpu() for g in gathered]
    if any(int(g[0]) != head[0] for g in gathered):
        raise ValueError(
            f"{what}: the ranks of the sequence-parallel group are not all calling {what} (or not with the "
            "same set of arguments); every rank must run the same attention kernel at the same point")
    start = 1 + len(flags)
    for name, sig, value in zip(names, rows, fields.values()):
        stop = start + len(sig)
        per_rank = [g[start:stop].tolist() for g in gathered]
        if any(p != per_rank[0] for p in per_rank):
            raise ValueError(
                f"{what}: ranks of the sequence-parallel group disagree on {name!r} "
                f"(per rank: {per_rank}; this rank has {_describe(value)}). Every rank must call with "
                "the same shapes and configuration."
            )
        start = stop
    return {name: [bool(g[1 + i]) for g in gathered] for i, name in enumerate(flags)}


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"shape {tuple(value.shape)}, dtype {value.dtype}"
    return repr(value)
