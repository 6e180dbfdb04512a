"""The kernels' rule for token positions, padding and documents (docs/contract.md 3.1), written
once: `token_layout` is the one function every kernel builds its view of the tokens with (the
single-process ones on their keys, the ring kernels (distributed/tokens.py) on the whole sequence
gathered from the ranks), and `visible_pairs` the base visibility every pattern narrows.

- a token's position is `position_ids` when given, else its rank among its row's real tokens
  (`cumsum(attention_mask) - 1`), else its index;
- a key whose mask is 0 is never visible;
- a new document starts at a real token whose position does not continue the previous *real*
  token's: continuing is the next position (+1, as mask ranks give) or the one its index implies
  (+ the index distance, as positions that count the padded slots give). A padded slot neither
  starts nor breaks a document, so a hole in the mask hides one key and changes nothing else.

transformers' rule (docs/contract.md 3.2: caches, sliding-window caches, packed-sequence
detection, cu_seq_lens), which maps what a model passes onto this one, is not written here but in
hf_dilated/integrations/model_inputs.py, next to the mask function: nothing in ops/ knows
transformers' conventions.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .plan_cache import PlanCache


@dataclass
class TokenLayout:
    positions: torch.Tensor  # (batch, kv_len) int64
    real: torch.Tensor  # (batch, kv_len) bool: not padding
    doc: torch.Tensor  # (batch, kv_len) int64: document index within the row, from 0
    plain: bool  # no padding, one document per row, positions 0..kv_len-1


def documents(positions: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """(batch, n) document index of every token, from 0, by the rule of the module docstring. A
    padded slot takes the document of the real token before it (0 before the first), which no
    rule ever reads."""
    n = positions.shape[-1]
    index = torch.arange(n, device=positions.device)
    last_real = torch.where(real, index, -1).cummax(-1).values  # last real index at or before i
    prev_real = torch.nn.functional.pad(last_real[:, :-1], (1, 0), value=-1)  # ... strictly before i
    prev_pos = positions.gather(-1, prev_real.clamp(min=0))
    step = positions - prev_pos
    starts = real & ((prev_real < 0) | ((step != 1) & (step != index - prev_real)))
    return (starts.long().cumsum(-1) - 1).clamp(min=0)


def mask_ranks(real: torch.Tensor) -> torch.Tensor:
    """The kernels' positions without position_ids (module docstring): each token's rank among the
    real tokens of its row, counting from 0 (a padding slot gets the rank of the real token before
    it, -1 before the first). The one place this rule is written."""
    return real.long().cumsum(-1) - 1


# Layouts by the identity of the mask and position tensors (plan_cache.py): every layer of a model,
# and every part of one call (the far projections, the band, the levels), reads the same ones, and
# building one reads values back to the host (`plain`).
_LAYOUTS = PlanCache(size=8)


def token_layout(batch: int, kv_len: int, device, attention_mask=None, position_ids=None) -> TokenLayout:
    """The kernels' rule (module docstring) for rows of kv_len tokens: one call's keys, or the
    whole sequence of a ring kernel (distributed/tokens.py, on the masks and positions it gathered)."""
    if attention_mask is None and position_ids is None:  # one document per row at its indices
        index = torch.arange(kv_len, device=device).expand(batch, kv_len)
        return TokenLayout(positions=index, real=torch.ones(batch, kv_len, dtype=torch.bool, device=device),
                           doc=torch.zeros(batch, kv_len, dtype=torch.long, device=device), plain=True)
    key = (batch, kv_len, str(device))
    layout = _LAYOUTS.get(key, attention_mask, position_ids)
    if layout is None:
        layout = _token_layout(batch, kv_len, device, attention_mask, position_ids)
        _LAYOUTS.put(key, attention_mask, position_ids, layout)
    return layout


def _token_layout(batch, kv_len, device, attention_mask, position_ids) -> TokenLayout:
    if attention_mask is not None:
        real = attention_mask.to(device=device, dtype=torch.bool).expand(batch, kv_len)
    else:
        real = torch.ones(batch, kv_len, dtype=torch.bool, device=device)
    if position_ids is not None:
        positions = position_ids.to(device=device, dtype=torch.long).expand(batch, kv_len)
    elif attention_mask is not None:
        positions = mask_ranks(real)
    else:
        positions = torch.arange(kv_len, device=device).expand(batch, kv_len)
    doc = documents(positions, real)
    plain = bool(real.all()) and bool((positions == torch.arange(kv_len, device=device)).all())
    return TokenLayout(positions=positions, real=real, doc=doc, plain=plain)


def ranks_in_document(layout: TokenLayout) -> torch.Tensor:
    """(batch, kv_len) each token's rank among the real tokens of its document: positions that
    keep the documents and the visibility of `layout` and fit in 0..kv_len-1 (dense attention
    needs nothing else of a position)."""
    real = layout.real.long()
    before = real.cumsum(-1) - real  # real tokens before each token in its row
    none = torch.iinfo(torch.long).max
    first = torch.full_like(before, none).scatter_reduce(  # `before` at each document's first real token
        -1, layout.doc, torch.where(layout.real, before, none), "amin")
    return (before - first.gather(-1, layout.doc)).clamp(min=0)


def first_key_within(layout: TokenLayout, index: int, reach: int, window: int | None = None) -> int:
    """The first key index that can lie within `reach` - 1 positions of the query at `index` (or
    of any later query), over every row. Within a document positions advance by at least one per
    real token, so such a key is among the last `reach` - 1 *real* tokens before `index`: with holes
    in the mask it can lie more than `reach` - 1 indices back. A sliding `window` (counted in
    indices, docs/contract.md 3.3) also hides keys more than `window` - 1 indices back."""
    if index <= 0:
        return 0
    real = layout.real.long()
    before = real.cumsum(1) - real  # real tokens before each index
    need = (before[:, index] - (reach - 1)).clamp(min=0)  # per row: real tokens before the first key
    lo = int(torch.searchsorted(before.contiguous(), need[:, None].contiguous()).min())
    if window is not None:
        lo = max(lo, index - (window - 1))
    return lo


def regular_rows(batch: int, kv_len: int, device, attention_mask=None, position_ids=None):
    """(first, shift) when every row's real tokens are one run to the end of the row at consecutive
    positions: row b's real tokens are indices first[b] .. kv_len - 1, one document, the token at
    index j at position j + shift[b] (what an unpadded or left-padded cache gives). Lists of ints;
    None when some row is not regular (holes, packing, right padding). With neither mask nor
    positions this decides from the shapes alone, reading no tensor."""
    if attention_mask is None and position_ids is None:
        return [0] * batch, [0] * batch
    # every layer of a decode step passes the same mask and positions: only the first reads them back
    key = ("rows", batch, kv_len, str(device))
    held = _LAYOUTS.get(key, attention_mask, position_ids)
    if held is None:
        held = (_regular_rows(batch, kv_len, device, attention_mask, position_ids),)  # (None too: not regular)
        _LAYOUTS.put(key, attention_mask, position_ids, held)
    rows = held[0]
    return None if rows is None else (list(rows[0]), list(rows[1]))


def _regular_rows(batch: int, kv_len: int, device, attention_mask, position_ids):
    index = torch.arange(kv_len, device=device)
    if attention_mask is not None:
        real = attention_mask.to(device=device, dtype=torch.bool).expand(batch, kv_len)
        count = real.sum(-1)
        first = kv_len - count
        # one run to the end: exactly the last `count` tokens are real
        if not bool((real == (index >= first[:, None])).all()):
            return None
    else:
        first = torch.zeros(batch, dtype=torch.long, device=device)
    if position_ids is None:
        shift = -first
    else:
        positions = position_ids.to(device=device, dtype=torch.long).expand(batch, kv_len)
        offset = positions - index
        shift = offset.gather(1, first.clamp(max=kv_len - 1)[:, None]).squeeze(1)
        if not bool(((offset == shift[:, None]) | (index < first[:, None])).all()):
            return None
    first, shift = torch.stack([first, shift]).tolist()  # (one read back)
    return first, shift


def plain_documents(batch: int, kv_len: int, device, attention_mask=None, position_ids=None):
    """Per row, the (start, end) index ranges of its documents where each is a plain row of its own
    (real tokens at positions 0, 1, ... one after the other): rows of documents packed end to end
    (position_ids restarting at 0, no mask), or rows whose real tokens are one run, left or right
    padded (a mask, its ranks the positions; an empty list: a row of padding). None for any other
    layout. One read back, once per mask or position tensor: every layer passes the same one."""
    if (attention_mask is None) == (position_ids is None):
        return None
    key = ("documents", batch, kv_len, str(device))
    held = _LAYOUTS.get(key, attention_mask, position_ids)
    if held is None:
        held = (_plain_documents(batch, kv_len, device, attention_mask, position_ids),)
        _LAYOUTS.put(key, attention_mask, position_ids, held)
    return held[0]


def _plain_documents(batch, kv_len, device, attention_mask, position_ids):
    index = torch.arange(kv_len, device=device)
    if attention_mask is not None:  # one run of real tokens per row, at its mask ranks 0, 1, ...
        real = attention_mask.to(device=device, dtype=torch.bool).expand(batch, kv_len)
        count = real.sum(-1)
        first = torch.where(real, index, kv_len).amin(-1)
        run = (real == ((index >= first[:, None]) & (index < (first + count)[:, None]))).all()
        facts = torch.cat([run.long()[None], first, count]).tolist()  # (one read back)
        if not facts[0]:
            return None
        return [[(f, f + c)] if c else [] for f, c in zip(facts[1:1 + batch], facts[1 + batch:])]
    positions = position_ids.to(device=device, dtype=torch.long).expand(batch, kv_len)
    restarts = positions[:, 1:] == 0
    packed = (positions[:, 0] == 0).all() & ((positions[:, 1:] == positions[:, :-1] + 1) | restarts).all()
    flat = torch.nn.functional.pad(restarts, (1, 0), value=True).flatten().nonzero().flatten()
    facts = torch.cat([packed.long()[None], flat]).tolist()  # (one read back, after nonzero's count)
    if not facts[0]:
        return None
    starts = [[] for _ in range(batch)]
    for at in facts[1:]:
        starts[at // kv_len].append(at % kv_len)
    return [list(zip(row, row[1:] + [kv_len])) for row in starts]


def take(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """values (batch, n) at the indices `index`, (m,) or per head (batch, heads, m): (batch, 1 or heads, m)."""
    if index.dim() == 1:
        return values[:, None, index]
    b, h, m = values.shape[0], index.shape[1], index.shape[2]
    return values[:, None].expand(b, h, values.shape[1]).gather(2, index.expand(b, h, m))


def visible_pairs(layout: TokenLayout, q_index, k_index, *, causal: bool = True,
                  sliding_window: int | None = None) -> torch.Tensor:
    """The kernels' base rule (docs/contract.md 3), which every pattern narrows: bool (batch, 1 or
    heads, len(q_index), len(k_index)), whether query q_index[i] may see key k_index[j]: the key
    is real, in the query's document, not after it (`causal`) and, with a `sliding_window` W,
    fewer than W indices before it. Indices into the layout's (batch, n) tensors: (m,), or per head
    (batch, heads, m). The local band (local_band.py) and the ring kernels (distributed/) build
    their masks on it."""
    q3 = q_index if q_index.dim() == 3 else q_index[None, None]
    k3 = k_index if k_index.dim() == 3 else k_index[None, None]
    visible = take(layout.real, k_index)[..., None, :] & (take(layout.doc, q_index)[..., :, None]
                                                           == take(layout.doc, k_index)[..., None, :])
    if causal:
        visible = visible & (k3[..., None, :] <= q3[..., :, None])
    if sliding_window is not None:
        visible = visible & (k3[..., None, :] > q3[..., :, None] - sliding_window)
    return visible
