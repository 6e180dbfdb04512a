"""Dilated attention (LongNet) over a sequence sharded across a process group.

Computes exactly the single-process `hf_dilated.ops.dilated_attention` on the global sequence, on
the ring of ring.py: K/V tiles travel around the ring, and each (local query rows, key tile) call
of the fused kernel gets the dilated pattern between those global tokens as its mask
(`dilated_visible`), so a rank holds one tile in hand and one in flight, never a window of a whole
segment, and its memory falls as 1/P. A key counted at several levels ("longnet") weighs
exp(s + log c). Only the K/V entries some rank further along the ring can see travel on
(`dilated_needed_keys`, the ring plan's masks), and only the gradients of entries a rank used come
back:
- a level whose segments do not cross a rank boundary needs nothing from other ranks;
- at a level with dilation r, kv head h needs only the keys selected for the offsets of its
  query heads ((p mod w) mod r == h mod r), so with one query head per kv head the traffic of a
  level falls by r (with grouped-query attention, by r / min(r, query heads per kv head)).
Which entries are needed is decided from positions, documents and padding alone, the same
rules the kernel applies (docs/contract.md 4). The mask is dense over a tile: the work of a call
does not shrink with the pattern's density, only calls where no query needs a key of the tile are
skipped.
"""
from __future__ import annotations

import torch

from ..config import DEFAULT_MODE, DEFAULT_RING_LAYOUT
from ..ops.validate import check_dilated_config, check_int, check_qkv, check_scale_dropout
from .ring import _RingAttention, ring_plan
from .tokens import GlobalTokens, prepare_call
from .utils import Exchange
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


def dilated_visible(tokens: GlobalTokens, q_index, k_index, q_heads: int, segment_lengths, dilation_rates,
                    mode: str) -> torch.Tensor:
    """(batch, q_heads, len(q_index), len(k_index)): for each query head, how the pattern counts key
    j for query i (docs/contract.md 4), before causality, documents and padding: bool for "union"
    (in some V_g(h, i)) and "head_groups" (in V_g(h, i) of the head's level), the number of levels
    g with j in V_g(h, i) for "longnet"."""
    pq, pk = tokens.positions[:, q_index], tokens.positions[:, k_index]
    heads = torch.arange(q_heads, device=pq.device)
    levels = levels_of_heads(q_heads, len(segment_lengths), mode)
    # j is in V_g(h, i) when i and j have the same level-g (segment, offset class) code and i's class
    # is h's (h mod r). Level by level: bit g of pairs[i, j] (codes equal, the same for every head)
    # and of heads_of[h, i] (i selected for h at g); one AND over (heads, rows, keys) at the end,
    # instead of one per level (the mask costs more than the attention call it serves otherwise).
    bits = torch.uint8 if len(segment_lengths) <= 8 else torch.int64  # one bit a level
    pairs = torch.zeros(pq.shape[0], pq.shape[1], pk.shape[1], dtype=bits, device=pq.device)
    heads_of = torch.zeros(pq.shape[0], q_heads, pq.shape[1], dtype=bits, device=pq.device)
    for g, (w, r) in enumerate(zip(segment_lengths, dilation_rates)):
        reads = torch.tensor([g in levels[h] for h in range(q_heads)], device=pq.device)
        if not bool(reads.any()):
            continue
        cls_q = (pq % w) % r
        code_q = torch.div(pq, w, rounding_mode="floor") * r + cls_q
        code_k = torch.div(pk, w, rounding_mode="floor") * r + (pk % w) % r
        pairs |= (code_q[:, :, None] == code_k[:, None, :]).to(bits) << g
        heads_of |= ((cls_q[:, None, :] == (heads % r)[None, :, None]) & reads[None, :, None]).to(bits) << g
    both = heads_of[..., None] & pairs[:, None]
    if mode != "longnet":
        return both != 0
    count = torch.zeros(both.shape, dtype=torch.int32, device=both.device)  # levels counted: the set bits
    for g in range(len(segment_lengths)):
        count += ((both >> g) & 1).to(torch.int32)
    return count


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
        return ring_plan(tokens, sliding_window,
                         pattern=lambda qi, kj: dilated_visible(tokens, qi, kj, q_heads, seg, dil, mode),
                         needed_keys=lambda qi: dilated_needed_keys(tokens, qi, q_heads, kv_heads, seg, dil, mode,
                                                                    memo))

    plan = prepare_call("dilated_ring_attention", q, k, v, attention_mask=attention_mask, position_ids=position_ids,
                        group=group, layout=layout, build=build, scale=scale, segment_lengths=seg,
                        dilation_rates=dil, mode=mode, sliding_window=sliding_window)
    return _RingAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), Exchange(group, "dilated_ring"),
                                plan, scale)
