"""Where a prefill's time goes on a GPU: the Llama-shaped model of scripts/gpu_check.sh (random
weights), converted as hf_dilated.bench.gpu_table converts it, timed beside sdpa's flash and cuDNN
kernels in the same process, then one prefill under torch.profiler (the ops by GPU time, and
dynamo's recompiles). With the default conversion, both row layouts of the FlexAttention far path
(ops/sparse_far_flex.LAYOUT) are timed, and their logits compared.

    python scripts/profile_prefill.py [--lengths 16384,65536] [--conversion default|union] [--top 25]
    python scripts/profile_prefill.py --smoke --lengths 512   # tiny sizes on the CPU (checks this script)
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, repeats: int = 3) -> float:
    """Median ms of `repeats` calls after one untimed call (which compiles)."""
    fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    from hf_dilated.bench import gpu_table
    from hf_dilated.ops import sparse_far_flex

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="16384")
    parser.add_argument("--conversion", default="default", choices=("default", "union"))
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, on the CPU when there is no GPU")
    args = parser.parse_args()
    s = gpu_table.settings(args.smoke)
    device = gpu_table._device(s)
    print(torch.cuda.get_device_name(0) if device == "cuda" else device, "torch", torch.__version__)
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device == "cuda"
                                                          else [])
    for n in map(int, args.lengths.split(",")):
        spec = dict(device=device, dtype=s["dtype"], model=s["model"], n=n, original=s["original"])
        base, _, ids = gpu_table._build_model(dict(spec, conversion="sdpa"))
        ours, _, _ = gpu_table._build_model(dict(spec, conversion=args.conversion))

        def prefill(model):
            with torch.no_grad():
                return model(input_ids=ids, use_cache=False, logits_to_keep=1).logits

        sdpa = {}
        for b in gpu_table.sdpa_backends(device, s):
            with gpu_table._sdpa_context(b):
                sdpa[b] = timed(lambda: prefill(base))
        best = min(sdpa.values())
        print(f"\n== N {n}: sdpa " + ", ".join(f"{b} {ms:.2f} ms" for b, ms in sdpa.items()))
        layouts = ("by_block", "by_query") if args.conversion == "default" else (None,)
        logits = {}
        for layout in layouts:
            if layout:
                sparse_far_flex.LAYOUT = layout
            ms = timed(lambda: prefill(ours))
            logits[layout] = prefill(ours).float()
            print(f"{args.conversion} {layout or ''}: {ms:.2f} ms, speed {best / ms:.2f}x of sdpa's best"
                  f"{'; FlexAttention failed: ' + sparse_far_flex._FAILED if sparse_far_flex._FAILED else ''}")
        if len(logits) == 2:
            a, b = logits.values()
            print(f"logits by_block vs by_query: max |diff| {(a - b).abs().max().item():.3e} "
                  f"(scale {a.abs().max().item():.3e})")
        sparse_far_flex.LAYOUT = layouts[0] or sparse_far_flex.LAYOUT
        torch._dynamo.utils.counters.clear()
        with torch.profiler.profile(activities=activities) as prof:
            prefill(ours)
            sync()
        sort = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=sort, row_limit=args.top, max_name_column_width=60))
        print("dynamo counters:", {k: dict(v) for k, v in torch._dynamo.utils.counters.items() if v})
        del base, ours
        if device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
