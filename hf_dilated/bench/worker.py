"""Every benchmark case runs here, in a fresh process of its own: its resident-memory peak is its
own, the memory measurement may change that process's allocator settings (measure.py), and a case
that runs out of memory or time cannot poison the next.

CaseRunner (in the driver) forks each case from a fork server that has already imported torch and
hf_dilated, so a case costs milliseconds to start, not the seconds of those imports. As with any
multiprocessing start method but fork, a script that drives it needs the
`if __name__ == "__main__":` guard (the `hf-dilated` command and `python -m hf_dilated.bench` have it).
"""
from __future__ import annotations

import importlib
import multiprocessing
import multiprocessing.connection
import os
import time
import traceback

import torch

from ..ops import backend
from .block_sparse import run_block_sparse_case
from .decode import run_decode_case, run_generate_case
from .distributed import run_distributed_rank
from .e2e import run_e2e_case
from .fsdp import run_fsdp_rank
from .kernels import run_kernel_case
from .window import run_window_case

CASES = {
    "kernel": run_kernel_case,
    "block_sparse": run_block_sparse_case,
    "decode": run_decode_case,
    "generate": run_generate_case,
    "e2e": run_e2e_case,
    "distributed": run_distributed_rank,
    "fsdp": run_fsdp_rank,
    "window": run_window_case,
}


def case_function(kind: str):
    """The function of a case kind: a name of CASES, or "package.module:function" for a case defined
    in another module (imported in the case's process; gpu_table.py's cases)."""
    if kind in CASES:
        return CASES[kind]
    module, sep, name = kind.partition(":")
    if not sep:
        raise KeyError(f"unknown case kind {kind!r}: one of {', '.join(CASES)} or 'module:function'")
    return getattr(importlib.import_module(module), name)


def run_case(spec: dict, own_process: bool = False) -> dict:
    """One case. own_process: this process exists for the case alone (child_main), so the memory
    measurement may change its allocator settings."""
    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    if spec.get("flash"):  # the FlashAttention of every flash call in the case: ours and sdpa's alike
        backend.activate_flash(spec["flash"])
    result = case_function(spec["kind"])(spec, own_process)
    result["threads"] = torch.get_num_threads()
    result["flash"] = backend.active_flash() or "FA2"
    return result


def child_main(spec: dict, conn) -> None:
    """Entry point of a case process: send the result (or the failure) to the driver."""
    try:
        result = run_case(spec, own_process=True)
    except Exception as e:  # noqa: BLE001 - reported: the driver records the failure for this case
        result = {"spec": spec, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2000:]}
    conn.send(result)
    conn.close()
    os._exit(0)  # skip interpreter teardown (compiled kernels, thread pools): the result is out


class CaseRunner:
    """Runs cases in fresh processes, each within a time limit."""

    def __init__(self):
        # No MALLOC_* settings here: timed calls run under glibc's defaults (measure.py).
        os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # no compile-worker pool to orphan
        method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
        self.ctx = multiprocessing.get_context(method)
        if method == "forkserver":
            self.ctx.set_forkserver_preload([__name__])

    def run(self, spec: dict, timeout: float) -> dict:
        return self._run([spec], timeout)[0]

    def run_group(self, spec: dict, timeout: float, world: int) -> list[dict]:
        """`world` processes at once, ranks 0..world-1 of one process group (spec gets rank, world)."""
        return self._run([dict(spec, rank=r, world=world) for r in range(world)], timeout)

    def _run(self, specs: list[dict], timeout: float) -> list[dict]:
        start = time.perf_counter()
        procs, pending = [], {}
        for i, spec in enumerate(specs):
            recv, send = self.ctx.Pipe(duplex=False)
            proc = self.ctx.Process(target=child_main, args=(spec, send), daemon=True)
            proc.start()
            send.close()
            procs.append(proc)
            pending[recv] = i
        results, died = [None] * len(specs), set()
        while pending and (left := start + timeout - time.perf_counter()) > 0:
            for conn in multiprocessing.connection.wait(list(pending), left):
                i = pending.pop(conn)
                try:
                    results[i] = conn.recv()
                except EOFError:  # the process ended without sending: killed (for memory?)
                    died.add(i)
        for proc in procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        wall = time.perf_counter() - start
        for i, spec in enumerate(specs):
            if results[i] is None and i in died:
                results[i] = {"spec": spec, "error": f"process died with exit code {procs[i].exitcode} "
                                                     "(killed for memory?)", "limit": "memory"}
            elif results[i] is None:
                results[i] = {"spec": spec, "error": f"time limit: no result within {timeout:.0f} s", "limit": "time"}
            results[i]["wall_s"] = wall
        return results
