"""Block-sparse benchmark: useful-pair throughput of the block-sparse kernel against dense causal
sdpa and compiled FlexAttention with the same token mask, forward and forward+backward, in one
process at one length (the longest of --lengths).

"Useful pairs" are the visible (query, key) pairs, counted exactly (counts.py): a sparse kernel
that computes 7% of the causal pairs in 10% of sdpa's time has 0.7x sdpa's useful-pair throughput.
FlexAttention has no CPU backward in torch 2.13, so on CPU it only appears in forward rows.

The variants are timed in interleaved rounds (each once per round, measure.time_interleaved), so a
slow spell of a shared machine falls on all of them; ratios are given from the median runs and
from each variant's fastest run. Memory: one more call per variant after all rounds (measure.py).
"""
from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F

from .. import measure
from .counts import dense_pair_count, layout_pair_count
from .kernels import DTYPES
from .report import mib, say

SDPA = "sdpa (dense causal)"


def kept_block_fraction(layout, num_blocks: int) -> float:
    """Allowed causal (query block, key block) pairs over all causal block pairs."""
    lay = layout[..., :num_blocks, :num_blocks].reshape(-1, num_blocks, num_blocks)[0]
    return float(lay.tril().sum()) / (num_blocks * (num_blocks + 1) / 2)


