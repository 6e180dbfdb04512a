"""Process groups for a data-parallel x sequence-parallel grid, and batch sharding for it.

With world size W and sequence-parallel size S (S divides W), processes are arranged as W/S
data-parallel replicas of S consecutive ranks: 4 processes with S = 2 give SP groups {0, 1} and
{2, 3} and DP groups {0, 2} and {1, 3}. The ranks of an SP group hold one sequence between them;
the DP groups see different batches.

Typical loop (the same code runs on one process, where there is no group and nothing is sharded):

    sp = setup_sequence_parallel(2)                       # after init_process_group / Accelerator()
    batch = shard_batch(input_ids, labels=input_ids)      # this rank's part, labels shifted first
    out = model(**batch)                                  # loss = local sum / global token count
    loss = reduce_loss(out.loss)                          # value: the global loss, on every rank
    loss.backward()                                       # then average gradients (DDP / FSDP2 do)

The grid can also come from a torch DeviceMesh with a named sequence-parallel dimension
(`setup_sequence_parallel_from_mesh(mesh, sp_dim="sp")`), the mesh FSDP2 (`fsdp.apply_fsdp2`)
shards parameters over; the SP group is then that dimension's group, the DP group the other
dimensions' together.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ..config import DEFAULT_RING_LAYOUT
from ..ops.token_layout import mask_ranks
from ..ops.validate import check_int
from .layout import check_layout, padded_length, shard, unshard


@dataclass(frozen=True)
class SequenceParallel:
    sp_group: object  # torch.distributed ProcessGroup of this rank's sequence-parallel group
    dp_group: object  # ProcessGroup of the ranks holding the same sequence position in other replicas
    sp_size: int
    sp_rank: int
    dp_size: int
    dp_rank: int
    layout: str
    mesh: object = None  # the DeviceMesh the grid was taken from (setup_sequence_parallel_from_mesh), else None


_STATE: SequenceParallel | None = None


def setup_sequence_parallel(sp_size: int, *, layout: str = DEFAULT_RING_LAYOUT, timeout: timedelta | None = None,
                            backend: str | None = None) -> SequenceParallel:
    """Builds the DP x SP grid inside the default process group (which must be initialised, e.g.
    by `accelerate launch` + `Accelerator()` or `torch.distributed.init_process_group`).

    Every rank must call this, with the same arguments. `timeout` bounds every wait on the new
    groups (a dead or hung peer becomes an error after it); default: the default group's timeout.
    """
    global _STATE
    check_layout(layout)
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("setup_sequence_parallel: torch.distributed is not initialised; call "
                           "init_process_group (or create an accelerate.Accelerator) first")
    check_int("sp_size", sp_size)
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % sp_size:
        raise ValueError(f"sp_size ({sp_size}) must divide the world size ({world})")
    if timeout is not None and not isinstance(timeout, timedelta):
        raise TypeError(f"timeout must be a datetime.timedelta or None, got {type(timeout).__name__}")
    dp_size = world // sp_size
    # new_group does not inherit the default group's timeout (it falls back to 30 minutes).
    kwargs = {"timeout": timeout if timeout is not None else _default_group_timeout(), "backend": backend}
    sp_group = dp_group = None
    # new_group is collective over the default group: every rank creates every group, in order.
    for d in range(dp_size):
        ranks = list(range(d * sp_size, (d + 1) * sp_size))
        g = dist.new_group(ranks, **kwargs)
        if rank in ranks:
            sp_group = g
    for s in range(sp_size):
        ranks = list(range(s, world, sp_size))
        g = dist.new_group(ranks, **kwargs)
        if rank in ranks:
            dp_group = g
    _STATE = SequenceParallel(sp_group, dp_group, sp_size, rank % sp_size, dp_size, rank // sp_size, layout)
    return _STATE


def rank_grid(mesh, sp_dim: str = "sp") -> torch.Tensor:
    """The global ranks of `mesh` as a (dp_size, sp_size) tensor: row d is one sequence-parallel
    group (along `sp_dim`), column s one data-parallel group (every other dimension, flattened in
    the mesh's order)."""
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}")
    names = tuple(mesh.mesh_dim_names or ())
    if sp_dim not in names:
        raise ValueError(f"sp_dim {sp_dim!r} is not a dimension of the mesh (its dimensions: {names}); "
                         "build it with mesh_dim_names, e.g. init_device_mesh('cpu', (dp, sp), "
                         "mesh_dim_names=('dp_shard', 'sp'))")
    index = names.index(sp_dim)
    return mesh.mesh.movedim(index, -1).reshape(-1, mesh.mesh.shape[index])


