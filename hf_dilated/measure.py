"""Time and memory measurement, the one implementation every benchmark (hf_dilated.bench: kernels,
block-sparse, decode, distributed, end to end) and the cost column of `hf-dilated eval` use. It
lives outside the bench package because nothing may import that package.

Time: calls run under glibc's default allocator settings, as in any user's process (after the
warm-up, blocks up to 32 MiB are reused from the heap instead of being mapped afresh, and
page-faulted, on every call). On CUDA every timed call is bracketed by synchronisations.

Memory: one more call per measured step, after *all* the timed calls of the process (the
allocator settings below cannot be undone). On CPU glibc is told (mallopt) to hand every block
over 64 KiB back to the OS when it is freed, the retained heap is trimmed, and the resident
high-water mark is reset (/proc/self/clear_refs) right before the call, so the figure is the peak
of that call alone beyond a baseline of the inputs. Measuring memory under those settings during
the timed calls would add a fresh mapping and its page faults to every allocation, which slows
kernels that allocate many temporaries and is no user's setting. On CUDA:
torch.cuda.max_memory_allocated beyond the allocation at the baseline. The settings are only made
in a process that exists for its case alone (`own_process`), never in a caller's.
"""
from __future__ import annotations

import gc
import resource
import statistics
import time
from typing import Callable

import torch

# Errors a measured call may raise that are reported as that measurement's outcome.
CALL_ERRORS = (RuntimeError, MemoryError, NotImplementedError)
NOT_GLIBC_NOTE = "allocator settings unavailable (not glibc): freed heap stays resident, the peak is over-stated"


def error_text(e: BaseException) -> str:
    """One line for a report: the exception's type and the first line of its message."""
    lines = str(e).splitlines()
    return f"{type(e).__name__}: {lines[0][:300] if lines else ''}"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(step: Callable[[], object], device: torch.device, warmup: int, repeats: int,
               before: Callable[[], object] | None = None, budget_s: float | None = None) -> dict:
    """`warmup` untimed calls, then `repeats` (at least 1) timed ones; `before` runs untimed ahead
    of each timed call (a barrier of a process group). With `budget_s`, the timed calls stop once
    they took that long in all and at least 3 ran (a 128K case then costs seconds, not a minute).
    first_s: the first call's time, warm-up or not (on a GPU it compiles: a user waits that long once)."""
    first_s = None
    for i in range(warmup):
        sync(device)
        start = time.perf_counter()
        step()
        if i == 0:
            sync(device)
            first_s = time.perf_counter() - start
    times = []
    for _ in range(max(1, repeats)):
        if budget_s is not None and len(times) >= 3 and sum(times) > budget_s:
            break
        if before is not None:
            before()
        sync(device)
        start = time.perf_counter()
        step()
        sync(device)
        times.append(time.perf_counter() - start)
    return {"times_s": times, "median_s": statistics.median(times), "first_s": times[0] if first_s is None else first_s}


def host_and_device(step: Callable[[], object], device: torch.device, busy_s: float, repeats: int = 3) -> dict | None:
    """On CUDA, a step's host time and GPU time apart, and whether it waits for the GPU: each call is
    issued while the GPU spins (torch.cuda._sleep) for `busy_s` seconds. A step that never waits for
    the GPU returns before the spin ends: its wall time is then its host's work alone (Python, launches),
    and the GPU, finding every kernel queued when the spin ends, runs them back to back (events
    around them: its kernels' time alone). A step that waits (a read back, a blocking copy, a full
    launch queue) returns after the spin: `waited`, and neither figure is its own. Choose `busy_s`
    well above the step's wall time. None elsewhere (the CPU has no queue to run ahead on).
    {"host_s", "device_s" (medians of the calls that did not wait), "waited" (calls), "calls"}"""
    if device.type != "cuda":
        return None
    cycles = _spin_cycles(busy_s, device)
    hosts, kernels, waited = [], [], 0
    for _ in range(max(1, repeats)):
        torch.cuda.synchronize(device)
        torch.cuda._sleep(cycles)
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()  # reached when the spin ends
        start = time.perf_counter()
        step()
        host = time.perf_counter() - start
        spun_out = begin.query()  # the spin over before the step returned: the step may have waited for it
        end.record()
        torch.cuda.synchronize(device)
        if spun_out:
            waited += 1
        else:
            hosts.append(host)
            kernels.append(begin.elapsed_time(end) / 1e3)
    return {"host_s": statistics.median(hosts) if hosts else None,
            "device_s": statistics.median(kernels) if kernels else None, "waited": waited, "calls": max(1, repeats)}