def _flex_forward(q, k, v, pattern, block_size: int):
    """Compiled FlexAttention with the token-level mask of a causal global_local pattern."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    g, w = pattern.global_blocks, pattern.window

    def mask_mod(b, h, q_idx, kv_idx):
        qb, kb = q_idx // block_size, kv_idx // block_size
        return (kv_idx <= q_idx) & ((kb < g) | (qb - kb < w))

    n = q.shape[2]
    block_mask = create_block_mask(mask_mod, None, None, n, n, device=q.device.type, BLOCK_SIZE=block_size)
    compiled = torch.compile(flex_attention, dynamic=False)
    return lambda: compiled(q, k, v, block_mask=block_mask)


def _cases(q, k, v, pattern, block_size, dense_pairs, sparse_pairs, flex, log):
    """(variant, mode, useful pairs, step) for every variant and pass."""
    from ..ops import block_sparse_attention

    cases = [
        (SDPA, "forward", dense_pairs, lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
        ("block_sparse", "forward", sparse_pairs,
         lambda: block_sparse_attention(q, k, v, pattern, block_size=block_size)),
    ]
    if flex:
        try:
            cases.append(("flex_attention (compiled)", "forward", sparse_pairs,
                          _flex_forward(q, k, v, pattern, block_size)))
        except Exception as exc:  # noqa: BLE001 - reported: FlexAttention support varies by build
            log(f"flex_attention unavailable: {type(exc).__name__}: {exc}")
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))

    def fwd_bwd(fn):
        def step():
            fn(qg, kg, vg).sum().backward()
            qg.grad = kg.grad = vg.grad = None
        return step

    return cases + [
        (SDPA, "forward+backward", dense_pairs,
         fwd_bwd(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True))),
        ("block_sparse", "forward+backward", sparse_pairs,
         fwd_bwd(lambda a, b, c: block_sparse_attention(a, b, c, pattern, block_size=block_size))),
    ]


def _add_ratios(rows) -> None:
    for row in rows:
        base = next((r for r in rows if r["variant"] == SDPA and r["mode"] == row["mode"]), None)
        flex_row = next((r for r in rows if r["variant"].startswith("flex") and r["mode"] == row["mode"]), None)
        row["vs_sdpa"] = row["pairs_per_s"] / base["pairs_per_s"] if base else None
        row["vs_flex"] = row["pairs_per_s"] / flex_row["pairs_per_s"] if flex_row else None
        # The same ratio from each variant's fastest run: interference from other processes only
        # ever slows a run down, so the best runs are the least disturbed comparison.
        best = lambda r: r["useful_pairs"] / r["min"]  # noqa: E731
        row["vs_sdpa_best"] = best(row) / best(base) if base else None


def compare_block_sparse(n=32768, heads=8, head_dim=64, block_size=256, global_blocks=1, window=5,
                         dtype=torch.float32, repeats=3, flex=True, device="cpu", log=print,
                         own_process=False) -> list[dict]:
    """Result rows: variant, mode, seconds (median), spread, useful pairs, pairs/s, ratios, memory."""
    from ..ops.block_patterns import GlobalLocalPattern

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, heads, n, head_dim, dtype=dtype, device=device) for _ in range(3))
    pattern = GlobalLocalPattern(global_blocks, window)
    num_blocks = -(-n // block_size)
    layout = pattern.block_layout(torch.arange(num_blocks), num_blocks)
    sparse_pairs = layout_pair_count(n, block_size, layout[0]) * heads
    label = (f"global_local(g={global_blocks}, w={window}), block {block_size}, "
             f"{kept_block_fraction(layout, num_blocks):.1%} of causal blocks kept")
    cases = _cases(q, k, v, pattern, block_size, dense_pair_count(n, heads), sparse_pairs, flex, log)
    dev = torch.device(device)
    all_times = measure.time_interleaved([(f"{c[0]} {c[1]}", c[3]) for c in cases], repeats, log=log, device=dev)
    rows, steps = [], {}
    for (variant, mode, pairs, step), times in zip(cases, all_times):
        if times is None:
            continue
        median = statistics.median(times)
        rows.append({
            "variant": variant, "mode": mode, "n": n, "heads": heads, "head_dim": head_dim,
            "dtype": str(dtype).replace("torch.", ""), "pattern": "causal" if variant == SDPA else label,
            "seconds": median, "min": min(times), "max": max(times), "runs": len(times),
            "useful_pairs": pairs, "pairs_per_s": pairs / median,
        })
        steps[len(rows) - 1] = step
        log(f"{variant:28s} {mode:17s} {median:9.3f} s  {pairs / median / 1e6:10.1f} Mpairs/s")
    memory = {i: {} for i in steps}
    measure.measure_memory(steps, memory, dev, own_process)
    for i, m in memory.items():
        rows[i]["peak_extra_bytes"] = m.get("peak_extra_bytes")
        rows[i]["memory_note"] = m.get("error") or m.get("memory_note")
    _add_ratios(rows)
    return rows


def run_block_sparse_case(spec: dict, own_process: bool = False) -> dict:
    log = []
    rows = compare_block_sparse(n=spec["n"], heads=spec["heads"], head_dim=spec["head_dim"],
                                block_size=spec["block_size"], global_blocks=spec["global_blocks"],
                                window=spec["window"], dtype=DTYPES[spec["dtype"]], repeats=spec["repeats"],
                                flex=spec["flex"], device=spec["device"], log=log.append, own_process=own_process)
    return {"spec": spec, "rows": rows, "log": log}


def run_section(s, runner, report) -> dict:
    pattern = s["block_pattern"]
    if pattern.get("type") != "global_local":
        return {"note": "Not run: the comparison takes a global_local pattern (see --block-pattern).", "rows": []}
    flex = s["flex"]
    spec = dict(kind="block_sparse", n=max(s["lengths"]), heads=s["heads"], head_dim=s["head_dim"],
                block_size=s["block_size"], global_blocks=pattern["global_blocks"], window=pattern["window"],
                dtype=s["dtypes"][0], repeats=max(1, s["repeats"]), flex=flex, device=s["device"],
                threads=s["threads"])
    r = runner.run(spec, s["case_timeout"])
    for line in r.get("log", []):
        say("  " + line)
    note = r.get("error") or ("" if flex else f"FlexAttention left out: {s['skip_reason']}.")
    return {"note": note, "rows": r.get("rows", []), "log": r.get("log", []), "spec": spec}


def markdown_table(rows) -> list[str]:
    L = ["| variant | mode | pattern | time (s, median [min-max], runs) | useful pairs | Mpairs/s | vs sdpa "
         "| vs sdpa, best runs | vs flex | peak MiB |",
         "|---|---|---|---|---|---|---|---|---|---|"]
    ratio = lambda x: "-" if x is None else f"{x:.2f}x"  # noqa: E731
    for r in rows:
        L.append(f"| {r['variant']} | {r['mode']} | {r['pattern']} | {r['seconds']:.3f} [{r['min']:.3f}-{r['max']:.3f}]"
                 f", {r['runs']} | {r['useful_pairs']:.3e} | {r['pairs_per_s'] / 1e6:.1f} | {ratio(r['vs_sdpa'])} | "
                 f"{ratio(r['vs_sdpa_best'])} | {ratio(r['vs_flex'])} | {mib(r.get('peak_extra_bytes'))} |")
    return L


def markdown_section(section, s) -> list[str]:
    L = ["## Block-sparse against sdpa and FlexAttention with the same mask\n"]
    if section["rows"]:
        spec = section["spec"]
        L.append(f"N = {spec['n']}, {spec['heads']} heads, head_dim {spec['head_dim']}, dtype {spec['dtype']}; "
                 f"{spec['repeats']} interleaved rounds after 1 warm-up; FlexAttention gets the identical token "
                 "mask. Peak memory beyond the inputs in one more call per variant after the rounds.\n")
        L += markdown_table(section["rows"])
        L += [f"- {line}" for line in section.get("log", []) if "unavailable" in line or "failed" in line]
        for row in section["rows"]:
            if row.get("memory_note"):
                L.append(f"- {row['variant']} {row['mode']} memory: {row['memory_note']}")
    if section["note"]:
        L.append(("\n" if section["rows"] else "") + section["note"])
    return L + [""]
