"""Sparse far keys (docs/contract.md 4.2): an eager decode step on a cache that writes in place
(hf_dilated.ReservedCache, StaticCache's slots), replayed as one CUDA graph.

A decode step is host-bound on a GPU: its ~100 small launches a layer cost more than the GPU's
work (docs/benchmarks.md). Against a buffer with reserved room, ops/sparse_far_static.kept_step is
one fixed-shape function of the buffer whose only per-step inputs are the query and the number of
written slots, so each layer's step is captured once as a CUDA graph and replayed, its summaries
kept on the buffer (rebuilt whenever the cache is not the last step's plus one token). Elsewhere
the eager path (ops/sparse_far_decode.py).
"""
from __future__ import annotations

import warnings

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .far_selection import FarSelection
from .rope import far_queries_static
from .sparse_far_static import CUT_CHECK_EVERY, KeptSummaries, build, kept_step, settings_of, warn_ties_cut
from .validate import records_grad

GRAPHED_ON = ("cuda",)
_POOLS = {}  # device -> (memory pool, layers captured into it): one per round of captures


class ReservedStep:
    """One layer's eager decode step against the whole buffer of an in-place cache (module
    docstring): kept_step over the buffer's slots, whose only per-step inputs are the query and the
    number of written slots, copied into fixed tensors; on a GPU captured as a CUDA graph at its
    first call and replayed after (elsewhere, for tests, called). Its summaries are rebuilt (eagerly,
    in place) whenever the cache is not the last step's plus one token (reserved_step). Held by its
    key buffer; nothing in it refers back to itself, so it goes (graph and pool included) with the
    buffer."""

    def __init__(self, key, owner: int, q, k_buffer, first, settings: dict, capture: bool):
        self.key, self.owner, self.seen, self.version, self.steps = key, owner, None, None, 0
        device = q.device
        size = settings["selection"].block_size
        rotation = settings["rotation"]
        if rotation is not None:  # the frequencies on the device once: a copy from the host cannot be captured
            rotation = (rotation[0], rotation[1], rotation[2].to(device))
        settings = dict(settings, rotation=rotation)
        kept = self.kept = KeptSummaries(k_buffer, size, settings_of(size, rotation))
        self.q = torch.empty_like(q)
        self.written = torch.zeros((), dtype=torch.long, device=device)
        slots = torch.arange(k_buffer.shape[2], device=device)
        first = torch.tensor(first, device=device)[:, None]  # (once, when the step is made)
        buffers = self.buffers = [None, None]  # the key and value buffers, during a call only

        def real(written):  # each row's real tokens: one run from its first to the written end (regular rows)
            return (slots >= first) & (slots < written)

        def step(q, written):
            q_far = q if rotation is None else far_queries_static(q, real(written), written, *rotation)
            return kept_step(q, buffers[0], buffers[1], q_far, kept=kept, real=real(written), seen=written,
                             **settings)

        self.real, self.step, self.rotation = real, step, rotation
        self.capture, self.graph, self.out = capture, None, None

    def _capture(self):
        """Capture step() on the current inputs, on its device: warmed up on a side stream first
        (torch.cuda.graphs' rule; its fold of the step's token is the one the replay redoes, the same
        values), then captured on that stream into the memory pool the other layers' steps of this
        round share (each replay's output is copied out before the next layer's replay)."""
        device = self.q.device
        pool, owners = _POOLS.get(device, (None, set()))
        if pool is None or self.owner in owners:  # a layer captures again: a new round
            pool, owners = torch.cuda.graph_pool_handle(), set()
        with torch.cuda.device(device):
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                self.step(self.q, self.written)
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=side):
                self.out = self.step(self.q, self.written)
        owners.add(self.owner)
        _POOLS[device] = (pool, owners)
        self.graph = graph

    def __call__(self, q, k_buffer, v_buffer, seen: int):
        """The step's output; k_buffer, v_buffer the buffers at the addresses of its key (a graph reads
        them there: they are held during the call only, so that a finished cache is freed)."""
        self.q.copy_(q)
        self.written.fill_(seen)
        self.buffers[:] = k_buffer, v_buffer
        try:
            if not self.capture:
                return self.step(self.q, self.written)
            if self.graph is None:
                self._capture()
            with torch.cuda.device(self.q.device):
                self.graph.replay()
            return self.out.clone()
        finally:
            self.buffers[:] = None, None


_STEP_ATTRIBUTE = "_hf_dilated_reserved_step"  # where a buffer holds its ReservedStep (it goes with the buffer)
# The key and value views hf_dilated.ReservedCache hands out -> (the buffer each views, the layer's
# count of writes into it). Under torch.inference_mode a view keeps no base and a tensor no version
# counter; this is what the step then reads instead: the cache's own writes (updates, reorders), not
# a write into its tensors from outside (docs/contract.md 4.2). A table held weakly by the views, not
# an attribute: a view saved or copied does not take its buffer and the step kept on it along.
_VIEW_BUFFERS = WeakIdKeyDictionary()


