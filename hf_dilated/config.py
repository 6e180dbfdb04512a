"""The one configuration module: the schema of the `hf_dilated` entry (`DilatedConfig`, one table
of fields with their help and defaults, and its one validator), its one default level schedule,
and the choices and defaults every entry point reads: the kinds (kinds.py), `create_attention`,
the transformers glue, the conversion and its CLI, and the kernels' signatures.

A model config carries it as a plain dict under the key `hf_dilated` (so it lands in
`config.json` and survives `save_pretrained` / `from_pretrained`); `DilatedConfig.from_model_config`
reads it back, or derives the documented default when a checkpoint has none.

This module imports nothing of torch or transformers at import time, and of hf_dilated only the
integer check (checks.py), so the kernels (hf_dilated.ops, hf_dilated.distributed) read their
defaults and checks from it; only validating a block-sparse pattern imports the patterns
(ops/block_patterns.py), when it runs.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from .checks import check_int  # the one integer check, importable by the kernels without this module

CONFIG_KEY = "hf_dilated"
# The entry also records which of our attn_implementation names the model was configured with
# (transformers' save_pretrained drops attn_implementation itself); integrations/transformers.py
# reads it at load time.
RECORDED_NAME = "attn_implementation"

# --- the choices and defaults (every parser, check and signature reads these) ------------------

DILATED_MODES = ("union", "longnet", "head_groups")  # docs/contract.md 4
DEFAULT_MODE = "union"
RING_LAYOUTS = ("zigzag", "contiguous")  # docs/contract.md 6
DEFAULT_RING_LAYOUT = "zigzag"  # of setup_sequence_parallel and the ring kernels
DEFAULT_BLOCK_SIZE = 64
# Sparse far keys (docs/contract.md 4.2): positions per far block, and blocks always read from a
# document's start (the attention sinks).
DEFAULT_FAR_BLOCK_SIZE = 64
DEFAULT_FAR_SINKS = 1
DEFAULT_ATTN_IMPLEMENTATION = "dilated"  # of patch, patch_family and hf-dilated convert
# Calls with at most this many queries against a longer cache (a decode step, a few speculative
# tokens) take the strided decode path of ops/dilated_decode.py when their rows allow it.
DECODE_MAX_QUERIES = 8


# --- the checks of single settings ---------------------------------------------------------------


def check_mode(mode) -> None:
    if mode not in DILATED_MODES:
        raise ValueError(f"mode must be one of {', '.join(map(repr, DILATED_MODES))}, got {mode!r}")


def check_ring_layout(layout, *, name: str = "layout", optional: bool = False) -> None:
    if optional and layout is None:
        return
    if layout not in RING_LAYOUTS:
        raise ValueError(f"{name} must be one of {RING_LAYOUTS}{' or None' if optional else ''}, got {layout!r}")


def check_dilated_config(segment_lengths, dilation_rates, mode) -> tuple[list[int], list[int]]:
    """The dilated levels (docs/contract.md 4) as lists, or the error naming the rule they break."""
    check_mode(mode)
    seg = list(segment_lengths) if isinstance(segment_lengths, (list, tuple)) else None
    dil = list(dilation_rates) if isinstance(dilation_rates, (list, tuple)) else None
    if seg is None or not seg:
        raise ValueError(f"segment_lengths must be a non-empty list of ints, got {segment_lengths!r}")
    if dil is None:
        raise ValueError(f"dilation_rates must be a list of ints, got {dilation_rates!r}")
    if len(seg) != len(dil):
        raise ValueError(
            f"segment_lengths and dilation_rates must have the same length, got {len(seg)} and {len(dil)}"
        )
    for name, vals in (("segment_lengths", seg), ("dilation_rates", dil)):
        for x in vals:
            if isinstance(x, bool) or not isinstance(x, int):
                raise TypeError(f"{name} must contain ints, got {x!r}")
            if x <= 0:
                raise ValueError(f"{name} must be positive, got {x}")
    for w, r in zip(seg, dil):
        if w % r != 0:
            raise ValueError(f"dilation_rates: each rate must divide its segment length, but {r} does not divide {w}")
    if mode == "union":
        for g in range(1, len(seg)):
            if seg[g] % seg[g - 1] != 0 or dil[g] % dil[g - 1] != 0:
                raise ValueError(
                    "segment_lengths/dilation_rates: mode 'union' needs nested levels (each segment length "
                    "divides the next and each dilation rate divides the next), got "
                    f"segment_lengths={seg}, dilation_rates={dil}"
                )
    return seg, dil


def check_band(mode, local_window, far_group, far_window, far_band=None, far_top_k=None,
               far_block_size=DEFAULT_FAR_BLOCK_SIZE, far_sinks=DEFAULT_FAR_SINKS) -> None:
    """The local band and its far keys (docs/contract.md 4.1, 4.2), or the error naming the field."""
    check_int("local_window", local_window, optional=True)
    check_int("far_group", far_group)
    if local_window is not None and mode != "union":
        raise ValueError(f"local_window: a local band is defined for mode 'union' only, got mode {mode!r}")
    if far_group > 1 and local_window is None:
        raise ValueError(f"far_group: grouped far positions ({far_group}) need a local_window")
    check_int("far_window", far_window, optional=True)
    if far_window is not None and far_group == 1:
        raise ValueError(f"far_window: {far_window} places grouped far positions; it needs far_group > 1")
    if far_window is not None and far_window > local_window:
        raise ValueError(f"far_window: at most local_window ({local_window}) so that far keys sit no further "
                         f"than the band's edge, got {far_window}")
    check_int("far_band", far_band, optional=True)
    check_int("far_top_k", far_top_k, optional=True, minimum=0)
    check_int("far_block_size", far_block_size)
    check_int("far_sinks", far_sinks, minimum=0)
    for name, value in (("far_band", far_band), ("far_top_k", far_top_k)):
        if value is not None and local_window is None:
            raise ValueError(f"{name}: {value} reads the far keys of a local band; it needs a local_window")
    if far_band is not None and far_band > local_window:
        raise ValueError(f"far_band: at most local_window ({local_window}), got {far_band}")
    for name, value, default in (("far_block_size", far_block_size, DEFAULT_FAR_BLOCK_SIZE),
                                 ("far_sinks", far_sinks, DEFAULT_FAR_SINKS)):
        if far_top_k is None and value != default:
            raise ValueError(f"{name}: {value} shapes the far keys' selection; it needs far_top_k")
    band = local_window if far_band is None else far_band
    if far_top_k is not None and far_block_size > band:
        raise ValueError(f"far_block_size: at most the band ({band}) so that a far block lies before its query, "
                         f"got {far_block_size}")


def check_block_sparse(pattern, block_size):
    """The block-sparse settings (docs/contract.md 5): the pattern object `pattern` (an object or a
    dict such as {"type": "local", "window": 4}) stands for, or the error naming what is wrong."""
    from .ops.block_patterns import make_pattern  # torch: imported only when a pattern is checked

    check_int("block_size", block_size)
    return make_pattern(pattern)


@dataclass
class DilatedConfig:
    """What the attention implementations registered by hf_dilated compute for one model.

    The fields, their defaults and their help are the table below (peft's LoraConfig style:
    `field_help(name)` or `dataclasses.fields(DilatedConfig)`); `validate` is the one validator.

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

    # Required (no default): DilatedConfig.default derives both from the context lengths.
    segment_lengths: list[int] = field(metadata={"help": (
        "the segment length of each level of the dilated attention (docs/contract.md 4; 'dilated', "
        "'dilated_ring')")})
    dilation_rates: list[int] = field(metadata={"help": (
        "the dilation rate of each level, dividing its segment length")})
    mode: str = field(default=DEFAULT_MODE, metadata={"help": (
        f"how the levels combine: one of {', '.join(DILATED_MODES)} (docs/contract.md 4)")})
    local_window: int | None = field(default=None, metadata={"help": (
        "mode 'union': a local band united with the levels, every key within this many positions of its "
        "query (docs/contract.md 4.1); None: the levels alone")})
    far_group: int = field(default=1, metadata={"help": (
        "with a local band: keys beyond it are read at Self-Extend's grouped positions, this many positions "
        "sharing one (docs/contract.md 4.1); 1: at their own positions")})
    far_window: int | None = field(default=None, metadata={"help": (
        "with far_group > 1: far keys sit where Self-Extend puts keys beyond a neighbour window of this many "
        "positions, a key d back at relative position d // G + far_window - far_window // G (docs/contract.md "
        "4.1); None: local_window, so that far distances continue the band's")})
    far_band: int | None = field(default=None, metadata={"help": (
        "the band of a query at a position >= local_window, whose band no longer holds its whole document "
        "(docs/contract.md 4.2): narrower, so that the keys between it and local_window are far keys too; "
        "None: local_window")})
    far_top_k: int | None = field(default=None, metadata={"help": (
        "sparse far keys (docs/contract.md 4.2): a query reads the far keys of this many blocks, those with the "
        "highest bound on its best score (Quest's, from each block's min/max far key), besides the sinks; "
        "None: every far key")})
    far_block_size: int = field(default=DEFAULT_FAR_BLOCK_SIZE, metadata={"help": (
        "with far_top_k: positions per far block (at most the band)")})
    far_sinks: int = field(default=DEFAULT_FAR_SINKS, metadata={"help": (
        "with far_top_k: the first blocks of a document, whose far keys every query reads")})
    block_size: int = field(default=DEFAULT_BLOCK_SIZE, metadata={"help": (
        "block-sparse attention (docs/contract.md 5; 'block_sparse', 'block_sparse_ring'): tokens per block")})
    pattern: dict | None = field(default=None, metadata={"resolved": True, "help": (
        "the block pattern, a dict such as {'type': 'local', 'window': 4} (hf_dilated.ops.block_patterns."
        "make_pattern); None: a local window dense within the first segment (see below), resolved on "
        "construction")})
    ring_layout: str | None = field(default=None, metadata={"help": (
        f"the layout ({' or '.join(RING_LAYOUTS)}) the sequence is sharded in over the ranks of a "
        "sequence-parallel group ('ring', 'dilated_ring', 'block_sparse_ring'); None follows the active group "
        "(hf_dilated.distributed.setup_sequence_parallel), a set value must agree with it. The layout never "
        "changes results")})
    original_length: int | None = field(default=None, metadata={"help": (
        "the context length the checkpoint was pretrained with")})
    target_length: int | None = field(default=None, metadata={"help": (
        "the context length the model is configured for")})
    scaled_rope: bool | None = field(default=None, metadata={"help": (
        "whether the last conversion by hf_dilated wrote the model's RoPE scaling (True: a later conversion "
        "scales it again) or kept the RoPE as it was (False: the checkpoint's own, or one kept with rope='none', "
        "which a later conversion keeps); None in entries written before this field, where the scaling's factor "
        "decides")})

    def __post_init__(self):
        self.validate()

    def validate(self) -> "DilatedConfig":
        """The one validator of the entry: normalises the levels to lists and resolves the default
        pattern, or raises the error naming the field and the rule it breaks."""
        seg, dil = check_dilated_config(self.segment_lengths, self.dilation_rates, self.mode)
        self.segment_lengths, self.dilation_rates = seg, dil
        check_int("block_size", self.block_size)
        check_band(self.mode, self.local_window, self.far_group, self.far_window, self.far_band, self.far_top_k,
                   self.far_block_size, self.far_sinks)
        if self.pattern is None:  # dense within the first segment, like the dilated default
            self.pattern = {"type": "local", "window": max(1, (self.original_length or seg[0]) // self.block_size)}
        if not isinstance(self.pattern, dict) or not isinstance(self.pattern.get("type"), str):
            raise ValueError(
                f"pattern must be a dict with a 'type' (e.g. {{'type': 'local', 'window': 4}}), got {self.pattern!r}"
            )
        check_block_sparse(self.pattern, self.block_size)  # the pattern's own parameters
        check_ring_layout(self.ring_layout, name="ring_layout", optional=True)
        for name in ("original_length", "target_length"):
            check_int(name, getattr(self, name), optional=True)
        if self.scaled_rope is not None and not isinstance(self.scaled_rope, bool):
            raise TypeError(f"scaled_rope must be a bool or None, got {self.scaled_rope!r}")
        return self

    # --- construction -------------------------------------------------------------------------

    @classmethod
    def default(cls, original_length: int, target_length: int | None = None, **overrides) -> "DilatedConfig":
        """The documented default (see the class docstring); `overrides` replace single fields."""
        check_int("original_length", original_length)
        check_int("target_length", target_length, optional=True)
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


def field_help(name: str) -> str:
    """The help of a DilatedConfig field (what the CLI shows)."""
    return {f.name: f.metadata["help"] for f in dataclasses.fields(DilatedConfig)}[name]


class _Required:
    """The default of a field with none (`field_defaults`): distinct from None, which means "off"."""

    def __repr__(self):
        return "REQUIRED"


REQUIRED = _Required()


def field_defaults(*names: str) -> dict:
    """{name: default} for DilatedConfig fields outside a DilatedConfig (the kinds' settings):
    REQUIRED for a field with no default or one a DilatedConfig resolves on construction from its
    context (the pattern); None for one that is off by default."""
    table = {f.name: REQUIRED if f.default is dataclasses.MISSING or f.metadata.get("resolved") else f.default
             for f in dataclasses.fields(DilatedConfig)}
    return {name: table[name] for name in names}


def far_keys(fields) -> tuple[int, int] | None:
    """(neighbour window, group) of the far keys' grouped positions (docs/contract.md 4.1) for a
    mapping of DilatedConfig fields (a config's, or a kind's settings), or None when far keys sit at
    their own positions. The window is far_window, else the band's."""
    group = fields.get("far_group") or 1
    if group == 1:
        return None
    window = fields.get("far_window")
    return (fields["local_window"] if window is None else window), group


def kept_rope_context(config) -> tuple[int, int, bool] | None:
    """(the RoPE's own context L, the converted target T, whether the target is read through far keys
    at grouped positions) when a model config was lengthened with its RoPE left unscaled (rope
    "none", and the default conversion), else None. Far keys at grouped positions (docs/contract.md
    4.1) are read by the names in BAND_NAMES alone; without them the names that read the entry
    (integrations.transformers.reading_names) read its target, what the conversion configured
    (config.json keeps L for other engines). Read off the entry as stored, never parsed: a model
    must load under any attention whatever its entry holds."""
    entry = getattr(config, CONFIG_KEY, None)
    if not isinstance(entry, dict):
        return None
    rope_type = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    original, target, group = entry.get("original_length"), entry.get("target_length"), entry.get("far_group", 1)
    if rope_type != "default" or not all(isinstance(x, int) and not isinstance(x, bool) for x in (original, target, group)):
        return None
    return (original, target, group > 1) if target > original else None


# --- the default conversion ------------------------------------------------------------------

# The names whose default conversion keeps the checkpoint's RoPE and reads the context beyond it
# through a local band with far keys at grouped positions (docs/contract.md 4.1): the dilated
# pattern's, on one process or across ranks. The other names get scaled positions instead.
BAND_NAMES = ("dilated", "dilated_ring")
# Far keys sit as Self-Extend puts keys beyond a neighbour window of L / FAR_WINDOW_DIVISOR, the
# farthest within L * FAR_REACH of relative position (the context the model was trained on): a
# pretrained model reads keys from about that window on at positions it knows, while far keys
# that continue the band's own distances (a window of L) leave it no room; the smallest group
# that keeps them within L crowds them least (G = 4 at 2L lost less than G = 8, G = 8 at 4L less
# than G = 16). docs/benchmarks.md has the measurements behind all three.
FAR_WINDOW_DIVISOR = 8
FAR_REACH = 1
# Sparse far keys (docs/contract.md 4.2) of the default band: past L a query's band narrows to
# L / FAR_BAND_DIVISOR and it reads the far keys of the first block and of the FAR_TOP_K blocks
# (of DEFAULT_FAR_BLOCK_SIZE positions) per doubling of the context (8 at 2L, 16 at 4L) that bound
# its score highest: the more far blocks there are to choose from, the more are read, while the
# pairs read still fall with the length. docs/benchmarks.md has the measurements behind the choice.
FAR_BAND_DIVISOR = 2
FAR_TOP_K = 8
# The RoPE scaling the other names get: YaRN costs a model far less inside its context than
# position interpolation ("linear"), a recipe that needs fine-tuning.
DEFAULT_SCALED_ROPE = "yarn"


def default_conversion(original_length: int, target_length: int, attn_implementation: str) -> tuple[str, dict]:
    """The default conversion of a checkpoint with an unscaled RoPE from `original_length` (L) to
    `target_length` (T) tokens, the one place it is decided: (rope, hf_dilated fields).

    For BAND_NAMES: the RoPE is kept ("none") and the band is the original context L itself, so
    within L the model reads exactly as it was trained (every name equals sdpa there). Keys further
    back are candidates on every head and query (one level of dilation 1 covering the target: far
    keys on only some heads and queries, as dilated levels give, lose what a pretrained model keeps
    at the start of its context; docs/benchmarks.md), at Self-Extend's grouped positions for a neighbour window
    F = L // FAR_WINDOW_DIVISOR, with G the smallest power of two that keeps the farthest key
    (T - 1 back) within L * FAR_REACH of relative position: (T - 1) // G + F - F // G <= L * FAR_REACH.
    Past L those reads are sparse (docs/contract.md 4.2): a query's band narrows to L //
    FAR_BAND_DIVISOR, and of its far keys it reads the first block's and, per doubling of L that
    the target needs, FAR_TOP_K blocks' with the highest bound (blocks of DEFAULT_FAR_BLOCK_SIZE
    positions, at most the band).
    For the other names: DEFAULT_SCALED_ROPE and the default levels. A T within L changes nothing."""
    check_int("original_length", original_length)
    check_int("target_length", target_length)
    if target_length <= original_length:
        return "none", {}
    if attn_implementation not in BAND_NAMES:
        return DEFAULT_SCALED_ROPE, {}
    return "none", default_band(original_length, target_length)


def default_band(original_length: int, target_length: int) -> dict:
    """The hf_dilated fields default_conversion gives BAND_NAMES (see there), for T > L."""
    check_int("original_length", original_length)
    check_int("target_length", target_length, minimum=original_length + 1)
    window = max(1, original_length // FAR_WINDOW_DIVISOR)
    group = 2
    while (target_length - 1) // group + window - window // group > original_length * FAR_REACH:
        group *= 2
    segment, doublings = original_length, 0
    while segment < target_length:
        segment, doublings = segment * 2, doublings + 1
    band = max(1, original_length // FAR_BAND_DIVISOR)
    return {"local_window": original_length, "far_group": group, "far_window": window,
            "segment_lengths": [segment], "dilation_rates": [1], "far_band": band,
            "far_top_k": FAR_TOP_K * doublings,
            "far_block_size": min(DEFAULT_FAR_BLOCK_SIZE, band), "far_sinks": DEFAULT_FAR_SINKS}


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