def setup_sequence_parallel_from_mesh(mesh, *, sp_dim: str = "sp", layout: str = DEFAULT_RING_LAYOUT,
                                      timeout: timedelta | None = None) -> SequenceParallel:
    """Like `setup_sequence_parallel`, with the grid of a DeviceMesh: the SP group is the group of
    the mesh's `sp_dim` dimension (so FSDP2 over the same mesh and our ring kernels agree on which
    ranks share a sequence), the DP group the ranks of the other dimensions at the same SP rank.

    The mesh must span every process of the default group. A mesh of torch's `init_device_mesh`
    (dimensions e.g. ("dp_shard", "sp")) works, and so does Accelerate's
    `ParallelismConfig(dp_shard_size=D, cp_size=S).build_device_mesh(...)` with sp_dim="cp".
    Every rank must call this, with the same arguments; `timeout` applies to a DP group that has
    to be created (one spanning several of the mesh's dimensions), the mesh's own groups keep theirs.
    """
    global _STATE
    check_layout(layout)
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("setup_sequence_parallel_from_mesh: torch.distributed is not initialised; call "
                           "init_process_group (or create an accelerate.Accelerator) first")
    if timeout is not None and not isinstance(timeout, timedelta):
        raise TypeError(f"timeout must be a datetime.timedelta or None, got {type(timeout).__name__}")
    grid = rank_grid(mesh, sp_dim)
    world, rank = dist.get_world_size(), dist.get_rank()
    if grid.numel() != world:
        raise ValueError(f"mesh spans {grid.numel()} processes, the default group {world}: the sequence-parallel "
                         "grid must cover every process")
    dp_size, sp_size = grid.shape
    dp_rank, sp_rank = (int(i) for i in (grid == rank).nonzero()[0])
    sp_group = mesh.get_group(sp_dim)
    others = [n for n in mesh.mesh_dim_names if n != sp_dim]
    if len(others) == 1:
        dp_group = mesh.get_group(others[0])
    else:  # none (dp_size 1) or several: one group per column of the grid, created in order by every rank
        kwargs = {"timeout": timeout if timeout is not None else _default_group_timeout()}
        dp_group = None
        for s in range(sp_size):
            g = dist.new_group(grid[:, s].tolist(), **kwargs)
            if s == sp_rank:
                dp_group = g
    _STATE = SequenceParallel(sp_group, dp_group, sp_size, sp_rank, dp_size, dp_rank, layout, mesh)
    return _STATE


def _default_group_timeout() -> timedelta | None:
    try:  # private API; without it the groups get torch's default timeout
        pg = dist.distributed_c10d._get_default_group()
        return pg._get_backend(torch.device("cpu")).options._timeout
    except Exception:
        try:
            pg = dist.distributed_c10d._get_default_group()
            return pg._get_backend(torch.device("cuda")).options._timeout
        except Exception:
            return None


def destroy_sequence_parallel() -> None:
    """Forgets the grid (the process groups themselves go with destroy_process_group)."""
    global _STATE
    _STATE = None


def get_sequence_parallel_state() -> SequenceParallel | None:
    return _STATE


def get_sequence_parallel_group():
    """The sequence-parallel group set by `setup_sequence_parallel`, or None when none is set."""
    return None if _STATE is None else _STATE.sp_group


def get_data_parallel_group():
    return None if _STATE is None else _STATE.dp_group


def get_sequence_parallel_layout() -> str:
    """The layout of the group set by `setup_sequence_parallel` (the default layout when none is set)."""
    return DEFAULT_RING_LAYOUT if _STATE is None else _STATE.layout


def group_size_rank(group) -> tuple[int, int]:
    """(world, rank) of `group`; (1, 0) for None, meaning a single process."""
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def resolve_group_layout(group=None, layout=None) -> tuple[object, str]:
    """The one resolution of a sequence-parallel call's (group, layout), for every entry point
    (create_attention, the transformers names, shard_batch, gather_sequence): `group`, else the
    group set by `setup_sequence_parallel` (None: a single process); `layout`, else that group's
    layout (the default layout when none is set); a ValueError for an unknown layout."""
    if group is None:
        group = get_sequence_parallel_group()
    if layout is None:
        layout = get_sequence_parallel_layout()
    check_layout(layout)
    return group, layout


_WARNED_GROUP_WITHOUT_SETUP = False


