"""Context-length conversion shared by the model families: RoPE scaling and the hf_dilated entry.

Works on a transformers config object (already normalised by transformers 5.x, so old
`rope_scaling` / `rotary_emb_base` keys have become `rope_parameters`) and returns the top-level
config fields to set, so the same result can patch a loaded model or a config.json.
"""
from __future__ import annotations

import warnings

from hf_dilated.config import (BAND_NAMES, CONFIG_KEY, DilatedConfig, check_int, context_lengths, default_band,
                               default_conversion, kept_rope_context)
from hf_dilated.integrations.rotary import check_fixed_frequencies

ROPE_CHOICES = ("linear", "dynamic", "yarn", "none")
_OURS = ("linear", "dynamic", "yarn")
# Far beyond any context this package is meant for, yet small enough that a mistyped length fails
# here rather than as a multi-gigabyte allocation at the top dilated level of the first forward.
MAX_CONTEXT_LENGTH = 2**24


class ConversionWarning(UserWarning):
    """A valid but unusual conversion request: the message says what was kept instead."""


def converted_before(config) -> bool:
    """Whether `config` carries an hf_dilated entry (an earlier conversion wrote it)."""
    return isinstance(getattr(config, CONFIG_KEY, None), dict)


def original_length(config) -> int:
    """The pretraining context length: recorded by an earlier conversion, else from the config."""
    block = getattr(config, CONFIG_KEY, None)
    if isinstance(block, dict) and isinstance(block.get("original_length"), int):
        return block["original_length"]
    return context_lengths(config)[0]


def _earlier_target(config) -> int | None:
    block = getattr(config, CONFIG_KEY, None)
    return block.get("target_length") if isinstance(block, dict) else None


def _kept_rope_for_far_keys(config) -> bool:
    """Whether an earlier conversion lengthened `config` keeping its RoPE unscaled for far keys at
    grouped positions (the default conversion), which only the names in BAND_NAMES read."""
    kept = kept_rope_context(config)
    return kept is not None and kept[2]


def convert_config(config, context_length=None, rope=None, attn_implementation=None, **dilated_fields) -> dict:
    """The top-level config fields that configure `config` for hf_dilated at `context_length`, for
    `attn_implementation` (what an unset RoPE and band default to: `with_defaults`), shared by the
    families (a family adds what its own layers need)."""
    check_conversion_arguments(config, context_length, rope)
    rope_context = context_length  # the context the RoPE is scaled for (None: kept as it is)
    if context_length is None and rope is None and _kept_rope_for_far_keys(config) and attn_implementation not in (
            None, *BAND_NAMES):
        # A new name alone, for a conversion that kept the RoPE for far keys: its RoPE is scaled for
        # the earlier target, as with_defaults does given a context (kept, the name would read no
        # further than the original context, and nothing said so); the entry stays as it was.
        rope_context = _earlier_target(config)
    rope, dilated_fields = with_defaults(config, rope_context, attn_implementation, rope, dilated_fields)
    updates = rope_updates(config, rope_context, rope) if rope_context is not None else {}
    updates[CONFIG_KEY] = dilated_entry(config, context_length, **dilated_fields)
    if rope_context is not None and "scaled_rope" not in dilated_fields:
        # whether this conversion wrote the RoPE scaling: one it kept (the checkpoint's own, or an
        # earlier conversion's kept with rope='none') is kept by the next conversion too
        updates[CONFIG_KEY]["scaled_rope"] = "rope_parameters" in updates
    rope_parameters = updates.get("rope_parameters", getattr(config, "rope_parameters", None))
    far_group = updates[CONFIG_KEY].get("far_group") or 1
    if attn_implementation in BAND_NAMES:  # (the names that read far keys at grouped positions)
        try:
            check_fixed_frequencies(rope_parameters, far_group)
        except ValueError as exc:
            raise ValueError(f"rope={rope!r}: {exc}" if rope == "dynamic" else str(exc)) from None
    covered = updates.get("max_position_embeddings", config.max_position_embeddings)
    kept = dict(rope_parameters or {}).get("rope_type", "default")
    if (context_length is not None and context_length > covered and far_group == 1 and rope is None
            and kept != "dynamic"):  # (dynamic NTK stretches past max_position_embeddings by design)
        # (a scaled RoPE kept as it is: rope_updates' choice for a checkpoint already scaled)
        warnings.warn(f"rope: the checkpoint's RoPE (rope_type={dict(rope_parameters or {}).get('rope_type')!r}) is "
                      f"kept, and covers {covered} tokens (max_position_embeddings), not {context_length}: far keys "
                      "at grouped positions (local_window, far_group > 1) read past it",
                      ConversionWarning, stacklevel=3)
    return updates


