"""The prologue every ring kernel runs before its first exchange.

`global_tokens` all-gathers the small per-token metadata (positions, padding flags) once per call
(once per forward pass of a model: `prepare_call` caches the plan built from it for the next
layers), so every rank knows the positions, documents and padding of the whole sequence and can
build any visibility pattern, for its own queries or for a peer's, without further messages. That
metadata is the kernels' one rule, `ops.token_layout.token_layout`, applied to the gathered global
mask and positions: a ring kernel reads the tokens exactly as the single-process kernel would.
"""
from __future__ import annotations

import warnings

from dataclasses import dataclass, fields

import torch
import torch.distributed as dist

from ..ops.plan_cache import PlanCache
from ..ops.token_layout import TokenLayout, token_layout
from .layout import shard_indices, unshard

@dataclass
class GlobalTokens(TokenLayout):
    """The TokenLayout of the whole sequence (positions, real, doc, plain: (batch, seq_len)),
    identical on every rank of the group, and where this rank's tokens lie in it."""
    local_index: torch.Tensor  # (n_local,) global index of each of this rank's tokens
    world: int
    rank: int
    layout: str

    def rank_index(self, r: int) -> torch.Tensor:
        return shard_indices(self.positions.shape[1], self.world, r, self.layout, self.positions.device)


def global_tokens(batch: int, n_local: int, *, attention_mask, position_ids, group, layout: str,
                  device, any_mask: bool, any_positions: bool) -> GlobalTokens:
    """Global positions / padding / documents (docs/contract.md 3.1) from the local
    shards of attention_mask and position_ids (either may be None). One all-gather, int64,
    2 x batch x n_local per rank, and only when some rank has a mask or positions.

    any_mask / any_positions: whether any rank of the group has one (a rank whose shard has no
    padding may get no mask from transformers; its tokens are then all real)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    seq_len = n_local * world
    mask = positions = None
    if any_mask or any_positions:
        mask, positions = _gather(batch, n_local, attention_mask, position_ids, group, layout, device)
    rule = token_layout(batch, seq_len, device, attention_mask=mask if any_mask else None,
                        position_ids=positions if any_positions else None)
    return GlobalTokens(**{f.name: getattr(rule, f.name) for f in fields(TokenLayout)},
                        local_index=shard_indices(seq_len, world, rank, layout, device),
                        world=world, rank=rank, layout=layout)


def _gather(batch, n_local, attention_mask, position_ids, group, layout, device):
    """The global (batch, seq_len) attention mask and position_ids from every rank's shard: one
    all-gather; a rank without a mask contributes ones, one without positions -1s."""
    world = dist.get_world_size(group)
    real = (attention_mask.to(torch.bool) if attention_mask is not None
            else torch.ones(1, n_local, dtype=torch.bool, device=device)).expand(batch, n_local)
    pos = (position_ids.long() if position_ids is not None
           else torch.full((1, n_local), -1, dtype=torch.long, device=device)).expand(batch, n_local)
    local = torch.stack([pos, real.long()]).contiguous()  # (2, batch, n_local)
    shards = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(shards, local, group=group)
    full = unshard(shards, layout, dim=2)
    return full[1], full[0]


# A rank uses its cached plan only when every rank of the group has one (agreed in the signature
# message), so the ranks always run the same collectives.
_PLANS = PlanCache()


def prepare_call(what: str, q, k, v, *, attention_mask, position_ids, group, layout: str, build, **config):
    """The prologue every ring kernel runs before its first exchange: checks that the ranks agree
    on shapes, dtype, layout and configuration (faults.py), gathers the token metadata and returns
    build(tokens), the kernel's plan (or the cached plan of an earlier layer with the same inputs)."""
    from .faults import check_same_on_all_ranks, fingerprint
    from .layout import chunks_per_rank

    if q.shape[2] != k.shape[2]:
        raise ValueError(f"{what}: q_len ({q.shape[2]}) must equal kv_len ({k.shape[2]}) under sequence "
                         "parallelism: q, k and v are this rank's shards of the same tokens")
    n = q.shape[2]
    if n % chunks_per_rank(layout):
        raise ValueError(f"{what}: the local length ({n}) must be a multiple of {chunks_per_rank(layout)} for "
                         f"layout {layout!r}; pad the global sequence to layout.padded_length() (shard_batch does)")
    # The group by its members and this rank's place in it (a plan depends on nothing else of it).
    members = (tuple(dist.get_process_group_ranks(group)), dist.get_rank(group))
    key = (what, tuple(q.shape), tuple(k.shape), q.dtype, str(q.device), layout, members, fingerprint(config))
    cached = _PLANS.get(key, attention_mask, position_ids)
    flags = check_same_on_all_ranks(group, what, flags={"mask": attention_mask is not None,
                                                        "positions": position_ids is not None,
                                                        "cached": cached is not None},
                                    q=q, k=k, v=v, layout=layout, **config)
    if all(flags["cached"]):
        return cached
    if any(flags["positions"]) and not all(flags["positions"]):
        raise ValueError(f"{what}: position_ids given on some ranks of the group and not on others "
                         f"(per rank: {flags['positions']}); pass them on every rank or on none")
    tokens = global_tokens(q.shape[0], n, attention_mask=attention_mask, position_ids=position_ids, group=group,
                           layout=layout, device=q.device, any_mask=any(flags["mask"]),
                           any_positions=all(flags["positions"]))
    if all(flags["positions"]) and tokens.world > 1:
        _check_not_local_default(what, tokens, n, layout)
    value = build(tokens)
    _PLANS.put(key, attention_mask, position_ids, value)
    return value


def _check_not_local_default(what: str, tokens: GlobalTokens, n: int, layout: str) -> None:
    # transformers models fill in position_ids = 0..n-1 when none are passed. Under sequence
    # parallelism that means every rank numbers its own shard from 0, which in the zigzag layout
    # puts documents starting at position n/2 in the middle of the sequence: never a real input (an
    # error). In the contiguous layout it reads as one document per rank, which packing can mean
    # (a warning: it was silently wrong for the input it usually is, a shard without its positions).
    local = torch.arange(n, device=tokens.positions.device)
    if not all(bool((tokens.positions[:, tokens.rank_index(r)] == local).all()) for r in range(tokens.world)):
        return
    message = (f"{what}: position_ids are 0..{n - 1} on every rank, the model's default when no position_ids "
               "are passed; under sequence parallelism pass the *global* positions of the rank's tokens "
               "(hf_dilated.distributed.shard_batch returns them)")
    if layout == "zigzag":
        raise ValueError(message)
    warnings.warn(message + "; read as one document per rank", UserWarning, stacklevel=3)
