"""The far projections of a local band (docs/contract.md 4.1) for a transformers model: its queries
and keys, which arrive already rotated by the model's RoPE, rotated on to Self-Extend's grouped
positions (hf_dilated.ops.rope), with the model's own rotary frequencies."""
from __future__ import annotations

import sys

import torch

from ..ops.rope import grouped_far_positions, rotate_by
from ..ops.token_layout import mask_ranks, token_layout

_inv_freq: dict[int, tuple[str, torch.Tensor]] = {}


def rotary_frequencies(module) -> torch.Tensor:
    """inv_freq of the model an attention module belongs to, from its family's own rotary class
    (scaled RoPE included). Dynamic NTK changes its frequencies with the length: refused."""
    config = module.config
    params = dict(getattr(config, "rope_parameters", None) or {})
    key = repr(sorted(params.items())) + repr(getattr(config, "max_position_embeddings", None))
    cached = _inv_freq.get(id(config))
    if cached is not None and cached[0] == key:
        return cached[1]
    if params.get("rope_type", "default") == "dynamic":
        raise ValueError("far_group: grouped far positions need fixed rotary frequencies; dynamic NTK RoPE changes "
                         "them with the length (convert with --rope none or yarn, or set far_group to 1)")
    modeling = sys.modules[type(module).__module__]
    classes = [obj for name, obj in vars(modeling).items()
               if name.endswith("RotaryEmbedding") and isinstance(obj, type)]
    if not classes:
        raise ValueError(f"far_group: {type(module).__name__} has no rotary embedding class beside it; grouped far "
                         "positions need RoPE (set far_group to 1)")
    inv_freq = classes[0](config=config).inv_freq.detach().float()
    _inv_freq[id(config)] = (key, inv_freq)
    return inv_freq


def far_projections(module, query, key, mask, positions, window: int, group: int):
    """(q_far, k_far): query (batch, heads, q_len, d) and key (batch, kv_heads, kv_len, d) moved
    from their positions under the kernels' rule (the ones the band is measured in) to grouped ones,
    for Self-Extend's neighbour window `window` (DilatedConfig.grouping_window)."""
    layout = token_layout(key.shape[0], key.shape[2], key.device, mask, positions)
    return far_projections_at(module, query, key, layout.positions, window, group)


def far_projections_at(module, query, key, positions, window: int, group: int):
    """far_projections given the keys' positions (batch, kv_len) under the kernels' rule; under
    sequence parallelism the ring kernel passes its shard's global positions (a rank cannot tell
    them from its shard of a padding mask)."""
    query_delta, key_delta = grouped_far_positions(positions, query.shape[2], window, group)
    inv_freq = rotary_frequencies(module)
    return rotate_by(query, query_delta, inv_freq), rotate_by(key, key_delta, inv_freq)


def far_projections_static(module, query, key, real, seen, window: int, group: int):
    """far_projections for a compiled decode step on a static cache (ops/dilated_decode.py:
    dilated_decode_static): positions are mask ranks, computed without any Python value from data."""
    positions = mask_ranks(real).clamp(min=0)
    query_slots = seen - query.shape[2] + torch.arange(query.shape[2], device=key.device)
    query_delta, _ = grouped_far_positions(positions.index_select(1, query_slots), query.shape[2], window, group)
    key_delta = positions // group - positions
    inv_freq = rotary_frequencies(module)
    return rotate_by(query, query_delta, inv_freq), rotate_by(key, key_delta, inv_freq)
