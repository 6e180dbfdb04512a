"""The thin transformers glue: attention/mask registration (transformers.py) and the config (config.py)."""
from .config import CONFIG_KEY, DilatedConfig
from .transformers import NAMES, register

__all__ = ["CONFIG_KEY", "DilatedConfig", "NAMES", "register"]
