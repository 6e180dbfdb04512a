"""Decode benchmark: one new token against a KV cache of N tokens, each of our kernels vs sdpa, and
the figure a user sees, `generate()` on a Llama-shaped model with a long prompt.

Kernel rows. The dilated configuration is the documented schedule for a checkpoint pretrained at
--original tokens and extended to N (DilatedConfig.default: segments original * 2^g, dilations
2^g); "dilated+band" adds the local band of `original` keys (docs/contract.md 4.1); block-sparse
uses the benchmark's block pattern. sdpa runs as transformers runs it for one query with grouped
heads and a mask (the query heads packed per kv head, no K/V repeat: the faster of its two forms
on CPU). Every row also gives the K/V rows the step reads (computed from the plan: kv head x key)
and the "limit": sdpa's rows over ours, the speedup a step that only read memory would reach.
One process per (context, dtype); the variants are timed in interleaved rounds and their memory
measured after (measure.py). `ring`, `dilated_ring` and `block_sparse_ring` on one process run
these same kernels.

Generate rows. LlamaForCausalLM with random weights and the given shapes, `dilated` under the
default conversion from --original tokens (config.default_band: a band of --original, sparse far keys
past it, docs/contract.md 4.2), a prompt of
--gen-prompt random tokens, --gen-new greedy tokens: prefill seconds (prompt to first token) and
decode tokens/s (the remaining tokens), with DynamicCache, StaticCache and hf_dilated.ReservedCache
(a DynamicCache that does not copy itself per step), timed inside `generate()` by a logits processor that stamps each step. One process per (name, cache).
With --gen-fill random the cache is filled with --gen-prompt random keys and values instead of a
prefill, and the greedy steps run one model call at a time: the decode rows of a deep model (SmolLM2's
30 layers) without minutes of prefill. A step's cost does not depend on what the cache holds (the
sparse far keys read a fixed number of blocks whichever they are).
"""
from __future__ import annotations

import inspect
import statistics
import time

import torch
import torch.nn.functional as F

from .. import measure
from .kernels import DTYPES
from .report import mib, say

KERNEL_VARIANTS = ("sdpa", "dilated", "dilated+band", "dilated+sparse", "block_sparse")


