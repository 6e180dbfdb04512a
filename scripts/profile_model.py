"""Where a model's time goes on a GPU: the Llama-shaped model of scripts/gpu_check.sh (random
weights), converted as hf_dilated.bench.gpu_table converts it, timed beside sdpa's kernels in the
same process, then one call under torch.profiler (the ops by GPU time, and dynamo's recompiles).

  prefill: N tokens beside sdpa's flash and cuDNN kernels; with the default conversion both row
    layouts of the FlexAttention far path (ops/sparse_far_flex.LAYOUT) are timed, their logits compared.
  decode: one step after a prefill of N tokens (ReservedCache, and DynamicCache), beside sdpa's;
    ours profiled with each cache, after how its layers' steps ran (graphed, compiled, eager).

    python scripts/profile_model.py [--steps prefill,decode] [--lengths 16384,65536] [--conversion default|union] [--top 25]
    python scripts/profile_model.py --lengths 16384 --picks maxima,sort   # the selection's picks both ways
    python scripts/profile_model.py --lengths 16384 --layouts by_block --merges reduce,by_slot   # the entries' sums
    python scripts/profile_model.py --smoke --lengths 512   # tiny sizes on the CPU (checks this script)
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, repeats: int = 3) -> float:
    """Median ms of `repeats` calls after one call (which compiles; its time is printed)."""
    sync()
    start = time.perf_counter()
    fn()
    sync()
    print(f"  first call (compiles): {1e3 * (time.perf_counter() - start):.0f} ms", flush=True)
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


# --- The selection's picks (--picks, sparse_far_flex.PICKS): on an H200 (2026-11-27) the top_k
# passes of far_selection.top_picks (unrolled by dynamo, fused by inductor into one reduction kernel)
# took 7.7 of a 16K prefill's 59 ms of GPU time (k = 24: 25 slots a query). Several: each runs in a
# process of its own with empty compile caches, so that every first call compiles all it needs.

def use_picks(name: str) -> None:
    """Makes the by-block plan pick with sparse_far_flex.PICKERS[name]: before any compile."""
    from hf_dilated.ops import sparse_far_flex

    if name not in sparse_far_flex.PICKERS:
        raise SystemExit(f"--picks: {name!r} is not one of {', '.join(sparse_far_flex.PICKERS)}")
    sparse_far_flex.PICKS = name


def each_picks_apart(args) -> None:
    """This script again per variant, in a process of its own with empty compile caches (inductor's
    and Triton's), so that each first call compiles all it needs (one process reusing another's
    kernels would time a cache hit)."""
    import os
    import subprocess
    import sys
    import tempfile

    argv = ["--steps", args.steps, "--lengths", args.lengths, "--conversion", args.conversion, "--top", str(args.top),
            "--layouts", "by_block", "--merges", args.merges] + (["--smoke"] if args.smoke else [])  # by query: no picks
    for name in args.picks.split(","):
        with tempfile.TemporaryDirectory() as cache:
            print(f"\n##### picks {name}: a process of its own, empty compile caches", flush=True)
            subprocess.run([sys.executable, __file__, *argv, "--picks", name], check=False,
                           env=dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, TRITON_CACHE_DIR=f"{cache}/triton"))


def profile(fn, device: str, top: int, by_count: int = 0) -> None:
    """One call of fn under torch.profiler: its aten ops' count, then the `top` ops by GPU time (CPU
    time elsewhere; none with top 0) and the `by_count` ops called most (a step's host bill: on the
    GPU machine a decode step costs ~20 us of host a dispatched op)."""
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device == "cuda"
                                                          else [])
    torch._dynamo.utils.counters.clear()
    with torch.profiler.profile(activities=activities) as prof:
        fn()
        sync()
    events = prof.key_averages()
    print("aten ops:", sum(e.count for e in events if e.key.startswith("aten::")))
    sort = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
    if top:
        print(events.table(sort_by=sort, row_limit=top, max_name_column_width=60))
    if by_count:
        print("most called:", ", ".join(f"{e.key} {e.count}" for e in sorted(events, key=lambda e: -e.count)[:by_count]))
    print("dynamo counters:", {k: dict(v) for k, v in torch._dynamo.utils.counters.items() if v})


def main() -> None:
    from transformers import DynamicCache

    from hf_dilated.bench import gpu_table
    from hf_dilated.integrations.cache import ReservedCache
    from hf_dilated.ops import sparse_far_flex

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", default="prefill", help="prefill, decode or both (comma-separated)")
    parser.add_argument("--lengths", default="16384")
    parser.add_argument("--conversion", default="default", choices=("default", "union"))
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--picks", default=sparse_far_flex.PICKS,
                        help="the default conversion's selection picks: one of " + ", ".join(sparse_far_flex.PICKERS)
                             + "; several "
                             "(comma-separated): each in a process of its own, with empty compile caches")
    parser.add_argument("--layouts", default="by_block,by_query", help="the default conversion's far-key row layouts")
    parser.add_argument("--merges", default=sparse_far_flex.MERGE,
                        help="by block, how the entries are summed: " + ", ".join(sparse_far_flex.MERGES)
                             + " (comma-separated: each timed, the first profiled)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, on the CPU when there is no GPU")
    args = parser.parse_args()
    if "," in args.picks:
        return each_picks_apart(args)
    use_picks(args.picks)
    steps = args.steps.split(",")
    s = gpu_table.settings(args.smoke)
    device = gpu_table._device(s)
    print(torch.cuda.get_device_name(0) if device == "cuda" else device, "torch", torch.__version__)
    for n in map(int, args.lengths.split(",")):
        spec = dict(device=device, dtype=s["dtype"], model=s["model"], n=n, original=s["original"])
        base, config, ids = gpu_table._build_model(dict(spec, conversion="sdpa"))
        ours, _, _ = gpu_table._build_model(dict(spec, conversion=args.conversion))
        arg = gpu_table._cache_arg(ours)

        def prefill(model, cache=None):
            with torch.no_grad():
                kw = {arg: cache, "use_cache": True} if cache is not None else {"use_cache": False}
                return model(input_ids=ids, logits_to_keep=1, **kw).logits

        if "prefill" in steps:
            sdpa = {}
            for b in gpu_table.sdpa_backends(device, s):
                with gpu_table._sdpa_context(b):
                    sdpa[b] = timed(lambda: prefill(base))
            best = min(sdpa.values())
            print(f"\n== prefill, N {n}: sdpa " + ", ".join(f"{b} {ms:.2f} ms" for b, ms in sdpa.items()))
            layouts = tuple(args.layouts.split(",")) if args.conversion == "default" else (None,)
            merges = args.merges.split(",")
            if set(merges) - set(sparse_far_flex.MERGES):
                raise SystemExit(f"--merges: {args.merges!r}: each one of {', '.join(sparse_far_flex.MERGES)}")
            logits = {}
            for layout in layouts:
                for merge in merges if layout == "by_block" else merges[:1]:
                    if layout:
                        sparse_far_flex.LAYOUT, sparse_far_flex.MERGE = layout, merge
                    name = f"{layout} merged {merge}" if layout == "by_block" and len(merges) > 1 else layout or ""
                    ms = timed(lambda: prefill(ours))
                    logits[name] = prefill(ours).float()
                    failed = [f"{what} failed: {why}" for what, why in (
                        ("FlexAttention", sparse_far_flex._FAILED),
                        ("compiling the plan", sparse_far_flex._FUSED_FAILED)) if why]
                    print(f"{args.conversion} {name}: {ms:.2f} ms, speed {best / ms:.2f}x of sdpa's best"
                          + "".join("; " + f for f in failed))
            (first, a), *others = logits.items() if len(logits) > 1 else [(None, None)]
            for name, b in others:
                print(f"logits {first} vs {name}: max |diff| {(a - b).abs().max().item():.3e} "
                      f"(scale {a.abs().max().item():.3e})")
            sparse_far_flex.LAYOUT, sparse_far_flex.MERGE = layouts[0] or sparse_far_flex.LAYOUT, merges[0]
            profile(lambda: prefill(ours), device, args.top)
            print("dynamo compile times (s):", torch._dynamo.utils.compile_times(repr="str"))
        if "decode" in steps:
            token = ids[:, -1:]
            print(f"\n== decode step after N {n}")
            # sdpa under each of its kernels (unrestricted, a step with grouped heads fell back to
            # its math kernel: 50 ms at 128K on an H200, where flash took 2)
            runs = [(f"sdpa {b}", base, b) for b in gpu_table.sdpa_backends(device, s)] + [(args.conversion, ours, None)]
            for label, make in (("ReservedCache", ReservedCache), ("DynamicCache", DynamicCache)):
                ms = {}
                for name, model, backend in runs:
                    cache = make(config=config)
                    with gpu_table._sdpa_context(backend) if backend else contextlib.nullcontext():
                        prefill(model, cache)

                        def step(model=model, cache=cache):
                            with torch.no_grad():
                                model(input_ids=token, **{arg: cache}, use_cache=True)

                        paths = {}
                        with gpu_table.step_paths(paths) if backend is None else contextlib.nullcontext():
                            ms[name] = timed(step, repeats=5)
                        if backend is None:  # how its layers' steps ran (graphed, compiled, eager), then where the time goes
                            print(f"  {label} layer steps: {paths or 'no sparse-far step'}; fell back: "
                                  f"{gpu_table.fallbacks() or 'nothing'}")
                            profile(step, device, args.top, by_count=40)
                        elif backend == runs[0][2]:  # sdpa's host bill beside ours: its op count
                            print(f"  {label} {name}:", end=" ")
                            profile(step, device, 0, by_count=40)
                    del cache
                best = min(v for k, v in ms.items() if k.startswith("sdpa"))
                print(f"{label}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in ms.items())
                      + f"; speed {best / ms[args.conversion]:.2f}x of sdpa's best")
        base = ours = None  # freed before the next length
        if device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
