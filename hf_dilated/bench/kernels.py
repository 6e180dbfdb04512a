"""Kernel benchmark: every attention variant (variants.py) against dense causal sdpa, forward and
forward+backward, one case (variant x length x dtype) per fresh process.

Per case: time as median [min-max] of `repeats` runs after `warmup` runs; useful pairs per second
(the (query, key) pairs the pattern makes visible, counted exactly in counts.py, divided by the
time) and that throughput as a ratio of sdpa's in the same run; peak memory beyond the inputs
(measure.py). From the rows: the fitted exponent of time vs length, and issue 2's target ratios.
The million-token forward (issue 2's memory check) is a section of this module too.
"""
from __future__ import annotations

import gc
import json
import math
import statistics

import torch

from .. import measure
from .ops import kernel_op_counts, markdown_ops
from .report import PASS_LABEL, case_summary, mib, say
from ..ops.validate import DILATED_MODES
from .variants import BUILDERS, Unavailable

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Issue 2's target shape and figures.
TARGET_SEGMENTS = [2048, 4096, 8192, 16384, 32768]
TARGET_DILATIONS = [1, 2, 4, 8, 16]
TARGET_N = 32768
TARGET_RATIO = {"forward": 0.9, "backward": 0.75}
MILLION = 1_048_576
MILLION_TARGET = 1.5


# --------------------------------------------------------------------------------------------
# In the case's process
# --------------------------------------------------------------------------------------------

def _random_qkv(spec, device, dtype, gen=None, requires_grad=False):
    """q, k, v drawn on `device` (gen: a generator of that device): drawn on the host and copied, a
    GPU case's 10^8-10^9 numbers took seconds of every case."""
    b, n, d = spec["batch"], spec["n"], spec["head_dim"]
    return [torch.randn(b, h, n, d, generator=gen, dtype=dtype, device=device).requires_grad_(requires_grad)
            for h in (spec["heads"], spec["kv_heads"], spec["kv_heads"])]


def _prewarm(spec, device, dtype) -> None:
    """Run the variant once on a short input, forward and backward, so that one-time costs (code
    paged in, thread pools) are not counted as the memory of a single measured call."""
    small = dict(spec, n=min(spec["n"], 256))
    q, k, v = _random_qkv(small, device, dtype, requires_grad=True)
    try:
        fn, _, no_backward = BUILDERS[spec["variant"]](small, q, k, v)
        out = fn(q, k, v)
        if not no_backward:
            out.sum().backward()
    except Unavailable:
        pass
    del q, k, v
    gc.collect()


def _backward_step(fn, q, k, v, gen):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    grad_out = torch.randn(q.shape, generator=gen, dtype=q.dtype, device=q.device)

    def step():
        fn(*leaves).backward(grad_out)
        for t in leaves:
            t.grad = None

    return step, grad_out.nbytes


def run_kernel_case(spec: dict, own_process: bool = False) -> dict:
    """Times every pass of one case, then measures the memory of each in one more call."""
    device, dtype = torch.device(spec["device"]), DTYPES[spec["dtype"]]
    result = {"spec": spec, "passes": {}}
    if spec.get("prewarm"):
        _prewarm(spec, device, dtype)
    measure.limit_memory(spec.get("budget_bytes"), device)  # the budget covers the inputs too
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = _random_qkv(spec, device, dtype, gen)
    result["qkvo_bytes"] = 2 * q.nbytes + k.nbytes + v.nbytes
    try:
        fn, pairs, no_backward = BUILDERS[spec["variant"]](spec, q, k, v)
    except Unavailable as e:
        result["unavailable"] = str(e)
        return result
    result["pairs"] = pairs
    steps = {}
    for pass_name in spec["passes"]:
        if pass_name == "backward" and no_backward:
            result["passes"][pass_name] = {"unsupported": no_backward}
            continue
        try:
            inputs = q.nbytes + k.nbytes + v.nbytes
            if pass_name == "forward":
                def step():
                    with torch.no_grad():
                        fn(q, k, v)
            elif pass_name == "backward":
                step, grad_bytes = _backward_step(fn, q, k, v, gen)
                inputs += grad_bytes
            else:
                raise ValueError(f"unknown pass {pass_name!r}")
            timed = measure.time_calls(step, device, spec["warmup"], spec["repeats"])
            result["passes"][pass_name] = dict(timed, inputs_bytes=inputs)
            steps[pass_name] = step
        except measure.CALL_ERRORS as e:
            result["passes"][pass_name] = {"error": measure.error_text(e)}
        gc.collect()
    measure.measure_memory(steps, result["passes"], device, own_process)
    if spec.get("ops"):  # after the timed and measured calls, which it cannot disturb
        try:
            result["ops"] = kernel_op_counts(fn, q, k, v, backward=not no_backward)
        except measure.CALL_ERRORS as e:
            result["ops"] = {"error": measure.error_text(e)}
    return result