def synchronizing_calls(step: Callable[[], object], device: torch.device) -> list[str] | None:
    """On CUDA, where one call of `step` makes the host wait for the GPU: torch's sync debug mode
    (torch.cuda.set_sync_debug_mode) warns at each such operation (a read back, a blocking copy
    either way, a stream's synchronize), and each warning is listed as "file:line: message", the
    line the Python frame that made the operation. Reads back that the CPU's counts see (aten's
    _local_scalar_dense, nonzero: tests/test_host_sync.py) and the CUDA-only ones they cannot (a
    blocking copy either way, a stream's synchronize in a library). Not seen: torch.cuda.synchronize
    and an event's synchronize (torch flags neither), the allocator's cudaFree, a full launch queue
    (host_and_device counts those as waits). [] when there is none; None elsewhere (no queue to
    wait on)."""
    if device.type != "cuda":
        return None
    import warnings

    torch.cuda.synchronize(device)
    before = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(before)
    torch.cuda.synchronize(device)
    return [f"{w.filename}:{w.lineno}: {str(w.message).splitlines()[0][:160]}" for w in caught
            if "synchroniz" in str(w.message)]


def host_profile(step: Callable[[], object], calls: int = 3, top: int = 20) -> str:
    """The `top` functions (Python, and the C functions they call) by their own time over `calls`
    calls of `step`, under cProfile, per call: where a host-bound step spends its host's time (on a
    GPU, with host_and_device saying that the host bounds it). Any device; the profiler's own cost
    inflates small functions alike for every step profiled, so compare steps, not milliseconds."""
    import cProfile
    import os
    import pstats

    calls = max(1, calls)
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        for _ in range(calls):
            step()
    finally:
        profiler.disable()
    stats = pstats.Stats(profiler).stats  # (file, line, function) -> (primitive calls, calls, own s, cumulative s, callers)
    rows = sorted(stats.items(), key=lambda item: -item[1][2])[:top]
    lines = [f"{'own ms':>8} {'cum ms':>8} {'calls':>6}  function (per call of the step; {calls} calls)"]
    for (file, line, function), (_, count, own, cumulative, _) in rows:
        where = function if file == "~" else f"{os.path.basename(file)}:{line}({function})"
        lines.append(f"{1e3 * own / calls:8.3f} {1e3 * cumulative / calls:8.3f} {count / calls:6.0f}  {where}")
    return "\n".join(lines)


_SPIN_RATE: dict = {}  # device -> seconds per cycle of torch.cuda._sleep


def _spin_cycles(seconds: float, device: torch.device) -> int:
    """The cycles of torch.cuda._sleep that take `seconds` on `device` (its rate timed once)."""
    if device not in _SPIN_RATE:
        probe = 10_000_000
        torch.cuda._sleep(probe)  # the first launch loads the kernel
        torch.cuda.synchronize(device)
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        torch.cuda._sleep(probe)
        end.record()
        torch.cuda.synchronize(device)
        _SPIN_RATE[device] = begin.elapsed_time(end) / 1e3 / probe
    return max(1, int(seconds / _SPIN_RATE[device]))


