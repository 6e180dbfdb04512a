"""Transformers glue: every name of hf_dilated.kinds.TRANSFORMERS_NAMES is registered with
transformers' `AttentionInterface` (one thin adapter per name around `_attention`) and
`AttentionMaskInterface` (one mask function for all, `padding_mask`).

transformers' rule for tokens (docs/contract.md 3.2: the mask function, caches, packed
sequences, cu_seq_lens, the last padded slot) is model_inputs.py's; this module registers it and
runs the kernels on what it returns.
"""
from __future__ import annotations

import copy
import functools
import weakref
from dataclasses import dataclass, field

import torch

from ..config import (BAND_NAMES, CONFIG_KEY, RECORDED_NAME, DilatedConfig, check_block_sparse, check_int, far_keys,
                      kept_rope_context)
from ..kinds import KINDS, TRANSFORMERS_NAMES
from .rotary import check_fixed_frequencies, link_rotary, model_rotary, rotary_frequencies
from .model_inputs import (is_static_slots, kernel_inputs, static_rope_shift, padded_last_query_as_sdpa, padding_mask,
                           read_static_slots)

NAMES = TRANSFORMERS_NAMES

# Keyword arguments some models pass that these kernels cannot honour: they raise, never ignore.
_UNSUPPORTED_KWARGS = {
    "softcap": "attention logit soft-capping",
    "s_aux": "attention sinks",
    "sinks": "attention sinks",
    "position_bias": "an additive position bias",
}


# --- configuration lookup ---------------------------------------------------------------------

@dataclass
class _ModelEntry:
    """What the attention reads of one model config, parsed once per configuration: its
    DilatedConfig, each kind's settings, and the rotary frequencies of its far keys."""

    source: tuple  # deep copies of what it was parsed from (the entry, the context, the RoPE)
    config: DilatedConfig
    owner: object = None  # weakref.ref to the model config: an id is reused once its object is freed
    settings: dict = field(default_factory=dict)  # kind name -> the kind's settings
    rope_frequencies: dict | None = None  # device -> (its source, inv_freq, None), without a rotary module


# id(model config) -> its _ModelEntry
_entries: dict[int, _ModelEntry] = {}


def _source(config) -> tuple:
    return (getattr(config, CONFIG_KEY, None), getattr(config, "max_position_embeddings", None),
            getattr(config, "rope_parameters", None))


def _entry(module) -> _ModelEntry:
    config = getattr(module, "config", None)
    if config is None:
        raise ValueError(
            f"{type(module).__name__} has no `config`; hf_dilated attention reads its settings from the model config"
        )
    entry = _entries.get(id(config))
    if torch.compiler.is_compiling():
        # A compiled step reads the entry the eager prefill parsed (comparing configs cannot be
        # traced; a config edited between compiled steps is not seen: recompile after such an edit)
        return entry if entry is not None else _ModelEntry((), DilatedConfig.from_model_config(config))
    source = _source(config)
    # a comparison, not a serialisation, on every layer call
    if entry is None or entry.owner() is not config or entry.source != source:
        entry = _ModelEntry(copy.deepcopy(source), DilatedConfig.from_model_config(config), weakref.ref(config))
        _entries[id(config)] = entry
    return entry


def config_for(module) -> DilatedConfig:
    """The DilatedConfig of the model an attention module belongs to. Parsed again whenever the
    entry (or the context it is derived from) changes, even by an in-place edit of the dict."""
    return _entry(module).config


def settings_for(module, kind) -> dict:
    """The settings `kind` runs with for this module's model: its fields of the DilatedConfig, the
    block-sparse pattern built into its object. Built once per configuration (with config_for's
    parse), not on every layer call."""
    entry = _entry(module)
    settings = entry.settings.get(kind.name)
    if settings is None:
        settings = {name: getattr(entry.config, name) for name in kind.settings}
        if "pattern" in settings:
            settings["pattern"] = check_block_sparse(settings["pattern"], settings["block_size"])
        entry.settings[kind.name] = settings
    return settings


