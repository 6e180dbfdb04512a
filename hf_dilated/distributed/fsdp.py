"""FSDP2 (torch.distributed.fsdp.fully_shard) over the data-parallel x sequence-parallel grid.

The ranks of a sequence-parallel group hold the same parameters and see the same rows (each a
shard of every row), so parameters can be sharded over them too:

- shard="dp_sp" (the default, ZeRO-3 style): every parameter is sharded over all processes (the
  grid flattened); the backward's reduce-scatter averages the gradients over all of them.
- shard="dp" (hybrid): sharded over the data-parallel ranks only and replicated over the SP group
  (FSDP2's HSDP: reduce-scatter over DP, then all-reduce over SP); more memory, less traffic.

Either way the gradient is the mean over all processes, as with DDP, so the loss must be
`reduce_loss(...)` with its default grad_reduction="mean" (each rank's share scaled by the SP
size): averaged over the S ranks of a group and the D replicas, the scaled shares give the mean
of the replicas' gradients, exactly one process's gradient when D = 1.

    mesh = build_mesh(sp_size=2)                          # dims ("dp_shard", "sp")
    setup_sequence_parallel_from_mesh(mesh)               # our ring kernels use mesh["sp"]
    model.gradient_checkpointing_enable(...)              # optional, before sharding
    apply_fsdp2(model, mesh)                              # then build the optimizer
"""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from ..ops.validate import check_int
from .groups import _default_group_timeout, rank_grid

FSDP_SHARDING = ("dp_sp", "dp")


def _backend_override(ndim: int, timeout: timedelta | None):
    """A mesh's per-dimension (backend, options) giving its groups `timeout`: DeviceMesh creates
    them with new_group, whose default is 30 minutes, not the default group's timeout (a dead
    peer would block FSDP2's collectives that long). None: torch's defaults."""
    if timeout is None:
        timeout = _default_group_timeout()
    elif not isinstance(timeout, timedelta):
        raise TypeError(f"timeout must be a datetime.timedelta or None, got {type(timeout).__name__}")
    backend = dist.get_backend()
    options_class = {"gloo": getattr(dist, "ProcessGroupGloo", None), "nccl": getattr(dist, "ProcessGroupNCCL", None)}
    cls = options_class.get(backend)
    if timeout is None or cls is None:
        return None
    override = []
    for _ in range(ndim):
        options = cls._Options() if backend == "gloo" else cls.Options()
        options._timeout = timeout
        override.append((backend, options))
    return tuple(override)


