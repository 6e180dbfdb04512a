"""GPT-NeoX (Pythia): fused query_key_value projection, partial rotary embeddings
(`rope_parameters["partial_rotary_factor"]`), attention dispatched through AttentionInterface."""
from __future__ import annotations

from .context import default_conversion, dilated_entry, rope_updates

MODEL_TYPES = ("gpt_neox",)
LORA_TARGET_MODULES = ["query_key_value", "dense"]  # "dense" is the attention output (MLP: dense_h_to_4h, ...)
# Long-context LoRA (LongLoRA) also trains the embeddings and the normalisation layers.
EXTRA_TRAINABLE_MODULES = ["embed_in", "input_layernorm", "post_attention_layernorm", "final_layer_norm"]


def convert_config(config, context_length=None, rope=None, attn_implementation=None, **dilated_fields) -> dict:
    """Top-level config fields that configure `config` for hf_dilated at `context_length`, for
    `attn_implementation` (what the unset RoPE and band default to: context.default_conversion)."""
    rope, dilated_fields = default_conversion(config, context_length, attn_implementation, rope, dilated_fields)
    updates = rope_updates(config, context_length, rope) if context_length is not None else {}
    updates["hf_dilated"] = dilated_entry(config, context_length, **dilated_fields)
    return updates


def prepare_model(model) -> None:
    """Nothing beyond the config: GPT-NeoX attention reads everything from it."""
