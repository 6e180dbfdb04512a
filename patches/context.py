"""Context-length conversion shared by the model families: RoPE scaling and the hf_dilated entry.

Works on a transformers config object (already normalised by transformers 5.x, so old
`rope_scaling` / `rotary_emb_base` keys have become `rope_parameters`) and returns the top-level
config fields to set, so the same result can patch a loaded model or a config.json.
"""
from __future__ import annotations

import warnings

from hf_dilated.config import CONFIG_KEY, DilatedConfig, check_int, context_lengths, default_band

ROPE_CHOICES = ("linear", "dynamic", "yarn", "none")
_OURS = ("linear", "dynamic", "yarn")
# Far beyond any context this package is meant for, yet small enough that a mistyped length fails
# here rather than as a multi-gigabyte allocation at the top dilated level of the first forward.
MAX_CONTEXT_LENGTH = 2**24


class ConversionWarning(UserWarning):
    """A valid but unusual conversion request: the message says what was kept instead."""


def original_length(config) -> int:
    """The pretraining context length: recorded by an earlier conversion, else from the config."""
    block = getattr(config, CONFIG_KEY, None)
    if isinstance(block, dict) and isinstance(block.get("original_length"), int):
        return block["original_length"]
    return context_lengths(config)[0]


def check_context_length(config, context_length) -> int:
    """`context_length` if a conversion of `config` can target it, else a ValueError saying why."""
    name = "context_length (--context)"
    check_int(name, context_length)
    if context_length > MAX_CONTEXT_LENGTH:
        raise ValueError(f"{name} {context_length:,} is above the limit of {MAX_CONTEXT_LENGTH:,} tokens (2**24)")
    original = original_length(config)
    if context_length < original:
        raise ValueError(
            f"{name} {context_length} is shorter than the checkpoint's original context of {original} tokens: "
            "a conversion can only lengthen it"
        )
    return context_length


# The names the default conversion gives a local band (docs/contract.md 4.1): the dilated pattern's,
# on one process or across ranks.
BAND_NAMES = ("dilated", "dilated_ring")


