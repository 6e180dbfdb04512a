"""Converting models to hf_dilated attention: one loaded model (`patch`), or a whole family
(`patch_family`: every later model of that family defaults to ours), and the LoRA settings of
long-context fine-tuning (`lora_config`)."""
from __future__ import annotations

import dataclasses

from .config import DEFAULT_ATTN_IMPLEMENTATION, DilatedConfig, default_band
from .integrations.rotary import link_rotary
from .integrations.transformers import FAMILY_DEFAULTS, record_choice
from .kinds import check_transformers_name, warn_unread_settings
from .patches import family_for


def patch(model, attn_implementation: str = DEFAULT_ATTN_IMPLEMENTATION, *, context_length: int | None = None,
          rope: str | None = None, **dilated_fields):
    """Converts an already-loaded transformers model in place and returns it.

    context_length: extend the model to this many tokens (RoPE scaling per `rope`: "linear",
        "dynamic", "yarn" or "none"; see hf_dilated.patches.context.rope_updates). None keeps the
        configured context.
    dilated_fields: DilatedConfig fields (segment_lengths, dilation_rates, mode, block_size,
        pattern, ring_layout) overriding the default derived from the model config.
    """
    check_transformers_name(attn_implementation)
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "set_attn_implementation"):
        raise TypeError(f"model: hf_dilated.patch takes a transformers model (a PreTrainedModel), got "
                        f"{type(model).__name__}")
    family = family_for(getattr(config, "model_type", None))
    updates = family.convert_config(config, context_length, rope, attn_implementation, **dilated_fields)
    warn_unread_settings(attn_implementation, dilated_fields)
    before = {name: getattr(config, name, _MISSING) for name in updates}
    for name, value in updates.items():
        setattr(config, name, value)
    try:  # the rotary modules from the new config first: where transformers cannot build them, nothing changed
        rotary = _rotary_embeddings(model) if "rope_parameters" in updates or "max_position_embeddings" in updates else []
    except Exception as exc:
        for name, value in before.items():
            if value is _MISSING:
                delattr(config, name)
            else:
                setattr(config, name, value)
        raise ValueError(f"rope: transformers could not build the model's rotary embedding with the converted RoPE "
                         f"parameters {updates.get('rope_parameters')!r} ({type(exc).__name__}: {exc}); the model is "
                         f"unchanged") from exc
    family.prepare_model(model)
    for parent, attr, module in rotary:
        setattr(parent, attr, module)
    model.set_attn_implementation(attn_implementation)
    record_choice(config, attn_implementation)  # (transformers skips the load-time hook for the same name)
    link_rotary(model)  # (a rebuilt rotary module, or a model built before hf_dilated was imported)
    return model


_MISSING = object()


def _rotary_embeddings(model) -> list:
    """(parent, attribute, module): each rotary module built again from its (new) config. Rotary
    modules compute their frequencies at construction."""
    rebuilt = []
    for name, module in list(model.named_modules()):
        if not type(module).__name__.endswith("RotaryEmbedding") or not hasattr(module, "config"):
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        device = module.inv_freq.device if hasattr(module, "inv_freq") else None
        rebuilt.append((parent, attr, type(module)(config=module.config).to(device)))
    return rebuilt


# --- family-level patch -----------------------------------------------------------------------


def patch_family(model_type: str, attn_implementation: str = DEFAULT_ATTN_IMPLEMENTATION, **dilated_fields) -> None:
    """Makes every model of `model_type` built from now on (from_pretrained, from_config, direct
    construction) use `attn_implementation` when the caller requests none, with its config
    converted as `patch` would (without changing its context length). An explicit
    `attn_implementation=` still wins, and so does the one a config.json names at its top level
    (what `hf-dilated convert` writes; transformers hands both over alike), not the name recorded
    in an `hf_dilated` entry (what save_pretrained keeps). Undo with `unpatch_family`.

    Records the family's default, which the one load-time hook (integrations/transformers.py)
    reads; nothing of transformers is wrapped here."""
    check_transformers_name(attn_implementation)
    family_for(model_type)  # a ValueError listing the supported families
    # The fields are checked now, as for a model of 4,096 tokens with or without the default band (each
    # load lays them over its checkpoint's entry and checks them again): a misspelt or invalid one
    # failed every later load of the family instead.
    try:
        DilatedConfig.default(4096, **dilated_fields)
    except ValueError:
        DilatedConfig.default(4096, **{**default_band(4096, 8192), **dilated_fields})
    FAMILY_DEFAULTS[model_type] = (attn_implementation, dict(dilated_fields))


def unpatch_family(model_type: str) -> None:
    """Undoes `patch_family` (no-op when the family is not patched)."""
    FAMILY_DEFAULTS.pop(model_type, None)


# --- LoRA -------------------------------------------------------------------------------------


def lora_config(model_or_model_type, *, r: int = 8, lora_alpha: int = 16, lora_dropout: float = 0.0,
                long_context: bool = True, **kwargs):
    """A peft.LoraConfig for a supported family: LoRA on the attention projections and, with
    `long_context=True` (LongLoRA), the embeddings and normalisation layers fully trained and saved
    with the adapter; given a model whose output head is its input embedding, the two stay tied
    (peft's `ensure_weight_tying`). Any peft field passed wins."""
    from peft import LoraConfig

    model_type = model_or_model_type
    if not isinstance(model_type, str):
        model_type = getattr(getattr(model_or_model_type, "config", None), "model_type", None)
    family = family_for(model_type)
    # the family's targets and extra trained modules unless the caller names others (peft's own fields)
    kwargs.setdefault("target_modules", list(family.LORA_TARGET_MODULES))
    kwargs.setdefault("modules_to_save", list(family.EXTRA_TRAINABLE_MODULES) if long_context else None)
    if kwargs["modules_to_save"] and _ties_embeddings(model_or_model_type) and "ensure_weight_tying" in {
            f.name for f in dataclasses.fields(LoraConfig)}:  # (peft >= 0.18)
        # A model whose output head is its input embedding (SmolLM2, Qwen2-0.5B): trained apart, the
        # embeddings left the head behind, peft said so, and the merged model came out untied (one
        # matrix the size of the vocabulary more). Kept tied, both train as the model was built.
        kwargs.setdefault("ensure_weight_tying", True)
    return LoraConfig(r=r, lora_alpha=lora_alpha, lora_dropout=lora_dropout, task_type="CAUSAL_LM", **kwargs)


def _ties_embeddings(model) -> bool:
    """Whether a model (not a model_type: its config says) ties its output head to its input embeddings."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return bool(getattr(text, "tie_word_embeddings", False))
