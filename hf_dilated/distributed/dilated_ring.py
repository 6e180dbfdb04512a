"""Dilated attention (LongNet) over a sequence sharded across a process group.

Computes exactly the single-process `hf_dilated.ops.dilated_attention` on the global sequence.
Each local chunk of queries runs the single-process kernel over a window of the global sequence
(windows.windowed_attention); from the other ranks it receives only the K/V entries its queries
can see:
- a level whose segments do not cross a rank boundary needs nothing from other ranks;
- at a level with dilation r, kv head h needs only the keys selected for the offsets of its
  query heads ((p mod w) mod r == h mod r), so with one query head per kv head the traffic of a
  level falls by r (with grouped-query attention, by r / min(r, query heads per kv head)).
Which entries are needed is decided from positions, documents and padding alone, the same
rules the kernel applies (docs/contract.md 4); a needed entry is sent once per window.
"""
from __future__ import annotations

import torch

from ..config import DEFAULT_MODE, DEFAULT_RING_LAYOUT
from ..ops.validate import check_dilated_config, check_int, check_qkv, check_scale_dropout
from .tokens import GlobalTokens, prepare_call
from .utils import Exchange
from .windows import plan_windows, windowed_attention
from .groups import group_size_rank
from .layout import check_layout


def levels_of_heads(q_heads: int, num_levels: int, mode: str) -> list[list[int]]:
    """For each query head, the levels it reads: all of them, or (head_groups) its group's one,
    groups contiguous and as equal as possible, the earlier groups taking the extra heads."""
    if mode != "head_groups":
        return [list(range(num_levels)) for _ in range(q_heads)]
    sizes = [q_heads // num_levels + (g < q_heads % num_levels) for g in range(num_levels)]
    return [[g] for g, size in enumerate(sizes) for _ in range(size)]


def dilated_needed_keys(tokens: GlobalTokens, query_index: torch.Tensor, q_heads: int, kv_heads: int,
                        segment_lengths, dilation_rates, mode: str, memo: dict | None = None) -> torch.Tensor:
    """bool (batch, kv_heads, seq_len): key j is needed for kv head hk when, for some query head h
    of hk, some level g it reads, and some query i of `query_index`, j is in V_g(h, i): both
    selected for h at g, same level-g segment, same document, j real and not after i."""
    p, real, doc = tokens.positions, tokens.real, tokens.doc
    batch, seq_len = p.shape
    device = p.device
    index = torch.arange(seq_len, device=device).expand(batch, seq_len)
    is_query = torch.zeros(seq_len, dtype=torch.bool, device=device)
    is_query[query_index] = True
    need = torch.zeros(batch, kv_heads, seq_len, dtype=torch.bool, device=device)
    per_kv = q_heads // kv_heads
    levels = levels_of_heads(q_heads, len(segment_lengths), mode)
    for g, (w, r) in enumerate(zip(segment_lengths, dilation_rates)):
        heads = [h for h in range(q_heads) if g in levels[h]]
        if not heads:
            continue
        if memo is not None and g in memo:  # independent of the queries: computed once per call
            offset, group = memo[g]
        else:
            offset = (p % w) % r
            # One id per (batch row, document, level-g segment). Within a document positions rise by
            # one per token, so each such group is a run of consecutive tokens: number the runs.
            segment = torch.div(p, w, rounding_mode="floor")
            starts = torch.ones(batch, seq_len, dtype=torch.bool, device=device)
            starts[:, 1:] = (doc[:, 1:] != doc[:, :-1]) | (segment[:, 1:] != segment[:, :-1])
            group = starts.flatten().long().cumsum(0).view(batch, seq_len) - 1
            if memo is not None:
                memo[g] = (offset, group)
        # The last query of each (group, offset class); a key needs only its own class's entry.
        cell = group * r + offset
        last_query = torch.full((int(cell.max()) + 1,), -1, dtype=torch.long, device=device)
        queries = is_query.expand(batch, seq_len)
        last_query.scatter_reduce_(0, cell[queries], index[queries], reduce="amax")
        need_g = real & (last_query[cell] >= index)
        for hk in range(kv_heads):  # kv head hk reads the classes of its query heads at this level
            classes = {h % r for h in heads if h // per_kv == hk}
            if not classes:
                continue
            if len(classes) == r:
                need[:, hk] |= need_g
            else:
                wanted = torch.zeros(r, dtype=torch.bool, device=device)
                wanted[sorted(classes)] = True
                need[:, hk] |= need_g & wanted[offset]
    return need


def dilated_ring_attention(q, k, v, segment_lengths, dilation_rates, *, mode: str = DEFAULT_MODE, group=None,
                           layout: str = DEFAULT_RING_LAYOUT, scale=None, attention_mask=None, position_ids=None,
                           dropout_p: float = 0.0, sliding_window: int | None = None):
    """Dilated attention over a sequence sharded across `group` (docs/contract.md 6).

    q, k, v, attention_mask, position_ids: this rank's shards of the global tensors in `layout`
    (see ring_attention); sliding_window: as in docs/contract.md 3.3, by global index. Returns this
    rank's shard of `dilated_attention` on the global sequence.
    With group None or of size 1 this is `hf_dilated.ops.dilated_attention` itself.
    """
    from ..ops import dilated_attention

    seg, dil = check_dilated_config(segment_lengths, dilation_rates, mode)
    check_layout(layout)
    check_qkv(q, k, v, attention_mask, position_ids)
    check_scale_dropout(scale, dropout_p)
    check_int("sliding_window", sliding_window, optional=True)
    world, _ = group_size_rank(group)
    if world == 1:
        return dilated_attention(q, k, v, seg, dil, mode=mode, scale=scale, dropout_p=dropout_p,
                                 attention_mask=attention_mask, position_ids=position_ids,
                                 sliding_window=sliding_window)
    if dropout_p:
        raise ValueError(f"dropout_p: dilated_ring_attention does not implement attention dropout, got {dropout_p}")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    q_heads, kv_heads = q.shape[1], k.shape[1]

    def build(tokens):
        memo = {}
        return plan_windows(tokens, lambda qi: dilated_needed_keys(tokens, qi, q_heads, kv_heads, seg, dil, mode,
                                                                   memo), sliding_window)

    plan = prepare_call("dilated_ring_attention", q, k, v, attention_mask=attention_mask, position_ids=position_ids,
                        group=group, layout=layout, build=build, scale=scale, segment_lengths=seg,
                        dilation_rates=dil, mode=mode, sliding_window=sliding_window)

    def kernel(qc, kw, vw, attention_mask, position_ids):
        return dilated_attention(qc, kw, vw, seg, dil, mode=mode, scale=scale, attention_mask=attention_mask,
                                 position_ids=position_ids, sliding_window=sliding_window)

    return windowed_attention(q.contiguous(), k.contiguous(), v.contiguous(), plan,
                              Exchange(group, "dilated_ring"), kernel)
