"""Block-sparse attention (docs/contract.md 5): one softmax over the allowed blocks.

What the layout indexes. Block numbers are counted within a document: token i is in block
`p_i // block_size` of its document (positions from `attention_mask` / `position_ids`, see
token_layout.py). The layout is a bool tensor (batch or 1, heads or 1, num_blocks, num_blocks) with
`layout[b, h, bq, bk]` saying whether a query of block number bq may read keys of block number bk.
With packed documents, every document of a row is read through the same layout (its own block
numbers restart with its positions); a key is still visible only from its own document, only
causally and never when it is padding. num_blocks = 1 + the largest block number of a real token.
Padding tokens have no block; their outputs are 0.

How it is computed. Only allowed blocks are computed, each by PyTorch's fused attention with its
log-sum-exp (backend.py); a query row's partial results merge in float32 by log-sum-exp, so the
softmax runs over every allowed key at once. Work and gathered memory grow with the number of
allowed blocks, never with N^2.
- Plain prefill (one unpadded document per row, shared layout, causal): q, k, v are used in place,
  viewed as blocks. The regular parts of the layout run as zero-copy strided calls: the band of
  full diagonals (own block causal in strips of query rows, earlier band blocks as overlapping
  windows), full columns such as global blocks (later queries as runs against fixed keys), further
  full diagonals (dilated strides). These calls go run by run over a few query blocks, so each
  result is small, reused by the allocator and merged while cached. Irregular leftovers are
  gathered as below.
- Otherwise tokens are regrouped into "row blocks" (one per document and block number, at most
  block_size tokens packed from slot 0 in sequence order). Each query row block has a list of
  allowed row blocks of its document; lists of equal length are batched, their K/V blocks gathered
  into dense batches (a list longer than the gather budget is cut into pieces), with an additive
  mask only for causality inside the query's own block and for the empty slots of short blocks.
  A layout shared by all heads gives grouped-query calls (K/V never repeated); a per-head layout
  (adaptive, or a custom layout with a head axis) batches (query block, head) pairs instead.
The backward replays the same calls with the merged output and log-sum-exp (flash-style), so no
probability matrix is kept. No real query row is ever fully masked inside a call (each call's keys
include an earlier real key or the query itself), so the backend's lse-0 convention for empty rows
never enters a merge; rows with no allowed key at all get output 0 and lse -inf.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from . import block_sparse_flex
from .backend import attention_backward, attention_forward
from ..config import DECODE_MAX_QUERIES
from .block_sparse_decode import block_sparse_decode
from .block_patterns import AdaptivePattern, CustomPattern, make_pattern
from .merge import merge_dtype, merge_into
from .plan_cache import PlanCache
from .strided import as_strided_within
from .token_layout import token_layout
from .validate import check_int, check_qkv, check_scale_dropout

# Elements of gathered K plus V per fused call: bounds the transient memory of a call.
_GATHER_BUDGET = 1 << 22
# Output elements (query rows x heads x head_dim) per zero-copy call: the calls of plain prefill
# run run-by-run over this many query rows. A fresh multi-megabyte result is page-faulted in on
# every call on CPU (~10% of the forward at N=32K when one call covered the sequence), and a small
# one is reused by the allocator and merged while it is still in cache.
_VIEW_CHUNK = 1 << 21
# Query rows per "strip" call of a block's own (causal) keys. The CPU kernel computes whole
# query-split x key tiles even under is_causal, so a 256-token diagonal block costs a full square;
# strips of 64 rows against only the keys up to their last row cost 15-30% less (measured at
# block 256, one thread).
_STRIP_ROWS = 64


def block_sparse_attention(q, k, v, pattern, *, block_size, is_causal=True, scale=None, attention_mask=None,
                           position_ids=None, return_layout=False, sliding_window=None):
    """Block-sparse attention with one softmax over all allowed blocks of a row.

    q (batch, q_heads, q_len, head_dim); k, v (batch, kv_heads, kv_len, head_dim); the queries are
    the last q_len tokens. `pattern`: a pattern object from block_patterns.py or a dict such as
    {"type": "global_local", "global_blocks": 1, "window": 4}. `sliding_window` W also hides every
    key more than W - 1 indices before its query (docs/contract.md 3.3): a block of keys wholly
    outside every window of a query block is never read. Returns a tensor shaped like q, and
    with return_layout=True also the bool layout used, (batch or 1, heads or 1, num_blocks,
    num_blocks) as described in the module docstring.
    """
    check_qkv(q, k, v, attention_mask, position_ids)
    check_scale_dropout(scale, 0.0)
    check_int("block_size", block_size)
    check_int("sliding_window", sliding_window, optional=True)
    if sliding_window is not None and sliding_window >= k.shape[2]:
        sliding_window = None  # a window over the whole key sequence hides nothing
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
    if q.shape[2] <= DECODE_MAX_QUERIES and q.shape[2] < k.shape[2] and is_causal and not return_layout:
        out = block_sparse_decode(q, k, v, pattern, block_size=block_size, scale=scale, attention_mask=attention_mask,
                                  position_ids=position_ids, sliding_window=sliding_window)
        if out is not None:
            return out

    key = _plan_key(pattern, q, k, block_size, is_causal, sliding_window)
    cached = None if key is None else _PLANS.get(key, attention_mask, position_ids)
    if cached is None:
        st = _structure(q.shape[0], q.shape[2], k.shape[2], block_size, q.device, attention_mask, position_ids)
        # (the whole layout where a caller or FlexAttention reads it, a plain row's: else its
        # (blocks x blocks) may be far larger than the rows the plan reads, as at large positions)
        layout, rows = _layout(pattern, q, k, st, whole=return_layout or st.plain)
        plan = _plan(st, rows, is_causal, q.shape[1], k.shape[1], q.shape[3], sliding_window)
        plan.calls = [_on_device(call, q.device) for call in plan.calls]
        if key is not None:
            _PLANS.put(key, attention_mask, position_ids, (st, layout, plan))
    else:
        st, layout, plan = cached
        if return_layout:  # the caller may write into it
            layout = _layout(pattern, q, k, st, whole=True)[0] if layout is None else layout.clone()
    if block_sparse_flex.applies(q, k, v, st.plain, is_causal, sliding_window, block_size):  # a plain prefill on CUDA
        out = block_sparse_flex.attention(q, k, v, layout, block_size, scale, key)
        if out is not None:
            return (out, layout) if return_layout else out
    out = _BlockSparseAttention.apply(q, k, v, st, plan, scale)
    return (out, layout) if return_layout else out


# Plans of recent calls: every layer of a model passes the same mask and positions, so the layers
# after the first (and every later step of the same shape) reuse the first one's structure, layout
# and calls, without reading a tensor on the host (no device synchronisation in a steady state).
_PLANS = PlanCache()


def _plan_key(pattern, q, k, block_size, is_causal, sliding_window):
    """The cache key of a call's plan, from shapes and settings only (no tensor data); None when
    the plan depends on the inputs' values (adaptive patterns select blocks by content)."""
    if isinstance(pattern, AdaptivePattern):
        return None
    if isinstance(pattern, CustomPattern):
        if pattern.layout.is_inference():  # no version counter: an in-place change would go unseen
            return None
        # the pattern object itself (compared by identity, and kept alive by the key) and the
        # version of its layout: a layout written in place gives a new plan
        pattern_key = (pattern, pattern.layout._version)
    else:
        pattern_key = pattern  # frozen dataclass: compared by value
    return (tuple(q.shape), tuple(k.shape), str(q.device), pattern_key, block_size, is_causal, sliding_window,
            _GATHER_BUDGET, _VIEW_CHUNK, _STRIP_ROWS)  # the budgets shape the calls too