def rope_frequencies_for(module, settings, device) -> torch.Tensor | None:
    """The inv_freq the kind needs for far keys at grouped positions (config.far_keys), those the
    model's rotary module runs (rotary.model_rotary: a model cast to bfloat16 runs rounded ones;
    without one, its family's rotary class from the config), on `device`; None when the settings
    have none. Kept per device with the rotary module (so models that share a config keep their
    own), made again when its buffer changes: a copy from the host inside a step would wait for the
    device (and a CUDA graph cannot capture it)."""
    if far_keys(settings) is None:
        return None
    rotary = model_rotary(module)
    if rotary is None:
        entry = _entry(module)
        if entry.rope_frequencies is None:
            entry.rope_frequencies = _LayerState()
        held, buffer = entry.rope_frequencies.get(device), None
    else:
        if "_hf_dilated_frequencies" not in rotary.__dict__:
            rotary.__dict__["_hf_dilated_frequencies"] = _LayerState()  # (copies and pickles take it empty)
        held, buffer = rotary.__dict__["_hf_dilated_frequencies"].get(device), rotary.inv_freq
    if held is not None and torch.compiler.is_compiling():
        return held[1]  # (the eager calls before keep it current; a compiled graph cannot compare)
    source = None if buffer is None else (id(buffer), buffer.dtype, buffer.device,
                                          None if buffer.is_inference() else buffer._version)
    if held is None or held[0] != source:
        # made outside inference mode: an inference tensor has no version counter, and a GPU's compiled
        # DynamicCache step keeps its turn table by the frequencies' version (made again every step without)
        with torch.inference_mode(False):
            frequencies = rotary_frequencies(module, settings["far_group"], rotary).to(device)
        # (the buffer is held, so that its id is not reused while it is compared)
        held = (source, frequencies, buffer)
        (entry.rope_frequencies if rotary is None else rotary.__dict__["_hf_dilated_frequencies"])[device] = held
    return held[1]


# --- the one shared adapter -------------------------------------------------------------------

def _warn_one_process_name_under_a_group(name: str, group) -> None:
    """A one-process name under setup_sequence_parallel attends within each process's tokens: fed
    shard_batch's shards it computes another model, with nothing said (a review: loss 4.155742
    against 4.154078). Said once; a process may also run whole rows on purpose."""
    import torch.distributed as dist

    if dist.get_world_size(group) > 1:
        _logger().warning_once(
            f"attn_implementation={name!r} attends within this process's tokens, while a sequence-parallel group "
            f"of {dist.get_world_size(group)} processes is set up (setup_sequence_parallel): batches of shard_batch "
            "are shards of one sequence, which only the `*_ring` names attend across (dilated_ring, "
            "block_sparse_ring, ring); whole rows on each process are computed as given")


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
    if dropout_p and kind.name in BAND_NAMES and config_for(module).local_window is not None:
        raise ValueError(f"dropout_p: attn_implementation={name!r} with a local band (the hf_dilated entry's "
                         f"local_window: the default conversion's) has no attention dropout yet, got dropout_p="
                         f"{dropout_p} (for a transformers model: set attention_dropout=0)")
    check_int("sliding_window", kwargs.get("sliding_window"), optional=True)
    return dropout_p


def _attention(name, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """What every registered name runs: the kernel of hf_dilated.kinds.KINDS[name] on the inputs
    of transformers' rule, under the model's DilatedConfig."""
    from ..distributed.groups import get_sequence_parallel_group, resolve_group_layout

    kind = KINDS[name]
    dropout_p = _check_call(kind, module, dropout, kwargs)
    if torch.compiler.is_compiling() and not is_static_slots(attention_mask):
        # Only a static cache's steps have static shapes; anything else (a prefill, a dynamic cache, a
        # sliding-window layer whose window has filled) reads Python values off the mask and the config:
        # say so here, rather than fail on the first of them (with fullgraph=True this is the error;
        # without it, a graph break, and the call runs eagerly).
        torch._dynamo.graph_break(
            f"attn_implementation={name!r}: under torch.compile only decode steps on a static cache are "
            "traced (transformers' StaticCache, through its mask function); compiled steps on other caches, "
            "and on sliding-window layers whose window has filled, are not supported yet")
    cfg = config_for(module)
    group, layout = resolve_group_layout() if kind.sequence_parallel else (None, None)
    if not kind.sequence_parallel and get_sequence_parallel_group() is not None:
        _warn_one_process_name_under_a_group(name, get_sequence_parallel_group())
    if group is not None:
        if key.shape[2] != query.shape[2]:
            raise NotImplementedError(
                f"attn_implementation={name!r}: a call against a KV cache (generate(), a decode step, a later "
                "chunk) is not supported under a sequence-parallel group, whose ranks hold one shard of the "
                "sequence each; generate outside the group (hf_dilated.distributed.destroy_sequence_parallel(), "
                "or one process)")
        if cfg.ring_layout is not None and cfg.ring_layout != layout:
            raise ValueError(
                f"attn_implementation={name!r}: the model config asks for ring_layout={cfg.ring_layout!r} but the "
                f"active sequence-parallel group shards sequences as {layout!r}"
            )
    if torch.compiler.is_compiling() and is_static_slots(attention_mask):
        return _compiled_static_step(kind, module, query, key, value, attention_mask, scaling, kwargs, group)
    cache_keys = key  # a static cache's own tensor (static_keep follows its writes)
    settings = settings_for(module, kind)
    rope_frequencies = rope_frequencies_for(module, settings, query.device)
    key, value, mask, positions, rope_offset = kernel_inputs(
        # (a group of one process holds the whole row: the single-process rules, as its kernels equal those)
        query, key, value, attention_mask, kwargs.get("position_ids"),
        sequence_parallel=group is not None and torch.distributed.get_world_size(group) > 1,
        cu_seq_lens=kwargs.get("cu_seq_lens_q"), cu_seq_lens_k=kwargs.get("cu_seq_lens_k"),
        rope=rope_frequencies is not None)
    # The model's sliding window (Mistral, Qwen2 layers): every kernel keeps it (docs/contract.md 3.3).
    window = kwargs.get("sliding_window")
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):
        # Follow autocast as sdpa does: q, k and v in the autocast dtype (RoPE may have left q and k
        # in float32 while v comes out of a projection in bfloat16), the output in it too.
        dtype = torch.get_autocast_dtype(device_type)
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    with torch.autocast(device_type, enabled=False):
        out = kind.run(query, key, value, settings, is_causal=True, attention_mask=mask, position_ids=positions,
                       scale=scaling, dropout_p=dropout_p, group=group, layout=layout, sliding_window=window,
                       rope_frequencies=rope_frequencies, state=_layer_state(module), rope_offset=rope_offset)
        if group is None and mask is not None:
            out = padded_last_query_as_sdpa(out, query, key, value, mask, scaling, window)
        if kind.static_keep is not None and group is None and is_static_slots(attention_mask):
            # what the compiled steps after this call read (transformers compiles the steps, not the prefill)
            real = read_static_slots(attention_mask)[0]  # kernel_inputs kept the `seen` written slots: no read here
            kind.static_keep(cache_keys, settings, real=real, seen=key.shape[2], q_len=query.shape[2],
                             rope_frequencies=rope_frequencies,
                             rope_shift=None if rope_offset is None else rope_offset.per_key[:, -1])
    # (batch, heads, q_len, head_dim) -> (batch, q_len, heads, head_dim), as sdpa_attention_forward
    return out.transpose(1, 2).contiguous(), None


