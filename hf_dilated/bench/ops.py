"""Operations per call: how many aten operations a kernel's forward, backward and decode step
dispatch, counted on whatever device runs (a TorchDispatchMode sees every op before its kernel).
On a GPU each non-view op is a kernel launch and a slice of host time, so this count is the host's
bill of a call, comparable across machines (issue 34: union at 32K dispatched 187 ops in a forward
and 437 in a backward). Counted after a first call, so plans are cached as in a steady state.
"""
from __future__ import annotations

import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class OpCounter(TorchDispatchMode):
    """Counts dispatched aten ops: `ops` all of them, `launches` those that are not views or
    metadata-only (what runs a kernel on a GPU), `by_name` per op."""

    def __init__(self):
        super().__init__()
        self.ops = self.launches = 0
        self.by_name = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        self.by_name[str(func)] += 1
        if not func.is_view and func not in _METADATA:
            self.launches += 1
        return func(*args, **(kwargs or {}))


_aten = torch.ops.aten
_METADATA = {_aten.detach.default, _aten.lift_fresh.default, _aten.empty.memory_format, _aten.empty_strided.default,
             _aten.empty_like.default, _aten.new_empty.default, _aten.new_empty_strided.default}


def count_ops(fn) -> OpCounter:
    counter = OpCounter()
    with counter:
        fn()
    return counter


def kernel_op_counts(fn, q, k, v, backward: bool = True) -> dict:
    """{"forward", "backward", "decode"} -> {"ops", "launches"} for fn(q, k, v) (prefill, as in
    training: inputs that require grad), its backward, and a decode step (the last query against
    every key, no grad). Each is counted on a second call, after one that plans."""
    leaves = [t.detach().requires_grad_(backward) for t in (q, k, v)]
    grad = torch.ones_like(leaves[0])
    out = fn(*leaves)
    if backward:
        out.backward(grad)
    result = {}
    holder = {}

    def forward():
        holder["out"] = fn(*leaves)

    c = count_ops(forward)
    result["forward"] = {"ops": c.ops, "launches": c.launches}
    if backward:
        c = count_ops(lambda: holder["out"].backward(grad))
        result["backward"] = {"ops": c.ops, "launches": c.launches}
    del holder["out"]
    with torch.no_grad():
        step_q = q[:, :, -1:].detach()

        def step():
            fn(step_q, k.detach(), v.detach())

        step()
        c = count_ops(step)
    result["decode"] = {"ops": c.ops, "launches": c.launches}
    return result


def markdown_ops(rows) -> list[str]:
    """A table of the op counts of kernel rows: rows carry variant, n, dtype and "ops" (as
    kernel_op_counts returns, or an "error")."""
    rows = [r for r in rows if r.get("ops")]
    if not rows:
        return []
    L = ["## Operations per call\n",
         "aten operations dispatched by one call after a planning call (plans cached), counted with a "
         "TorchDispatchMode: all / launches (not views or metadata; on a GPU each is a kernel launch). "
         "Decode: the last query against every key, no grad.\n",
         "| dtype | N | variant | forward | backward | decode step |", "|---|---:|---|---:|---:|---:|"]
    for r in rows:
        ops = r["ops"]
        if "error" in ops:
            L.append(f"| {r['dtype']} | {r['n']} | {r['variant']} | {ops['error']} | - | - |")
            continue
        cells = [f"{ops[p]['ops']} / {ops[p]['launches']}" if p in ops else "-" for p in ("forward", "backward", "decode")]
        L.append(f"| {r['dtype']} | {r['n']} | {r['variant']} | " + " | ".join(cells) + " |")
    return L + [""]
