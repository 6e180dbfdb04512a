"""End-to-end benchmark: a training step (loss + backward) of a tiny Llama with random weights, for
each attn_implementation (by default sdpa and every one `import hf_dilated` registers), one
process per (implementation, length); time and memory as in every benchmark (measure.py)."""
from __future__ import annotations

import json

import torch

from .. import measure
from .kernels import DTYPES
from .report import case_summary, mib, say

HF_DILATED_IMPLEMENTATIONS = ("dilated", "dilated_ring", "ring", "block_sparse", "block_sparse_ring")


def run_e2e_case(spec: dict, own_process: bool = False) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    device, dtype = torch.device(spec["device"]), DTYPES[spec["dtype"]]
    result = {"spec": spec, "passes": {}}
    measure.limit_memory(spec.get("budget_bytes"), device)
    config = LlamaConfig(**spec["model_config"])
    for key, value in (spec.get("config_extra") or {}).items():
        setattr(config, key, value)
    torch.manual_seed(0)
    try:
        model = LlamaForCausalLM._from_config(config, attn_implementation=spec["attn_implementation"],
                                              dtype=dtype).to(device)
    except (ValueError, KeyError, ImportError, RuntimeError) as e:
        result["unavailable"] = measure.error_text(e)
        return result
    model.train()
    ids = torch.randint(0, config.vocab_size, (spec["batch"], spec["n"]),
                        generator=torch.Generator().manual_seed(0)).to(device)

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)

    result["params"] = sum(p.numel() for p in model.parameters())
    errors = measure.CALL_ERRORS + (ValueError,)
    try:
        result["passes"]["backward"] = measure.time_calls(step, device, spec["warmup"], spec["repeats"])
    except errors as e:
        result["passes"]["backward"] = {"error": measure.error_text(e)}
        return result
    measure.measure_memory({"backward": step}, result["passes"], device, own_process, errors)
    return result


def model_config(max_len: int) -> dict:
    from ..model_configs import load_preset

    cfg = dict(load_preset("tiny-llama")["model_config"])
    cfg.pop("model_type", None)
    # Wider than the test preset so that attention has realistic heads (head_dim 64).
    cfg.update(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
               vocab_size=1024, max_position_embeddings=max_len)
    return cfg


def implementations(requested) -> tuple[list[str], dict]:
    """(names to run, {name: why not run}): the requested names transformers knows, or by default
    sdpa and every implementation `import hf_dilated` registered (this package is part of
    hf_dilated, so they are registered by now)."""
    from transformers import AttentionInterface

    known = set(AttentionInterface._global_mapping) | {"sdpa", "eager"}
    missing = {n: "not registered by `import hf_dilated`" for n in HF_DILATED_IMPLEMENTATIONS if n not in known}
    if requested is None:
        return ["sdpa"] + [n for n in HF_DILATED_IMPLEMENTATIONS if n in known], missing
    missing.update({n: "not a registered attn_implementation" for n in requested if n not in known})
    return [n for n in requested if n in known], missing


def run_section(s, runner, report) -> dict:
    impls, unavailable = implementations(s["e2e_impls"])
    config = model_config(max(s["e2e_lengths"]))
    dilated_cfg = {"segment_lengths": s["segment_lengths"], "dilation_rates": s["dilation_rates"], "mode": "union",
                   "block_size": s["block_size"], "pattern": s["block_pattern"]}
    rows = []
    for n in s["e2e_lengths"]:
        for impl in impls:
            spec = dict(kind="e2e", attn_implementation=impl, n=n, dtype=s["dtypes"][0], device=s["device"],
                        batch=1, model_config=config, config_extra={"hf_dilated": dilated_cfg},
                        warmup=s["warmup"], repeats=s["repeats"], threads=s["threads"])
            r = runner.run(spec, s["case_timeout"])
            say(f"  e2e {impl:>18} N={n:<7} {case_summary(r)}")
            if r.get("unavailable"):
                unavailable[impl] = r["unavailable"]
            rows.append(r)
    return {"rows": rows, "unavailable": unavailable, "model_config": config, "hf_dilated": dilated_cfg}


def markdown_section(section, s) -> list[str]:
    mc = section["model_config"]
    L = ["## End to end: tiny Llama forward + backward\n",
         f"LlamaForCausalLM with random weights ({mc['num_hidden_layers']} layers, hidden {mc['hidden_size']}, "
         f"{mc['num_attention_heads']} heads over {mc['num_key_value_heads']} kv heads, vocab {mc['vocab_size']}), "
         f"batch 1, loss + backward, dtype {s['dtypes'][0]}; hf_dilated config {json.dumps(section['hf_dilated'])}.\n",
         "| attn_implementation | N | ms | tokens/s | speed vs sdpa | peak MiB |",
         "|---|---:|---:|---:|---:|---:|"]
    sdpa = {r["spec"]["n"]: r["passes"]["backward"]["median_s"] for r in section["rows"]
            if r["spec"]["attn_implementation"] == "sdpa" and "median_s" in r.get("passes", {}).get("backward", {})}
    for r in section["rows"]:
        p, n, impl = r.get("passes", {}).get("backward", {}), r["spec"]["n"], r["spec"]["attn_implementation"]
        if "median_s" not in p:
            L.append(f"| {impl} | {n} | {r.get('unavailable') or r.get('error') or p.get('error')} | - | - | - |")
            continue
        t, times = p["median_s"], p["times_s"]
        L.append(f"| {impl} | {n} | {t * 1e3:.1f} [{min(times) * 1e3:.1f}-{max(times) * 1e3:.1f}] | {n / t:,.0f} | "
                 f"{f'{sdpa[n] / t:.2f}' if n in sdpa else '-'} | {mib(p['peak_extra_bytes'])} |")
    L.append("")
    L += [f"- `{name}` unavailable: {why}" for name, why in section["unavailable"].items()]
    L.append("- transformers' `eager` and `flex_attention` are not run by default: eager materialises the N x N "
             "weights per layer, and FlexAttention has no CPU backward; the kernel table has compiled `flex` forward.")
    return L + [""]
