"""Distributed benchmark: the sequence-parallel kernels `ring` and `dilated_ring` over P gloo
processes on this machine's CPU (P = 1 runs the single-process kernel): one forward + backward over
a fixed global sequence split over the P ranks (zigzag layout). Per rank, one process of its own:
time (median of the timed steps, a barrier before each), peak memory above the inputs in one more
step after them (measure.py), and bytes sent by the kernel's exchanges in that step (counted in
hf_dilated.distributed.exchange). Rows give the worst rank. With more processes than cores the
times measure oversubscription, not the kernel: compare memory and bytes across P.
"""
from __future__ import annotations

import datetime
import math
import os
import socket

import torch

from .. import measure
from .report import say

KERNELS = ("ring", "dilated_ring")


def run_distributed_rank(spec: dict, own_process: bool = False) -> dict:
    """One rank of a group of spec["world"] processes (spec["rank"]); sends its own figures."""
    import torch.distributed as dist

    import hf_dilated.distributed as hd

    rank, world = spec["rank"], spec["world"]
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["port"]))
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=spec["timeout_s"]))
    group = dist.group.WORLD if world > 1 else None
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(1, h, spec["n"], spec["head_dim"], generator=gen)
            for h in (spec["heads"], spec["kv_heads"], spec["kv_heads"])]
    q, k, v = (hd.shard(t, world, rank, "zigzag", dim=2).contiguous().requires_grad_() for t in full)
    del full

    def step():
        if spec["kernel"] == "ring":
            out = hd.ring_attention(q, k, v, group=group)
        else:
            out = hd.dilated_ring_attention(q, k, v, spec["segment_lengths"], spec["dilation_rates"], group=group)
        out.backward(torch.ones_like(out))
        q.grad = k.grad = v.grad = None

    barrier = dist.barrier if world > 1 else None
    cpu = torch.device("cpu")
    passes = {"backward": measure.time_calls(step, cpu, max(1, spec["warmup"]), spec["repeats"], before=barrier)}
    hd.reset_bytes_sent()
    measure.measure_memory({"backward": step}, passes, cpu, own_process)
    sent = sum(hd.bytes_sent().values())
    if world > 1:
        dist.barrier()  # no rank leaves while another still waits on it
    return {"spec": spec, "passes": passes, "sent_bytes": sent}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def global_length(s) -> int:
    """--distributed-length, else the longest of --lengths up to 8192, cut to a length every
    process count splits into zigzag chunks."""
    n = s["distributed_length"] or max([n for n in s["lengths"] if n <= 8192] or [8192])
    return n - n % math.lcm(*(2 * p for p in s["processes"]))


def _worst_rank(kernel, world, ranks) -> dict:
    row = {"kernel": kernel, "processes": world}
    errors = [r.get("error") or r["passes"]["backward"].get("error") for r in ranks
              if r.get("error") or r["passes"]["backward"].get("error")]
    if errors:
        return dict(row, error=errors[0])
    passes = [r["passes"]["backward"] for r in ranks]
    return dict(row, time_s=max(p["median_s"] for p in passes), peak_extra_bytes=max(p["peak_extra_bytes"] for p in passes),
                sent_bytes=max(r["sent_bytes"] for r in ranks))


def run_section(s, runner, report) -> dict:
    n = global_length(s)
    seg = [w for w in s["segment_lengths"] if w < n] + [n]
    config = dict(n=n, heads=s["heads"], kv_heads=s["kv_heads"], head_dim=s["head_dim"], segment_lengths=seg,
                  dilation_rates=[2**g for g in range(len(seg))])
    rows = []
    for kernel in KERNELS:
        for world in s["processes"]:
            spec = dict(config, kind="distributed", kernel=kernel, world=world, port=_free_port(),
                        warmup=s["warmup"], repeats=s["repeats"], timeout_s=s["case_timeout"],
                        threads=s["threads"] or max(1, (os.cpu_count() or 1) // world))
            rows.append(_worst_rank(kernel, world, runner.run_group(spec, s["case_timeout"], world)))
            say(f"  {kernel} x{world}: {rows[-1]}")
    return {"config": config, "rows": rows}


def markdown_section(section, s) -> list[str]:
    c = section["config"]
    L = ["## Multi-process (ring attention over a process group)\n",
         f"Global length {c['n']}, {c['heads']} query / {c['kv_heads']} kv heads, head_dim {c['head_dim']}, float32 "
         f"forward + backward, gloo on this machine's CPU, dilated levels segment_lengths={c['segment_lengths']}, "
         f"dilation_rates={c['dilation_rates']}; worst rank. With as many processes as cores the times include "
         "contention; compare memory and bytes sent across process counts.\n",
         "| kernel | processes | time / step (s) | peak MiB above inputs | sent per rank (MiB) |",
         "|---|---:|---:|---:|---:|"]
    for r in section["rows"]:
        if "error" in r:
            L.append(f"| {r['kernel']} | {r['processes']} | {r['error']} | - | - |")
        else:
            L.append(f"| {r['kernel']} | {r['processes']} | {r['time_s']:.3f} | {r['peak_extra_bytes'] / 2**20:.1f} | "
                     f"{r['sent_bytes'] / 2**20:.2f} |")
    return L + [""]
