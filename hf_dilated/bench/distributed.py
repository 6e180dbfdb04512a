"""Distributed benchmark: the sequence-parallel kernels `ring`, `dilated_ring` and
`block_sparse_ring` over P gloo processes on this machine's CPU (P = 1 runs the single-process
kernel) at one fixed global sequence split over the P ranks (zigzag layout). Per rank, one process
of its own, measured in this order:

- time: forward + backward, median of the timed steps, a barrier before each;
- peak memory above the inputs (measure.py) of one more step of each kind, after every timed step:
  "forward" (under torch.no_grad, as in inference) and "backward" (forward + backward, the
  gradient of a sum of the outputs);
- the fixed per-process overhead, apart: the same forward + backward on a trivially small sequence
  (`TINY_TOKENS` per rank) in the same process group. Whatever that costs (gloo's transport
  buffers, the allocator, Python objects of the call) does not shrink with P, so it is not part of
  the 1/P target; the resident memory that `init_process_group` itself adds is reported too (it
  lies under every baseline, so it is in no peak figure);
- bytes sent by the kernel's exchanges (hf_dilated.distributed.bytes_sent) in each measured step.

Rows give the worst rank. With more processes than cores the times measure oversubscription, not
the kernel: compare memory and bytes across P.
"""
from __future__ import annotations

import datetime
import math
import os
import socket

import torch

from .. import measure
from .report import say

KERNELS = ("ring", "dilated_ring", "block_sparse_ring")
TINY_TOKENS = 64  # per rank, for the fixed overhead: every buffer that scales with the sequence is then tiny
STEPS = ("forward", "backward", "overhead")


def _call(kernel: str, spec: dict, group, tiny: bool):
    """kernel(q, k, v) on this rank's shards, with the spec's pattern (shrunk to fit the tiny sequence)."""
    import hf_dilated.distributed as hd

    if kernel == "ring":
        return lambda q, k, v: hd.ring_attention(q, k, v, group=group)
    if kernel == "dilated_ring":
        seg, dil = ([TINY_TOKENS * spec["world"]], [1]) if tiny else (spec["segment_lengths"], spec["dilation_rates"])
        return lambda q, k, v: hd.dilated_ring_attention(q, k, v, seg, dil, group=group)
    block_size = min(spec["block_size"], TINY_TOKENS // 2) if tiny else spec["block_size"]
    return lambda q, k, v: hd.block_sparse_ring_attention(q, k, v, spec["block_pattern"], block_size=block_size,
                                                          group=group)


def _shards(spec, n, world, rank):
    import hf_dilated.distributed as hd

    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(1, h, n, spec["head_dim"], generator=gen)
            for h in (spec["heads"], spec["kv_heads"], spec["kv_heads"])]
    return [hd.shard(t, world, rank, "zigzag", dim=2).contiguous().requires_grad_() for t in full]


def run_distributed_rank(spec: dict, own_process: bool = False) -> dict:
    """One rank of a group of spec["world"] processes (spec["rank"]); sends its own figures."""
    import torch.distributed as dist

    import hf_dilated.distributed as hd

    rank, world = spec["rank"], spec["world"]
    probe = measure.MemoryProbe(torch.device("cpu"))
    before_init = probe.current()
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["port"]))
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=spec["timeout_s"]))
    init_bytes = probe.current() - before_init
    group = dist.group.WORLD if world > 1 else None
    q, k, v = _shards(spec, spec["n"], world, rank)
    tq, tk, tv = _shards(spec, TINY_TOKENS * world, world, rank)
    kernel = _call(spec["kernel"], spec, group, tiny=False)
    tiny_kernel = _call(spec["kernel"], spec, group, tiny=True)

    def forward_backward(fn, a, b, c):
        out = fn(a, b, c)
        out.backward(torch.ones_like(out))
        a.grad = b.grad = c.grad = None

    def forward():
        with torch.no_grad():
            kernel(q, k, v)

    steps = {"forward": forward, "backward": lambda: forward_backward(kernel, q, k, v),
             "overhead": lambda: forward_backward(tiny_kernel, tq, tk, tv)}
    barrier = dist.barrier if world > 1 else None
    cpu = torch.device("cpu")
    steps["overhead"]()  # its first call builds plans and buffers, as the timed warm-up does for the others
    passes = {"backward": measure.time_calls(steps["backward"], cpu, max(1, spec["warmup"]), spec["repeats"],
                                             before=barrier)}
    passes["forward"], passes["overhead"] = {}, {}
    sent = {}
    for name in STEPS:  # one step at a time, so that each gets its own byte count
        if barrier is not None:
            barrier()
        hd.reset_bytes_sent()
        measure.measure_memory({name: steps[name]}, passes, cpu, own_process)
        sent[name] = sum(hd.bytes_sent().values())
    if world > 1:
        dist.barrier()  # no rank leaves while another still waits on it
    return {"spec": spec, "passes": passes, "sent_bytes": sent, "init_bytes": init_bytes}


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
    errors = [r.get("error") or next((r["passes"][n]["error"] for n in STEPS if "error" in r["passes"][n]), None)
              for r in ranks]
    errors = [e for e in errors if e]
    if errors:
        return dict(row, error=errors[0])
    passes = [r["passes"] for r in ranks]
    return dict(row, time_s=max(p["backward"]["median_s"] for p in passes),
                **{f"{name}_peak_bytes": max(p[name]["peak_extra_bytes"] for p in passes) for name in STEPS},
                **{f"{name}_sent_bytes": max(r["sent_bytes"][name] for r in ranks) for name in STEPS},
                init_bytes=max(r["init_bytes"] for r in ranks))


