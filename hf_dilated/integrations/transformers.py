"""Transformers glue: one attention function per registered name, and one mask function for all.

`register()` (run by `import hf_dilated`) adds "dilated", "dilated_ring", "ring", "block_sparse"
and "block_sparse_ring" to transformers' `AttentionInterface` and `AttentionMaskInterface`.

Masks stay O(N). The mask function hands the attention the 2-D padding mask (batch, kv_len)
unchanged, or None when there is no padding; it never builds a (q_len x kv_len) mask. Without
a registered mask function transformers would pass `attention_mask=None` to a custom attention,
silently dropping padding. Positions arrive in `kwargs["position_ids"]` (Llama and GPT-NeoX pass
them through to the attention function).

Key positions (SPEC.md "Positions, padding, packing"):
- prefill / training (q_len == kv_len): `position_ids` as given (packed documents restart at 0),
  except that the model's own default, 0..n-1 in every row, is replaced by the positions the
  padding mask implies (`cumsum(mask) - 1`): a left-padded row then computes what it computes alone,
  as with `generate()`, which passes mask-derived positions itself;
- decode / chunked prefill (q_len < kv_len, KV cache): the cached keys' positions come from the
  padding mask (or 0..kv_len-1 without one); the new tokens' `position_ids` must agree with them,
  otherwise a ValueError (e.g. packed documents cannot be continued from a cache).
"""
from __future__ import annotations

import torch

from ..ops import dilated_attention
from ..ops.block_patterns import make_pattern
from .config import DilatedConfig

NAMES = ("dilated", "dilated_ring", "ring", "block_sparse", "block_sparse_ring")

# Keyword arguments some models pass that these kernels cannot honour: they raise, never ignore.
_UNSUPPORTED_KWARGS = {
    "softcap": "attention logit soft-capping",
    "sliding_window": "a sliding window (set config.sliding_window = None; hf_dilated.patch does)",
    "s_aux": "attention sinks",
    "sinks": "attention sinks",
    "position_bias": "an additive position bias",
}


# --- configuration lookup ---------------------------------------------------------------------

_config_cache: dict[int, tuple[object, DilatedConfig]] = {}


def config_for(module) -> DilatedConfig:
    """The DilatedConfig of the model an attention module belongs to (parsed once per entry)."""
    config = getattr(module, "config", None)
    if config is None:
        raise ValueError(
            f"{type(module).__name__} has no `config`; hf_dilated attention reads its settings from the model config"
        )
    raw = getattr(config, "hf_dilated", None)
    key = (raw, getattr(config, "max_position_embeddings", None), str(getattr(config, "rope_parameters", None)))
    cached = _config_cache.get(id(config))
    if cached is not None and cached[0] == key:
        return cached[1]
    parsed = DilatedConfig.from_model_config(config)
    _config_cache[id(config)] = (key, parsed)
    return parsed


# --- mask function ----------------------------------------------------------------------------


def padding_mask(
    batch_size,
    kv_length,
    kv_offset=0,
    mask_function=None,
    attention_mask=None,
    q_length=None,
    q_offset=None,
    use_vmap=False,
    device=None,
    **kwargs,
):
    """AttentionMaskInterface entry: returns the 2-D padding mask (batch, seen + q_len) as bool, or None.

    A static cache hands a `kv_length` larger than the tokens seen so far: the mask then covers
    only the seen tokens and the attention function drops the empty cache slots beyond it.
    """
    if use_vmap:
        raise NotImplementedError(
            "hf_dilated attention cannot honour an or_mask_function/and_mask_function overlay (e.g. "
            "bidirectional image-token masks); only causal attention with padding and packed documents"
        )
    if kv_offset:
        raise NotImplementedError(
            f"hf_dilated attention needs the whole key sequence from position 0, got kv_offset={kv_offset} "
            "(sliding-window or chunked caches are not supported)"
        )
    if attention_mask is not None:
        if attention_mask.shape[-1] > kv_length:
            raise ValueError(
                f"attention_mask covers {attention_mask.shape[-1]} tokens but the keys hold {kv_length}"
            )
        seen, device = attention_mask.shape[-1], attention_mask.device
        if not bool(attention_mask.all()):
            return attention_mask.to(torch.bool)
    else:
        seen = int(q_offset) + int(q_length)
    # No padding: None, unless a static cache holds empty slots beyond the tokens seen so far.
    return None if seen == kv_length else torch.ones(batch_size, seen, dtype=torch.bool, device=device)


