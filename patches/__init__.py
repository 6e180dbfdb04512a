"""Model families hf_dilated knows how to convert: one module per family.

Each family module exposes MODEL_TYPES, LORA_TARGET_MODULES, EXTRA_TRAINABLE_MODULES,
`convert_config(config, context_length=None, rope=None, **dilated_fields) -> dict` and
`prepare_model(model)`. The attention kinds serve exactly these families (hf_dilated/kinds.py).
"""
from __future__ import annotations

from . import gpt_neox, llama

FAMILIES = (llama, gpt_neox)


def supported_model_types() -> list[str]:
    return [t for family in FAMILIES for t in family.MODEL_TYPES]


def family_for(model_type: str):
    """The family module for a transformers `model_type`, or a ValueError listing the supported ones."""
    for family in FAMILIES:
        if model_type in family.MODEL_TYPES:
            return family
    raise ValueError(
        f"hf_dilated does not support model_type {model_type!r}; supported: {', '.join(supported_model_types())}"
    )
