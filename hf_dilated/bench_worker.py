"""One benchmark case, run in a fresh process.

`hf_dilated.bench` forks one process per case (`child_main`, from a fork server that has imported
torch and hf_dilated) so that the resident-memory peak of a case is its own, and a case that runs
out of memory or time cannot poison the next. By hand: `python -m hf_dilated.bench_worker SPEC_JSON`
prints the result as one JSON line.

Time: the timed calls run under glibc's default allocator settings, as in any user's process (after
the warm-up, blocks up to 32 MiB are reused from the heap instead of being mapped afresh, and
page-faulted, on every call).
Memory on CPU: one more call per pass, after all the timed calls of the case (the settings below
cannot be undone): glibc is told (mallopt) to hand every block over 64 KiB back to the OS when it
is freed, the retained heap is trimmed, and the resident high-water mark is reset (/proc/self/clear_refs) right before the call, so the
figure is the peak of that call alone beyond a baseline of the inputs. (Measuring memory under
those settings during the timed calls would add a fresh mapping and its page faults to every
allocation, which slows kernels that allocate many temporaries and is no user's setting.) On
CUDA: torch.cuda.max_memory_allocated beyond the allocation at the baseline.

Spec keys: kind ("kernel" or "e2e"), variant / attn_implementation, n, dtype, device, batch, heads,
kv_heads, head_dim, segment_lengths, dilation_rates, block_size, block_pattern, passes
(["forward", "backward"]), warmup, repeats, threads, prewarm (run once on 256 tokens first),
budget_bytes (optional: hard limit on memory beyond the imports, inputs included).
"""
from __future__ import annotations

import gc
import json
import os
import resource
import statistics
import sys
import time
import traceback

import torch

from .bench_count import dense_pair_count, dilated_pair_count, layout_pair_count

DILATED_MODES = ("union", "longnet", "head_groups")
# Every kernel variant the benchmark knows, in report order.
KERNEL_VARIANTS = ("sdpa", "flex", "union", "flex_union", "longnet", "head_groups", "block_sparse", "ring",
                   "dilated_ring", "auto")
FLEX_MASK_LIMIT = 1 << 28
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Unavailable(Exception):
    """A variant that cannot run here (missing module, unsupported pass); the reason is reported."""


# --------------------------------------------------------------------------------------------
# Memory probes
# --------------------------------------------------------------------------------------------

