"""`as_strided` views that provably stay inside their storage.

`Tensor.as_strided` checks nothing: a view whose last element lies past the end of its storage
reads (or writes) whatever memory follows. On the CPU that is usually mapped and goes unnoticed;
on CUDA it is an illegal memory access when it lands on unmapped memory, i.e. only sometimes.
Every `as_strided` of the kernels goes through `as_strided_within`, which computes the view's
reach (storage_offset + sum((size - 1) * stride) + 1 elements, for a non-empty view) and raises
before building a view past the storage. The check is Python arithmetic on shapes: no tensor
operation, no device synchronisation.
"""
from __future__ import annotations

import torch


def view_reach(size, stride, storage_offset: int) -> int:
    """Elements of storage a view needs: one past its last element (its offset when empty)."""
    if any(n == 0 for n in size):
        return storage_offset
    return storage_offset + sum((n - 1) * s for n, s in zip(size, stride)) + 1


def storage_elements(x: torch.Tensor) -> int:
    """Elements of x's dtype that x's storage holds."""
    return x.untyped_storage().nbytes() // x.element_size()


def as_strided_within(x: torch.Tensor, size, stride, storage_offset: int) -> torch.Tensor:
    """x.as_strided(size, stride, storage_offset), after checking that the view lies in x's storage."""
    size, stride = tuple(size), tuple(stride)
    if not torch.compiler.is_compiling():
        limit = storage_elements(x)
        reach = view_reach(size, stride, storage_offset)
        if storage_offset < 0 or any(s < 0 for s in stride) or reach > limit:
            raise IndexError(f"as_strided view (size {size}, stride {stride}, offset {storage_offset}) reaches "
                             f"element {reach - 1} of a storage of {limit} elements")
    return x.as_strided(size, stride, storage_offset)


def canonical(x: torch.Tensor) -> torch.Tensor:
    """x with the strides of a contiguous tensor of its shape (a copy only where x is not
    contiguous). A compiled call (dynamic=False) guards every stride, a size-1 dimension's too, which
    .contiguous() leaves as it was: a batch of one sliced from a longer row (flash's band output of
    transformers' layout) has a stride that follows the row's length, and recompiled at each length."""
    if not x.is_contiguous():
        return x.contiguous()
    strides, step = [], 1
    for size in reversed(x.shape):
        strides.append(step)
        step *= max(size, 1)
    strides = tuple(reversed(strides))
    return x if x.stride() == strides else as_strided_within(x, x.shape, strides, x.storage_offset())
