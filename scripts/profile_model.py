"""Where a model's time goes on a GPU: the Llama-shaped model of scripts/gpu_check.sh (random
weights), converted as hf_dilated.bench.gpu_table converts it, timed beside sdpa's kernels in the
same process, then one call under torch.profiler (the ops by GPU time, and dynamo's recompiles).
Every timing comes before the first profile: once torch.profiler has traced CUDA, the process may
keep NVIDIA's tracing library attached (pytorch/pytorch#144455), which slows every later launch (on
2026-11-27 sdpa's decode step took 5.2-5.4 ms after a profile, 2.3-3.6 ms in gpu_table's processes).

  prefill: N tokens beside sdpa's flash and cuDNN kernels; with the default conversion both row
    layouts of the FlexAttention far path (ops/sparse_far_flex.LAYOUT) are timed, their logits compared.
  decode: one step after a prefill of N tokens (ReservedCache, and DynamicCache), beside sdpa's,
    timed in turn (7 rounds), each with its host's and its GPU's time apart (hf_dilated.measure.host_and_device); ours
    profiled with each cache, after how its layers' steps ran (graphed, compiled, eager).
  train: one training step (forward and backward, the loss over every token) beside sdpa's kernels;
    with the default conversion past its context, ops/sparse_far_train's path (and whether its
    backward fell back to the masked calls).

    python scripts/profile_model.py [--steps prefill,decode] [--lengths 16384,65536] [--conversion default|union] [--top 25]
    python scripts/profile_model.py --lengths 16384 --layouts by_block --picks maxima,sort --merges reduce,by_slot
        # the selection's picks and the entries' sums, each pair (after gpu_check.sh: its compile caches)
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


def profile(fn, device: str, top: int, by_count: int = 0) -> None:
    """One call of fn under torch.profiler: its aten ops' count, then the `top` ops by GPU time (CPU
    time elsewhere; none with top 0) and the `by_count` ops called most (a step's host bill: on the
    GPU machine a decode step costs ~20 us of host a dispatched op)."""
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device == "cuda"
                                                          else [])
    torch._dynamo.utils.counters.clear()
    with torch.profiler.profile(activities=activities, record_shapes=bool(top)) as prof:
        fn()
        sync()
    events = prof.key_averages()
    print("aten ops:", sum(e.count for e in events if e.key.startswith("aten::")))
    sort = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
    if top:
        print(events.table(sort_by=sort, row_limit=top, max_name_column_width=60))
        # the same ops by input shape: which tensors the eager elementwise ops and copies move
        # (on an H200, 2026-11-27, 15 of a 16K prefill's 59.5 ms went to ops the table names only by kind)
        shaped = [e for e in prof.key_averages(group_by_input_shape=True) if e.key.startswith("aten::")]
        print("aten ops by input shape (" + ("GPU" if device == "cuda" else "CPU") + " time, calls, shapes):")
        timed_by = (lambda e: e.self_device_time_total) if device == "cuda" else (lambda e: e.self_cpu_time_total)
        for e in sorted(shaped, key=timed_by, reverse=True)[:top]:
            print(f"  {timed_by(e) / 1e3:9.3f} ms {e.count:5d}  {e.key} {str(e.input_shapes)[:160]}")
    if by_count:
        print("most called:", ", ".join(f"{e.key} {e.count}" for e in sorted(events, key=lambda e: -e.count)[:by_count]))
    print("dynamo counters:", {k: dict(v) for k, v in torch._dynamo.utils.counters.items() if v})


def main() -> None:
    from transformers import DynamicCache

    from hf_dilated import measure
    from hf_dilated.bench import gpu_table
    from hf_dilated.integrations.cache import ReservedCache
    from hf_dilated.ops import sparse_far_flex, sparse_far_train

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", default="prefill", help="prefill, decode, train (comma-separated)")
    parser.add_argument("--lengths", default="16384")
    parser.add_argument("--conversion", default="default", choices=("default", "union"))
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--host-top", type=int, default=15, help="decode: functions listed by host time")
    parser.add_argument("--picks", default=sparse_far_flex.PICKS,
                        help="by block, how the selection picks a query's blocks: " + ", ".join(sparse_far_flex.PICKERS)
                             + " (comma-separated: each timed with each of --merges, the first pair profiled)")
    parser.add_argument("--layouts", default="by_block,by_query", help="the default conversion's far-key row layouts")
    parser.add_argument("--merges", default=sparse_far_flex.MERGE,
                        help="by block, how the entries are summed: " + ", ".join(sparse_far_flex.MERGES)
                             + " (comma-separated: each timed, the first profiled)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, on the CPU when there is no GPU")
    args = parser.parse_args()
    merges, picks = args.merges.split(","), args.picks.split(",")
    for option, given, allowed in (("--merges", merges, sparse_far_flex.MERGES),
                                   ("--picks", picks, tuple(sparse_far_flex.PICKERS))):
        if set(given) - set(allowed):
            raise SystemExit(f"{option}: {','.join(given)!r}: each one of {', '.join(allowed)}")
    steps = args.steps.split(",")
    if set(steps) - {"prefill", "decode", "train"}:
        raise SystemExit(f"--steps: {args.steps!r}: each one of prefill, decode, train")
    s = gpu_table.settings(args.smoke)
    device = gpu_table._device(s)
    print(torch.cuda.get_device_name(0) if device == "cuda" else device, "torch", torch.__version__)
    profiles = []  # (title, call): run after every timing (module docstring)
    for n in map(int, args.lengths.split(",")):
        spec = dict(device=device, dtype=s["dtype"], model=s["model"], n=n, original=s["original"])
        base, config, ids = gpu_table._build_model(dict(spec, conversion="sdpa"))
        ours, _, _ = gpu_table._build_model(dict(spec, conversion=args.conversion))
        arg = gpu_table._cache_arg(ours)

        def prefill(model, cache=None, ids=ids):  # (bound now: a profile runs after the later lengths)
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
            # by block: every (picks, merge) pair, one after the other in this process (each compiles
            # what it changes; the first call's time printed is then that part's compile alone)
            variants = [(layout, pick, merge) for layout in layouts
                        for pick, merge in ([(p, m) for p in picks for m in merges] if layout == "by_block"
                                            else [(picks[0], merges[0])])]
            logits = {}
            for layout, pick, merge in variants:
                if layout:
                    sparse_far_flex.LAYOUT, sparse_far_flex.PICKS, sparse_far_flex.MERGE = layout, pick, merge
                name = layout or ""
                if layout == "by_block" and len(picks) * len(merges) > 1:
                    name += f" picked by {pick}, merged by {merge}"
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
            def profile_prefill(ours=ours, prefill=prefill, variant=variants[0]):
                if variant[0]:
                    sparse_far_flex.LAYOUT, sparse_far_flex.PICKS, sparse_far_flex.MERGE = variant
                profile(lambda: prefill(ours), device, args.top)
                print("dynamo compile times (s):", torch._dynamo.utils.compile_times(repr="str"))

            profiles.append((f"prefill, N {n}: {args.conversion} {' '.join(filter(None, variants[0]))}",
                             profile_prefill))
        if "train" in steps:
            def train_step(model, ids=ids):
                model.zero_grad(set_to_none=True)
                model(input_ids=ids, labels=ids, use_cache=False).loss.backward()

            sdpa = {}
            for b in gpu_table.sdpa_backends(device, s):
                with gpu_table._sdpa_context(b):
                    sdpa[b] = timed(lambda: train_step(base))
            ms = timed(lambda: train_step(ours))
            print(f"\n== training step, N {n}: sdpa " + ", ".join(f"{b} {t:.2f} ms" for b, t in sdpa.items())
                  + f"; {args.conversion} {ms:.2f} ms, speed {min(sdpa.values()) / ms:.2f}x of sdpa's best"
                  + (f"; its backward fell back: {sparse_far_train._BACKWARD_FAILED}"
                     if sparse_far_train._BACKWARD_FAILED else ""))
            profiles.append((f"training step, N {n}: {args.conversion}",
                             lambda ours=ours, train_step=train_step: profile(lambda: train_step(ours), device, args.top)))
        if "decode" in steps:
            token = ids[:, -1:]
            print(f"\n== decode step after N {n}")
            # sdpa under each of its kernels (unrestricted, a step with grouped heads fell back to
            # its math kernel: 50 ms at 128K on an H200, where flash took 2)
            runs = [(f"sdpa {b}", base, b) for b in gpu_table.sdpa_backends(device, s)] + [(args.conversion, ours, None)]
            for label, make in (("ReservedCache", ReservedCache), ("DynamicCache", DynamicCache)):
                cache_steps = {}  # name -> (step, backend): each with its own cache, filled by its own prefill
                for name, model, backend in runs:
                    cache = make(config=config)
                    with gpu_table._sdpa_context(backend) if backend else contextlib.nullcontext():
                        prefill(model, cache)

                    def step(model=model, cache=cache, token=token, backend=backend):
                        with torch.no_grad(), (gpu_table._sdpa_context(backend) if backend else contextlib.nullcontext()):
                            model(input_ids=token, **{arg: cache}, use_cache=True)

                    sync()
                    start = time.perf_counter()
                    try:
                        step()  # (ours' first step past the band compiles or captures its graphs)
                        sync()
                    except Exception as exc:  # noqa: BLE001 - reported; the other steps and lengths go on
                        print(f"  {label} {name}: first step failed: {measure.error_text(exc)}", flush=True)
                        continue
                    print(f"  {label} {name}: first step {1e3 * (time.perf_counter() - start):.0f} ms", flush=True)
                    cache_steps[name] = (step, backend)
                # the steps timed in turn, round by round: a slow spell of the machine falls on each alike
                # (one after the other, sdpa's step took 2.3 ms in one process and 3.6 in the next); sdpa's
                # steps each enter their kernel's context (sdpa_kernel: microseconds of host time)
                paths = {}
                with gpu_table.step_paths(paths):  # (counts ours' layer steps; sdpa's never reach them)
                    rounds = measure.time_interleaved([(name, step) for name, (step, _) in cache_steps.items()], repeats=7,
                                                      warmup=1, device=torch.device(device))
                ms = {name: 1e3 * statistics.median(t) for name, t in zip(cache_steps, rounds) if t}
                for name, (step, backend) in cache_steps.items():
                    if name not in ms:  # (it raised: time_interleaved printed why)
                        continue
                    split = measure.host_and_device(step, torch.device(device), busy_s=max(0.05, 4e-3 * ms.get(name, 0)))
                    if split:  # which bounds the step: its host's work or its GPU's, or a wait
                        apart = ("waits for the GPU" if split["host_s"] is None else
                                 f"host {1e3 * split['host_s']:.2f} ms, GPU {1e3 * split['device_s']:.2f} ms")
                        print(f"  {label} {name}: {apart} (waited in {split['waited']} of {split['calls']} calls)")
                    waits = measure.synchronizing_calls(step, torch.device(device))
                    if waits is not None:  # where it waits, if it does (a read back, a blocking copy)
                        print(f"  {label} {name}: synchronizing calls in a step: {len(waits)}"
                              + "".join(f"\n    {w}" for w in waits[:12]))
                    if backend is None or backend == runs[0][2]:  # where a host-bound step's host time goes
                        print(f"  {label} {name}: host time by function (cProfile, 3 steps)\n"
                              + measure.host_profile(step, calls=3, top=args.host_top))

                        def profile_step(step=step, backend=backend):
                            # ours: where the time goes; sdpa: its host bill beside ours (its op count)
                            profile(step, device, args.top if backend is None else 0, by_count=40)

                        profiles.append((f"decode step after N {n}, {label}: {name}", profile_step))
                print(f"  {label} layer steps: {paths or 'no sparse-far step'}; fell back: "
                      f"{gpu_table.fallbacks() or 'nothing'}")
                sdpa_ms = [v for k, v in ms.items() if k.startswith("sdpa")]
                speed = (f"speed {min(sdpa_ms) / ms[args.conversion]:.2f}x of sdpa's best (7 rounds in turn, medians)"
                         if sdpa_ms and args.conversion in ms else "no ratio: a step failed")
                print(f"{label}: " + ", ".join(f"{k} {ms[k]:.2f} ms" if k in ms else f"{k} failed" for k, _, _ in runs)
                      + f"; {speed}")
                del cache_steps, step
        if device == "cuda":  # what no profile holds (caches of unprofiled steps) goes before the next length
            torch.cuda.empty_cache()
    for title, call in profiles:
        print(f"\n== profile: {title}")
        call()


if __name__ == "__main__":
    main()
