"""Block-sparse attention over a sequence sharded across a process group.

Computes exactly the single-process `hf_dilated.ops.block_sparse_attention` on the global
sequence, on the ring of ring.py as dilated_ring does: each (local query rows, key tile) call of
the fused kernel gets the block layout between those global tokens as its mask
(`block_sparse_visible`); a call is skipped when none of its query tiles reads a block of the key
tile, and only the keys of blocks some rank further along the ring may read travel on (per kv
head when the layout has a head axis). Static patterns (local, dilated, global_local,
hierarchical, custom) are supported; the adaptive pattern is not: its top-k choice pools the
queries and keys of whole blocks, which may straddle ranks, so it cannot be decided per rank
without another exchange. The layout is a `BlockSparsePattern`, the ring.RingPattern the ring runs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import DEFAULT_RING_LAYOUT
from ..ops.block_patterns import AdaptivePattern, CustomPattern, make_pattern
from ..ops.validate import check_int, check_qkv, check_scale_dropout
from .ring import RingPattern, ring_plan, run_ring
from .tokens import GlobalTokens, prepare_call
from .groups import group_size_rank
from .layout import check_layout


def block_allowed(pattern, num_blocks: int, q_heads: int, device) -> torch.Tensor:
    """bool (heads or 1, num_blocks, num_blocks): key block bk allowed for query block bq."""
    if isinstance(pattern, CustomPattern):
        layout = pattern.layout.to(device)
        if layout.shape[1] < num_blocks or layout.shape[2] < num_blocks:
            raise ValueError(f"pattern: the custom layout covers {layout.shape[1]}x{layout.shape[2]} blocks but "
                             f"the input has {num_blocks} blocks")
        if layout.shape[0] not in (1, q_heads):
            raise ValueError(f"pattern: a custom layout needs 1 or q_heads ({q_heads}) heads, got {layout.shape[0]}")
        return layout[:, :num_blocks, :num_blocks]
    return pattern.block_layout(torch.arange(num_blocks, device=device), num_blocks)[0]


def block_sparse_needed_keys(tokens: GlobalTokens, query_index: torch.Tensor, pattern, block_size: int,
                             q_heads: int, kv_heads: int) -> torch.Tensor:
    """bool (batch, kv_heads, seq_len): key j is needed for kv head hk when some real query i of
    `query_index` in j's document, not before j, has a block that may read j's block for some
    query head of hk (j real).

    Within a document positions grow with the index (ops/token_layout.py), so a query of a later
    block of j's document comes after j, and one of j's own block may or may not: key j is needed
    when its own block may read itself and that block's last query is not before j, or when a
    block after it that holds a query may read it. The second is a product of (documents x blocks)
    by the (blocks x blocks) layout, taken a slice of key blocks at a time: memory of the layout's
    order, never of (tokens x blocks), which at a million tokens in blocks of 64 is 16 G entries."""
    p, real, doc = tokens.positions, tokens.real, tokens.doc
    batch, seq_len = p.shape
    device = p.device
    block = torch.where(real, p // block_size, torch.zeros_like(p))
    num_blocks = int(block[real].max()) + 1 if bool(real.any()) else 1
    index = torch.arange(seq_len, device=device).expand(batch, seq_len)
    is_query = torch.zeros(batch, seq_len, dtype=torch.bool, device=device)
    is_query[:, query_index] = True
    is_query &= real
    # last[b * num_docs + d, bq]: the last query of block bq in document d of row b (-1: none).
    num_docs = int(doc.max()) + 1
    cell = (torch.arange(batch, device=device)[:, None] * num_docs + doc) * num_blocks + block
    last = torch.full((batch * num_docs * num_blocks,), -1, dtype=torch.long, device=device)
    last.scatter_reduce_(0, cell[is_query], index[is_query], reduce="amax")
    own_block = last[cell] >= index  # (batch, seq): a query of the key's own block at or after it
    holds_query = (last.view(batch * num_docs, num_blocks) >= 0).float()
    allowed = block_allowed(pattern, num_blocks, q_heads, device)  # (H or 1, bq, bk)
    blocks = torch.arange(num_blocks, device=device)
    cols = max(1, _LATER_BUDGET // num_blocks)
    need = torch.zeros(batch, kv_heads, seq_len, dtype=torch.bool, device=device)
    per_kv = q_heads // kv_heads
    for h in range(allowed.shape[0]):
        later = torch.empty(batch * num_docs, num_blocks, dtype=torch.bool, device=device)
        for c in range(0, num_blocks, cols):  # later[., bk]: a block bq > bk with a query may read bk
            reads = allowed[h, :, c:c + cols] & (blocks[:, None] > blocks[None, c:c + cols])
            later[:, c:c + cols] = (holds_query @ reads.float()) > 0
        need_h = real & ((own_block & allowed[h].diagonal()[block]) | later.view(-1)[cell])
        heads = range(kv_heads) if allowed.shape[0] == 1 else [h // per_kv]
        for hk in heads:
            need[:, hk] |= need_h
    return need


_LATER_BUDGET = 1 << 24  # entries of one slice of the layout in block_sparse_needed_keys


def _blocks(tokens: GlobalTokens, pattern, block_size: int, q_heads: int):
    """Each token's block number (batch, seq_len) (docs/contract.md 5: p // block_size, positions
    counting within the document) and the layout (heads or 1, blocks, blocks) over the sequence."""
    p, real = tokens.positions, tokens.real
    block = torch.where(real, p // block_size, torch.zeros_like(p))
    num_blocks = int(block[real].max()) + 1 if bool(real.any()) else 1
    return block, block_allowed(pattern, num_blocks, q_heads, p.device)


def block_sparse_visible(block, allowed, q_index, k_index) -> torch.Tensor:
    """bool (batch, heads or 1, len(q_index), len(k_index)): the layout allows key j's block for
    query i's block (before causality, documents and padding)."""
    bq, bk = block[:, q_index], block[:, k_index]
    return allowed[:, bq[:, :, None], bk[:, None, :]].transpose(0, 1)


