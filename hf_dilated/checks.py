"""The checks several entry points share, in a module that imports nothing of the package: the one
integer check (docs/contract.md 9), which the configuration (config.py) and the block patterns it
validates (ops/block_patterns.py) share without importing each other in a cycle, and where an
output folder cannot be made."""
from __future__ import annotations

from pathlib import Path


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


def file_in_the_way(path) -> Path | None:
    """The file that `path` is, or lies under (a folder cannot be made there), else None: checked
    before the work whose results go there (found after it, it was a traceback)."""
    path = Path(path)
    return next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
