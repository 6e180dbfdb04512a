"""`hf-dilated bench` (or `python -m hf_dilated.bench`): every attention variant against dense causal
sdpa on this machine, in one run, written as markdown + JSON + PNG plots.

What is measured, per variant x sequence length x dtype:
- forward and forward+backward time: median [min-max] of `--repeats` runs after `--warmup` runs;
- useful pairs per second: the (query, key) pairs the pattern makes visible, counted exactly
  (hf_dilated.bench_count), divided by the time; and that throughput as a ratio of sdpa's in the
  same run, at the same length and dtype;
- peak memory beyond the inputs (see bench_worker.py: a fresh process per case, resident-set
  high-water mark on CPU, max_memory_allocated on CUDA).
Then: the fitted exponent of time vs length; the longest sequence each variant runs within a
memory budget (doubling, then bisection, one process per attempt); optionally (`--million`) the
issue's memory check, a float32 forward at 1,048,576 tokens; and end-to-end rows: a tiny Llama
(forward + backward) with each attn_implementation that `import hf_dilated` registered.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import multiprocessing
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from .bench_worker import DILATED_MODES, KERNEL_VARIANTS

# Issue 2's target shape and figures.
TARGET_SEGMENTS = [2048, 4096, 8192, 16384, 32768]
TARGET_DILATIONS = [1, 2, 4, 8, 16]
TARGET_N = 32768
TARGET_RATIO = {"forward": 0.9, "backward": 0.75}
MILLION = 1_048_576
MILLION_TARGET = 1.5
E2E_EXPECTED = ("dilated", "dilated_ring", "ring", "block_sparse", "block_sparse_ring")
PASS_LABEL = {"forward": "fwd", "backward": "fwd+bwd"}

# Profiles: values the options take unless given. "quick" stays under 2 minutes on 2 CPU cores;
# "smoke" is for the test suite (tiny everything, every section exercised).
PROFILES = {
    "full": dict(
        lengths=[4096, 8192, 16384, 32768], dtypes=["float32", "bfloat16"], warmup=1, repeats=3,
        segment_lengths=TARGET_SEGMENTS, dilation_rates=TARGET_DILATIONS, search=True, budget_gib=4.0,
        search_start=4096, search_max=1 << 21, search_timeout=120.0, bisect_steps=3,
        e2e_lengths=[4096, 16384], case_timeout=1800.0, skip_variants=[], distributed=True,
    ),
    "quick": dict(
        lengths=[1024, 4096], dtypes=["float32"], warmup=1, repeats=3,
        segment_lengths=[256, 512, 1024, 2048, 4096], dilation_rates=[1, 2, 4, 8, 16], search=False,
        budget_gib=0.25, search_start=2048, search_max=1 << 16, search_timeout=20.0, bisect_steps=0,
        e2e_lengths=[1024], case_timeout=120.0, skip_variants=["flex", "flex_union"], distributed=False,
    ),
    "smoke": dict(
        lengths=[128, 256], dtypes=["float32"], warmup=0, repeats=2,
        segment_lengths=[32, 64, 128], dilation_rates=[1, 2, 4], search=True, budget_gib=6 / 1024,
        search_start=256, search_max=1024, search_timeout=30.0, bisect_steps=1,
        e2e_lengths=[128], case_timeout=120.0, skip_variants=["flex", "flex_union"], distributed=False,
    ),
}
SKIP_REASON = {v: "FlexAttention compiles for ~30 s per shape on CPU; name it in --variants to include it"
               for v in ("flex", "flex_union")}


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.replace(" ", "").split(",") if x]


def _names(text: str) -> list[str]:
    return [x for x in text.replace(" ", "").split(",") if x]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    p = parser
    p.add_argument("--quick", action="store_true", help="small lengths, float32, no length search (< 2 min)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes through every section (for the tests)")
    p.add_argument("--out", default="bench-results", help="output directory (default: %(default)s)")
    p.add_argument("--lengths", type=_ints, help="sequence lengths, comma separated")
    p.add_argument("--dtypes", type=_names, help="float32, bfloat16, float16 (comma separated)")
    p.add_argument("--variants", type=_names, help=f"kernel variants among {', '.join(KERNEL_VARIANTS)}")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--segment-lengths", type=_ints)
    p.add_argument("--dilation-rates", type=_ints)
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--block-pattern", type=json.loads, default=None,
                   help='block-sparse pattern as JSON (default: {"type": "global_local", "global_blocks": 1, '
                        '"window": 5}, the block-sparse benchmark\'s)')
    p.add_argument("--warmup", type=int)
    p.add_argument("--repeats", type=int)
    p.add_argument("--threads", type=int, default=None, help="torch threads per case (default: torch's)")
    p.add_argument("--case-timeout", type=float, help="seconds before a case is abandoned")
    p.add_argument("--search", action=argparse.BooleanOptionalAction, default=None,
                   help="find the longest sequence within --budget-gib (default: on, off with --quick)")
    p.add_argument("--budget-gib", type=float, help="memory budget of the length search (inputs included)")
    p.add_argument("--search-start", type=int)
    p.add_argument("--search-max", type=int)
    p.add_argument("--search-timeout", type=float, help="seconds per attempt of the length search")
    p.add_argument("--bisect-steps", type=int)
    p.add_argument("--million", action="store_true",
                   help="also run issue 2's memory check: a float32 forward at 1,048,576 tokens per dilated mode")
    p.add_argument("--distributed", action=argparse.BooleanOptionalAction, default=None,
                   help="ring / dilated_ring on 1 and 2 gloo processes via hf_dilated.distributed.bench "
                        "(default: on, off with --quick)")
    p.add_argument("--e2e", action=argparse.BooleanOptionalAction, default=True, help="tiny-Llama rows")
    p.add_argument("--e2e-lengths", type=_ints)
    p.add_argument("--e2e-impls", type=_names, help="attn_implementations (default: sdpa + all registered)")


# --------------------------------------------------------------------------------------------
# Running cases in fresh processes
# --------------------------------------------------------------------------------------------

class CaseRunner:
    """Runs each case in a fresh process forked from a server that has already imported torch and
    hf_dilated (so a case costs milliseconds to start, not the seconds of those imports). As with
    any multiprocessing start method but fork, a script that drives it needs the
    `if __name__ == "__main__":` guard (the `hf-dilated` command and `python -m` entry points have it)."""

    def __init__(self):
        # No MALLOC_* settings here: timed calls run under glibc's defaults (the worker tightens
        # the allocator itself for its separate memory measurement, see bench_worker).
        os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # no compile-worker pool to orphan
        method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
        self.ctx = multiprocessing.get_context(method)
        if method == "forkserver":
            self.ctx.set_forkserver_preload(["hf_dilated.bench_worker"])

    def run(self, spec: dict, timeout: float) -> dict:
        from .bench_worker import child_main

        recv, send = self.ctx.Pipe(duplex=False)
        proc = self.ctx.Process(target=child_main, args=(spec, send), daemon=True)
        t0 = time.perf_counter()
        proc.start()
        send.close()
        result = None
        try:
            if recv.poll(timeout):
                result = recv.recv()
        except EOFError:
            pass
        proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join()
        if result is None:
            if time.perf_counter() - t0 >= timeout:
                result = {"spec": spec, "error": f"time limit: no result within {timeout:.0f} s", "limit": "time"}
            else:
                result = {"spec": spec, "error": f"process died with exit code {proc.exitcode} "
                                                 "(killed for memory?)", "limit": "memory"}
        result["wall_s"] = time.perf_counter() - t0
        return result


# --------------------------------------------------------------------------------------------
# The benchmark
# --------------------------------------------------------------------------------------------

def _settings(args) -> dict:
    profile = "smoke" if args.smoke else "quick" if args.quick else "full"
    s = dict(PROFILES[profile], profile=profile)
    for key in ("lengths", "dtypes", "warmup", "repeats", "segment_lengths", "dilation_rates", "search",
                "budget_gib", "search_start", "search_max", "search_timeout", "bisect_steps", "e2e_lengths",
                "case_timeout", "distributed"):
        value = getattr(args, key, None)
        if value is not None:
            s[key] = value
    import torch

    s["device"] = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    s["variants"] = args.variants or [v for v in KERNEL_VARIANTS if v not in s["skip_variants"]]
    s["skipped_variants"] = [] if args.variants else [v for v in s["skip_variants"]]
    unknown = sorted(set(s["variants"]) - set(KERNEL_VARIANTS))
    if unknown:
        raise ValueError(f"--variants: unknown {unknown}; choose among {', '.join(KERNEL_VARIANTS)}")
    if "sdpa" not in s["variants"]:
        s["variants"] = ["sdpa"] + s["variants"]  # every ratio is to sdpa measured in this run
    bad = sorted(set(s["dtypes"]) - {"float32", "bfloat16", "float16"})
    if bad:
        raise ValueError(f"--dtypes: unknown {bad}; choose among float32, bfloat16, float16")
    if any(n <= 0 for n in s["lengths"]):
        raise ValueError(f"--lengths must be positive, got {s['lengths']}")
    from .ops.validate import check_dilated_config

    check_dilated_config(s["segment_lengths"], s["dilation_rates"], "union")
    s.update(batch=args.batch, heads=args.heads, kv_heads=args.kv_heads or args.heads, head_dim=args.head_dim,
             block_size=args.block_size, threads=args.threads, million=args.million, e2e=args.e2e,
             e2e_impls=args.e2e_impls)
    s["block_pattern"] = args.block_pattern or {"type": "global_local", "global_blocks": 1, "window": 5}
    return s


def _kernel_spec(s, variant, n, dtype, passes, **extra) -> dict:
    spec = dict(kind="kernel", variant=variant, n=n, dtype=dtype, device=s["device"], batch=s["batch"],
                heads=s["heads"], kv_heads=s["kv_heads"], head_dim=s["head_dim"],
                segment_lengths=s["segment_lengths"], dilation_rates=s["dilation_rates"],
                block_size=s["block_size"], block_pattern=s["block_pattern"], passes=passes,
                warmup=s["warmup"], repeats=s["repeats"], threads=s["threads"])
    spec.update(extra)
    return spec


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _fmt_case(r: dict) -> str:
    parts = []
    for name, p in r.get("passes", {}).items():
        if "median_s" in p:
            parts.append(f"{PASS_LABEL[name]} {p['median_s'] * 1e3:.1f} ms, {p['peak_extra_bytes'] / 2**20:.0f} MiB")
        else:
            parts.append(f"{PASS_LABEL[name]}: {p.get('error') or p.get('unsupported')}")
    return "; ".join(parts) or r.get("unavailable") or r.get("error", "")


def run_kernels(s, runner) -> list[dict]:
    results = []
    unavailable = set()
    for dtype in s["dtypes"]:
        for n in s["lengths"]:
            for variant in s["variants"]:
                if variant in unavailable:
                    continue
                spec = _kernel_spec(s, variant, n, dtype, ["forward", "backward"])
                r = runner.run(spec, s["case_timeout"])
                if r.get("unavailable"):
                    unavailable.add(variant)
                _say(f"  {variant:>12} {dtype:>8} N={n:<7} {_fmt_case(r)}")
                results.append(r)
    return results


def _attempt_ok(r, pass_name, budget_bytes):
    """(fits, why not) for one attempt of the length search."""
    if r.get("unavailable"):
        return False, "unavailable"
    p = r.get("passes", {}).get(pass_name, {})
    if "unsupported" in p:
        return False, "unsupported"
    error = r.get("error") or p.get("error")
    if error:
        if "limit" in r:
            return False, r["limit"]
        return False, "memory" if "allocate" in error or "out of memory" in error.lower() else "error: " + error[:80]
    total = p["inputs_bytes"] + p["peak_extra_bytes"]
    return (True, "") if total <= budget_bytes else (False, "memory")


def search_longest(s, runner, variant, dtype, pass_name) -> dict:
    budget = int(s["budget_gib"] * 2**30)
    tried = []

    def attempt(n):
        spec = _kernel_spec(s, variant, n, dtype, [pass_name], warmup=0, repeats=1, budget_bytes=budget,
                            prewarm=True)
        r = runner.run(spec, s["search_timeout"])
        ok, why = _attempt_ok(r, pass_name, budget)
        tried.append({"n": n, "ok": ok, "why": why, "wall_s": round(r["wall_s"], 2)})
        return ok, why

    best, fail, why_fail = None, None, ""
    n = s["search_start"]
    while n <= s["search_max"]:
        ok, why = attempt(n)
        if not ok:
            fail, why_fail = n, why
            break
        best, n = n, n * 2
    if best is not None and fail is not None and why_fail in ("memory", "time"):
        lo, hi = best, fail
        for _ in range(s["bisect_steps"]):
            mid = (lo + hi) // 2 // 256 * 256
            if mid <= lo:
                break
            ok, why = attempt(mid)
            if ok:
                lo = mid
            else:
                hi, why_fail = mid, why
        best, fail = lo, hi
    limit = why_fail if fail is not None else f"none up to {s['search_max']}"
    return {"variant": variant, "dtype": dtype, "pass": pass_name, "longest": best, "first_failure": fail,
            "limited_by": limit, "attempts": tried}


def run_search(s, runner, available) -> list[dict]:
    out = []
    dtype = s["dtypes"][0]
    for variant in available:
        for pass_name in ("forward", "backward"):
            r = search_longest(s, runner, variant, dtype, pass_name)
            _say(f"  {variant:>12} {PASS_LABEL[pass_name]:>7}: longest {r['longest']} "
                 f"(first failure {r['first_failure']}: {r['limited_by']})")
            out.append(r)
    return out


def run_block_sparse_comparison(s, runner) -> dict:
    """hf_dilated.bench_block_sparse: block_sparse vs sdpa and FlexAttention with the same mask."""
    pattern = s["block_pattern"]
    if "block_sparse" not in s["variants"]:
        return {"note": "Not run (block_sparse not among --variants).", "rows": []}
    if "flex" in s["skipped_variants"]:
        return {"note": "Not run in this profile (it compiles FlexAttention); name flex in --variants, or run "
                        "`python -m hf_dilated.bench_block_sparse`.", "rows": []}
    if pattern.get("type") != "global_local":
        return {"note": "Not run: the comparison takes a global_local pattern (see --block-pattern).", "rows": []}
    spec = dict(kind="block_sparse_comparison", n=max(s["lengths"]), heads=s["heads"], head_dim=s["head_dim"],
                block_size=s["block_size"], global_blocks=pattern["global_blocks"], window=pattern["window"],
                dtype=s["dtypes"][0], repeats=max(1, s["repeats"]), device=s["device"], threads=s["threads"])
    r = runner.run(spec, s["case_timeout"])
    _say(f"  block-sparse comparison at N={spec['n']}: {len(r.get('rows', []))} rows {r.get('error', '')}")
    return {"note": r.get("error") or "", "rows": r.get("rows", []), "log": r.get("log", []), "spec": spec}


def run_million(s, runner) -> list[dict]:
    out = []
    modes = [m for m in s["variants"] if m in DILATED_MODES] or ["union"]
    for mode in modes:
        spec = _kernel_spec(s, mode, MILLION, "float32", ["forward"], warmup=0, repeats=1, prewarm=True,
                            segment_lengths=TARGET_SEGMENTS, dilation_rates=TARGET_DILATIONS)
        r = runner.run(spec, max(s["case_timeout"], 3600.0))
        p = r.get("passes", {}).get("forward", {})
        row = {"variant": mode, "n": MILLION, "qkvo_bytes": r.get("qkvo_bytes"),
               "peak_extra_bytes": p.get("peak_extra_bytes"), "seconds": p.get("median_s"),
               "error": r.get("error") or p.get("error") or r.get("unavailable")}
        if row["peak_extra_bytes"] is not None and row["qkvo_bytes"]:
            row["multiple_of_qkvo"] = row["peak_extra_bytes"] / row["qkvo_bytes"]
        _say(f"  million {mode}: {row}")
        out.append(row)
    return out


# --------------------------------------------------------------------------------------------
# End to end: a tiny Llama with each attn_implementation
# --------------------------------------------------------------------------------------------

def e2e_model_config(s, max_len: int) -> dict:
    from .model_configs import load_preset

    cfg = dict(load_preset("tiny-llama")["model_config"])
    cfg.pop("model_type", None)
    # Wider than the test preset so that attention has realistic heads (head_dim 64).
    cfg.update(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
               vocab_size=1024, max_position_embeddings=max_len)
    return cfg


def registered_implementations() -> tuple[list[str], dict]:
    """(registered names, {expected name: why unavailable})."""
    try:
        import hf_dilated  # noqa: F401
        from transformers import AttentionInterface
    except Exception as e:  # noqa: BLE001 - report any import failure as the reason
        return [], {name: f"import failed: {type(e).__name__}: {e}" for name in E2E_EXPECTED}
    names = set(AttentionInterface._global_mapping)
    have = [n for n in E2E_EXPECTED if n in names]
    missing = {n: "not registered by `import hf_dilated`" for n in E2E_EXPECTED if n not in names}
    return have, missing


def run_e2e(s, runner) -> dict:
    have, missing = registered_implementations()
    impls = s["e2e_impls"] or ["sdpa"] + have
    for name in s["e2e_impls"] or []:
        if name != "sdpa" and name not in have:
            missing.setdefault(name, "not registered")
    impls = [i for i in impls if i == "sdpa" or i in have]
    rows = []
    model_config = e2e_model_config(s, max(s["e2e_lengths"]))
    dilated_cfg = {"segment_lengths": s["segment_lengths"], "dilation_rates": s["dilation_rates"], "mode": "union",
                   "block_size": s["block_size"], "pattern": s["block_pattern"]}
    for n in s["e2e_lengths"]:
        for impl in impls:
            spec = dict(kind="e2e", attn_implementation=impl, n=n, dtype=s["dtypes"][0], device=s["device"],
                        batch=1, model_config=model_config, config_extra={"hf_dilated": dilated_cfg},
                        warmup=s["warmup"], repeats=s["repeats"], threads=s["threads"])
            r = runner.run(spec, s["case_timeout"])
            _say(f"  e2e {impl:>18} N={n:<7} {_fmt_case(r)}")
            if r.get("unavailable"):
                missing[impl] = r["unavailable"]
            rows.append(r)
    return {"rows": rows, "unavailable": missing, "model_config": model_config, "hf_dilated": dilated_cfg}


# --------------------------------------------------------------------------------------------
# Analysis
# --------------------------------------------------------------------------------------------

def kernel_rows(results) -> list[dict]:
    """Flat rows with throughput and ratio to sdpa at the same (n, dtype, pass)."""
    rows = []
    sdpa = {}
    for r in results:
        spec = r["spec"]
        for pass_name, p in r.get("passes", {}).items():
            row = {"variant": spec["variant"], "n": spec["n"], "dtype": spec["dtype"], "pass": pass_name,
                   "pairs": r.get("pairs")}
            if "median_s" in p:
                row.update(median_s=p["median_s"], min_s=min(p["times_s"]), max_s=max(p["times_s"]),
                           times_s=p["times_s"], peak_extra_bytes=p["peak_extra_bytes"],
                           pairs_per_s=r["pairs"] / p["median_s"])
                if spec["variant"] == "sdpa":
                    sdpa[(spec["n"], spec["dtype"], pass_name)] = row["pairs_per_s"]
            else:
                row["note"] = p.get("error") or p.get("unsupported")
            rows.append(row)
    for row in rows:
        base = sdpa.get((row["n"], row["dtype"], row["pass"]))
        if base and "pairs_per_s" in row:
            row["ratio_to_sdpa"] = row["pairs_per_s"] / base
    return rows


def fit_exponents(rows) -> list[dict]:
    """Least-squares slope of log(time) against log(length), per (variant, dtype, pass)."""
    groups = {}
    for row in rows:
        if "median_s" in row:
            groups.setdefault((row["variant"], row["dtype"], row["pass"]), []).append((row["n"], row["median_s"]))
    out = []
    for (variant, dtype, pass_name), pts in groups.items():
        if len({n for n, _ in pts}) < 2:
            continue
        xs = [math.log(n) for n, _ in pts]
        ys = [math.log(t) for _, t in pts]
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        out.append({"variant": variant, "dtype": dtype, "pass": pass_name, "exponent": slope,
                    "lengths": sorted(n for n, _ in pts)})
    return out


def machine_info(s) -> dict:
    import torch

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    mem = None
    try:
        with open("/proc/meminfo") as f:
            mem = int(next(line for line in f if line.startswith("MemTotal")).split()[1]) * 1024
    except (OSError, StopIteration):
        pass
    info = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
        "platform": platform.platform(), "python": platform.python_version(), "cpu": cpu,
        "cpu_count": os.cpu_count(), "memory_bytes": mem, "torch": torch.__version__,
        "torch_threads": s["threads"] or torch.get_num_threads(), "device": s["device"],
        "load_average_at_start": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }
    if s["device"] == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
    try:
        from . import __version__
        info["hf_dilated"] = __version__
    except ImportError:
        pass
    try:
        repo = Path(__file__).resolve().parent.parent
        info["git_commit"] = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"],
                                            capture_output=True, text=True, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        pass
    return info


# --------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------

def _ms(row):
    if "median_s" not in row:
        return row.get("note") or "-"
    return f"{row['median_s'] * 1e3:.1f} [{row['min_s'] * 1e3:.1f}-{row['max_s'] * 1e3:.1f}]"


def _mib(b):
    return "-" if b is None else f"{b / 2**20:.1f}"


def write_markdown(report: dict, path: Path) -> str:
    s, m = report["settings"], report["machine"]
    L = []
    L.append("# hf-dilated benchmark\n")
    L.append(f"- date (UTC): {m['date_utc']}; profile: `{s['profile']}`")
    L.append(f"- machine: {m['cpu']} ({m['cpu_count']} logical cores"
             + (f", {m['memory_bytes'] / 2**30:.1f} GiB" if m.get("memory_bytes") else "") + f"), {m['platform']}"
             + (f"; GPU {m['gpu']}" if m.get("gpu") else ""))
    load = m.get("load_average_at_start")
    L.append(f"- torch {m['torch']}, threads {m['torch_threads']}, device `{m['device']}`, dtypes "
             f"{', '.join(s['dtypes'])}; hf_dilated {m.get('hf_dilated', '?')} ({m.get('git_commit') or 'no git'})"
             + (f"; load average at start {load[0]:.2f}" if load else ""))
    L.append(f"- shape: batch {s['batch']}, {s['heads']} query heads, {s['kv_heads']} kv heads, head_dim "
             f"{s['head_dim']}; dilated: segment_lengths={s['segment_lengths']}, dilation_rates={s['dilation_rates']}; "
             f"block_sparse: block_size {s['block_size']}, pattern {json.dumps(s['block_pattern'])}")
    L.append(f"- time: median [min-max] of {s['repeats']} runs after {s['warmup']} warm-up, ms. Pairs: visible "
             "(query, key) pairs of the pattern, counted exactly; Gpairs/s = pairs / median time; ratio = that "
             "throughput / sdpa's at the same length and dtype, measured in this run. Memory: peak beyond the "
             "inputs (CPU: resident high-water mark of a fresh process per case; CUDA: max_memory_allocated), MiB.")
    L.append("")
    L.append("## Kernels\n")
    L.append("| dtype | N | variant | pairs | fwd ms | fwd Gpairs/s | fwd ratio | fwd MiB "
             "| fwd+bwd ms | fwd+bwd Gpairs/s | fwd+bwd ratio | fwd+bwd MiB |")
    L.append("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    by = {(r["variant"], r["n"], r["dtype"], r["pass"]): r for r in report["kernel_rows"]}
    for dtype in s["dtypes"]:
        for n in s["lengths"]:
            for variant in s["variants"]:
                f, b = by.get((variant, n, dtype, "forward")), by.get((variant, n, dtype, "backward"))
                if f is None and b is None:
                    continue
                cells = [dtype, str(n), variant, f"{(f or b).get('pairs') or 0:,}"]
                for row in (f, b):
                    if row is None:
                        cells += ["-"] * 4
                        continue
                    cells += [_ms(row), f"{row['pairs_per_s'] / 1e9:.3f}" if "pairs_per_s" in row else "-",
                              f"{row['ratio_to_sdpa']:.2f}" if "ratio_to_sdpa" in row else "-",
                              _mib(row.get("peak_extra_bytes"))]
                L.append("| " + " | ".join(cells) + " |")
    if report["unavailable_variants"]:
        L.append("")
        for variant, why in report["unavailable_variants"].items():
            L.append(f"- `{variant}` not measured: {why}")
    L.append("")
    L.append("`ring` and `dilated_ring` run here on one process (no group), where SPEC makes them equal to dense "
             "and dilated attention; the multi-process figures come from the distributed benchmark "
             "(see the last section). `auto` is `hf_dilated.create_attention(\"auto\")` with its defaults (what "
             "`DilatedMultiheadAttention` uses): dense sdpa up to the device's first segment "
             f"({_auto_limit(s['device'])} tokens here), dilated beyond it.\n")

    L.append("## Block-sparse against FlexAttention with the same mask\n")
    bsc = report["block_sparse_comparison"]
    if bsc["rows"]:
        from .bench_block_sparse import markdown_table

        L.append(f"hf_dilated.bench_block_sparse at N = {bsc['spec']['n']}, dtype {bsc['spec']['dtype']}, "
                 f"{bsc['spec']['repeats']} runs after 1 warm-up; FlexAttention gets the identical token mask.\n")
        L.append(markdown_table(bsc["rows"]))
        for line in bsc.get("log", []):
            if "unavailable" in line or "failed" in line:
                L.append(f"- {line}")
        L.append("")
    else:
        L.append((bsc["note"] or "No rows.") + "\n")

    L.append("## Issue 2 targets (N = 32768, batch 1, 8 heads, head_dim 64, issue's dilated config)\n")
    tgt = report["targets"]
    if not tgt:
        L.append("Not measured in this run (needs N=32768 in --lengths with the issue's shape and config).\n")
    else:
        L.append("| dtype | mode | fwd ratio (target >= 0.9) | fwd+bwd ratio (target >= 0.75) |")
        L.append("|---|---|---|---|")
        for t in tgt:
            cells = []
            for pass_name in ("forward", "backward"):
                r = t.get(pass_name)
                cells.append("-" if r is None else f"{r:.2f} ({'meets' if r >= TARGET_RATIO[pass_name] else 'misses'})")
            L.append(f"| {t['dtype']} | {t['variant']} | {cells[0]} | {cells[1]} |")
        L.append("")

    L.append("## Growth with sequence length\n")
    if report["exponents"]:
        L.append("Fitted exponent b of time ~ N^b (least squares on log-log); dense attention is 2, a fixed "
                 "pattern per token is 1.\n")
        L.append("| variant | dtype | pass | exponent | lengths |")
        L.append("|---|---|---|---:|---|")
        for e in report["exponents"]:
            L.append(f"| {e['variant']} | {e['dtype']} | {PASS_LABEL[e['pass']]} | {e['exponent']:.2f} | "
                     f"{', '.join(map(str, e['lengths']))} |")
    else:
        L.append("Needs at least two lengths.")
    L.append("")

    L.append("## Longest sequence within the memory budget\n")
    if report["search"] is None:
        L.append("Skipped (`--quick` leaves it out; pass `--search` to run it).\n")
    else:
        L.append(f"Budget {s['budget_gib']:g} GiB for inputs plus peak extra memory, {s['search_timeout']:g} s per "
                 f"attempt, dtype {s['dtypes'][0]}; doubling from {s['search_start']} up to {s['search_max']}, then "
                 f"{s['bisect_steps']} bisection steps (multiples of 256); each attempt is a fresh process "
                 "with its memory hard-limited to the budget.\n")
        L.append("| variant | pass | longest N that fits | first N that did not | limited by |")
        L.append("|---|---|---:|---:|---|")
        for r in report["search"]:
            L.append(f"| {r['variant']} | {PASS_LABEL[r['pass']]} | {r['longest'] or '-'} | "
                     f"{r['first_failure'] or '-'} | {r['limited_by']} |")
        L.append("")

    L.append("## Million-token forward (issue 2 memory check)\n")
    if report["million"] is None:
        L.append("Not run (pass `--million`; it takes minutes per mode).\n")
    else:
        L.append("float32, batch 1, 8 heads, head_dim 64, N = 1,048,576, issue 2's dilated config; peak memory "
                 "beyond q, k, v as a multiple of the size of q, k, v and the output together (target <= 1.5).\n")
        L.append("| mode | seconds | q+k+v+out MiB | peak extra MiB | multiple | target |")
        L.append("|---|---:|---:|---:|---:|---|")
        for r in report["million"]:
            mult = r.get("multiple_of_qkvo")
            L.append(f"| {r['variant']} | {r['seconds'] and round(r['seconds'], 1)} | {_mib(r['qkvo_bytes'])} | "
                     f"{_mib(r['peak_extra_bytes'])} | {'-' if mult is None else f'{mult:.2f}'} | "
                     f"{'-' if mult is None else ('meets' if mult <= MILLION_TARGET else 'misses')}"
                     f"{' ' + r['error'] if r.get('error') else ''} |")
        L.append("")

    L.append("## End to end: tiny Llama forward + backward\n")
    e2e = report["e2e"]
    if e2e is None:
        L.append("Not run (`--no-e2e`).\n")
    else:
        mc = e2e["model_config"]
        L.append(f"LlamaForCausalLM with random weights ({mc['num_hidden_layers']} layers, hidden "
                 f"{mc['hidden_size']}, {mc['num_attention_heads']} heads over {mc['num_key_value_heads']} kv heads, "
                 f"vocab {mc['vocab_size']}), batch 1, loss + backward, dtype {s['dtypes'][0]}; "
                 f"hf_dilated config {json.dumps(e2e['hf_dilated'])}.\n")
        L.append("| attn_implementation | N | ms | tokens/s | speed vs sdpa | peak MiB |")
        L.append("|---|---:|---:|---:|---:|---:|")
        base = {}
        for r in e2e["rows"]:
            p = r.get("passes", {}).get("backward", {})
            if r["spec"]["attn_implementation"] == "sdpa" and "median_s" in p:
                base[r["spec"]["n"]] = p["median_s"]
        for r in e2e["rows"]:
            p, n = r.get("passes", {}).get("backward", {}), r["spec"]["n"]
            impl = r["spec"]["attn_implementation"]
            if "median_s" in p:
                t = p["median_s"]
                L.append(f"| {impl} | {n} | {t * 1e3:.1f} [{min(p['times_s']) * 1e3:.1f}-{max(p['times_s']) * 1e3:.1f}] "
                         f"| {n / t:,.0f} | {f'{base[n] / t:.2f}' if n in base else '-'} | "
                         f"{_mib(p['peak_extra_bytes'])} |")
            else:
                L.append(f"| {impl} | {n} | {r.get('unavailable') or r.get('error') or p.get('error')} | - | - | - |")
        L.append("")
        for name, why in e2e["unavailable"].items():
            L.append(f"- `{name}` unavailable: {why}")
        L.append("- transformers' `eager` and `flex_attention` are not run: eager materialises the N x N weights "
                 "per layer, and FlexAttention has no CPU backward; the kernel table has compiled `flex` forward.")
        L.append("")

    L.append("## Multi-process (ring attention over a process group)\n")
    dist = report["distributed"]
    L.append(dist["note"] + "\n")
    if dist["rows"]:
        L.append("| kernel | processes | time / step (s) | peak MiB above inputs | sent per rank (MiB) |")
        L.append("|---|---:|---:|---:|---:|")
        for r in dist["rows"]:
            if "error" in r:
                L.append(f"| {r['kernel']} | {r['processes']} | {r['error']} | - | - |")
            else:
                L.append(f"| {r['kernel']} | {r['processes']} | {r['time_s']:.3f} | {r['peak_mib']:.1f} | "
                         f"{r['sent_mib']:.2f} |")
        L.append("")
    text = "\n".join(L)
    path.write_text(text)
    return text


def _auto_limit(device: str) -> int:
    from .nn import AUTO_DENSE_MAX_LEN

    return AUTO_DENSE_MAX_LEN.get(device, 4096)


def write_plots(report: dict, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    rows = [r for r in report["kernel_rows"] if "median_s" in r]
    palette = plt.get_cmap("tab10")
    color = {v: palette(i % 10) for i, v in enumerate(KERNEL_VARIANTS)}  # same colour in every panel
    dash = {"float32": "-", "bfloat16": "--", "float16": ":"}
    for key, ylabel, fname, scale in (("median_s", "time (ms)", "time_vs_length.png", 1e3),
                                      ("peak_extra_bytes", "peak extra memory (MiB)", "memory_vs_length.png", 2**-20)):
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        for ax, pass_name in zip(axes, ("forward", "backward")):
            series = {}
            for r in rows:
                if r["pass"] == pass_name and r[key] > 0:
                    series.setdefault((r["variant"], r["dtype"]), []).append((r["n"], r[key] * scale))
            for (variant, dtype), pts in sorted(series.items()):
                pts.sort()
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=color[variant],
                        linestyle=dash[dtype], label=f"{variant} ({dtype})")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("sequence length N")
            ax.set_ylabel(ylabel)
            ax.set_title(PASS_LABEL[pass_name])
            ax.grid(True, which="both", alpha=0.3)
            if series:
                ax.legend(fontsize=7)
        fig.suptitle(f"hf-dilated bench: {ylabel} vs length ({report['machine']['device']}, "
                     f"torch {report['machine']['torch']})")
        fig.tight_layout()
        fig.savefig(out / fname, dpi=110)
        plt.close(fig)
        written.append(fname)
    return written


def run_distributed(s) -> dict:
    """ring and dilated_ring over 1 and 2 gloo processes, through hf_dilated.distributed.bench."""
    try:
        from .distributed import bench as dist_bench
    except ImportError as e:
        return {"note": f"hf_dilated.distributed.bench is not available in this build ({e})", "rows": []}
    if not s["distributed"]:
        return {"note": "Not run (off with --quick; pass --distributed, or run `python -m "
                        "hf_dilated.distributed.bench` for more process counts).", "rows": []}
    n = max(n for n in s["lengths"] if n <= 8192) if min(s["lengths"]) <= 8192 else 8192
    n -= n % 4
    seg = [w for w in s["segment_lengths"] if w < n] + [n]
    cfg = dict(seq_len=n, heads=s["heads"], kv_heads=s["kv_heads"], head_dim=s["head_dim"], segment_lengths=seg,
               dilation_rates=[2**g for g in range(len(seg))], reps=max(1, s["repeats"]))
    rows = []
    for kernel in ("ring", "dilated_ring"):
        for world in (1, 2):
            try:
                r = dist_bench.run(kernel, world, cfg)
                rows.append(dict(r, kernel=kernel, processes=world))
            except Exception as e:  # noqa: BLE001 - a failed row is reported, not fatal
                rows.append({"kernel": kernel, "processes": world, "error": f"{type(e).__name__}: {e}"})
            _say(f"  {kernel} x{world}: {rows[-1]}")
    return {"note": (f"Global length {n}, float32 forward + backward, gloo on this CPU, dilated levels "
                     f"segment_lengths={seg}, dilation_rates={cfg['dilation_rates']}; worst rank. With as many "
                     "processes as cores the times include contention; compare memory and bytes sent across "
                     "process counts. More: `python -m hf_dilated.distributed.bench`."), "rows": rows, "config": cfg}


def targets(s, rows) -> list[dict]:
    if not (s["heads"] == 8 and s["head_dim"] == 64 and s["batch"] == 1 and s["kv_heads"] == 8
            and s["segment_lengths"] == TARGET_SEGMENTS and s["dilation_rates"] == TARGET_DILATIONS):
        return []
    out = []
    for dtype in s["dtypes"]:
        for mode in DILATED_MODES:
            entry = {"dtype": dtype, "variant": mode}
            for row in rows:
                if (row["variant"], row["n"], row["dtype"]) == (mode, TARGET_N, dtype) and "ratio_to_sdpa" in row:
                    entry[row["pass"]] = row["ratio_to_sdpa"]
            if len(entry) > 2:
                out.append(entry)
    return out


def main(args) -> int:
    t_start = time.perf_counter()
    try:
        s = _settings(args)
    except (TypeError, ValueError) as e:
        print(f"hf-dilated bench: error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runner = CaseRunner()
    machine = machine_info(s)
    _say(f"hf-dilated bench ({s['profile']}): {machine['cpu']}, torch {machine['torch']}, "
         f"{machine['torch_threads']} threads, device {s['device']}, dtypes {s['dtypes']}")
    for variant in s["skipped_variants"]:
        _say(f"  {variant}: skipped in this profile ({SKIP_REASON.get(variant, '')})")

    _say("kernels:")
    results = run_kernels(s, runner)
    rows = kernel_rows(results)
    unavailable = {r["spec"]["variant"]: r.get("unavailable") or r.get("error")
                   for r in results if r.get("unavailable")}
    for variant in s["skipped_variants"]:
        unavailable[variant] = "skipped: " + SKIP_REASON.get(variant, "")
    available = [v for v in s["variants"] if v not in unavailable]

    if "block_sparse" in s["variants"] and "flex" not in s["skipped_variants"]:
        _say("block-sparse against FlexAttention with the same mask:")
    block_sparse = run_block_sparse_comparison(s, runner)
    search = None
    if s["search"]:
        _say(f"longest sequence within {s['budget_gib']:g} GiB:")
        search = run_search(s, runner, available)
    million = None
    if s["million"]:
        _say("million-token forward:")
        million = run_million(s, runner)
    if s["distributed"]:
        _say("multi-process:")
    distributed = run_distributed(s)
    e2e = None
    if s["e2e"]:
        _say("end to end:")
        e2e = run_e2e(s, runner)

    report = {
        "settings": {k: v for k, v in s.items() if k != "skip_variants"},
        "machine": machine,
        "kernel_results": results,
        "kernel_rows": rows,
        "unavailable_variants": unavailable,
        "targets": targets(s, rows),
        "exponents": fit_exponents(rows),
        "search": search,
        "million": million,
        "e2e": e2e,
        "distributed": distributed,
        "block_sparse_comparison": block_sparse,
    }
    report["elapsed_s"] = time.perf_counter() - t_start
    (out / "results.json").write_text(json.dumps(report, indent=1, default=str))
    text = write_markdown(report, out / "report.md")
    plots = write_plots(report, out)
    print(text)
    _say(f"wrote {out / 'report.md'}, {out / 'results.json'}, " + ", ".join(str(out / p) for p in plots)
         + f" in {report['elapsed_s']:.0f} s")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m hf_dilated.bench", description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
