"""Transformers glue: every name of hf_dilated.kinds.TRANSFORMERS_NAMES is registered with
transformers' `AttentionInterface` (one thin adapter per name around `_attention`) and
`AttentionMaskInterface` (one mask function for all).

Masks stay O(N). The mask function never builds a (q_len x kv_len) mask: it tells the attention
which of transformers' cases it is in (ops/token_layout.py, `from_model_inputs`):
- a bool (batch, seen) padding mask when the model was given an attention mask (even an all-ones
  one) or when transformers saw no packed sequences: each row is then one document;
- an int64 (batch, q_len) tensor of document ids when transformers detected packed sequences
  from `position_ids` (it only does so without a mask and without a KV cache: then its own mask
  function separates the documents, which is how we read its decision);
- None when there is neither.
Without a registered mask function transformers would pass `attention_mask=None` to a custom
attention, silently dropping padding.
"""
from __future__ import annotations

import json

import torch

from ..config import CONFIG_KEY, RECORDED_NAME, DilatedConfig, check_block_sparse, check_int
from ..kinds import KINDS, TRANSFORMERS_NAMES
from ..ops.plan_cache import PlanCache
from ..ops.token_layout import from_model_inputs

NAMES = TRANSFORMERS_NAMES

# Keyword arguments some models pass that these kernels cannot honour: they raise, never ignore.
_UNSUPPORTED_KWARGS = {
    "softcap": "attention logit soft-capping",
    "s_aux": "attention sinks",
    "sinks": "attention sinks",
    "position_bias": "an additive position bias",
}


# --- configuration lookup ---------------------------------------------------------------------

# id(model config) -> (the entry as parsed from, its DilatedConfig, {kind name: the kind's settings})
_config_cache: dict[int, tuple[str, DilatedConfig, dict]] = {}


def _parsed(module) -> tuple[DilatedConfig, dict]:
    config = getattr(module, "config", None)
    if config is None:
        raise ValueError(
            f"{type(module).__name__} has no `config`; hf_dilated attention reads its settings from the model config"
        )
    key = json.dumps([getattr(config, CONFIG_KEY, None), getattr(config, "max_position_embeddings", None),
                      getattr(config, "rope_parameters", None)], sort_keys=True, default=str)
    cached = _config_cache.get(id(config))
    if cached is None or cached[0] != key:
        cached = (key, DilatedConfig.from_model_config(config), {})
        _config_cache[id(config)] = cached
    return cached[1], cached[2]


def config_for(module) -> DilatedConfig:
    """The DilatedConfig of the model an attention module belongs to. Parsed again whenever the
    entry (or the context it is derived from) changes, even by an in-place edit of the dict."""
    return _parsed(module)[0]


def settings_for(module, kind) -> dict:
    """The settings `kind` runs with for this module's model: its fields of the DilatedConfig, the
    block-sparse pattern built into its object. Built once per configuration (with config_for's
    parse), not on every layer call."""
    cfg, per_kind = _parsed(module)
    settings = per_kind.get(kind.name)
    if settings is None:
        settings = {name: getattr(cfg, name) for name in kind.settings}
        if "pattern" in settings:
            settings["pattern"] = check_block_sparse(settings["pattern"], settings["block_size"])
        per_kind[kind.name] = settings
    return settings


# --- mask function ----------------------------------------------------------------------------


