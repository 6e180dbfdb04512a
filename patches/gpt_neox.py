"""GPT-NeoX (Pythia): fused query_key_value projection, partial rotary embeddings
(`rope_parameters["partial_rotary_factor"]`), attention dispatched through AttentionInterface."""
from __future__ import annotations

from .context import convert_config

MODEL_TYPES = ("gpt_neox",)
LORA_TARGET_MODULES = ["query_key_value", "dense"]  # "dense" is the attention output (MLP: dense_h_to_4h, ...)
# Long-context LoRA (LongLoRA) also trains the embeddings and the normalisation layers.
EXTRA_TRAINABLE_MODULES = ["embed_in", "input_layernorm", "post_attention_layernorm", "final_layer_norm"]
# convert_config: context.convert_config as it is (GPT-NeoX has no sliding window).
__all__ = ["MODEL_TYPES", "LORA_TARGET_MODULES", "EXTRA_TRAINABLE_MODULES", "convert_config", "prepare_model"]


def prepare_model(model) -> None:
    """Nothing beyond the config: GPT-NeoX attention reads everything from it."""