def kv_rows(spec: dict, variant: str, cfg) -> int:
    """K/V rows (kv head x key) one decode step of `variant` reads at the end of the cache."""
    from ..ops.dilated_decode import _parts
    from ..ops.block_sparse_decode import _visible_runs
    from ..ops.block_patterns import make_pattern

    n, hq, hkv = spec["n"], spec["heads"], spec["kv_heads"]
    if variant == "sdpa":
        return hkv * n
    if variant == "block_sparse":
        bs = spec["block_size"]
        runs = _visible_runs(make_pattern(spec["block_pattern"]), n - 1, 0, 0, bs, None)
        return hkv * sum(hi - lo for lo, hi in runs)
    if variant == "dilated+sparse":  # the band past L, the sinks' and the chosen blocks' keys (and ties: a floor)
        s = _sparse_settings(spec)
        return hkv * min(n, s["far_band"] + (s["far_top_k"] + s["far_sinks"]) * s["far_block_size"])
    band = spec["original"] if variant == "dilated+band" else None
    group = hq // hkv
    rows = 0
    for part in _parts(n - 1, 0, 0, hq, hkv, cfg.segment_lengths, cfg.dilation_rates, cfg.mode, None, band):
        heads = range(part.h0, part.h0 + part.n_heads * part.h_step, part.h_step)
        rows += part.count * len({h // group for h in heads})
    return rows


def _sparse_settings(spec: dict) -> dict:
    """The default conversion's settings for N tokens (config.default_band): the band, far keys at
    grouped positions, sparse far keys (docs/contract.md 4.2)."""
    from ..config import field_defaults, default_band
    from ..kinds import KINDS

    return {**field_defaults(*KINDS["dilated"].settings), "mode": "union",
            **default_band(spec["original"], max(spec["n"], spec["original"] + 1))}


def run_decode_case(spec: dict, own_process: bool = False) -> dict:
    from ..config import DilatedConfig
    from ..ops import block_sparse_attention, dilated_attention
    from ..ops import block_sparse_decode, dilated_decode

    device, dtype, n = torch.device(spec["device"]), DTYPES[spec["dtype"]], spec["n"]
    cfg = DilatedConfig.default(spec["original"], n)
    seg, dil = cfg.segment_lengths, cfg.dilation_rates
    gen = torch.Generator(device="cpu").manual_seed(0)
    hq, hkv, d = spec["heads"], spec["kv_heads"], spec["head_dim"]
    q = torch.randn(1, hq, 1, d, generator=gen, dtype=dtype).to(device)
    k, v = (torch.randn(1, hkv, n, d, generator=gen, dtype=dtype).to(device) for _ in range(2))
    packed = q.view(1, hkv, hq // hkv, d)  # transformers' pack_gqa for one query
    from ..kinds import KINDS

    sparse = _sparse_settings(spec)
    inv_freq = 1.0 / (1e5 ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))
    # The summaries persist between steps as they do on a model's layer (the same cache buffer).
    sparse_state = {}
    sparse_kw = dict(is_causal=True, attention_mask=None, position_ids=None, scale=None, dropout_p=0.0, group=None,
                     layout=None, rope_frequencies=inv_freq, state=sparse_state)
    steps = {
        "sdpa": lambda: F.scaled_dot_product_attention(packed, k, v),
        "dilated": lambda: dilated_attention(q, k, v, seg, dil, mode=cfg.mode),
        "dilated+band": lambda: dilated_attention(q, k, v, seg, dil, mode=cfg.mode, local_window=spec["original"]),
        "dilated+sparse": lambda: KINDS["dilated"].run(q, k, v, sparse, **sparse_kw),
        "block_sparse": lambda: block_sparse_attention(q, k, v, spec["block_pattern"], block_size=spec["block_size"]),
    }
    counts = (dilated_decode.COUNTS, block_sparse_decode.COUNTS)
    before = [dict(c) for c in counts]
    log = []
    with torch.no_grad():
        times = measure.time_interleaved(list(steps.items()), spec["repeats"], warmup=max(1, spec["warmup"]),
                                         log=log.append, device=device)
        timed = {name: {"times_s": t, "median_s": statistics.median(t)}
                 for name, t in zip(steps, times) if t is not None}
        measure.measure_memory({name: steps[name] for name in timed}, timed, device, own_process)
    fallbacks = sum(c["fallback"] - b["fallback"] for c, b in zip(counts, before))
    rows = {name: kv_rows(spec, name, cfg) for name in steps}
    return {"spec": spec, "levels": len(seg), "segment_lengths": seg, "dilation_rates": dil, "passes": timed,
            "kv_rows": rows, "bytes_per_row": 2 * d * q.element_size(), "fallbacks": fallbacks, "log": log}


class _StepClock:
    """A logits processor that records the time of each generation step (it runs after each forward)."""

    def __init__(self):
        self.stamps = []

    def __call__(self, input_ids, scores):
        self.stamps.append(time.perf_counter())
        return scores


def run_generate_case(spec: dict, own_process: bool = False) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM, LogitsProcessorList

    from ..config import CONFIG_KEY, DilatedConfig, default_band

    total = spec["prompt"] + spec["new"]
    config = LlamaConfig(**spec["model_config"], max_position_embeddings=total)
    # The default conversion (config.default_conversion for `dilated`): the band of the original
    # context, far keys at grouped positions, read sparsely past it.
    setattr(config, CONFIG_KEY, DilatedConfig.default(spec["original"], total,
                                                      **default_band(spec["original"], total)).to_dict())
    torch.manual_seed(0)
    model = LlamaForCausalLM._from_config(config, attn_implementation=spec["attn_implementation"],
                                          dtype=DTYPES[spec["dtype"]]).eval()
    ids = torch.randint(0, config.vocab_size, (1, spec["prompt"]), generator=torch.Generator().manual_seed(0))
    clock = _StepClock()
    from ..integrations.cache import ReservedCache

    if spec.get("fill") == "random":
        return _steps_on_filled_cache(model, config, spec)
    cache = {"static": {"cache_implementation": "static"}, "dynamic": {},
             "reserved": {"cache": ReservedCache(config=config)}}[spec["cache"]]
    with torch.no_grad():
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=spec["new"],
                             min_new_tokens=spec["new"], do_sample=False, pad_token_id=0,
                             logits_processor=LogitsProcessorList([clock]), **cache)
    stamps = clock.stamps
    decode_s = stamps[-1] - stamps[0]
    return {"spec": spec, "prefill_s": stamps[0] - start, "decode_s": decode_s,
            "decode_tokens_per_s": (len(stamps) - 1) / decode_s, "tokens": out[0, spec["prompt"]:].tolist(),
            "params": sum(p.numel() for p in model.parameters())}


def _steps_on_filled_cache(model, config, spec) -> dict:
    """generate()'s greedy decode steps, one model call each, on a cache filled with random keys and
    values (--gen-fill random): decode_tokens_per_s over every step but the first, which builds
    what later steps keep (the far keys' summaries)."""
    from transformers import DynamicCache

    from ..integrations.cache import ReservedCache

    prompt, new = spec["prompt"], spec["new"]
    if new < 2:
        raise ValueError(f"--gen-new: --gen-fill random times the steps after the first, got {new}")
    cache = (ReservedCache if spec["cache"] == "reserved" else DynamicCache)(config=config)
    g = torch.Generator().manual_seed(1)
    shape = (1, config.num_key_value_heads, prompt, config.head_dim)
    for layer in range(config.num_hidden_layers):
        cache.update(torch.randn(shape, generator=g).to(model.dtype), torch.randn(shape, generator=g).to(model.dtype),
                     layer)
    # transformers renamed past_key_values to cache (5.x)
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    token = torch.zeros(1, 1, dtype=torch.long)
    tokens, times = [], []
    with torch.no_grad():
        for step in range(new):
            at = prompt + step
            start = time.perf_counter()
            logits = model(input_ids=token, attention_mask=torch.ones(1, at + 1, dtype=torch.long),
                           position_ids=torch.tensor([[at]]), use_cache=True, **{name: cache}).logits
            token = logits[:, -1:].argmax(-1)
            times.append(time.perf_counter() - start)
            tokens.append(int(token))
    decode_s = sum(times[1:])
    return {"spec": spec, "prefill_s": None, "first_step_s": times[0], "decode_s": decode_s,
            "decode_tokens_per_s": (new - 1) / decode_s, "tokens": tokens,
            "params": sum(p.numel() for p in model.parameters())}


def generate_model_config(s) -> dict:
    return dict(hidden_size=s["heads"] * s["head_dim"], num_attention_heads=s["heads"],
                num_key_value_heads=s["kv_heads"], head_dim=s["head_dim"], num_hidden_layers=s["gen_layers"],
                intermediate_size=s["gen_intermediate"], vocab_size=s["gen_vocab"])


def run_section(s, runner, report) -> dict:
    results = []
    for dtype in s["dtypes"]:
        for n in s["contexts"]:
            spec = dict(kind="decode", n=n, original=s["original"], heads=s["heads"], kv_heads=s["kv_heads"],
                        head_dim=s["head_dim"], dtype=dtype, device=s["device"], warmup=s["warmup"],
                        repeats=s["repeats"], threads=s["threads"], block_size=s["block_size"],
                        block_pattern=s["block_pattern"])
            r = runner.run(spec, s["case_timeout"])
            p = r.get("passes", {})
            say(f"  decode {dtype:>8} N={n:<8} " + ("; ".join(
                f"{name} {p[name]['median_s'] * 1e3:.2f} ms" for name in p if "median_s" in p[name])
                or r.get("error", "")))
            results.append(r)
    generated = []
    if s["gen_prompt"]:
        for cache in s["gen_caches"]:
            for name in ("sdpa", "dilated"):
                spec = dict(kind="generate", attn_implementation=name, cache=cache, prompt=s["gen_prompt"],
                            new=s["gen_new"], original=s["original"], dtype=s["dtypes"][0],
                            model_config=generate_model_config(s), threads=s["threads"], fill=s["gen_fill"])
                r = runner.run(spec, s["case_timeout"])
                say(f"  generate {name:>8} {cache:>7} cache: " + (
                    f"prefill {_seconds(r['prefill_s'])}, decode {r['decode_tokens_per_s']:.2f} tokens/s"
                    if "decode_tokens_per_s" in r else r.get("error", "")))
                generated.append(r)
    return {"results": results, "generate": generated}


def _conversion_line(spec) -> str:
    """What `dilated` ran in the generate rows: the default conversion for prompt + new tokens (a
    prompt of 4L with new tokens on top is converted past 4L, with more blocks)."""
    from ..config import default_band

    total = spec["prompt"] + spec["new"]
    if total <= spec["original"]:
        return f"dilated: {total} tokens fit the original {spec['original']}: the conversion changes nothing.\n"
    b = default_band(spec["original"], total)
    return (f"dilated: the default conversion from {spec['original']} to {total} tokens (prompt + new): band "
            f"{b['local_window']}, past it {b['far_band']}; far keys at G = {b['far_group']}, the first block and "
            f"{b['far_top_k']} blocks of {b['far_block_size']}.\n")


def _seconds(s) -> str:
    return "- (cache filled at random)" if s is None else f"{s:.1f} s"


def _cells(p) -> list[str]:
    if "median_s" not in p:
        return [p.get("error", "-")]
    t = p["times_s"]
    return [f"{p['median_s'] * 1e3:.2f} [{min(t) * 1e3:.2f}-{max(t) * 1e3:.2f}]"]


def markdown_section(section, s) -> list[str]:
    L = ["## Decode: one token against a KV cache of N tokens\n",
         f"{s['heads']} query heads over {s['kv_heads']} kv heads, head_dim {s['head_dim']}. dilated: "
         f"DilatedConfig.default({s['original']}, N); dilated+band: the same with a local band of {s['original']} "
         f"keys; dilated+sparse: the default conversion's band of {s['original']} with sparse far keys "
         "(hf_dilated.config.default_band, docs/contract.md 4.2; the block summaries kept between steps); "
         f"block_sparse: {s['block_pattern']} with blocks of {s['block_size']}. sdpa as transformers runs one "
         f"query with a mask (heads packed per kv head). Time: median [min-max] of {s['repeats']} interleaved "
         "rounds, ms. K/V MiB: what the step reads (kv head x key rows, K and V). speedup = sdpa time / ours; "
         "limit = sdpa's K/V bytes / ours; of limit = speedup / limit. Memory: peak beyond the cache, MiB.\n",
         "| dtype | N | variant | ms | K/V MiB read | peak MiB | speedup vs sdpa | limit | of limit |",
         "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in section["results"]:
        spec, p = r["spec"], r.get("passes", {})
        if "error" in r:
            L.append(f"| {spec['dtype']} | {spec['n']} | {r['error']} | - | - | - | - | - | - |")
            continue
        sdpa = p.get("sdpa", {})
        for name, rows in r["kv_rows"].items():
            mine = p.get(name, {})
            read = f"{rows * r['bytes_per_row'] / 2 ** 20:,.1f}"
            speed = limit = frac = "-"
            if "median_s" in mine and "median_s" in sdpa and name != "sdpa":
                sp = sdpa["median_s"] / mine["median_s"]
                lim = r["kv_rows"]["sdpa"] / rows
                speed, limit, frac = f"{sp:.1f}x", f"{lim:.1f}x", f"{sp / lim:.2f}"
            L.append(f"| {spec['dtype']} | {spec['n']} | {name} | " + " | ".join(_cells(mine)) +
                     f" | {read} | {mib(mine.get('peak_extra_bytes'))} | {speed} | {limit} | {frac} |")
    falls = sum(r.get("fallbacks", 0) for r in section["results"])
    L.append(f"\nDecode calls that fell back to the general path in these layouts: {falls}.\n")
    L += [f"- N={r['spec']['n']}: {line}" for r in section["results"] for line in r.get("log", [])]
    gen = section.get("generate") or []
    if gen:
        mc = gen[0]["spec"]["model_config"]
        L += ["", f"### generate(): prompt of {gen[0]['spec']['prompt']} tokens, {gen[0]['spec']['new']} new tokens\n",
              f"LlamaForCausalLM, random weights: {mc['num_hidden_layers']} layers, hidden {mc['hidden_size']}, "
              f"{mc['num_attention_heads']}/{mc['num_key_value_heads']} heads of {mc['head_dim']}, intermediate "
              f"{mc['intermediate_size']}, vocabulary {mc['vocab_size']}; {gen[0]['spec']['dtype']}; greedy. " + (
                  "The cache filled with random keys and values (--gen-fill random), no prefill; decode: the "
                  "steps after the first, one model call each.\n" if gen[0]["spec"].get("fill") == "random" else
                  "Prefill: prompt to first token. Decode: the other tokens.\n"),
              _conversion_line(gen[0]["spec"]),
              "| cache | attn_implementation | prefill s | decode tokens/s | decode vs sdpa |", "|---|---|---:|---:|---:|"]
        base = {r["spec"]["cache"]: r.get("decode_tokens_per_s") for r in gen if r["spec"]["attn_implementation"] == "sdpa"}
        for r in gen:
            spec = r["spec"]
            if "decode_tokens_per_s" not in r:
                L.append(f"| {spec['cache']} | {spec['attn_implementation']} | {r.get('error', '-')} | - | - |")
                continue
            tps, sdpa_tps = r["decode_tokens_per_s"], base.get(spec["cache"])
            versus = f"{tps / sdpa_tps:.2f}x" if sdpa_tps else "-"
            prefill = "-" if r["prefill_s"] is None else f"{r['prefill_s']:.1f}"
            L.append(f"| {spec['cache']} | {spec['attn_implementation']} | {prefill} | {tps:.2f} | {versus} |")
    return L + [""]