def _status_bytes(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class MemoryProbe:
    """Peak memory beyond a baseline, for the device the case runs on."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.can_reset = False
        self.baseline = 0

    def current(self) -> int:
        if self.cuda:
            return torch.cuda.memory_allocated()
        rss = _status_bytes("VmRSS")
        return rss if rss is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def start(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")  # reset the resident high-water mark (Linux >= 4.0)
                self.can_reset = True
            except OSError:
                self.can_reset = False
        self.baseline = self.current()

    def peak_extra(self) -> int:
        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self.baseline
        hwm = _status_bytes("VmHWM") if self.can_reset else None
        if hwm is None:  # no resettable high-water mark: the process-lifetime peak (an upper bound)
            hwm = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return max(0, hwm - self.baseline)


def _limit_memory(budget_bytes: int | None, device: torch.device) -> None:
    """Make allocations beyond the budget fail (CPU: RLIMIT_DATA over the current data size)."""
    if not budget_bytes:
        return
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, (budget_bytes + torch.cuda.memory_allocated()) / total))
        return
    data = _status_bytes("VmData")
    if data is not None:
        resource.setrlimit(resource.RLIMIT_DATA, (data + budget_bytes, resource.RLIM_INFINITY))


# --------------------------------------------------------------------------------------------
# Kernel variants: each builder takes (spec, q, k, v) and returns
# (fn(q, k, v) -> out, visible pairs over the batch, reason the backward is unsupported or None)
# --------------------------------------------------------------------------------------------

def _build_sdpa(spec, q, k, v):
    def fn(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1]
        )
    return fn, spec["batch"] * dense_pair_count(spec["n"], spec["heads"]), None


def _build_flex(spec, q, k, v):
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError as e:  # pragma: no cover - old torch
        raise Unavailable(f"torch {torch.__version__} has no FlexAttention ({e})")
    n = spec["n"]

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    block_mask = create_block_mask(causal, None, None, n, n, device=q.device)
    compiled = torch.compile(flex_attention)

    def fn(q, k, v):
        return compiled(q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1])

    no_backward = f"FlexAttention has no CPU backward (torch {torch.__version__})" if q.device.type == "cpu" else None
    return fn, spec["batch"] * dense_pair_count(n, spec["heads"]), no_backward


def union_mask_mod(segment_lengths, dilation_rates):
    """FlexAttention mask_mod of SPEC's "union" pattern for one plain document (positions = indices)."""
    def union(b, h, q_idx, kv_idx):
        visible = q_idx < 0  # all False, as a tensor
        for w, r in zip(segment_lengths, dilation_rates):
            o = h % r
            level = ((q_idx // w) == (kv_idx // w)) & ((q_idx % w) % r == o) & ((kv_idx % w) % r == o)
            visible = visible | level
        return visible & (q_idx >= kv_idx)

    return union


def _build_flex_union(spec, q, k, v):
    """The "union" pattern as a FlexAttention mask (what a user would otherwise write), compiled."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError as e:  # pragma: no cover - old torch
        raise Unavailable(f"torch {torch.__version__} has no FlexAttention ({e})")
    n, seg, dil = spec["n"], spec["segment_lengths"], spec["dilation_rates"]
    if spec["heads"] * n * n > FLEX_MASK_LIMIT:
        # create_block_mask evaluates the mask on the whole (heads, N, N) grid; its compiled
        # construction (_compile=True) fails to build for this mask in torch 2.13 on CPU.
        raise Unavailable(f"flex_union stops at heads x N^2 <= 2^28 (create_block_mask materialises the "
                          f"(heads, N, N) mask; N={n} would need {spec['heads'] * n * n / 2**30:.1f} Gi entries)")

    block_mask = create_block_mask(union_mask_mod(seg, dil), None, spec["heads"], n, n, device=q.device)
    compiled = torch.compile(flex_attention)

    def fn(q, k, v):
        return compiled(q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1])

    no_backward = f"FlexAttention has no CPU backward (torch {torch.__version__})" if q.device.type == "cpu" else None
    return fn, spec["batch"] * dilated_pair_count(n, spec["heads"], seg, dil, "union"), no_backward


def _build_dilated(spec, q, k, v):
    from .ops import dilated_attention
    mode, seg, dil = spec["variant"], spec["segment_lengths"], spec["dilation_rates"]

    def fn(q, k, v):
        return dilated_attention(q, k, v, seg, dil, mode=mode)

    return fn, spec["batch"] * dilated_pair_count(spec["n"], spec["heads"], seg, dil, mode), None


def _build_block_sparse(spec, q, k, v):
    try:
        from .ops import block_sparse_attention
    except ImportError as e:
        raise Unavailable(f"hf_dilated.ops.block_sparse_attention is not available ({e})")
    pattern, bs = spec["block_pattern"], spec["block_size"]
    with torch.no_grad():  # the layout of these very inputs (adaptive patterns depend on them)
        _, layout = block_sparse_attention(q, k, v, pattern, block_size=bs, return_layout=True)
    layout_batch, layout_heads = layout.shape[0], layout.shape[1]
    pairs = layout_pair_count(spec["n"], bs, layout) * (spec["heads"] // layout_heads) * (spec["batch"] // layout_batch)

    def fn(q, k, v):
        return block_sparse_attention(q, k, v, pattern, block_size=bs)

    return fn, pairs, None


def _build_ring(spec, q, k, v):
    try:
        from .distributed import ring_attention
    except ImportError as e:
        raise Unavailable(f"hf_dilated.distributed.ring_attention is not available ({e})")

    def fn(q, k, v):
        return ring_attention(q, k, v, group=None)

    return fn, spec["batch"] * dense_pair_count(spec["n"], spec["heads"]), None


def _build_dilated_ring(spec, q, k, v):
    try:
        from .distributed import dilated_ring_attention
    except ImportError as e:
        raise Unavailable(f"hf_dilated.distributed.dilated_ring_attention is not available ({e})")
    seg, dil = spec["segment_lengths"], spec["dilation_rates"]

    def fn(q, k, v):
        return dilated_ring_attention(q, k, v, seg, dil, mode="union", group=None)

    return fn, spec["batch"] * dilated_pair_count(spec["n"], spec["heads"], seg, dil, "union"), None


def _build_auto(spec, q, k, v):
    """create_attention("auto") as DilatedMultiheadAttention uses it by default (its own pattern:
    dense up to the device's dense_max_len, dilated beyond; the run's segment_lengths do not apply)."""
    from .nn import create_attention

    attn = create_attention("auto")
    kind, cfg = attn.choose(spec["n"], q.device)
    if kind == "dense":
        pairs = dense_pair_count(spec["n"], spec["heads"])
    else:
        pairs = dilated_pair_count(spec["n"], spec["heads"], cfg["segment_lengths"], cfg["dilation_rates"], "union")
    return attn, spec["batch"] * pairs, None


BUILDERS = {
    "sdpa": _build_sdpa,
    "flex": _build_flex,
    "union": _build_dilated,
    "flex_union": _build_flex_union,
    "longnet": _build_dilated,
    "head_groups": _build_dilated,
    "block_sparse": _build_block_sparse,
    "ring": _build_ring,
    "dilated_ring": _build_dilated_ring,
    "auto": _build_auto,
}


# --------------------------------------------------------------------------------------------
# Running a case
# --------------------------------------------------------------------------------------------

def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _time_pass(step, device, warmup: int, repeats: int) -> dict:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(max(1, repeats)):
        _sync(device)
        t0 = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return {"times_s": times, "median_s": statistics.median(times)}


def _peak_memory(step, probe: MemoryProbe) -> int:
    """Peak memory of one more call (after _strict_allocator on CPU)."""
    probe.start()
    step()
    return probe.peak_extra()


def _measure_passes(steps: dict, passes: dict, device, probe: MemoryProbe, errors: tuple, own_process: bool) -> None:
    """Memory of every timed pass, measured after *all* timings: the strict allocator settings
    cannot be undone, so no timed call may follow them. They are only set in a process of the
    case's own (`own_process`), never in a caller's (a test calling run_case directly)."""
    note = None
    if device.type == "cpu" and steps and own_process and not _strict_allocator():
        note = "allocator settings unavailable (not glibc): freed heap stays resident, the peak is over-stated"
    for name, step in steps.items():
        try:
            passes[name]["peak_extra_bytes"] = _peak_memory(step, probe)
            if note:
                passes[name]["memory_note"] = note
        except errors as e:
            passes[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
        gc.collect()


def _strict_allocator() -> bool:
    """glibc: map every block over 64 KiB on its own and unmap it when freed, and give the retained
    heap back, so the resident set follows the live allocations (for the memory measurement).
    Returns whether the settings took (False where the C library is not glibc)."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3  # malloc.h
        libc.mallopt(m_mmap_threshold, 64 * 1024)
        libc.mallopt(m_trim_threshold, 128 * 1024)
        gc.collect()
        libc.malloc_trim(0)
        return True
    except (OSError, AttributeError):
        return False


def _prewarm(spec, device, dtype) -> None:
    """Run the variant once on a short input, forward and backward, so that one-time costs (code
    paged in, thread pools) are not counted as the memory of a single measured call."""
    small = dict(spec, n=min(spec["n"], 256))
    q, k, v = (torch.randn(spec["batch"], heads, small["n"], spec["head_dim"], device=device, dtype=dtype,
                           requires_grad=True) for heads in (spec["heads"], spec["kv_heads"], spec["kv_heads"]))
    try:
        fn, _, no_backward = BUILDERS[spec["variant"]](small, q, k, v)
        out = fn(q, k, v)
        if not no_backward:
            out.sum().backward()
    except Unavailable:
        pass
    del q, k, v
    gc.collect()


def run_kernel_case(spec: dict, own_process: bool = False) -> dict:
    device = torch.device(spec["device"])
    dtype = DTYPES[spec["dtype"]]
    result = {"spec": spec, "passes": {}}
    probe = MemoryProbe(device)
    if spec.get("prewarm"):
        _prewarm(spec, device, dtype)
    _limit_memory(spec.get("budget_bytes"), device)  # the budget covers the inputs too
    b, h, hk, n, d = spec["batch"], spec["heads"], spec["kv_heads"], spec["n"], spec["head_dim"]
    gen = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(b, h, n, d, generator=gen, dtype=dtype).to(device)
    k = torch.randn(b, hk, n, d, generator=gen, dtype=dtype).to(device)
    v = torch.randn(b, hk, n, d, generator=gen, dtype=dtype).to(device)
    result["qkvo_bytes"] = 2 * q.nbytes + k.nbytes + v.nbytes
    try:
        fn, pairs, no_backward = BUILDERS[spec["variant"]](spec, q, k, v)
    except Unavailable as e:
        result["unavailable"] = str(e)
        return result
    result["pairs"] = pairs
    steps, errors = {}, (RuntimeError, MemoryError, NotImplementedError)
    for pass_name in spec["passes"]:
        try:
            if pass_name == "forward":
                def step():
                    with torch.no_grad():
                        fn(q, k, v)
            elif pass_name == "backward":
                if no_backward:
                    result["passes"][pass_name] = {"unsupported": no_backward}
                    continue
                leaves = [t.detach().requires_grad_() for t in (q, k, v)]
                grad_out = torch.randn(q.shape, generator=gen, dtype=dtype).to(device)

                def step():
                    out = fn(*leaves)
                    out.backward(grad_out)
                    for t in leaves:
                        t.grad = None
            else:
                raise ValueError(f"unknown pass {pass_name!r}")
            inputs = q.nbytes + k.nbytes + v.nbytes + (grad_out.nbytes if pass_name == "backward" else 0)
            result["passes"][pass_name] = _time_pass(step, device, spec["warmup"], spec["repeats"])
            result["passes"][pass_name]["inputs_bytes"] = inputs
            steps[pass_name] = step
        except errors as e:
            result["passes"][pass_name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
        gc.collect()
    _measure_passes(steps, result["passes"], device, probe, errors, own_process)
    return result


def run_e2e_case(spec: dict, own_process: bool = False) -> dict:
    """Forward + backward of a tiny Llama (random weights) with one attn_implementation."""
    import hf_dilated  # noqa: F401  (registers the attention implementations)
    from transformers import LlamaConfig, LlamaForCausalLM

    device = torch.device(spec["device"])
    dtype = DTYPES[spec["dtype"]]
    result = {"spec": spec, "passes": {}}
    probe = MemoryProbe(device)
    _limit_memory(spec.get("budget_bytes"), device)
    config = LlamaConfig(**spec["model_config"])
    for key, value in (spec.get("config_extra") or {}).items():
        setattr(config, key, value)
    torch.manual_seed(0)
    try:
        model = LlamaForCausalLM._from_config(config, attn_implementation=spec["attn_implementation"],
                                              dtype=dtype).to(device)
    except (ValueError, KeyError, ImportError, RuntimeError) as e:
        result["unavailable"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        return result
    model.train()
    n, b = spec["n"], spec["batch"]
    ids = torch.randint(0, config.vocab_size, (b, n), generator=torch.Generator().manual_seed(0)).to(device)

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        model.zero_grad(set_to_none=True)

    result["params"] = sum(p.numel() for p in model.parameters())
    errors = (RuntimeError, MemoryError, NotImplementedError, ValueError)
    try:
        result["passes"]["backward"] = _time_pass(step, device, spec["warmup"], spec["repeats"])
    except errors as e:
        result["passes"]["backward"] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
        return result
    _measure_passes({"backward": step}, result["passes"], device, probe, errors, own_process)
    return result


def run_block_sparse_comparison(spec: dict) -> dict:
    """hf_dilated.bench_block_sparse (the block-sparse kernel against sdpa and compiled FlexAttention
    with the identical mask), run in this fresh process."""
    from .bench_block_sparse import run_block_sparse_bench

    log = []
    rows = run_block_sparse_bench(n=spec["n"], heads=spec["heads"], head_dim=spec["head_dim"],
                                  block_size=spec["block_size"], global_blocks=spec["global_blocks"],
                                  window=spec["window"], dtype=DTYPES[spec["dtype"]], repeats=spec["repeats"],
                                  flex=True, backward=True, device=spec["device"], log=log.append)
    return {"spec": spec, "rows": rows, "log": log}


def run_case(spec: dict, own_process: bool = False) -> dict:
    """One case. own_process: this process exists for the case alone (child_main, main), so the
    memory measurement may change its allocator settings."""
    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    if spec.get("kind") == "block_sparse_comparison":
        result = run_block_sparse_comparison(spec)
    else:
        run = run_e2e_case if spec.get("kind") == "e2e" else run_kernel_case
        result = run(spec, own_process)
    result["threads"] = torch.get_num_threads()
    return result


def child_main(spec: dict, conn) -> None:
    """Entry point of a forked case process (see hf_dilated.bench.CaseRunner): send the result."""
    try:
        result = run_case(spec, own_process=True)
    except Exception as e:  # report, never hang the parent: it records the failure for this case
        result = {"spec": spec, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2000:]}
    conn.send(result)
    conn.close()
    os._exit(0)  # skip interpreter teardown (compiled kernels, thread pools): the result is out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec = json.loads(argv[0])
    try:
        result = run_case(spec, own_process=True)
    except Exception as e:  # report, never hang the parent: it records the failure for this case
        result = {"spec": spec, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2000:]}
    sys.stdout.write("\n" + json.dumps(result) + "\n")
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown (compiled kernels, thread pools): the result is out


if __name__ == "__main__":
    sys.exit(main())
