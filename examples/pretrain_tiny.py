"""Step 1 of the embedded default: build a tiny Llama from a model_configs preset and a byte-level
tokenizer (both locally, nothing downloaded), then pre-train it briefly at a short context with
`sdpa` on real text every machine has, the Python standard library's own source files, with every
other row short passkey documents (at most 256 tokens) so that retrieval within the original
context is something the short-context model has met.

    python examples/pretrain_tiny.py --output-dir runs/pretrain --max-steps 800

Writes OUTPUT_DIR/init (the random initialisation) and OUTPUT_DIR/model (the pre-trained
checkpoint, safetensors + tokenizer); the training itself is finetune_long_context.py with
--full-finetune, so the same loop, logs and checkpoints apply.
"""
from __future__ import annotations

import argparse
import sys
import sysconfig
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import finetune_long_context  # noqa: E402
from byte_tokenizer import build_byte_tokenizer  # noqa: E402


def stdlib_sources(max_files: int) -> list[str]:
    """Top-level .py files of the running Python's standard library, largest first (more text per
    file), at most `max_files`, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"), key=lambda p: (-p.stat().st_size, p.name))
    if not files:
        raise SystemExit(f"no standard-library sources under {root}")
    return [str(p) for p in files[:max_files]]


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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output-dir", required=True)
    p.add_argument("--preset", default="tiny-llama-passkey", help="model_configs preset with a model_config")
    p.add_argument("--seq-len", type=int, default=None, help="pre-training context (default: the preset's original)")
    p.add_argument("--max-files", type=int, default=60, help="standard-library files to train on")
    p.add_argument("--seed", type=int, default=0)
    args, rest = p.parse_known_args(argv)  # everything else goes to the training loop
    out = Path(args.output_dir)
    init = out / "init"
    if not (init / "config.json").is_file():
        build_initial_checkpoint(args.preset, init, args.seed)
    from hf_dilated.model_configs import load_preset

    seq_len = args.seq_len or load_preset(args.preset)["assumes"]["max_position_embeddings"]
    train_args = ["--model", str(init), "--output-dir", str(out), "--attn", "sdpa", "--full-finetune",
                  "--seq-len", str(seq_len), "--seed", str(args.seed), "--data", "passkey", *stdlib_sources(args.max_files)]
    defaults = {"--lr": "3e-3", "--warmup-steps": "20", "--batch-size": "8", "--no-gradient-checkpointing": None,
                "--passkey-recalls": "2", "--passkey-max-doc-len": "256", "--loss-mean": "row"}
    for flag, value in defaults.items():
        if flag not in rest and not (flag.startswith("--no-") and "--" + flag[5:] in rest):
            train_args += [flag] + ([value] if value is not None else [])
    return finetune_long_context.main(train_args + rest)


if __name__ == "__main__":
    sys.exit(main())
