"""Every attention kind in one table, read by both front doors: `create_attention` (nn.py) and
the transformers `attn_implementation` names (integrations/transformers.py). Adding a kind is
adding a row here.

Each row's `run(q, k, v, settings, *, is_causal, attention_mask, position_ids, scale, dropout_p,
group, layout, sliding_window, rope_frequencies, state, rope_offset)` takes the kernels' inputs (the layout of
docs/contract.md 1; positions and padding by the kernels' rule of ops/token_layout.py; the window
of docs/contract.md 3.3) and the settings named in `settings` (name -> default; config.REQUIRED:
no default). `rope_frequencies` (the inv_freq of the RoPE that rotated q and k) is needed only by
settings with far keys at grouped positions (config.far_keys): the kind rotates q and k on to
them itself (docs/contract.md 4.1), so every entry point passes the same settings and one tensor.
`state` is a dict the caller keeps per layer across calls, or None: what a kind keeps between
decode steps (sparse far keys' block summaries, ops/sparse_far_decode.py) lives there.
`rope_offset` (ops/rope.RopeOffset, or None) says where the model rotated q and k further than at
their kernel positions; the kinds with far keys move them from there.
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

import warnings
from dataclasses import dataclass
from typing import Callable

from .config import far_keys, field_defaults
from .patches import supported_model_types


@dataclass(frozen=True)
class Kind:
    """One attention kind: what it takes, what it runs, and what it supports (checked once per
    entry point, by `check_call` and `check_family`, one exception type per mistake)."""

    name: str
    settings: dict  # setting -> default (config.REQUIRED: none), the defaults of hf_dilated/config.py
    run: Callable
    sequence_parallel: bool  # shards its sequence over a process group
    dropout: bool  # implements attention dropout (docs/contract.md 8)
    causal_only: bool  # computes causal attention only (docs/contract.md 6)
    families: tuple = ()  # the model types it serves as a transformers attn_implementation; () : none
    # A decode step against a static cache under torch.compile (no Python value from tensor data):
    # static_decode(q, k, v, settings, *, real, seen, scale, sliding_window, rope_frequencies, rope_shift); None:
    # not supported.
    static_decode: Callable | None = None
    # What an eager call on a static cache keeps for the compiled steps after it, on the
    # cache: static_keep(k, settings, *, real, seen, q_len, rope_frequencies, rope_shift); None: nothing.
    static_keep: Callable | None = None

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


def _far_keys(s, rope_frequencies):
    """(window, group, inv_freq) of the settings' far keys (docs/contract.md 4.1), or None."""
    far = far_keys(s)
    if far is None:
        return None
    if rope_frequencies is None:
        raise ValueError(f"rope_frequencies: far_group={far[1]} reads far keys at grouped positions, which needs the "
                         "inv_freq of the RoPE that rotated q and k")
    return (*far, rope_frequencies)


def _dense(q, k, v, s, *, is_causal, attention_mask, position_ids, scale, dropout_p, group, layout,
           sliding_window=None, rope_frequencies=None, state=None, rope_offset=None):
    from .ops.dense import dense_attention

    return dense_attention(q, k, v, is_causal=is_causal, scale=scale, dropout_p=dropout_p,
                           attention_mask=attention_mask, position_ids=position_ids, sliding_window=sliding_window)