def check_conversion_arguments(config, context_length, rope) -> None:
    """A ValueError naming `context_length` or `rope` when a conversion cannot take them: a RoPE
    scaling is a choice for a new context, so `rope` needs `context_length` (it was ignored)."""
    if context_length is not None:
        check_context_length(config, context_length)
    check_rope(rope)
    if rope is not None and context_length is None:
        raise ValueError(f"rope={rope!r} scales the RoPE for a new context: pass context_length (--context) with it")


def check_rope(rope) -> None:
    """A ValueError unless `rope` is one of ROPE_CHOICES or None."""
    if rope is not None and rope not in ROPE_CHOICES:
        raise ValueError(f"rope must be one of {ROPE_CHOICES} or None, got {rope!r}")


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


def with_defaults(config, context_length: int | None, attn_implementation: str | None, rope: str | None,
                  fields: dict) -> tuple[str | None, dict]:
    """(rope, hf_dilated fields) with what the caller left unset taken from the default conversion
    (config.default_conversion, where it is decided), when it applies: a first conversion that
    lengthens a checkpoint with an unscaled RoPE, with no RoPE scaling asked for. A band the caller
    chose is kept whole (the RoPE is then kept too); anything else the caller set, and any earlier
    conversion's choice, is kept."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    unscaled = params.get("rope_type", "default") == "default"
    if (context_length is not None and rope is None and _kept_rope_for_far_keys(config)
            and attn_implementation not in (None, *BAND_NAMES) and context_length > original_length(config)):
        # The earlier conversion kept the RoPE for far keys at grouped positions, which this name does
        # not read: kept, it would give the new name no more than the original context.
        rope = default_conversion(original_length(config), context_length, attn_implementation)[0]
        warnings.warn(f"rope: {attn_implementation!r} reads no far keys at grouped positions, so the earlier "
                      f"conversion's unscaled RoPE became {rope!r} for {context_length} tokens, as a first conversion "
                      "for it chooses (pass rope / --rope to choose)", ConversionWarning, stacklevel=4)
        return rope, fields
    if (context_length is None or rope is not None or converted_before(config)
            or not unscaled or context_length <= original_length(config)):
        return rope, fields
    # a band is defined for mode "union" alone (docs/contract.md 4.1): another mode gets what the
    # names without a band get (it failed on the band it was given)
    banded = attn_implementation if fields.get("mode", "union") == "union" else None
    rope, band = default_conversion(original_length(config), context_length, banded)
    if band and {"local_window", "far_group", "far_window"} & set(fields):  # the caller chose the band
        return rope, fields
    return rope, {**band, **fields}


def _scaled_by_us(config, params: dict) -> bool:
    """Whether the RoPE scaling of `config` is an earlier hf_dilated conversion's, not the checkpoint's
    own: a scaling the checkpoint came with (kept by a conversion) must not be replaced as if it were
    ours. The entry records it (DilatedConfig.scaled_rope); an entry from before that field has only
    the factor to go by (ours is its target over the original context, which a checkpoint's own
    factor may equal by chance)."""
    if not converted_before(config) or params.get("rope_type", "default") not in _OURS:
        return False
    recorded = getattr(config, CONFIG_KEY).get("scaled_rope")
    if isinstance(recorded, bool):
        return recorded
    target = _earlier_target(config) or original_length(config)
    return abs(float(params.get("factor", 1.0)) - max(1.0, target / original_length(config))) < 1e-9


def rope_updates(config, context_length: int, rope: str | None = None) -> dict:
    """Config fields that give a RoPE model `context_length` tokens of context.

    rope: "linear" (position interpolation, factor = context / original), "dynamic" (dynamic NTK:
    max_position_embeddings stays the original length, frequencies stretch beyond it), "yarn",
    or "none" (keep the checkpoint's RoPE, and with it the context it supports: see below). None
    keeps the scheme of an earlier hf_dilated conversion,
    else picks "linear" for an unscaled checkpoint and "none" for one whose RoPE is already scaled.
    `context_length` must lie between the original context and MAX_CONTEXT_LENGTH. Choices that
    keep something other than asked for are told with a ConversionWarning.
    """
    check_rope(rope)
    check_context_length(config, context_length)
    params = dict(getattr(config, "rope_parameters", None) or {})
    if not params or "rope_theta" not in params:
        raise ValueError(f"{type(config).__name__} has no rope_parameters: cannot rescale its positions")
    original = original_length(config)
    current = params.get("rope_type", "default")
    before = converted_before(config)
    ours = _scaled_by_us(config, params)
    if rope is None and ours:
        rope = current  # re-converting: keep the scheme the earlier conversion chose
        if rope != "linear":  # what a first conversion would pick: say so when it differs
            warnings.warn(f"rope: kept the earlier conversion's {rope!r} RoPE scaling, now for {context_length} "
                          "tokens (pass rope / --rope to change it)", ConversionWarning, stacklevel=3)
    elif rope is None and before and current == "default" and (_earlier_target(config) or 0) > original:
        # An earlier conversion lengthened the context with rope='none': it wanted positions unscaled.
        rope = "none"
        warnings.warn(f"rope: kept the earlier conversion's unscaled RoPE (rope='none') for {context_length} tokens "
                      "(pass rope / --rope to scale it)", ConversionWarning, stacklevel=3)
    elif rope is None:  # default_conversion chose already for a first conversion; keep a scaled RoPE as it is
        rope = "linear" if current == "default" else "none"
    if rope == "none":
        # The RoPE is kept, and so is the context it supports: max_position_embeddings, which every
        # engine that ignores the hf_dilated entry reads, stays what the checkpoint covers by
        # itself, so that none of them reads positions the model never saw; the extended context
        # is the entry's target_length, which hf_dilated's attention reads (README, "Converting").
        # (An earlier conversion by an older hf_dilated may have raised it: put back.)
        if before and current == "default" and config.max_position_embeddings != original:
            return {"max_position_embeddings": original}
        return {}
    if current != "default" and not ours:
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
_KEPT_ON_RECONVERT = ("mode", "block_size", "pattern", "ring_layout", "local_window", "far_group", "far_window")


def dilated_entry(config, context_length: int | None = None, **fields) -> dict:
    """The `hf_dilated` entry for `config` at `context_length` (None: the configured one).

    Starts from the checkpoint's entry when it has one (a new context length recomputes the
    segments and the default band, keeping mode, block size, pattern, ring layout and a band the
    caller chose, with its far grouping), else from the documented default
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
        earlier_target = existing.get("target_length") or original
        earlier = default_band(original, earlier_target) if earlier_target > original else None
        if earlier is not None and all(existing.get(k) == v for k, v in earlier.items()):
            # an earlier default conversion: the default band of the new length
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
    entry = DilatedConfig.default(original, target, **base).to_dict()
    if context_length is not None and "segment_lengths" in fields:  # (the default levels always reach it)
        check_levels_reach(entry["segment_lengths"], target, entry.get("local_window"),
                           "segment_lengths (--segment-lengths)", f"make the last segment at least {target} tokens, or "
                           "leave segment_lengths and dilation_rates to the default")
    return entry


def check_levels_reach(segment_lengths, target: int, local_window: int | None, argument: str, remedy: str) -> None:
    """A ValueError naming `argument` when levels chosen for a new context end before it: no key
    further back than the last segment is read there. A band as long as the context reads every key
    whatever the levels (docs/contract.md 4.1)."""
    if max(segment_lengths) < target and (local_window or 0) < target:
        raise ValueError(f"{argument}: the levels end at {max(segment_lengths)} tokens, so no key further back than "
                         f"that is read at a context of {target}: {remedy}")
