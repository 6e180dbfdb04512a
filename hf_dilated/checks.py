"""The one integer check (docs/contract.md 9), in a module that imports nothing, so that the
configuration (config.py) and the block patterns it validates (ops/block_patterns.py) share it
without importing each other in a cycle."""
from __future__ import annotations


def check_int(name: str, value, *, minimum: int = 1, optional: bool = False) -> None:
    """A TypeError naming `name` unless `value` is an int (a bool is not; None passes when
    `optional`), a ValueError unless it is >= `minimum`."""
    if optional and value is None:
        return
    rule = ("a positive int" if minimum == 1 else f"an int >= {minimum}") + (" or None" if optional else "")
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be {rule}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be {rule}, got {value!r}")
