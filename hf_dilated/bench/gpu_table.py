"""The GPU check's one table (issue 34 item 4): every measure beside `sdpa`'s best kernel measured in
the same run, as ratios. scripts/gpu_check.sh runs each part as a step of its own, under a time
limit, then renders the table:

    python -m hf_dilated.bench.gpu_table run PART --out DIR --budget SECONDS [--smoke]
    python -m hf_dilated.bench.gpu_table table --out DIR [--smoke] [--tests-xml F] [--tests-log F]

PART is one of PARTS. Every case runs in a fresh process (worker.CaseRunner) under a time limit cut
from the part's budget; a case that no longer fits is skipped and says so, and DIR/PART.json is
rewritten after every case, so a part stopped by its step's limit keeps what it measured. The table
lists every row the settings define whether or not it was measured: a missing one says why.

"sdpa best" is the faster of sdpa's flash and cuDNN backends (torch.nn.attention.sdpa_kernel), each
timed in the same process as the other; where neither runs (a mask), sdpa's own choice; on the CPU
(--smoke) sdpa's default. Our kernels and models run with no backend restriction.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import re
import sys
import time
from pathlib import Path

# Timed calls of one measurement stop after this many seconds (at least 3 calls): the check's 470 s
# hold every row only if the long contexts do not repeat 10 calls of a second each.
MEASURE_SECONDS = 2.0
PARTS = ("kernels", "model", "train", "block-sparse", "million", "static")
ROOM = 64  # decode positions beyond the prefill: the model's levels cover N + ROOM
PASSES = {"forward": "fwd", "backward": "fwd+bwd"}


def settings(smoke: bool = False) -> dict:
    """Sizes of every part. GPU: bfloat16, the issue's shapes. --smoke: tiny, float32, on the CPU
    (or whatever device there is), the same rows."""
    if smoke:
        return dict(
            smoke=True, dtype="float32", original=64, warmup=0, repeats=2, decode_warmup=1, decode_repeats=3,
            kernel_shapes=[(2, 2, 16), (4, 2, 32)], kernel_lengths=[128, 256, 512], kernel_modes=["union", "longnet"],
            model=dict(heads=4, kv_heads=2, head_dim=16, layers=2, intermediate=64, vocab=128),
            prefill_lengths=[128, 256, 512], train_lengths=[64, 128, 256, 512],
            block_sparse=dict(n=512, heads=2, kv_heads=2, head_dim=16, block_size=64,
                              pattern={"type": "global_local", "global_blocks": 1, "window": 2}),
            million=dict(n=4096, heads=2, head_dim=16), static_length=256, case_cap=120.0,
        )
    return dict(
        smoke=False, dtype="bfloat16", original=4096, warmup=1, repeats=3, decode_warmup=2, decode_repeats=5,
        kernel_shapes=[(8, 8, 64), (32, 8, 128)], kernel_lengths=[8192, 32768, 131072],
        kernel_modes=["union", "longnet"],
        model=dict(heads=32, kv_heads=8, head_dim=128, layers=2, intermediate=1024, vocab=1024),
        prefill_lengths=[16384, 65536, 131072], train_lengths=[4096, 16384, 65536, 131072],
        block_sparse=dict(n=32768, heads=8, kv_heads=8, head_dim=64, block_size=256,
                          pattern={"type": "global_local", "global_blocks": 1, "window": 5}),
        million=dict(n=1 << 20, heads=8, head_dim=64), static_length=131072, case_cap=90.0,
    )


def _device(s) -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def sdpa_backends(device: str, s: dict) -> list[str]:
    """flash and cuDNN on CUDA in half precision; sdpa's default elsewhere (neither takes float32)."""
    return ["flash", "cudnn"] if device == "cuda" and s["dtype"] != "float32" else ["default"]


def static_sdpa_backends(backends: list[str]) -> list[str]:
    """The sdpa kernels a StaticCache step is timed on: sdpa's own choice, and cuDNN where `backends`
    (sdpa_backends') hold it; never flash, which takes no mask (plan's static part)."""
    return ["default"] + [b for b in backends if b == "cudnn"]


def _shape(shape) -> str:
    hq, hkv, d = shape
    return f"{hq}/{hkv}x{d}"


def _levels(original: int, n: int) -> tuple[list[int], list[int]]:
    from ..config import default_schedule

    return default_schedule(original, n)


def _model_entry(conversion: str, original: int, target: int) -> dict:
    """The model's hf_dilated entry: "default" = hf_dilated.config.default_conversion for `dilated`
    (band L, L / 2 past L; sparse far keys at grouped positions); "every_far" = the same band L
    with every far key read (its far_* fields of 4.2 left out: what the default was before sparse far
    keys, the issue's "reads every key"); "union" = levels doubling from L (DilatedConfig.default)."""
    from ..config import DilatedConfig, default_band

    if conversion in ("default", "every_far"):
        band = default_band(original, target)
        if conversion == "every_far":
            band = {k: v for k, v in band.items() if k not in ("far_band", "far_top_k", "far_block_size", "far_sinks")}
        return DilatedConfig.default(original, target, **band).to_dict()
    return DilatedConfig.default(original, target).to_dict()


# --------------------------------------------------------------------------------------------
# The cases (each runs in a process of its own: worker.run_case with kind "<this module>:<name>")
# --------------------------------------------------------------------------------------------

