"""The thin transformers glue: attention/mask registration and the choice of attention at load
time (transformers.py); transformers' rule for caches, packing and the mask function
(model_inputs.py, docs/contract.md 3.2); the model's rotary frequencies, with which the kinds place far
keys at grouped positions (rotary.py, docs/contract.md 4.1); a DynamicCache that writes into reserved room instead of
copying itself every step (cache.py). The configuration schema it reads is hf_dilated/config.py."""
from .transformers import NAMES, register

__all__ = ["NAMES", "register"]
