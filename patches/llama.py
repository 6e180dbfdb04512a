"""Llama and the families that reuse its attention layout (Mistral, Qwen2).

Attention modules project with q_proj/k_proj/v_proj/o_proj, apply RoPE from
`config.rope_parameters`, and dispatch through transformers' AttentionInterface, so routing them
to hf_dilated is setting the attention implementation. Mistral and Qwen2 may carry a sliding
window, which the long-context patterns replace: it is switched off.
"""
from __future__ import annotations

from .context import dilated_entry, rope_updates

MODEL_TYPES = ("llama", "mistral", "qwen2")
PRETRAINED_CLASSES = {
    "llama": "transformers.models.llama.modeling_llama.LlamaPreTrainedModel",
    "mistral": "transformers.models.mistral.modeling_mistral.MistralPreTrainedModel",
    "qwen2": "transformers.models.qwen2.modeling_qwen2.Qwen2PreTrainedModel",
}
LORA_TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj"]
# Long-context LoRA (LongLoRA) also trains the embeddings and the normalisation layers.
EXTRA_TRAINABLE_MODULES = ["embed_tokens", "input_layernorm", "post_attention_layernorm", "norm"]


def convert_config(config, context_length=None, rope=None, **dilated_fields) -> dict:
    """Top-level config fields that configure `config` for hf_dilated at `context_length`."""
    updates = rope_updates(config, context_length, rope) if context_length is not None else {}
    updates["hf_dilated"] = dilated_entry(config, context_length, **dilated_fields)
    if getattr(config, "sliding_window", None) is not None:
        updates["sliding_window"] = None
    if getattr(config, "use_sliding_window", False):
        updates["use_sliding_window"] = False
    layer_types = getattr(config, "layer_types", None)
    if layer_types and any(t != "full_attention" for t in layer_types):
        updates["layer_types"] = ["full_attention"] * len(layer_types)
    return updates


def prepare_model(model) -> None:
    """In-place changes a loaded model needs beyond its config: Qwen2 copies the window into each
    attention layer and records at construction whether sliding masks are needed."""
    for module in model.modules():
        if type(module).__name__.endswith("Attention") and getattr(module, "sliding_window", None) is not None:
            module.sliding_window = None
        if getattr(module, "has_sliding_layers", False):
            module.has_sliding_layers = False
