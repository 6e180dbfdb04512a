"""The thin transformers glue: attention/mask registration and the choice of attention at load
time (transformers.py). The configuration schema it reads is hf_dilated/config.py."""
from .transformers import NAMES, register

__all__ = ["NAMES", "register"]