def padding_mask(batch_size, kv_length, kv_offset=0, mask_function=None, attention_mask=None, q_length=None,
                 q_offset=None, use_vmap=False, device=None, **kwargs):
    """AttentionMaskInterface entry: what the attention needs to know of the mask (module docstring).

    The mask always covers the tokens seen so far, from the row's first. Two caches hand the
    attention a different number of keys, which it reads off the key length:
    - a static cache hands a `kv_length` larger than the tokens seen: the attention drops the
      empty cache slots beyond them;
    - a sliding-window cache keeps only the last keys (`kv_offset` > 0): the attention takes the
      mask's last `kv_length` entries, and the ranks of the tokens before them as the keys'
      first position.
    """
    if use_vmap:
        raise NotImplementedError(
            "hf_dilated attention cannot honour an or_mask_function/and_mask_function overlay (e.g. "
            "bidirectional image-token masks); only causal attention with padding and packed documents"
        )
    kv_offset = int(kv_offset or 0)
    if attention_mask is not None:
        if attention_mask.shape[-1] > kv_offset + kv_length:
            raise ValueError(f"attention_mask covers {attention_mask.shape[-1]} tokens but the keys hold "
                             f"{kv_offset + kv_length}")
        return attention_mask.to(torch.bool)
    q_offset, q_length = int(q_offset or 0), int(q_length)
    if q_offset == 0 and q_length > 1 and mask_function is not None:
        doc = _packed_documents(mask_function, batch_size, q_length, device)
        if doc is not None:
            return doc
    seen = q_offset + q_length
    # One document per row: None, unless a static cache holds empty slots beyond the tokens seen
    # or a sliding-window cache dropped the first ones.
    return None if seen == kv_length else torch.ones(batch_size, seen, dtype=torch.bool, device=device)


def _packed_documents(mask_function, batch, n, device):
    """Document ids (batch, n) when transformers' mask function separates neighbouring tokens
    (its packed-sequence overlay), else None. Evaluates it on the n - 1 neighbouring pairs only."""
    b = torch.arange(batch, device=device)[:, None]
    i = torch.arange(1, n, device=device)[None, :]
    sees_previous = torch.as_tensor(mask_function(b, torch.zeros((), dtype=torch.long, device=device), i, i - 1))
    if bool(sees_previous.all()):
        return None
    starts = torch.nn.functional.pad(~sees_previous.expand(batch, n - 1), (1, 0), value=False)
    return starts.long().cumsum(-1)


# --- the one shared adapter -------------------------------------------------------------------

# The kernel inputs derived from one model call's mask and positions, by tensor identity: every
# layer passes the same tensors, so every layer reuses them, and the kernels' plan caches hit.
_INPUTS = PlanCache()


def _logger():
    """A logger under transformers' own namespace, so that its verbosity settings
    (`transformers.logging.set_verbosity_error()`, TRANSFORMERS_VERBOSITY) govern our lines too."""
    from transformers.utils import logging

    return logging.get_logger("transformers.hf_dilated")


def _check_call(kind, module, dropout, kwargs) -> float:
    """The checks of one call, once, before any work; returns the dropout probability to apply.
    What the kind supports is its row's to say (kinds.py); every transformers name computes causal
    self-attention only (the mask function is causal), and the keyword arguments of features no
    kernel has raise rather than being ignored."""
    name = kind.name
    for key, what in _UNSUPPORTED_KWARGS.items():
        if kwargs.get(key) is not None:
            raise NotImplementedError(f"attn_implementation={name!r} does not support {what} ({key}={kwargs[key]!r})")
    if kwargs.get("output_attentions"):  # as sdpa does: say so once, return no weights, run on
        _logger().warning_once(f"`{name}` attention does not support `output_attentions=True`. Please set your "
                               "attention to `eager` if you want any of these features.")
    is_causal = kwargs.get("is_causal")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    dropout_p = float(dropout) if getattr(module, "training", False) else 0.0
    kind.check_call(is_causal=is_causal, dropout_p=dropout_p, entry=f"attn_implementation={name!r}", causal_only=True)
    check_int("sliding_window", kwargs.get("sliding_window"), optional=True)
    return dropout_p


