"""Long-context fine-tuning with Accelerate: LoRA (LongLoRA-style) or full fine-tuning of a
checkpoint converted by `hf-dilated convert`, on one process or under `accelerate launch` with
data parallel x sequence parallel.

    # one process
    python examples/finetune_long_context.py --model ckpt-8k --attn dilated_ring --seq-len 8192 \
        --data passkey --max-steps 200 --output-dir runs/ft
    # 2 data-parallel replicas x 2 sequence-parallel ranks
    accelerate launch --config_file examples/accelerate_configs/gpu_dp2_sp2.yaml \
        examples/finetune_long_context.py --model ckpt-8k --attn dilated_ring --sp-size 2 ...
    # the same grid with FSDP2: weights, gradients and optimizer state sharded over all 4 ranks
    accelerate launch --config_file examples/accelerate_configs/gpu_fsdp_dp2_sp2.yaml \
        examples/finetune_long_context.py --model ckpt-8k --attn dilated_ring --sp-size 2 --fsdp ...

Data: `--data passkey` generates passkey-retrieval rows locally; any other value is a list of
local text / JSON-lines files or directories, tokenized and packed to --seq-len with document
boundaries kept (see data.py).

Output directory:
    checkpoints/step-NNNNNN/   trainable.safetensors, optimizer.safetensors, trainer_state.json
                               (--fsdp: sharded/, every rank's shards (torch.distributed.checkpoint),
                               and trainer_state.json; resume with the same --fsdp). A resume takes the
                               run's --sp-size and data-parallel size (each step's rows depend on it):
                               the same process count
    adapter/                   the LoRA adapter (peft format; LoRA runs only)
    model/                     the full checkpoint (LoRA merged in) with the tokenizer; loads with
                               AutoModelForCausalLM.from_pretrained(path, attn_implementation=...)
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from data import AlternatingDataset, CopySpanDataset, PackedTextDataset, PasskeyDataset, find_text_files  # noqa: E402
from passkey import IGNORE_INDEX  # noqa: E402

ATTENTION_CHOICES = ("dilated_ring", "ring", "block_sparse_ring", "sdpa", "dilated", "block_sparse")
CHECKPOINT_DIR = "checkpoints"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="checkpoint directory (e.g. the output of `hf-dilated convert`)")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--attn", choices=ATTENTION_CHOICES, default="dilated_ring",
                   help="attention implementation (sdpa: dense, for comparison; single-process only)")
    p.add_argument("--seq-len", type=int, required=True, help="tokens per training row")
    p.add_argument("--data", nargs="+", default=["passkey"],
                   help="'passkey' (generated), local text / JSON-lines files and directories, or both "
                        "(rows alternate: one text row, then --passkey-ratio passkey rows)")
    p.add_argument("--text-field", default="text", help="field holding the text in JSON-lines files")
    p.add_argument("--num-rows", type=int, default=100_000, help="passkey rows to draw from (generated lazily)")
    p.add_argument("--passkey-ratio", type=int, default=1,
                   help="with text files and passkey data: passkey rows per text row")
    p.add_argument("--passkey-min-doc-len", type=int, default=None,
                   help="shortest passkey document packed into a row (default: the shortest possible)")
    p.add_argument("--passkey-max-doc-len", type=int, default=None,
                   help="longest passkey document packed into a row (default: --seq-len)")
    p.add_argument("--passkey-recalls", type=int, default=0,
                   help="passkey: also ask and answer the question this many times mid-text per document, "
                        "at random distances from the key (more answers to learn from per row)")
    p.add_argument("--copy-rows", action="store_true",
                   help="with text files and passkey data: every other passkey row becomes a copy row, a window of "
                        "the text files in which a span is written again 1/4..3/4 of --seq-len later, only the "
                        "repeat labelled (data.CopySpanDataset): long-range copying with tens of labels per row")
    p.add_argument("--passkey-keys", type=int, default=1,
                   help="passkey: up to this many keys per document (1-4), each in its own brackets and asked for "
                        "at the end, so one document gives several long-range answers to learn from")
    p.add_argument("--loss-mean", choices=("token", "row"), default="token",
                   help="token: the mean over all labelled tokens of a step's micro-batches on each replica (as "
                        "transformers' Trainer, which also averages the count over replicas); row: each "
                        "row's own mean, averaged over rows, so that rows with few labels (passkey answers) "
                        "weigh as much as fully labelled text rows in a text+passkey mixture")
    p.add_argument("--passkey-learn-all", action="store_true",
                   help="passkey: language-model loss on every token, not only on the key digits")
    p.add_argument("--max-rows", type=int, default=None, help="use at most this many packed text rows")
    # What is trained.
    p.add_argument("--full-finetune", action="store_true", help="train every weight instead of LoRA")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--lora-alpha", type=int, default=32)
    p.add_argument("--lora-dropout", type=float, default=0.0)
    p.add_argument("--no-train-embeddings-norms", action="store_true",
                   help="plain LoRA: do not also train the embeddings and norms (LongLoRA trains them)")
    # Optimisation.
    p.add_argument("--max-steps", type=int, required=True, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=1, help="rows per data-parallel replica per micro-step")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-steps per optimizer step")
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine schedule floor, as a fraction of --lr")
    p.add_argument("--warmup-steps", type=int, default=10)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--mixed-precision", choices=("auto", "no", "bf16", "fp16"), default="auto",
                   help="auto: bf16 on a GPU that has it, else float32")
    p.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--cpu", action="store_true", help="train on CPU even when a GPU is present")
    p.add_argument("--sp-size", type=int, default=1, help="sequence-parallel group size (divides the process count)")
    p.add_argument("--sp-layout", choices=("zigzag", "contiguous"), default="zigzag")
    p.add_argument("--fsdp", action="store_true",
                   help="shard weights, gradients and optimizer state with FSDP2 (fully_shard per decoder layer) "
                        "instead of replicating them (DDP); needs several processes (accelerate launch)")
    p.add_argument("--fsdp-shard", choices=("dp_sp", "dp"), default=None,
                   help="with --fsdp: shard over every process (dp_sp, the default: the SP ranks hold the same "
                        "weights, so they can share them out) or over the data-parallel replicas only, each SP group "
                        "keeping a copy (dp: less communication, more memory)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds a process waits on the others (a collective, a barrier) before that becomes an error; "
                        "without it a stopped rank leaves the others blocked forever")
    # Checkpoints.
    p.add_argument("--save-every", type=int, default=0, help="save a resumable checkpoint every N steps (0: only at the end)")
    p.add_argument("--keep-checkpoints", type=int, default=2, help="resumable checkpoints kept (oldest removed)")
    p.add_argument("--stop-after-steps", type=int, default=None,
                   help="end this run after N more steps (a checkpoint is saved), e.g. to fit a time slot; "
                        "--resume auto continues with the same schedule")
    p.add_argument("--resume", default=None, help="'auto' (latest in --output-dir) or a checkpoint directory")
    p.add_argument("--no-final-model", action="store_true", help="skip writing adapter/ and model/ at the end")
    p.add_argument("--log-file", default=None, help="append one JSON line per step (loss, lr, tokens/s)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (logs only)")
    return p


def parse_args(argv=None):
    args = build_parser().parse_args(argv)
    for name in ("seq_len", "max_steps", "batch_size", "grad_accum", "sp_size", "lora_rank", "num_rows", "passkey_ratio"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.copy_rows and not ("passkey" in args.data and len(args.data) > 1):
        raise SystemExit("--copy-rows replaces half the passkey rows of a text+passkey mixture: give --data passkey and text files")
    if args.passkey_ratio != 1 and not ("passkey" in args.data and len(args.data) > 1):
        raise SystemExit("--passkey-ratio mixes text and passkey rows: give --data passkey and text files")
    for name, ok, rule in (("keep_checkpoints", args.keep_checkpoints >= 1, ">= 1"),  # (0 deleted every one saved)
                           ("save_every", args.save_every >= 0, ">= 0"),
                           ("warmup_steps", args.warmup_steps >= 0, ">= 0"),
                           ("lr", args.lr > 0, "> 0"),
                           ("min_lr_ratio", 0 <= args.min_lr_ratio <= 1, "in [0, 1]"),
                           ("lora_alpha", args.lora_alpha >= 1, ">= 1"),
                           ("lora_dropout", 0 <= args.lora_dropout < 1, "in [0, 1)"),
                           ("weight_decay", args.weight_decay >= 0, ">= 0"),
                           ("max_grad_norm", args.max_grad_norm > 0, "> 0")):
        if not ok:
            raise SystemExit(f"--{name.replace('_', '-')} must be {rule}, got {getattr(args, name)}")
    parser = build_parser()
    # Options of a kind of data that is not read (they were ignored)
    passkey, text = "passkey" in args.data, any(d != "passkey" for d in args.data)
    for names, used, kind in ((("num_rows", "passkey_min_doc_len", "passkey_max_doc_len", "passkey_recalls",
                                "passkey_keys", "passkey_learn_all"), passkey, "passkey rows (--data passkey)"),
                              (("text_field", "max_rows"), text, "text files (--data FILE ...)")):
        given = [f"--{n.replace('_', '-')}" for n in names if getattr(args, n) != parser.get_default(n)]
        if given and not used:
            raise SystemExit(f"{', '.join(given)} shape{'s' if len(given) == 1 else ''} {kind}, which --data does "
                             "not read")
    if args.full_finetune:  # LoRA's options: given with it, they were ignored
        given = [f"--{name.replace('_', '-')}" for name in ("lora_rank", "lora_alpha", "lora_dropout",
                                                             "no_train_embeddings_norms")
                 if getattr(args, name) != parser.get_default(name)]
        if given:
            raise SystemExit(f"{', '.join(given)} configure LoRA, which --full-finetune does not use")
    if args.sp_size == 1 and args.sp_layout != parser.get_default("sp_layout"):  # no group: it was ignored
        raise SystemExit(f"--sp-layout {args.sp_layout} splits a row over a sequence-parallel group, which --sp-size 1 "
                         "does not form")
    if args.timeout <= 0:
        raise SystemExit(f"--timeout must be > 0 seconds, got {args.timeout}")
    if args.stop_after_steps is not None and args.stop_after_steps < 1:
        raise SystemExit(f"--stop-after-steps must be >= 1, got {args.stop_after_steps}")
    if args.fsdp_shard is not None and not args.fsdp:
        raise SystemExit("--fsdp-shard says how --fsdp shards: give --fsdp too")
    if args.fsdp:
        args.fsdp_shard = args.fsdp_shard or "dp_sp"
        if args.mixed_precision == "fp16":
            raise SystemExit("--fsdp --mixed-precision fp16 is not supported (it needs loss scaling); use bf16")
    if args.attn in ("sdpa", "dilated", "block_sparse") and args.sp_size > 1:
        raise SystemExit(f"--attn {args.attn} computes on one process; with --sp-size > 1 use dilated_ring, ring "
                         "or block_sparse_ring")
    if "passkey" in args.data:
        from hf_dilated.eval.passkey import min_length

        least = max(min_length(), args.passkey_min_doc_len or 0)
        if args.seq_len < least:
            raise SystemExit(f"--seq-len {args.seq_len} is shorter than a passkey row ({least} tokens at least, "
                             "--passkey-min-doc-len)")
        from hf_dilated.eval.passkey import BRACKETS

        if not 1 <= args.passkey_keys <= len(BRACKETS):  # (0 and below acted as 1; 5 raised in the data loader)
            raise SystemExit(f"--passkey-keys must be in 1..{len(BRACKETS)}, got {args.passkey_keys}")
    check_output_dir(args)
    return args


def check_output_dir(args) -> None:
    """What the run writes under --output-dir (model/, adapter/, checkpoints/, model.tmp/) must not be,
    or hold, the --model it reads: the final save replaced that directory (a run continuing from a
    fine-tuned model/ into the same --output-dir rewrote its source). And a fresh run must not land
    on an earlier run's checkpoints, which it pruned and --resume auto then took for its own."""
    out, source = Path(args.output_dir).resolve(), Path(args.model).resolve()
    for name in ("model", "model.tmp", "adapter", CHECKPOINT_DIR):
        written = out / name
        if source == written or written in source.parents:
            raise SystemExit(f"--output-dir {args.output_dir}: the run writes {written}, which holds --model "
                             f"{args.model}; choose another --output-dir")
    earlier = sorted(Path(args.output_dir, CHECKPOINT_DIR).glob("step-[0-9]*[0-9]"))
    if earlier and args.resume is None:
        raise SystemExit(f"--output-dir {args.output_dir} holds an earlier run's checkpoints ({earlier[-1].name}): "
                         "continue it with --resume auto, or choose a new --output-dir")


