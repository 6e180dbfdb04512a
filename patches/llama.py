"""Llama and the families that reuse its attention layout (Mistral, Qwen2).

Attention modules project with q_proj/k_proj/v_proj/o_proj, apply RoPE from
`config.rope_parameters`, and dispatch through transformers' AttentionInterface, so routing them
to hf_dilated is setting the attention implementation. Mistral and Qwen2 may carry a sliding
window: every hf_dilated name keeps it (docs/contract.md 3.3), so a model run at its own context
is unchanged; extending the context removes it (a window would hide the added context) and says so.
"""
from __future__ import annotations

import warnings

from . import context
from .context import ConversionWarning, original_length

MODEL_TYPES = ("llama", "mistral", "qwen2")
LORA_TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj"]
# Long-context LoRA (LongLoRA) also trains the embeddings and the normalisation layers.
EXTRA_TRAINABLE_MODULES = ["embed_tokens", "input_layernorm", "post_attention_layernorm", "norm"]


def convert_config(config, context_length=None, rope=None, attn_implementation=None, **dilated_fields) -> dict:
    """context.convert_config, with a sliding window removed when the context grows (it would hide
    the added context)."""
    updates = context.convert_config(config, context_length, rope, attn_implementation, **dilated_fields)
    extending = context_length is not None and context_length > original_length(config)
    if extending:
        updates.update(_without_window(config, context_length))
    return updates


def _without_window(config, context_length) -> dict:
    """The fields that switch a sliding window off, with a ConversionWarning saying so."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None) or []
    sliding = window is not None and (getattr(config, "model_type", None) != "qwen2"
                                      or any(t == "sliding_attention" for t in layer_types))
    updates = {}
    if window is not None:
        updates["sliding_window"] = None
    if getattr(config, "use_sliding_window", False):
        updates["use_sliding_window"] = False
    if any(t != "full_attention" for t in layer_types):
        updates["layer_types"] = ["full_attention"] * len(layer_types)
    if sliding:
        warnings.warn(f"sliding_window: removed the checkpoint's {window}-token sliding window, which would hide all "
                      f"but the last {window} tokens of the {context_length}-token context; the long-context pattern "
                      "bounds the cost instead", ConversionWarning, stacklevel=3)
    return updates


def prepare_model(model) -> None:
    """In-place changes a loaded model needs beyond its config once the window is off: Qwen2
    copies the window into each attention layer and records at construction whether sliding masks
    are needed."""
    if getattr(model.config, "sliding_window", None) is not None:
        return  # the window is kept
    for module in model.modules():
        if type(module).__name__.endswith("Attention") and getattr(module, "sliding_window", None) is not None:
            module.sliding_window = None
        if getattr(module, "has_sliding_layers", False):
            module.has_sliding_layers = False