# --------------------------------------------------------------------------------------------
# In the driver
# --------------------------------------------------------------------------------------------

def kernel_spec(s, variant, n, dtype, passes, **extra) -> dict:
    spec = dict(kind="kernel", variant=variant, n=n, dtype=dtype, device=s["device"], batch=s["batch"],
                heads=s["heads"], kv_heads=s["kv_heads"], head_dim=s["head_dim"],
                segment_lengths=s["segment_lengths"], dilation_rates=s["dilation_rates"],
                block_size=s["block_size"], block_pattern=s["block_pattern"], passes=passes,
                warmup=s["warmup"], repeats=s["repeats"], threads=s["threads"], ops=s.get("ops", False))
    spec.update(extra)
    return spec


def run_section(s, runner, report) -> dict:
    results, unavailable = [], {}
    for variant in s["skipped_variants"]:
        unavailable[variant] = "skipped: " + s["skip_reason"]
        say(f"  {variant}: skipped in this profile ({s['skip_reason']})")
    for dtype in s["dtypes"]:
        for n in s["lengths"]:
            for variant in s["variants"]:
                if variant in unavailable:
                    continue
                r = runner.run(kernel_spec(s, variant, n, dtype, ["forward", "backward"]), s["case_timeout"])
                if r.get("unavailable"):
                    unavailable[variant] = r["unavailable"]
                say(f"  {variant:>12} {dtype:>8} N={n:<7} {case_summary(r)}")
                results.append(r)
    rows = kernel_rows(results)
    ops = [{"variant": r["spec"]["variant"], "n": r["spec"]["n"], "dtype": r["spec"]["dtype"], "ops": r["ops"]}
           for r in results if r.get("ops")]
    return {"results": results, "rows": rows, "unavailable": unavailable, "targets": targets(s, rows),
            "exponents": fit_exponents(rows), "ops": ops}


def kernel_rows(results) -> list[dict]:
    """Flat rows with throughput and ratio to sdpa at the same (n, dtype, pass)."""
    rows, sdpa = [], {}
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


def targets(s, rows) -> list[dict]:
    """Issue 2's ratios of the dilated modes, where this run measured its shape at N = 32768."""
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


def run_million(s, runner, report) -> list[dict]:
    """A float32 forward at 1,048,576 tokens per dilated mode, issue 2's dilated config."""
    out = []
    for mode in [m for m in s["variants"] if m in DILATED_MODES] or ["union"]:
        spec = kernel_spec(s, mode, MILLION, "float32", ["forward"], warmup=0, repeats=1, prewarm=True,
                           segment_lengths=TARGET_SEGMENTS, dilation_rates=TARGET_DILATIONS)
        r = runner.run(spec, max(s["case_timeout"], 3600.0))
        p = r.get("passes", {}).get("forward", {})
        row = {"variant": mode, "n": MILLION, "qkvo_bytes": r.get("qkvo_bytes"),
               "peak_extra_bytes": p.get("peak_extra_bytes"), "seconds": p.get("median_s"),
               "error": r.get("error") or p.get("error") or r.get("unavailable")}
        if row["peak_extra_bytes"] is not None and row["qkvo_bytes"]:
            row["multiple_of_qkvo"] = row["peak_extra_bytes"] / row["qkvo_bytes"]
        say(f"  million {mode}: {row}")
        out.append(row)
    return out


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------

def _ms(row):
    if "median_s" not in row:
        return row.get("note") or "-"
    return f"{row['median_s'] * 1e3:.1f} [{row['min_s'] * 1e3:.1f}-{row['max_s'] * 1e3:.1f}]"


def _kernel_table(section, s) -> list[str]:
    L = ["| dtype | N | variant | pairs | fwd ms | fwd Gpairs/s | fwd ratio | fwd MiB "
         "| fwd+bwd ms | fwd+bwd Gpairs/s | fwd+bwd ratio | fwd+bwd MiB |",
         "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    by = {(r["variant"], r["n"], r["dtype"], r["pass"]): r for r in section["rows"]}
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
                              mib(row.get("peak_extra_bytes"))]
                L.append("| " + " | ".join(cells) + " |")
    return L


