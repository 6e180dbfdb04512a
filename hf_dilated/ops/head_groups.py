"""The head-group rule of mode "head_groups" (docs/contract.md 4), written once: query heads split
into one contiguous group per level, as equal as possible, the earlier groups taking the extra
heads. The kernel, its decode path and the ring read it from here."""
from __future__ import annotations


def head_groups(num_heads: int, num_groups: int) -> list[list[int]]:
    """The query heads of each group (a group is empty when there are more groups than heads)."""
    base, extra = divmod(num_heads, num_groups)
    groups, start = [], 0
    for g in range(num_groups):
        size = base + (1 if g < extra else 0)
        groups.append(list(range(start, start + size)))
        start += size
    return groups


def head_group_bounds(num_heads: int, num_groups: int) -> list[tuple[int, int]]:
    """(first head, end head) of each group; (0, 0) for an empty one."""
    return [(g[0], g[-1] + 1) if g else (0, 0) for g in head_groups(num_heads, num_groups)]


def levels_of_heads(num_heads: int, num_levels: int, mode: str) -> list[list[int]]:
    """For each query head, the levels it reads: all of them, or (mode "head_groups") its group's one."""
    if mode != "head_groups":
        return [list(range(num_levels)) for _ in range(num_heads)]
    return [[g] for g, heads in enumerate(head_groups(num_heads, num_levels)) for _ in heads]