# --- model --------------------------------------------------------------------------------------


def load_model(args, dtype):
    import hf_dilated  # noqa: F401  (registers the attention names)
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_dilated.integrations.transformers import converted_context

    config = AutoConfig.from_pretrained(args.model)
    # The context the checkpoint was converted to, whatever the attention fine-tunes it: under sdpa
    # too, training at it teaches the positions beyond what the RoPE covered.
    limit = converted_context(config)
    if limit is not None and args.seq_len > limit:
        raise SystemExit(f"--seq-len {args.seq_len} exceeds the checkpoint's context ({limit}); extend it first: "
                         f"hf-dilated convert {args.model} NEW_DIR --context {args.seq_len}")
    model = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation=args.attn, dtype=dtype)
    model.config.use_cache = False
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if args.full_finetune:
        return model
    from peft import get_peft_model

    lora = hf_dilated.lora_config(model, r=args.lora_rank, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                                  long_context=not args.no_train_embeddings_norms)
    return get_peft_model(model, lora)


def trainable_parameters(model) -> dict[str, torch.nn.Parameter]:
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


# --- data ---------------------------------------------------------------------------------------


def build_dataset(args, tokenizer):
    files = [d for d in args.data if d != "passkey"]
    passkey = None
    if "passkey" in args.data:
        passkey = PasskeyDataset(tokenizer, args.seq_len, args.num_rows, min_doc_len=args.passkey_min_doc_len,
                                 max_doc_len=args.passkey_max_doc_len, seed=args.seed, recalls=args.passkey_recalls, learn_all=args.passkey_learn_all,
                                 keys=args.passkey_keys)
        if not files:
            return passkey
    text = PackedTextDataset(tokenizer, find_text_files(files), args.seq_len, text_field=args.text_field,
                             max_rows=args.max_rows, cache_dir=os.path.join(args.output_dir, "datasets_cache"))
    if passkey is not None and args.copy_rows:
        copies = CopySpanDataset(tokenizer, [f for f in find_text_files(files) if not f.endswith((".json", ".jsonl"))],
                                 args.seq_len, args.num_rows, seed=args.seed)
        passkey = AlternatingDataset(passkey, copies)
    return text if passkey is None else AlternatingDataset(text, passkey, second_rows=args.passkey_ratio)


