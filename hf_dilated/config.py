"""The one configuration module: the schema of the `hf_dilated` entry, its one default level
schedule and the constants, read by the transformers glue, the conversion and `create_attention`.

A model config carries it as a plain dict under the key `hf_dilated` (so it lands in
`config.json` and survives `save_pretrained` / `from_pretrained`); `DilatedConfig.from_model_config`
reads it back, or derives the documented default when a checkpoint has none.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from .ops.block_patterns import make_pattern
from .ops.validate import check_dilated_config, check_positive_int

CONFIG_KEY = "hf_dilated"
# The entry also records which of our attn_implementation names the model was configured with
# (transformers' save_pretrained drops attn_implementation itself); integrations/transformers.py
# reads it at load time.
RECORDED_NAME = "attn_implementation"
RING_LAYOUTS = ("zigzag", "contiguous")
DEFAULT_BLOCK_SIZE = 64


@dataclass
class DilatedConfig:
    """What the attention implementations registered by hf_dilated compute for one model.

    Fields:
        segment_lengths, dilation_rates, mode: the dilated attention of docs/contract.md 4
            ("dilated", "dilated_ring").
        block_size, pattern: the block-sparse attention ("block_sparse", "block_sparse_ring");
            `pattern` is a dict such as `{"type": "local", "window": 4}` (see
            `hf_dilated.ops.block_patterns.make_pattern`).
        ring_layout: the layout ("zigzag" or "contiguous") the sequence is sharded in over the
            ranks of a sequence-parallel group, for "ring", "dilated_ring" and "block_sparse_ring".
            None (the default) follows the active group (`hf_dilated.distributed.setup_sequence_parallel`);
            a set value must agree with it. The layout never changes results.
        original_length: the context length the checkpoint was pretrained with.
        target_length: the context length the model is configured for.

    Default (`DilatedConfig.default(original_length, target_length)`, used when a checkpoint has no
    `hf_dilated` entry): the first segment is the original context length with dilation 1, and
    each further level doubles both, until a segment covers the target length:
        segment_lengths = [L, 2L, 4L, ..., 2^k L],  dilation_rates = [1, 2, 4, ..., 2^k],
    with 2^k L the first >= target_length. In mode "union" a document no longer than L then gets
    exactly dense causal attention, so a patched checkpoint gives the same logits as `sdpa` on
    such inputs. The default block-sparse pattern is a local window of L / block_size blocks
    (at least 1), which is also dense within the first L positions. Without an entry both lengths
    are `max_position_embeddings`, also for a checkpoint whose RoPE is already scaled (it was
    trained at that length); the conversion in `hf_dilated.patches` stores both explicitly.
    """

    segment_lengths: list[int]
    dilation_rates: list[int]
    mode: str = "union"
    block_size: int = DEFAULT_BLOCK_SIZE
    pattern: dict | None = None  # None: the default window (class docstring), resolved on construction
    ring_layout: str | None = None
    original_length: int | None = None
    target_length: int | None = None

    def __post_init__(self):
        self.validate()

    def validate(self) -> "DilatedConfig":
        seg, dil = check_dilated_config(self.segment_lengths, self.dilation_rates, self.mode)
        self.segment_lengths, self.dilation_rates = seg, dil
        check_positive_int("block_size", self.block_size)
        if self.pattern is None:  # dense within the first segment, like the dilated default
            self.pattern = {"type": "local", "window": max(1, (self.original_length or seg[0]) // self.block_size)}
        if not isinstance(self.pattern, dict) or not isinstance(self.pattern.get("type"), str):
            raise ValueError(
                f"pattern must be a dict with a 'type' (e.g. {{'type': 'local', 'window': 4}}), got {self.pattern!r}"
            )
        make_pattern(self.pattern)  # validates the pattern's parameters
        if self.ring_layout is not None and self.ring_layout not in RING_LAYOUTS:
            raise ValueError(f"ring_layout must be one of {RING_LAYOUTS} or None, got {self.ring_layout!r}")
        for name in ("original_length", "target_length"):
            check_positive_int(name, getattr(self, name), optional=True)
        return self

    # --- construction -------------------------------------------------------------------------

    @classmethod
    def default(cls, original_length: int, target_length: int | None = None, **overrides) -> "DilatedConfig":
        """The documented default (see the class docstring); `overrides` replace single fields."""
        check_positive_int("original_length", original_length)
        check_positive_int("target_length", target_length, optional=True)
        target_length = max(target_length or original_length, original_length)
        segment_lengths, dilation_rates = default_schedule(original_length, target_length)
        fields = dict(
            segment_lengths=segment_lengths,
            dilation_rates=dilation_rates,
            original_length=original_length,
            target_length=target_length,
        )
        overrides.pop(RECORDED_NAME, None)  # not a setting of the attention (see RECORDED_NAME)
        unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise TypeError(f"unknown hf_dilated config field(s): {sorted(unknown)}")
        fields.update(overrides)
        return cls(**fields)

    @classmethod
    def from_dict(cls, data: dict) -> "DilatedConfig":
        if not isinstance(data, dict):
            raise TypeError(f"the '{CONFIG_KEY}' config entry must be a dict, got {type(data).__name__}")
        data = {k: v for k, v in data.items() if k != RECORDED_NAME}  # read at load time, not here
        unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown field(s) in the '{CONFIG_KEY}' config entry: {sorted(unknown)}")
        missing = {"segment_lengths", "dilation_rates"} - set(data)
        if missing:
            raise ValueError(f"the '{CONFIG_KEY}' config entry lacks {sorted(missing)}")
        return cls(**data)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_model_config(cls, config) -> "DilatedConfig":
        """The entry stored in a transformers config, or the default derived from it."""
        data = getattr(config, CONFIG_KEY, None)
        if data is not None:
            return cls.from_dict(data)
        original, target = context_lengths(config)
        return cls.default(original, target)


def default_schedule(first_segment: int, length: int) -> tuple[list[int], list[int]]:
    """The one default level schedule: segment `first_segment` with dilation 1, then both doubled
    per level until a segment covers `length`: ([L, 2L, ..., 2^k L], [1, 2, ..., 2^k])."""
    levels = 1 + max(0, math.ceil(math.log2(max(length, 1) / first_segment)))
    return [first_segment * 2**g for g in range(levels)], [2**g for g in range(levels)]


def context_lengths(config) -> tuple[int, int]:
    """(original, target) context lengths of a transformers config with no hf_dilated entry: both
    `max_position_embeddings`, the context the checkpoint is configured for. A checkpoint whose
    RoPE is already scaled (Llama-3.1's "llama3", YaRN) was trained at that length too, so its
    first segment covers all of it and the model is unchanged on every input it supports (the
    pre-scaling `original_max_position_embeddings` would cut it into levels)."""
    target = getattr(config, "max_position_embeddings", None)
    if isinstance(target, bool) or not isinstance(target, int) or target <= 0:
        raise ValueError(
            f"cannot derive a default hf_dilated config: {type(config).__name__} has no positive "
            "max_position_embeddings; pass segment_lengths and dilation_rates explicitly"
        )
    return target, target
