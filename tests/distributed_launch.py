"""Runs a function on N real processes joined by a gloo process group (no mocks).

`launch(fn, world_size, *args)` starts N processes (forkserver start method), each calling
`fn(rank, world_size, *args)` after `init_process_group("gloo")` on a free local port, and returns
every rank's outcome. `fn` must be a module-level function of an importable module. A child's
result travels back through a file (torch.save), so tensors are fine.
"""
from __future__ import annotations

import datetime
import os
import socket
import tempfile
import time
import traceback

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_PRELOAD = ["torch", "torch.distributed", "hf_dilated.distributed", "transformers"]


def _context():
    # forkserver: one server process imports torch & co. once per test session, then every child
    # is forked from it (fast, and free of the parent's threads, unlike a plain fork).
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _child(rank, world_size, port, timeout_s, out_dir, fn, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    import torch.distributed as dist

    start = time.monotonic()
    outcome = {"rank": rank}
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        outcome["result"] = fn(rank, world_size, *args)
        outcome["ok"] = True
    except BaseException as e:  # reported to the parent, which decides
        outcome["ok"] = False
        outcome["error"] = f"{type(e).__name__}: {e}"
        outcome["traceback"] = traceback.format_exc()
    outcome["elapsed"] = time.monotonic() - start
    torch.save(outcome, os.path.join(out_dir, f"rank{rank}.pt"))
    if outcome["ok"]:
        try:
            dist.destroy_process_group()
        except Exception:
            pass


def launch(fn, world_size: int, *args, timeout_s: float = 30.0, join_s: float = 120.0,
           allow_failures: bool = False) -> list[dict]:
    """Runs fn on `world_size` gloo processes; returns the outcomes in rank order.

    timeout_s is the process-group timeout; join_s bounds the whole run. Unless allow_failures,
    any failed rank raises AssertionError with its traceback. A rank that wrote no outcome (it
    died) gets {"ok": False, "exitcode": ...}."""
    ctx = _context()
    port = free_port()
    with tempfile.TemporaryDirectory() as out_dir:
        procs = [ctx.Process(target=_child, args=(r, world_size, port, timeout_s, out_dir, fn, args))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + join_s
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:  # only the processes started here
            if p.is_alive():
                p.kill()
                p.join()
        outcomes = []
        for r, p in enumerate(procs):
            path = os.path.join(out_dir, f"rank{r}.pt")
            if os.path.exists(path):
                o = torch.load(path, weights_only=False)
            else:
                o = {"rank": r, "ok": False, "error": "no outcome (process died or hung)"}
            o["exitcode"] = p.exitcode
            o["hung"] = r in hung
            outcomes.append(o)
    if hung:
        raise AssertionError(f"ranks {hung} still running after {join_s}s: {outcomes}")
    if not allow_failures:
        failed = [o for o in outcomes if not o["ok"]]
        if failed:
            raise AssertionError("\n\n".join(f"rank {o['rank']}: {o.get('traceback', o['error'])}" for o in failed))
    return outcomes
