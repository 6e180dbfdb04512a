"""The longest sequence each kernel variant runs within a memory budget: doubling from a start
length, then bisection between the last length that fit and the first that did not; every attempt
is a fresh process whose memory is hard-limited to the budget (inputs included)."""
from __future__ import annotations

from .kernels import kernel_spec
from .report import PASS_LABEL, say


def _attempt_ok(r, pass_name, budget_bytes):
    """(fits, why not) for one attempt."""
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
        spec = kernel_spec(s, variant, n, dtype, [pass_name], warmup=0, repeats=1, budget_bytes=budget, prewarm=True)
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


def run_section(s, runner, report) -> list[dict]:
    """Every variant the kernel section could run (all requested ones when it did not run)."""
    unavailable = report.get("kernels", {}).get("unavailable", {})
    out = []
    for variant in [v for v in s["variants"] if v not in unavailable]:
        for pass_name in ("forward", "backward"):
            r = search_longest(s, runner, variant, s["dtypes"][0], pass_name)
            say(f"  {variant:>12} {PASS_LABEL[pass_name]:>7}: longest {r['longest']} "
                f"(first failure {r['first_failure']}: {r['limited_by']})")
            out.append(r)
    return out


def markdown_section(rows, s) -> list[str]:
    L = ["## Longest sequence within the memory budget\n",
         f"Budget {s['budget_gib']:g} GiB for inputs plus peak extra memory, {s['search_timeout']:g} s per "
         f"attempt, dtype {s['dtypes'][0]}; doubling from {s['search_start']} up to {s['search_max']}, then "
         f"{s['bisect_steps']} bisection steps (multiples of 256); each attempt is a fresh process "
         "with its memory hard-limited to the budget.\n",
         "| variant | pass | longest N that fits | first N that did not | limited by |",
         "|---|---|---:|---:|---|"]
    for r in rows:
        L.append(f"| {r['variant']} | {PASS_LABEL[r['pass']]} | {r['longest'] or '-'} | "
                 f"{r['first_failure'] or '-'} | {r['limited_by']} |")
    return L + [""]
