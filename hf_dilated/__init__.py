"""hf-dilated: long-context attention (dilated, ring, block-sparse) for Hugging Face Transformers.

`import hf_dilated` registers the attention implementations "dilated", "dilated_ring", "ring",
"block_sparse" and "block_sparse_ring" with transformers.
"""
from .ops import dilated_attention

__version__ = "0.1.0"
__all__ = ["dilated_attention"]