def rows_for(dataset, step: int, micro: int, args, dp_rank: int, dp_size: int, generator_seed: int):
    """The rows one data-parallel replica trains on at (step, micro-step): a function of those
    numbers alone, so a resumed run sees exactly the data an uninterrupted one would have (with the
    same dp_size, which sets the global batch and where each step starts: check_resumed_dp_size)."""
    start = (step * args.grad_accum + micro) * dp_size * args.batch_size + dp_rank * args.batch_size
    epoch_len = len(dataset)
    rows = []
    for i in range(start, start + args.batch_size):
        epoch, offset = divmod(i, epoch_len)
        order = torch.randperm(epoch_len, generator=torch.Generator().manual_seed(generator_seed + epoch))
        index = int(order[offset])
        rows.append(dataset.row(index, epoch) if hasattr(dataset, "row") else dataset[index])
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


# --- checkpoints (all tensors as safetensors) ---------------------------------------------------


def save_checkpoint(path: Path, model, optimizer, scheduler, step: int, args, dp_size: int):
    """Writes into a temporary directory and renames it into place: never a half-written checkpoint."""
    from safetensors.torch import save_file

    params = trainable_parameters(model)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({n: p.detach().contiguous().cpu() for n, p in params.items()}, str(tmp / "trainable.safetensors"))
    state = optimizer.state_dict()
    tensors = {}
    for index, entry in state["state"].items():
        for key, value in entry.items():
            value = value if torch.is_tensor(value) else torch.tensor(value)
            tensors[f"state.{index}.{key}"] = value.detach().contiguous().cpu()
    metadata = {"param_groups": json.dumps(state["param_groups"]), "param_names": json.dumps(list(params))}
    save_file(tensors, str(tmp / "optimizer.safetensors"), metadata=metadata)
    trainer_state = {"step": step, "scheduler": scheduler.state_dict(), "args": vars(args), "dp_size": dp_size}
    (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=2, default=str) + "\n")
    if path.exists():
        shutil.rmtree(path)
    os.replace(tmp, path)