def _check_against_setup(group, layout) -> None:
    """shard_batch's `group` / `layout` against what a model's attention will read. The `*_ring`
    attn_implementation names take the group and layout of `setup_sequence_parallel` (they have no
    arguments of their own): a batch sharded another way gave a plausible, wrong loss."""
    global _WARNED_GROUP_WITHOUT_SETUP
    state = get_sequence_parallel_state()
    ranks = dist.get_process_group_ranks
    if state is not None:
        # The same ranks in the same order shard alike, whichever group object holds them.
        if group is not None and group is not state.sp_group and ranks(group) != ranks(state.sp_group):
            raise ValueError(
                f"group (ranks {ranks(group)}) is not the sequence-parallel group set by "
                f"setup_sequence_parallel (ranks {ranks(state.sp_group)}), the only group a model's `*_ring` "
                "attention reads: its shards would not be this batch's. Leave group unset (it defaults to that "
                "group), or destroy_sequence_parallel() to shard for kernels called with your group")
        if layout is not None and layout != state.layout:
            raise ValueError(
                f"layout={layout!r} differs from the layout set by setup_sequence_parallel ({state.layout!r}), the "
                "only layout a model's `*_ring` attention reads: its shards would not be this batch's. Leave layout "
                "unset (it defaults to that layout), or pass layout= to setup_sequence_parallel")
    elif group is not None and group_size_rank(group)[0] > 1 and not _WARNED_GROUP_WITHOUT_SETUP:
        # Allowed (the kernels take the group as an argument); a transformers model would attend
        # within each rank's shard alone, with nothing said.
        _WARNED_GROUP_WITHOUT_SETUP = True
        warnings.warn(
            "shard_batch(group=...) without setup_sequence_parallel: the batch is for kernels called with that "
            "group (hf_dilated.distributed.ring_attention(..., group=...)); the `*_ring` attn_implementation names "
            "of a transformers model read only the group of setup_sequence_parallel, and without one attend "
            "within each rank's shard alone", stacklevel=3)


def _check_same_batch(group, **tensors) -> None:
    """shard_batch's tensors, the whole batch, must be the same on every rank of the group: each
    rank keeps its shard of them, so ranks given other rows (a DataLoader prepared for data
    parallelism gives every process its own) train on pieces of different sequences, a plausible
    loss with nothing said. One all-gather of their shapes and of a checksum of their values."""
    from .faults import check_same_on_all_ranks

    def checksum(t):  # a weighted sum on the device, wrapping in int64: one number read back
        weights = torch.arange(1, t.numel() + 1, device=t.device, dtype=torch.int64) * 1_000_003 + 7
        return int((t.reshape(-1).long() * weights).sum())

    sums = {f"{name} values": checksum(t) for name, t in tensors.items() if t is not None}
    try:
        check_same_on_all_ranks(group, "shard_batch", **tensors, **sums)
    except ValueError as exc:
        raise ValueError(f"{exc} shard_batch takes the whole batch, the same on every rank of the sequence-parallel "
                         "group, and keeps this rank's shard: give the ranks of one group the same rows (a DataLoader "
                         "prepared for data parallelism gives each process its own: split the rows by the "
                         "data-parallel rank, get_sequence_parallel_state().dp_rank)") from None