def _ratios(rows) -> None:
    """Each row's peaks (the fixed overhead taken off) against its kernel's one-process row's, and
    the target 1.25 / P."""
    one = {r["kernel"]: r for r in rows if r["processes"] == 1 and "error" not in r}
    for r in rows:
        base = one.get(r["kernel"])
        if "error" in r or base is None:
            continue
        for name in ("forward", "backward"):
            ref = base[f"{name}_peak_bytes"] - base["overhead_peak_bytes"]
            if ref > 0:  # (a tiny smoke sequence may measure nothing above the overhead)
                r[f"{name}_ratio"] = max(0, r[f"{name}_peak_bytes"] - r["overhead_peak_bytes"]) / ref
        r["target_ratio"] = 1.25 / r["processes"]


def run_section(s, runner, report) -> dict:
    n = global_length(s)
    seg = [w for w in s["segment_lengths"] if w < n] + [n]
    config = dict(n=n, heads=s["heads"], kv_heads=s["kv_heads"], head_dim=s["head_dim"], segment_lengths=seg,
                  dilation_rates=[2**g for g in range(len(seg))], block_size=s["block_size"],
                  block_pattern=s["block_pattern"])
    rows = []
    for kernel in s["distributed_kernels"] or KERNELS:
        for world in s["processes"]:
            spec = dict(config, kind="distributed", kernel=kernel, world=world, port=_free_port(),
                        warmup=s["warmup"], repeats=s["repeats"], timeout_s=s["case_timeout"],
                        threads=s["threads"] or max(1, (os.cpu_count() or 1) // world))
            rows.append(_worst_rank(kernel, world, runner.run_group(spec, s["case_timeout"], world)))
            say(f"  {kernel} x{world}: {rows[-1]}")
    _ratios(rows)
    return {"config": config, "rows": rows}


def _mib(x) -> str:
    return f"{x / 2**20:.1f}"


def markdown_section(section, s) -> list[str]:
    c = section["config"]
    L = ["## Multi-process (sequence-parallel kernels over a process group)\n",
         f"Global length {c['n']}, {c['heads']} query / {c['kv_heads']} kv heads, head_dim {c['head_dim']}, float32, "
         f"gloo on this machine's CPU, zigzag shards; dilated levels segment_lengths={c['segment_lengths']}, "
         f"dilation_rates={c['dilation_rates']}; block-sparse pattern {c['block_pattern']}, block_size "
         f"{c['block_size']}; worst rank. Peaks are MiB of resident memory above the inputs, forward (no grad) "
         "and forward + backward; \"fixed\" is the forward + backward of "
         f"{TINY_TOKENS} tokens per rank in the same group (the per-process overhead, not part of the 1/P "
         "target); \"ratio\" is (peak - fixed) against one process's (peak - fixed), to compare with 1.25 / P; "
         "\"init\" is what init_process_group adds (under every baseline). With more processes than cores "
         "the times include contention; compare memory and bytes across process counts.\n",
         "| kernel | P | s / step (fwd+bwd) | fwd MiB | fwd+bwd MiB | fixed MiB | init MiB | fwd ratio | "
         "fwd+bwd ratio | 1.25/P | sent fwd (MiB) | sent fwd+bwd (MiB) |",
         "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in section["rows"]:
        if "error" in r:
            L.append(f"| {r['kernel']} | {r['processes']} | {r['error']} |" + " - |" * 10)
            continue
        ratios = [f"{r[k]:.2f}" if k in r else "-" for k in ("forward_ratio", "backward_ratio", "target_ratio")]
        L.append(f"| {r['kernel']} | {r['processes']} | {r['time_s']:.3f} | {_mib(r['forward_peak_bytes'])} | "
                 f"{_mib(r['backward_peak_bytes'])} | {_mib(r['overhead_peak_bytes'])} | {_mib(r['init_bytes'])} | "
                 f"{' | '.join(ratios)} | {r['forward_sent_bytes'] / 2**20:.2f} | "
                 f"{r['backward_sent_bytes'] / 2**20:.2f} |")
    return L + [""]
