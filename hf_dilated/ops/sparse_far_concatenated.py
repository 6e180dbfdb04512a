"""Sparse far keys (docs/contract.md 4.2): an eager decode step on a cache that concatenates into a
new tensor every step (transformers' DynamicCache), compiled.

No CUDA graph can hold such a cache (its address changes every step), and summaries kept between
its steps cannot be trusted without reading it (a crop, a beam search's reorder, a rewrite): the
eager path (ops/sparse_far_decode.py) checks them by checksums, one pass over the keys and a read
back per layer, then ~100 launches. Here the step is one compiled call (torch.compile, the cache's
length dynamic) of ops/sparse_far_static.kept_step with the summaries made again from the whole
cache in the same call: fused, they cost that same pass and nothing else (the rotation to grouped
positions, its turns read from a table kept outside the step (far_turns), and the blocks' minima
and maxima in one kernel), exact whatever happened to the cache, no read back. The chosen far keys
are turned by the same table. On CUDA only: on
the CPU there are no launches to save, and summaries kept between steps are cheaper.
"""
from __future__ import annotations

import types
import warnings

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .far_selection import FarSelection, bound_dtype
from .rope import far_queries_static, far_turn_table, rotate_with
from . import sparse_far_static
from .sparse_far_static import BUILD_SLOTS, CUT_CHECK_EVERY, kept_step, warn_ties_cut
from .validate import records_grad

COMPILED_ON = ("cuda",)
BACKEND = "inductor"  # torch.compile's backend for it (tests on the CPU may take a lighter one)
_COMPILED = {}  # settings -> the compiled step
_COMPILE_FAILED: str | None = None  # why compiling failed in this process (steps then take the eager path)
_RECOMPILE_LIMIT = getattr(torch._dynamo.exc, "FailOnRecompileLimitHit", ())  # (what fullgraph raises there)


class MadeSummaries:
    """Summaries made from the whole cache in the call (summarise_rows), and the layer's count of
    ties cut, kept between calls: what kept_step reads as `kept` with refresh=False."""

    def __init__(self, mn, mx, cut):
        self.mn, self.mx, self.cut = mn, mx, cut