def shard_batch(input_ids: torch.Tensor, labels: torch.Tensor | None = None, *, shift_labels=None,
                attention_mask=None, position_ids=None, group=None, layout: str | None = None,
                pad_token_id: int = 0, ignore_index: int = -100) -> dict:
    """This rank's part of a causal-LM batch, as keyword arguments for a transformers model.

    input_ids, labels, attention_mask, position_ids: (batch, seq_len), the *whole* batch, the same
    on every rank of the group (checked: _check_same_batch). Returns a dict with
    - input_ids, position_ids: this rank's tokens and their *global* positions (so RoPE and the
      attention patterns see true positions). position_ids are the given ones, else
      cumsum(attention_mask) - 1 (as `generate` does), else 0..seq_len-1;
    - attention_mask: this rank's part, when one was given;
    - labels and shift_labels (only when labels or shift_labels are given): the labels shifted left
      by one *before* sharding, so the last token of a shard still predicts the first token of the
      next one; transformers' causal-LM loss uses shift_labels as they are. Labels that are already
      shifted (shift_labels[t] is what token t predicts, transformers' own convention) are passed
      as `shift_labels=` instead of `labels=` and only sharded;
    - num_items_in_batch: the number of labelled tokens of the whole batch, so that the model's
      loss is (this rank's loss sum) / (global count) and the group's losses add up to the global
      mean (`reduce_loss`).
    A length the layout cannot split evenly is padded at the end (pad_token_id, ignore_index
    labels, mask 0 when a mask is given, positions continuing). Causal attention never lets an
    earlier token see a later one, so the padding changes nothing for the real tokens.
    group defaults to the group of `setup_sequence_parallel`; with no group nothing is sharded.
    Under `setup_sequence_parallel` a model's `*_ring` attention reads only its group and layout, so
    a `group` or `layout` that differs from them is a ValueError; a group given with none set is for
    the kernels called with that group (`ring_attention(..., group=...)`).
    """
    given_group, given_layout = group, layout
    group, layout = resolve_group_layout(group, layout)
    _check_against_setup(given_group, given_layout)
    world, rank = group_size_rank(group)
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError(f"input_ids must be a 2-D tensor (batch, seq_len), got {getattr(input_ids, 'shape', input_ids)}")
    batch, seq_len = input_ids.shape
    if labels is not None and shift_labels is not None:
        raise ValueError("labels, shift_labels: pass one of them (shift_labels are labels already shifted)")
    for name, t in (("labels", labels), ("shift_labels", shift_labels), ("attention_mask", attention_mask),
                    ("position_ids", position_ids)):
        if t is not None and (not isinstance(t, torch.Tensor) or t.shape != input_ids.shape):
            raise ValueError(f"{name} must be a tensor shaped like input_ids {tuple(input_ids.shape)}, "
                             f"got {getattr(t, 'shape', t)}")
    if world > 1:
        _check_same_batch(group, input_ids=input_ids, labels=labels, shift_labels=shift_labels,
                          attention_mask=attention_mask, position_ids=position_ids)
    if position_ids is None:
        if attention_mask is not None:
            position_ids = mask_ranks(attention_mask)
            position_ids = position_ids.masked_fill(attention_mask == 0, 1)
        else:
            position_ids = torch.arange(seq_len, device=input_ids.device).expand(batch, seq_len)
    out = {}
    if labels is not None:
        shift_labels = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=ignore_index)
    if shift_labels is not None:
        out["num_items_in_batch"] = (shift_labels != ignore_index).sum()
    total = padded_length(seq_len, world, layout)
    pad = total - seq_len

    def pad_end(t, value):
        return torch.nn.functional.pad(t, (0, pad), value=value) if pad else t

    last = position_ids[:, -1:]
    tail = last + torch.arange(1, pad + 1, device=position_ids.device)
    parts = {
        "input_ids": pad_end(input_ids, pad_token_id),
        "position_ids": torch.cat([position_ids, tail], dim=1) if pad else position_ids,
    }
    if attention_mask is not None:
        parts["attention_mask"] = pad_end(attention_mask, 0)
    if shift_labels is not None:
        parts["labels"] = pad_end(shift_labels, ignore_index)
    for name, t in parts.items():
        out[name] = shard(t, world, rank, layout, dim=1).contiguous() if world > 1 else t.contiguous()
    if shift_labels is not None:
        out["shift_labels"] = out["labels"]
    return out


class _AllGather(torch.autograd.Function):
    """All-gather whose backward is a reduce-scatter (each shard's gradient summed over ranks)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x, group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad):
        out = torch.empty_like(grad[0])
        dist.reduce_scatter(out, [g.contiguous() for g in grad.unbind(0)], group=ctx.group)
        return out, None


def gather_sequence(x: torch.Tensor, *, seq_len: int | None = None, group=None, layout: str | None = None,
                    dim: int = 1) -> torch.Tensor:
    """The global tensor from every rank's shard of `x` (sequence along `dim`), in sequence order,
    trimmed to `seq_len` when given (to drop shard_batch's padding). Differentiable: the gradient
    of a shard is the *sum* over ranks of the gradients flowing into its slice."""
    group, layout = resolve_group_layout(group, layout)
    world, _ = group_size_rank(group)
    if world > 1:
        parts = _AllGather.apply(x.contiguous(), group)
        x = unshard(list(parts.unbind(0)), layout, dim=dim)
    if seq_len is not None:
        x = x.narrow(dim, 0, seq_len)
    return x


class _SumForwardIdentityBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local, group, grad_scale):
        ctx.grad_scale = grad_scale
        total = local.detach().clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.grad_scale, None, None


def reduce_loss(local_loss: torch.Tensor, *, group=None, grad_reduction: str = "mean") -> torch.Tensor:
    """The group's total of per-rank loss parts (e.g. the model's loss computed with shard_batch's
    num_items_in_batch): the global loss, the same value on every rank.

    Its backward sends each rank only its own part's gradient (no communication); summed over the
    group's ranks these are the gradient of the global loss. `grad_reduction` says how parameter
    gradients will be combined across the group afterwards: "mean" (DDP / Accelerate / FSDP2 average
    over all processes; the gradient is scaled by the group size to compensate) or "sum".
    """
    if grad_reduction not in ("mean", "sum"):
        raise ValueError(f"grad_reduction must be 'mean' or 'sum', got {grad_reduction!r}")
    if group is None:
        group = get_sequence_parallel_group()
    world, _ = group_size_rank(group)
    if world == 1:
        return local_loss
    scale = float(world) if grad_reduction == "mean" else 1.0
    return _SumForwardIdentityBackward.apply(local_loss, group, scale)