def _on_device(call: "_Call", device) -> "_Call":
    """The call with its bias and empty-row mask on `device` (moved once, at planning)."""
    moved = {name: t.to(device) for name in ("bias", "empty")
             if (t := getattr(call, name)) is not None and t.device != device}
    return replace(call, **moved) if moved else call


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
    plain: bool  # prefill of one unpadded document per row: item ids are block ids
    # token-level info the adaptive selection pools over
    real: torch.Tensor
    bnum: torch.Tensor


def _structure(batch, q_len, kv_len, bs, device, attention_mask, position_ids) -> _Structure:
    tl = token_layout(batch, kv_len, device, attention_mask, position_ids)
    real, pos, doc = tl.real, tl.positions, tl.doc
    if bool(((pos < 0) & real).any()):
        raise ValueError("position_ids: real (unmasked) tokens must have non-negative positions")
    bnum = torch.where(real, pos // bs, torch.zeros_like(pos))
    if tl.plain:  # one unpadded document per row: blocks are tensor blocks, no search needed
        return _plain_structure(batch, q_len, kv_len, bs, device, real, bnum)
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
        q_slot=k_slot[is_q], item_blk=item_blk, plain=tl.plain and q_len == kv_len, real=real, bnum=bnum,
    )


def _plain_structure(batch, q_len, kv_len, bs, device, real, bnum) -> _Structure:
    R = -(-kv_len // bs)
    null = batch * R
    t = torch.arange(kv_len, device=device)
    k_b = torch.arange(batch, device=device).repeat_interleave(kv_len)
    k_t = t.repeat(batch)
    k_blk = k_b * R + k_t // bs
    r = torch.arange(R, device=device)
    blk_len = torch.clamp(kv_len - r * bs, max=bs).repeat(batch)
    first_q = kv_len - q_len
    first_item = first_q // bs
    items_per_row = R - first_item
    q_b = torch.arange(batch, device=device).repeat_interleave(q_len)
    q_seq = torch.arange(first_q, kv_len, device=device).repeat(batch)  # sequence index of each query
    item_blk = (torch.arange(batch, device=device)[:, None] * R + r[None, first_item:]).reshape(-1)
    tail = torch.zeros(1, dtype=torch.long, device=device)
    return _Structure(
        block_size=bs, num_blocks=R, R=R, null=null,
        blk_doc=torch.cat([torch.zeros(null, dtype=torch.long, device=device), tail - 1]),
        blk_num=torch.cat([r.repeat(batch), tail]), blk_len=torch.cat([blk_len, tail]), k_b=k_b, k_t=k_t,
        k_blk=k_blk, k_slot=k_t % bs, q_b=q_b, q_t=q_seq - first_q,
        q_item=q_b * items_per_row + q_seq // bs - first_item, q_slot=q_seq % bs,
        item_blk=item_blk, plain=q_len == kv_len, real=real, bnum=bnum,
    )


# ----------------------------------------------------------------------------------------------
# Layouts


def _layout(pattern, q, k, st: _Structure, whole: bool):
    """Returns (the whole layout to report, or None for a static pattern unless `whole`; rows (I,
    heads or 1, num_blocks) for the query items)."""
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
    rows = pattern.block_layout(item_num, nb)[0].transpose(0, 1)
    return pattern.block_layout(torch.arange(nb, device=q.device), nb) if whole else None, rows


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
    """One fused call. kind "gather": units (G,) attend the listed key blocks (G, M), gathered.
    The view kinds need no copy: "window": each unit u in [u0, u1) attends blocks
    [u - off - m + 1, u - off] (overlapping strided views); "strip": query rows [r0, r1) of each
    unit u attend its own first r1 keys, causally (bias, or is_causal when r0 = 0); "fixed": the
    units [u0, u1), as one run of queries, attend blocks [s, s + m) (causal: the run starts at
    block s = u0 = 0)."""

    kind: str
    first: bool  # first call touching these units: write the result, else merge into it
    bias: torch.Tensor | None = None  # additive float32, broadcastable to the call's scores
    units: torch.Tensor | None = None
    blocks: torch.Tensor | None = None
    u0: int = 0
    u1: int = 0
    off: int = 0
    s: int = 0
    m: int = 0
    causal: bool = False
    r0: int = 0  # query rows of a "strip" call within each block
    r1: int = 0
    b: int = 0  # batch row (plain plans; units and blocks are then block numbers of that row)
    empty: torch.Tensor | None = None  # (G, 1, bs) query rows that see no key of the call (sliding window)


@dataclass
class _Plan:
    calls: list
    num_items: int
    per_head: bool
    plain: bool  # storage is q/k/v themselves, (batch, heads, R, bs, D); else gathered items
    covered: bool = False  # the first calls write every row: no need to pre-fill the output


def _plan(st: _Structure, rows, is_causal, q_heads, kv_heads, dim, window=None) -> _Plan:
    device = rows.device
    R = st.R
    I = st.item_blk.numel()
    lh = rows.shape[1]
    per_head = lh > 1
    if I == 0:
        return _Plan([], 0, per_head, False)
    r = torch.arange(R, device=device)
    if st.plain and is_causal and not per_head and window is None:
        # Prefill of one unpadded document per row: every row has the same R blocks.
        allowed = rows[:R, 0, :R] & (r[None, :] <= r[:, None])
        # Strips and runs work around the CPU kernel and allocator; CUDA keeps whole calls.
        cpu = device.type == "cpu"
        view_calls, left, band = _view_calls(allowed, st, _STRIP_ROWS if cpu else st.block_size)
        run = max(1, _VIEW_CHUNK // (q_heads * st.block_size * dim)) if cpu else R
        view_calls = _chunk_view_calls(view_calls, R, run)
        zeros = torch.zeros(R, dtype=torch.long, device=device)
        row_calls = view_calls + _gather_calls(left, zeros, r, st, 1, False, is_causal, kv_heads, dim, False)
        calls = [replace(c, b=b) for b in range(I // R) for c in row_calls]
        return _Plan(calls, I, False, True, covered=band > 0)
    item_b, item_r = st.item_blk // R, st.item_blk % R
    cand_blk = item_b[:, None] * R + r[None, :]
    cand = (st.blk_len[cand_blk] > 0) & (st.blk_doc[cand_blk] == st.blk_doc[st.item_blk][:, None])
    if is_causal:
        cand &= r[None, :] <= item_r[:, None]
    windowed = None
    if window is not None:
        # Sequence index of every row-block slot (-1: empty). A key block whose last token lies
        # window or more indices before the query block's first token is invisible to all of it.
        blk_index = torch.full(((st.null + 1) * st.block_size,), -1, dtype=torch.long, device=device)
        blk_index[st.k_blk * st.block_size + st.k_slot] = st.k_t
        blk_index = blk_index.view(st.null + 1, st.block_size)
        first = torch.where(blk_index >= 0, blk_index, torch.iinfo(torch.long).max).amin(1)
        cand &= blk_index.amax(1)[cand_blk] > first[st.item_blk][:, None] - window
        windowed = (window, blk_index)
    knum = st.blk_num[cand_blk]
    allowed = (cand[:, None, :] & rows.gather(2, knum[:, None, :].expand(I, lh, R))).reshape(I * lh, R)
    calls = _gather_calls(allowed, item_b, item_r, st, lh, per_head, is_causal, kv_heads, dim, True, windowed)
    return _Plan(calls, I, per_head, False)


def _view_calls(allowed, st: _Structure, strip_rows):
    """Zero-copy calls for the regular parts of an (R, R) causal block layout of one row: the band
    of full diagonals 0..w-1 (a dense causal head, then each block's own keys in strips of
    `strip_rows` query rows and the earlier band blocks as overlapping windows), full columns [0, g)
    below the band (one run of queries against fixed keys), and further full diagonals.
    Returns the calls, the (R, R) pairs left for gathered calls, and the band width w."""
    R = allowed.shape[0]
    left = allowed.clone()

    def full_diagonal(d):
        return d < R and bool(torch.diagonal(left, -d).all())

    calls = []
    band = 0
    while full_diagonal(band):
        band += 1
    if band:
        a = torch.arange(R, device=allowed.device)
        left &= (a[:, None] - a[None, :]) >= band
        head = band - 1 if band < R else R  # these blocks see all earlier ones: dense causal
        if head:
            calls.append(_Call("fixed", True, u0=0, u1=head, s=0, m=head, causal=True))
        if head < R:  # own block causal in strips of rows, then the earlier band blocks unmasked
            bs = st.block_size
            for r0 in range(0, bs, strip_rows):
                r1 = min(bs, r0 + strip_rows)
                bias = None if r0 == 0 else _causal_bias(r1 - r0, r1, diagonal=r0)
                calls.append(_Call("strip", True, bias, u0=head, u1=R, r0=r0, r1=r1, causal=r0 == 0))
            if band > 1:
                calls.append(_Call("window", False, u0=head, u1=R, off=1, m=band - 1))
    lo = max(band, 1)
    g = 0
    while g < R - lo and bool(left[g + lo:, g].all()):
        g += 1
    if g:
        left[g + lo - 1:, :g] = False
        calls.append(_Call("fixed", False, u0=g + lo - 1, u1=R, s=0, m=g))
    for d in range(lo, R):
        if full_diagonal(d):
            torch.diagonal(left, -d).fill_(False)
            calls.append(_Call("window", False, u0=d, u1=R, off=d, m=1))
    return calls, left, band


def _chunk_view_calls(calls, R, size):
    """The view calls cut into runs of at most `size` query blocks, run by run (calls keep their
    order within a run, so every block still meets its writing call first). A causal "fixed" call
    stays whole (its causality is aligned to its first block) and forms its own run."""
    whole = [c for c in calls if c.kind == "fixed" and c.causal]
    assert all(c.u0 == 0 for c in whole) and len(whole) <= 1
    start = whole[0].u1 if whole else 0
    runs = [(0, start)] if start else []
    runs += [(lo, min(R, lo + size)) for lo in range(start, R, size)]
    out = []
    for lo, hi in runs:
        for c in calls:
            if c.kind == "fixed" and c.causal:
                if (c.u0, c.u1) == (lo, hi):
                    out.append(c)
            elif max(c.u0, lo) < min(c.u1, hi):
                out.append(replace(c, u0=max(c.u0, lo), u1=min(c.u1, hi)))
    return out


def _causal_bias(rows, keys, diagonal):
    """(1, 1, rows, keys): query row i sees keys j <= i + diagonal."""
    return torch.full((rows, keys), float("-inf"), dtype=torch.float32).triu(diagonal + 1)[None, None]


def _gather_calls(allowed, item_b, item_r, st, lh, per_head, is_causal, kv_heads, dim, may_write, windowed=None):
    """Gathered calls for (I * lh, R) allowed row blocks: one call per group of units whose lists
    have the same length (and diagonal flag), so lists are dense; a list longer than the gather
    budget is cut into pieces merged by log-sum-exp. `windowed`: (sliding window, sequence index of
    every row-block slot), to mask the keys outside each query's window."""
    device = allowed.device
    bs, R = st.block_size, st.R
    unit_r = item_r.repeat_interleave(lh)
    counts = allowed.sum(-1)
    has_diag = allowed.gather(1, unit_r[:, None])[:, 0]
    key = counts * 2 + has_diag.long()
    order = torch.argsort(key, descending=True, stable=True)
    order = order[counts[order] > 0]
    if order.numel() == 0:
        return []
    lists = torch.argsort((~allowed[order]).to(torch.int8), dim=-1, stable=True)  # allowed r' first, ascending
    bounds = torch.cumsum(torch.unique_consecutive(key[order], return_counts=True)[1], 0).tolist()
    per_block = bs * dim * 2 * (1 if per_head else kv_heads)  # gathered K+V elements per block
    max_blocks = max(1, _GATHER_BUDGET // per_block)
    slots = torch.arange(bs, device=device)
    calls = []
    start = 0
    for end in bounds:
        m = int(counts[order[start]])
        diag = bool(has_diag[order[start]]) and is_causal
        piece = min(m, max_blocks)
        chunk = max(1, _GATHER_BUDGET // (piece * per_block))
        for lo in range(start, end, chunk):
            hi = min(end, lo + chunk)
            unit = order[lo:hi]
            item = unit // lh
            blocks = item_b[item][:, None] * R + lists[lo:hi, :m]
            for p0 in range(0, m, piece):
                part = blocks[:, p0:p0 + piece]
                bias = _bias(part, st, slots, diag and p0 + piece >= m)
                empty = None
                if windowed is not None:
                    bias, empty = _window_bias(bias, part, st.item_blk[item], *windowed)
                calls.append(_Call("gather", may_write and p0 == 0, bias, unit if per_head else item, part,
                                   empty=empty))
        start = end
    return calls


def _bias(blocks, st: _Structure, slots, causal_last: bool):
    """Additive mask for a gathered call, or None: causal inside the query's own (last) block, and
    -inf on the empty slots of short blocks (a short own block needs no mask: causality hides its
    empty trailing slots from every real query)."""
    g, m = blocks.shape
    bs = st.block_size
    valid = slots[None, None, :] < st.blk_len[blocks][:, :, None]  # (G, M, bs)
    if causal_last:
        valid[:, -1] = True
    bias = None
    if not bool(valid.all()):
        bias = torch.zeros(valid.shape, dtype=torch.float32, device=blocks.device)
        bias = bias.masked_fill(~valid, float("-inf")).view(g, 1, 1, m * bs)
    if causal_last:
        causal = _causal_bias(bs, m * bs, (m - 1) * bs).to(blocks.device)
        bias = causal if bias is None else bias + causal
    return bias


def _window_bias(bias, blocks, query_blocks, window, blk_index):
    """`bias` with the sliding window added: key slot j of the call hidden from query slot i unless
    index(j) > index(i) - window. Returns (bias (G, 1, bs, M * bs), bool (G, 1, bs) query rows that
    see no key of the call, whose log-sum-exp the caller sets to -inf)."""
    g, m = blocks.shape
    qi = blk_index[query_blocks]  # (G, bs)
    ki = blk_index[blocks].reshape(g, -1)  # (G, M * bs)
    hidden = ki[:, None, :] <= qi[:, :, None] - window
    window_bias = torch.zeros(hidden.shape, dtype=torch.float32, device=blocks.device).masked_fill_(
        hidden, float("-inf"))[:, None]
    bias = window_bias if bias is None else bias + window_bias
    return bias, (bias == float("-inf")).all(-1)


# ----------------------------------------------------------------------------------------------
# Storage: where a call's inputs come from and its results go.
#
# Every storage keeps rows so that an output row (..., D) and its log-sum-exp (...) line up.


class _Workspace:
    """Reused gather buffers: a fresh multi-megabyte allocation per call costs more in page faults
    than the copy itself on CPU."""

    def __init__(self):
        self.buffers = {}

    def take(self, name, src, dim, index, shape):
        size = list(src.shape)
        size[dim] = index.numel()
        numel = 1
        for n in size:
            numel *= n
        buf = self.buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != src.dtype:
            buf = self.buffers[name] = src.new_empty(max(numel, 1))
        out = buf[:numel].view(size)
        torch.index_select(src, dim, index, out=out)
        return out.view(shape)


class _PlainStorage:
    """Plain prefill: q, k, v themselves viewed as (batch, heads, R, bs, D) (padded to whole
    blocks when the length is not a multiple of bs). Rows of a call: (heads, n, bs, D)."""

    def __init__(self, st: _Structure, plan: _Plan, q_shape, k_shape):
        self.bs, self.R = st.block_size, st.R
        self.q_heads, self.kv_heads = q_shape[1], k_shape[1]

    def tokens(self, x):
        batch, heads, length, dim = x.shape
        pad = self.R * self.bs - length
        x = torch.nn.functional.pad(x, (0, 0, 0, pad)) if pad else x.contiguous()
        return x.view(batch, heads, self.R, self.bs, dim)

    keys = queries = tokens

    def accumulators(self, like, dtype, covered):
        make = torch.empty if covered else torch.zeros
        out = make(like.shape, dtype=dtype, device=like.device)
        # log-sum-exp (batch, heads, R, bs) stored heads-last, as the kernel returns it, so that
        # writes and merges run over matching memory (a strided log-sum-exp merge costs ~4x more)
        batch, heads, R, bs, _ = like.shape
        lse = torch.full((batch, R, bs, heads), float("-inf"), dtype=dtype, device=like.device)
        return out, lse.permute(0, 3, 1, 2)

    def result(self, x, shape, keys=False):
        batch, heads, length, dim = shape
        return x.view(batch, heads, self.R * self.bs, dim)[:, :, :length]

    def inputs(self, call: _Call, sources, ks, vs, ws: _Workspace):
        bs = self.bs
        kb, vb = ks[call.b], vs[call.b]  # (Hk, R, bs, D), contiguous
        heads, _, _, dim = kb.shape
        if call.kind == "window":
            n, start = call.u1 - call.u0, call.u0 - call.off - call.m + 1
            if start < 0 or start + n - 1 + call.m > self.R:  # blocks start .. u1 - 1 - off of this row
                raise IndexError(f"window call reads blocks {start}..{call.u1 - 1 - call.off} of {self.R}")
            size, stride = (n, heads, call.m * bs, dim), (bs * dim, kb.stride(0), dim, 1)
            kx = as_strided_within(kb, size, stride, kb.storage_offset() + start * bs * dim)
            vx = as_strided_within(vb, size, stride, vb.storage_offset() + start * bs * dim)
            return [x[call.b][:, call.u0:call.u1].transpose(0, 1) for x in sources], kx, vx
        if call.kind == "strip":
            kx, vx = (x[:, call.u0:call.u1, :call.r1].transpose(0, 1) for x in (kb, vb))
            return [self.view(call, x).transpose(0, 1) for x in sources], kx, vx
        if call.kind == "fixed":
            n = call.u1 - call.u0
            kx = kb[:, call.s:call.s + call.m].reshape(1, heads, call.m * bs, dim)
            vx = vb[:, call.s:call.s + call.m].reshape(1, heads, call.m * bs, dim)
            return [x[call.b][:, call.u0:call.u1].reshape(1, -1, n * bs, dim) for x in sources], kx, vx
        g, m = call.blocks.shape
        idx = call.blocks.reshape(-1)
        kx = ws.take("k", kb, 1, idx, (heads, g, m * bs, dim)).transpose(0, 1)
        vx = ws.take("v", vb, 1, idx, (heads, g, m * bs, dim)).transpose(0, 1)
        rows = [ws.take(f"q{i}", x[call.b], 1, call.units, (-1, g, bs, dim)).transpose(0, 1) for i, x in enumerate(sources)]
        return rows, kx, vx

    def rows(self, call: _Call, x, lse=None):
        """Kernel output (and lse) -> rows."""
        if call.kind == "fixed":
            n = call.u1 - call.u0
            return x[0].view(x.shape[1], n, self.bs, -1), None if lse is None else lse[0].view(-1, n, self.bs)
        return x.transpose(0, 1), None if lse is None else lse.transpose(0, 1)

    def lse_to_kernel(self, call: _Call, lse):
        rows = self.read(call, lse)
        if call.kind == "fixed":
            return rows.reshape(1, rows.shape[0], -1)
        return rows.transpose(0, 1).contiguous()

    @staticmethod
    def view(call: _Call, x):
        """The rows of a view call in x (..., R, bs[, D])."""
        rows = x[call.b][:, call.u0:call.u1]
        return rows[:, :, call.r0:call.r1] if call.kind == "strip" else rows

    def read(self, call: _Call, x):
        if call.kind == "gather":
            return x[call.b].index_select(1, call.units)
        return self.view(call, x)

    def write(self, call: _Call, x, rows):
        if call.kind == "gather":
            x[call.b].index_copy_(1, call.units, rows)
        else:
            self.view(call, x).copy_(rows)

    def add(self, call: _Call, x, rows):
        if call.kind == "gather":
            x[call.b].index_add_(1, call.units, rows)
        else:
            self.view(call, x).add_(rows)

    def add_keys(self, call: _Call, dkb, dk):
        bs, dkb = self.bs, dkb[call.b]
        if call.kind == "window":  # overlapping windows: fold block by block
            start, n = call.u0 - call.off - call.m + 1, call.u1 - call.u0
            for j in range(call.m):
                dkb[:, start + j:start + j + n] += dk[:, :, j * bs:(j + 1) * bs].transpose(0, 1)
        elif call.kind == "strip":
            dkb[:, call.u0:call.u1, :call.r1] += dk.transpose(0, 1)
        elif call.kind == "fixed":
            dkb[:, call.s:call.s + call.m] += dk[0].view(dk.shape[1], call.m, bs, -1)
        else:
            g, m = call.blocks.shape
            dkb.index_add_(1, call.blocks.reshape(-1), dk.transpose(0, 1).reshape(dk.shape[1], g * m, bs, -1))


class _ItemStorage:
    """General case: tokens regrouped into row blocks. Shared layout: query items (I, bs, Hq, D)
    and key blocks (B*R + 1, bs, Hk, D) (the last one all-zero, for padding); rows of a call are
    (G, bs, Hq, D), lse rows (G, bs, Hq). Per-head layout: one row per (item, head) and per
    (block, kv head): items (I*Hq, bs, D), key blocks ((B*R + 1)*Hk, bs, D)."""

    def __init__(self, st: _Structure, plan: _Plan, q_shape, k_shape):
        self.st, self.plan, self.bs = st, plan, st.block_size
        self.q_heads, self.kv_heads = q_shape[1], k_shape[1]
        self.q_index = (st.q_item * self.bs + st.q_slot, st.q_b * q_shape[2] + st.q_t)
        self.k_index = (st.k_blk * self.bs + st.k_slot, st.k_b * k_shape[2] + st.k_t)

    def _scatter(self, x, index, num_rows):
        batch, heads, length, dim = x.shape
        slots_of, tokens_of = index
        tok = x.transpose(1, 2).reshape(batch * length, heads, dim).index_select(0, tokens_of)
        out = x.new_zeros(num_rows * self.bs, heads, dim)
        out.index_copy_(0, slots_of, tok)
        out = out.view(num_rows, self.bs, heads, dim)
        if self.plan.per_head:
            out = out.transpose(1, 2).reshape(num_rows * heads, self.bs, dim)
        return out

    def queries(self, x):
        return self._scatter(x, self.q_index, self.plan.num_items)

    def keys(self, x):
        return self._scatter(x, self.k_index, self.st.null + 1)

    def accumulators(self, like, dtype, covered):
        out = torch.zeros(like.shape, dtype=dtype, device=like.device)
        lse = torch.full(like.shape[:-1], float("-inf"), dtype=dtype, device=like.device)
        return out, lse

    def result(self, xi, shape, keys=False):
        """Blocked rows back to a (B, H, L, D) tensor, zeros where no token maps."""
        batch, heads, length, dim = shape
        slots_of, tokens_of = self.k_index if keys else self.q_index
        if self.plan.per_head:
            xi = xi.view(-1, heads, self.bs, dim).transpose(1, 2)
        rows = xi.reshape(-1, heads, dim).index_select(0, slots_of)
        out = xi.new_zeros(batch * length, heads, dim)
        out.index_copy_(0, tokens_of, rows)
        return out.view(batch, length, heads, dim).transpose(1, 2)

    def inputs(self, call: _Call, sources, kb, vb, ws: _Workspace):
        g, m = call.blocks.shape
        q_heads, kv_heads = self.q_heads, self.kv_heads
        if self.plan.per_head:
            bs, dim = kb.shape[1], kb.shape[2]
            kv_head = (call.units % q_heads) // (q_heads // kv_heads)
            idx = (call.blocks * kv_heads + kv_head[:, None]).reshape(-1)
            kx = ws.take("k", kb, 0, idx, (g, 1, m * bs, dim))
            vx = ws.take("v", vb, 0, idx, (g, 1, m * bs, dim))
            return [ws.take(f"q{i}", x, 0, call.units, (g, 1, bs, dim)) for i, x in enumerate(sources)], kx, vx
        bs, dim = kb.shape[1], kb.shape[3]
        idx = call.blocks.reshape(-1)
        kx = ws.take("k", kb, 0, idx, (g, m * bs, kv_heads, dim)).transpose(1, 2)
        vx = ws.take("v", vb, 0, idx, (g, m * bs, kv_heads, dim)).transpose(1, 2)
        rows = [ws.take(f"q{i}", x, 0, call.units, (g, bs, q_heads, dim)).transpose(1, 2) for i, x in enumerate(sources)]
        return rows, kx, vx

    def rows(self, call: _Call, x, lse=None):
        if self.plan.per_head:
            return x[:, 0], None if lse is None else lse[:, 0]
        return x.transpose(1, 2), None if lse is None else lse.transpose(1, 2)

    def lse_to_kernel(self, call: _Call, lse):
        rows = lse.index_select(0, call.units)
        return (rows[:, None] if self.plan.per_head else rows.transpose(1, 2)).contiguous()

    def read(self, call: _Call, x):
        return x.index_select(0, call.units)

    def write(self, call: _Call, x, rows):
        x.index_copy_(0, call.units, rows)

    def add(self, call: _Call, x, rows):
        x.index_add_(0, call.units, rows)

    def add_keys(self, call: _Call, dkb, dk):
        g, m = call.blocks.shape
        if self.plan.per_head:
            q_heads, kv_heads = self.q_heads, self.kv_heads
            kv_head = (call.units % q_heads) // (q_heads // kv_heads)
            dkb.index_add_(0, (call.blocks * kv_heads + kv_head[:, None]).reshape(-1), dk.reshape(g * m, self.bs, -1))
        else:
            dkb.index_add_(0, call.blocks.reshape(-1), dk.transpose(1, 2).reshape(g * m, self.bs, self.kv_heads, -1))


# ----------------------------------------------------------------------------------------------
# The kernel


class _BlockSparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, st: _Structure, plan: _Plan, scale: float):
        store = (_PlainStorage if plan.plain else _ItemStorage)(st, plan, q.shape, k.shape)
        acc = merge_dtype(q.dtype)
        qs, ks, vs = store.queries(q), store.keys(k), store.keys(v)
        out_acc, lse_acc = store.accumulators(qs, acc, plan.covered)
        ws = _Workspace()
        for call in plan.calls:
            (qx,), kx, vx = store.inputs(call, [qs], ks, vs, ws)
            bias = None if call.bias is None else call.bias.to(device=q.device, dtype=q.dtype)
            out, lse = attention_forward(qx, kx, vx, is_causal=call.causal, scale=scale, attn_bias=bias)
            if call.empty is not None:  # the kernel reports lse 0 for a row with no key
                lse = lse.masked_fill(call.empty.to(lse.device), float("-inf"))
            out, lse = store.rows(call, out, lse)
            out, lse = out.to(acc), lse.to(acc)
            if call.first:
                store.write(call, out_acc, out)
                store.write(call, lse_acc, lse)
            elif call.kind == "gather":  # these rows already hold other keys' partial result
                prev_out, prev_lse = store.read(call, out_acc), store.read(call, lse_acc)
                merge_into(prev_out, prev_lse, out, lse)
                store.write(call, out_acc, prev_out)
                store.write(call, lse_acc, prev_lse)
            else:  # a view of the accumulators: merge in place
                merge_into(store.read(call, out_acc), store.read(call, lse_acc), out, lse)
            del out, lse  # free before the next call allocates, so the allocator reuses the memory
        out_rows = out_acc.to(q.dtype)
        ctx.save_for_backward(qs, ks, vs, out_rows, lse_acc)
        ctx.st, ctx.plan, ctx.scale, ctx.shapes = st, plan, scale, (q.shape, k.shape)
        return store.result(out_rows, q.shape)

    @staticmethod
    def backward(ctx, dout):
        qs, ks, vs, out_rows, lse_acc = ctx.saved_tensors
        st, plan, scale = ctx.st, ctx.plan, ctx.scale
        q_shape, k_shape = ctx.shapes
        store = (_PlainStorage if plan.plain else _ItemStorage)(st, plan, q_shape, k_shape)
        acc = merge_dtype(qs.dtype)
        dout_rows = store.queries(dout.to(qs.dtype))
        # A row that saw no key (lse -inf) gets probability exp(s - inf) = 0 in every call.
        lse_bwd = torch.where(torch.isfinite(lse_acc), lse_acc, torch.full_like(lse_acc, float("inf")))
        lse_bwd = lse_bwd.to(torch.float64 if qs.dtype == torch.float64 else torch.float32)
        dqs = torch.zeros(qs.shape, dtype=acc, device=qs.device)
        dks = torch.zeros(ks.shape, dtype=acc, device=qs.device)
        dvs = torch.zeros(ks.shape, dtype=acc, device=qs.device)
        ws = _Workspace()
        for call in plan.calls:
            (qx, ox, dox), kx, vx = store.inputs(call, [qs, out_rows, dout_rows], ks, vs, ws)
            bias = None if call.bias is None else call.bias.to(device=qs.device, dtype=qs.dtype)
            dq, dk, dv = attention_backward(
                dox, qx, kx, vx, ox, store.lse_to_kernel(call, lse_bwd), is_causal=call.causal, scale=scale,
                attn_bias=bias,
            )
            store.add(call, dqs, store.rows(call, dq)[0].to(acc))
            store.add_keys(call, dks, dk.to(acc))
            store.add_keys(call, dvs, dv.to(acc))
        return (
            store.result(dqs.to(qs.dtype), q_shape),
            store.result(dks.to(qs.dtype), k_shape, keys=True),
            store.result(dvs.to(qs.dtype), k_shape, keys=True),
            None, None, None,
        )