def build_mesh(sp_size: int, *, device_type: str | None = None, dim_names: tuple[str, str] = ("dp_shard", "sp"),
               timeout: timedelta | None = None):
    """A (world / sp_size) x sp_size DeviceMesh named `dim_names` over the default group: SP groups
    of consecutive ranks, as `setup_sequence_parallel` arranges them. device_type: "cuda" when the
    default group is NCCL, else "cpu". timeout: how long its groups wait on a peer (default: the
    default group's timeout)."""
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("build_mesh: torch.distributed is not initialised; call init_process_group "
                           "(or create an accelerate.Accelerator) first")
    check_int("sp_size", sp_size)
    world = dist.get_world_size()
    if world % sp_size:
        raise ValueError(f"sp_size ({sp_size}) must divide the world size ({world})")
    if len(dim_names) != 2 or len(set(dim_names)) != 2:
        raise ValueError(f"dim_names must be two distinct names (data parallel, sequence parallel), got {dim_names}")
    if device_type is None:
        device_type = "cuda" if "nccl" in dist.get_backend() else "cpu"  # "nccl" or e.g. "cpu:gloo,cuda:nccl"
    override = _backend_override(2, timeout)
    return init_device_mesh(device_type, (world // sp_size, sp_size), mesh_dim_names=tuple(dim_names),
                            backend_override=None if override is None else dict(enumerate(override)))


def fsdp_mesh(mesh, *, sp_dim: str = "sp", shard: str = "dp_sp", timeout: timedelta | None = None):
    """The mesh fully_shard gets for `shard` (see the module docstring), built from `mesh`'s grid;
    its groups wait `timeout` (default: the default group's).

    New meshes rather than slices of `mesh`: HSDP wants the replicated (SP) dimension first, and a
    DeviceMesh cannot be sliced with its dimensions reordered."""
    from torch.distributed.device_mesh import DeviceMesh

    if shard not in FSDP_SHARDING:
        raise ValueError(f"shard must be one of {FSDP_SHARDING}, got {shard!r}")
    grid = rank_grid(mesh, sp_dim)  # (dp, sp)
    if shard == "dp_sp":
        return DeviceMesh(mesh.device_type, grid.reshape(-1), mesh_dim_names=("dp_sp",),
                          backend_override=_backend_override(1, timeout))
    return DeviceMesh(mesh.device_type, grid.t().contiguous(), mesh_dim_names=("sp_replicate", "dp_shard"),
                      backend_override=_backend_override(2, timeout))


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks: modules whose class transformers names in `_no_split_modules`
    (LlamaDecoderLayer, GPTNeoXLayer, ...), looked up through a peft wrapper."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(getattr(base, "_no_split_modules", None) or ())
    # By the class and its bases: fully_shard makes each layer an FSDP<Name> subclass of its class.
    layers = [m for m in model.modules() if any(c.__name__ in names for c in type(m).__mro__)]
    if not layers:
        raise ValueError(f"model: found no decoder layers to shard ({type(base).__name__}._no_split_modules = "
                         f"{sorted(names)}); apply_fsdp2 needs a transformers model that names its blocks")
    return layers


def apply_fsdp2(model: torch.nn.Module, mesh, *, sp_dim: str = "sp", shard: str = "dp_sp", mp_policy=None,
                reshard_after_forward: bool = True, timeout: timedelta | None = None) -> torch.nn.Module:
    """Shards `model` in place with FSDP2: each decoder layer, then the root (embeddings, final
    norm, head). Returns the model; its parameters are DTensors, so build the optimizer after this.

    mesh: a DeviceMesh with a dimension named `sp_dim` (e.g. `build_mesh`'s); shard: "dp_sp" or
    "dp" (module docstring); mp_policy: a torch.distributed.fsdp.MixedPrecisionPolicy, e.g.
    MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32).
    timeout: how long the sharding groups wait on a peer (default: the default group's timeout).
    Enable gradient checkpointing (model.gradient_checkpointing_enable) before calling this.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if mp_policy is not None and not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy or None, "
                        f"got {type(mp_policy).__name__}")
    target = fsdp_mesh(mesh, sp_dim=sp_dim, shard=shard, timeout=timeout)
    kwargs = {"mesh": target, "reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    for layer in decoder_layers(model):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def _state_options(*, trainable_only: bool, full: bool = False):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # Frozen weights (a LoRA run's base model) come from the model's own checkpoint: not saved
    # again, and not expected on load (strict=False; load_sharded_state checks the rest).
    return StateDictOptions(ignore_frozen_params=trainable_only, strict=not trainable_only, full_state_dict=full,
                            cpu_offload=full)


def save_sharded_state(path, model, optimizer, *, trainable_only: bool = True) -> None:
    """Every rank writes its shards of the model's (trainable) weights and of the optimizer's
    state into the directory `path` (torch.distributed.checkpoint; collective: call on every rank).
    The directory must be visible to every rank (one machine, or a shared file system)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer, options=_state_options(trainable_only=trainable_only))
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(path))


def load_sharded_state(path, model, optimizer, *, trainable_only: bool = True) -> None:
    """Restores what `save_sharded_state` wrote into a model sharded by `apply_fsdp2` and its
    optimizer, on any grid and sharding (DCP reshards on load). Collective: call on every rank."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    options = _state_options(trainable_only=trainable_only)
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    state = {"model": model_state, "optimizer": optim_state}
    try:
        dcp.load(state, checkpoint_id=str(path))
    except (CheckpointException, RuntimeError) as e:  # DCP names the first weight it lacks, deep in its message
        raise ValueError(f"path: {path} does not hold this model's {'trainable ' if trainable_only else ''}weights "
                         "and optimizer state (was it saved with the same model and LoRA / full fine-tuning "
                         f"settings?): {str(e)[:300]}") from e
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                   options=options)


def full_model_state(model) -> dict:
    """The whole model's weights as plain CPU tensors on rank 0 (an empty dict elsewhere), e.g. to
    load into an unsharded copy of the model and `save_pretrained` it. Collective."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_state_options(trainable_only=False, full=True))
