"""Every attention kind in one table, read by both front doors: `create_attention` (nn.py) and
the transformers `attn_implementation` names (integrations/transformers.py). Adding a kind is
adding a row here.

Each row's `run(q, k, v, settings, *, is_causal, attention_mask, position_ids, scale, dropout_p,
group, layout, sliding_window)` takes the kernels' inputs (the layout of docs/contract.md 1;
positions and padding by the kernels' rule of ops/token_layout.py; the window of
docs/contract.md 3.3) and the settings named in `settings` (name -> default, None: required). The ring kinds take this rank's shards under a sequence-parallel `group`; with no
group (or a group of one) each equals its single-process counterpart, so that fallback is written
once, in hf_dilated.distributed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .config import DEFAULT_BLOCK_SIZE


@dataclass(frozen=True)
class Kind:
    name: str
    settings: dict  # setting -> default (None: required)
    run: Callable
    sequence_parallel: bool  # shards its sequence over a process group
    dropout: bool  # implements attention dropout (on one process)


def _no_dropout(name, dropout_p):
    if dropout_p:
        raise ValueError(f"dropout_p: {name!r} attention does not implement attention dropout, got {dropout_p}")


def _causal_only(name, is_causal):
    if not is_causal:
        raise ValueError(f"is_causal: {name!r} attention is causal only (docs/contract.md 3.1), got False")


def _dense(q, k, v, s, *, is_causal, attention_mask, position_ids, scale, dropout_p, group, layout,
           sliding_window=None):
    from .ops.dense import dense_attention

    return dense_attention(q, k, v, is_causal=is_causal, scale=scale, dropout_p=dropout_p,
                           attention_mask=attention_mask, position_ids=position_ids, sliding_window=sliding_window)


def _dilated(q, k, v, s, *, is_causal, attention_mask, position_ids, scale, dropout_p, group, layout,
           sliding_window=None):
    from .ops.dilated import dilated_attention

    return dilated_attention(q, k, v, s["segment_lengths"], s["dilation_rates"], mode=s["mode"],
                             is_causal=is_causal, scale=scale, dropout_p=dropout_p,
                             attention_mask=attention_mask, position_ids=position_ids,
                             sliding_window=sliding_window)


def _block_sparse(q, k, v, s, *, is_causal, attention_mask, position_ids, scale, dropout_p, group, layout,
           sliding_window=None):
    from .ops.block_sparse import block_sparse_attention

    _no_dropout("block_sparse", dropout_p)
    return block_sparse_attention(q, k, v, s["pattern"], block_size=s["block_size"], is_causal=is_causal,
                                  scale=scale, attention_mask=attention_mask, position_ids=position_ids,
                                  sliding_window=sliding_window)


def _ring(q, k, v, s, *, is_causal, attention_mask, position_ids, scale, dropout_p, group, layout,
           sliding_window=None):
    from .distributed import ring_attention

    _causal_only("ring", is_causal)
    return ring_attention(q, k, v, group=group, layout=layout or "zigzag", scale=scale,
                          attention_mask=attention_mask, position_ids=position_ids, dropout_p=dropout_p,
                          sliding_window=sliding_window)


def _dilated_ring(q, k, v, s, *, is_causal, attention_mask, position_ids, scale, dropout_p, group, layout,
           sliding_window=None):
    from .distributed import dilated_ring_attention

    _causal_only("dilated_ring", is_causal)
    return dilated_ring_attention(q, k, v, s["segment_lengths"], s["dilation_rates"], mode=s["mode"], group=group,
                                  layout=layout or "zigzag", scale=scale, attention_mask=attention_mask,
                                  position_ids=position_ids, dropout_p=dropout_p, sliding_window=sliding_window)


def _block_sparse_ring(q, k, v, s, *, is_causal, attention_mask, position_ids, scale, dropout_p, group, layout,
           sliding_window=None):
    from .distributed import block_sparse_ring_attention

    _causal_only("block_sparse_ring", is_causal)
    _no_dropout("block_sparse_ring", dropout_p)
    return block_sparse_ring_attention(q, k, v, s["pattern"], block_size=s["block_size"], group=group,
                                       layout=layout or "zigzag", scale=scale, attention_mask=attention_mask,
                                       position_ids=position_ids, sliding_window=sliding_window)


_DILATED = {"segment_lengths": None, "dilation_rates": None, "mode": "union"}
_BLOCK_SPARSE = {"pattern": None, "block_size": DEFAULT_BLOCK_SIZE}

KINDS = {
    kind.name: kind
    for kind in (
        Kind("dense", {}, _dense, sequence_parallel=False, dropout=True),
        Kind("dilated", _DILATED, _dilated, sequence_parallel=False, dropout=True),
        Kind("block_sparse", _BLOCK_SPARSE, _block_sparse, sequence_parallel=False, dropout=False),
        Kind("ring", {}, _ring, sequence_parallel=True, dropout=True),
        Kind("dilated_ring", _DILATED, _dilated_ring, sequence_parallel=True, dropout=True),
        Kind("block_sparse_ring", _BLOCK_SPARSE, _block_sparse_ring, sequence_parallel=True, dropout=False),
    )
}

# The transformers names: every kind but "dense" (transformers' own "sdpa" is that).
TRANSFORMERS_NAMES = tuple(name for name in KINDS if name != "dense")