# --- shared argument handling -----------------------------------------------------------------


def _check_kwargs(module, name, kwargs):
    for key, what in _UNSUPPORTED_KWARGS.items():
        if kwargs.get(key) is not None:
            raise NotImplementedError(f"attn_implementation={name!r} does not support {what} ({key}={kwargs[key]!r})")
    is_causal = kwargs.get("is_causal")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    if not is_causal:
        raise NotImplementedError(f"attn_implementation={name!r} computes causal attention only (is_causal=False)")
    if kwargs.get("position_ids") is None and kwargs.get("cu_seq_lens_q") is not None:
        raise NotImplementedError(
            f"attn_implementation={name!r} reads packed documents from position_ids, not cu_seq_lens; pass position_ids"
        )


def kernel_inputs(query, key, value, attention_mask, position_ids):
    """Turns what transformers passes into the kernel's (key, value, attention_mask, position_ids).

    attention_mask: None or the 2-D bool mask from `padding_mask`; position_ids: None or
    (batch or 1, q_len). See the module docstring for the rules.
    """
    batch, q_len, kv_len = query.shape[0], query.shape[2], key.shape[2]
    if attention_mask is not None:
        if attention_mask.dim() != 2:
            raise ValueError(
                "hf_dilated attention takes the 2-D padding mask (batch, kv_len); got a "
                f"{attention_mask.dim()}-D mask of shape {tuple(attention_mask.shape)}: custom dense masks "
                "cannot be honoured (pass a 2-D attention_mask and position_ids instead)"
            )
        if attention_mask.shape[-1] < kv_len:  # static cache: drop the slots not written yet
            if attention_mask.shape[-1] < q_len:
                raise ValueError(
                    f"attention_mask covers {attention_mask.shape[-1]} tokens, fewer than the {q_len} queries"
                )
            key, value = key[:, :, : attention_mask.shape[-1]], value[:, :, : attention_mask.shape[-1]]
            kv_len = key.shape[2]
    if position_ids is None:
        return key, value, attention_mask, None
    if position_ids.dim() != 2 or position_ids.shape[-1] != q_len:
        raise ValueError(f"position_ids must have shape (batch, q_len={q_len}), got {tuple(position_ids.shape)}")
    position_ids = position_ids.to(key.device).expand(batch, q_len)
    default = torch.arange(kv_len - q_len, kv_len, device=key.device)
    if q_len == kv_len:
        if bool((position_ids == default).all()):
            return key, value, attention_mask, None  # the model's default: derive from the mask
        return key, value, attention_mask, position_ids
    # Decode: the kernel derives cached positions from the mask; the new tokens must agree.
    if attention_mask is not None:
        derived = (attention_mask.long().cumsum(-1) - 1)[:, -q_len:]
        real = attention_mask[:, -q_len:]
    else:
        derived, real = default.expand(batch, q_len), torch.ones_like(position_ids, dtype=torch.bool)
    agrees = (position_ids == derived) | (position_ids == default) | ~real
    if not bool(agrees.all()):
        raise ValueError(
            "position_ids of the new tokens do not continue the cached keys' positions, which hf_dilated "
            "derives from the attention mask (cumsum(mask) - 1); packed documents or custom positions "
            "cannot be continued from a KV cache"
        )
    return key, value, attention_mask, None


def _finish(out):
    # (batch, heads, q_len, head_dim) -> (batch, q_len, heads, head_dim), as sdpa_attention_forward
    return out.transpose(1, 2).contiguous(), None


def _dropout(module, dropout):
    return float(dropout) if getattr(module, "training", False) else 0.0


def _sequence_parallel(cfg: DilatedConfig, name: str):
    """(group, layout) of the active sequence-parallel group, or (None, None) when there is none."""
    from .. import distributed

    group = distributed.get_sequence_parallel_group()
    if group is None:
        return None, None
    layout = distributed.get_sequence_parallel_layout()
    if cfg.ring_layout is not None and cfg.ring_layout != layout:
        raise ValueError(
            f"attn_implementation={name!r}: the model config asks for ring_layout={cfg.ring_layout!r} but the "
            f"active sequence-parallel group shards sequences as {layout!r}"
        )
    return group, layout


def _distributed_kernel(fn_name: str, name: str):
    from .. import distributed

    fn = getattr(distributed, fn_name, None)
    if fn is None:
        raise NotImplementedError(
            f"attn_implementation={name!r} under sequence parallelism needs hf_dilated.distributed.{fn_name}, "
            "which is not available in this build"
        )
    return fn