def _dilated(q, k, v, s, *, is_causal, attention_mask, position_ids, scale, dropout_p, group, layout,
             sliding_window=None, rope_frequencies=None, state=None, rope_offset=None):
    from .ops.dilated import dilated_attention
    from .ops.rope import far_projections
    from .ops.token_layout import token_layout

    q_far = k_far = None
    far = _far_keys(s, rope_frequencies)
    selection = _far_selection(s)
    if selection is not None and _sparse_decode_applies(q, k, s, is_causal, dropout_p, sliding_window):
        from .ops.sparse_far_decode import SummaryState, sparse_far_decode
        from .ops.token_layout import regular_rows

        rows = regular_rows(k.shape[0], k.shape[2], k.device, attention_mask, position_ids)
        if rows is not None and max(rows[0]) <= k.shape[2] - q.shape[2]:  # no padded query
            kept = None
            if rope_offset is not None:  # (the GPU's steps take the kernels' positions as the model's)
                if state is not None:
                    kept = state.get("far_summaries") or state.setdefault("far_summaries", SummaryState())
            elif state is not None:
                from .ops import sparse_far_concatenated, sparse_far_reserved

                step = dict(local_window=s["local_window"], far_band=s["far_band"], selection=selection,
                            scale=q.shape[-1] ** -0.5 if scale is None else scale, first=rows[0], shift=rows[1],
                            rotation=far)
                out = None
                if q.shape[2] == 1 and q.device.type in sparse_far_reserved.GRAPHED_ON:  # an in-place cache, on a GPU
                    out = sparse_far_reserved.reserved_step(q, k, v, layer=id(state), state=state, **step)
                if out is None and q.shape[2] == 1 and q.device.type in sparse_far_concatenated.COMPILED_ON:
                    out = sparse_far_concatenated.concatenated_step(q, k, v, state=state, **step)  # a DynamicCache
                if out is not None:
                    return out
                kept = state.get("far_summaries") or state.setdefault("far_summaries", SummaryState())
            return sparse_far_decode(q, k, v, local_window=s["local_window"], far_band=s["far_band"],
                                     selection=selection, scale=q.shape[-1] ** -0.5 if scale is None else scale,
                                     first=rows[0], shift=rows[1], rotation=far, state=kept,
                                     rope_shift=None if rope_offset is None else rope_offset.per_row)
    if far is not None:
        positions = token_layout(k.shape[0], k.shape[2], k.device, attention_mask, position_ids).positions
        q_far, k_far = far_projections(q, k, positions, *far,
                                       offset=None if rope_offset is None else rope_offset.per_key)
    return dilated_attention(q, k, v, s["segment_lengths"], s["dilation_rates"], mode=s["mode"],
                             is_causal=is_causal, scale=scale, dropout_p=dropout_p,
                             attention_mask=attention_mask, position_ids=position_ids,
                             sliding_window=sliding_window, local_window=s["local_window"],
                             q_far=q_far, k_far=k_far, far_band=s["far_band"], far_selection=_far_selection(s))


def _sparse_decode_applies(q, k, s, is_causal, dropout_p, sliding_window) -> bool:
    """A decode step (a few queries against a longer cache) whose levels hold every earlier key: the
    sparse far keys' own decode (ops/sparse_far_decode.py) reads the band, sinks and chosen blocks only."""
    from .config import DECODE_MAX_QUERIES

    n = k.shape[2]
    return (q.shape[2] <= DECODE_MAX_QUERIES and q.shape[2] < n and is_causal and not dropout_p
            and sliding_window is None and s["mode"] == "union"
            and any(w >= n and r == 1 for w, r in zip(s["segment_lengths"], s["dilation_rates"])))


def _far_selection(s):
    """The settings' sparse far keys (docs/contract.md 4.2), or None."""
    from .ops.far_selection import FarSelection

    if s["far_top_k"] is None:
        return None
    return FarSelection(s["far_top_k"], s["far_block_size"], s["far_sinks"])


def _block_sparse(q, k, v, s, *, is_causal, attention_mask, position_ids, scale, dropout_p, group, layout,
                  sliding_window=None, rope_frequencies=None, state=None, rope_offset=None):
    from .ops.block_sparse import block_sparse_attention

    _warn_adaptive_against_a_cache(s["pattern"], q, k)
    return block_sparse_attention(q, k, v, s["pattern"], block_size=s["block_size"], is_causal=is_causal,
                                  scale=scale, attention_mask=attention_mask, position_ids=position_ids,
                                  sliding_window=sliding_window)


def _warn_adaptive_against_a_cache(pattern, q, k) -> None:
    if (pattern.get("type") if isinstance(pattern, dict) else getattr(pattern, "type", None)) == "adaptive" \
            and q.shape[2] < k.shape[2]:
        warnings.warn("block_sparse: pattern 'adaptive' pools every query of a query block, later ones included "
                      "(docs/contract.md 5): a call against a cache (generation) pools the queries it has, so it may "
                      "choose other blocks than a forward over the whole sequence", UserWarning, stacklevel=3)


def _ring(q, k, v, s, *, is_causal, attention_mask, position_ids, scale, dropout_p, group, layout,
          sliding_window=None, rope_frequencies=None, state=None, rope_offset=None):
    from .distributed import ring_attention

    return ring_attention(q, k, v, group=group, layout=layout, scale=scale,
                          attention_mask=attention_mask, position_ids=position_ids, dropout_p=dropout_p,
                          sliding_window=sliding_window)


