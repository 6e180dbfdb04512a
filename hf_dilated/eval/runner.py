"""`hf-dilated eval`: perplexity by position and context, passkey retrieval and forward cost, for
one or more checkpoints each under one or more attention implementations. Writes eval.md,
eval.json and (with matplotlib) loss_by_position.png and passkey.png to --output-dir.

    hf-dilated eval --model base=ckpt-256@sdpa long=ckpt-1024@dilated_ring,sdpa \
        --text heldout/ --lengths 256 512 1024 --output-dir runs/eval
    python -m hf_dilated.eval ...   (the same)

A --model entry is [LABEL=]PATH[@ATTN[,ATTN...]]; without @ the checkpoint is evaluated with every
--attn (default: the attention its config names, else sdpa). Every row sees the same documents,
tokens and passkey samples.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from ..checks import file_in_the_way

TEXT_SUFFIXES = {".txt", ".md", ".py", ".rst"}
BUILTIN_ATTENTIONS = ("sdpa", "eager")


class EvalError(Exception):
    """Bad input: the message names the argument."""


@dataclass
class Run:
    label: str
    path: Path
    attns: list[str]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", nargs="+", required=True, metavar="[LABEL=]PATH[@ATTN,...]",
                   help="checkpoints (with a tokenizer), each optionally with a label and its own attentions")
    p.add_argument("--attn", nargs="+", default=None,
                   help="attentions for --model entries without @ (default: the checkpoint's own, else sdpa)")
    p.add_argument("--text", nargs="+", default=None,
                   help="held-out text files or directories for the perplexity (each at least --ppl-length tokens); "
                        "without it no perplexity is measured")
    p.add_argument("--lengths", nargs="+", type=int, default=[256, 512, 1024],
                   help="passkey and cost lengths in tokens")
    p.add_argument("--ppl-length", type=int, default=None, help="tokens scored per document (default: the longest --lengths)")
    p.add_argument("--bucket", type=int, default=None,
                   help="position bucket size (default: the first checkpoint's original context)")
    p.add_argument("--window", type=int, default=None, help="the cut context for far buckets (default: --bucket)")
    p.add_argument("--window-stride", type=int, default=None,
                   help="targets scored per window row (default: window / 4): each sees window - stride + 1 .. window tokens")
    p.add_argument("--max-docs", type=int, default=None, help="use at most this many documents (in sorted order)")
    p.add_argument("--depths", nargs="+", type=float, default=[0.0, 0.25, 0.5, 0.75, 1.0])
    p.add_argument("--samples", type=int, default=8, help="passkey samples per (length, depth); 0: no passkey")
    p.add_argument("--no-cost", action="store_true", help="skip the forward time and memory")
    p.add_argument("--cost-repeats", type=int, default=3, help="timed forwards per cost figure (their median)")
    p.add_argument("--cut-rows", choices=("all", "first", "none"), default="all",
                   help="which rows also get the loss with the context cut to --window: every row, only the "
                        "first (the unconverted model, where it is the baseline a user could have by truncating), "
                        "or none (a run that compares against a baseline measured before)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seed", type=int, default=1234, help="passkey samples (training used other seeds)")
    p.add_argument("--output-dir", default=None, help="where eval.md, eval.json and the plots go")
    p.add_argument("--no-progress", action="store_true")


def known_attentions() -> tuple[str, ...]:
    from hf_dilated.integrations.transformers import NAMES

    return BUILTIN_ATTENTIONS + tuple(NAMES)


def check_attn(name: str, option: str = "--attn") -> str:
    known = known_attentions()
    if name not in known:
        raise EvalError(f"{option}: unknown attention {name!r}; choose from {', '.join(known)}")
    return name


def _check_tokenizer(path: Path) -> None:
    """An EvalError naming --model where `path` holds no tokenizer that loads: found only after the
    models before it had run, it failed the whole evaluation with transformers' traceback."""
    from transformers import AutoTokenizer

    try:
        AutoTokenizer.from_pretrained(path)
    except Exception as exc:  # (transformers raises ValueError, OSError or others, by what is missing)
        raise EvalError(f"--model: {path} holds no tokenizer that loads ({type(exc).__name__}: {' '.join(str(exc).split())[:200]}); "
                        "save the tokenizer beside the model") from None