def _sdpa_context(backend: str):
    if backend == "default":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([{"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]])


def _time(step, device, warmup, repeats) -> dict:
    from .. import measure

    try:
        return measure.time_calls(step, device, warmup, repeats, budget_s=MEASURE_SECONDS)
    except measure.CALL_ERRORS + (ValueError,) as e:
        return {"error": measure.error_text(e)}


def sdpa_kernel_case(spec: dict, own_process: bool = False) -> dict:
    """Dense causal sdpa under each backend of spec["backends"], forward and forward+backward. With
    fewer kv heads: enable_gqa, or (where the backend refuses it) K/V expanded beforehand, untimed."""
    import torch
    import torch.nn.functional as F

    from .kernels import DTYPES, _backward_step, _random_qkv

    device, dtype = torch.device(spec["device"]), DTYPES[spec["dtype"]]
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = _random_qkv(spec, device, dtype, gen)
    group = spec["heads"] // spec["kv_heads"]
    forms = [("gqa", k, v)] if group == 1 else [
        ("gqa", k, v), ("K/V expanded", k.repeat_interleave(group, 1), v.repeat_interleave(group, 1))]
    result = {"spec": spec, "backends": {}}
    for backend in spec["backends"]:
        res = result["backends"][backend] = {}
        for pass_name in ("forward", "backward"):
            for form, kk, vv in forms:
                gqa = form == "gqa" and group > 1

                def fn(a, b, c, gqa=gqa):
                    return F.scaled_dot_product_attention(a, b, c, is_causal=True, enable_gqa=gqa)

                if pass_name == "forward":
                    def step(kk=kk, vv=vv, fn=fn):
                        with torch.no_grad():
                            fn(q, kk, vv)
                else:
                    step, _ = _backward_step(fn, q, kk, vv, gen)
                with _sdpa_context(backend):
                    timed = _time(step, device, spec["warmup"], spec["repeats"])
                res[pass_name] = dict(timed, form=form)
                gc.collect()
                if "median_s" in timed:
                    break
    return result


def _build_model(spec):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from ..config import CONFIG_KEY
    from .kernels import DTYPES

    mc = spec["model"]
    config = LlamaConfig(hidden_size=mc["heads"] * mc["head_dim"], num_attention_heads=mc["heads"],
                         num_key_value_heads=mc["kv_heads"], head_dim=mc["head_dim"],
                         num_hidden_layers=mc["layers"], intermediate_size=mc["intermediate"],
                         vocab_size=mc["vocab"], max_position_embeddings=spec["n"] + ROOM)
    impl = "sdpa"
    if spec["conversion"] != "sdpa":
        impl = "dilated"
        setattr(config, CONFIG_KEY, _model_entry(spec["conversion"], spec["original"], spec["n"] + ROOM))
    torch.manual_seed(0)
    with torch.device(spec["device"]):
        model = LlamaForCausalLM._from_config(config, attn_implementation=impl, dtype=DTYPES[spec["dtype"]])
    ids = torch.randint(0, config.vocab_size, (1, spec["n"]), generator=torch.Generator().manual_seed(0))
    return model, config, ids.to(spec["device"])


def _cache_arg(model) -> str:
    """The forward's name of the cache argument: `cache` (transformers >= 5.24), else `past_key_values`."""
    import inspect

    return "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"


def _prefill(model, ids, cache):
    """The table's prefill: N tokens into `cache`, the last token's logits only (model_case times it;
    warm_case makes its first call, so both compile the same graphs)."""
    return model(input_ids=ids, **{_cache_arg(model): cache}, use_cache=True, logits_to_keep=1)


def _backends_of(spec) -> list[str]:
    return spec["backends"] if spec["conversion"] == "sdpa" else ["ours"]


# Where a path gives up its fast form for the rest of the process (module, global): a table row is
# then the slower form's time, and says why.
FALLBACKS = (("sparse_far_flex", "_FAILED"), ("sparse_far_flex", "_FUSED_FAILED"),
             ("sparse_far_flex", "_BLOCK_TILES_FAILED"), ("sparse_far_concatenated", "_COMPILE_FAILED"),
             ("sparse_far_reserved", "_GRAPH_FAILED"), ("block_sparse_flex", "_FAILED"))


def fallbacks() -> dict:
    """{"module.global": why} of the FALLBACKS this process has taken so far."""
    import importlib

    found = {}
    for module, name in FALLBACKS:
        why = getattr(importlib.import_module(f"hf_dilated.ops.{module}"), name, None)
        if why is not None:
            found[f"{module}.{name}"] = str(why)[:300]
    return found


@contextlib.contextmanager
def step_paths(counts: dict):
    """Counts into `counts` how the layers' sparse-far decode steps ran, in kinds.py's order of
    tries: "graphed" (sparse_far_reserved's CUDA graph), "compiled" (sparse_far_concatenated's
    compiled call), "eager" (sparse_far_decode, the rest). A row that is slow says which it was."""
    from ..ops import sparse_far_concatenated, sparse_far_decode, sparse_far_reserved

    def counted(module, name, key):
        real = getattr(module, name)

        def call(*args, **kwargs):
            out = real(*args, **kwargs)
            if out is not None:  # served (None: the step is left to the next form)
                counts[key] = counts.get(key, 0) + 1
            return out
        return real, call

    patched = [(m, name, *counted(m, name, key)) for m, name, key in (
        (sparse_far_reserved, "reserved_step", "graphed"), (sparse_far_concatenated, "concatenated_step", "compiled"),
        (sparse_far_decode, "sparse_far_decode", "eager"))]
    for module, name, _, call in patched:
        setattr(module, name, call)
    try:
        yield counts
    finally:
        for module, name, real, _ in patched:
            setattr(module, name, real)


def model_case(spec: dict, own_process: bool = False) -> dict:
    """Prefill of N tokens (DynamicCache, logits of the last token only), then one decode step with
    DynamicCache and with hf_dilated.ReservedCache, each filled by a prefill of its own; on CUDA each
    step's host and GPU time apart too (measure.host_and_device: which of them bounds the step, and
    whether it waits for the GPU) and its synchronizing calls. Ours' steps again in turn with sdpa's
    (_decode_in_turn), whose ratio the table's decode rows give."""
    import torch
    from transformers import DynamicCache

    from .. import measure
    from ..integrations.cache import ReservedCache

    device = torch.device(spec["device"])
    model, config, ids = _build_model(spec)
    model.eval()
    arg = _cache_arg(model)
    caches = {"dynamic": lambda: DynamicCache(config=config), "reserved": lambda: ReservedCache(config=config)}
    # Ours' decode steps are timed once more in turn with sdpa's (its first kernel, flash on a GPU) in
    # this process: in processes of their own sdpa's step took 2.3 ms in one and 3.6 in the next (an
    # H200, 2026-11-27), a spread that no ratio of two processes can carry.
    base = None
    if spec["conversion"] != "sdpa":
        base, _, _ = _build_model(dict(spec, conversion="sdpa"))
        base.eval()
        base_backend = sdpa_backends(spec["device"], spec)[0]
    result = {"spec": spec, "backends": {}}
    for backend in _backends_of(spec):
        res = result["backends"][backend] = {}
        with torch.no_grad(), (_sdpa_context(backend) if backend != "ours" else contextlib.nullcontext()):
            def prefill(make=caches["dynamic"]):
                cache = make()
                _prefill(model, ids, cache)
                return cache

            res["prefill"] = _time(prefill, device, spec["warmup"], spec["repeats"])
            for name, make in caches.items():
                if "error" in res["prefill"]:
                    res[name] = {"error": "prefill failed"}
                    continue
                cache = prefill(make)
                token = ids[:, -1:]

                def step(cache=cache):
                    model(input_ids=token, **{arg: cache}, use_cache=True)

                paths = {}
                with step_paths(paths) if backend == "ours" else contextlib.nullcontext():
                    res[name] = _time(step, device, spec["decode_warmup"], spec["decode_repeats"])
                if paths:
                    res[name]["paths"] = paths
                # its host's and its GPU's time apart (on CUDA), for ours and the kernel sdpa's decode
                # steps are fastest on (cuDNN's took 45-65 ms at 16K on an H200, 2026-11-27: no split)
                if "median_s" in res[name] and backend != "cudnn":
                    split = measure.host_and_device(step, device, busy_s=max(0.05, 4 * res[name]["median_s"]),
                                                    repeats=2)
                    if split:
                        res[name]["split"] = split
                    try:  # (diagnostics: a failure is reported, never the case's figures lost)
                        waits = measure.synchronizing_calls(step, device)  # where it waits, if it does
                    except Exception as e:  # noqa: BLE001
                        waits, res[name]["waits_error"] = None, measure.error_text(e)
                    if waits is not None:
                        res[name]["waits"] = waits
                if base is not None and "median_s" in res[name]:
                    try:
                        res[name]["in_turn"] = _decode_in_turn(step, base, cache, make, ids, arg, base_backend,
                                                               device, spec["decode_repeats"])
                    except Exception as e:  # noqa: BLE001
                        res[name]["in_turn"] = {"error": measure.error_text(e)}
                del cache
                gc.collect()
    result["fallbacks"] = fallbacks()
    return result


def _decode_in_turn(step, base, ours_cache, make, ids, arg, backend: str, device, repeats: int) -> dict:
    """Ours' decode `step` and sdpa's (the model `base` under its kernel `backend`, on a cache of its
    own made by `make`, holding copies of ours_cache's keys and values: a step's time does not
    depend on their values, and a prefill of sdpa's own took most of a second at 128K), timed in
    turn, one call each a round after one to warm up: {"backend", "ours_s", "sdpa_s"} (medians), or
    {"error"}."""
    import statistics

    import torch

    from .. import measure

    cache = make()
    with torch.no_grad():
        for i, layer in enumerate(ours_cache.layers):
            cache.update(layer.keys.clone(), layer.values.clone(), i)

    def sdpa_step():
        with torch.no_grad(), _sdpa_context(backend):
            base(input_ids=ids[:, -1:], **{arg: cache}, use_cache=True)

    errors = []  # (time_interleaved logs a call that raises, and leaves its side out)
    ours, sdpa = measure.time_interleaved([("ours", step), ("sdpa", sdpa_step)], repeats=max(3, repeats),
                                          warmup=1, log=errors.append, device=device)
    if not ours or not sdpa:
        return {"error": "; ".join(errors)[:300] or "no call timed"}
    return {"backend": backend, "ours_s": statistics.median(ours), "sdpa_s": statistics.median(sdpa)}


def train_case(spec: dict, own_process: bool = False) -> dict:
    """One training step: loss over N tokens, backward."""
    import torch

    device = torch.device(spec["device"])
    model, config, ids = _build_model(spec)
    model.train()

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)

    result = {"spec": spec, "backends": {}}
    for backend in _backends_of(spec):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        with _sdpa_context(backend) if backend != "ours" else contextlib.nullcontext():
            timed = _time(step, device, spec["warmup"], spec["repeats"])
        if device.type == "cuda" and "median_s" in timed:
            timed["peak_bytes"] = torch.cuda.max_memory_allocated()
        result["backends"][backend] = {"train": timed}
        gc.collect()
    result["fallbacks"] = fallbacks()
    return result


def static_case(spec: dict, own_process: bool = False) -> dict:
    """A decode step with transformers' StaticCache and the model under torch.compile (fullgraph;
    mode "reduce-overhead", CUDA graphs, on CUDA), after an eager prefill of N tokens."""
    import torch
    from transformers import StaticCache

    device = torch.device(spec["device"])
    model, config, ids = _build_model(spec)
    model.eval()
    arg = _cache_arg(model)
    backend = spec["backends"][0] if spec["conversion"] == "sdpa" else "ours"
    result = {"spec": spec, "backends": {}}
    with torch.no_grad(), (_sdpa_context(backend) if backend != "ours" else contextlib.nullcontext()):
        cache = StaticCache(config=config, max_cache_len=spec["n"] + ROOM)
        try:
            model(input_ids=ids, **{arg: cache}, use_cache=True, logits_to_keep=1,
                  cache_position=torch.arange(spec["n"], device=device))
        except Exception as e:  # noqa: BLE001 - reported as this case's outcome
            result["backends"][backend] = {"static": {"error": f"prefill: {type(e).__name__}: {str(e)[:200]}"}}
            return result
        # CUDA: inductor with CUDA graphs, as transformers' generate() compiles; elsewhere (--smoke) dynamo's
        # fullgraph capture alone (backend "eager"): inductor's C++ build takes a minute per model on a CPU.
        compiled = (torch.compile(model, fullgraph=True, mode="reduce-overhead") if device.type == "cuda"
                    else torch.compile(model, fullgraph=True, backend="eager"))
        token, position = ids[:, -1:], [spec["n"]]

        def step():
            p = position[0]
            position[0] += 1
            compiled(input_ids=token, **{arg: cache}, use_cache=True,
                     cache_position=torch.tensor([p], device=device))

        start = time.perf_counter()
        try:
            step()  # compiles
            timed = _time(step, device, max(1, spec["decode_warmup"]), spec["decode_repeats"])
        except Exception as e:  # noqa: BLE001 - compile errors come in many types; reported
            timed = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
        timed["compile_and_run_s"] = time.perf_counter() - start
    result["backends"][backend] = {"static": timed}
    return result


def flex_block_mask(layout, n: int, block_size: int, device):
    """FlexAttention's BlockMask of a causal block layout, built from the blocks themselves
    (BlockMask.from_kv_blocks, never an N x N mask): the allowed blocks below the diagonal are full,
    the diagonal ones partial under a causal mask_mod."""
    import torch
    from torch.nn.attention.flex_attention import BlockMask

    lay = layout.to(torch.bool).tril()
    diag = torch.eye(lay.shape[-1], dtype=torch.bool)
    partial, full = lay & diag, lay & ~diag

    def blocks(m):
        count = m.sum(-1).to(torch.int32)[None, None].to(device)
        index = torch.argsort(m.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
        return count, index[None, None].contiguous().to(device)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    kv_num, kv_idx = blocks(partial)
    full_num, full_idx = blocks(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block_size, mask_mod=causal,
                                    seq_lengths=(n, n))


class _NotHere(Exception):
    pass


def block_sparse_case(spec: dict, own_process: bool = False) -> dict:
    """block_sparse with sdpa's backends (dense causal; spec["flex"] False), or with compiled
    FlexAttention under the BlockMask of the same block layout (True: a process of its own, so that a
    slow compile cannot cost the sdpa rows), forward and forward+backward, in interleaved rounds."""
    import statistics

    import torch
    import torch.nn.functional as F

    from .. import measure
    from ..ops import block_sparse_attention
    from ..ops.block_patterns import make_pattern
    from .counts import layout_pair_count
    from .kernels import DTYPES

    device, dtype = torch.device(spec["device"]), DTYPES[spec["dtype"]]
    n, bs, h, d = spec["n"], spec["block_size"], spec["heads"], spec["head_dim"]
    gen = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(1, h, n, d, generator=gen, dtype=dtype).to(device) for _ in range(3))
    pattern = make_pattern(spec["pattern"])
    nb = -(-n // bs)
    layout = pattern.block_layout(torch.arange(nb), nb)[0, 0]
    result = {"spec": spec, "pairs": layout_pair_count(n, bs, layout) * h,
              "kept_blocks": float(layout.tril().sum()) / (nb * (nb + 1) / 2), "passes": {}}
    fns = {"block_sparse": lambda a, b, c: block_sparse_attention(a, b, c, spec["pattern"], block_size=bs)}
    for backend in spec["backends"] if spec["flex"] is False else []:
        def dense(a, b, c, backend=backend):
            with _sdpa_context(backend):
                return F.scaled_dot_product_attention(a, b, c, is_causal=True)
        fns["sdpa " + backend] = dense
    flex_note = None
    try:
        if not spec["flex"]:
            raise _NotHere
        from torch.nn.attention.flex_attention import flex_attention

        block_mask = flex_block_mask(layout, n, bs, device)
        compiled = torch.compile(flex_attention, dynamic=False)
        fns["flex"] = lambda a, b, c: compiled(a, b, c, block_mask=block_mask)
        with torch.no_grad():  # the same mask: the outputs agree
            result["flex_max_abs_diff"] = float((fns["flex"](q, k, v).float()
                                                 - fns["block_sparse"](q, k, v).float()).abs().max())
    except _NotHere:
        pass
    except Exception as e:  # noqa: BLE001 - reported: FlexAttention support varies by build
        flex_note = f"FlexAttention unavailable: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        fns.pop("flex", None)
    result["flex_note"] = flex_note
    log = []
    forward = [(name, (lambda fn=fn: fn(q, k, v))) for name, fn in fns.items()]
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]

    def fwd_bwd(fn):
        def step():
            fn(*leaves).sum().backward()
            for t in leaves:
                t.grad = None
        return step

    backward = [(name, fwd_bwd(fn)) for name, fn in fns.items()
                if not (name == "flex" and device.type == "cpu")]  # no CPU backward in FlexAttention
    for pass_name, cases in (("forward", forward), ("backward", backward)):
        grad = torch.enable_grad() if pass_name == "backward" else torch.no_grad()
        with grad:
            times = measure.time_interleaved(cases, spec["repeats"], warmup=max(1, spec["warmup"]),
                                             log=log.append, device=device)
        result["passes"][pass_name] = {
            name: ({"median_s": statistics.median(t), "times_s": t} if t else {"error": "failed (see log)"})
            for (name, _), t in zip(cases, times)}
        if pass_name == "backward" and "flex" in fns and device.type == "cpu":
            result["passes"][pass_name]["flex"] = {"error": f"no CPU backward in FlexAttention (torch {torch.__version__})"}
    result["log"] = log
    result["fallbacks"] = fallbacks()
    return result


def default_train_length(s: dict) -> int | None:
    """The training part's length for the default conversion: the shortest beyond the original
    context (within it the default conversion reads as sdpa does), or None where there is none."""
    longer = [n for n in s["train_lengths"] if n > s["original"]]
    return min(longer) if longer else None


# --------------------------------------------------------------------------------------------
# The plan: every case of a part, in the order it runs (sdpa before ours; cheap first, but training)
# --------------------------------------------------------------------------------------------

def _kind(name: str) -> str:
    return f"{__name__.replace('__main__', 'hf_dilated.bench.gpu_table')}:{name}"


def plan(part: str, s: dict, device: str) -> list[tuple[str, dict]]:
    """(key, spec) of every case of `part`."""
    # flash "auto": the FlashAttention installed for the GPU (FA3 on Hopper, else FA4; torch's own FlashAttention-2
    # where none is) runs every flash call of a case, ours and sdpa's alike (ops/backend.activate_flash)
    common = dict(device=device, dtype=s["dtype"], warmup=s["warmup"], repeats=s["repeats"], threads=None,
                  flash="auto")
    backends = sdpa_backends(device, s)
    out = []
    if part == "kernels":
        for n in s["kernel_lengths"]:
            for shape in s["kernel_shapes"]:
                hq, hkv, d = shape
                base = dict(common, n=n, batch=1, heads=hq, kv_heads=hkv, head_dim=d,
                            repeats=min(2, s["repeats"]) if n >= 65536 else s["repeats"])
                out.append((f"sdpa|{_shape(shape)}|{n}", dict(base, kind=_kind("sdpa_kernel_case"), backends=backends)))
                seg, dil = _levels(s["original"], n)
                for mode in s["kernel_modes"]:
                    out.append((f"{mode}|{_shape(shape)}|{n}", dict(
                        base, kind="kernel", variant=mode, segment_lengths=seg, dilation_rates=dil, block_size=256,
                        block_pattern=None, passes=["forward", "backward"], ops=False)))
    elif part in ("model", "train"):
        # Training runs its longest length first: the target row (128K), which the seventh
        # session's run did not reach before the step's time ran out after the shorter ones. The model
        # part runs its shortest, then its longest (union levels' 2.5x target at 128K, and the decode
        # rows' there: the step's time ran out after 16K in the twelfth session's run), then the rest;
        # per length union levels before the default conversion (whose first call compiles).
        if part == "model":
            ordered = sorted(s["prefill_lengths"])
            lengths = ordered[:1] + ordered[1:][-1:] + ordered[1:-1]
        else:
            lengths = sorted(s["train_lengths"], reverse=True)
        conversions = ["sdpa", "union", "default"] if part == "model" else ["sdpa", "union"]
        cases = [(conv, n) for n in lengths for conv in conversions]
        if part == "model":  # last, at the shortest length only: what reading every far key costs
            cases.append(("every_far", min(lengths)))  # beside the sparse default (no compile: seconds)
        elif default_train_length(s) is not None:  # last: the default conversion's fine-tuning past L
            cases.append(("default", default_train_length(s)))
        for conv, n in cases:
            out.append((f"{conv}|{n}", dict(common, kind=_kind(f"{part}_case"), n=n, conversion=conv,
                                            original=s["original"], model=s["model"], backends=backends,
                                            decode_warmup=s["decode_warmup"], decode_repeats=s["decode_repeats"],
                                            warmup=min(1, s["warmup"]) if part == "model" else s["warmup"],
                                            repeats=min(2, s["repeats"]))))
    elif part == "static":
        n = s["static_length"]
        base = dict(common, kind=_kind("static_case"), n=n, original=s["original"], model=s["model"],
                    decode_warmup=s["decode_warmup"], decode_repeats=s["decode_repeats"])
        # sdpa's own choice first (what a user's compiled step runs), then ours, then cuDNN forced (on
        # CUDA, half precision). Not flash: a StaticCache step gives sdpa a mask (the slots not written
        # yet), which flash refuses ("Flash Attention does not support non-null attn_mask": the H200's
        # run of 2026-11-27 spent its step compiling it, then measured nothing).
        static_baselines = static_sdpa_backends(backends)
        out.append((f"sdpa {static_baselines[0]}|{n}", dict(base, conversion="sdpa", backends=static_baselines[:1])))
        out += [(f"{conv}|{n}", dict(base, conversion=conv, backends=[])) for conv in ("union", "default")]
        out += [(f"sdpa {b}|{n}", dict(base, conversion="sdpa", backends=[b])) for b in static_baselines[1:]]
    elif part == "block-sparse":
        # FlexAttention's case first: it times block_sparse in turn with FlexAttention (the 1.0x target
        # row); the other, against sdpa, was the only one reached on 2026-11-27
        for key, flex in (("flex", True), ("block_sparse", False)):
            out.append((key, dict(common, **s["block_sparse"], kind=_kind("block_sparse_case"), flex=flex,
                                  backends=backends, repeats=max(3, s["repeats"] + 2))))
    elif part == "million":
        m = s["million"]
        seg, dil = _levels(s["original"], m["n"])
        out.append(("union", dict(common, kind="kernel", variant="union", n=m["n"], batch=1, heads=m["heads"],
                                  kv_heads=m["heads"], head_dim=m["head_dim"], segment_lengths=seg,
                                  dilation_rates=dil, block_size=256, block_pattern=None, passes=["forward"],
                                  warmup=0, repeats=1, prewarm=True, ops=False)))
    else:
        raise ValueError(f"unknown part {part!r}; one of {', '.join(PARTS)}")
    return out


# --------------------------------------------------------------------------------------------
# Compiling ahead: a first call that compiles takes about a minute on a GPU (the default
# conversion's plan: 64 s at 16K on an H200, 2026-11-27), more than a model step's budget holds.
# scripts/gpu_check.sh warms these cases beside the tests, each in a process of its own; the
# table's processes then find the compiled kernels in inductor's and Triton's caches on disk.
# --------------------------------------------------------------------------------------------

WARM_PARTS = ("block-sparse", "model", "static")
# Cases compiled side by side: on an H200 (2026-11-27) all seven at once, beside 4 test workers,
# finished none in the 110 s (the first, the default conversion's prefill at 16K: the table's first
# call of it took 13.4 s after them); in the plan's order, a few at a time, the first ones finish.
WARM_AT_ONCE = 2


def warm_plan(parts, s: dict, device: str) -> list[tuple[str, dict]]:
    """(part|key, spec) of the cases of `parts` whose first call compiles on a GPU: both block-sparse
    cases (block_sparse's FlexAttention forward and backward, and FlexAttention's own: together
    more than that step's budget on an H200, 2026-11-27), the default conversion's prefill (its
    selection plan and FlexAttention, one graph per length) and its DynamicCache decode step
    (ops/sparse_far_concatenated.concatenated_step), and every StaticCache decode step (the whole
    model under torch.compile)."""
    out = []
    for part in parts:
        if part not in WARM_PARTS:
            raise ValueError(f"part: {part!r} compiles nothing ahead; one of {', '.join(WARM_PARTS)}")
        for key, spec in plan(part, s, device):
            if (part == "block-sparse" or (part == "model" and spec["conversion"] == "default")
                    or part == "static"):
                out.append((f"{part}|{key}", spec))
    return out


def warm_case(spec: dict, report=print) -> None:
    """Reports (`report`, a line each) the seconds of the compiling first call of one case: "first
    call X s" (the prefill; a static or block-sparse case runs whole), then for a model case
    "first step Y s" (a decode step on the prefill's DynamicCache: on a GPU the default conversion's
    compiles its own). Run beside the tests, so its kernels' autotuning choices are not kept (the
    timed case makes its own, on a quiet GPU); what it compiled is."""
    import torch
    from transformers import DynamicCache

    torch._inductor.config.autotune_local_cache = False  # not part of the compiled graphs' cache key

    def timed(fn):
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter() - start

    if spec.get("flash"):
        from ..ops import backend
        backend.activate_flash(spec["flash"])
    if spec["kind"].endswith(":static_case"):
        report(f"first call {timed(lambda: static_case(spec)):.3f} s")
        return
    if spec["kind"].endswith(":block_sparse_case"):  # it runs whole: its compiles are most of it
        report(f"first call {timed(lambda: block_sparse_case(spec)):.3f} s")
        return
    model, config, ids = _build_model(spec)
    model.eval()
    cache = DynamicCache(config=config)
    with torch.no_grad():
        report(f"first call {timed(lambda: _prefill(model, ids, cache)):.3f} s")
        step = lambda: model(input_ids=ids[:, -1:], **{_cache_arg(model): cache}, use_cache=True)  # noqa: E731
        report(f"first step {timed(step):.3f} s")


def warm(parts, s: dict, out: Path, budget_s: float, log=None, at_once: int = WARM_AT_ONCE) -> dict:
    """Runs the warm_plan cases in their order, `at_once` at a time, each in a process (group) of its
    own, for at most `budget_s` seconds: the ones still compiling then are killed with their compile
    workers, and the ones not started say so. Writes out/warm.json: per case its exit status and
    first call (first_s), or why none."""
    import os
    import signal
    import subprocess
    import threading

    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    logs = out / "warm"
    logs.mkdir(parents=True, exist_ok=True)
    # a few compile workers each: the cases compile beside the tests
    env = dict(os.environ, TORCHINDUCTOR_COMPILE_THREADS=os.environ.get("TORCHINDUCTOR_COMPILE_THREADS", "4"))
    start = time.perf_counter()
    left = lambda: budget_s - (time.perf_counter() - start)  # noqa: E731
    cases = list(enumerate(warm_plan(parts, s, _device(s))))
    running, data = {}, {"budget_s": budget_s, "at_once": at_once, "cases": {}}

    def finish(key, i, proc, result):
        text = (logs / f"{i}.log").read_text(errors="replace")
        for name, field in (("call", "first_s"), ("step", "step_s")):  # the prefill's, then a decode step's
            found = re.findall(rf"^first {name} ([0-9.]+) s$", text, re.M)
            if found:
                result[field] = float(found[-1])
        if "first_s" not in result and result["rc"] is not None:
            result["error"] = text.strip().splitlines()[-1][:300] if text.strip() else f"exit {result['rc']}"
        data["cases"][key] = result
        log(f"  warm {key} (ended at {time.perf_counter() - start:.0f} s): {_warmed(result)}")

    def stop(key):  # a case still compiling: killed with its compile workers (its own session)
        i, proc = running[key]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        del running[key]
        return i, proc

    # The cases run in sessions of their own, so a SIGTERM to this process (gpu_check.sh's time limit)
    # would not reach them; once they outlived it and compiled for another minute beside the table's
    # timed steps (an H200, 2026-11-27). The handler only notes it: the loop below stops them
    # (at most 50 ms later), records them and writes warm.json, then this process exits 128 + 15.
    terminated = []
    on_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: terminated.append(signum)) if on_main_thread \
        else None
    try:
        while (cases or running) and not terminated:
            while cases and len(running) < at_once and left() > 0 and not terminated:
                i, (key, spec) = cases.pop(0)
                with open(logs / f"{i}.log", "w") as f:  # a file, not a pipe: nothing waits on a reader
                    running[key] = (i, subprocess.Popen(
                        [sys.executable, "-m", "hf_dilated.bench.gpu_table", "warm-case", json.dumps(spec)], env=env,
                        stdout=f, stderr=subprocess.STDOUT, start_new_session=True))
            if left() <= 0:
                break
            for key, (i, proc) in list(running.items()):
                if proc.poll() is not None:
                    del running[key]
                    finish(key, i, proc, {"rc": proc.returncode, "seconds": time.perf_counter() - start})
            time.sleep(0.05)
        why = "terminated: stopped" if terminated else f"still compiling after the {budget_s:.0f} s: stopped"
        for key in list(running):
            finish(key, *stop(key), {"rc": None, "error": why})
    finally:
        if on_main_thread:
            signal.signal(signal.SIGTERM, previous)
    for i, (key, _) in cases:
        why = "terminated" if terminated else f"the {budget_s:.0f} s were spent"
        data["cases"][key] = {"rc": None, "error": f"not started: {why}"}
        log(f"  warm {key}: {data['cases'][key]['error']}")
    data["cases"] = {key: data["cases"][key] for key, _ in warm_plan(parts, s, _device(s))}  # in plan order
    _write(out / "warm.json", data)
    if terminated:
        raise SystemExit(128 + terminated[0])
    return data


def _warmed(case: dict) -> str:
    """A warm case in words: its first call (and first decode step), or why none."""
    said = [f"first call {case['first_s']:.1f} s"] if "first_s" in case else []
    if "step_s" in case:
        said.append(f"first decode step {case['step_s']:.1f} s")
    if case.get("error"):
        said.append(case["error"])
    return ", ".join(said) or "?"


def _write(path: Path, data: dict) -> None:
    from .report import write_text

    write_text(path, json.dumps(data, indent=1, default=str))


def run_part(part: str, s: dict, out: Path, budget_s: float, runner=None, log=None) -> dict:
    """Runs the cases of `part` within `budget_s` seconds, rewriting out/PART.json after each."""
    from .worker import CaseRunner

    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    start = time.perf_counter()
    device = _device(s)
    out.mkdir(parents=True, exist_ok=True)
    if runner is None:
        runner = CaseRunner()
        with contextlib.suppress(Exception):  # imports the case processes would repeat
            runner.ctx.set_forkserver_preload(["hf_dilated.bench.worker", "transformers",
                                               "transformers.models.llama.modeling_llama"])
    data = {"part": part, "device": device, "budget_s": budget_s, "results": {}, "skipped": {}, "done": False}
    path = out / f"{part}.json"
    _write(path, data)
    for key, spec in plan(part, s, device):
        left = budget_s - (time.perf_counter() - start)
        if left < 3:
            data["skipped"][key] = f"skipped: the step's {budget_s:.0f} s were spent"
            log(f"  {part} {key}: {data['skipped'][key]}")
            _write(path, data)
            continue
        timeout = min(s["case_cap"], left)
        t0 = time.perf_counter()
        r = runner.run(spec, timeout)
        r["seconds"] = time.perf_counter() - t0
        if r.get("limit") == "time":
            r["error"] = f"time limit: no result within {timeout:.0f} s" + (
                " (the rest of the step's budget)" if timeout < s["case_cap"] else "")
        data["results"][key] = r
        log(f"  {part} {key}: {r['seconds']:.1f} s" + (f" {r['error']}" if r.get("error") else ""))
        _write(path, data)
    data["done"] = True
    data["elapsed_s"] = time.perf_counter() - start
    _write(path, data)
    return data


# --------------------------------------------------------------------------------------------
# The table
# --------------------------------------------------------------------------------------------

def _best(result: dict | None, entry: str, backends) -> tuple[float | None, str, str | None]:
    """(seconds, backend label, error) of the fastest backend of `result` that timed `entry`."""
    if result is None:
        return None, "sdpa", None
    if "backends" not in result:
        return None, "sdpa", result.get("error") or "no result"
    best, errors = None, []
    for b in backends:
        p = result["backends"].get(b, {}).get(entry, {})
        if "median_s" in p:
            label = "sdpa " + b + (" (K/V expanded)" if p.get("form") == "K/V expanded" else "")
            if best is None or p["median_s"] < best[0]:
                best = (p["median_s"], label)
        elif p:
            errors.append(f"{b}: {p.get('error')}")
    if best:
        return best[0], best[1], None
    return None, "sdpa", "; ".join(errors) or result.get("error") or "no result"


def _missing(part: str, key: str, parts: dict) -> str:
    data = parts.get(part)
    if data is None:
        return f"not run: step table-{part} wrote no results (see table-{part}.log)"
    if key in data["skipped"]:
        return data["skipped"][key]
    if not data.get("done"):
        return f"not run: step table-{part} stopped (time limit) before this case"
    return "not run"


def _why(part: str, parts: dict, *sides) -> str:
    """Why a row has no figure: for each (label, key, result, error) side, the case's error or why
    it did not run; the same reason once."""
    reasons = []
    for label, key, result, error in sides:
        text = _missing(part, key, parts) if result is None else error
        if text and text not in reasons:
            reasons.append(text if label is None else f"{label}: {text}")
    return _short("; ".join(reasons) or "not measured")


def _short(text: str, limit: int = 140) -> str:
    text = " ".join(str(text).replace("|", "/").split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _path_note(result, entry=None) -> str | None:
    """How our steps ran (step_paths' counts, for a decode entry) and the fast forms the case's
    process gave up (fallbacks), in words; None when there is nothing to say."""
    said = []
    paths = ((result or {}).get("backends", {}).get("ours", {}).get(entry, {}) or {}).get("paths") if entry else None
    if paths:
        said.append("layer steps: " + ", ".join(f"{count} {path}" for path, count in sorted(paths.items())))
    for where, why in ((result or {}).get("fallbacks") or {}).items():
        said.append(f"fell back ({where}): {_short(why, 100)}")
    return "; ".join(said) or None


def _split_note(ours, sdpa, entry: str, sdpa_label: str) -> str | None:
    """A decode row's host and GPU time apart (measure.host_and_device), ours then sdpa's kernel of
    the row's ratio (cuDNN's is not split: never the faster for decode): "host 5.10 ms, GPU 1.90 ms",
    or "waits for the GPU (2 of 2 calls)": a read back, a blocking copy or free, a full launch queue,
    or host work longer than the spin (measure.host_and_device); then the step's synchronizing calls
    (measure.synchronizing_calls: their count and the first's file and line); None without."""
    def said(result, backend):
        measured = (result or {}).get("backends", {}).get(backend, {}).get(entry, {}) or {}
        split, waits, failed = measured.get("split"), measured.get("waits"), measured.get("waits_error")
        if not split:
            return None
        at = f"; synchronizing calls not found ({_short(failed, 80)})" if failed else "" if waits is None else (
            "; no synchronizing call" if not waits else
            f"; {len(waits)} synchronizing call{'s' if len(waits) > 1 else ''} a step, first at "
            + _short(waits[0].split(": ")[0].rsplit("/", 1)[-1], 60))
        if split.get("host_s") is None:
            return f"waits for the GPU ({split['waited']} of {split['calls']} calls){at}"
        return (f"host {_ms(split['host_s'])} ms, GPU {_ms(split['device_s'])} ms"
                + (f" (waited in {split['waited']} of {split['calls']} calls)" if split.get("waited") else "") + at)

    backend = sdpa_label.split()[1] if sdpa_label.startswith("sdpa ") else None
    parts = [f"{who}: {text}" for who, text in (("ours", said(ours, "ours")),
                                                (sdpa_label, said(sdpa, backend) if backend else None)) if text]
    return "; ".join(parts) or None


def _seconds(t: float) -> str:
    return f"{t:.1f} s" if t >= 1 else f"{1e3 * t:.0f} ms"


def _ms(t):
    return "-" if t is None else f"{t * 1e3:,.2f}" if t < 1 else f"{t * 1e3:,.0f}"


def _row(measure, config, n, ours_name, ours_t, base_name, base_t, *, why=None, pairs=None, dense=None,
         target=None, check=None) -> dict:
    """check(speed, pair_rate) -> bool | None decides the verdict against `target`."""
    row = dict(measure=measure, config=config, n=n, ours=ours_name, ours_t=ours_t, base=base_name, base_t=base_t,
               why=why, pairs=pairs, dense=dense, target=target or "-", verdict="-")
    if ours_t and base_t:
        row["speed"] = base_t / ours_t
        if pairs and dense:
            row["pair_rate"] = (pairs / ours_t) / (dense / base_t)
        if check:
            ok = check(row["speed"], row.get("pair_rate"))
            row["verdict"] = "-" if ok is None else "meets" if ok else "misses"
    return row


def _pass_time(result, pass_name):
    p = (result or {}).get("passes", {}).get(pass_name, {})
    return p.get("median_s"), p.get("error") or p.get("unsupported") or (result or {}).get("error") \
        or (result or {}).get("unavailable")


def build_rows(s: dict, parts: dict, device: str) -> list[dict]:
    from .counts import dense_pair_count, dilated_pair_count

    backends = sdpa_backends(device, s)
    L, rows = s["original"], []
    res = lambda part, key: parts.get(part, {}).get("results", {}).get(key)  # noqa: E731

    # kernel pair rate
    for shape in s["kernel_shapes"]:
        for n in s["kernel_lengths"]:
            hq = shape[0]
            seg, dil = _levels(L, n)
            sdpa = res("kernels", f"sdpa|{_shape(shape)}|{n}")
            for mode in s["kernel_modes"]:
                ours = res("kernels", f"{mode}|{_shape(shape)}|{n}")
                pairs = (ours or {}).get("pairs") or dilated_pair_count(n, hq, seg, dil, mode)
                for pass_name, label in PASSES.items():
                    t, err = _pass_time(ours, pass_name)
                    bt, bname, berr = _best(sdpa, pass_name, backends)
                    why = None if (t and bt) else _why("kernels", parts,
                                                        (mode, f"{mode}|{_shape(shape)}|{n}", ours, err),
                                                        ("sdpa", f"sdpa|{_shape(shape)}|{n}", sdpa, berr))
                    rows.append(_row(f"kernel pair rate, {label}", f"{_shape(shape)}, levels {seg[0]}..{seg[-1]}", n,
                                     mode, t, bname, bt, why=why, pairs=pairs, dense=dense_pair_count(n, hq),
                                     target="pair rate >= 0.5", check=lambda sp, pr: pr >= 0.5 if pr else None))
    mc = s["model"]
    model_cfg = f"Llama {mc['heads']}/{mc['kv_heads']}x{mc['head_dim']}, {mc['layers']} layers"

    def model_pairs(conv, n):
        if conv == "default":
            return None  # each query's far blocks are chosen from the data: no count from the pattern
        if conv == "every_far":  # the band and every far key: every earlier key, as dense attention
            return dense_pair_count(n, mc["heads"])
        entry = _model_entry("union", L, n + ROOM)
        return dilated_pair_count(n, mc["heads"], entry["segment_lengths"], entry["dilation_rates"], "union")

    conv_label = {"default": f"default conversion from {L}", "union": f"union levels from {L}",
                  "every_far": f"default conversion from {L}, every far key"}
    for n in s["prefill_lengths"]:
        sdpa = res("model", f"sdpa|{n}")
        for conv in ("default", "union", "every_far"):
            if conv == "every_far" and n != min(s["prefill_lengths"]):  # plan() runs it at the shortest only
                continue
            ours = res("model", f"{conv}|{n}")
            entries = [("prefill", "prefill (DynamicCache)", None), ("dynamic", "decode step, DynamicCache", None),
                       ("reserved", "decode step, ReservedCache", None)]
            for entry, label, _ in entries:
                t, tname, terr = _best(ours, entry, ["ours"])
                bt, bname, berr = _best(sdpa, entry, backends)
                # a decode step's ratio: ours and sdpa's timed in turn in ours' process (model_case), where
                # there; the two cases' own figures in its note
                turn = (((ours or {}).get("backends", {}).get("ours", {}).get(entry) or {}).get("in_turn")
                        if entry != "prefill" else None) or {}
                apart = None
                if "ours_s" in turn:
                    apart = f"apart: ours {_ms(t)} ms, {bname} {_ms(bt)} ms" if (t and bt) else None
                    t, bt, bname = turn["ours_s"], turn["sdpa_s"], f"sdpa {turn['backend']} (in turn)"
                elif "error" in turn:
                    apart = f"in turn: {_short(turn['error'], 100)}"
                if entry == "prefill" and conv in ("default", "every_far"):
                    target, check = ">= 0.8x best (>= 1.0x flash)", lambda sp, pr: sp >= 0.8
                elif entry == "prefill" and n == max(s["prefill_lengths"]):
                    target, check = ">= 2.5x", lambda sp, pr: sp >= 2.5
                elif entry != "prefill" and n >= 8 * L:
                    target, check = ">= 1.0x (same cache)", lambda sp, pr: sp >= 1.0
                else:
                    target, check = None, None
                why = None if (t and bt) else _why("model", parts, ("ours", f"{conv}|{n}", ours, terr),
                                                    ("sdpa", f"sdpa|{n}", sdpa, berr))
                row = _row(label, f"{model_cfg}, {conv_label[conv]}", n, "dilated", t, bname, bt, why=why,
                           pairs=model_pairs(conv, n) if entry == "prefill" else None,
                           dense=dense_pair_count(n, mc["heads"]) if entry == "prefill" else None,
                           target=target, check=check)
                if entry == "prefill" and conv in ("default", "every_far") and t:
                    flash = ((sdpa or {}).get("backends", {}).get("flash", {}).get("prefill", {})).get("median_s")
                    if flash:
                        row["note"] = f"{flash / t:.2f}x flash"
                        if row["verdict"] == "meets" and flash / t < 1.0:
                            row["verdict"] = "misses"
                first = ((ours or {}).get("backends", {}).get("ours", {}).get(entry, {})).get("first_s")
                if entry == "prefill" and t and first:  # a new length compiles on a GPU: what a user waits once
                    cold = parts.get("warm", {}).get("cases", {}).get(f"model|{conv}|{n}", {}).get("first_s")
                    row["note"] = "; ".join(filter(None, [row.get("note"), (
                        f"first call {cold:.1f} s compiling ahead, {_seconds(first)} here" if cold
                        else f"first call {_seconds(first)}")]))
                split_label = f"sdpa {turn['backend']}" if "ours_s" in turn else bname  # (its own process's)
                row["note"] = "; ".join(filter(None, [row.get("note"), apart, _path_note(ours, entry),
                                                      _split_note(ours, sdpa, entry, split_label)]))
                rows.append(row)
    n = s["static_length"]
    static = parts.get("static", {}).get("results", {})
    sdpa_static = {"backends": {}}
    for key, r in static.items():
        if key.startswith("sdpa "):
            sdpa_static["backends"].update(r.get("backends", {}))
            if "error" in r and not r.get("backends"):
                sdpa_static["backends"][key.split("|")[0][5:]] = {"static": {"error": r["error"]}}
    static_backends = static_sdpa_backends(backends)
    for conv in ("default", "union"):
        ours = static.get(f"{conv}|{n}")
        t, _, terr = _best(ours, "static", ["ours"])
        bt, bname, berr = _best(sdpa_static if sdpa_static["backends"] else None, "static", static_backends)
        why = None
        if not (t and bt):
            parts_missing = []
            if ours is None:
                parts_missing.append(_missing("static", f"{conv}|{n}", parts))
            elif terr:
                parts_missing.append(f"ours: {terr}")
            if not sdpa_static["backends"]:
                parts_missing.append("sdpa: " + _missing("static", f"sdpa {static_backends[0]}|{n}", parts))
            elif berr:
                parts_missing.append(f"sdpa: {berr}")
            why = _short("; ".join(parts_missing))
        rows.append(_row("decode step, StaticCache + torch.compile", f"{model_cfg}, {conv_label[conv]}", n, "dilated",
                         t, bname, bt, why=why, target=">= 3x", check=lambda sp, pr: sp >= 3.0))
    for n in s["train_lengths"]:
        sdpa, ours = res("train", f"sdpa|{n}"), res("train", f"union|{n}")
        t, _, terr = _best(ours, "train", ["ours"])
        bt, bname, berr = _best(sdpa, "train", backends)
        why = None if (t and bt) else _why("train", parts, ("ours", f"union|{n}", ours, terr),
                                            ("sdpa", f"sdpa|{n}", sdpa, berr))
        last = n == max(s["train_lengths"])
        row = _row("training step (fwd+bwd)", f"{model_cfg}, {conv_label['union']}", n, "dilated", t, bname, bt,
                   why=why, target=">= 2x" if last else None, check=(lambda sp, pr: sp >= 2.0) if last else None)
        row["note"] = _path_note(ours)
        rows.append(row)
    n = default_train_length(s)
    if n is not None:  # no target: what fine-tuning the default conversion past L costs (local_band's masked calls)
        sdpa, ours = res("train", f"sdpa|{n}"), res("train", f"default|{n}")
        t, _, terr = _best(ours, "train", ["ours"])
        bt, bname, berr = _best(sdpa, "train", backends)
        why = None if (t and bt) else _why("train", parts, ("ours", f"default|{n}", ours, terr),
                                            ("sdpa", f"sdpa|{n}", sdpa, berr))
        row = _row("training step (fwd+bwd)", f"{model_cfg}, {conv_label['default']}", n, "dilated", t, bname, bt,
                   why=why)
        row["note"] = _path_note(ours)
        rows.append(row)
    b = s["block_sparse"]
    r, rf = res("block-sparse", "block_sparse"), res("block-sparse", "flex")
    cfg = f"{b['heads']}/{b['kv_heads']}x{b['head_dim']}, {json.dumps(b['pattern'])}, block {b['block_size']}"
    if (r or rf) and "kept_blocks" in (r or rf):
        cfg += f", {(r or rf)['kept_blocks']:.1%} of causal blocks"
    for pass_name, label in PASSES.items():
        p = (r or {}).get("passes", {}).get(pass_name, {})
        t = p.get("block_sparse", {}).get("median_s")
        pf = (rf or {}).get("passes", {}).get(pass_name, {})
        flex, tf = pf.get("flex", {}), pf.get("block_sparse", {}).get("median_s")  # timed in turn with flex
        why = None
        if not rf:
            why = _missing("block-sparse", "flex", parts)
        elif not (tf and flex.get("median_s")):
            why = _short(rf.get("error") or flex.get("error") or rf.get("flex_note")
                         or (pf.get("block_sparse", {}).get("error") and "block_sparse: " + pf["block_sparse"]["error"])
                         or "flex: not measured")
        row = _row(f"block_sparse vs FlexAttention (same BlockMask), {label}", cfg, b["n"], "block_sparse", tf,
                   "flex (compiled)", flex.get("median_s"), why=why, target=">= 1.0x", check=lambda sp, pr: sp >= 1.0)
        if rf and rf.get("flex_max_abs_diff") is not None:
            row["note"] = f"outputs differ by {rf['flex_max_abs_diff']:.1e}"
        row["note"] = "; ".join(filter(None, [row.get("note"), _path_note(rf)]))
        rows.append(row)
        sdpa = {"backends": {bk: {pass_name: p.get("sdpa " + bk, {})} for bk in backends}} if r else None
        bt, bname, berr = _best(sdpa, pass_name, backends)
        why = None if (t and bt) else (_short(berr or "block_sparse: not measured") if r else
                                       _missing("block-sparse", "block_sparse", parts))
        rows.append(_row(f"block_sparse vs sdpa, {label}", cfg, b["n"], "block_sparse", t, bname, bt, why=why,
                         pairs=(r or {}).get("pairs"), dense=dense_pair_count(b["n"], b["heads"])))
    m = s["million"]
    r = res("million", "union")
    row = dict(measure="union forward: extra memory / (q, k, v, out)",
               config=f"{m['heads']}/{m['heads']}x{m['head_dim']}, {s['dtype']}, levels from {L}", n=m["n"],
               ours="union", target="<= 1.5", verdict="-", kind="memory")
    fwd = (r or {}).get("passes", {}).get("forward", {})
    if r and fwd.get("peak_extra_bytes") is not None and r.get("qkvo_bytes"):
        mult = fwd["peak_extra_bytes"] / r["qkvo_bytes"]
        row.update(value=f"{mult:.2f}x ({fwd['peak_extra_bytes'] / 2**20:,.0f} of {r['qkvo_bytes'] / 2**20:,.0f} MiB)",
                   ours_t=fwd.get("median_s"), verdict="meets" if mult <= 1.5 else "misses")
    else:
        row["why"] = _short(fwd.get("error") or (r or {}).get("error") or (r or {}).get("unavailable")
                            or _missing("million", "union", parts))
    rows.append(row)
    return rows


def cuda_tests(xml: Path | None, log: Path | None) -> dict:
    """Counts of the CUDA-marked tests: from pytest's junit XML, else (the step was stopped) from its
    -rA / -v log lines."""
    if xml and xml.is_file():
        try:
            import xml.etree.ElementTree as ET

            root = ET.parse(xml).getroot()
            suite = root if root.tag == "testsuite" else root.find("testsuite")
            c = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
            failed = [f"{case.get('classname')}::{case.get('name')}" for case in suite.iter("testcase")
                      if case.find("failure") is not None or case.find("error") is not None]
            return dict(passed=c["tests"] - c["failures"] - c["errors"] - c["skipped"], failed=c["failures"],
                        errors=c["errors"], skipped=c["skipped"], source="junit XML", failed_names=failed)
        except Exception as e:  # noqa: BLE001 - fall back to the log
            note = f"junit XML unreadable ({type(e).__name__})"
    else:
        note = "no junit XML (the step was stopped?)"
    if log and log.is_file():
        text = log.read_text(errors="replace")
        # "path::test PASSED", or with pytest-xdist's workers "[gw0] [ 12%] PASSED path::test"
        counts = {w: len(re.findall(rf"^(?:\S+::\S.* {w.upper()}\b|\[gw\d+\] \[\s*\d+%\] {w.upper()} \S+::)", text, re.M))
                  for w in ("passed", "failed", "error", "skipped")}
        return dict(passed=counts["passed"], failed=counts["failed"], errors=counts["error"], skipped=counts["skipped"],
                    source=f"{note}: counted in the log, partial", failed_names=[])
    return dict(source=f"{note}; no log")


def _cell_ratio(x, fmt="{:.2f}x"):
    return "-" if x is None else fmt.format(x)


def markdown(s: dict, rows: list[dict], tests: dict, env: dict, parts: dict) -> str:
    L = s["original"]
    lines = [
        "# GPU check: hf-dilated beside sdpa's best kernel\n",
        f"- {env.get('device_name', env.get('device'))}; torch {env.get('torch')}; {s['dtype']}"
        + ("; --smoke: tiny sizes, timings meaningless" if s["smoke"] else ""),
        "- sdpa best = the faster of sdpa's flash and cuDNN backends (torch.nn.attention.sdpa_kernel), measured in the "
        "same run (in float32 or on the CPU: sdpa's default). Ours runs unrestricted.",
        f"- FlashAttention in every flash call, ours and sdpa's: {env.get('flash') or 'not recorded'}",
        "- speed = sdpa time / ours (above 1: ours faster); time ratio = ours / sdpa; pair rate = (visible pairs / "
        "our time) / (dense causal pairs / sdpa time); pairs = visible (query, key) pairs / dense causal pairs.",
        f"- levels from {L}: segments {L}, {2 * L}, ... with dilations 1, 2, ... until a segment covers N (model rows: "
        f"N + {ROOM}, the decode steps); default conversion = hf_dilated.config.default_conversion({L}, N + {ROOM}, "
        "'dilated') (band L inside L and L / 2 past it; far keys at grouped positions, each query reading its top "
        "8 blocks of 64 per doubling of L by Quest's bound and the first block: a data-dependent set, so no pair count).",
        "",
        "| measure | config | N | ours | ours ms | baseline | baseline ms | time ratio | speed | pairs | pair rate "
        "| target | verdict | note |",
        "|---|---|---:|---|---:|---|---:|---:|---:|---:|---:|---|---|---|",
    ]
    for r in rows:
        if r.get("kind") == "memory":
            lines.append(f"| {r['measure']} | {r['config']} | {r['n']:,} | {r['ours']} | {_ms(r.get('ours_t'))} | - | - "
                         f"| - | - | - | - | {r['target']} | {r['verdict']} | {r.get('value') or r.get('why')} |")
            continue
        ratio = r["ours_t"] / r["base_t"] if r.get("ours_t") and r.get("base_t") else None
        pairs = "-" if not r.get("dense") or r.get("pairs") is None else f"{r['pairs'] / r['dense']:.2f}"
        note = "; ".join(x for x in (r.get("note"), r.get("why")) if x)
        lines.append(
            f"| {r['measure']} | {r['config']} | {r['n']:,} | {r['ours']} | {_ms(r.get('ours_t'))} | {r['base']} | "
            f"{_ms(r.get('base_t'))} | {_cell_ratio(ratio, '{:.2f}')} | {_cell_ratio(r.get('speed'))} | {pairs} | "
            f"{_cell_ratio(r.get('pair_rate'), '{:.2f}')} | {r['target']} | {r['verdict']} | {note} |")
    if "passed" in tests:
        total = tests["passed"] + tests["failed"] + tests["errors"]
        value = (f"{tests['passed']} passed, {tests['failed']} failed, {tests['errors']} errors, {tests['skipped']} "
                 f"skipped ({tests['source']})")
        if tests.get("failed_names"):
            value += "; failed: " + ", ".join(tests["failed_names"][:8]) + (" ..." if len(tests["failed_names"]) > 8 else "")
        verdict = "-" if total == 0 else "meets" if tests["failed"] + tests["errors"] == 0 else "misses"
    else:
        value, verdict = f"not run: {tests.get('source')}", "-"
    lines.append(f"| CUDA tests (pytest -m cuda, every one) | - | - | - | - | - | - | - | - | - | - | all pass | "
                 f"{verdict} | {_short(value, 600)} |")
    lines.append("")
    for part in PARTS:
        data = parts.get(part)
        if data is None:
            lines.append(f"- step table-{part}: no results")
        else:
            state = "done" if data.get("done") else "stopped before its end"
            lines.append(f"- step table-{part}: {state}, {len(data['results'])} cases measured, "
                         f"{len(data['skipped'])} skipped, budget {data['budget_s']:.0f} s"
                         + (f", {data['elapsed_s']:.0f} s used" if data.get("elapsed_s") else ""))
    warmed = parts.get("warm", {}).get("cases", {})
    if warmed:
        lines.append("- compiled ahead, beside the tests: " + "; ".join(
            f"{key} {_warmed(c)}" for key, c in warmed.items()))
    return "\n".join(lines) + "\n"


def render(s: dict, out: Path, tests_xml: Path | None = None, tests_log: Path | None = None) -> str:
    import platform

    import torch

    parts = {}
    for part in PARTS + ("warm",):  # warm: the first calls compiled ahead (gpu_check.sh, beside the tests)
        path = out / f"{part}.json"
        if path.is_file():
            with contextlib.suppress(ValueError):
                parts[part] = json.loads(path.read_text())
    device = next((p["device"] for p in parts.values() if "device" in p), _device(s))
    env = {"device": device, "torch": torch.__version__, "python": platform.python_version()}
    if device == "cuda" and torch.cuda.is_available():
        env["device_name"] = torch.cuda.get_device_name(0)
    flashes = sorted({r["flash"] for p in parts.values() for r in p.get("results", {}).values() if r.get("flash")})
    if device == "cuda":
        env["flash"] = ", ".join(f.replace("FA2", "FA2 (torch's own)") for f in flashes) or None
    else:
        env["flash"] = "none (no flash kernel off CUDA)"
    tests = cuda_tests(tests_xml, tests_log)
    rows = build_rows(s, parts, device)
    text = markdown(s, rows, tests, env, parts)
    from .report import write_text

    write_text(out / "table.md", text)
    _write(out / "table.json", {"settings": s, "rows": rows, "tests": tests, "env": env})
    return text


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m hf_dilated.bench.gpu_table", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="measure one part")
    run.add_argument("part", choices=PARTS)
    run.add_argument("--budget", type=float, required=True, help="seconds for the part's cases")
    deadline_help = ("the Unix time (s) to be done by, whatever the budget: a caller's time limit counts this "
                     "process's start-up (importing torch and transformers: 10 s and more beside compiles)")
    run.add_argument("--deadline", type=float, help=deadline_help)
    ahead = sub.add_parser("warm", help="compile ahead, beside the tests, what the parts' first calls compile")
    ahead.add_argument("parts", nargs="+", choices=WARM_PARTS)
    ahead.add_argument("--budget", type=float, default=600.0, help="seconds before the cases still compiling stop")
    ahead.add_argument("--deadline", type=float, help=deadline_help)
    one = sub.add_parser("warm-case", help=argparse.SUPPRESS)  # one case, in this process (warm's children)
    one.add_argument("spec", type=json.loads)
    table = sub.add_parser("table", help="write DIR/table.md from the parts' results and print it")
    table.add_argument("--tests-xml", type=Path)
    table.add_argument("--tests-log", type=Path)
    for q in (run, ahead, table):
        q.add_argument("--out", type=Path, required=True)
        q.add_argument("--smoke", action="store_true", help="tiny sizes (checks the script on a CPU)")
    args = p.parse_args(argv)
    if args.command == "warm-case":
        warm_case(args.spec, report=lambda line: print(line, flush=True))
        return 0
    s = settings(args.smoke)
    budget = getattr(args, "budget", None)
    if getattr(args, "deadline", None) is not None:
        if not math.isfinite(args.deadline):
            p.error(f"--deadline: a Unix time in seconds, got {args.deadline}")
        budget = max(0.0, min(budget, args.deadline - time.time()))  # past it: every case skipped, said so
    if args.command == "run":
        data = run_part(args.part, s, args.out, budget)
        return 0 if data["results"] else 1
    if args.command == "warm":
        data = warm(args.parts, s, args.out, budget)
        return 0 if all(c.get("rc") == 0 for c in data["cases"].values()) else 1
    print(render(s, args.out, args.tests_xml, args.tests_log), end="")
    return 0


if __name__ == "__main__":  # the case processes import this module: no run on import
    sys.exit(main())