def kernel_inputs(query, key, value, attention_mask, position_ids, *, sequence_parallel=False, cu_seq_lens=None):
    """(key, value, attention_mask, position_ids) for a kernel from what transformers passes."""
    batch, q_len = query.shape[0], query.shape[2]
    if attention_mask is not None:
        if attention_mask.dim() != 2:
            raise ValueError(
                "hf_dilated attention takes the 2-D padding mask (batch, kv_len); got a "
                f"{attention_mask.dim()}-D mask of shape {tuple(attention_mask.shape)}: custom dense masks "
                "cannot be honoured (pass a 2-D attention_mask and position_ids instead)"
            )
        seen = attention_mask.shape[-1]
        if attention_mask.dtype == torch.bool and seen < key.shape[2]:  # static cache: drop unwritten slots
            if seen < q_len:
                raise ValueError(f"attention_mask covers {seen} tokens, fewer than the {q_len} queries")
            key, value = key[:, :, :seen], value[:, :, :seen]
    if sequence_parallel:  # local shards: the distributed kernels derive the global layout
        if attention_mask is not None and attention_mask.dtype == torch.bool:
            return key, value, attention_mask, None
        return key, value, None, position_ids
    kv_len = key.shape[2]
    cache_key = (batch, q_len, kv_len, str(key.device), cu_seq_lens is not None)
    cached = _INPUTS.get(cache_key, attention_mask, position_ids)
    if cached is None:
        mask, positions = from_model_inputs(attention_mask, position_ids, batch=batch, q_len=q_len, kv_len=kv_len,
                                            device=key.device, cu_seq_lens=cu_seq_lens)
        if mask is not None and bool(mask.all()):
            mask = None  # an all-ones mask says "one document per row": so does no mask, more cheaply
        cached = (mask, positions)
        _INPUTS.put(cache_key, attention_mask, position_ids, cached)
    return key, value, *cached


def _attention(name, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """What every registered name runs: the kernel of hf_dilated.kinds.KINDS[name] on the inputs
    of transformers' rule, under the model's DilatedConfig."""
    from ..distributed.groups import resolve_group_layout

    kind = KINDS[name]
    dropout_p = _check_call(kind, module, dropout, kwargs)
    cfg = config_for(module)
    group, layout = resolve_group_layout() if kind.sequence_parallel else (None, None)
    if group is not None:
        if cfg.ring_layout is not None and cfg.ring_layout != layout:
            raise ValueError(
                f"attn_implementation={name!r}: the model config asks for ring_layout={cfg.ring_layout!r} but the "
                f"active sequence-parallel group shards sequences as {layout!r}"
            )
    if kwargs.get("cu_seq_lens_q") is not None and kwargs.get("cu_seq_lens_k") is not None and \
            not torch.equal(kwargs["cu_seq_lens_q"], kwargs["cu_seq_lens_k"]):
        raise ValueError(f"attn_implementation={name!r}: cu_seq_lens_q and cu_seq_lens_k differ; only causal "
                         "self-attention over packed sequences is supported")
    key, value, mask, positions = kernel_inputs(
        query, key, value, attention_mask, kwargs.get("position_ids"), sequence_parallel=group is not None,
        cu_seq_lens=kwargs.get("cu_seq_lens_q"))
    # The model's sliding window (Mistral, Qwen2 layers): every kernel keeps it (docs/contract.md 3.3).
    window = kwargs.get("sliding_window")
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):
        # Follow autocast as sdpa does: q, k and v in the autocast dtype (RoPE may have left q and k
        # in float32 while v comes out of a projection in bfloat16), the output in it too.
        dtype = torch.get_autocast_dtype(device_type)
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    settings = settings_for(module, kind)
    with torch.autocast(device_type, enabled=False):
        out = kind.run(query, key, value, settings, is_causal=True, attention_mask=mask, position_ids=positions,
                       scale=scaling, dropout_p=dropout_p, group=group, layout=layout, sliding_window=window)
        if group is None and mask is not None:
            out = _padded_last_query_as_sdpa(out, query, key, value, mask, scaling, window)
    # (batch, heads, q_len, head_dim) -> (batch, q_len, heads, head_dim), as sdpa_attention_forward
    return out.transpose(1, 2).contiguous(), None


def _padded_last_query_as_sdpa(out, query, key, value, mask, scale, window=None):
    """docs/contract.md 3.1 leaves outputs at padded query slots unspecified, but generate() reads
    the logits of the last slot even when it is padding (a right-padded prompt's first new token
    comes from there; docs/contract.md 3.2, "The last padded slot"). For those rows the last slot gets exactly what sdpa gives it: attention over the row's real
    keys (within the sliding window, if any). One query per row, so O(kv_len)."""
    if window is not None:  # the last slot sees the keys of index > kv_len - 1 - window only
        mask = mask & (torch.arange(mask.shape[-1], device=mask.device) >= mask.shape[-1] - window)
    rows = (~mask[:, -1] & mask.any(-1)).nonzero().squeeze(1)
    if rows.numel() == 0:
        return out
    last = torch.nn.functional.scaled_dot_product_attention(
        query[rows, :, -1:], key[rows], value[rows], attn_mask=mask[rows, None, None, :], scale=scale,
        enable_gqa=query.shape[1] != key.shape[1])
    out = out.clone()  # out of place: autograd may hold the kernel's output
    out[rows, :, -1:] = last.to(out.dtype)
    return out


