"""Passkey-retrieval accuracy by context length and depth, for any checkpoints and attention
implementations: prints a markdown table and saves a PNG plot (accuracy vs context length, one
line per attention implementation and checkpoint) and the raw results as JSON.

    python examples/eval_passkey.py --model runs/finetune/model --attn dilated_ring sdpa \
        --lengths 512 1024 2048 4096 --depths 0 0.25 0.5 0.75 1 --samples 8 --output-dir runs/eval

A sample counts as retrieved when greedy decoding after "The pass key is " produces all five
digits. That is computed in one forward pass over prompt + answer: greedy decoding yields the
answer exactly when the argmax at every answer position, given the right digits before it, is
the right digit. Every checkpoint and attention implementation sees the same samples (keys and
depths are seeded by length, depth and sample number).
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from passkey import KEY_DIGITS, passkey_sample  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", nargs="+", required=True, help="checkpoint directories (with a tokenizer)")
    p.add_argument("--attn", nargs="+", default=["dilated_ring"],
                   help="attention implementations, e.g. dilated_ring ring block_sparse_ring sdpa")
    p.add_argument("--lengths", nargs="+", type=int, default=[512, 1024, 2048, 4096], help="context lengths in tokens")
    p.add_argument("--depths", nargs="+", type=float, default=[0.0, 0.25, 0.5, 0.75, 1.0],
                   help="where the key sits in the filler, 0 (start) .. 1 (end)")
    p.add_argument("--samples", type=int, default=8, help="samples per (length, depth)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seed", type=int, default=1234, help="keys differ from the training data's (seed 0)")
    p.add_argument("--output-dir", default=None, help="where to write passkey.md, passkey.json and passkey.png")
    p.add_argument("--label", nargs="+", default=None, help="a short name per --model for the table and plot")
    args = p.parse_args(argv)
    if args.label is not None and len(args.label) != len(args.model):
        p.error(f"--label needs one name per --model ({len(args.model)}), got {len(args.label)}")
    if args.samples < 1 or args.batch_size < 1:
        p.error("--samples and --batch-size must be >= 1")
    for d in args.depths:
        if not 0.0 <= d <= 1.0:
            p.error(f"--depths must lie in [0, 1], got {d}")
    return args


def make_samples(tokenizer, length: int, depth: float, count: int, seed: int) -> list[dict]:
    rng = random.Random(f"{seed}:{length}:{depth}")
    return [passkey_sample(tokenizer, length, depth, rng) for _ in range(count)]


@torch.no_grad()
def retrieved(model, samples: list[dict], batch_size: int) -> list[bool]:
    """For each sample, whether greedy decoding would produce its key (see the module docstring)."""
    device = next(model.parameters()).device
    hits = []
    for start in range(0, len(samples), batch_size):
        chunk = samples[start:start + batch_size]
        input_ids = torch.stack([s["input_ids"] for s in chunk]).to(device)
        labels = torch.stack([s["labels"] for s in chunk]).to(device)
        logits = model(input_ids=input_ids).logits
        answer = labels != -100
        predicted = logits.argmax(-1)[answer].view(len(chunk), KEY_DIGITS)
        hits += (predicted == labels[answer].view(len(chunk), KEY_DIGITS)).all(-1).tolist()
    return hits


def evaluate(args) -> list[dict]:
    import hf_dilated  # noqa: F401  (registers the attention names)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    labels = args.label or [Path(m).name if Path(m).name not in ("model", "") else Path(m).parent.name + "/" + Path(m).name
                            for m in args.model]
    results = []
    for model_path, label in zip(args.model, labels):
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        for attn in args.attn:
            model = AutoModelForCausalLM.from_pretrained(model_path, attn_implementation=attn, dtype=torch.float32)
            model.to(device).eval()
            for length in args.lengths:
                for depth in args.depths:
                    samples = make_samples(tokenizer, length, depth, args.samples, args.seed)
                    hits = retrieved(model, samples, args.batch_size)
                    results.append({"model": label, "path": str(model_path), "attn": attn, "length": length,
                                    "depth": depth, "correct": sum(hits), "samples": len(hits)})
                    print(f"{label} {attn:>17} length {length:>6} depth {depth:.2f}: {sum(hits)}/{len(hits)}", flush=True)
            del model
    return results


def markdown_table(results: list[dict], depths: list[float]) -> str:
    head = "| checkpoint | attention | length | " + " | ".join(f"depth {d:g}" for d in depths) + " | mean |"
    rows = [head, "|" + "---|" * (4 + len(depths))]
    keys = sorted({(r["model"], r["attn"], r["length"]) for r in results},
                  key=lambda k: ([r["model"] for r in results].index(k[0]), [r["attn"] for r in results].index(k[1]), k[2]))
    for model, attn, length in keys:
        cells = {r["depth"]: r for r in results if (r["model"], r["attn"], r["length"]) == (model, attn, length)}
        correct = sum(c["correct"] for c in cells.values())
        total = sum(c["samples"] for c in cells.values())
        rows.append(f"| {model} | {attn} | {length} | "
                    + " | ".join(f"{cells[d]['correct'] / cells[d]['samples']:.0%}" for d in depths)
                    + f" | **{correct / total:.0%}** |")
    return "\n".join(rows)


def accuracy_by_length(results: list[dict]) -> dict[tuple[str, str], dict[int, float]]:
    curves: dict[tuple[str, str], dict[int, list[int]]] = {}
    for r in results:
        c = curves.setdefault((r["model"], r["attn"]), {}).setdefault(r["length"], [0, 0])
        c[0] += r["correct"]
        c[1] += r["samples"]
    return {k: {n: a / b for n, (a, b) in sorted(v.items())} for k, v in curves.items()}


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = accuracy_by_length(results)
    several_models = len({m for m, _ in curves}) > 1
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for (model, attn), points in curves.items():
        ax.plot(list(points), [100 * a for a in points.values()], marker="o",
                label=f"{attn} ({model})" if several_models else attn)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({r["length"] for r in results}), labels=[str(n) for n in sorted({r["length"] for r in results})])
    ax.set_ylim(-3, 103)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("passkey accuracy (%), mean over depths")
    ax.set_title("Passkey retrieval")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    results = evaluate(args)
    table = markdown_table(results, args.depths)
    print()
    print(table)
    if args.output_dir:
        out = Path(args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "passkey.md").write_text(table + "\n")
        (out / "passkey.json").write_text(json.dumps(results, indent=1) + "\n")
        plot(results, out / "passkey.png")
        print(f"\nwrote {out / 'passkey.md'}, {out / 'passkey.json'}, {out / 'passkey.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