class _LayerState(dict):
    """What the kernels keep for one layer between calls: a cache of what its calls recompute, so a
    pickled or copied model (torch.save(model), copy.deepcopy) takes it empty (it holds weak
    references, which pickle refuses)."""

    def __reduce__(self):
        return _LayerState, ()


def _layer_state(module) -> dict:
    """What the kernels keep for this layer between calls (kinds.py: `state`), on the module itself:
    not a parameter or buffer, so it is never saved."""
    state = module.__dict__.get("_hf_dilated_state")
    if state is None:
        state = module.__dict__["_hf_dilated_state"] = _LayerState()
    return state


def _compiled_static_step(kind, module, query, key, value, slots, scaling, kwargs, group):
    """A step on a static cache under torch.compile: the kind's static decode (kinds.py), whose
    shapes and Python values depend on the cache alone, so that each step reuses one graph."""
    if kind.static_decode is None or group is not None:
        raise NotImplementedError(f"attn_implementation={kind.name!r}: a compiled step on a static cache "
                                  + ("under sequence parallelism" if group is not None else "") + " is not supported")
    real, seen = read_static_slots(slots)
    settings = settings_for(module, kind)
    rope_frequencies = rope_frequencies_for(module, settings, query.device)
    out = kind.static_decode(query, key, value, settings, real=real, seen=seen,
                             scale=query.shape[-1] ** -0.5 if scaling is None else scaling,
                             sliding_window=kwargs.get("sliding_window"), rope_frequencies=rope_frequencies,
                             rope_shift=None if rope_frequencies is None else static_rope_shift(
                                 kwargs.get("position_ids"), real, seen, query.shape[0]))
    return out.transpose(1, 2).contiguous(), None


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
      corrupt config.json fails at load, not at the first forward);
    - the context the model declares (`max_position_embeddings`) is the one it reads under the
      chosen attention (`declare_context`).
    And wraps `PretrainedConfig.save_pretrained` (which a model's save_pretrained calls), so that
    config.json declares what the RoPE alone supports, whatever the attention in memory; and
    `PreTrainedModel.post_init`, so that a built model's attention modules hold its rotary module
    (rotary.link_rotary)."""
    from transformers import PretrainedConfig, PreTrainedModel

    current = PreTrainedModel._check_and_adjust_attn_implementation
    if getattr(current, "_hf_dilated", False):
        return

    def _check_and_adjust_attn_implementation(self, attn_implementation, *args, **kwargs):
        if attn_implementation is None:
            attn_implementation = _default_choice(self.config)
        if attn_implementation in NAMES:
            check_model_supported(self.config, attn_implementation)
        chosen = current(self, attn_implementation, *args, **kwargs)
        if chosen in NAMES:
            link_rotary(self)  # (a built model switched to our names; at construction, post_init links)
        record_choice(self.config, chosen)
        return chosen

    _check_and_adjust_attn_implementation._hf_dilated = True
    PreTrainedModel._check_and_adjust_attn_implementation = _check_and_adjust_attn_implementation

    # The config's own save_pretrained (a model's writes its config through it): a config saved
    # alone (model.config.save_pretrained) declared the converted context as well.
    save = PretrainedConfig.save_pretrained

    @functools.wraps(save)
    def save_pretrained(self, *args, **kwargs):
        kept = kept_rope_context(self)
        if kept is None or self.max_position_embeddings == kept[0]:
            return save(self, *args, **kwargs)
        declared = self.max_position_embeddings
        self.max_position_embeddings = kept[0]  # what engines that ignore the entry may read
        try:
            return save(self, *args, **kwargs)
        finally:
            self.max_position_embeddings = declared

    PretrainedConfig.save_pretrained = save_pretrained

    # Every model's attention modules find its rotary module (rotary.link_rotary) once it is built:
    # post_init ends the construction of each transformers model.
    post_init = PreTrainedModel.post_init

    @functools.wraps(post_init)
    def linked_post_init(self, *args, **kwargs):
        out = post_init(self, *args, **kwargs)
        link_rotary(self)
        return out

    PreTrainedModel.post_init = linked_post_init


def record_choice(config, chosen) -> None:
    """What choosing attention `chosen` for a model of `config` with an `hf_dilated` entry records:
    the name in the entry (kept through save_pretrained, read at load), and the context it declares
    (declare_context). The load-time hook runs it; so does `patch`, for transformers' own
    set_attn_implementation skips the hook when the name does not change."""
    entry = getattr(config, CONFIG_KEY, None)
    if isinstance(entry, dict) and isinstance(chosen, str):
        if chosen in NAMES:
            entry[RECORDED_NAME] = chosen
        else:
            entry.pop(RECORDED_NAME, None)
        declare_context(config, chosen)


def reading_names(config) -> tuple[int, int, tuple[str, ...]] | None:
    """config.kept_rope_context with the names that read the target: BAND_NAMES where it is read
    through far keys at grouped positions, else the names that read the entry (not `ring`, which
    computes what sdpa does: past L it is as wrong)."""
    kept = kept_rope_context(config)
    if kept is None:
        return None
    return kept[0], kept[1], BAND_NAMES if kept[2] else tuple(name for name in NAMES if KINDS[name].settings)


def supported_context(config, attn_implementation: str) -> int | None:
    """The tokens a model of `config` reads under `attn_implementation`: with its RoPE kept unscaled
    by a conversion, the converted target under the names that read it (reading_names) and
    the RoPE's own context L under any other (sdpa is then silently wrong past L); else
    max_position_embeddings."""
    kept = reading_names(config)
    if kept is None:
        return getattr(config, "max_position_embeddings", None)
    return kept[1] if attn_implementation in kept[2] else kept[0]


def declare_context(config, attn_implementation: str) -> None:
    """Sets `max_position_embeddings`, which transformers' generate() and other tools read as the
    model's context, to `supported_context` under the chosen attention: config.json keeps the
    RoPE's own context for engines that ignore the hf_dilated entry (patches/context.py), and a
    model loaded under `dilated` reads the converted one. Under another attention it says once
    that inputs past L are silently wrong there."""
    kept = reading_names(config)
    if kept is None:
        return
    config.max_position_embeddings = supported_context(config, attn_implementation)
    if attn_implementation not in kept[2]:
        how = "far keys at grouped positions" if kept[2] == BAND_NAMES else "hf_dilated's attention"
        _logger().warning_once(
            f"this checkpoint was converted for {kept[1]} tokens of context with its RoPE unscaled, read through "
            f"{how} (attn_implementation in {kept[2]}); under {attn_implementation!r} it is valid for up to "
            f"{kept[0]} tokens (max_position_embeddings), and longer inputs are silently wrong")


def converted_context(config) -> int | None:
    """The context `config` was configured for: its hf_dilated entry's target length (what
    `hf-dilated convert --context` set, read as stored), else max_position_embeddings."""
    entry = getattr(config, CONFIG_KEY, None)
    target = entry.get("target_length") if isinstance(entry, dict) else None
    return target if isinstance(target, int) else getattr(config, "max_position_embeddings", None)


def check_model_supported(config, name: str) -> None:
    """A ValueError unless `config` is of a family the kind `name` serves, with a valid entry."""
    KINDS[name].check_family(getattr(config, "model_type", None), entry=f"attn_implementation={name!r}")
    try:
        entry = DilatedConfig.from_model_config(config)
        if name in BAND_NAMES:  # (the names that read far keys at grouped positions)
            check_fixed_frequencies(getattr(config, "rope_parameters", None), entry.far_group)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"attn_implementation={name!r}: invalid 'hf_dilated' config entry: {exc}") from None
