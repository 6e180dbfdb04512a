"""`hf-dilated convert` (write a long-context copy of a checkpoint) and `hf-dilated info`.

A conversion never touches SRC and never leaves a half-written DST: it builds the new checkpoint
in a temporary directory beside DST and renames it into place at the end. Only config.json
changes; weight files are hard-linked (byte-identical, no extra disk) where the filesystem
allows, else copied; everything else (tokenizer, generation config, ...) is copied. Because hard
links share storage, never write into a converted directory in place (e.g. `save_pretrained(DST)`
would overwrite SRC's weights through the link): save elsewhere, or convert with `--copy`.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

from .integrations.config import CONFIG_KEY, DilatedConfig
from .integrations.transformers import NAMES
from .patches import family_for
from .patches.context import ROPE_CHOICES

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")


def _int_list(text):
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None


def add_convert_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="source checkpoint directory (config.json + weights); never modified")
    p.add_argument("dst", help="directory to create")
    p.add_argument("--attn", choices=NAMES, default=None,
                   help="attention implementation stored in config.json (default: the preset's, else 'dilated')")
    p.add_argument("--context", type=int, default=None, help="target context length in tokens")
    p.add_argument("--preset", default=None, help="a model_configs preset (e.g. llama2-7b-32k)")
    p.add_argument("--rope", choices=ROPE_CHOICES, default=None,
                   help="RoPE scaling (default: the preset's, else linear for an unscaled checkpoint)")
    p.add_argument("--mode", choices=("union", "longnet", "head_groups"), default=None)
    p.add_argument("--segment-lengths", type=_int_list, default=None, help="e.g. 4096,8192,16384")
    p.add_argument("--dilation-rates", type=_int_list, default=None, help="e.g. 1,2,4")
    p.add_argument("--copy", action="store_true", help="copy weight files instead of hard-linking them")
    p.add_argument("--force", action="store_true", help="replace DST if it exists")


def convert_main(args) -> int:
    fields = {k: v for k, v in (("mode", args.mode), ("segment_lengths", args.segment_lengths),
                                ("dilation_rates", args.dilation_rates)) if v is not None}
    try:
        dst = convert_checkpoint(args.src, args.dst, attn_implementation=args.attn, context_length=args.context,
                                 preset=args.preset, rope=args.rope, force=args.force, copy=args.copy, **fields)
    except (ValueError, TypeError, FileExistsError, FileNotFoundError) as exc:
        print(f"hf-dilated convert: error: {exc}")
        return 2
    print(f"wrote {dst}")
    print(describe(dst))
    return 0


def convert_checkpoint(src, dst, *, attn_implementation=None, context_length=None, preset=None, rope=None,
                       force=False, copy=False, **dilated_fields) -> Path:
    """Writes the converted checkpoint to `dst` and returns its path. See the module docstring."""
    from transformers import AutoConfig

    src, dst = Path(src).resolve(), Path(dst).resolve()
    if not (src / "config.json").is_file():
        raise FileNotFoundError(f"src: {src} is not a checkpoint directory (no config.json)")
    if dst == src or src in dst.parents:
        raise ValueError(f"dst ({dst}) must not be src or lie inside it")
    if dst.exists() and not force:
        raise FileExistsError(f"dst: {dst} exists; pass --force (force=True) to replace it")

    raw = json.loads((src / "config.json").read_text())
    config = AutoConfig.from_pretrained(src)  # normalised view (rope_parameters etc.)
    family = family_for(config.model_type)
    if preset is not None:
        from .model_configs import check_source, load_preset

        p = load_preset(preset)
        check_source(p, config, preset)
        attn_implementation = attn_implementation or p["attn_implementation"]
        context_length = context_length or p["context_length"]
        rope = rope or p["rope"]
        dilated_fields = {**p.get("hf_dilated", {}), **dilated_fields}
    attn_implementation = attn_implementation or "dilated"
    if attn_implementation not in NAMES:
        raise ValueError(f"attn_implementation must be one of {NAMES}, got {attn_implementation!r}")

    updates = family.convert_config(config, context_length, rope, **dilated_fields)
    new = dict(raw)
    new.update(updates)
    if "rope_parameters" in updates:
        new.pop("rope_scaling", None)  # transformers reads a legacy rope_scaling before rope_parameters
    new["attn_implementation"] = attn_implementation  # from_pretrained(DST) uses it (after `import hf_dilated`)

    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-", dir=dst.parent))
    try:
        _copy_tree(src, tmp, link_weights=not copy)
        (tmp / "config.json").unlink()
        (tmp / "config.json").write_text(json.dumps(new, indent=2, sort_keys=True) + "\n")
        if dst.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old-", dir=dst.parent))
            os.replace(dst, old / "x")
            os.replace(tmp, dst)
            shutil.rmtree(old)
        else:
            os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


def _copy_tree(src: Path, dst: Path, link_weights: bool) -> None:
    for path in sorted(src.rglob("*")):
        target = dst / path.relative_to(src)
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        if link_weights and path.name.endswith(WEIGHT_SUFFIXES):
            try:
                os.link(path, target)
                continue
            except OSError:  # another filesystem, or links not allowed: copy
                pass
        shutil.copy2(path, target)


# --- info -------------------------------------------------------------------------------------


def add_info_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", help="checkpoint directory")


def info_main(args) -> int:
    try:
        print(describe(args.dir))
    except (ValueError, TypeError, FileNotFoundError) as exc:
        print(f"hf-dilated info: error: {exc}")
        return 2
    return 0


def describe(directory) -> str:
    """A short human-readable account of what a checkpoint is configured to do."""
    from transformers import AutoConfig

    directory = Path(directory)
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(f"{directory} is not a checkpoint directory (no config.json)")
    raw = json.loads((directory / "config.json").read_text())
    config = AutoConfig.from_pretrained(directory)
    stored = CONFIG_KEY in raw
    cfg = DilatedConfig.from_model_config(config)
    rope = getattr(config, "rope_parameters", None) or {}
    lines = [
        f"checkpoint:           {directory}",
        f"model_type:           {config.model_type}",
        f"attn_implementation:  {raw.get('attn_implementation', '(not set: transformers default, sdpa)')}",
        f"max_position_embeddings: {getattr(config, 'max_position_embeddings', None)}",
        f"rope:                 {rope.get('rope_type', 'default')}"
        + (f" (factor {rope['factor']:g})" if "factor" in rope else ""),
        f"hf_dilated entry:     {'stored in config.json' if stored else 'absent: the default derived from the config'}",
        f"  original / target:  {cfg.original_length} / {cfg.target_length} tokens",
        f"  dilated:            mode={cfg.mode} segment_lengths={cfg.segment_lengths} "
        f"dilation_rates={cfg.dilation_rates}",
        f"  decode keys/query:  <= {sum(w // r for w, r in zip(cfg.segment_lengths, cfg.dilation_rates))}",
        f"  block-sparse:       block_size={cfg.block_size} pattern={json.dumps(cfg.pattern, sort_keys=True)}",
        f"  ring layout:        {cfg.ring_layout or 'that of the active sequence-parallel group'}",
    ]
    return "\n".join(lines)
