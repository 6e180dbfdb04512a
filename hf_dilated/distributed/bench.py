"""Benchmark of the sequence-parallel kernels: per-rank time, peak memory and bytes sent.

    python -m hf_dilated.distributed.bench                      # defaults below
    python -m hf_dilated.distributed.bench --seq-len 8192 --procs 1 2 4 --kernels ring dilated_ring

For each kernel and process count P (gloo, on this machine's CPU; P = 1 runs the single-process
kernel), one forward + backward over a fixed global sequence split over the P ranks. Printed per
rank (worst rank): time (median of --reps), peak resident memory above the inputs during one
forward + backward (Linux VmHWM, reset before the run after malloc_trim), and bytes sent by the kernel's exchanges
(counted in hf_dilated.distributed.exchange). Times with more processes than cores measure
oversubscription, not the kernel: compare memory and bytes across P, times only where P <= cores.
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time

import torch
import torch.multiprocessing as mp


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _trim_heap() -> None:
    # Hand freed heap pages back to the OS so that the next peak counts the run's own memory.
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _reset_peak() -> bool:
    try:  # Linux >= 4.0: "5" resets the peak resident set size (VmHWM) to the current one
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _worker(rank, world, port, cfg, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    import torch.distributed as dist

    import hf_dilated.distributed as hd
    from hf_dilated.distributed.layout import shard

    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))
    group = dist.group.WORLD if world > 1 else None
    g = torch.Generator().manual_seed(0)
    L, H, Hk, D = cfg["seq_len"], cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    full = [torch.randn(1, h, L, D, generator=g) for h in (H, Hk, Hk)]
    q, k, v = (shard(t, world, rank, "zigzag", dim=2).contiguous().requires_grad_() for t in full)
    del full
    kernel = cfg["kernel"]

    def step():
        if kernel == "ring":
            out = hd.ring_attention(q, k, v, group=group)
        else:
            out = hd.dilated_ring_attention(q, k, v, cfg["segment_lengths"], cfg["dilation_rates"], group=group)
        out.backward(torch.ones_like(out))
        q.grad = k.grad = v.grad = None

    step()  # warm-up (allocator, thread pools)
    if world > 1:
        dist.barrier()
    _trim_heap()
    base = _rss_kib("VmRSS")
    exact = _reset_peak()
    hd.reset_bytes_sent()
    step()
    peak = _rss_kib("VmHWM") - base if exact else float("nan")
    sent = sum(hd.bytes_sent().values())
    times = []
    for _ in range(cfg["reps"]):
        if world > 1:
            dist.barrier()
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    queue.put((rank, statistics.median(times), peak / 1024, sent))
    if world > 1:
        dist.barrier()
    dist.destroy_process_group()


def run(kernel: str, world: int, cfg: dict) -> dict:
    from .layout import padded_length

    if padded_length(cfg["seq_len"], world, "zigzag") != cfg["seq_len"]:
        raise ValueError(f"--seq-len must be a multiple of {2 * world} for {world} processes")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "hf_dilated.distributed"])
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, world, port, dict(cfg, kernel=kernel), queue)) for r in range(world)]
    for p in procs:
        p.start()
    rows = [queue.get(timeout=1800) for _ in procs]
    for p in procs:
        p.join()
    return {"time_s": max(r[1] for r in rows), "peak_mib": max(r[2] for r in rows),
            "sent_mib": max(r[3] for r in rows) / 2**20}


def main(argv=None):
    p = argparse.ArgumentParser(description="per-rank time, peak memory and bytes sent of the SP kernels")
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--segment-lengths", type=int, nargs="+", default=None,
                   help="default: seq_len/8, seq_len/4, seq_len/2, seq_len")
    p.add_argument("--dilation-rates", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--procs", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--kernels", nargs="+", default=["ring", "dilated_ring"], choices=["ring", "dilated_ring"])
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args(argv)
    if args.segment_lengths is None:
        args.segment_lengths = [args.seq_len // 8, args.seq_len // 4, args.seq_len // 2, args.seq_len]
    cfg = dict(seq_len=args.seq_len, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
               segment_lengths=args.segment_lengths, dilation_rates=args.dilation_rates, reps=args.reps)
    print(f"global length {args.seq_len}, batch 1, {args.heads} query / {args.kv_heads} kv heads, head_dim "
          f"{args.head_dim}, float32, forward + backward; dilated: segments {args.segment_lengths}, "
          f"rates {args.dilation_rates}; {os.cpu_count()} CPU cores, gloo")
    print("| kernel | processes | time / step (s, worst rank) | peak memory above inputs (MiB, worst rank) "
          "| sent per rank (MiB, fwd+bwd) |")
    print("|---|---|---|---|---|")
    for kernel in args.kernels:
        for world in args.procs:
            r = run(kernel, world, cfg)
            print(f"| {kernel} | {world} | {r['time_s']:.3f} | {r['peak_mib']:.1f} | {r['sent_mib']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
