"""The rotary frequencies of a transformers model, for the far keys of a local band
(docs/contract.md 4.1): its queries and keys arrive already rotated by the model's RoPE, and the
kinds rotate them on to Self-Extend's grouped positions (ops/rope.py) with these frequencies. The
glue caches them with the rest of the model's entry (transformers.py: rope_frequencies_for)."""
from __future__ import annotations

import sys

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
# off, 32K back). The attention function only sees its layer, so each attention module holds a
# plain reference to its model's rotary module (in its __dict__: not a submodule, so neither
# parameters, state_dict nor module listings change), which copy.deepcopy and pickling carry to
# the copy's own rotary module. (A model built before hf_dilated was imported and switched by
# assigning config._attn_implementation, not set_attn_implementation, has none: the frequencies
# of its family's rotary class are used.)

_LINK = "_hf_dilated_rotary"


def link_rotary(model) -> None:
    """Gives every attention module of `model` its rotary module (model_rotary), where the model has
    exactly one with an `inv_freq` buffer: the load-time hooks call it when a model is built (its
    post_init) and when one of our names is chosen, and `patch` after it rebuilds the rotary."""
    modules = list(model.modules())
    rotary = [m for m in modules if type(m).__name__.endswith("RotaryEmbedding")
              and isinstance(getattr(m, "inv_freq", None), torch.Tensor)]
    if len(rotary) != 1:
        return
    for module in modules:
        if type(module).__name__.endswith("Attention"):
            module.__dict__[_LINK] = rotary[0]


def model_rotary(module):
    """The rotary module linked to attention `module` (link_rotary), or None."""
    return module.__dict__.get(_LINK)


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
