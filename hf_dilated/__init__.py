"""hf-dilated: long-context attention (dilated, ring, block-sparse) for Hugging Face Transformers.

`import hf_dilated` registers the attention implementations "dilated", "dilated_ring", "ring",
"block_sparse" and "block_sparse_ring" with transformers.
"""
from .config import DilatedConfig
from .integrations import register as _register_with_transformers
from .integrations.cache import ReservedCache
from .nn import DilatedMultiheadAttention, create_attention
from .ops import dilated_attention
from .ops.backend import activate_flash
from .patching import lora_config, patch, patch_family, unpatch_family

_register_with_transformers()

__version__ = "0.1.0"
__all__ = [
    "DilatedConfig", "DilatedMultiheadAttention", "ReservedCache", "activate_flash", "create_attention", "dilated_attention", "lora_config", "patch",
    "patch_family", "unpatch_family",
]
