"""Pure-torch attention kernels. Nothing here imports transformers."""
from .dilated import dilated_attention

__all__ = ["dilated_attention"]
