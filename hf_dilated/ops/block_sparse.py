"""Block-sparse attention (SPEC.md, "Block-sparse attention"): one softmax over the allowed blocks.

What the layout indexes. Block numbers are counted within a document: token i is in block
`p_i // block_size` of its document (positions from `attention_mask` / `position_ids`, see
positions.py). The layout is a bool tensor (batch or 1, heads or 1, num_blocks, num_blocks) with
`layout[b, h, bq, bk]` saying whether a query of block number bq may read keys of block number bk.
With packed documents, every document of a row is read through the same layout (its own block
numbers restart with its positions); a key is still visible only from its own document, only
causally and never when it is padding. num_blocks = 1 + the largest block number of a real token.
Padding tokens have no block; their outputs are 0.

How it is computed. Tokens are regrouped into "row blocks" (one per document and block number,
each holding at most block_size tokens, packed from slot 0 in sequence order). A query row block
then needs its own row block (the diagonal: causal inside the block) and a list of earlier row
blocks of its document (off-diagonal: fully visible). The diagonal of every query block is one
fused call; off-diagonal lists are grouped by length, their K/V blocks gathered into dense batches
(at most ~12% padding, masked by an additive bias) and each batch is one fused call. The two
partial results of a row merge in float32 by log-sum-exp, so the softmax runs over every allowed
key at once. Work and gathered memory grow with the number of allowed blocks, never with N^2.
When the layout is shared by all heads the calls are grouped-query attention calls (K/V never
repeated); a per-head layout (adaptive, or a custom layout with a head axis) batches
(query block, head) pairs instead. The backward replays the same calls with the merged output
and log-sum-exp (flash-style), so no probability matrix is kept.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .backend import attention_backward, attention_forward
from .block_patterns import AdaptivePattern, CustomPattern, _check_int, make_pattern
from .merge import merge_dtype, merge_partial
from .positions import token_layout
from .validate import check_qkv, check_scale_dropout

# Elements of gathered K plus V per fused call: bounds the transient memory of a call.
_GATHER_BUDGET = 1 << 24
# A group of off-diagonal lists is padded to its longest list; allow at most 1/8 of padding.
_PAD_SLACK = 0.125


def block_sparse_attention(q, k, v, pattern, *, block_size, is_causal=True, scale=None, attention_mask=None,
                           position_ids=None, return_layout=False):
    """Block-sparse attention with one softmax over all allowed blocks of a row.

    q (batch, q_heads, q_len, head_dim); k, v (batch, kv_heads, kv_len, head_dim); the queries are
    the last q_len tokens. `pattern`: a pattern object from block_patterns.py or a dict such as
    {"type": "global_local", "global_blocks": 1, "window": 4}. Returns a tensor shaped like q, and
    with return_layout=True also the bool layout used, (batch or 1, heads or 1, num_blocks,
    num_blocks) as described in the module docstring.
    """
    check_qkv(q, k, v, attention_mask, position_ids)
    check_scale_dropout(scale, 0.0)
    _check_int("block_size", block_size, 1)
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {is_causal!r}")
    if not isinstance(return_layout, bool):
        raise TypeError(f"return_layout must be a bool, got {return_layout!r}")
    pattern = make_pattern(pattern)
    q_heads = q.shape[1]
    if isinstance(pattern, CustomPattern) and pattern.layout.shape[0] not in (1, q_heads):
        raise ValueError(
            f"pattern: a custom layout needs 1 or q_heads ({q_heads}) heads, got {pattern.layout.shape[0]}"
        )
    scale = float(scale) if scale is not None else q.shape[-1] ** -0.5

    st = _structure(q.shape[0], q.shape[2], k.shape[2], block_size, q.device, attention_mask, position_ids)
    layout, rows = _layout(pattern, q, k, st)
    plan = _plan(st, rows, is_causal, q.shape[1], k.shape[1], q.shape[3])
    out = _BlockSparseAttention.apply(q, k, v, st, plan, scale)
    return (out, layout) if return_layout else out


# ----------------------------------------------------------------------------------------------
# Token -> row block structure


@dataclass
class _Structure:
    block_size: int
    num_blocks: int  # layout size: 1 + largest block number of a real token
    R: int  # row blocks per batch row (max over rows); block id = b * R + r, null id = B * R
    null: int
    blk_doc: torch.Tensor  # (B*R + 1,) document of each row block
    blk_num: torch.Tensor  # (B*R + 1,) block number within its document
    blk_len: torch.Tensor  # (B*R + 1,) real tokens in the block (0 for absent blocks and null)
    k_b: torch.Tensor  # real key tokens: batch row, sequence index, block id, slot
    k_t: torch.Tensor
    k_blk: torch.Tensor
    k_slot: torch.Tensor
    q_b: torch.Tensor  # real query tokens: batch row, query index (0..q_len-1), item, slot
    q_t: torch.Tensor
    q_item: torch.Tensor
    q_slot: torch.Tensor
    item_blk: torch.Tensor  # (I,) row block id of each query item (row blocks holding queries)
    # token-level info the adaptive selection pools over
    real: torch.Tensor
    bnum: torch.Tensor


def _structure(batch, q_len, kv_len, bs, device, attention_mask, position_ids) -> _Structure:
    tl = token_layout(batch, kv_len, device, attention_mask, position_ids)
    real, pos, doc = tl.real, tl.positions, tl.doc
    if bool((pos[real] < 0).any()):
        raise ValueError("position_ids: real (unmasked) tokens must have non-negative positions")
    bnum = torch.where(real, pos // bs, torch.zeros_like(pos))
    num_blocks = int(bnum.max()) + 1 if bool(real.any()) else 1
    # Row blocks: runs of real tokens sharing (document, block number); keys are non-decreasing.
    key = torch.where(real, doc * num_blocks + bnum, torch.full_like(doc, -1))
    seen = key.cummax(-1).values
    prev = torch.cat([torch.full_like(seen[:, :1], -1), seen[:, :-1]], dim=1)
    new = real & (key != prev)
    rb = new.long().cumsum(-1) - 1
    R = max(int(rb.max()) + 1, 1)
    null = batch * R
    rank = real.long().cumsum(-1) - 1

    k_b, k_t = real.nonzero(as_tuple=True)
    k_blk = k_b * R + rb[k_b, k_t]
    n_b, n_t = new.nonzero(as_tuple=True)
    new_blk = n_b * R + rb[n_b, n_t]
    start_rank = torch.zeros(null + 1, dtype=torch.long, device=device)
    start_rank[new_blk] = rank[n_b, n_t]
    k_slot = rank[k_b, k_t] - start_rank[k_blk]
    blk_doc = torch.full((null + 1,), -1, dtype=torch.long, device=device)
    blk_doc[new_blk] = doc[n_b, n_t]
    blk_num = torch.zeros(null + 1, dtype=torch.long, device=device)
    blk_num[new_blk] = bnum[n_b, n_t]
    blk_len = torch.bincount(k_blk, minlength=null + 1)

    first_q = kv_len - q_len
    is_q = k_t >= first_q
    q_blk = k_blk[is_q]
    item_blk = torch.unique(q_blk)  # sorted
    return _Structure(
        block_size=bs, num_blocks=num_blocks, R=R, null=null, blk_doc=blk_doc, blk_num=blk_num,
        blk_len=blk_len, k_b=k_b, k_t=k_t, k_blk=k_blk, k_slot=k_slot,
        q_b=k_b[is_q], q_t=k_t[is_q] - first_q, q_item=torch.searchsorted(item_blk, q_blk),
        q_slot=k_slot[is_q], item_blk=item_blk, real=real, bnum=bnum,
    )


# ----------------------------------------------------------------------------------------------
# Layouts


def _layout(pattern, q, k, st: _Structure):
    """Returns (full layout to report, rows (I, heads or 1, num_blocks) for the query items)."""
    nb = st.num_blocks
    item_num = st.blk_num[st.item_blk]
    if isinstance(pattern, AdaptivePattern):
        layout = _adaptive_layout(pattern, q, k, st)
        return layout, layout[st.item_blk // st.R, :, item_num]
    if isinstance(pattern, CustomPattern):
        full = pattern.layout.to(q.device)
        if full.shape[1] < nb or full.shape[2] < nb:
            raise ValueError(
                f"pattern: the custom layout covers {full.shape[1]}x{full.shape[2]} blocks but the input "
                f"has {nb} blocks of block_size={st.block_size}"
            )
        return full[None], full[:, item_num, :nb].transpose(0, 1)
    all_blocks = torch.arange(nb, device=q.device)
    return pattern.block_layout(all_blocks, nb), pattern.block_layout(item_num, nb)[0].transpose(0, 1)


def _adaptive_layout(pattern: AdaptivePattern, q, k, st: _Structure):
    """(batch, q_heads, nb, nb): local window plus top_k selected earlier blocks per row block."""
    batch, q_heads, q_len, dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    nb = st.num_blocks
    acc = merge_dtype(q.dtype)
    with torch.no_grad():
        ksum = torch.zeros(batch, nb, kv_heads, dim, dtype=acc, device=q.device)
        ksum.index_put_((st.k_b, st.bnum[st.k_b, st.k_t]), k[st.k_b, :, st.k_t].to(acc), accumulate=True)
        kcount = torch.zeros(batch, nb, dtype=acc, device=q.device)
        kcount.index_put_((st.k_b, st.bnum[st.k_b, st.k_t]), torch.ones_like(st.k_b, dtype=acc), accumulate=True)
        qnum = st.bnum[st.q_b, st.q_t + (kv_len - q_len)]
        qsum = torch.zeros(batch, nb, q_heads, dim, dtype=acc, device=q.device)
        qsum.index_put_((st.q_b, qnum), q[st.q_b, :, st.q_t].to(acc), accumulate=True)
        qcount = torch.zeros(batch, nb, dtype=acc, device=q.device)
        qcount.index_put_((st.q_b, qnum), torch.ones_like(st.q_b, dtype=acc), accumulate=True)
        pooled_k = ksum / kcount.clamp_min(1)[..., None, None]
        pooled_q = (qsum / qcount.clamp_min(1)[..., None, None]).view(batch, nb, kv_heads, q_heads // kv_heads, dim)
        scores = torch.einsum("bnkgd,bmkd->bkgnm", pooled_q, pooled_k).reshape(batch, q_heads, nb, nb)
        blocks = torch.arange(nb, device=q.device)
        offset = blocks[:, None] - blocks[None, :]
        local = (offset >= 0) & (offset < pattern.window)
        candidate = (offset >= pattern.window)[None] & (kcount[:, None, :] > 0) & (qcount[:, :, None] > 0)
        scores = scores.masked_fill(~candidate[:, None], float("-inf"))
        top = min(pattern.top_k, nb)
        layout = local.expand(batch, q_heads, nb, nb).clone()
        if top > 0:
            values, index = scores.topk(top, dim=-1)
            selected = torch.zeros_like(layout)
            selected.scatter_(-1, index, torch.isfinite(values))
            layout |= selected
    return layout


# ----------------------------------------------------------------------------------------------
# Plan: the fused calls


@dataclass
class _Call:
    units: torch.Tensor  # item ids (shared layout) or item * q_heads + head (per-head layout)
    per_head: bool
    blocks: torch.Tensor  # (units, M) key block ids, padded with the null block
    causal: bool
    bias: torch.Tensor | None  # additive, broadcastable to (units, heads, block_size, M * block_size)
    empty_rows: torch.Tensor | None  # (units, heads, 1) rows with no key: their lse is -inf


@dataclass
class _Plan:
    calls: list
    num_items: int


def _plan(st: _Structure, rows, is_causal, q_heads, kv_heads, dim) -> _Plan:
    device = rows.device
    bs, R = st.block_size, st.R
    I = st.item_blk.numel()
    lh = rows.shape[1]
    per_head = lh > 1
    calls = []
    if I == 0:
        return _Plan(calls, 0)
    item_b, item_r = st.item_blk // R, st.item_blk % R
    item_num = st.blk_num[st.item_blk]
    r = torch.arange(R, device=device)
    cand_blk = item_b[:, None] * R + r[None, :]
    cand = (st.blk_len[cand_blk] > 0) & (st.blk_doc[cand_blk] == st.blk_doc[st.item_blk][:, None])
    cand &= r[None, :] != item_r[:, None]
    if is_causal:
        cand &= r[None, :] < item_r[:, None]
    knum = st.blk_num[cand_blk]
    allowed = cand[:, None, :] & rows.gather(2, knum[:, None, :].expand(I, lh, R))  # (I, lh, R)
    diag = rows.gather(2, item_num[:, None, None].expand(I, lh, 1))[..., 0]  # (I, lh)
    slots = torch.arange(bs, device=device)

    # Diagonal: every query block against its own block, one grouped-query call.
    has_diag = diag.any(1)
    if bool(has_diag.any()):
        units = has_diag.nonzero()[:, 0]
        blocks = st.item_blk[units][:, None]
        bias, empty = None, None
        if not is_causal:  # trailing empty slots of a short block are only hidden by causality
            valid = slots[None, :] < st.blk_len[blocks]
            if not bool(valid.all()):
                bias = _bias(valid, 1)
        if per_head and not bool(diag[units].all()):
            off = ~diag[units][:, :, None, None]  # (G, Hq, 1, 1)
            head_bias = torch.zeros(off.shape, dtype=torch.float32, device=device).masked_fill(off, float("-inf"))
            bias = head_bias if bias is None else bias + head_bias
            empty = off[..., 0]
        calls.append(_Call(units, False, blocks, is_causal, bias, empty))

    # Off-diagonal: lists of earlier blocks, grouped by length.
    flat = allowed.reshape(I * lh, R)
    counts = flat.sum(-1)
    order = torch.argsort(counts, descending=True, stable=True)
    order = order[counts[order] > 0]
    if order.numel() == 0:
        return _Plan(calls, I)
    # r' in increasing order first, for every unit
    lists = torch.argsort((~flat[order]).to(torch.int8), dim=-1, stable=True)
    sorted_counts = counts[order].tolist()
    per_unit = bs * dim * 2 * (1 if per_head else kv_heads)
    start = 0
    n = len(sorted_counts)
    while start < n:
        m = sorted_counts[start]
        cap = max(1, _GATHER_BUDGET // (m * per_unit))
        end = start + 1
        while end < n and end - start < cap and sorted_counts[end] >= m * (1 - _PAD_SLACK):
            end += 1
        unit = order[start:end]
        item = unit // lh
        cols = lists[start:end, :m]
        used = torch.arange(m, device=device)[None, :] < counts[unit][:, None]
        blocks = torch.where(used, item_b[item][:, None] * R + cols, torch.full_like(cols, st.null))
        valid = slots[None, None, :] < st.blk_len[blocks][:, :, None]  # null block has length 0
        bias = None if bool(valid.all()) else _bias(valid.reshape(len(unit), m * bs), 1)
        units = unit if per_head else item
        calls.append(_Call(units, per_head, blocks, False, bias, None))
        start = end
    return _Plan(calls, I)


def _bias(valid, heads):
    """(G, keys) bool -> additive float32 bias (G, heads=1, 1, keys)."""
    bias = torch.zeros(valid.shape, dtype=torch.float32, device=valid.device).masked_fill(~valid, float("-inf"))
    return bias[:, None, None, :].expand(-1, heads, 1, -1)


# ----------------------------------------------------------------------------------------------
# The kernel


def _gather(call: _Call, items, kb, vb, q_heads):
    """Dense 4-D batches for one call: queries-like tensors from `items` (I, bs, Hq, D) and keys,
    values from the blocked kb, vb (B*R + 1, bs, Hk, D). Returns (q-like list, k, v)."""
    g, m = call.blocks.shape
    bs, kv_heads, dim = kb.shape[1], kb.shape[2], kb.shape[3]
    if not call.per_head:
        kx = kb[call.blocks].view(g, m * bs, kv_heads, dim).transpose(1, 2)
        vx = vb[call.blocks].view(g, m * bs, kv_heads, dim).transpose(1, 2)
        return [x[call.units].transpose(1, 2) for x in items], kx, vx
    item, head = call.units // q_heads, call.units % q_heads
    kv_head = (head // (q_heads // kv_heads))[:, None]
    kx = kb[call.blocks, :, kv_head].reshape(g, 1, m * bs, dim)
    vx = vb[call.blocks, :, kv_head].reshape(g, 1, m * bs, dim)
    return [x[item, :, head][:, None] for x in items], kx, vx


def _lse_rows(call: _Call, lse, q_heads):
    """The (units, heads, bs) slice of an (I, bs, Hq) log-sum-exp tensor."""
    if not call.per_head:
        return lse[call.units].transpose(1, 2).contiguous()
    return lse[call.units // q_heads, :, call.units % q_heads][:, None].contiguous()


class _BlockSparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, st: _Structure, plan: _Plan, scale: float):
        batch, q_heads, q_len, dim = q.shape
        kv_heads = k.shape[1]
        bs = st.block_size
        acc = merge_dtype(q.dtype)
        qi = q.new_zeros(plan.num_items, bs, q_heads, dim)
        qi[st.q_item, st.q_slot] = q[st.q_b, :, st.q_t]
        kb = k.new_zeros(st.null + 1, bs, kv_heads, dim)
        vb = v.new_zeros(st.null + 1, bs, kv_heads, dim)
        kb[st.k_blk, st.k_slot] = k[st.k_b, :, st.k_t]
        vb[st.k_blk, st.k_slot] = v[st.k_b, :, st.k_t]

        out_acc = torch.zeros(plan.num_items, bs, q_heads, dim, dtype=acc, device=q.device)
        lse_acc = torch.full((plan.num_items, bs, q_heads), float("-inf"), dtype=acc, device=q.device)
        for call in plan.calls:
            (qx,), kx, vx = _gather(call, [qi], kb, vb, q_heads)
            bias = None if call.bias is None else call.bias.to(q.dtype)
            out, lse = attention_forward(qx, kx, vx, is_causal=call.causal, scale=scale, attn_bias=bias)
            if call.empty_rows is not None:  # fully masked rows come back with lse 0: no key is -inf
                lse = lse.masked_fill(call.empty_rows, float("-inf"))
            out, lse = out.to(acc), lse.to(acc)
            if call.per_head:
                item, head = call.units // q_heads, call.units % q_heads
                merged = merge_partial(out_acc[item, :, head], lse_acc[item, :, head], out[:, 0], lse[:, 0])
                out_acc[item, :, head], lse_acc[item, :, head] = merged
            else:
                merged = merge_partial(out_acc[call.units], lse_acc[call.units], out.transpose(1, 2), lse.transpose(1, 2))
                out_acc[call.units], lse_acc[call.units] = merged

        out_items = out_acc.to(q.dtype)
        result = q.new_zeros(q.shape)
        result[st.q_b, :, st.q_t] = out_items[st.q_item, st.q_slot]
        ctx.save_for_backward(qi, kb, vb, out_items, lse_acc)
        ctx.st, ctx.plan, ctx.scale = st, plan, scale
        ctx.shapes = (q.shape, k.shape)
        return result

    @staticmethod
    def backward(ctx, dout):
        qi, kb, vb, out_items, lse_acc = ctx.saved_tensors
        st, plan, scale = ctx.st, ctx.plan, ctx.scale
        q_shape, k_shape = ctx.shapes
        q_heads, kv_heads = q_shape[1], k_shape[1]
        acc = merge_dtype(qi.dtype)
        bs = st.block_size
        slots = torch.arange(bs, device=qi.device)
        dout_items = torch.zeros_like(qi)
        dout_items[st.q_item, st.q_slot] = dout[st.q_b, :, st.q_t].to(qi.dtype)
        # A row that saw no key (lse -inf) gets probability exp(s - inf) = 0 in every call.
        lse_bwd = torch.where(torch.isfinite(lse_acc), lse_acc, torch.full_like(lse_acc, float("inf")))
        dqi = torch.zeros(qi.shape, dtype=acc, device=qi.device)
        dkb = torch.zeros(kb.shape, dtype=acc, device=qi.device)
        dvb = torch.zeros(kb.shape, dtype=acc, device=qi.device)
        for call in plan.calls:
            (qx, ox, dox), kx, vx = _gather(call, [qi, out_items, dout_items], kb, vb, q_heads)
            lse = _lse_rows(call, lse_bwd, q_heads).to(torch.float64 if qi.dtype == torch.float64 else torch.float32)
            bias = None if call.bias is None else call.bias.to(qi.dtype)
            dq, dk, dv = attention_backward(dox, qx, kx, vx, ox, lse, is_causal=call.causal, scale=scale, attn_bias=bias)
            g, m = call.blocks.shape
            if call.per_head:
                item, head = call.units // q_heads, call.units % q_heads
                kv_head = head // (q_heads // kv_heads)
                dqi.index_put_((item[:, None], slots[None, :], head[:, None]), dq[:, 0].to(acc), accumulate=True)
                idx = (call.blocks[:, :, None], slots[None, None, :], kv_head[:, None, None])
                dkb.index_put_(idx, dk.reshape(g, m, bs, -1).to(acc), accumulate=True)
                dvb.index_put_(idx, dv.reshape(g, m, bs, -1).to(acc), accumulate=True)
            else:
                dqi.index_add_(0, call.units, dq.transpose(1, 2).to(acc))
                blocks = call.blocks.reshape(-1)
                dkb.index_add_(0, blocks, dk.transpose(1, 2).reshape(g * m, bs, kv_heads, -1).to(acc))
                dvb.index_add_(0, blocks, dv.transpose(1, 2).reshape(g * m, bs, kv_heads, -1).to(acc))
        dq_out = qi.new_zeros(q_shape)
        dq_out[st.q_b, :, st.q_t] = dqi[st.q_item, st.q_slot].to(qi.dtype)
        dk_out = kb.new_zeros(k_shape)
        dv_out = kb.new_zeros(k_shape)
        dk_out[st.k_b, :, st.k_t] = dkb[st.k_blk, st.k_slot].to(kb.dtype)
        dv_out[st.k_b, :, st.k_t] = dvb[st.k_blk, st.k_slot].to(kb.dtype)
        return dq_out, dk_out, dv_out, None, None, None