def summarised_slots(n: int, size: int, spare: int) -> int:
    """The ranks summarise_rows reads for a cache of n slots: its blocks' (N // size + 1 + spare)."""
    return (n // size + 1 + spare) * size


def summarise_rows(k: torch.Tensor, first: torch.Tensor, size: int, turns, dtype, spare: int = 0) -> tuple:
    """(mn, mx) as KeptSummaries holds them, (batch, kv_heads, N // size + 2 + spare, d), of a cache
    whose row b holds its real tokens at slots first[b] .. N - 1 (regular rows; positions their
    ranks): block c of row b is slots first[b] + c B ... One gather, rotation and reduction over the
    keys, which a compiled call fuses into one pass. `spare` empty blocks more past the end (never
    reached: no key) give a compiled step's Python decisions on the block count (top k, ties) one
    answer at every length, so that one graph serves them all. turns: the (cos, sin) moving each rank
    to its grouped far position, rope.far_turn_table of at least summarised_slots() ranks (every row's
    ranks are these: one table row each); None where far keys are not moved."""
    batch, kv_heads, n, dim = k.shape
    n_blocks = n // size + 1 + spare

    def blocks(c0, c1):  # (mn, mx) of blocks c0 .. c1 - 1
        rank = torch.arange(c0 * size, c1 * size, device=k.device)
        slot = first[:, None] + rank  # (batch, (c1 - c0) B)
        ok = (slot < n)[:, None, :, None]
        keys = k.gather(2, slot.clamp(max=n - 1)[:, None, :, None].expand(batch, kv_heads, -1, dim))
        if turns is not None:
            keys = rotate_with(keys, turns[0][c0 * size:c1 * size], turns[1][c0 * size:c1 * size])
        keys = keys.to(dtype)
        return (keys.masked_fill(~ok, float("inf")).unflatten(2, (c1 - c0, size)).amin(3),
                keys.masked_fill(~ok, float("-inf")).unflatten(2, (c1 - c0, size)).amax(3))

    if torch.compiler.is_compiling():  # one fused pass: no temporaries
        parts = [blocks(0, n_blocks)]
    else:  # uncompiled (under a dispatch mode): in chunks, which bound the temporaries
        step = max(1, BUILD_SLOTS // size)
        parts = [blocks(c, min(n_blocks, c + step)) for c in range(0, n_blocks, step)]
    dump = torch.full((batch, kv_heads, 1, dim), float("inf"), dtype=dtype, device=k.device)  # kept_step's last row
    return (torch.cat([p[0] for p in parts] + [dump], 2), torch.cat([p[1] for p in parts] + [-dump], 2))


def _spare_blocks(selection: FarSelection) -> int:
    """summarise_rows' spare blocks in a compiled step: at least top_k + TIE_SLOTS + 1 blocks, and two
    in the reduction (no 0/1 specialisation)."""
    return selection.sinks + selection.top_k + sparse_far_static.TIE_SLOTS + 2


def _concatenated(q, k, v, first, cut, inv_freq, turn_cos, turn_sin, *, local_window: int, far_band: int | None,
                  selection: FarSelection, scale: float, far: tuple | None):
    """The step that concatenated_step compiles: summaries from the whole cache, then kept_step."""
    n = k.shape[2]
    rotation = None if far is None else (*far, inv_freq)
    real = torch.arange(n, device=k.device) >= first[:, None]
    seen = torch.full((), n, dtype=torch.long, device=k.device)
    mn, mx = summarise_rows(k, first, selection.block_size, None if far is None else (turn_cos, turn_sin),
                            bound_dtype(k.dtype), spare=_spare_blocks(selection))
    q_far = q if rotation is None else far_queries_static(q, real, seen, *rotation)
    return kept_step(q, k, v, q_far, local_window=local_window, far_band=far_band, selection=selection, scale=scale,
                     real=real, seen=seen, rotation=rotation, kept=MadeSummaries(mn, mx, cut), refresh=False,
                     turns=None if far is None else (turn_cos, turn_sin))


class ConcatenatedState:
    """What a layer keeps between its compiled steps: the rows' first slots on the device (made once
    per layout, so that no step copies from the host) and the count of ties cut."""

    def __init__(self, device):
        self.first = {}  # rows' first slots (a tuple) -> on the device; a few layouts
        with torch.inference_mode(False):  # written by steps in and out of inference mode alike
            self.cut = torch.zeros((), dtype=torch.int32, device=device)
        self.steps = self.length = 0  # steps in a row, and the cache's length at the last one

    def first_slots(self, first: list[int], device) -> torch.Tensor:
        held = self.first.get(tuple(first))
        if held is None:  # (a copy from the host once per layout, not per step)
            if len(self.first) >= 8:
                self.first.clear()
            with torch.inference_mode(False):
                held = self.first[tuple(first)] = torch.tensor(first, dtype=torch.long, device=device)
        return held


# rope.far_turn_table per frequency tensor (by identity, so one going frees its tables), then per
# (group, dtype): (the tensor's version counter then, (cos, sin)). Every layer of a model reads the
# same frequencies (integrations: rope_frequencies_for), so a model keeps one table: length x rot
# values in each of cos and sin (8 MiB at 16K tokens for heads of 128 in bfloat16), whatever its
# layers.
_TURNS = WeakIdKeyDictionary()


def far_turns(length: int, group: int, inv_freq: torch.Tensor, dtype) -> tuple:
    """rope.far_turn_table of at least `length` positions, made again only when a cache outgrows it
    (to the next power of two: a few times a generation) or the frequencies are written in place.
    Frequencies without a version counter (made under inference mode) get one made afresh each call
    (a few launches outside the compiled step), since a write into them could not be seen."""
    try:
        version = inv_freq._version
    except RuntimeError:
        version = None
    tables = _TURNS.get(inv_freq)
    held = None if tables is None or version is None else tables.get((group, dtype))
    if held is not None and held[0] == version and held[1][0].shape[0] >= length:
        return held[1]
    with torch.inference_mode(False):  # read by steps in and out of inference mode alike
        table = far_turn_table(1 << max(0, length - 1).bit_length(), group, inv_freq, dtype, inv_freq.device)
    if version is not None:
        if tables is None:
            tables = _TURNS[inv_freq] = {}
        tables[(group, dtype)] = (version, table)
    return table


def _compiled(settings: dict):
    key = tuple(sorted(settings.items(), key=lambda item: item[0]))
    step = _COMPILED.get(key)
    if step is None:
        def concatenated(q, k, v, first, cut, inv_freq, turn_cos, turn_sin):
            return _concatenated(q, k, v, first, cut, inv_freq, turn_cos, turn_sin, **settings)

        # A code object of its own per settings: dynamo keeps at most recompile_limit (8) graphs per code
        # object, and each settings' dtypes, batch sizes, grad modes and devices take some.
        code = concatenated.__code__.replace(co_name=f"concatenated_{len(_COMPILED)}")
        own = types.FunctionType(code, concatenated.__globals__, code.co_name, None, concatenated.__closure__)
        step = _COMPILED[key] = torch.compile(own, backend=BACKEND, fullgraph=True)
    return step


def concatenated_step(q, k, v, *, local_window: int, far_band: int | None, selection: FarSelection, scale: float,
                      first: list[int], shift: list[int], rotation, state: dict):
    """An eager one-query step on a cache that concatenates (module docstring), compiled, or
    None (nothing done) where it does not apply: a key tensor that is a view (an in-place cache:
    reserved_step's), positions other than the mask ranks, no far key yet, inside an outer
    torch.compile, once compiling failed here (warned once), and with dynamo switched off
    (TORCHDYNAMO_DISABLE=1: the eager path keeps its summaries, cheaper uncompiled). `state` the
    layer's dict (kinds.py)."""
    global _COMPILE_FAILED
    if (_COMPILE_FAILED is not None or torch._dynamo.config.disable or torch.compiler.is_compiling()
            or k._base is not None or v._base is not None or any(s != -f for f, s in zip(first, shift))
            or records_grad(q, k, v)):
        return None
    if k.shape[2] - 1 - min(first) < local_window:
        # No query has a far key yet (a context within the original one): the eager step reads the band
        # alone, in a few launches; compiling (tens of seconds on a GPU) waits until far keys exist.
        return None
    held = state.get("concatenated")
    if held is None or held.cut.device != q.device:
        held = state["concatenated"] = ConcatenatedState(q.device)
    far = None if rotation is None else (rotation[0], rotation[1])
    inv_freq = (torch.empty(0, device=q.device) if rotation is None else rotation[2]).to(q.device)
    settings = dict(local_window=local_window, far_band=far_band, selection=selection, scale=scale, far=far)
    if rotation is None:
        turns = (inv_freq, inv_freq)  # (empty: nothing turns)
    else:  # the keys' turns, read by rank: made again a few times a generation, not per key each step
        turns = far_turns(summarised_slots(k.shape[2], selection.block_size, _spare_blocks(selection)), rotation[1],
                          inv_freq, k.dtype)
    for t in (k, v):  # the cache's length changes every step: one graph for all of them
        torch._dynamo.maybe_mark_dynamic(t, 2)
    for t in turns:  # and the table's, every time it grows
        torch._dynamo.maybe_mark_dynamic(t, 0)
    # Under a dispatch mode of the user's (a FLOP counter, a debug mode) dynamo compiles nothing: the
    # same step, called.
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    step = (_compiled(settings) if _get_current_dispatch_mode() is None
            else lambda *a: _concatenated(*a, **settings))
    try:
        out = step(q, k, v, held.first_slots(first, q.device), held.cut, inv_freq, *turns)
    except torch.OutOfMemoryError:
        raise
    except _RECOMPILE_LIMIT:  # graphs enough for these settings (dtypes, batches, devices): this call eagerly
        return None
    except Exception as exc:  # compiling failed: the eager step from now on
        _COMPILE_FAILED = f"{type(exc).__name__}: {exc}"
        warnings.warn(f"hf_dilated: compiling the decode step for a concatenating cache failed "
                      f"({_COMPILE_FAILED[:500]}); decode steps take the eager path from now on (the same "
                      "results, more launches)", RuntimeWarning, stacklevel=3)
        return None
    # The ties cut are read back (one read) at a step that does not follow the last one (the next
    # generation's first: a read is due there anyway, after its prefill) and every CUT_CHECK_EVERY steps.
    held.steps = held.steps + 1 if k.shape[2] == held.length + 1 else 0
    held.length = k.shape[2]
    if held.steps % CUT_CHECK_EVERY == 0:
        warn_ties_cut(held.cut, stacklevel=4)
    return out
