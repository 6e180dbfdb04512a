"""Pure-torch attention kernels. Nothing here imports transformers."""
from .block_sparse import block_sparse_attention
from .dilated import dilated_attention

__all__ = ["block_sparse_attention", "dilated_attention"]