@dataclass(eq=False)
class BlockSparsePattern(RingPattern):
    """The ring pattern of block_sparse_ring_attention: a static block layout (docs/contract.md 5)."""
    block_pattern: object  # a static pattern of ops/block_patterns.py
    block_size: int
    q_heads: int
    kv_heads: int
    sparse = True

    def __post_init__(self):
        self.block, self.allowed = _blocks(self.tokens, self.block_pattern, self.block_size, self.q_heads)

    def needed_keys(self, query_index):
        return block_sparse_needed_keys(self.tokens, query_index, self.block_pattern, self.block_size, self.q_heads,
                                        self.kv_heads)

    def weight(self, q_index, k_index):
        return block_sparse_visible(self.block, self.allowed, q_index, k_index)


def block_sparse_ring_attention(q, k, v, pattern, *, block_size, group=None, layout: str = DEFAULT_RING_LAYOUT,
                                scale=None, attention_mask=None, position_ids=None, sliding_window: int | None = None):
    """Block-sparse attention over a sequence sharded across `group` (docs/contract.md 6).

    q, k, v, attention_mask, position_ids: this rank's shards of the global tensors in `layout`
    (see ring_attention); sliding_window: as in docs/contract.md 3.3, by global index. Returns this
    rank's shard of `block_sparse_attention` on the global sequence. With group None or of size 1 this is `hf_dilated.ops.block_sparse_attention`.
    """
    from ..ops.block_sparse import block_sparse_attention

    pattern = make_pattern(pattern)
    check_int("block_size", block_size)
    check_layout(layout)
    check_qkv(q, k, v, attention_mask, position_ids)
    check_scale_dropout(scale, 0.0)
    check_int("sliding_window", sliding_window, optional=True)
    world, _ = group_size_rank(group)
    if world == 1:
        return block_sparse_attention(q, k, v, pattern, block_size=block_size, scale=scale,
                                      attention_mask=attention_mask, position_ids=position_ids,
                                      sliding_window=sliding_window)
    if isinstance(pattern, AdaptivePattern):
        raise NotImplementedError(
            "pattern: the adaptive pattern is not supported under sequence parallelism (its top-k block choice "
            "pools whole blocks of queries and keys that may lie on several ranks); use a static pattern "
            "(local, dilated, global_local, hierarchical, custom) or a single process")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    q_heads, kv_heads = q.shape[1], k.shape[1]

    def build(tokens):
        if tokens.real.any() and bool((tokens.positions[tokens.real] < 0).any()):
            raise ValueError("position_ids: real (unmasked) tokens must have non-negative positions")
        return ring_plan(BlockSparsePattern(tokens, sliding_window, block_pattern=pattern, block_size=block_size,
                                            q_heads=q_heads, kv_heads=kv_heads))

    plan = prepare_call("block_sparse_ring_attention", q, k, v, attention_mask=attention_mask,
                        position_ids=position_ids, group=group, layout=layout, build=build, scale=scale,
                        pattern=pattern.to_dict(), block_size=block_size, sliding_window=sliding_window)
    return run_ring(q, k, v, plan, group=group, label="block_sparse_ring", scale=scale)