def _targets_and_growth(section) -> list[str]:
    L = ["## Issue 2 targets (N = 32768, batch 1, 8 heads, head_dim 64, issue's dilated config)\n"]
    if not section["targets"]:
        L.append("Not measured in this run (needs N=32768 in --lengths with the issue's shape and config).\n")
    else:
        L += ["| dtype | mode | fwd ratio (target >= 0.9) | fwd+bwd ratio (target >= 0.75) |", "|---|---|---|---|"]
        for t in section["targets"]:
            cells = []
            for pass_name in ("forward", "backward"):
                r = t.get(pass_name)
                cells.append("-" if r is None else f"{r:.2f} ({'meets' if r >= TARGET_RATIO[pass_name] else 'misses'})")
            L.append(f"| {t['dtype']} | {t['variant']} | {cells[0]} | {cells[1]} |")
        L.append("")
    L.append("## Growth with sequence length\n")
    if not section["exponents"]:
        return L + ["Needs at least two lengths.\n"]
    L += ["Fitted exponent b of time ~ N^b (least squares on log-log); dense attention is 2, a fixed "
          "pattern per token is 1.\n", "| variant | dtype | pass | exponent | lengths |", "|---|---|---|---:|---|"]
    for e in section["exponents"]:
        L.append(f"| {e['variant']} | {e['dtype']} | {PASS_LABEL[e['pass']]} | {e['exponent']:.2f} | "
                 f"{', '.join(map(str, e['lengths']))} |")
    return L + [""]


def markdown_section(section, s) -> list[str]:
    from ..nn import AUTO_DENSE_MAX_LEN

    L = ["## Kernels\n",
         f"Batch {s['batch']}, {s['heads']} query heads, {s['kv_heads']} kv heads, head_dim {s['head_dim']}; dilated: "
         f"segment_lengths={s['segment_lengths']}, dilation_rates={s['dilation_rates']}; block_sparse: block_size "
         f"{s['block_size']}, pattern {json.dumps(s['block_pattern'])}. Time: median [min-max] of {s['repeats']} runs after "
         f"{s['warmup']} warm-up, ms. Pairs: visible (query, key) pairs of the pattern, counted exactly; Gpairs/s = "
         "pairs / median time; ratio = that throughput / sdpa's at the same length and dtype, measured in this "
         "run. Memory: peak beyond the inputs in one more call after the timed ones (CPU: resident high-water "
         "mark of a fresh process per case; CUDA: max_memory_allocated), MiB.\n"]
    L += _kernel_table(section, s)
    L.append("")
    for variant, why in section["unavailable"].items():
        L.append(f"- `{variant}` not measured: {why}")
    L.append("\n`ring` and `dilated_ring` run here on one process (no group), where docs/contract.md 6 makes them equal to dense "
             "and dilated attention; the multi-process figures come from `hf-dilated bench distributed`. `auto` is "
             "`hf_dilated.create_attention(\"auto\")` with its defaults (what `DilatedMultiheadAttention` uses): "
             f"dense sdpa up to the device's first segment ({AUTO_DENSE_MAX_LEN.get(s['device'], 4096)} tokens "
             "here), dilated beyond it.\n")
    return L + markdown_ops(section.get("ops", [])) + _targets_and_growth(section)


def markdown_million(rows, s) -> list[str]:
    L = ["## Million-token forward (issue 2 memory check)\n",
         "float32, batch 1, 8 heads, head_dim 64, N = 1,048,576, issue 2's dilated config; peak memory beyond "
         "q, k, v as a multiple of the size of q, k, v and the output together (target <= 1.5).\n",
         "| mode | seconds | q+k+v+out MiB | peak extra MiB | multiple | target |",
         "|---|---:|---:|---:|---:|---|"]
    for r in rows:
        mult = r.get("multiple_of_qkvo")
        L.append(f"| {r['variant']} | {r['seconds'] and round(r['seconds'], 1)} | {mib(r['qkvo_bytes'])} | "
                 f"{mib(r['peak_extra_bytes'])} | {'-' if mult is None else f'{mult:.2f}'} | "
                 f"{'-' if mult is None else ('meets' if mult <= MILLION_TARGET else 'misses')}"
                 f"{' ' + r['error'] if r.get('error') else ''} |")
    return L + [""]
