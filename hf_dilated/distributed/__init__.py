"""Sequence parallelism over torch.distributed: ring, dilated-ring and block-sparse-ring attention.

Kernels take this rank's shards of q/k/v (and of the global attention_mask / position_ids) in the
group's layout and return this rank's shard of the output; with no group (None) or a group of one
process each equals its single-process counterpart.
"""
from .block_sparse_ring import block_sparse_ring_attention
from .dilated_ring import dilated_ring_attention
from .utils import bytes_sent, reset_bytes_sent
from .groups import (
    SequenceParallel,
    destroy_sequence_parallel,
    gather_sequence,
    get_data_parallel_group,
    get_sequence_parallel_group,
    get_sequence_parallel_layout,
    get_sequence_parallel_state,
    rank_grid,
    reduce_loss,
    setup_sequence_parallel,
    setup_sequence_parallel_from_mesh,
    shard_batch,
)
from .fsdp import FSDP_SHARDING, apply_fsdp2, build_mesh, full_model_state, load_sharded_state, save_sharded_state
from .layout import padded_length, shard, shard_indices, unshard
from .ring import ring_attention

__all__ = [
    "FSDP_SHARDING",
    "SequenceParallel",
    "apply_fsdp2",
    "block_sparse_ring_attention",
    "build_mesh",
    "bytes_sent",
    "destroy_sequence_parallel",
    "dilated_ring_attention",
    "full_model_state",
    "gather_sequence",
    "get_data_parallel_group",
    "get_sequence_parallel_group",
    "get_sequence_parallel_layout",
    "get_sequence_parallel_state",
    "load_sharded_state",
    "padded_length",
    "rank_grid",
    "reduce_loss",
    "reset_bytes_sent",
    "ring_attention",
    "save_sharded_state",
    "setup_sequence_parallel",
    "setup_sequence_parallel_from_mesh",
    "shard",
    "shard_batch",
    "shard_indices",
    "unshard",
]