def time_interleaved(fns, repeats: int, warmup: int = 1, log=print,
                     device: torch.device | None = None) -> list[list[float] | None]:
    """Times every (name, fn) once per round, in turn, for `repeats` rounds after `warmup` calls each.

    Interleaving makes a slow spell of a busy machine fall on every variant alike, so the ratios
    between them stay meaningful; timing one variant after another lets it skew just one of them.
    A function that raises, in its warm-up or in any round, is logged and left out (None)."""
    times: list[list[float] | None] = [[] for _ in fns]
    for rnd in range(-warmup, repeats):  # negative rounds: warm-up, not timed
        for i, (name, fn) in enumerate(fns):
            if times[i] is None:
                continue
            try:
                if device is not None:
                    sync(device)
                start = time.perf_counter()
                fn()
                if device is not None:
                    sync(device)
                if rnd >= 0:
                    times[i].append(time.perf_counter() - start)
            except Exception as exc:  # noqa: BLE001 - any failure drops this variant, not the run
                log(f"{name} failed: {type(exc).__name__}: {exc}")
                times[i] = None
    return times


def _status_bytes(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class MemoryProbe:
    """Peak memory beyond a baseline taken at `start()`, on the device the case runs on."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.can_reset = False
        self.baseline = 0

    def current(self) -> int:
        if self.cuda:
            return torch.cuda.memory_allocated()
        rss = _status_bytes("VmRSS")
        return rss if rss is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def start(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")  # reset the resident high-water mark (Linux >= 4.0)
                self.can_reset = True
            except OSError:
                self.can_reset = False
        self.baseline = self.current()

    def peak_extra(self) -> int:
        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self.baseline
        hwm = _status_bytes("VmHWM") if self.can_reset else None
        if hwm is None:  # no resettable high-water mark: the process-lifetime peak (an upper bound)
            hwm = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return max(0, hwm - self.baseline)


def strict_allocator(on: bool = True) -> bool:
    """glibc: with `on`, map every block over 64 KiB on its own and unmap it when freed, and give
    the retained heap back, so the resident set follows the live allocations (for the memory
    measurement); `on=False` goes back to glibc's default thresholds (128 KiB, fixed from then on:
    glibc's own dynamic threshold is not restored, so a caller measures time before memory).
    Returns whether the settings took (False where the C library is not glibc)."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3  # malloc.h
        libc.mallopt(m_mmap_threshold, 64 * 1024 if on else 128 * 1024)
        libc.mallopt(m_trim_threshold, 128 * 1024)
        gc.collect()
        libc.malloc_trim(0)
        return True
    except (OSError, AttributeError):
        return False


def measure_memory(steps: dict, results: dict, device: torch.device, own_process: bool,
                   errors: tuple = CALL_ERRORS) -> None:
    """Peak memory of one more call of each step, stored as results[name]["peak_extra_bytes"]
    (or results[name] = {"error": ...}). Call it after every timed call of the process; the strict
    allocator is set only in a process of the case's own (`own_process`)."""
    note = None
    if device.type == "cpu" and steps and own_process and not strict_allocator():
        note = NOT_GLIBC_NOTE
    probe = MemoryProbe(device)
    for name, step in steps.items():
        try:
            probe.start()
            step()
            results[name]["peak_extra_bytes"] = probe.peak_extra()
            if note:
                results[name]["memory_note"] = note
        except errors as e:
            results[name] = {"error": error_text(e)}
        gc.collect()


def limit_memory(budget_bytes: int | None, device: torch.device) -> None:
    """Make allocations beyond the budget fail (CPU: RLIMIT_DATA over the current data size)."""
    if not budget_bytes:
        return
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, (budget_bytes + torch.cuda.memory_allocated()) / total))
        return
    data = _status_bytes("VmData")
    if data is not None:
        resource.setrlimit(resource.RLIMIT_DATA, (data + budget_bytes, resource.RLIM_INFINITY))
