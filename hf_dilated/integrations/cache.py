"""A DynamicCache that does not copy itself on every step.

transformers' `DynamicLayer.update` concatenates the new keys to the old ones, so each decode step
copies the whole cache: at 32K tokens that copy costs about as much as dense attention reads, and
more than a sparse decode step (docs/benchmarks.md). `ReservedCache` keeps transformers' Cache
interface and the DynamicCache's behaviour (it grows as tokens come, crops, reorders for beam
search, works with any attention), but its full-attention layers write new keys into reserved room
at the end of a larger buffer, and `keys`/`values` are views of the filled part: a step writes
only its own tokens, and the buffer grows by half again when full (amortised O(1) per token,
at most 50% more memory than the tokens held).

    cache = hf_dilated.ReservedCache(config=model.config)
    model.generate(ids, cache=cache, ...)  # past_key_values=cache on older transformers

Under torch.inference_mode torch tracks no tensor versions: there the sparse far keys' decode step
on a GPU knows of the cache's own writes (its count of them), not of a write into its tensors from
outside (docs/contract.md 4.2): edit a cache's tensors outside inference mode.
"""
from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from ..ops.sparse_far_reserved import tag_view

_MIN_ROOM = 256  # tokens reserved beyond the need, at least: a prompt then decodes that many steps without growing


class ReservedLayer(DynamicLayer):
    """A DynamicLayer whose keys/values are views of a buffer with room reserved after them."""

    def lazy_initialization(self, key_states, value_states):
        super().lazy_initialization(key_states, value_states)
        self._room = None  # (keys buffer, values buffer)

    def _in_room(self, n_new: int) -> bool:
        """The keys are still the filled start of the buffer (no crop-then-replace, no reorder or batch
        edit since: those rebind `keys` to other tensors) and the new tokens fit, and the buffer can be
        written here (one made under torch.inference_mode cannot be outside it: a new one is made)."""
        if self._room is None or self.keys.numel() == 0:
            return False
        if self._room[0].is_inference() and not torch.is_inference_mode_enabled():
            return False
        room = self._room[0]
        return (self.keys.data_ptr() == room.data_ptr() and self.keys.shape[:2] == room.shape[:2]
                and self.keys.stride() == room.stride() and self.keys.shape[-2] + n_new <= room.shape[-2])

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n_new = key_states.shape[-2]
        held = self.keys.shape[-2] if self.keys.numel() else 0
        if not self._in_room(n_new):
            need = held + n_new
            capacity = need + max(need // 2, _MIN_ROOM)
            rooms = []
            for old, new in ((self.keys, key_states), (self.values, value_states)):
                buffer = new.new_empty(new.shape[:2] + (capacity,) + new.shape[3:])
                if held:
                    buffer[..., :held, :].copy_(old)
                rooms.append(buffer)
            self._room = tuple(rooms)
        keys, values = self._room
        keys[..., held:held + n_new, :].copy_(key_states)
        values[..., held:held + n_new, :].copy_(value_states)
        self.keys, self.values = keys[..., :held + n_new, :], values[..., :held + n_new, :]
        self._count_write()
        return self.keys, self.values

    def _count_write(self) -> None:
        """Record (sparse_far_reserved.tag_view) which buffer the views view and how many writes it
        has had: under torch.inference_mode a view keeps no base and a tensor no version counter, and
        a GPU's decode step (ops/sparse_far_reserved.py) needs both to replay its CUDA graph there."""
        self._writes = getattr(self, "_writes", 0) + 1
        for view, buffer in ((self.keys, self._room[0]), (self.values, self._room[1])):
            tag_view(view, buffer, self._writes)

    def reorder_cache(self, beam_idx) -> None:
        """Beam search's reorder, in place inside the buffer: a new tensor every step would give up
        the room (the next step copies the cache into a new buffer) and, on a GPU, the decode
        step's CUDA graph kept on it (ops/sparse_far_reserved.py)."""
        if self.get_seq_length() > 0 and self._in_room(0):
            index = beam_idx.to(self.keys.device)
            self.keys.copy_(self.keys.index_select(0, index))
            self.values.copy_(self.values.index_select(0, index))
            self._count_write()
        else:
            super().reorder_cache(beam_idx)

    def reset(self) -> None:
        self._room = None
        super().reset()


class ReservedCache(DynamicCache):
    """DynamicCache whose full-attention layers are `ReservedLayer`s (module docstring). Same
    constructor; sliding-window layers stay transformers' own (they keep a window, not a prefix)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.layer_class_to_replicate is DynamicLayer:
            self.layer_class_to_replicate = ReservedLayer
        for i, layer in enumerate(self.layers):
            if type(layer) is DynamicLayer:
                reserved = ReservedLayer()
                if layer.is_initialized and layer.keys is not None and layer.keys.numel():
                    reserved.update(layer.keys, layer.values)
                self.layers[i] = reserved
