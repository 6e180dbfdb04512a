"""The rotary frequencies of a transformers model, for the far keys of a local band
(docs/contract.md 4.1): its queries and keys arrive already rotated by the model's RoPE, and the
kinds rotate them on to Self-Extend's grouped positions (ops/rope.py) with these frequencies. The
glue caches them with the rest of the model's entry (transformers.py: rope_frequencies_for)."""
from __future__ import annotations

import sys
import weakref

import torch

# RoPE types whose frequencies change with the length (transformers' `dynamic_rope_update`): the keys
# in a cache were turned by other frequencies than the call's, so no grouped position is fixed.
_LENGTH_DEPENDENT = {"dynamic": "dynamic NTK", "longrope": "LongRoPE"}


def check_fixed_frequencies(rope_parameters, far_group: int) -> None:
    """A ValueError naming far_group where far keys at grouped positions (far_group > 1) meet a RoPE
    whose frequencies change with the length (dynamic NTK, LongRoPE): checked for the names that read
    far keys (config.BAND_NAMES) at conversion, at load and at the first call."""
    rope_type = dict(rope_parameters or {}).get("rope_type", "default")
    if far_group > 1 and rope_type in _LENGTH_DEPENDENT:
        raise ValueError(f"far_group={far_group}: grouped far positions need fixed rotary frequencies; "
                         f"{_LENGTH_DEPENDENT[rope_type]} RoPE (rope_type {rope_type!r}) changes them with the length "
                         "(convert with --rope none, linear or yarn, or set far_group to 1)")


# --- the rotary module a model runs --------------------------------------------------------------
# A model's q and k are turned by its rotary module's `inv_freq` buffer, which is not always what its
# class computes from the config: `model.to(torch.bfloat16)` (or `.half()`) rounds the buffer, and
# far keys moved by the unrounded frequencies would sit at no grouped position (tens of radians
# off, 32K back). The attention function only sees its layer, so the load-time hook records the
# models built with our names (track_model) and a layer finds its model's rotary module among them.

_MODELS: dict[int, list] = {}  # id(model config) -> weakref.ref of each model built on it
_ROTARY_OF = weakref.WeakKeyDictionary()  # attention module -> (weakref.ref(model), the rotary's name)


def track_model(model) -> None:
    """Records `model` (the load-time hook and `patch` call this) so that its layers find its rotary
    module (model_rotary)."""
    key = id(model.config)
    alive = [ref for ref in _MODELS.get(key, ()) if ref() is not None and ref() is not model
             and ref().config is model.config]
    _MODELS[key] = alive + [weakref.ref(model)]


def model_rotary(module):
    """The rotary module (with an `inv_freq` buffer) of the tracked model that holds attention
    `module`, or None when no tracked model holds it."""
    found = _ROTARY_OF.get(module)
    if found is not None and found[0]() is not None:
        try:
            return found[0]().get_submodule(found[1])
        except AttributeError:  # (the rotary module was replaced: patch rebuilds it on a new RoPE)
            pass
    for ref in _MODELS.get(id(module.config), ()):
        model = ref()
        if model is None or model.config is not module.config:
            continue
        named = dict(model.named_modules())
        if not any(m is module for m in named.values()):
            continue
        rotary = [name for name, m in named.items() if type(m).__name__.endswith("RotaryEmbedding")
                  and isinstance(getattr(m, "inv_freq", None), torch.Tensor)]
        if len(rotary) == 1:
            _ROTARY_OF[module] = (ref, rotary[0])
            return named[rotary[0]]
    return None


def rotary_frequencies(module, far_group: int, rotary=None) -> torch.Tensor:
    """inv_freq (float32) of the model an attention module belongs to, for far keys grouped by
    `far_group`: the buffer of its rotary module `rotary` (model_rotary) as the model reads it,
    else computed by its family's own rotary class (scaled RoPE included). Frequencies that change
    with the length are refused."""
    config = module.config
    check_fixed_frequencies(getattr(config, "rope_parameters", None), far_group)
    if rotary is not None:
        return rotary.inv_freq.detach().float()  # (transformers' rotary reads its buffer in float32 too)
    modeling = sys.modules[type(module).__module__]
    classes = [obj for name, obj in vars(modeling).items()
               if name.endswith("RotaryEmbedding") and isinstance(obj, type)]
    if not classes:
        raise ValueError(f"far_group: {type(module).__name__} has no rotary embedding class beside it; grouped far "
                         "positions need RoPE (set far_group to 1)")
    return classes[0](config=config).inv_freq.detach().float()