def parse_runs(entries: list[str], default_attns: list[str] | None) -> list[Run]:
    runs = []
    for entry in entries:
        # LABEL=PATH splits at the first "=" (a path may hold more), a bare path that exists is taken whole
        label, _, rest = ("", "", entry) if "=" not in entry or Path(entry.partition("@")[0]).exists() \
            else entry.partition("=")
        path_text, _, attn_text = rest.partition("@")
        path = Path(path_text)
        if not (path / "config.json").is_file():
            raise EvalError(f"--model: no checkpoint at {path} (no config.json)")
        _check_tokenizer(path)
        if attn_text:
            attns = [check_attn(a, option="--model") for a in attn_text.split(",") if a]
        elif default_attns:
            attns = [check_attn(a) for a in default_attns]
        else:  # the attention the checkpoint loads with: config.json's, else the one its entry records
            # (save_pretrained drops the first and keeps the second)
            from ..config import CONFIG_KEY, RECORDED_NAME

            config = json.loads((path / "config.json").read_text())
            entry = config.get(CONFIG_KEY)
            recorded = entry.get(RECORDED_NAME) if isinstance(entry, dict) else None
            attns = [check_attn(config.get("attn_implementation") or recorded or "sdpa")]
        if not label:
            label = path.name if path.name not in ("model", "") else f"{path.parent.name}/{path.name}"
        runs.append(Run(label, path, attns))
    if default_attns and all("@" in e for e in entries):
        raise EvalError("--attn: every --model entry names its attentions after @, so --attn is not used")
    labels = [r.label for r in runs]
    if len(set(labels)) != len(labels):
        raise EvalError(f"--model: two checkpoints share a label ({labels}); name them LABEL=PATH")
    return runs


def find_documents(paths: list[str]) -> list[Path]:
    files = []
    for path in map(Path, paths):
        if path.is_dir():
            files += sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
        elif path.is_file():
            files.append(path)
        else:
            raise EvalError(f"--text: no such file or directory: {path}")
    if not files:
        raise EvalError(f"--text: no text files under {' '.join(paths)}")
    return files


def load_documents(tokenizer, files: list[Path], length: int):
    import torch

    docs = []
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    for f in files:
        ids = bos + tokenizer(f.read_text(encoding="utf-8", errors="replace"), add_special_tokens=False)["input_ids"]
        if len(ids) < length:
            raise EvalError(f"--text: {f} has {len(ids)} tokens, fewer than --ppl-length {length}; give documents "
                            f"at least that long or a shorter --ppl-length")
        docs.append(torch.tensor(ids[:length]))
    return docs


def original_context(path: Path) -> int:
    from transformers import AutoConfig

    from hf_dilated.patches.context import original_length

    return original_length(AutoConfig.from_pretrained(path))