def tag_view(view: torch.Tensor, buffer: torch.Tensor, writes: int) -> None:
    """Record that `view` is the filled start of `buffer`, after `writes` writes into it."""
    _VIEW_BUFFERS[view] = (buffer, writes)
_GRAPH_FAILED: str | None = None  # why capturing failed in this process (steps then take the eager path)


def _buffer_of(view: torch.Tensor) -> tuple:
    """(buffer, version) of an in-place cache's view: its base and the base's version counter, or
    under inference mode what ReservedCache recorded of it (tag_view); (None, None) else."""
    if view._base is not None:
        return view._base, view._base._version
    return _VIEW_BUFFERS.get(view, (None, None))


def reserved_step(q, k, v, *, local_window: int, far_band: int | None, selection: FarSelection, scale: float,
                  first: list[int], shift: list[int], rotation, layer: int, state: dict | None = None):
    """An eager one-query step on a cache whose keys and values are the filled start of larger
    buffers (hf_dilated.ReservedCache; StaticCache's slots): the ReservedStep kept on the key
    buffer (so two caches used in turn keep theirs; `layer` an id of the calling layer, which the
    graphs' memory pools follow; `state` the layer's, where the count of ties its last step cut is
    kept). None (nothing done) where it does not apply: other caches
    (DynamicCache concatenates into a new tensor), positions other than the mask ranks (rows
    regular: ops/token_layout.regular_rows), and once a capture failed here (warned once)."""
    global _GRAPH_FAILED
    (k_buffer, version), (v_buffer, _) = _buffer_of(k), _buffer_of(v)
    if (_GRAPH_FAILED is not None or k_buffer is None or v_buffer is None or k_buffer.dim() != 4
            or v_buffer.shape != k_buffer.shape or k_buffer.shape[:2] + k_buffer.shape[3:] != k.shape[:2] + k.shape[3:]
            or k.data_ptr() != k_buffer.data_ptr() or v.data_ptr() != v_buffer.data_ptr()
            or k.stride() != k_buffer.stride() or v.stride() != v_buffer.stride()
            or any(s != -f for f, s in zip(first, shift)) or records_grad(q, k, v)):
        return None
    seen = k.shape[2]
    settings = dict(local_window=local_window, far_band=far_band, selection=selection, scale=scale, rotation=rotation)
    key = (k_buffer.data_ptr(), v_buffer.data_ptr(), tuple(k_buffer.shape), k_buffer.dtype, tuple(q.shape), q.dtype,
           local_window, far_band, selection, scale, tuple(first),
           None if rotation is None else (rotation[0], rotation[1], rotation[2].data_ptr()))
    runner = getattr(k_buffer, _STEP_ATTRIBUTE, None)
    if runner is None or runner.key != key:
        with torch.inference_mode(False):  # its tensors are written by steps in and out of inference mode alike
            runner = ReservedStep(key, layer, q, k_buffer, first, settings, capture=q.device.type == "cuda")
        setattr(k_buffer, _STEP_ATTRIBUTE, runner)
        if state is not None:
            # the count of ties the layer's last step cut (sparse_far_static: Ties), read as a new step
            # replaces it: a ReservedCache takes a new buffer each generation and as it grows, and the
            # count went unread with the old buffer (no rebuild comes to read it)
            if "reserved_cut" in state:
                warn_ties_cut(state["reserved_cut"], stacklevel=4)  # (one read, where a rebuild reads anyway)
            state["reserved_cut"] = runner.kept.cut
    if runner.seen != seen - 1 or runner.version != version - 1:
        # not the last step's cache plus this token (a first step, a crop, a rewrite): summarise it again
        warn_ties_cut(runner.kept.cut, stacklevel=4)  # (one read, at a rebuild)
        build(runner.kept, k_buffer, runner.real(seen), seen, selection.block_size, runner.rotation)
    try:
        out = runner(q, k_buffer, v_buffer, seen)
    except torch.OutOfMemoryError:
        raise
    except Exception as exc:  # capturing failed: the eager step from now on
        if runner.graph is not None or not runner.capture:
            raise
        _GRAPH_FAILED = f"{type(exc).__name__}: {exc}"
        delattr(k_buffer, _STEP_ATTRIBUTE)
        warnings.warn(f"hf_dilated: capturing a decode step as a CUDA graph failed ({_GRAPH_FAILED[:500]}); decode "
                      "steps take the eager path from now on (the same results, more launches)", RuntimeWarning,
                      stacklevel=3)
        return None
    runner.steps = runner.steps + 1 if runner.seen == seen - 1 else 0
    runner.seen, runner.version = seen, version
    if runner.steps % CUT_CHECK_EVERY == CUT_CHECK_EVERY - 1:
        warn_ties_cut(runner.kept.cut, stacklevel=3)
    return out
