"""Block-sparse attention patterns (docs/contract.md 5): small validated configs.

A pattern says which key blocks each query block may read. Block numbers are counted within a
document: the block of token i is `p_i // block_size`. `bq` is the query's block, `bk` the key's.

- LocalPattern(window):                   0 <= bq - bk < window
- DilatedPattern(window, stride):         0 <= bq - bk < window  or  (bq - bk) mod stride == 0
- GlobalLocalPattern(global_blocks, window): bk < global_blocks  or  0 <= bq - bk < window
- HierarchicalPattern(levels):            union of DilatedPattern(window_l, stride_l)
- AdaptivePattern(top_k, window):         local window plus, per (batch row, head, query block), the
                                          top_k earlier blocks outside the window whose mean-pooled
                                          key best matches the block's mean-pooled query (content
                                          dependent: the kernel selects them, see block_sparse.py)
- CustomPattern(layout):                  a user bool tensor (heads or 1, query_blocks, key_blocks)

Causality and documents are not part of a pattern: the kernel applies them on top (a future or
foreign-document block that a pattern allows is still invisible). `make_pattern` builds a pattern
from an instance or from a dict such as {"type": "global_local", "global_blocks": 1, "window": 4};
`pattern.to_dict()` is its inverse, so patterns round-trip through config.json.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from ..checks import check_int


_SLICE_ENTRIES = 1 << 22  # int64 offsets of one slice of block_layout's rows (32 MB)


def _offsets(q_blocks: torch.Tensor, num_key_blocks: int):
    """(len(q_blocks), num_key_blocks) int64 tensors bq - bk and bk."""
    bk = torch.arange(num_key_blocks, device=q_blocks.device)
    return q_blocks[:, None] - bk[None, :], bk[None, :]


class _StaticPattern:
    """A pattern that depends on block numbers only (same for every batch row and head)."""

    def allowed(self, q_blocks: torch.Tensor, num_key_blocks: int) -> torch.Tensor:
        """bool (len(q_blocks), num_key_blocks): key block bk allowed for query block q_blocks[r]."""
        raise NotImplementedError

    def block_layout(self, q_blocks: torch.Tensor, num_key_blocks: int) -> torch.Tensor:
        """bool (1, 1, len(q_blocks), num_key_blocks), made a slice of rows at a time: `allowed`
        works on int64 offsets, 8 bytes an entry (2 GB for the 16K x 16K blocks of a million
        tokens in blocks of 64), the layout on bools."""
        out = torch.empty(len(q_blocks), num_key_blocks, dtype=torch.bool, device=q_blocks.device)
        rows = max(1, _SLICE_ENTRIES // max(num_key_blocks, 1))
        for r in range(0, len(q_blocks), rows):
            out[r:r + rows] = self.allowed(q_blocks[r:r + rows], num_key_blocks)
        return out[None, None]

    def to_dict(self) -> dict:
        return {"type": self.type, **{f.name: getattr(self, f.name) for f in fields(self)}}


@dataclass(frozen=True)
class LocalPattern(_StaticPattern):
    window: int
    type = "local"

    def __post_init__(self):
        check_int("window", self.window)

    def allowed(self, q_blocks, num_key_blocks):
        d, _ = _offsets(q_blocks, num_key_blocks)
        return (d >= 0) & (d < self.window)


@dataclass(frozen=True)
class DilatedPattern(_StaticPattern):
    window: int
    stride: int
    type = "dilated"

    def __post_init__(self):
        check_int("window", self.window)
        check_int("stride", self.stride)

    def allowed(self, q_blocks, num_key_blocks):
        d, _ = _offsets(q_blocks, num_key_blocks)
        return ((d >= 0) & (d < self.window)) | (d % self.stride == 0)


@dataclass(frozen=True)
class GlobalLocalPattern(_StaticPattern):
    global_blocks: int
    window: int
    type = "global_local"

    def __post_init__(self):
        check_int("global_blocks", self.global_blocks, minimum=0)
        check_int("window", self.window)

    def allowed(self, q_blocks, num_key_blocks):
        d, bk = _offsets(q_blocks, num_key_blocks)
        return (bk < self.global_blocks) | ((d >= 0) & (d < self.window))


@dataclass(frozen=True)
class HierarchicalPattern(_StaticPattern):
    """levels: a non-empty sequence of (window, stride) pairs, dicts or DilatedPattern objects."""

    levels: tuple
    type = "hierarchical"

    def __post_init__(self):
        if not isinstance(self.levels, (list, tuple)) or len(self.levels) == 0:
            raise ValueError(f"levels must be a non-empty list of (window, stride) pairs, got {self.levels!r}")
        parsed = []
        for level in self.levels:
            if isinstance(level, DilatedPattern):
                parsed.append(level)
            elif isinstance(level, dict):
                unknown = set(level) - {"window", "stride"}
                if unknown or len(level) != 2:
                    raise ValueError(f"levels: each dict needs exactly 'window' and 'stride', got {level!r}")
                parsed.append(DilatedPattern(level["window"], level["stride"]))
            elif isinstance(level, (list, tuple)) and len(level) == 2:
                parsed.append(DilatedPattern(level[0], level[1]))
            else:
                raise ValueError(f"levels: each level must be a (window, stride) pair, got {level!r}")
        object.__setattr__(self, "levels", tuple(parsed))

    def allowed(self, q_blocks, num_key_blocks):
        out = self.levels[0].allowed(q_blocks, num_key_blocks)
        for level in self.levels[1:]:
            out = out | level.allowed(q_blocks, num_key_blocks)
        return out

    def to_dict(self) -> dict:
        return {"type": self.type, "levels": [[lv.window, lv.stride] for lv in self.levels]}


@dataclass(frozen=True)
class AdaptivePattern:
    """Local window plus top_k content-selected earlier blocks (selected in block_sparse.py).

    Candidates for query block bq are the blocks bk <= bq - window (earlier and outside the local
    window) holding at least one real key; the top_k of them by (mean-pooled query of bq) .
    (mean-pooled key of bk), per batch row and head (a query head reads its kv head's keys), are
    added. Means are over the row's real tokens of that block number: with packed documents the
    documents of a row share one selection per block number (pass one document per row for a
    per-document selection). The selection is not differentiated; the attention over it is.
    """

    top_k: int
    window: int
    type = "adaptive"

    def __post_init__(self):
        check_int("top_k", self.top_k, minimum=0)
        check_int("window", self.window)

    def to_dict(self) -> dict:
        return {"type": self.type, "top_k": self.top_k, "window": self.window}


@dataclass(frozen=True, eq=False)
class CustomPattern:
    """layout: bool tensor (heads or 1, query_blocks, key_blocks), indexed by block numbers; it
    must cover every block of the input (checked by the kernel)."""

    layout: torch.Tensor = field(repr=False)
    type = "custom"

    def __post_init__(self):
        layout = self.layout
        if isinstance(layout, (list, tuple)):
            layout = torch.tensor(layout)
        if not isinstance(layout, torch.Tensor):
            raise TypeError(f"layout must be a bool tensor (heads or 1, query_blocks, key_blocks), got {type(layout).__name__}")
        if layout.dtype != torch.bool:
            raise TypeError(f"layout must have dtype torch.bool, got {layout.dtype}")
        if layout.dim() != 3 or 0 in layout.shape:
            raise ValueError(
                f"layout must be 3-D and non-empty (heads or 1, query_blocks, key_blocks), got shape {tuple(layout.shape)}"
            )
        object.__setattr__(self, "layout", layout)

    def to_dict(self) -> dict:
        return {"type": self.type, "layout": self.layout.tolist()}


PATTERN_TYPES = {
    cls.type: cls
    for cls in (LocalPattern, DilatedPattern, GlobalLocalPattern, HierarchicalPattern, AdaptivePattern, CustomPattern)
}
Pattern = LocalPattern | DilatedPattern | GlobalLocalPattern | HierarchicalPattern | AdaptivePattern | CustomPattern


def make_pattern(spec) -> Pattern:
    """A pattern from a pattern object or a dict {"type": name, **parameters}."""
    if isinstance(spec, tuple(PATTERN_TYPES.values())):
        return spec
    if not isinstance(spec, dict):
        raise TypeError(
            f"pattern must be a pattern object or a dict with a 'type' key, got {type(spec).__name__}"
        )
    if "type" not in spec:
        raise ValueError(f"pattern: a dict needs a 'type' key (one of {sorted(PATTERN_TYPES)}), got {spec!r}")
    kind = spec["type"]
    if kind not in PATTERN_TYPES:
        raise ValueError(f"pattern: unknown type {kind!r}; expected one of {sorted(PATTERN_TYPES)}")
    cls = PATTERN_TYPES[kind]
    params = {key: val for key, val in spec.items() if key != "type"}
    expected = {f.name for f in fields(cls)}
    if set(params) != expected:
        raise ValueError(
            f"pattern: type {kind!r} takes exactly the parameters {sorted(expected)}, got {sorted(params)}"
        )
    return cls(**params)