def validate(args) -> None:
    for name in ("batch_size", "cost_repeats"):
        if getattr(args, name) < 1:
            raise EvalError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    # (None: the default; 0 is not one, it was taken for the default)
    for name in ("ppl_length", "bucket", "window", "window_stride", "max_docs"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise EvalError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.samples < 0:
        raise EvalError(f"--samples must be >= 0, got {args.samples}")
    # Options of a part that does not run (they were taken without a word)
    defaults = argparse.ArgumentParser()
    add_arguments(defaults)
    unused = {"--text": ("ppl_length", "bucket", "window", "window_stride", "max_docs", "cut_rows"),
              "--samples": ("depths", "seed"), "the cost (--no-cost)": ("cost_repeats",)}
    off = {"--text": not args.text, "--samples": args.samples == 0, "the cost (--no-cost)": args.no_cost,
           "--cut-rows none": args.cut_rows == "none"}
    unused["--cut-rows none"] = ("window", "window_stride")  # (the cut rows are what a window cuts)
    for part, names in unused.items():
        given = [f"--{n.replace('_', '-')}" for n in names if off[part] and getattr(args, n) != defaults.get_default(n)]
        if given:
            raise EvalError(f"{', '.join(given)}: {part} measures nothing here, so {'it is' if len(given) == 1 else 'they are'} "
                            "not used")
    if not args.text and args.samples == 0 and args.no_cost:
        raise EvalError("--samples 0 and --no-cost without --text: nothing to measure")
    for n in args.lengths:
        if n < 2:
            raise EvalError(f"--lengths must be >= 2 tokens, got {n}")
    for d in args.depths:
        if not 0.0 <= d <= 1.0:
            raise EvalError(f"--depths must lie in [0, 1], got {d}")
    if args.samples:
        from .passkey import min_length

        short = [n for n in args.lengths if n < min_length()]
        if short:
            raise EvalError(f"--lengths: a passkey sample needs at least {min_length()} tokens, got {short} "
                            "(or --samples 0)")


def evaluate(args, runs: list[Run], progress) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hf_dilated  # noqa: F401  (registers the attention names)

    from ..ops import pair_count
    from . import core

    device = "cuda" if torch.cuda.is_available() else "cpu"
    result = {"settings": {}, "rows": []}
    ppl_length = max(args.lengths) if args.ppl_length is None else args.ppl_length
    bucket = original_context(runs[0].path) if args.bucket is None else args.bucket
    window = bucket if args.window is None else args.window
    stride = max(1, window // 4) if args.window_stride is None else args.window_stride
    if window > bucket:
        raise EvalError(f"--window ({window}) must not exceed --bucket ({bucket}): the far buckets start at --bucket")
    if stride > window:
        raise EvalError(f"--window-stride ({stride}) must not exceed --window ({window})")
    if args.text and args.cut_rows != "none" and ppl_length <= bucket:
        raise EvalError(f"--ppl-length ({ppl_length}, else the longest --lengths) must exceed --bucket ({bucket}, "
                        "else the model's original context) for the cut rows (--cut-rows): they read the positions "
                        "past it")
    files = find_documents(args.text) if args.text else []
    if args.max_docs is not None:
        files = files[:args.max_docs]
    result["settings"] = {"ppl_length": ppl_length, "bucket": bucket, "window": window, "window_stride": stride,
                          "documents": [str(f) for f in files], "lengths": args.lengths, "depths": args.depths,
                          "samples": args.samples, "seed": args.seed, "device": device}
    for run in runs:
        tokenizer = AutoTokenizer.from_pretrained(run.path)
        docs = load_documents(tokenizer, files, ppl_length) if files else []
        for attn in run.attns:
            model = AutoModelForCausalLM.from_pretrained(run.path, attn_implementation=attn, dtype=torch.float32)
            model.to(device).eval()
            row = {"model": run.label, "path": str(run.path), "attn": attn}
            progress.set_description(f"{run.label} {attn}")
            if docs:
                start = time.perf_counter()
                with pair_count.counting() as tally:
                    row["loss_by_bucket"] = core.bucket_losses(model, docs, ppl_length, bucket, args.batch_size,
                                                               progress)
                # Forward time beside the loss (the same forward, no extra one): seconds per document.
                row["loss_seconds_per_doc"] = (time.perf_counter() - start) / len(docs)
                row["pairs_read"] = core.pairs_read_fraction(model, attn, tally, len(docs), ppl_length)
                if args.cut_rows == "all" or (args.cut_rows == "first" and not result["rows"]):
                    row["windowed_loss_by_bucket"] = core.windowed_losses(model, docs, ppl_length, bucket, window, stride,
                                                                          args.batch_size, progress)
            if args.samples:
                row["passkey"] = []
                for length in args.lengths:
                    for depth in args.depths:
                        samples = core.make_passkey_samples(tokenizer, length, depth, args.samples, args.seed)
                        if "labels" in samples[0]:
                            keys, digits = core.passkey_scores(model, samples, args.batch_size, progress)
                        else:  # an instruct model's plain-text prompt: greedy generation
                            keys, digits = core.generated_passkey_scores(model, tokenizer, samples, progress)
                        row["passkey"].append({"length": length, "depth": depth, "correct": sum(keys),
                                               "digits_correct": sum(digits), "samples": len(keys)})
            if not args.no_cost:
                row["cost"] = []
                for length in args.lengths:
                    row["cost"].append({"length": length, **core.forward_cost(model, length, model.config.vocab_size,
                                                                               args.cost_repeats)})
                    progress.update(1)
            result["rows"].append(row)
            del model
    return result


def work_units(args, runs: list[Run]) -> int:
    combos = sum(len(r.attns) for r in runs)
    units = 0
    if args.text:
        n_docs = len(find_documents(args.text)) if args.max_docs is None else args.max_docs
        units += n_docs  # whole-context rows; the windowed rows are added as they come
    units += args.samples * len(args.lengths) * len(args.depths)
    units += 0 if args.no_cost else len(args.lengths)
    return combos * units


# --- reports -------------------------------------------------------------------------------------


def bucket_names(bucket: int, count: int) -> list[str]:
    return [f"{k * bucket}-{(k + 1) * bucket}" for k in range(count)]


def markdown(result: dict) -> str:
    s, rows = result["settings"], result["rows"]
    out = []
    ppl_rows = [r for r in rows if "loss_by_bucket" in r]
    if ppl_rows:
        n = len(ppl_rows[0]["loss_by_bucket"])
        names = bucket_names(s["bucket"], n)
        out += [f"### Loss by position (nats/token, {len(s['documents'])} held-out documents x {s['ppl_length']} tokens)",
                "",
                f"Whole document, and (cut) the same tokens with the context cut to the previous "
                f"{s['window'] - s['window_stride'] + 1}-{s['window']} tokens; gain = cut - whole; s / doc: "
                "seconds of the whole-document forward (no grad), per document; pairs: the (query, key) pairs "
                "that forward read over dense causal attention's, counted exactly by the kernels (-: not counted "
                "by this attention's kernels).",
                "",
                "| checkpoint | attention | " + " | ".join(names) + " | "
                + " | ".join(f"{x} cut | {x} gain" for x in names[1:]) + " | s / doc | pairs |",
                "|" + "---|" * (4 + n + 2 * (n - 1))]
        for r in ppl_rows:
            full, cut = r["loss_by_bucket"], r.get("windowed_loss_by_bucket")  # --cut-rows first: one row has it
            out.append(f"| {r['model']} | {r['attn']} | " + " | ".join(f"{v:.3f}" for v in full) + " | "
                       + " | ".join(f"{cut[k]:.3f} | {cut[k] - full[k]:+.3f}" if cut else "- | -" for k in range(1, n))
                       + f" | {r['loss_seconds_per_doc']:.1f} | "
                       + ("-" if r.get("pairs_read") is None else f"{r['pairs_read']:.3f}") + " |")
        out.append("")
    pk_rows = [r for r in rows if "passkey" in r]
    if pk_rows:
        depths = s["depths"]
        out += [f"### Passkey retrieval (whole keys right, {s['samples']} samples per length and depth; "
                "digits: teacher-forced digit accuracy, or for an instruct model's plain-text prompt the digits its "
                "greedy answer gets right)", "",
                "| checkpoint | attention | length | " + " | ".join(f"depth {d:g}" for d in depths) + " | keys | digits |",
                "|" + "---|" * (5 + len(depths))]
        for r in pk_rows:
            for length in s["lengths"]:
                cells = {c["depth"]: c for c in r["passkey"] if c["length"] == length}
                keys = sum(c["correct"] for c in cells.values())
                digits = sum(c["digits_correct"] for c in cells.values())
                total = sum(c["samples"] for c in cells.values())
                out.append(f"| {r['model']} | {r['attn']} | {length} | "
                           + " | ".join(f"{cells[d]['correct'] / cells[d]['samples']:.0%}" for d in depths)
                           + f" | **{keys / total:.0%}** | {digits / (5 * total):.2f} |")
        out.append("")
    cost_rows = [r for r in rows if "cost" in r]
    if cost_rows:
        out += [f"### Forward cost (one row, no grad, {s['device']}: median seconds / peak MiB above the model)", "",
                "| checkpoint | attention | " + " | ".join(str(n) for n in s["lengths"]) + " |",
                "|" + "---|" * (2 + len(s["lengths"]))]
        for r in cost_rows:
            out.append(f"| {r['model']} | {r['attn']} | " + " | ".join(
                f"{c['seconds']:.3f} s / {c['peak_bytes'] / 2**20:.0f}{'' if c['memory_exact'] else ' (upper bound)'} MiB"
                for c in r["cost"]) + " |")
        out.append("")
    return "\n".join(out)


def plots(result: dict, out: Path, shown: Path | None = None) -> list[str]:
    """Writes the PNGs into `out`; returns notes (what was written, as in `shown` (default: out),
    where it will be; or matplotlib missing)."""
    try:
        import matplotlib
    except ImportError:
        return ["plots skipped: matplotlib is not installed (pip install matplotlib)"]
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s, rows, written = result["settings"], result["rows"], []
    ppl_rows = [r for r in rows if "loss_by_bucket" in r]
    if ppl_rows:
        fig, ax = plt.subplots(figsize=(7, 4.4))
        n = len(ppl_rows[0]["loss_by_bucket"])
        x = list(range(n))
        for r in ppl_rows:
            line, = ax.plot(x, r["loss_by_bucket"], marker="o", label=f"{r['model']} {r['attn']}")
            cut = r.get("windowed_loss_by_bucket")
            if cut:
                ax.plot(x[1:], cut[1:], marker="x", linestyle="--", color=line.get_color(), alpha=0.7)
        ax.set_xticks(x, bucket_names(s["bucket"], n))
        ax.set_xlabel("target position (tokens)")
        ax.set_ylabel("loss (nats/token)")
        ax.set_title(f"Held-out loss by position (dashed: context cut to {s['window']})")
        written.append(_save(plt, fig, ax, out / "loss_by_position.png"))
    pk_rows = [r for r in rows if "passkey" in r]
    if pk_rows:
        fig, ax = plt.subplots(figsize=(7, 4.4))
        for r in pk_rows:
            acc = []
            for length in s["lengths"]:
                cells = [c for c in r["passkey"] if c["length"] == length]
                acc.append(100 * sum(c["correct"] for c in cells) / sum(c["samples"] for c in cells))
            ax.plot(s["lengths"], acc, marker="o", label=f"{r['model']} {r['attn']}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(s["lengths"], [str(n) for n in s["lengths"]])
        ax.set_ylim(-3, 103)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("keys right (%), mean over depths")
        ax.set_title("Passkey retrieval")
        written.append(_save(plt, fig, ax, out / "passkey.png"))
    return [f"wrote {(shown or out) / w}" for w in written]


def _save(plt, fig, ax, path) -> str:
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path.name


class _NoProgress:
    def update(self, n=1):
        pass

    def set_description(self, text):
        pass

    def close(self):
        pass


def main(args) -> int:
    try:
        validate(args)
        runs = parse_runs(args.model, args.attn)
        file = args.output_dir and file_in_the_way(args.output_dir)
        if file:
            raise EvalError(f"--output-dir: {args.output_dir} is or lies under a file ({file})")
        if args.no_progress:
            progress = _NoProgress()
        else:
            from tqdm.auto import tqdm

            progress = tqdm(total=work_units(args, runs), desc="eval", dynamic_ncols=True)
        try:
            result = evaluate(args, runs, progress)
        finally:
            progress.close()
    except EvalError as exc:
        print(f"hf-dilated eval: error: {exc}", file=sys.stderr)
        return 2
    table = markdown(result)
    print(table)
    if args.output_dir:
        out = Path(args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        # Written aside, then moved in together, and an earlier run's outputs this one does not make
        # removed: a plot of another run stayed beside the new report.
        staging = Path(tempfile.mkdtemp(prefix=".eval-", dir=out))
        try:
            (staging / "eval.md").write_text(table + "\n")
            (staging / "eval.json").write_text(json.dumps(result, indent=1) + "\n")
            notes = plots(result, staging, shown=out)
            for name in OUTPUTS:
                if (staging / name).exists():
                    os.replace(staging / name, out / name)
                elif (out / name).exists():
                    (out / name).unlink()
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        for note in [f"wrote {out / 'eval.md'}, {out / 'eval.json'}"] + notes:
            print(note)
    return 0


OUTPUTS = ("eval.md", "eval.json", "loss_by_position.png", "passkey.png")  # what main writes to --output-dir


def cli(argv=None) -> int:
    p = argparse.ArgumentParser(prog="hf-dilated eval", description=__doc__.splitlines()[0])
    add_arguments(p)
    return main(p.parse_args(argv))