def _dilated_ring(q, k, v, s, *, is_causal, attention_mask, position_ids, scale, dropout_p, group, layout,
                  sliding_window=None, rope_frequencies=None, state=None, rope_offset=None):
    from .distributed import dilated_ring_attention
    from .ops.rope import far_projections

    far = _far_keys(s, rope_frequencies)
    # A rank cannot tell its tokens' positions from its shard of a padding mask: the ring kernel
    # finds them and asks for the far projections at them. (rope_offset: without a group, the whole
    # row's, as for dilated; a rank's shard gets none: docs/contract.md 4.1.)
    offset = None if rope_offset is None else rope_offset.per_key
    far_at = None if far is None else (lambda positions: far_projections(q, k, positions, *far, offset=offset))
    return dilated_ring_attention(q, k, v, s["segment_lengths"], s["dilation_rates"], mode=s["mode"], group=group,
                                  layout=layout, scale=scale, attention_mask=attention_mask,
                                  position_ids=position_ids, dropout_p=dropout_p, sliding_window=sliding_window,
                                  local_window=s["local_window"], far_at=far_at, far_band=s["far_band"],
                                  far_selection=_far_selection(s))


def _block_sparse_ring(q, k, v, s, *, is_causal, attention_mask, position_ids, scale, dropout_p, group, layout,
                       sliding_window=None, rope_frequencies=None, state=None, rope_offset=None):
    from .distributed import block_sparse_ring_attention

    _warn_adaptive_against_a_cache(s["pattern"], q, k)
    return block_sparse_ring_attention(q, k, v, s["pattern"], block_size=s["block_size"], group=group,
                                       layout=layout, scale=scale, attention_mask=attention_mask,
                                       position_ids=position_ids, sliding_window=sliding_window)


def _dilated_static(q, k, v, s, *, real, seen, scale, sliding_window=None, rope_frequencies=None, rope_shift=None):
    from .ops.dilated_decode import dilated_decode_static
    from .ops.rope import far_projections_static, far_queries_static

    far = _far_keys(s, rope_frequencies)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    selection = _far_selection(s)
    if selection is not None or s["far_band"] is not None:
        from .ops import sparse_far_static
        from .ops.far_selection import FarSelection

        n = k.shape[2]
        if sliding_window is not None or s["mode"] != "union" or not any(
                w >= n and r == 1 for w, r in zip(s["segment_lengths"], s["dilation_rates"])):
            name = "far_top_k" if selection is not None else "far_band"
            raise ValueError(f"{name}: a compiled step on a static cache reads sparse far keys only where one level "
                             "of dilation 1 holds the whole cache and the layer has no sliding_window")
        settings = dict(local_window=s["local_window"], far_band=s["far_band"], scale=scale, real=real, seen=seen)
        kept = None if selection is None else sparse_far_static.kept_for(k, selection.block_size, far)
        if kept is not None:  # kept on the cache's key tensor by an eager call on it
            q_far = q if far is None else far_queries_static(q, real, seen, *far)
            q_bound = None if far is None or rope_shift is None else far_queries_static(q, real, seen, *far, rope_shift)
            return sparse_far_static.kept_step(q, k, v, q_far, selection=selection, rotation=far, kept=kept,
                                               q_bound=q_bound, shift=rope_shift, **settings)
        q_far, k_far = (q, k) if far is None else far_projections_static(q, k, real, seen, *far, rope_shift)
        if selection is None:  # a narrower band past local_window alone: every far key (a selection of them all)
            selection = FarSelection(n, s["far_block_size"], 0)
        return sparse_far_static.every_slot_step(q, k, v, q_far, k_far, selection=selection, **settings)
    q_far = k_far = None
    if far is not None:
        q_far, k_far = far_projections_static(q, k, real, seen, *far)
    return dilated_decode_static(q, k, v, s["segment_lengths"], s["dilation_rates"], s["mode"], scale=scale, real=real,
                                 seen=seen, local_window=s["local_window"], q_far=q_far, k_far=k_far,
                                 sliding_window=sliding_window)