def load_checkpoint(path: Path, model, optimizer, scheduler) -> int:
    """Restores trainable weights, optimizer and schedule; returns the step to continue from."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    params = trainable_parameters(model)
    if not (path / "trainable.safetensors").is_file():
        raise SystemExit(f"--resume {path}: an --fsdp checkpoint (no trainable.safetensors); resume it with --fsdp")
    saved = load_file(str(path / "trainable.safetensors"))
    if set(saved) != set(params):
        missing, extra = sorted(set(params) - set(saved)), sorted(set(saved) - set(params))
        raise SystemExit(f"--resume {path}: the checkpoint does not match this model's trainable weights "
                         f"(missing {missing[:3]}, unexpected {extra[:3]}); resume with the same LoRA/full settings")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(saved[name])
    with safe_open(str(path / "optimizer.safetensors"), framework="pt") as f:
        metadata = f.metadata()
        state = {}
        for key in f.keys():
            _, index, name = key.split(".", 2)
            state.setdefault(int(index), {})[name] = f.get_tensor(key)
    if json.loads(metadata["param_names"]) != list(params):
        raise SystemExit(f"--resume {path}: trainable parameters differ in order or name from the checkpoint's")
    optimizer.load_state_dict({"state": state, "param_groups": json.loads(metadata["param_groups"])})
    trainer_state = json.loads((path / "trainer_state.json").read_text())
    scheduler.load_state_dict(trainer_state["scheduler"])
    return int(trainer_state["step"])


SHARDED_DIR = "sharded"  # --fsdp checkpoints: torch.distributed.checkpoint's files, every rank's shards


def save_sharded_checkpoint(path: Path, run, step: int) -> None:
    """--fsdp: every rank writes its shards into a temporary directory, the main process adds
    trainer_state.json and renames it into place (never a half-written checkpoint)."""
    from hf_dilated.distributed import save_sharded_state

    tmp = path.with_name(path.name + ".tmp")
    if run.accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    run.accelerator.wait_for_everyone()
    save_sharded_state(tmp / SHARDED_DIR, run.model, run.optimizer)
    run.accelerator.wait_for_everyone()
    if run.accelerator.is_main_process:
        trainer_state = {"step": step, "scheduler": run.scheduler.state_dict(), "args": vars(run.args),
                         "dp_size": run.dp_size}
        (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=2, default=str) + "\n")
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)


def load_sharded_checkpoint(path: Path, model, optimizer, scheduler) -> int:
    """--fsdp: restores the sharded weights and optimizer state (resharded to this run's
    processes) and the schedule; returns the step to continue from."""
    from hf_dilated.distributed import load_sharded_state

    if not (path / SHARDED_DIR / ".metadata").is_file():
        raise SystemExit(f"--resume {path}: not an --fsdp checkpoint (no {SHARDED_DIR}/); resume it without --fsdp")
    load_sharded_state(path / SHARDED_DIR, model, optimizer)
    trainer_state = json.loads((path / "trainer_state.json").read_text())
    scheduler.load_state_dict(trainer_state["scheduler"])
    return int(trainer_state["step"])


# Options a resumed run may change: where and how often it saves and logs, how long it runs now.
# Any other defines the run (its data, schedule, model and loss), and the checkpoint's optimizer and
# schedule state replaced a changed value without a word.
RESUME_MAY_CHANGE = {"resume", "output_dir", "save_every", "keep_checkpoints", "stop_after_steps", "log_file",
                     "no_progress", "no_final_model", "timeout", "gradient_checkpointing", "cpu", "mixed_precision"}


def _comparable(name: str, value):
    """An option's value as a resumed run compares it: paths resolved (`ckpt`, `./ckpt` and its absolute
    path are one model), the rest as saved in trainer_state.json."""
    if name in ("model", "data") and value is not None:
        return [str(Path(v).resolve()) if Path(v).exists() else v for v in value] if isinstance(value, list) \
            else str(Path(value).resolve())
    return value


def check_resumed_options(path: Path, args) -> None:
    saved = json.loads((path / "trainer_state.json").read_text()).get("args", {})
    now = json.loads(json.dumps(vars(args), default=str))
    parser = build_parser()
    defaults = json.loads(json.dumps({n: parser.get_default(n) for n in now}, default=str))
    saved = {**defaults, **saved}  # (an option added since the run started: its default)
    changed = sorted(name for name in now if name not in RESUME_MAY_CHANGE
                     and _comparable(name, saved.get(name)) != _comparable(name, now.get(name)))
    if changed:
        listed = ", ".join(f"--{n.replace('_', '-')} {saved.get(n)!r} -> {now.get(n)!r}" for n in changed[:6])
        raise SystemExit(f"--resume {path}: the run was started with other options ({listed}); resume it with "
                         "the same ones (or train anew from its model in another --output-dir)")


def check_resumed_dp_size(path: Path, dp_size: int, sp_size: int) -> None:
    """The data-parallel size is no option but the process count over --sp-size: a run resumed on
    another one changed its global batch and skipped or repeated rows (rows_for) without a word. An
    --fsdp checkpoint's shards would load on another process count; its data schedule would not.
    (A checkpoint saved before dp_size was recorded: not checked.)"""
    saved = json.loads((path / "trainer_state.json").read_text()).get("dp_size")
    if saved is not None and saved != dp_size:
        processes = saved * sp_size
        raise SystemExit(f"--resume {path}: the run was trained with dp_size {saved} (data-parallel replicas: processes "
                         f"/ --sp-size), this one has dp_size {dp_size}; each step's global batch and rows depend on it: "
                         f"resume on {processes} process{'es' if processes > 1 else ''} (or train anew from its model "
                         "in another --output-dir)")


def find_resume(args) -> Path | None:
    if args.resume is None:
        return None
    if args.resume != "auto":
        path = Path(args.resume)
        if not (path / "trainer_state.json").is_file():
            raise SystemExit(f"--resume {path}: not a checkpoint directory (no trainer_state.json)")
        return path
    found = sorted(Path(args.output_dir, CHECKPOINT_DIR).glob("step-[0-9]*[0-9]"))
    found = [p for p in found if (p / "trainer_state.json").is_file()]
    return found[-1] if found else None


def prune_checkpoints(args):
    found = sorted(Path(args.output_dir, CHECKPOINT_DIR).glob("step-[0-9]*[0-9]"))
    for old in found[: max(0, len(found) - args.keep_checkpoints)]:
        shutil.rmtree(old)


def save_final(model, tokenizer, args, accelerator):
    """adapter/ (LoRA) and model/: the full checkpoint, LoRA merged, loadable with from_pretrained."""
    model = accelerator.unwrap_model(model)
    out = Path(args.output_dir)
    if not args.full_finetune:
        model.save_pretrained(out / "adapter")
        model = model.merge_and_unload()
    if args.gradient_checkpointing:
        model.gradient_checkpointing_disable()
    model.config.use_cache = True
    tmp = out / "model.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(out / "model", ignore_errors=True)
    os.replace(tmp, out / "model")


# --- training -----------------------------------------------------------------------------------


def mixed_precision(choice: str) -> str:
    if choice != "auto":
        return choice
    return "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"


def token_loss_sum(logits, labels, row_counts=None):
    """Sum of next-token cross-entropies over labelled positions (labels already shifted). With
    row_counts (each row's number of labels in the whole, unsharded batch) every row's sum is
    divided by its count first, so the rows weigh the same whatever their number of labels."""
    if row_counts is None:
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
    losses = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="none")
    return (losses.view(labels.shape).sum(1) / row_counts.clamp(min=1)).sum()


@dataclass
class Run:
    """What the training loop works with, built by `setup`: the Accelerator, the parallel groups,
    the model, optimizer and schedule (prepared by Accelerate), and the step to start from."""
    args: argparse.Namespace
    accelerator: Any
    sp: Any  # the sequence-parallel groups (hf_dilated.distributed), None without --sp-size
    dp_size: int
    dp_rank: int
    tokenizer: Any
    model: Any
    optimizer: Any
    scheduler: Any
    dataset: Any
    start_step: int = 0

    @property
    def world(self) -> int:
        return self.accelerator.num_processes

    @property
    def rank(self) -> int:
        return self.accelerator.process_index


def make_accelerator(args):
    """Processes started by accelerate launch / torchrun join one gloo (CPU) or NCCL group whose
    collectives fail after --timeout seconds instead of waiting forever on a stopped rank."""
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    # Without CUDA, cpu=True makes processes started by torchrun (accelerate's multi-GPU launcher)
    # join one gloo group instead of each running alone.
    cpu = args.cpu or not torch.cuda.is_available()
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1  # by accelerate launch / torchrun
    timeout = datetime.timedelta(seconds=args.timeout)
    handlers = [InitProcessGroupKwargs(backend="gloo" if cpu else "nccl", timeout=timeout)] if launched else []
    # --fsdp: FSDP2's MixedPrecisionPolicy casts (fsdp_mixed_precision); Accelerate never wraps the
    # model, so it must not autocast either.
    precision = "no" if args.fsdp else mixed_precision(args.mixed_precision)
    return Accelerator(cpu=cpu, gradient_accumulation_steps=args.grad_accum, kwargs_handlers=handlers,
                       mixed_precision=precision)


def fsdp_mixed_precision(args):
    """--fsdp with bf16 (--mixed-precision bf16, or auto on a GPU that has it): bf16 compute and
    all-gathers, float32 gradient reduction and float32 sharded weights for the optimizer."""
    if mixed_precision(args.mixed_precision) != "bf16":
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def check_world_size(args, world: int):
    if world % args.sp_size:
        hint = ""
        if world == 1 and os.environ.get("ACCELERATE_USE_CPU", "").lower() == "true":
            hint = (": `accelerate launch --cpu` starts a single process unless mpirun is configured; use "
                    "--config_file examples/accelerate_configs/cpu_2proc.yaml (torchrun) instead")
        raise SystemExit(f"--sp-size {args.sp_size} must divide the number of processes ({world}){hint}")


def parallel_groups(args, accelerator):
    """(sp, dp_size, dp_rank, mesh): the sequence-parallel groups of --sp-size processes (None for
    1), this process's data-parallel replica among dp_size, and with --fsdp the (dp_shard, sp)
    DeviceMesh FSDP2 shards over (its "sp" dimension is the SP group), else None.

    The mesh is torch's init_device_mesh, not Accelerate's ParallelismConfig: there sp_size means
    DeepSpeed's Ulysses (no mesh is built for it) and cp_size makes Accelerator.prepare attach
    torch context-parallel hooks that drop the attention mask of every self_attn module."""
    world, rank = accelerator.num_processes, accelerator.process_index
    check_world_size(args, world)
    timeout = datetime.timedelta(seconds=args.timeout)
    mesh = None
    if args.fsdp:
        if world == 1:
            raise SystemExit("--fsdp shards over several processes: start them with accelerate launch, e.g. "
                             "--config_file examples/accelerate_configs/cpu_4proc_fsdp.yaml")
        from hf_dilated.distributed import build_mesh

        mesh = build_mesh(args.sp_size, timeout=timeout)  # its groups fail after --timeout too
    if args.sp_size == 1:
        return None, world, rank, mesh
    from hf_dilated.distributed import setup_sequence_parallel, setup_sequence_parallel_from_mesh

    if mesh is not None:
        sp = setup_sequence_parallel_from_mesh(mesh, layout=args.sp_layout, timeout=timeout)
    else:
        sp = setup_sequence_parallel(args.sp_size, layout=args.sp_layout, timeout=timeout)
    return sp, sp.dp_size, sp.dp_rank, mesh


def build_optimizer(args, model):
    """AdamW over the trainable weights and its cosine schedule (warmup, floor at --min-lr-ratio)."""
    from transformers import get_cosine_with_min_lr_schedule_with_warmup

    params = list(trainable_parameters(model).values())
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.95))
    scheduler = get_cosine_with_min_lr_schedule_with_warmup(
        optimizer, num_warmup_steps=min(args.warmup_steps, args.max_steps), num_training_steps=args.max_steps,
        min_lr_rate=args.min_lr_ratio)
    return optimizer, scheduler


def setup(args, dataset=None) -> Run:
    """The run, resumed from --resume's checkpoint if there is one; dataset: see `train`."""
    from transformers import AutoTokenizer

    accelerator = make_accelerator(args)
    sp, dp_size, dp_rank, mesh = parallel_groups(args, accelerator)
    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    dtype = torch.bfloat16 if (not args.full_finetune and accelerator.mixed_precision == "bf16") else torch.float32
    model = load_model(args, dtype)
    if mesh is not None:  # --fsdp: sharded before the optimizer is built (its parameters become DTensors)
        from hf_dilated.distributed import apply_fsdp2

        apply_fsdp2(model, mesh, shard=args.fsdp_shard, mp_policy=fsdp_mixed_precision(args),
                    timeout=datetime.timedelta(seconds=args.timeout))
    if dataset is None:
        dataset = build_dataset(args, tokenizer)
    optimizer, scheduler = build_optimizer(args, model)
    run = Run(args, accelerator, sp, dp_size, dp_rank, tokenizer, model, optimizer, scheduler, dataset)
    run.start_step = resume(run)
    # The scheduler is stepped by hand once per optimizer step (a prepared one would step once per process).
    if mesh is not None:
        # FSDP2 reduces the gradients itself: Accelerate only gets the optimizer (it steps on the
        # last micro-step of --grad-accum), never the model (it would wrap it in DDP).
        run.optimizer = accelerator.prepare(optimizer)
    else:
        run.model, run.optimizer = accelerator.prepare(model, optimizer)
    run.model.train()
    announce(run)
    return run


def resume(run: Run) -> int:
    """The step to continue from: --resume's (trainable weights, optimizer and schedule restored), or 0."""
    path = find_resume(run.args)
    if path is None:
        return 0
    check_resumed_options(path, run.args)
    check_resumed_dp_size(path, run.dp_size, run.args.sp_size)
    load = load_sharded_checkpoint if run.args.fsdp else load_checkpoint
    step = load(path, run.model, run.optimizer, run.scheduler)
    run.accelerator.print(f"resumed from {path} at step {step}")
    return step


def announce(run: Run):
    """The main process creates --output-dir and prints what it trains."""
    args, accelerator = run.args, run.accelerator
    if not accelerator.is_main_process:
        return
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    n_train = sum(p.numel() for group in run.optimizer.param_groups for p in group["params"])
    n_all = sum(p.numel() for p in accelerator.unwrap_model(run.model).parameters())
    precision, sharding = accelerator.mixed_precision, ""
    if args.fsdp:  # FSDP2 casts, not Accelerate
        precision, sharding = mixed_precision(args.mixed_precision), f" fsdp={args.fsdp_shard}"
    accelerator.print(f"attn={args.attn} seq_len={args.seq_len} world={run.world} "
                      f"(dp={run.dp_size} x sp={args.sp_size}){sharding} precision={precision} "
                      f"trainable={n_train:,}/{n_all:,} parameters")


def _logged_step(line: str) -> int | None:
    """The step of one --log-file line; None for a line that is not a record (a line cut short when
    a run was killed while writing it)."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None


class StepLog:
    """The progress bar and --log-file's JSON lines, both on the main process only."""

    def __init__(self, args, accelerator, start_step: int):
        main = accelerator.is_main_process
        self.progress = None
        if main and not args.no_progress:
            from tqdm.auto import tqdm

            self.progress = tqdm(total=args.max_steps, initial=start_step, desc="train", dynamic_ncols=True)
        self.file = None
        if args.log_file and main:
            log = Path(args.log_file)
            if start_step and log.is_file():  # a resumed run: drop the steps after its checkpoint (they run again)
                kept = [line for line in log.read_text().splitlines(keepends=True)
                        if _logged_step(line) is not None and _logged_step(line) <= start_step]
                tmp = log.with_name(log.name + ".tmp")
                tmp.write_text("".join(kept))
                os.replace(tmp, log)
            self.file = open(log, "a")

    def write(self, record: dict):
        if self.progress is not None:
            self.progress.update(1)
            self.progress.set_postfix(loss=f"{record['loss']:.4f}", acc=f"{record['accuracy']:.2f}",
                                      tok_s=f"{record['tokens_per_s']:.0f}")
        if self.file is not None:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()

    def close(self):
        if self.progress is not None:
            self.progress.close()
        if self.file is not None:
            self.file.close()


def micro_step(run: Run, step: int, micro: int, batch: dict, step_labels: int):
    """Forward and backward on this replica's rows of (step, micro) (`batch`; `step_labels` the
    labelled tokens of all the step's micro-batches here); the optimizer steps (and the schedule
    with it) on the last micro-step of the step. Returns forward_loss's (loss, hits, count)."""
    args, accelerator, model = run.args, run.accelerator, run.model
    # Seeded per (step, micro, rank): dropout replays identically after a resume.
    torch.manual_seed(args.seed * 1_000_003 + (step * args.grad_accum + micro) * run.world + run.rank)
    with accelerator.accumulate(model):
        # (accelerate divides each micro-step's loss by --grad-accum: a divisor of step_labels / grad_accum
        # makes the step's gradient that of its token mean, whatever each micro-batch's share)
        loss, hits, count = forward_loss(model, batch, accelerator.device, run.sp, args.loss_mean,
                                         token_divisor=max(1, step_labels) / args.grad_accum)
        accelerator.backward(loss)
        if accelerator.sync_gradients and args.max_grad_norm > 0:
            accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        run.optimizer.step()
        if accelerator.sync_gradients:
            run.scheduler.step()
        run.optimizer.zero_grad(set_to_none=True)
    return loss, hits, count


def train_step(run: Run, step: int) -> dict:
    """One optimizer step (--grad-accum micro-steps); returns its log record: loss and accuracy over
    all processes, the learning rate it trained with, tokens per second."""
    args, accelerator = run.args, run.accelerator
    t0 = time.perf_counter()
    lr = run.optimizer.param_groups[0]["lr"]  # the rate this step trains with
    step_loss = torch.zeros((), device=accelerator.device)
    step_hits = torch.zeros(2, device=accelerator.device)  # right, labelled
    batches = [rows_for(run.dataset, step, micro, args, run.dp_rank, run.dp_size, args.seed)
               for micro in range(args.grad_accum)]
    step_labels = sum(int((batch["labels"] != IGNORE_INDEX).sum()) for batch in batches)
    for micro, batch in enumerate(batches):
        loss, hits, count = micro_step(run, step, micro, batch, step_labels)
        step_loss += loss.detach() / args.grad_accum
        step_hits += torch.stack([hits.float(), count.float()])
    # Every rank holds its replica's loss (an SP group's ranks the same value): the mean over
    # all processes is the mean over replicas.
    if run.world > 1:
        step_loss = accelerator.reduce(step_loss, reduction="mean")
        step_hits = accelerator.reduce(step_hits, reduction="sum") / args.sp_size
    seconds = time.perf_counter() - t0
    tokens = args.seq_len * args.batch_size * args.grad_accum * run.dp_size
    return {"step": step + 1, "loss": float(step_loss), "accuracy": float(step_hits[0] / step_hits[1].clamp(min=1)),
            "lr": lr, "tokens_per_s": tokens / seconds}


def checkpoint_due(args, steps_done: int, end_step: int) -> bool:
    """Every --save-every steps, and when --stop-after-steps ends the run before --max-steps."""
    stopping = steps_done == end_step and end_step < args.max_steps
    return bool(args.save_every and steps_done % args.save_every == 0) or stopping


def save_step_checkpoint(run: Run, steps_done: int):
    """checkpoints/step-NNNNNN by the main process (the oldest beyond --keep-checkpoints removed);
    the others wait for it."""
    accelerator = run.accelerator
    path = Path(run.args.output_dir, CHECKPOINT_DIR, f"step-{steps_done:06d}")
    if run.args.fsdp:  # every rank writes its shards
        save_sharded_checkpoint(path, run, steps_done)
    elif accelerator.is_main_process:
        save_checkpoint(path, accelerator.unwrap_model(run.model), run.optimizer, run.scheduler, steps_done, run.args,
                        run.dp_size)
    if accelerator.is_main_process:
        prune_checkpoints(run.args)
    accelerator.wait_for_everyone()


def finish(run: Run, end_step: int):
    """adapter/ and model/ once --max-steps is reached (unless --no-final-model), then the end."""
    args, accelerator = run.args, run.accelerator
    if not args.no_final_model and end_step == args.max_steps:
        model = run.model
        if args.fsdp:
            model = unsharded_copy(run)  # collective: every rank sends its shards to the main process
        if accelerator.is_main_process:
            save_final(model, run.tokenizer, args, accelerator)
    if accelerator.num_processes == 1:
        accelerator.end_training()
        return
    # Every rank meets once more (the others wait for the main process's final model), and the
    # process groups stay up: the script then ends its process without tearing them down (exit_process). accelerate's end_training() destroyed the default group,
    # DDP's reducer kept the last reference to a gloo subgroup, and at the interpreter's exit it
    # destroyed that with the GIL held while the group's worker thread waited for the GIL: a rank
    # hung for good (seen on 2026-11-28 in a test run beside another; pytorch/pytorch#56297).
    accelerator.wait_for_everyone()


def unsharded_copy(run: Run):
    """--fsdp: on the main process, a plain (unsharded, float32) copy of the model holding the
    trained weights, gathered from every rank's shards; None elsewhere. Collective."""
    from hf_dilated.distributed import full_model_state

    state = full_model_state(run.model)
    if not run.accelerator.is_main_process:
        return None
    model = load_model(run.args, torch.float32)
    model.load_state_dict(state)  # strict: the same model, LoRA included, so every name must match
    return model


def train(args, dataset=None) -> dict:
    """Trains from step 0 or --resume's step up to --max-steps (or --stop-after-steps more); returns
    {"history": each step's record, "start_step"}. dataset: rows to train on instead of the ones
    --data describes (pretrain_tiny.py's mixture)."""
    run = setup(args, dataset)
    end_step = args.max_steps
    if args.stop_after_steps is not None:
        end_step = min(args.max_steps, run.start_step + args.stop_after_steps)
    log = StepLog(args, run.accelerator, run.start_step)
    history = []
    for step in range(run.start_step, end_step):
        history.append(train_step(run, step))
        log.write(history[-1])
        if checkpoint_due(args, step + 1, end_step):
            save_step_checkpoint(run, step + 1)
    log.close()
    finish(run, end_step)
    return {"history": history, "start_step": run.start_step}


def forward_loss(model, batch, device, sp, loss_mean: str = "token", token_divisor=None):
    """The mean next-token loss over the labelled tokens of this replica's rows, with the number
    of those tokens predicted right and their count (for the logged accuracy). token_divisor: what
    the "token" sum is divided by instead of this batch's count (train_step: the step's labels over
    its micro-batches, so that --grad-accum does not weigh each micro-batch alike).

    Under sequence parallelism each rank holds a shard of every row (global positions kept):
    the rank's loss is its share (local sum / the rows' total label count) and `reduce_loss`
    adds the shares, scaling gradients so that DDP's average over all processes stays right.
    loss_mean "row" divides each row's sum by that row's count instead, then by the rows.
    """
    input_ids, labels, position_ids = (batch[k].to(device) for k in ("input_ids", "labels", "position_ids"))
    count = (labels != IGNORE_INDEX).sum().clamp(min=1)
    row_counts = denominator = None
    if loss_mean == "row":  # the loss is (sum of row means) / (rows with labels)
        row_counts = (labels != IGNORE_INDEX).sum(1)
        denominator = (row_counts > 0).sum().clamp(min=1)
    if sp is None:
        logits = model(input_ids=input_ids, position_ids=position_ids).logits
        divisor = (count if token_divisor is None else token_divisor) if row_counts is None else denominator
        loss = token_loss_sum(logits, labels, row_counts) / divisor
        return loss, token_hits(logits, labels), count
    from hf_dilated.distributed import reduce_loss, shard_batch

    # Our labels are already shifted (data.py): shard them as they are.
    part = shard_batch(input_ids, shift_labels=labels, position_ids=position_ids, ignore_index=IGNORE_INDEX)
    logits = model(input_ids=part["input_ids"], position_ids=part["position_ids"]).logits
    hits = token_hits(logits, part["labels"])
    torch.distributed.all_reduce(hits, group=sp.sp_group)  # the group's shards hold one row set between them
    divisor = (count if token_divisor is None else token_divisor) if row_counts is None else denominator
    share = token_loss_sum(logits, part["labels"], row_counts) / divisor
    return reduce_loss(share), hits, count


def token_hits(logits, labels):
    """How many labelled tokens the model's argmax predicts right (logged as accuracy)."""
    return ((logits.argmax(-1) == labels) & (labels != IGNORE_INDEX)).sum()


def main(argv=None, dataset=None) -> int:
    args = parse_args(argv)
    result = train(args, dataset)
    if result["history"] and int(os.environ.get("RANK", "0")) == 0:
        last = result["history"][-1]
        print(f"done: step {last['step']} loss {last['loss']:.4f} ({last['tokens_per_s']:.0f} tokens/s)")
    return 0


def exit_process(code: int):
    """Ends the process with `code`. With process groups up (every rank past finish()'s last meeting,
    all it writes written), without the interpreter's teardown, which can hang a rank in a gloo
    group's destructor (finish()); sequence_parallel_demo.py ends so too. Ending the process
    releases the groups."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    exit_process(main())
