"""`hf-dilated convert` (write a long-context copy of a checkpoint) and `hf-dilated info`.

A conversion never touches SRC and never leaves a half-written DST: it builds the new checkpoint
in a temporary directory beside DST (named after DST, this process and this host), checks it and
renames it into place at the end. A temporary directory that a killed run left is removed by the
next run for the same DST, once its process is gone. Only config.json changes; weight files are
hard-linked (byte-identical, no extra disk) where the filesystem allows, else copied; everything
else (tokenizer, generation config, ...) is copied. Symbolic links in SRC (the Hugging Face cache
layout: every file a link into ../../blobs/) are resolved: DST holds the files themselves. Because
hard links share storage, never write into a converted directory in place (e.g.
`save_pretrained(DST)` would overwrite SRC's weights through the link): save elsewhere, or
convert with `--copy`.

`--force` replaces an existing DST only when that is safe: DST must not be SRC, lie inside it,
contain it or contain a file SRC links to, and must be an empty directory or a checkpoint written
by hf-dilated (a config.json with an `hf_dilated` entry); anything else is refused.

Re-converting a converted checkpoint keeps its attention implementation and RoPE scheme unless the
options say otherwise; valid but unusual requests print a warning saying what was kept.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import secrets
import shutil
import socket
import stat
import sys
import warnings
from pathlib import Path

from .config import (BAND_NAMES, CONFIG_KEY, DEFAULT_ATTN_IMPLEMENTATION, DEFAULT_SCALED_ROPE, DILATED_MODES,
                     FAR_WINDOW_DIVISOR, RECORDED_NAME, DilatedConfig, far_keys, field_help)
from .integrations.transformers import converted_context, reading_names
from .kinds import TRANSFORMERS_NAMES as NAMES, check_transformers_name, warn_unread_settings
from .patches import family_for
from .patches.context import (MAX_CONTEXT_LENGTH, ROPE_CHOICES, ConversionWarning, check_context_length,
                              check_levels_reach, converted_before, original_length)

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
                   help="attention implementation stored in config.json (default: the preset's, else the one an "
                        f"earlier conversion stored, else {DEFAULT_ATTN_IMPLEMENTATION!r})")
    p.add_argument("--context", type=int, default=None,
                   help=f"target context length in tokens (from the original length to {MAX_CONTEXT_LENGTH:,})")
    p.add_argument("--preset", default=None, help="a model_configs preset (e.g. llama2-7b-32k)")
    p.add_argument("--rope", choices=ROPE_CHOICES, default=None,
                   help="RoPE scaling (default: the preset's, else the one an earlier conversion chose, else for an "
                        f"unscaled checkpoint 'none' with --attn {' or '.join(BAND_NAMES)} (far keys at grouped "
                        f"positions) and {DEFAULT_SCALED_ROPE!r} with the others: hf_dilated.config.default_conversion)")
    # The hf_dilated fields, with DilatedConfig's help; unset: the preset's, else the earlier
    # conversion's mode, else DilatedConfig's defaults (levels: its default schedule for --context).
    p.add_argument("--mode", choices=DILATED_MODES, default=None, help=field_help("mode"))
    p.add_argument("--segment-lengths", type=_int_list, default=None,
                   help=field_help("segment_lengths") + ", comma-separated, e.g. 4096,8192,16384")
    p.add_argument("--dilation-rates", type=_int_list, default=None,
                   help=field_help("dilation_rates") + ", comma-separated, e.g. 1,2,4")
    p.add_argument("--local-window", type=int, default=None,
                   help=field_help("local_window") + f" (default with --attn {' or '.join(BAND_NAMES)}: the original "
                        "context, when the RoPE is left unscaled)")
    p.add_argument("--far-group", type=int, default=None,
                   help=field_help("far_group") + " (default with the default band: hf_dilated.config.default_conversion)")
    p.add_argument("--far-window", type=int, default=None,
                   help=field_help("far_window") + f" (default with the default band: the original context // "
                                                   f"{FAR_WINDOW_DIVISOR})")
    p.add_argument("--far-band", type=int, default=None, help=field_help("far_band"))
    p.add_argument("--far-top-k", type=int, default=None, help=field_help("far_top_k"))
    p.add_argument("--far-block-size", type=int, default=None, help=field_help("far_block_size"))
    p.add_argument("--far-sinks", type=int, default=None, help=field_help("far_sinks"))
    p.add_argument("--copy", action="store_true", help="copy weight files instead of hard-linking them")
    p.add_argument("--force", action="store_true",
                   help="replace DST if it exists (only an empty directory or exactly what a conversion wrote there)")


def _one_line(text) -> str:
    return " ".join(str(text).split())


def convert_main(args) -> int:
    fields = {k: v for k, v in (("mode", args.mode), ("segment_lengths", args.segment_lengths),
                                ("dilation_rates", args.dilation_rates), ("local_window", args.local_window),
                                ("far_group", args.far_group), ("far_window", args.far_window),
                                ("far_band", args.far_band), ("far_top_k", args.far_top_k),
                                ("far_block_size", args.far_block_size), ("far_sinks", args.far_sinks))
              if v is not None}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ConversionWarning)
        try:
            dst = convert_checkpoint(args.src, args.dst, attn_implementation=args.attn, context_length=args.context,
                                     preset=args.preset, rope=args.rope, force=args.force, copy=args.copy, **fields)
        except (ValueError, TypeError, OSError) as exc:
            error = exc
        else:
            error = None
    for w in caught:  # ours as one line each; any other library's warning as Python shows it
        if issubclass(w.category, ConversionWarning):
            print(f"hf-dilated convert: warning: {_one_line(w.message)}", file=sys.stderr)
        else:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    if error is not None:
        print(f"hf-dilated convert: error: {_one_line(error)}", file=sys.stderr)
        return 2
    print(f"wrote {dst}")
    print(describe(dst))
    return 0


def convert_checkpoint(src, dst, *, attn_implementation=None, context_length=None, preset=None, rope=None,
                       force=False, copy=False, **dilated_fields) -> Path:
    """Writes the converted checkpoint to `dst` and returns its path. See the module docstring."""
    from transformers import AutoConfig

    src = Path(src).resolve()
    # DST's parent resolved, its last component not: a DST that is a symlink is judged as the link.
    dst = Path(os.path.abspath(dst))
    dst = dst.parent.resolve() / dst.name
    if not (src / "config.json").is_file():
        raise FileNotFoundError(f"src: {src} is not a checkpoint directory (no config.json)")
    files = _list_tree(src)
    _check_dst(src, dst, files, force)
    _clean_leftovers(dst)

    raw = _read_config(src, "src")
    config = AutoConfig.from_pretrained(src)  # normalised view (rope_parameters etc.)
    family = family_for(config.model_type)
    before = converted_before(config)
    given = dict(dilated_fields)  # the caller's (a preset's configure every name)
    if preset is not None:
        from .model_configs import check_source, load_preset

        p = load_preset(preset)
        check_source(p, config, preset)
        attn_implementation = p["attn_implementation"] if attn_implementation is None else attn_implementation
        levels = None if context_length is None or "segment_lengths" in given else p.get("hf_dilated", {}).get(
            "segment_lengths")  # the preset's levels, for a context of the caller's
        context_length = p["context_length"] if context_length is None else context_length
        rope = p["rope"] if rope is None else rope
        dilated_fields = {**p.get("hf_dilated", {}), **dilated_fields}
    if context_length is not None:
        check_context_length(config, context_length)
        if preset is not None and levels:
            check_levels_reach(levels, context_length, dilated_fields.get("local_window"),
                               f"context_length (--context) with preset {preset!r}", "pass --segment-lengths and "
                               "--dilation-rates for it, or leave out --preset")
    elif rope is not None:
        if not before:
            raise ValueError("rope: --rope needs --context (the context length to scale RoPE for)")
        context_length = converted_context(config)
        warnings.warn(f"context_length: no --context given: kept the earlier conversion's context of {context_length} "
                      f"tokens for --rope {rope}", ConversionWarning, stacklevel=2)
    if attn_implementation is None:
        earlier = recorded_name(raw)
        attn_implementation = earlier if before and earlier in NAMES else DEFAULT_ATTN_IMPLEMENTATION
        if attn_implementation != DEFAULT_ATTN_IMPLEMENTATION:
            warnings.warn(f"attn: kept the earlier conversion's attn_implementation {earlier!r} (pass "
                          "attn_implementation / --attn to change it)", ConversionWarning, stacklevel=2)
    check_transformers_name(attn_implementation)

    updates = family.convert_config(config, context_length, rope, attn_implementation, **dilated_fields)
    warn_unread_settings(attn_implementation, given)
    longest = max(updates[CONFIG_KEY]["segment_lengths"])
    if longest > 2 * MAX_CONTEXT_LENGTH:  # the default levels stay below it for any allowed --context
        raise ValueError(f"segment_lengths (--segment-lengths): a level of {longest:,} tokens is above the limit of "
                         f"{2 * MAX_CONTEXT_LENGTH:,} (2**25)")
    new = dict(raw)
    new.update(updates)
    if "rope_parameters" in updates:
        new.pop("rope_scaling", None)  # transformers reads a legacy rope_scaling before rope_parameters
    new["attn_implementation"] = attn_implementation  # from_pretrained(DST) uses it (after `import hf_dilated`)
    written = {Path("config.json"): json.dumps(new, indent=2, sort_keys=True) + "\n"}
    generation = _generation_config(src, files, config, before, updates[CONFIG_KEY]["target_length"])
    if generation is not None:
        written[Path("generation_config.json")] = generation
    _write(src, dst, files, written, link_weights=not copy, force=force)
    return dst


def _generation_config(src: Path, files, config, before: bool, target: int) -> str | None:
    """SRC's generation_config.json with a `max_length` that is the checkpoint's context (Llama-2's
    says 4096) raised to the converted one, which generate() would otherwise stop at (it reads
    max_length when given no max_new_tokens); None where nothing changes."""
    if (Path("generation_config.json"), (src / "generation_config.json").resolve()) not in files:
        return None
    try:
        raw = json.loads((src / "generation_config.json").read_text())
    except ValueError:  # (transformers reads it as it can; copied as it is)
        return None
    length = raw.get("max_length") if isinstance(raw, dict) else None
    contexts = {original_length(config)} | ({converted_context(config)} if before else set())
    if not isinstance(length, int) or isinstance(length, bool) or length not in contexts or length == target:
        return None
    warnings.warn(f"generation_config.json: max_length {length} (the checkpoint's context) became {target}, the "
                  "converted context, which generate() reads when given no max_new_tokens", ConversionWarning,
                  stacklevel=3)
    return json.dumps({**raw, "max_length": target}, indent=2, sort_keys=True) + "\n"


# --- what SRC holds, and whether DST may be (re)placed ------------------------------------------


def _list_tree(src: Path) -> list[tuple[Path, Path | None]]:
    """(path relative to src, the real file it is or links to; None for a directory) for everything
    under src, in a stable order. Links are followed, so DST gets files, never links."""
    out = []

    def walk(directory: Path, rel: Path, ancestors: frozenset) -> None:
        for entry in sorted(os.scandir(directory), key=lambda e: e.name):
            path = Path(entry.path)
            real = path.resolve()
            if not real.exists():
                raise FileNotFoundError(f"src: {path} is a broken symbolic link (to {os.readlink(path)})")
            if real.is_dir():
                if real in ancestors:
                    raise ValueError(f"src: {path} links back to {real}, a directory that contains it")
                out.append((rel / entry.name, None))
                walk(real, rel / entry.name, ancestors | {real})
            elif real.is_file():
                out.append((rel / entry.name, real))
            else:
                raise ValueError(f"src: {path} is neither a regular file nor a directory")

    walk(src, Path(), frozenset({src}))
    return out


def _within(path: Path, directory: Path) -> bool:
    return path == directory or directory in path.parents


def _check_dst(src: Path, dst: Path, files, force: bool) -> None:
    for where in {dst, dst.resolve()}:  # the link and what it points to, when DST is a link
        if _within(where, src) or _within(src, where):
            raise ValueError(
                f"dst: {dst} must not be src, lie inside it or contain it (src: {src}); refusing, whatever --force says"
            )
        for rel, real in files:
            if real is not None and _within(real, where):
                raise ValueError(f"dst: {dst} must not contain {real}, which src's {rel} links to; refusing, "
                                 "whatever --force says")
    if not os.path.lexists(dst):
        return
    if not force:
        raise FileExistsError(f"dst: {dst} exists; pass --force (force=True) to replace it")
    if dst.is_symlink() or not dst.is_dir():
        raise ValueError(f"dst: {dst} is not a directory (or is a symbolic link); --force replaces only an empty "
                         "directory or a checkpoint written by hf-dilated convert")
    if any(dst.iterdir()):
        changed = _changed_since_written(dst)
        if changed is not None:
            raise ValueError(f"dst: {dst} is not a checkpoint hf-dilated convert wrote as it is now ({changed}); "
                             "refusing to replace it even with --force: remove it yourself or choose another DST")


# What a conversion wrote, file by file, so that --force replaces only that: a directory with an
# hf_dilated entry may also be a fine-tuned model saved from a converted one (save_pretrained writes
# the entry too), which --force must never destroy.
MANIFEST = "hf_dilated_conversion.json"


def _file_records(directory: Path) -> dict:
    """{relative path: record} of every file under directory but the manifest: weights by size and
    modification time, which links and copy2 keep from SRC (no weight is read), the others (small;
    config.json is written anew) by their bytes' hash: the same SRC gives the same manifest."""
    records = {}
    for path in sorted(directory.rglob("*")):
        rel = path.relative_to(directory).as_posix()
        if rel == MANIFEST or path.is_dir() and not path.is_symlink():
            continue
        info = os.lstat(path)
        if path.is_symlink():  # (a conversion writes none: one added since is recorded, never followed)
            records[rel] = {"link": os.readlink(path)}
        elif rel.endswith(WEIGHT_SUFFIXES):
            records[rel] = {"size": info.st_size, "mtime_ns": info.st_mtime_ns}
        else:
            records[rel] = {"sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    return records


def _changed_since_written(directory: Path) -> str | None:
    """None when directory holds exactly what a conversion's manifest lists, else what differs."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
        listed = manifest["files"]
    except (OSError, ValueError, TypeError, KeyError):
        return f"no readable {MANIFEST}"
    try:
        found = _file_records(directory)
    except OSError as exc:  # (unreadable: not replaced)
        return f"{exc.filename} cannot be read: {exc.strerror}"
    differ = sorted(set(found) ^ set(listed) | {rel for rel in set(found) & set(listed) if found[rel] != listed[rel]})
    if differ:
        return f"{len(differ)} file(s) added, removed or changed since, e.g. {differ[0]}"
    return None


# --- temporary directories: named after DST, process and host, so a later run knows whose they are


_HOST = re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname()) or "localhost"


def temporary_dir(dst: Path, kind: str) -> Path:
    """A new directory beside dst (mode from the umask, unlike tempfile.mkdtemp's 0700)."""
    while True:
        path = dst.parent / f".{dst.name}.{kind}-{os.getpid()}@{_HOST}-{secrets.token_hex(4)}"
        try:
            os.mkdir(path)
            return path
        except FileExistsError:
            continue


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _clean_leftovers(dst: Path) -> None:
    """Removes the temporary directories of earlier runs for dst on this host whose process is gone.
    A run killed between moving the old DST aside and moving the new one in left the old DST in its
    `.old-` directory: with no DST in place, that is put back first."""
    pattern = re.compile(rf"\.{re.escape(dst.name)}\.(tmp|old)-(\d+)@(.+)-[0-9a-f]{{8}}")
    try:
        entries = sorted(os.scandir(dst.parent), key=lambda e: e.name)
    except OSError:  # no parent yet, or not readable: nothing of ours there
        return
    for entry in entries:
        match = pattern.fullmatch(entry.name)
        if not match or match[3] != _HOST or _alive(int(match[2])) or not entry.is_dir(follow_symlinks=False):
            continue
        path = Path(entry.path)
        if match[1] == "old" and not os.path.lexists(dst) and os.path.isdir(path / "previous"):
            try:
                os.rename(path / "previous", dst)
            except OSError:  # another run got there first
                pass
        shutil.rmtree(path, ignore_errors=True)


# --- writing ----------------------------------------------------------------------------------


def _write(src: Path, dst: Path, files, written: dict, link_weights: bool, force: bool) -> None:
    """DST: SRC's files, those in `written` ({relative path: text}) with that text instead."""
    created = []  # parents of dst this run made: removed again if it fails
    for parent in reversed([dst.parent, *dst.parent.parents]):
        if not parent.exists():
            try:
                os.mkdir(parent)
            except FileExistsError:
                continue
            except OSError as exc:
                _remove_empty(created)
                raise type(exc)(f"dst: cannot create {parent}: {exc.strerror}") from None
            created.append(parent)
    try:
        tmp = temporary_dir(dst, "tmp")
    except OSError as exc:
        _remove_empty(created)
        raise type(exc)(f"dst: cannot create {dst}: {exc.strerror} (in {dst.parent})") from None
    try:
        for rel, real in files:
            target = tmp / rel
            if real is None:
                target.mkdir()
            elif rel not in written:
                _place(real, target, link=link_weights and rel.name.endswith(WEIGHT_SUFFIXES))
        for rel, text in written.items():
            (tmp / rel).write_text(text)
        _verify_weights(tmp, files)
        (tmp / MANIFEST).write_text(json.dumps({"written_by": "hf-dilated convert", "files": _file_records(tmp)},
                                               indent=1, sort_keys=True) + "\n")
        if os.path.lexists(dst):
            if not force:  # appeared while this run was copying
                raise FileExistsError(f"dst: {dst} exists; pass --force (force=True) to replace it")
            old = temporary_dir(dst, "old")
            os.rename(dst, old / "previous")
            os.rename(tmp, dst)
            shutil.rmtree(old)
        else:
            os.rename(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_empty(created)
        raise


def _remove_empty(directories) -> None:
    for directory in reversed(directories):
        try:
            os.rmdir(directory)
        except OSError:
            pass


def _place(real: Path, target: Path, link: bool) -> None:
    if link:
        try:
            os.link(real, target)  # `real` is a file, never a link: the new name shares its data
            return
        except OSError:  # another filesystem, or links not allowed: copy
            pass
    shutil.copy2(real, target)


def _verify_weights(tmp: Path, files) -> None:
    """Every weight file in tmp is a readable regular file with the bytes of the one in SRC."""
    for rel, real in files:
        if real is None or not rel.name.endswith(WEIGHT_SUFFIXES):
            continue
        path = tmp / rel
        if not stat.S_ISREG(os.lstat(path).st_mode):
            raise OSError(f"dst: {rel} was not written as a regular file")
        with open(path, "rb") as written:
            if os.path.samefile(path, real):
                continue  # a hard link: the same data, no need to read it
            with open(real, "rb") as original:
                while True:
                    a, b = written.read(1 << 24), original.read(1 << 24)
                    if a != b:
                        raise OSError(f"dst: {rel} differs from src's {real} after copying")
                    if not a:
                        break


# --- info -------------------------------------------------------------------------------------


def add_info_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", help="checkpoint directory")


def _read_config(directory: Path, argument: str) -> dict:
    """The checkpoint's config.json as a dict, or a ValueError naming the argument and the file."""
    path = directory / "config.json"
    try:
        raw = json.loads(path.read_text())
    except ValueError as exc:
        raise ValueError(f"{argument}: {path} is not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{argument}: {path} holds a JSON {type(raw).__name__}, not a config object")
    return raw


def info_main(args) -> int:
    try:
        print(describe(args.dir))
    except (ValueError, TypeError, OSError) as exc:
        print(f"hf-dilated info: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    return 0


def recorded_name(raw: dict) -> str | None:
    """The attention a config.json (as a dict) loads with when the caller names none: its
    `attn_implementation`, else the name recorded in its `hf_dilated` entry (save_pretrained drops
    the first and keeps the second: integrations/transformers.py)."""
    entry = raw.get(CONFIG_KEY)
    return raw.get("attn_implementation") or (entry.get(RECORDED_NAME) if isinstance(entry, dict) else None)


def describe(directory) -> str:
    """A short human-readable account of what a checkpoint is configured to do."""
    from transformers import AutoConfig

    directory = Path(directory)
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(f"dir: {directory} is not a checkpoint directory (no config.json)")
    raw = _read_config(directory, "dir")
    config = AutoConfig.from_pretrained(directory)
    family_for(config.model_type)  # (a family convert refuses has no hf_dilated account either)
    stored = CONFIG_KEY in raw
    cfg = DilatedConfig.from_model_config(config)
    rope = getattr(config, "rope_parameters", None) or {}
    positions = getattr(config, "max_position_embeddings", None)
    level_keys = sum(w // r for w, r in zip(cfg.segment_lengths, cfg.dilation_rates))
    keys = level_keys if cfg.local_window is None else level_keys + cfg.local_window
    if cfg.target_length is not None:
        keys = min(keys, cfg.target_length)
    if cfg.far_top_k is not None:  # inside the band all of it; past it the band, the sinks' and chosen blocks' keys
        band = cfg.local_window if cfg.far_band is None else cfg.far_band
        keys = min(keys, max(cfg.local_window, band + (cfg.far_top_k + cfg.far_sinks) * cfg.far_block_size))
    far = far_keys(cfg.to_dict())
    kept = reading_names(config)
    how = "far keys at grouped positions" if kept and kept[2] == BAND_NAMES else "the entry's attention"
    context = (f"{kept[1]} tokens under {', '.join(kept[2])} ({how}); {kept[0]} under any other attention or "
               "engine (max_position_embeddings: its RoPE is unscaled, longer inputs are read wrongly)" if kept
               else f"{positions} tokens (max_position_embeddings)")
    lines = [
        f"checkpoint:           {directory}",
        f"model_type:           {config.model_type}",
        f"attn_implementation:  {recorded_name(raw) or '(not set: transformers default, sdpa)'}",
        f"context:              {context}",
        f"rope:                 {rope.get('rope_type', 'default')}"
        + (f" (factor {rope['factor']:g})" if "factor" in rope else "")
        + {True: "; written by hf_dilated's conversion (scaled_rope: a later conversion scales it again)",
           False: "; the checkpoint's own, kept by hf_dilated's conversion (scaled_rope: a later conversion keeps it)",
           None: ""}[cfg.scaled_rope],
        f"hf_dilated entry:     {'stored in config.json' if stored else 'absent: the default derived from the config'}",
        f"  original / target:  {cfg.original_length} / {cfg.target_length} tokens",
        f"  dilated:            mode={cfg.mode} segment_lengths={cfg.segment_lengths} "
        f"dilation_rates={cfg.dilation_rates}",
        "  local band:         " + ("none" if cfg.local_window is None else
                                    f"every key within {cfg.local_window} positions of its query (local_window)"),
        "  far keys:           " + ("at their own positions" if far is None else
                                    f"beyond the band, at Self-Extend's grouped positions: {far[1]} positions share "
                                    f"one (far_group), neighbour window {far[0]} (far_window)"),
        "  band past it:       " + ("the same" if cfg.far_band is None else
                                    f"{cfg.far_band} positions for a query at a position >= {cfg.local_window} "
                                    "(far_band)"),
        "  far keys read:      " + ("every one" if cfg.far_top_k is None else
                                    f"the first {cfg.far_sinks} block(s) of the document and the {cfg.far_top_k} "
                                    f"blocks of {cfg.far_block_size} positions with the highest bound on the "
                                    "query's score (far_sinks, far_top_k, far_block_size)"),
        f"  decode keys/query:  <= {keys}" + ("" if cfg.far_top_k is None else " (blocks tied at the k-th bound add theirs)"),
        f"  block-sparse:       block_size={cfg.block_size} pattern={json.dumps(cfg.pattern, sort_keys=True)}",
        f"  ring layout:        {cfg.ring_layout or 'that of the active sequence-parallel group'}",
    ]
    return "\n".join(lines)