def _dilated_static_keep(k, s, *, real, seen: int, q_len: int, rope_frequencies=None, rope_shift=None):
    """After an eager call on a static cache whose key tensor is k: keep on it the block summaries
    its compiled steps read (ops/sparse_far_static.py); nothing for settings without sparse far keys."""
    from .config import DECODE_MAX_QUERIES
    from .ops import sparse_far_static

    selection = _far_selection(s)
    if selection is None or s["mode"] != "union" or not any(
            w >= k.shape[2] and r == 1 for w, r in zip(s["segment_lengths"], s["dilation_rates"])):
        return
    sparse_far_static.keep(k, real, seen, q_len, selection.block_size, _far_keys(s, rope_frequencies),
                           few=DECODE_MAX_QUERIES, shift=rope_shift)


def _dense_static(q, k, v, s, *, real, seen, scale, sliding_window=None, rope_frequencies=None, rope_shift=None):
    from .ops.dilated_decode import dilated_decode_static

    # dense causal attention is one level of dilation 1 whose segment holds the whole cache
    return dilated_decode_static(q, k, v, [k.shape[2]], [1], "union", scale=scale, real=real, seen=seen,
                                 sliding_window=sliding_window)


def _block_sparse_static(q, k, v, s, *, real, seen, scale, sliding_window=None, rope_frequencies=None,
                         rope_shift=None):
    from .ops.block_sparse_decode import block_sparse_decode_static

    return block_sparse_decode_static(q, k, v, s["pattern"], block_size=s["block_size"], scale=scale, real=real,
                                      seen=seen, sliding_window=sliding_window)


_DILATED = field_defaults("segment_lengths", "dilation_rates", "mode", "local_window", "far_group", "far_window",
                          "far_band", "far_top_k", "far_block_size", "far_sinks")
_BLOCK_SPARSE = field_defaults("pattern", "block_size")
# Every kind but "dense" (transformers' own "sdpa" is that) serves the families of hf_dilated.patches.
_FAMILIES = tuple(supported_model_types())

KINDS = {
    kind.name: kind
    for kind in (
        Kind("dense", {}, _dense, sequence_parallel=False, dropout=True, causal_only=False),
        Kind("dilated", _DILATED, _dilated, sequence_parallel=False, dropout=True, causal_only=False,
             families=_FAMILIES, static_decode=_dilated_static, static_keep=_dilated_static_keep),
        Kind("block_sparse", _BLOCK_SPARSE, _block_sparse, sequence_parallel=False, dropout=False, causal_only=False,
             families=_FAMILIES, static_decode=_block_sparse_static),
        Kind("ring", {}, _ring, sequence_parallel=True, dropout=True, causal_only=True, families=_FAMILIES,
             static_decode=_dense_static),
        Kind("dilated_ring", _DILATED, _dilated_ring, sequence_parallel=True, dropout=True, causal_only=True,
             families=_FAMILIES, static_decode=_dilated_static, static_keep=_dilated_static_keep),
        Kind("block_sparse_ring", _BLOCK_SPARSE, _block_sparse_ring, sequence_parallel=True, dropout=False,
             causal_only=True, families=_FAMILIES, static_decode=_block_sparse_static),
    )
}

# The transformers attn_implementation names: the kinds that serve some family.
TRANSFORMERS_NAMES = tuple(name for name, kind in KINDS.items() if kind.families)


def unread_settings(name: str, fields) -> list[str]:
    """The hf_dilated fields among `fields` that attention `name` does not read (a conversion stores
    them for the names that do; ring_layout is read by the sequence-parallel ones)."""
    kind = KINDS[name]
    read = set(kind.settings) | ({"ring_layout"} if kind.sequence_parallel else set())
    return sorted(set(fields) - read - {"original_length", "target_length", "scaled_rope"})


def warn_unread_settings(name: str, fields, stacklevel: int = 3) -> None:
    """A ConversionWarning naming the fields a caller gave that `name` does not read."""
    from .patches.context import ConversionWarning

    unread = unread_settings(name, fields)
    if unread:
        warnings.warn(f"{', '.join(unread)}: attn_implementation {name!r} does not read "
                      f"{'it' if len(unread) == 1 else 'them'} (stored in the hf_dilated entry, for the names that do)",
                      ConversionWarning, stacklevel=stacklevel)


def check_transformers_name(attn_implementation) -> None:
    """A ValueError unless `attn_implementation` is one of TRANSFORMERS_NAMES."""
    if attn_implementation not in TRANSFORMERS_NAMES:
        raise ValueError(f"attn_implementation must be one of {TRANSFORMERS_NAMES}, got {attn_implementation!r}")