def default_conversion(config, context_length: int | None, attn_implementation: str | None, rope: str | None,
                       fields: dict) -> tuple[str | None, dict]:
    """The default conversion, written once: (rope, hf_dilated fields) for what the caller left unset.

    A first conversion that lengthens an unscaled checkpoint, with no RoPE scaling asked for, keeps
    the checkpoint's RoPE ("none") and, for "dilated" and "dilated_ring", unites the levels with the
    default band (config.default_band: the original context read as trained, far keys at grouped
    positions): a pretrained model survives it without fine-tuning, and within its original context
    it is unchanged. For the other names the far keys need scaled positions: YaRN, which costs a
    model far less inside its context than position interpolation ("linear"), a recipe that needs
    fine-tuning. Anything the caller set, and any earlier conversion's choice, is kept."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    first = not isinstance(getattr(config, CONFIG_KEY, None), dict)
    if (context_length is None or rope is not None or not first or params.get("rope_type", "default") != "default"
            or context_length <= original_length(config)):
        return rope, fields
    if attn_implementation not in BAND_NAMES:
        return "yarn", fields
    if {"local_window", "far_group", "far_window"} & set(fields):  # the caller chose the band
        return "none", fields
    return "none", {**default_band(original_length(config), context_length), **fields}


def rope_updates(config, context_length: int, rope: str | None = None) -> dict:
    """Config fields that give a RoPE model `context_length` tokens of context.

    rope: "linear" (position interpolation, factor = context / original), "dynamic" (dynamic NTK:
    max_position_embeddings stays the original length, frequencies stretch beyond it), "yarn",
    or "none" (keep the checkpoint's RoPE). None keeps the scheme of an earlier hf_dilated conversion,
    else picks "linear" for an unscaled checkpoint and "none" for one whose RoPE is already scaled.
    `context_length` must lie between the original context and MAX_CONTEXT_LENGTH. Choices that
    keep something other than asked for are told with a ConversionWarning.
    """
    if rope is not None and rope not in ROPE_CHOICES:
        raise ValueError(f"rope must be one of {ROPE_CHOICES} or None, got {rope!r}")
    check_context_length(config, context_length)
    params = dict(getattr(config, "rope_parameters", None) or {})
    if not params or "rope_theta" not in params:
        raise ValueError(f"{type(config).__name__} has no rope_parameters: cannot rescale its positions")
    original = original_length(config)
    current = params.get("rope_type", "default")
    converted_before = isinstance(getattr(config, CONFIG_KEY, None), dict)
    if rope is None and converted_before and current in _OURS:
        rope = current  # re-converting: keep the scheme the earlier conversion chose
        if rope != "linear":  # what a first conversion would pick: say so when it differs
            warnings.warn(f"rope: kept the earlier conversion's {rope!r} RoPE scaling, now for {context_length} "
                          "tokens (pass rope / --rope to change it)", ConversionWarning, stacklevel=3)
    elif rope is None and converted_before and current == "default" and config.max_position_embeddings > original:
        # An earlier conversion lengthened the context with rope='none': it wanted positions unscaled.
        rope = "none"
        warnings.warn(f"rope: kept the earlier conversion's unscaled RoPE (rope='none') for {context_length} tokens "
                      "(pass rope / --rope to scale it)", ConversionWarning, stacklevel=3)
    elif rope is None:  # default_conversion chose already for a first conversion; keep a scaled RoPE as it is
        rope = "linear" if current == "default" else "none"
    if rope == "none":
        if current == "dynamic":  # dynamic NTK reads max_position_embeddings as the original length
            return {}
        # What the checkpoint covers by itself: its max_position_embeddings, unless an earlier
        # conversion set that (then the original length it recorded).
        own = original if converted_before else config.max_position_embeddings
        if context_length < own:
            warnings.warn(f"max_position_embeddings: kept max_position_embeddings = {own} (the checkpoint's own RoPE "
                          f"covers more than the {context_length} tokens asked for; only the hf_dilated levels use "
                          "the new length)", ConversionWarning, stacklevel=3)
        return {"max_position_embeddings": max(context_length, own)}
    if current != "default" and not (converted_before and current in _OURS):
        raise ValueError(
            f"the checkpoint's RoPE is already scaled (rope_type={current!r}); converting it to {rope!r} would "
            "discard that scaling: pass rope='none' (--rope none) to keep it"
        )
    factor = max(1.0, context_length / original)
    new = {"rope_type": rope, "rope_theta": params["rope_theta"], "factor": factor}
    if "partial_rotary_factor" in params:
        new["partial_rotary_factor"] = params["partial_rotary_factor"]
    if rope == "yarn":
        new["original_max_position_embeddings"] = original
    max_positions = original if rope == "dynamic" else max(context_length, original)
    return {"rope_parameters": new, "max_position_embeddings": max_positions}


# Fields an earlier conversion chose that a new context length does not invalidate.
_KEPT_ON_RECONVERT = ("mode", "block_size", "pattern", "ring_layout", "local_window")


def dilated_entry(config, context_length: int | None = None, **fields) -> dict:
    """The `hf_dilated` entry for `config` at `context_length` (None: the configured one).

    Starts from the checkpoint's entry when it has one (a new context length recomputes the
    segments and the default band's far group, keeping mode, block size, pattern, ring layout and
    the band), else from the documented default
    (DilatedConfig); explicit `fields` override both.
    """
    existing = getattr(config, CONFIG_KEY, None)
    existing = dict(existing) if isinstance(existing, dict) else {}
    original = original_length(config)
    if context_length is None:
        base = existing
        target = existing.get("target_length") or context_lengths(config)[1]
    else:
        check_context_length(config, context_length)
        base = {k: existing[k] for k in _KEPT_ON_RECONVERT if k in existing}
        target = context_length
        chosen = {k: existing[k] for k in ("segment_lengths", "dilation_rates") if k in existing}
        default_band_before = existing.get("local_window") == original and existing.get("far_group", 1) > 1
        if default_band_before:  # an earlier default conversion: the default band of the new length
            band = default_band(original, max(target, original + 1))
            base.update({k: v for k, v in band.items() if k not in fields})
        elif chosen and not {"segment_lengths", "dilation_rates"} & set(fields):
            default = DilatedConfig.default(original, existing.get("target_length") or original)
            if chosen != {"segment_lengths": default.segment_lengths, "dilation_rates": default.dilation_rates}:
                warnings.warn(f"hf_dilated: the earlier conversion's own levels {chosen} were replaced by the default "
                              f"ones for {context_length} tokens (pass segment_lengths and dilation_rates to "
                              "keep or choose levels)", ConversionWarning, stacklevel=3)
    base = {k: v for k, v in base.items() if k not in ("original_length", "target_length")}
    base.update(fields)
    return DilatedConfig.default(original, target, **base).to_dict()