def _adapter(name):
    def attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        return _attention(name, module, query, key, value, attention_mask, scaling, dropout, **kwargs)

    attention_forward.__name__ = f"{name}_attention_forward"
    attention_forward.__doc__ = f"transformers attention function of attn_implementation={name!r}."
    return attention_forward


ATTENTION_FUNCTIONS = {name: _adapter(name) for name in NAMES}


def register() -> None:
    """Registers every name with transformers and hooks model loading (both idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    for name, fn in ATTENTION_FUNCTIONS.items():
        AttentionInterface.register(name, fn)
        AttentionMaskInterface.register(name, padding_mask)
    _hook_attention_choice()


# --- the choice of attention at load time ------------------------------------------------------

# model_type -> (attn_implementation, DilatedConfig fields): the per-family defaults that
# hf_dilated.patch_family records and unpatch_family removes; the one load-time hook reads them.
FAMILY_DEFAULTS: dict[str, tuple[str, dict]] = {}


def _default_choice(config):
    """The attention a model gets when its caller names none: its family's default (patch_family),
    with its config converted as `patch` would; else the name recorded in its `hf_dilated` entry;
    else None (transformers' own choice)."""
    model_type = getattr(config, "model_type", None)
    if model_type in FAMILY_DEFAULTS:
        from ..patches import family_for

        name, fields = FAMILY_DEFAULTS[model_type]
        for key, value in family_for(model_type).convert_config(config, None, None, **fields).items():
            setattr(config, key, value)
        return name
    entry = getattr(config, CONFIG_KEY, None)
    if isinstance(entry, dict) and entry.get(RECORDED_NAME) in NAMES:
        return entry[RECORDED_NAME]
    return None


def _hook_attention_choice() -> None:
    """Wraps `PreTrainedModel._check_and_adjust_attn_implementation`, which transformers runs when
    a model is built or loaded and on `set_attn_implementation` (the one wrapper of it), so that:
    - a model whose caller names no attention gets its family's default when `patch_family`
      recorded one (FAMILY_DEFAULTS);
    - a checkpoint configured for one of our names comes back with it: `save_pretrained` drops
      `attn_implementation` from config.json, so the name is also recorded in the `hf_dilated`
      entry, which it keeps; an explicit `attn_implementation=` still wins over both;
    - choosing one of our names validates the entry and the model family there and then (a
      corrupt config.json fails at load, not at the first forward)."""
    from transformers import PreTrainedModel

    current = PreTrainedModel._check_and_adjust_attn_implementation
    if getattr(current, "_hf_dilated", False):
        return

    def _check_and_adjust_attn_implementation(self, attn_implementation, *args, **kwargs):
        if attn_implementation is None:
            attn_implementation = _default_choice(self.config)
        entry = getattr(self.config, CONFIG_KEY, None)
        if attn_implementation in NAMES:
            check_model_supported(self.config, attn_implementation)
        chosen = current(self, attn_implementation, *args, **kwargs)
        if isinstance(entry, dict) and isinstance(chosen, str):
            if chosen in NAMES:
                entry[RECORDED_NAME] = chosen
            else:
                entry.pop(RECORDED_NAME, None)
        return chosen

    _check_and_adjust_attn_implementation._hf_dilated = True
    PreTrainedModel._check_and_adjust_attn_implementation = _check_and_adjust_attn_implementation


def check_model_supported(config, name: str) -> None:
    """A ValueError unless `config` is of a family the kind `name` serves, with a valid entry."""
    KINDS[name].check_family(getattr(config, "model_type", None), entry=f"attn_implementation={name!r}")
    try:
        DilatedConfig.from_model_config(config)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"attn_implementation={name!r}: invalid 'hf_dilated' config entry: {exc}") from None
