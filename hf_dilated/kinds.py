"""Every attention kind in one table, read by both front doors: `create_attention` (nn.py) and
the transformers `attn_implementation` names (integrations/transformers.py). Adding a kind is
adding a row here.

Each row's `run(q, k, v, settings, *, is_causal, attention_mask, position_ids, scale, dropout_p,
group, layout, sliding_window)` takes the kernels' inputs (the layout of docs/contract.md 1;
positions and padding by the kernels' rule of ops/token_layout.py; the window of
docs/contract.md 3.3) and the settings named in `settings` (name -> default, None: required).
The ring kinds take this rank's shards under a sequence-parallel `group`; with no
group (or a group of one) each equals its single-process counterpart, so that fallback is written
once, in hf_dilated.distributed. The ring layout reaches `run` resolved (an entry point resolves
it once, hf_dilated.distributed.groups.resolve_group_layout).

Each row also says what the kind supports: causal only or not, attention dropout or not, and the
transformers model families it serves. Each entry point checks a call against its row once, with
`Kind.check_call` / `Kind.check_family` (one exception type per mistake: ValueError); `run`
itself checks none of it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .config import field_defaults
from .patches import supported_model_types


@dataclass(frozen=True)
class Kind:
    """One attention kind: what it takes, what it runs, and what it supports (checked once per
    entry point, by `check_call` and `check_family`, one exception type per mistake)."""

    name: str
    settings: dict  # setting -> default (None: required), the defaults of hf_dilated/config.py
    run: Callable
    sequence_parallel: bool  # shards its sequence over a process group
    dropout: bool  # implements attention dropout (docs/contract.md 8)
    causal_only: bool  # computes causal attention only (docs/contract.md 6)
    families: tuple = ()  # the model types it serves as a transformers attn_implementation; () : none
    # A decode step against a static cache under torch.compile (no Python value from tensor data):
    # static_decode(q, k, v, settings, *, real, seen, scale, sliding_window, far); None: not supported.
    static_decode: Callable | None = None

    def check_call(self, *, is_causal, dropout_p, entry: str, causal_only: bool = False) -> None:
        """A ValueError naming the argument when a call asks for what this kind does not do.
        `entry` names the kind to the caller (e.g. "attn_implementation='ring'"); `causal_only`:
        the entry point itself computes causal attention only."""
        if not is_causal and (self.causal_only or causal_only):
            raise ValueError(f"is_causal: {entry} computes causal attention only (docs/contract.md 6, 9), "
                             "got is_causal=False")
        if dropout_p and not self.dropout:
            raise ValueError(f"dropout_p: {entry} does not implement attention dropout (docs/contract.md 8), got "
                             f"dropout_p={dropout_p} (for a transformers model: set attention_dropout=0)")

    def check_family(self, model_type, *, entry: str) -> None:
        """A ValueError unless this kind serves transformers models of `model_type`, listing those it does."""
        if model_type not in self.families:
            raise ValueError(f"{entry}: hf_dilated does not support model_type {model_type!r}; supported: "
                             f"{', '.join(self.families) or 'none (not a transformers attn_implementation)'}")


def _dense(q, k, v, s, *, is_causal, attention_mask, position_ids, scale, dropout_p, group, layout,
           sliding_window=None):
    from .ops.dense import dense_attention

    return dense_attention(q, k, v, is_causal=is_causal, scale=scale, dropout_p=dropout_p,
                           attention_mask=attention_mask, position_ids=position_ids, sliding_window=sliding_window)


def _dilated(q, k, v, s, *, is_causal, attention_mask, position_ids, scale, dropout_p, group, layout,
           sliding_window=None, far=None):
    from .ops.dilated import dilated_attention

    q_far, k_far = far or (None, None)
    return dilated_attention(q, k, v, s["segment_lengths"], s["dilation_rates"], mode=s["mode"],
                             is_causal=is_causal, scale=scale, dropout_p=dropout_p,
                             attention_mask=attention_mask, position_ids=position_ids,
                             sliding_window=sliding_window, local_window=s.get("local_window"),
                             q_far=q_far, k_far=k_far)


def _block_sparse(q, k, v, s, *, is_causal, attention_mask, position_ids, scale, dropout_p, group, layout,
           sliding_window=None):
    from .ops.block_sparse import block_sparse_attention

    return block_sparse_attention(q, k, v, s["pattern"], block_size=s["block_size"], is_causal=is_causal,
                                  scale=scale, attention_mask=attention_mask, position_ids=position_ids,
                                  sliding_window=sliding_window)


def _ring(q, k, v, s, *, is_causal, attention_mask, position_ids, scale, dropout_p, group, layout,
           sliding_window=None):
    from .distributed import ring_attention

    return ring_attention(q, k, v, group=group, layout=layout, scale=scale,
                          attention_mask=attention_mask, position_ids=position_ids, dropout_p=dropout_p,
                          sliding_window=sliding_window)


def _dilated_ring(q, k, v, s, *, is_causal, attention_mask, position_ids, scale, dropout_p, group, layout,
           sliding_window=None, far=None):
    from .distributed import dilated_ring_attention

    # far: (q_far, k_far), or under sequence parallelism a function of the shard's global positions
    q_far, k_far = (None, None) if far is None or callable(far) else far
    return dilated_ring_attention(q, k, v, s["segment_lengths"], s["dilation_rates"], mode=s["mode"], group=group,
                                  layout=layout, scale=scale, attention_mask=attention_mask,
                                  position_ids=position_ids, dropout_p=dropout_p, sliding_window=sliding_window,
                                  local_window=s.get("local_window"), q_far=q_far, k_far=k_far,
                                  far_at=far if callable(far) else None)


def _block_sparse_ring(q, k, v, s, *, is_causal, attention_mask, position_ids, scale, dropout_p, group, layout,
           sliding_window=None):
    from .distributed import block_sparse_ring_attention

    return block_sparse_ring_attention(q, k, v, s["pattern"], block_size=s["block_size"], group=group,
                                       layout=layout, scale=scale, attention_mask=attention_mask,
                                       position_ids=position_ids, sliding_window=sliding_window)


def _dilated_static(q, k, v, s, *, real, seen, scale, sliding_window=None, far=None):
    from .ops.dilated_decode import dilated_decode_static

    q_far, k_far = far or (None, None)
    return dilated_decode_static(q, k, v, s["segment_lengths"], s["dilation_rates"], s["mode"], scale=scale, real=real,
                                 seen=seen, local_window=s.get("local_window"), q_far=q_far, k_far=k_far,
                                 sliding_window=sliding_window)


def _dense_static(q, k, v, s, *, real, seen, scale, sliding_window=None, far=None):
    from .ops.dilated_decode import dilated_decode_static

    # dense causal attention is one level of dilation 1 whose segment holds the whole cache
    return dilated_decode_static(q, k, v, [k.shape[2]], [1], "union", scale=scale, real=real, seen=seen,
                                 sliding_window=sliding_window)


def _block_sparse_static(q, k, v, s, *, real, seen, scale, sliding_window=None, far=None):
    from .ops.block_sparse_decode import block_sparse_decode_static

    return block_sparse_decode_static(q, k, v, s["pattern"], block_size=s["block_size"], scale=scale, real=real,
                                      seen=seen, sliding_window=sliding_window)


_DILATED = field_defaults("segment_lengths", "dilation_rates", "mode", "local_window")
_BLOCK_SPARSE = field_defaults("pattern", "block_size")
# Every kind but "dense" (transformers' own "sdpa" is that) serves the families of hf_dilated.patches.
_FAMILIES = tuple(supported_model_types())

KINDS = {
    kind.name: kind
    for kind in (
        Kind("dense", {}, _dense, sequence_parallel=False, dropout=True, causal_only=False),
        Kind("dilated", _DILATED, _dilated, sequence_parallel=False, dropout=True, causal_only=False,
             families=_FAMILIES, static_decode=_dilated_static),
        Kind("block_sparse", _BLOCK_SPARSE, _block_sparse, sequence_parallel=False, dropout=False, causal_only=False,
             families=_FAMILIES, static_decode=_block_sparse_static),
        Kind("ring", {}, _ring, sequence_parallel=True, dropout=True, causal_only=True, families=_FAMILIES,
             static_decode=_dense_static),
        Kind("dilated_ring", _DILATED, _dilated_ring, sequence_parallel=True, dropout=True, causal_only=True,
             families=_FAMILIES, static_decode=_dilated_static),
        Kind("block_sparse_ring", _BLOCK_SPARSE, _block_sparse_ring, sequence_parallel=True, dropout=False,
             causal_only=True, families=_FAMILIES, static_decode=_block_sparse_static),
    )
}

# The transformers attn_implementation names: the kinds that serve some family.
TRANSFORMERS_NAMES = tuple(name for name, kind in KINDS.items() if kind.families)
