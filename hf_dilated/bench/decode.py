"""Decode benchmark: one new token against a KV cache of N tokens, dilated attention vs sdpa.

A decode step of dilated attention gathers, per level, only the w_g / r_g keys of the query's
segment that its head selects, so its cost follows sum_g w_g / r_g, not N. The configuration is
the documented default for a checkpoint pretrained at --original tokens and extended to N
(DilatedConfig.default: segments original * 2^g, dilations 2^g). One process per (context, dtype);
the two are timed in interleaved rounds and their memory measured after (measure.py).
"""
from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F

from .. import measure
from .kernels import DTYPES
from .report import mib, say


def run_decode_case(spec: dict, own_process: bool = False) -> dict:
    from ..config import DilatedConfig
    from ..ops import dilated_attention

    device, dtype, n = torch.device(spec["device"]), DTYPES[spec["dtype"]], spec["n"]
    cfg = DilatedConfig.default(spec["original"], n)
    gen = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(1, spec["heads"], 1, spec["head_dim"], generator=gen, dtype=dtype).to(device)
    k, v = (torch.randn(1, spec["kv_heads"], n, spec["head_dim"], generator=gen, dtype=dtype).to(device)
            for _ in range(2))
    gqa = spec["heads"] != spec["kv_heads"]
    steps = {
        # what transformers' sdpa does for one query with grouped heads: no mask, enable_gqa
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa),
        "dilated": lambda: dilated_attention(q, k, v, cfg.segment_lengths, cfg.dilation_rates, mode=cfg.mode),
    }
    log = []
    with torch.no_grad():
        times = measure.time_interleaved(list(steps.items()), spec["repeats"], warmup=max(1, spec["warmup"]),
                                       log=log.append, device=device)
        timed = {name: {"times_s": t, "median_s": statistics.median(t)}
                 for name, t in zip(steps, times) if t is not None}
        measure.measure_memory({name: steps[name] for name in timed}, timed, device, own_process)
    keys = sum(w // r for w, r in zip(cfg.segment_lengths, cfg.dilation_rates))
    return {"spec": spec, "levels": len(cfg.segment_lengths), "keys_per_query": min(keys, n),
            "segment_lengths": cfg.segment_lengths, "dilation_rates": cfg.dilation_rates, "passes": timed, "log": log}


def run_section(s, runner, report) -> dict:
    results = []
    for dtype in s["dtypes"]:
        for n in s["contexts"]:
            spec = dict(kind="decode", n=n, original=s["original"], heads=s["heads"], kv_heads=s["kv_heads"],
                        head_dim=s["head_dim"], dtype=dtype, device=s["device"], warmup=s["warmup"],
                        repeats=s["repeats"], threads=s["threads"])
            r = runner.run(spec, s["case_timeout"])
            p = r.get("passes", {})
            say(f"  decode {dtype:>8} N={n:<7} " + ("; ".join(
                f"{name} {p[name]['median_s'] * 1e3:.2f} ms" for name in p if "median_s" in p[name])
                or r.get("error", "")))
            results.append(r)
    return {"results": results}


def _cells(p) -> list[str]:
    if "median_s" not in p:
        return [p.get("error", "-"), "-"]
    t = p["times_s"]
    return [f"{p['median_s'] * 1e3:.2f} [{min(t) * 1e3:.2f}-{max(t) * 1e3:.2f}]", mib(p.get("peak_extra_bytes"))]


def markdown_section(section, s) -> list[str]:
    L = ["## Decode: one token against a KV cache of N tokens\n",
         f"{s['heads']} query heads over {s['kv_heads']} kv heads, head_dim {s['head_dim']}; dilated config "
         f"DilatedConfig.default({s['original']}, N). Time: median [min-max] of {s['repeats']} interleaved rounds, "
         "ms; ratio = dilated / sdpa time (median runs; fastest runs). Memory: peak beyond the cache in one more "
         "call, MiB.\n",
         "| dtype | N | levels | keys per query <= | sdpa ms | sdpa MiB | dilated ms | dilated MiB | dilated / sdpa |",
         "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in section["results"]:
        spec, p = r["spec"], r.get("passes", {})
        if "error" in r:
            L.append(f"| {spec['dtype']} | {spec['n']} | {r['error']} | - | - | - | - | - | - |")
            continue
        sdpa, dil = p.get("sdpa", {}), p.get("dilated", {})
        ratio = "-"
        if "median_s" in sdpa and "median_s" in dil:
            ratio = (f"{dil['median_s'] / sdpa['median_s']:.2f} "
                     f"({min(dil['times_s']) / min(sdpa['times_s']):.2f})")
        L.append(f"| {spec['dtype']} | {spec['n']} | {r['levels']} | {r['keys_per_query']} | "
                 + " | ".join(_cells(sdpa) + _cells(dil)) + f" | {ratio} |")
    L += [f"- N={r['spec']['n']}: {line}" for r in section["results"] for line in r.get("log", [])]
    return L + [""]
