"""Sliding-window benchmark: a Mistral-style window W over N tokens, forward and forward +
backward, hf_dilated's kernels vs sdpa.

transformers' sdpa honours a window with a dense (N x N) boolean mask, so its cost and memory grow
with N^2 whatever W is. hf_dilated keeps the window as a band: "ring" on one process is exact dense
attention within the window; "dilated" is the default pattern of a checkpoint pretrained at W
tokens and extended to N (DilatedConfig.default), windowed. One process per (N, dtype); the
variants are timed in interleaved rounds and their memory measured after (measure.py).
"""
from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F

from .. import measure
from .kernels import DTYPES
from .report import mib, say

PASSES = ("forward", "forward+backward")


def run_window_case(spec: dict, own_process: bool = False) -> dict:
    from ..config import DilatedConfig
    from ..ops import dilated_attention
    from ..ops.dense import dense_attention

    device, dtype, n, w = torch.device(spec["device"]), DTYPES[spec["dtype"]], spec["n"], spec["window"]
    cfg = DilatedConfig.default(w, n)
    gen = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(spec["batch"], spec["heads"], n, spec["head_dim"], generator=gen, dtype=dtype).to(device)
    k, v = (torch.randn(spec["batch"], spec["kv_heads"], n, spec["head_dim"], generator=gen, dtype=dtype).to(device)
            for _ in range(2))
    gqa = spec["heads"] != spec["kv_heads"]
    index = torch.arange(n, device=device)
    band = (index[None, :] <= index[:, None]) & (index[None, :] > index[:, None] - w)  # what sdpa is given

    kernels = {
        "sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=band, enable_gqa=gqa),
        "ring": lambda q, k, v: dense_attention(q, k, v, sliding_window=w),
        "dilated": lambda q, k, v: dilated_attention(q, k, v, cfg.segment_lengths, cfg.dilation_rates,
                                                     mode=cfg.mode, sliding_window=w),
    }
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]

    def backward(fn):
        def step():
            fn(*leaves).sum().backward()
        return step

    passes = {}
    log = []
    for name, make in (("forward", lambda fn: (lambda: fn(q, k, v))), ("forward+backward", backward)):
        steps = {variant: make(fn) for variant, fn in kernels.items()}
        ctx = torch.no_grad() if name == "forward" else torch.enable_grad()
        with ctx:
            times = measure.time_interleaved(list(steps.items()), spec["repeats"], warmup=max(1, spec["warmup"]),
                                           log=log.append, device=device)
            timed = {v: {"times_s": t, "median_s": statistics.median(t)}
                     for v, t in zip(steps, times) if t is not None}
            measure.measure_memory({v: steps[v] for v in timed}, timed, device, own_process)
        passes[name] = timed
    return {"spec": spec, "segment_lengths": cfg.segment_lengths, "dilation_rates": cfg.dilation_rates,
            "passes": passes, "log": log}


def run_section(s, runner, report) -> dict:
    results = []
    for dtype in s["dtypes"]:
        for n in s["lengths"]:
            spec = dict(kind="window", n=n, window=s["window"], batch=s["batch"], heads=s["heads"],
                        kv_heads=s["kv_heads"], head_dim=s["head_dim"], dtype=dtype, device=s["device"],
                        warmup=s["warmup"], repeats=s["repeats"], threads=s["threads"])
            r = runner.run(spec, s["case_timeout"])
            for name in PASSES:
                p = r.get("passes", {}).get(name, {})
                say(f"  window {dtype:>8} N={n:<7} W={s['window']} {name:<16} " + ("; ".join(
                    f"{v} {p[v]['median_s'] * 1e3:.1f} ms" for v in p if "median_s" in p[v]) or r.get("error", "")))
            results.append(r)
    return {"results": results}


def _ratio(p, variant):
    a, b = p.get(variant, {}), p.get("sdpa", {})
    if "median_s" not in a or "median_s" not in b:
        return "-"
    return f"{a['median_s'] / b['median_s']:.2f} ({min(a['times_s']) / min(b['times_s']):.2f})"


def markdown_section(section, s) -> list[str]:
    L = ["## Sliding window: W over N tokens\n",
         f"batch {s['batch']}, {s['heads']} query heads over {s['kv_heads']} kv heads, head_dim {s['head_dim']}, "
         f"window {s['window']}. sdpa gets the (N x N) window mask transformers builds for it; ring = exact "
         "attention within the window (one process); dilated = DilatedConfig.default(W, N) with the window. Time: "
         f"median of {s['repeats']} interleaved rounds, ms; ratio = ours / sdpa (median runs; fastest runs). "
         "Memory: peak in one more call, MiB.\n",
         "| dtype | N | pass | sdpa ms | sdpa MiB | ring ms | ring MiB | ring / sdpa | dilated ms | dilated MiB | "
         "dilated / sdpa |",
         "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in section["results"]:
        spec = r["spec"]
        if "error" in r:
            L.append(f"| {spec['dtype']} | {spec['n']} | {r['error']} |" + " - |" * 8)
            continue
        for name in PASSES:
            p = r["passes"].get(name, {})
            cells = []
            for v in ("sdpa", "ring", "dilated"):
                x = p.get(v, {})
                cells += [f"{x['median_s'] * 1e3:.1f}" if "median_s" in x else x.get("error", "-"),
                          mib(x.get("peak_extra_bytes"))]
                if v != "sdpa":
                    cells.append(_ratio(p, v))
            L.append(f"| {spec['dtype']} | {spec['n']} | {name} | " + " | ".join(cells) + " |")
    L += [f"- N={r['spec']['n']}: {line}" for r in section["results"] for line in r.get("log", [])]
    return L + [""]
