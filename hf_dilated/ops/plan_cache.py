"""A small cache of call plans, keyed by shapes and configuration and by the *identity* (object
and version counter) of the mask and position tensors (and any other tensor the plan reads): every
layer of a model passes the same tensors, so every layer after the first reuses the first one's plan.

Inference-mode tensors carry no version counter, so plans built from them are never cached.
Writes through `.data` or through shared numpy memory bypass the counter too: don't do that.
"""
from __future__ import annotations

import weakref


class PlanCache:
    def __init__(self, size: int = 4):
        self.size, self.entries = size, []

    @staticmethod
    def cacheable(*tensors) -> bool:
        return all(t is None or not t.is_inference() for t in tensors)

    @staticmethod
    def _ident(t):
        return None if t is None else (weakref.ref(t), t._version)

    @staticmethod
    def _same(ident, t) -> bool:
        if ident is None or t is None:
            return ident is None and t is None
        return ident[0]() is t and ident[1] == t._version

    def get(self, key, *tensors):
        """The value put under `key` and these very tensors (mask, positions, ...), or None."""
        if not self.cacheable(*tensors):
            return None
        for k, idents, value in self.entries:
            if k == key and len(idents) == len(tensors) and all(map(self._same, idents, tensors)):
                return value
        return None

    def put(self, key, *tensors_then_value) -> None:
        """put(key, mask, positions, ..., value)."""
        *tensors, value = tensors_then_value
        if self.cacheable(*tensors):
            self.entries = [(key, [self._ident(t) for t in tensors], value)] + self.entries[: self.size - 1]
