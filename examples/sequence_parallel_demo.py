"""Sequence parallelism with Accelerate: a tiny Llama trained a few steps on a DP x SP grid.

    accelerate launch --multi_gpu --num_processes 4 examples/sequence_parallel_demo.py --sp 2
    python examples/sequence_parallel_demo.py              # the same training on one process

The script always runs on CPU with gloo (Accelerator(cpu=True)); `--multi_gpu` only selects
Accelerate's torchrun launcher, which starts the 4 processes. (`accelerate launch --cpu
--num_processes 4` starts a single process unless Accelerate is configured to use mpirun:
accelerate 1.x launches multi-CPU jobs through MPI only. The script says so and stops.)

Every step trains on the same global batch (`--rows` sequences of `--seq-len` generated tokens).
With P processes and --sp S there are P/S data-parallel replicas; replica d takes rows d, d+P/S, ...
and its S ranks split each row (`shard_batch`: labels shifted first, global positions, zigzag).
Accelerate wraps the model in DDP over all P processes, which averages gradients; `reduce_loss`
compensates for the S ranks of a replica holding one loss between them. The printed losses and
the trained weights (--out) match the single-process run up to rounding.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sp", type=int, default=1, help="sequence-parallel group size (divides the process count)")
    p.add_argument("--attn", default="dilated_ring", choices=["ring", "dilated_ring", "block_sparse_ring"])
    p.add_argument("--layout", default="zigzag", choices=["zigzag", "contiguous"])
    p.add_argument("--seq-len", type=int, default=61, help="global sequence length (need not divide evenly)")
    p.add_argument("--rows", type=int, default=2, help="sequences per global batch (a multiple of the replicas)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--lr", type=float, default=0.5)
    p.add_argument("--timeout", type=float, default=60.0, help="seconds before a hung peer becomes an error")
    p.add_argument("--out", default=None, help="write losses to OUT.json and weights to OUT.safetensors (rank 0)")
    args = p.parse_args(argv)
    if args.sp == 1 and args.layout != p.get_default("layout"):  # no group: it was ignored
        raise SystemExit(f"--layout {args.layout} splits a row over a sequence-parallel group, which --sp 1 does not form")
    return args


def build_model(attn: str):
    import hf_dilated  # noqa: F401  (registers the attention names)
    from transformers import AutoModelForCausalLM, LlamaConfig

    from hf_dilated.model_configs import load_preset

    spec = dict(load_preset("tiny-llama")["model_config"])
    spec.pop("model_type")
    config = LlamaConfig(**spec, use_cache=False)
    config.hf_dilated = {"segment_lengths": [8, 16, 64], "dilation_rates": [1, 2, 4], "block_size": 4,
                         "pattern": {"type": "global_local", "global_blocks": 1, "window": 3}}
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn)


def global_batch(step: int, rows: int, seq_len: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(3, 256, (rows, seq_len), generator=g)


def main(argv=None):
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    import hf_dilated.distributed as hd

    args = parse_args(argv)
    timeout = datetime.timedelta(seconds=args.timeout)
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1  # by accelerate launch / torchrun
    handlers = [InitProcessGroupKwargs(backend="gloo", timeout=timeout)] if launched else []
    accelerator = Accelerator(cpu=True, kwargs_handlers=handlers)
    world = accelerator.num_processes
    if world == 1 and args.sp > 1 and os.environ.get("ACCELERATE_USE_CPU", "").lower() == "true":
        raise SystemExit(
            f"--sp {args.sp} needs several processes, but `accelerate launch --cpu` started one: without an "
            "mpirun configuration Accelerate runs CPU jobs as a single process. Launch with "
            "`accelerate launch --multi_gpu --num_processes N examples/sequence_parallel_demo.py ...` "
            "(torchrun; this script stays on CPU/gloo) or with `torchrun --standalone --nproc-per-node N ...`.")
    if world % args.sp:
        raise SystemExit(f"--sp {args.sp} must divide the number of processes ({world})")
    if args.sp > 1:
        sp = hd.setup_sequence_parallel(args.sp, layout=args.layout, timeout=timeout)
        dp_size, dp_rank = sp.dp_size, sp.dp_rank
    else:
        dp_size, dp_rank = world, accelerator.process_index
    if args.rows % dp_size:
        raise SystemExit(f"--rows {args.rows} must be a multiple of the data-parallel replicas ({dp_size})")

    model = build_model(args.attn)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    model, optimizer = accelerator.prepare(model, optimizer)
    model.train()
    losses = []
    for step in range(args.steps):
        rows = global_batch(step, args.rows, args.seq_len)[dp_rank::dp_size]
        batch = hd.shard_batch(rows, labels=rows)  # no group set: the whole rows, labels shifted
        out = model(**batch)
        loss = hd.reduce_loss(out.loss)  # this replica's loss; gradient scaled for DDP's average
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        # Mean over the replicas: the loss of the global batch (rows have equal token counts).
        logged = accelerator.reduce(loss.detach(), reduction="sum") / world
        losses.append(logged.item())
        accelerator.print(f"step {step}: loss {logged.item():.6f}  (processes={world}, dp={dp_size} x sp={args.sp}, "
                          f"attn={args.attn})")
    sent = hd.bytes_sent()
    accelerator.print(f"bytes sent by rank 0 per kernel: {sent}")
    if args.out and accelerator.is_main_process:
        from safetensors.torch import save_file

        with open(args.out + ".json", "w") as f:
            json.dump({"losses": losses, "processes": world, "sp": args.sp, "attn": args.attn}, f)
        state = accelerator.unwrap_model(model).state_dict()
        save_file({k: v.contiguous() for k, v in state.items()}, args.out + ".safetensors")
    accelerator.wait_for_everyone()
    return launched


if __name__ == "__main__":
    if main():
        # Every rank has passed the last barrier and written what it writes: leave without tearing
        # the gloo groups down. Both ways of tearing them down fail now and then: destroy_process_group()
        # over the DP x SP subgroups hung once in a CI-like run (pytorch/pytorch#75097), and the
        # interpreter's own exit, which leaves them to their destructors, aborted a rank once in CI
        # ("terminate called without an active exception": gloo's worker threads racing the
        # interpreter's teardown, pytorch/pytorch#190489). Ending the process releases them.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