def _block_sparse_kernel(name: str):
    try:
        from ..ops.block_sparse import block_sparse_attention
    except ImportError as exc:
        raise NotImplementedError(
            f"attn_implementation={name!r} needs hf_dilated.ops.block_sparse_attention, which is not "
            f"available in this build ({exc})"
        ) from None
    return block_sparse_attention


# --- one function per registered name ---------------------------------------------------------


def dilated_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    _check_kwargs(module, "dilated", kwargs)
    cfg = config_for(module)
    key, value, mask, positions = kernel_inputs(query, key, value, attention_mask, kwargs.get("position_ids"))
    out = dilated_attention(
        query, key, value, cfg.segment_lengths, cfg.dilation_rates, mode=cfg.mode, scale=scaling,
        dropout_p=_dropout(module, dropout), attention_mask=mask, position_ids=positions,
    )
    return _finish(out)


def ring_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    _check_kwargs(module, "ring", kwargs)
    cfg = config_for(module)
    group, layout = _sequence_parallel(cfg, "ring")
    if group is not None:  # q/k/v, mask and positions are this rank's shards of the global sequence
        out = _distributed_kernel("ring_attention", "ring")(
            query, key, value, group=group, layout=layout, scale=scaling, attention_mask=attention_mask,
            position_ids=kwargs.get("position_ids"), dropout_p=_dropout(module, dropout),
        )
        return _finish(out)
    # One process: exact dense causal attention = a single level covering the whole sequence.
    key, value, mask, positions = kernel_inputs(query, key, value, attention_mask, kwargs.get("position_ids"))
    out = dilated_attention(
        query, key, value, [key.shape[2]], [1], scale=scaling, dropout_p=_dropout(module, dropout),
        attention_mask=mask, position_ids=positions,
    )
    return _finish(out)


def dilated_ring_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    _check_kwargs(module, "dilated_ring", kwargs)
    cfg = config_for(module)
    group, layout = _sequence_parallel(cfg, "dilated_ring")
    if group is None:
        return dilated_attention_forward(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
    out = _distributed_kernel("dilated_ring_attention", "dilated_ring")(
        query, key, value, cfg.segment_lengths, cfg.dilation_rates, mode=cfg.mode, group=group, layout=layout,
        scale=scaling, attention_mask=attention_mask, position_ids=kwargs.get("position_ids"),
        dropout_p=_dropout(module, dropout),
    )
    return _finish(out)


def block_sparse_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    _check_kwargs(module, "block_sparse", kwargs)
    block_sparse_attention = _block_sparse_kernel("block_sparse")
    if _dropout(module, dropout) > 0.0:
        raise NotImplementedError("attn_implementation='block_sparse' has no attention dropout; set attention_dropout=0")
    cfg = config_for(module)
    key, value, mask, positions = kernel_inputs(query, key, value, attention_mask, kwargs.get("position_ids"))
    out = block_sparse_attention(
        query, key, value, make_pattern(cfg.pattern), block_size=cfg.block_size, is_causal=True, scale=scaling,
        attention_mask=mask, position_ids=positions,
    )
    return _finish(out)


def block_sparse_ring_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    _check_kwargs(module, "block_sparse_ring", kwargs)
    cfg = config_for(module)
    group, layout = _sequence_parallel(cfg, "block_sparse_ring")
    if group is None:
        return block_sparse_attention_forward(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
    if _dropout(module, dropout) > 0.0:
        raise NotImplementedError("attn_implementation='block_sparse_ring' has no attention dropout")
    out = _distributed_kernel("block_sparse_ring_attention", "block_sparse_ring")(
        query, key, value, make_pattern(cfg.pattern), block_size=cfg.block_size, group=group, layout=layout,
        scale=scaling, attention_mask=attention_mask, position_ids=kwargs.get("position_ids"),
    )
    return _finish(out)


ATTENTION_FUNCTIONS = {
    "dilated": dilated_attention_forward,
    "dilated_ring": dilated_ring_attention_forward,
    "ring": ring_attention_forward,
    "block_sparse": block_sparse_attention_forward,
    "block_sparse_ring": block_sparse_ring_attention_forward,
}


def register() -> None:
    """Registers every name with transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    for name, fn in ATTENTION_FUNCTIONS.items():
        AttentionInterface.register(name, fn)
        AttentionMaskInterface.register(name, padding_mask)
