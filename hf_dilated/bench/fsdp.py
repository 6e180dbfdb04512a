"""FSDP2 x sequence parallelism against plain data parallelism x sequence parallelism: one training
step (forward, backward, AdamW) of a tiny Llama on P gloo processes, `dilated_ring` attention over
an SP group of --fsdp-sp ranks. Per rank: the bytes of parameters, gradients and optimizer state it
holds (its local shards, counted exactly), and the peak resident memory of the step above what the
process held before it (measure.py). Grids: every parameter replicated (plain DP x SP, what DDP
holds), FSDP2 sharded over the data-parallel ranks only (HSDP, replicated over SP), and FSDP2
sharded over every rank (ZeRO-3 style). The sharded states should fall as 1 / shard count.
"""
from __future__ import annotations

import datetime
import os

import torch

from .. import measure
from .report import mib, say

GRIDS = ("replicated", "fsdp_dp", "fsdp_dp_sp")


def _local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def run_fsdp_rank(spec: dict, own_process: bool = False) -> dict:
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    import hf_dilated.distributed as hd
    from ..config import CONFIG_KEY, DilatedConfig
    from ..distributed.fsdp import apply_fsdp2, build_mesh

    rank, world = spec["rank"], spec["world"]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["port"]))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=spec["timeout_s"]))
    mesh = build_mesh(spec["sp"])
    hd.setup_sequence_parallel_from_mesh(mesh)
    config = LlamaConfig(**spec["model_config"], max_position_embeddings=spec["n"])
    setattr(config, CONFIG_KEY, DilatedConfig.default(spec["n"] // 4, spec["n"]).to_dict())
    torch.manual_seed(0)
    model = LlamaForCausalLM._from_config(config, attn_implementation="dilated_ring")
    if spec["grid"] != "replicated":
        apply_fsdp2(model, mesh, shard=spec["grid"][len("fsdp_"):])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, config.vocab_size, (1, spec["n"]), generator=torch.Generator().manual_seed(rank // spec["sp"]))
    batch = hd.shard_batch(ids, labels=ids)

    def step():
        loss = hd.reduce_loss(model(**batch).loss)
        loss.backward()
        if spec["grid"] == "replicated":  # what DDP does: average the gradients over every rank
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        optimizer.step()

    step()  # AdamW creates its state on the first step
    held = {"parameters": _local_bytes(model.parameters()), "gradients": _local_bytes(p.grad for p in model.parameters()),
            "optimizer": _local_bytes(v for s in optimizer.state.values() for v in s.values()
                                      if isinstance(v, torch.Tensor) and v.dim() > 0)}
    optimizer.zero_grad(set_to_none=True)
    passes = {"step": {}}
    dist.barrier()
    measure.measure_memory({"step": step}, passes, torch.device("cpu"), own_process)
    dist.barrier()
    params = sum(p.numel() for p in model.parameters()) if spec["grid"] == "replicated" else None
    dist.destroy_process_group()
    return {"spec": spec, "held_bytes": held, "passes": passes, "params": params}


def run_section(s, runner, report) -> dict:
    from .distributed import _free_port

    model_config = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                        num_key_value_heads=4, vocab_size=8192)
    rows = []
    for grid in GRIDS:
        spec = dict(kind="fsdp", grid=grid, sp=s["fsdp_sp"], n=s["fsdp_length"], model_config=model_config,
                    port=_free_port(), timeout_s=s["case_timeout"], threads=1)
        ranks = runner.run_group(spec, s["case_timeout"], s["fsdp_processes"])
        errors = [r.get("error") for r in ranks if r.get("error")]
        if errors:
            rows.append({"grid": grid, "error": errors[0]})
        else:
            rows.append({"grid": grid, **{k: max(r["held_bytes"][k] for r in ranks) for k in ranks[0]["held_bytes"]},
                         "peak_bytes": max(r["passes"]["step"].get("peak_extra_bytes", 0) for r in ranks)})
        say(f"  fsdp {grid:>11}: " + (rows[-1].get("error") or ", ".join(
            f"{k} {mib(rows[-1][k])} MiB" for k in ("parameters", "gradients", "optimizer", "peak_bytes"))))
    return {"rows": rows, "model_config": model_config}


def markdown_section(section, s) -> list[str]:
    mc = section["model_config"]
    L = ["## FSDP2 x sequence parallelism: what a rank holds\n",
         f"One training step (forward, backward, AdamW) of a tiny Llama ({mc['num_hidden_layers']} layers, hidden "
         f"{mc['hidden_size']}, vocabulary {mc['vocab_size']}), `dilated_ring`, {s['fsdp_length']} tokens per row, "
         f"{s['fsdp_processes']} gloo processes in SP groups of {s['fsdp_sp']}. Worst rank. Parameters, gradients "
         "and optimizer state: the local shards' bytes, MiB; step peak: resident memory above the process's before "
         "the step, MiB.\n",
         "| grid | parameters | gradients | optimizer state | step peak |", "|---|---:|---:|---:|---:|"]
    for r in section["rows"]:
        if "error" in r:
            L.append(f"| {r['grid']} | {r['error']} | - | - | - |")
            continue
        L.append(f"| {r['grid']} | {mib(r['parameters'])} | {mib(r['gradients'])} | {mib(r['optimizer'])} | "
                 f"{mib(r['peak_bytes'])} |")
    return L + [""]
