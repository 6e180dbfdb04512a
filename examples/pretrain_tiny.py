"""The embedded default's base model: a tiny Llama (a model_configs preset) with a byte-level
tokenizer, built locally and pre-trained at its short context with `sdpa` on real text every
machine has (the Python standard library's sources, minus the held-out files `data.stdlib_files`
keeps for evaluation) mixed with short passkey documents, so that the short-context model
retrieves within its own context.

    # how examples/tiny_base was made (one CPU thread each; about 25 minutes in all on an idle core):
    python examples/pretrain_tiny.py --output-dir runs/pt/a50 --passkey-fraction 1 --max-steps 800 --save-every 200
    python examples/pretrain_tiny.py --output-dir runs/pt/s2 --init runs/pt/a50/model --seed 1 \
        --passkey-fraction 0.5 --max-steps 4500 --lr 1.5e-3 --warmup-steps 100 --save-every 250
    python examples/pretrain_tiny.py --export runs/pt/s2/model --record RECORD.json --output-dir examples/tiny_base

Each row is a passkey row with probability --passkey-fraction, else a window of one training
file (data.TextPasskeyMixture); the loss is each row's own mean (--loss-mean row), so the few key
digits of a passkey row weigh as much as a text row. A curriculum is two runs: passkey alone first
(retrieval is learnt in a few hundred steps when nothing else competes), then the mixture from
that model (--init). Writes OUTPUT_DIR/init (the starting weights) and OUTPUT_DIR/model (safetensors
+ tokenizer); the training itself is finetune_long_context.py with --full-finetune, so the same
loop, logs and resumable checkpoints apply (any other flag goes to it).
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import finetune_long_context  # noqa: E402
from byte_tokenizer import build_byte_tokenizer  # noqa: E402
from data import TextPasskeyMixture, stdlib_files  # noqa: E402

DEFAULT_PRESET = "tiny-llama-passkey"


def build_initial_checkpoint(preset: str, path: Path, seed: int) -> None:
    from transformers import AutoModelForCausalLM

    from hf_dilated.model_configs import build_model_config

    tokenizer = build_byte_tokenizer()
    config = build_model_config(preset)
    if config.vocab_size < len(tokenizer):
        raise SystemExit(f"preset {preset!r} has vocab_size {config.vocab_size} < the tokenizer's {len(tokenizer)}")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


def measure(model_dir: Path, context: int, samples: int = 8) -> dict:
    """The base model's figures at its own context with sdpa: the held-out loss of the first `context`
    tokens of the held-out sources of at least 4 x context bytes (the main job's evaluation
    documents), the loss by 32-token position bucket over every whole `context`-token window of
    those files, and passkey keys right at `context` tokens (depths 0..1, `samples` each, the
    evaluation's seed)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_dilated.eval import core
    from data import tokenize_files

    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa").eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    files = stdlib_files("heldout", min_bytes=4 * context + 64)
    docs = [d[:context] for d in tokenize_files(tokenizer, files)]
    losses = core.token_losses(model, torch.stack(docs), batch_size=8)
    # every whole `context`-token window of those documents (starting mid-file, like the training
    # windows): the loss by position within the context, over many tokens
    windows = torch.stack([w for d in tokenize_files(tokenizer, files) for w in d.split(context) if len(w) == context])
    buckets = core.bucket_means(core.token_losses(model, windows, batch_size=16), 32)
    keys = digits = total = 0
    for depth in (0.0, 0.25, 0.5, 0.75, 1.0):
        hit, dig = core.passkey_scores(model, core.make_passkey_samples(tokenizer, context, depth, samples, 1234), 8)
        keys, digits, total = keys + sum(hit), digits + sum(dig), total + len(hit)
    # the slice tests/test_eval.py re-scores (fast): the first 4 documents, 3 depths x 4 samples
    slice_keys = [k for d in (0.0, 0.5, 1.0)
                  for k in core.passkey_scores(model, core.make_passkey_samples(tokenizer, context, d, 4, 1234), 6)[0]]
    return {"heldout_documents": [Path(f).name for f in files], "heldout_loss_0_L": float(losses.mean()),
            "slice_loss_0_L": float(losses[:4].mean()), "slice_passkey_keys_at_L": sum(slice_keys) / len(slice_keys),
            "heldout_windows": len(windows), "heldout_windows_loss_by_32_tokens": [round(b, 4) for b in buckets],
            "passkey_keys_at_L": keys / total, "passkey_digits_at_L": digits / (5 * total), "passkey_samples": total}


def export(src: Path, dest: Path, record: dict) -> None:
    """Copies a trained model (safetensors, config, tokenizer) to `dest` with training.json: the
    record (seed, commands, data) and the measured figures."""
    import json

    dest.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix in (".json", ".safetensors", ".txt") and f.name != "training.json":
            shutil.copy2(f, dest / f.name)
    import platform
    record = {**record, "python": platform.python_version(), "torch": torch.__version__,
              "train_files": len(stdlib_files("train")), "figures": measure(dest, record["context"])}
    (dest / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record["figures"], indent=1))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--export", default=None, metavar="MODEL_DIR",
                   help="do not train: copy MODEL_DIR to --output-dir with training.json (--record: a JSON file "
                        "with seed, commands and data) and the figures measured at its context")
    p.add_argument("--record", default=None, help="with --export: JSON file merged into training.json")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--preset", default=DEFAULT_PRESET, help="model_configs preset with a model_config")
    p.add_argument("--init", default=None, help="start from this checkpoint instead of the preset's random weights")
    p.add_argument("--seq-len", type=int, default=None, help="pre-training context (default: the preset's original)")
    p.add_argument("--passkey-fraction", type=float, default=0.5, help="share of rows that are passkey rows")
    p.add_argument("--passkey-recalls", type=int, default=2, help="answers mid-text per passkey document (at most)")
    p.add_argument("--num-rows", type=int, default=1_000_000, help="distinct rows to draw from")
    p.add_argument("--seed", type=int, default=0)
    args, rest = p.parse_known_args(argv)  # everything else goes to the training loop
    out = Path(args.output_dir)
    if args.export and rest:  # (they were dropped without a word)
        p.error(f"--export copies a model and trains nothing: {' '.join(rest)} not taken")
    if args.export and Path(args.export).resolve() == out.resolve():
        p.error("--output-dir: --export copies MODEL_DIR elsewhere, not onto itself")
    if args.init and not (Path(args.init) / "config.json").is_file():
        p.error(f"--init: no checkpoint (config.json) at {args.init}")
    if args.export:
        import json

        from hf_dilated.model_configs import load_preset

        record = json.loads(Path(args.record).read_text()) if args.record else {}
        record.setdefault("context", load_preset(args.preset)["assumes"]["max_position_embeddings"])
        export(Path(args.export), out, record)
        return 0
    init = out / "init"
    if not (init / "config.json").is_file():
        if args.init:
            shutil.copytree(args.init, init)
        else:
            build_initial_checkpoint(args.preset, init, args.seed)
    from hf_dilated.model_configs import load_preset

    seq_len = args.seq_len or load_preset(args.preset)["assumes"]["max_position_embeddings"]
    train_args = ["--model", str(init), "--output-dir", str(out), "--attn", "sdpa", "--full-finetune",
                  "--seq-len", str(seq_len), "--seed", str(args.seed), "--data", "passkey"]
    defaults = {"--lr": "2e-3", "--warmup-steps": "50", "--batch-size": "8", "--no-gradient-checkpointing": None,
                "--loss-mean": "row"}
    for flag, value in defaults.items():
        if flag not in rest and not (flag.startswith("--no-") and "--" + flag[5:] in rest):
            train_args += [flag] + ([value] if value is not None else [])
    tokenizer = build_byte_tokenizer()
    dataset = TextPasskeyMixture(tokenizer, stdlib_files("train"), seq_len, args.num_rows,
                                 passkey_fraction=args.passkey_fraction, seed=args.seed, recalls=args.passkey_recalls)
    return finetune_long_context.main(train_args + rest, dataset=dataset)


if __name__ == "__main__":
    finetune_long_context.exit_process(main())  # (several processes: no teardown of their groups)
