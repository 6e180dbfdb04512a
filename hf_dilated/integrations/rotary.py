"""The rotary frequencies of a transformers model, for the far keys of a local band
(docs/contract.md 4.1): its queries and keys arrive already rotated by the model's RoPE, and the
kinds rotate them on to Self-Extend's grouped positions (ops/rope.py) with these frequencies. The
glue caches them with the rest of the model's entry (transformers.py: rope_frequencies_for)."""
from __future__ import annotations

import sys

import torch


def check_fixed_frequencies(rope_parameters, far_group: int) -> None:
    """A ValueError naming far_group where far keys at grouped positions (far_group > 1) meet a RoPE
    whose frequencies change with the length (dynamic NTK): checked for the names that read far keys
    (config.BAND_NAMES) at conversion, at load and at the first call."""
    if far_group > 1 and dict(rope_parameters or {}).get("rope_type", "default") == "dynamic":
        raise ValueError(f"far_group={far_group}: grouped far positions need fixed rotary frequencies; dynamic NTK "
                         "RoPE changes them with the length (convert with --rope none, linear or yarn, or set "
                         "far_group to 1)")


def rotary_frequencies(module, far_group: int) -> torch.Tensor:
    """inv_freq of the model an attention module belongs to, from its family's own rotary class
    (scaled RoPE included), for far keys grouped by `far_group`. Dynamic NTK changes its
    frequencies with the length: refused."""
    config = module.config
    check_fixed_frequencies(getattr(config, "rope_parameters", None), far_group)
    modeling = sys.modules[type(module).__module__]
    classes = [obj for name, obj in vars(modeling).items()
               if name.endswith("RotaryEmbedding") and isinstance(obj, type)]
    if not classes:
        raise ValueError(f"far_group: {type(module).__name__} has no rotary embedding class beside it; grouped far "
                         "positions need RoPE (set far_group to 1)")
    return classes[0](config=config).inv_freq.detach().float()
