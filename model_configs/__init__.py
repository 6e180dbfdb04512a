"""Presets (JSON, one file each): how to convert a known checkpoint, or build a tiny test model.

A preset holds:
    description          what it is for
    model_type           the transformers model_type it applies to
    assumes              config fields the source checkpoint must have (checked by `check_source`)
    attn_implementation  one of the names hf_dilated registers
    context_length       the target context length
    rope                 "linear" | "dynamic" | "yarn" | "none"
    hf_dilated           DilatedConfig fields; those left out take the documented default
    model_config         (test models only) a complete transformers config to build the model from
"""
from __future__ import annotations

import json
from pathlib import Path

_DIR = Path(__file__).resolve().parent
_KEYS = {"description", "model_type", "assumes", "attn_implementation", "context_length", "rope", "hf_dilated",
         "model_config"}


def list_presets() -> list[str]:
    return sorted(p.stem for p in _DIR.glob("*.json"))


def load_preset(name: str) -> dict:
    """The preset's JSON, validated (ValueError naming the preset and the field otherwise)."""
    path = _DIR / f"{name}.json"
    if not path.is_file():
        raise ValueError(f"unknown preset {name!r}; available: {', '.join(list_presets())}")
    preset = json.loads(path.read_text())
    validate_preset(preset, name)
    return preset


def validate_preset(preset: dict, name: str = "<preset>") -> None:
    from hf_dilated.config import DilatedConfig
    from hf_dilated.integrations.transformers import NAMES
    from hf_dilated.patches import family_for
    from hf_dilated.patches.context import ROPE_CHOICES

    def fail(msg):
        raise ValueError(f"preset {name!r}: {msg}")

    unknown = set(preset) - _KEYS
    if unknown:
        fail(f"unknown keys {sorted(unknown)}")
    for key in ("description", "model_type", "assumes", "attn_implementation", "context_length", "rope"):
        if key not in preset:
            fail(f"missing {key!r}")
    try:
        family_for(preset["model_type"])
    except ValueError as exc:
        fail(str(exc))
    if preset["attn_implementation"] not in NAMES:
        fail(f"attn_implementation must be one of {NAMES}, got {preset['attn_implementation']!r}")
    if preset["rope"] not in ROPE_CHOICES:
        fail(f"rope must be one of {ROPE_CHOICES}, got {preset['rope']!r}")
    original = preset["assumes"].get("max_position_embeddings")
    context = preset["context_length"]
    if not isinstance(original, int) or not isinstance(context, int) or not 0 < original <= context:
        fail("needs assumes.max_position_embeddings and context_length as ints with 0 < original <= context")
    try:
        cfg = DilatedConfig.default(original, context, **preset.get("hf_dilated", {}))
    except (TypeError, ValueError) as exc:
        fail(f"hf_dilated: {exc}")
    if cfg.segment_lengths[0] != original or cfg.dilation_rates[0] != 1:
        fail("the first level must be the original context length with dilation 1 (dense where the model was trained)")
    if cfg.segment_lengths[-1] < context:
        fail(f"the last segment ({cfg.segment_lengths[-1]}) must cover context_length ({context})")
    model_config = preset.get("model_config")
    if model_config is not None:
        if model_config.get("model_type") != preset["model_type"]:
            fail("model_config.model_type must equal model_type")
        for key, value in preset["assumes"].items():
            if model_config.get(key) != value:
                fail(f"model_config.{key} = {model_config.get(key)!r} contradicts assumes.{key} = {value!r}")


def check_source(preset: dict, config, name: str = "<preset>") -> None:
    """Raises ValueError when a checkpoint's config is not what the preset assumes."""
    model_type = getattr(config, "model_type", None)
    if model_type != preset["model_type"]:
        raise ValueError(f"preset {name!r} is for model_type {preset['model_type']!r}, the checkpoint is {model_type!r}")
    from hf_dilated.patches.context import original_length

    for key, value in preset["assumes"].items():
        actual = original_length(config) if key == "max_position_embeddings" else getattr(config, key, None)
        if actual != value:
            raise ValueError(f"preset {name!r} assumes {key} = {value!r}, the checkpoint has {actual!r}")


def build_model_config(name: str):
    """The transformers config of a test-model preset (one with `model_config`)."""
    from transformers import AutoConfig

    preset = load_preset(name)
    if "model_config" not in preset:
        raise ValueError(f"preset {name!r} describes a conversion, not a test model (it has no model_config)")
    fields = dict(preset["model_config"])
    return AutoConfig.for_model(fields.pop("model_type"), **fields)
