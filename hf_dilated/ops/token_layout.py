"""Token positions, padding and documents: the one place these rules are written
(docs/contract.md 3). Every kernel, single-process and distributed, and the transformers glue read
them from here.

The kernels' rule (`token_layout`, `documents`):
- a token's position is `position_ids` when given, else its rank among its row's real tokens
  (`cumsum(attention_mask) - 1`), else its index;
- a key whose mask is 0 is never visible;
- a new document starts at a real token whose position does not continue the previous *real*
  token's: continuing is the next position (+1, as mask ranks give) or the one its index implies
  (+ the index distance, as positions that count the padded slots give). A padded slot neither
  starts nor breaks a document, so a hole in the mask hides one key and changes nothing else.

transformers' rule (`from_model_inputs`), which maps what a model passes onto the kernels' rule so
that every name sees exactly the keys `sdpa` sees:
- with an attention mask (even an all-ones one) a row is one document, positions are mask ranks,
  and `position_ids` only feed RoPE; a mask longer than the keys means a sliding-window cache kept
  only the last keys: they take the mask's last entries and continue its ranks;
- without one, `position_ids` define the documents (packed sequences), as transformers'
  `find_packed_sequence_indices` does, but only where transformers itself detected packing: with
  a KV cache it does not, and the row stays one document.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


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


def token_layout(batch: int, kv_len: int, device, attention_mask=None, position_ids=None) -> TokenLayout:
    """The kernels' rule (module docstring) for one call's keys."""
    if attention_mask is not None:
        real = attention_mask.to(device=device, dtype=torch.bool).expand(batch, kv_len)
    else:
        real = torch.ones(batch, kv_len, dtype=torch.bool, device=device)
    if position_ids is not None:
        positions = position_ids.to(device=device, dtype=torch.long).expand(batch, kv_len)
    elif attention_mask is not None:
        positions = real.long().cumsum(-1) - 1
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


def from_model_inputs(mask, position_ids, *, batch: int, q_len: int, kv_len: int, device,
                      cu_seq_lens=None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """transformers' rule (module docstring): (attention_mask, position_ids) for a kernel, from
    what a model hands its attention function.

    mask: what hf_dilated's mask function returned (integrations/transformers.py): a bool
        (batch, seen) mask when the model was given an attention mask or transformers saw no
        packing (the row is one document; seen > kv_len when a sliding-window cache dropped the
        first seen - kv_len keys), an int64 tensor of document ids when transformers detected
        packed sequences, or None (no mask, no packing).
    position_ids: (batch or 1, q_len) or None, the queries' positions (only read without a mask).
    cu_seq_lens: flash-attention style sequence boundaries (1-D, cumulative), for packed batches
        that carry no position_ids.
    """
    if mask is not None and mask.dtype == torch.bool:
        if mask.shape[-1] > kv_len:  # sliding-window cache: the keys are the last kv_len tokens seen
            ranks = mask.long().cumsum(-1) - 1
            return mask[:, -kv_len:], ranks[:, -kv_len:]
        return mask, None
    if position_ids is not None:
        if position_ids.dim() != 2 or position_ids.shape[-1] != q_len or position_ids.shape[0] not in (1, batch):
            raise ValueError(f"position_ids must have shape (batch, q_len={q_len}), got {tuple(position_ids.shape)}")
        position_ids = position_ids.to(device).expand(batch, q_len)
    if mask is not None:  # packed sequences, as transformers detected them from position_ids
        if position_ids is None or q_len != kv_len:
            raise ValueError("packed sequences need position_ids covering the whole key sequence")
        return None, position_ids
    if cu_seq_lens is not None and q_len == kv_len:
        return None, _positions_from_boundaries(cu_seq_lens, batch, kv_len, device)
    if position_ids is None or q_len != kv_len:
        return None, None  # one document; with a cache the keys are 0..kv_len-1
    steps = position_ids[:, 1:] - position_ids[:, :-1]
    if bool((steps == 1).all()):
        return None, position_ids  # one document at the given positions
    # transformers saw no packing (it skips the check with a KV cache): one document, like sdpa.
    return None, None


def _positions_from_boundaries(cu_seq_lens, batch, kv_len, device) -> torch.Tensor:
    cu = cu_seq_lens.to(device=device, dtype=torch.long).reshape(-1)
    if batch != 1 or cu.numel() < 2 or int(cu[0]) != 0 or int(cu[-1]) != kv_len or bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(
            f"cu_seq_lens_q must be the cumulative lengths 0 <= ... <= {kv_len} of the packed sequences of one "
            f"row of {kv_len} tokens, got {cu.tolist()[:8]} for batch {batch}"
        )
    index = torch.arange(kv_len, device=device)
    starts = cu[:-1][torch.searchsorted(cu[1:], index, right=True)]
    return (index - starts).unsqueeze(0)
