"""transformers' rule (docs/contract.md 3.2): how what a model hands its attention function (a
mask, `position_ids`, `cu_seq_lens_q`, a cache's keys) maps onto the kernels' rule of
ops/token_layout.py (3.1), so that every registered name sees exactly the keys `sdpa` sees. All of
transformers' conventions live here, next to the mask function that reads its decisions; ops/
knows none of them.

Masks stay O(N). The mask function (`padding_mask`) never builds a (q_len x kv_len) mask: it tells
the attention which of transformers' cases it is in, and `from_model_inputs` reads that:
- a bool (batch, seen) padding mask when the model was given an attention mask (even an all-ones
  one) or when transformers saw no packed sequences: each row is then one document, positions are
  mask ranks, and `position_ids` only feed RoPE. A mask longer than the keys means a
  sliding-window cache kept only the last keys: they take the mask's last entries and continue
  its ranks; a mask shorter than the keys means a static cache's empty slots, which are dropped;
- an int64 (batch, q_len) tensor, 1 at each document's first token, when transformers detected
  packed sequences from
  `position_ids` (it only does so without a mask and without a KV cache: then its own mask
  function separates the documents, which is how we read its decision); the kernels then read the
  documents off those `position_ids`;
- None when there is neither;
- for a decode step against a static cache (whose layers hand a tensor `q_offset`, so that compiled
  steps do not recompile): a fixed-shape (batch, 1, 1, kv_length) int8 tensor of slot states, 1 a
  real token, 0 padding, -1 a slot not written yet (`static_slots`). Being 4-D, it passes through
  transformers' mask preparation untouched, so a compiled forward receives it as built outside;
  eager calls read it back as the (batch, seen) mask, compiled ones run the kind's static decode.
Without a registered mask function transformers would pass `attention_mask=None` to a custom
attention, silently dropping padding.
"""
from __future__ import annotations

import torch

from ..config import DECODE_MAX_QUERIES
from ..ops.plan_cache import PlanCache
from ..ops.rope import RopeOffset
from ..ops.token_layout import mask_ranks


# --- the mask function ------------------------------------------------------------------------


def padding_mask(batch_size, kv_length, kv_offset=0, mask_function=None, attention_mask=None, q_length=None,
                 q_offset=None, use_vmap=False, device=None, **kwargs):
    """AttentionMaskInterface entry: what the attention needs to know of the mask (module docstring).

    The mask always covers the tokens seen so far, from the row's first. Two caches hand the
    attention a different number of keys, which it reads off the key length:
    - a static cache hands a `kv_length` larger than the tokens seen: the attention drops the
      empty cache slots beyond them;
    - a sliding-window cache keeps only the last keys (`kv_offset` > 0): the attention takes the
      mask's last `kv_length` entries, and the ranks of the tokens before them as the keys'
      first position.
    """
    if use_vmap:
        raise NotImplementedError(
            "hf_dilated attention cannot honour an or_mask_function/and_mask_function overlay (e.g. "
            "bidirectional image-token masks); only causal attention with padding and packed documents"
        )
    kv_offset = int(kv_offset or 0)
    if kv_offset == 0 and _static_layer(q_offset, q_length, kv_length):
        if attention_mask is not None and attention_mask.shape[-1] > kv_length:
            raise ValueError(f"attention_mask covers {attention_mask.shape[-1]} tokens but the keys hold {kv_length}")
        return static_slots(attention_mask, batch_size, kv_length, q_offset + int(q_length), device)
    if attention_mask is not None:
        if attention_mask.shape[-1] > kv_offset + kv_length:
            raise ValueError(f"attention_mask covers {attention_mask.shape[-1]} tokens but the keys hold "
                             f"{kv_offset + kv_length}")
        return attention_mask.to(torch.bool)
    q_offset, q_length = int(q_offset or 0), int(q_length)
    # transformers clears allow_is_causal_skip wherever it lays its packed-sequence overlay on the mask
    # function (masking_utils, every version we support): while it is set there is nothing to find,
    # and the check (a read back: a stall on a GPU) is skipped.
    may_be_packed = not kwargs.get("allow_is_causal_skip", False)
    if q_offset == 0 and q_length > 1 and mask_function is not None and may_be_packed:
        starts = _document_starts(mask_function, batch_size, q_length, device)
        if starts is not None:
            return starts
    seen = q_offset + q_length
    # One document per row: None, unless a static cache holds empty slots beyond the tokens seen
    # or a sliding-window cache dropped the first ones.
    return None if seen == kv_length else torch.ones(batch_size, seen, dtype=torch.bool, device=device)


def _static_layer(q_offset, q_length, kv_length) -> bool:
    """Whether a call with kv_offset 0 gets slot states (`static_slots`). A static cache's
    full-attention layers hand a tensor `q_offset`; a static sliding-window layer whose window has
    not filled hands an int one and its cache size as `kv_length` (only a static layer has slots
    beyond the tokens seen), so generate() builds the states outside the compiled step. Inside a
    compiled step a few queries always get them (the step that fills such a layer's last slot
    arrives here with a 2-D mask): the compiled attention runs on slot states only."""
    if isinstance(q_offset, torch.Tensor):
        return True
    if q_offset is None or q_length is None:
        return False
    seen = int(q_offset) + int(q_length)
    # (q_offset > 0: a step after a prefill; a forward without a cache is no cache's step)
    return seen < kv_length or (torch.compiler.is_compiling() and seen == kv_length and int(q_offset) > 0
                                and int(q_length) <= DECODE_MAX_QUERIES)


def static_slots(attention_mask, batch: int, kv_length: int, seen, device) -> torch.Tensor:
    """The slot states of a static cache (module docstring): (batch, 1, 1, kv_length) int8, with
    shapes that depend on the cache alone. `seen` may be a 0-d tensor."""
    written = torch.arange(kv_length, device=device) < seen
    if attention_mask is None:
        real = written.expand(batch, kv_length)
    else:
        mask = attention_mask.to(device=device, dtype=torch.bool)
        real = torch.nn.functional.pad(mask, (0, kv_length - mask.shape[-1]), value=False) & written
    return torch.where(written, real.to(torch.int8), -1)[:, None, None, :]


def is_static_slots(mask) -> bool:
    return isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.dtype == torch.int8


def read_static_slots(slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(real (batch, kv_length) bool, seen: 0-d tensor, the written slots) of `static_slots`."""
    states = slots[:, 0, 0, :]
    return states == 1, (states[0] >= 0).sum()


def _document_starts(mask_function, batch, n, device):
    """int64 (batch, n), 1 at each document's first token, when transformers' mask function
    separates neighbouring tokens (its packed-sequence overlay), else None. Evaluates it on the
    n - 1 neighbouring pairs only."""
    b = torch.arange(batch, device=device)[:, None]
    i = torch.arange(1, n, device=device)[None, :]
    sees_previous = torch.as_tensor(mask_function(b, torch.zeros((), dtype=torch.long, device=device), i, i - 1))
    if bool(sees_previous.all()):
        return None
    return torch.nn.functional.pad(~sees_previous.expand(batch, n - 1), (1, 0), value=True).long()


# --- reading it in the attention ----------------------------------------------------------

# The kernel inputs derived from one model call's mask and positions, by tensor identity: every
# layer passes the same tensors, so every layer reuses them, and the kernels' plan caches hit.
_INPUTS = PlanCache(size=8)


def kernel_inputs(query, key, value, attention_mask, position_ids, *, sequence_parallel=False, cu_seq_lens=None,
                  cu_seq_lens_k=None, rope=False):
    """(key, value, attention_mask, position_ids, rope_offset) for a kernel from what transformers
    passes. rope_offset, a RopeOffset of rope_offsets' or None: asked for with rope=True (the kernel
    moves q and k on from where the model rotated them: far keys at grouped positions).
    cu_seq_lens_k must equal cu_seq_lens (the queries'): checked once per pair of tensors, not in
    every layer (the collator makes two tensors; comparing them reads back from the device)."""
    batch, q_len = query.shape[0], query.shape[2]
    if is_static_slots(attention_mask):  # an eager step on a static cache: its written slots, as a 2-D mask
        real, seen = read_static_slots(attention_mask)
        seen = int(seen)
        attention_mask, key, value = real[:, :seen], key[:, :, :seen], value[:, :, :seen]
    if attention_mask is not None:
        if attention_mask.dim() != 2:
            raise ValueError(
                "hf_dilated attention takes the 2-D padding mask (batch, kv_len); got a "
                f"{attention_mask.dim()}-D mask of shape {tuple(attention_mask.shape)}: custom dense masks "
                "cannot be honoured (pass a 2-D attention_mask and position_ids instead)"
            )
        seen = attention_mask.shape[-1]
        if attention_mask.dtype == torch.bool and seen < key.shape[2]:  # static cache: drop unwritten slots
            if seen < q_len:
                raise ValueError(f"attention_mask covers {seen} tokens, fewer than the {q_len} queries")
            key, value = key[:, :, :seen], value[:, :, :seen]
    if sequence_parallel:  # local shards: the distributed kernels derive the global layout
        if cu_seq_lens is not None or cu_seq_lens_k is not None:
            raise ValueError(
                "cu_seq_lens_q/cu_seq_lens_k: under a sequence-parallel group of several processes the documents "
                "come from position_ids (each shard's global positions, restarting at 0 per document: "
                "hf_dilated.distributed.shard_batch); boundaries of a whole row are not split across the ranks. "
                "Pass position_ids instead (DataCollatorWithFlattening(return_flash_attn_kwargs=False))")
        if attention_mask is not None and attention_mask.dtype == torch.bool:
            return key, value, attention_mask, None, None
        return key, value, None, position_ids, None
    kv_len = key.shape[2]
    cache_key = (batch, q_len, kv_len, str(key.device), rope)
    cached = _INPUTS.get(cache_key, attention_mask, position_ids, cu_seq_lens, cu_seq_lens_k)
    if cached is None:
        _check_same_boundaries(cu_seq_lens, cu_seq_lens_k)
        mask, positions, rotated = from_model_inputs(attention_mask, position_ids, batch=batch, q_len=q_len,
                                                     kv_len=kv_len, device=key.device, cu_seq_lens=cu_seq_lens)
        offset = rope_offsets(position_ids, mask, positions, rotated, batch=batch, q_len=q_len, kv_len=kv_len,
                              device=key.device) if rope else None
        if mask is not None or offset is not None:  # one read back for every fact
            facts = [(mask.all() if mask is not None else torch.zeros((), device=key.device))[None].long()]
            if offset is not None:
                facts += [offset.ne(0).any()[None].long(), offset[:, -1]]
            facts = torch.cat(facts).tolist()
            if facts[0]:
                mask = None  # an all-ones mask says "one document per row": so does no mask, more cheaply
            if offset is not None:
                offset = RopeOffset(offset, facts[2:]) if facts[1] else None  # None: generate()'s position_ids
        cached = (mask, positions, offset)
        _INPUTS.put(cache_key, attention_mask, position_ids, cu_seq_lens, cu_seq_lens_k, cached)
    return key, value, *cached


def static_rope_shift(position_ids, real, seen, batch: int) -> torch.Tensor | None:
    """rope_offsets' per-row offset for a compiled step on a static cache, on the device, read from
    nothing on the host: how much further than its mask rank the model rotated each row's last
    query (its position_ids against its rank among the written real slots `real`, `seen` a 0-d
    tensor), taken as every key's (rope_offsets' rule: transformers' default position_ids, the
    indices, give a left-padded row its padding; generate()'s ranks give 0); None without them."""
    if position_ids is None:
        return None
    rank = mask_ranks(real).index_select(1, (seen - 1).reshape(1))[:, 0]
    return position_ids[:, -1].to(torch.long).expand(batch) - rank


def _check_same_boundaries(cu_q, cu_k) -> None:
    if cu_q is None and cu_k is not None:
        raise ValueError("cu_seq_lens_k without cu_seq_lens_q: pass both (the same boundaries), as "
                         "DataCollatorWithFlattening(return_flash_attn_kwargs=True) does")
    if cu_q is not None and cu_k is not None and cu_k is not cu_q and not torch.equal(cu_q, cu_k.to(cu_q.device)):
        raise ValueError("cu_seq_lens_q and cu_seq_lens_k differ; only causal self-attention over packed "
                         "sequences is supported")


def rope_offsets(position_ids, mask, positions, rotated=None, *, batch: int, q_len: int, kv_len: int, device):
    """(batch, kv_len) int64: how far the position the model rotated each key at (its RoPE's
    `position_ids`) is from the key's kernel position (from_model_inputs' mask and positions), 0 at
    padded slots; None where they are known to be the same. The far keys' grouped positions are of
    the kernels' positions (docs/contract.md 4.1): a left-padded row under transformers' default
    position_ids (its indices, not its mask ranks) was rotated `padding` positions further, which
    changes which far blocks bound highest (4.2), not the scores. In a call against a cache only
    the queries' position_ids are known: where the last query's is its index (transformers'
    default), every key's is taken to be its index; else every key is taken to be offset as the
    last query is (generate()'s mask ranks: 0). Without a mask: `rotated` - the kernels' positions
    where from_model_inputs found the model rotated elsewhere (cu_seq_lens' documents, ids that are
    not consecutive), else None: the same positions, or a call against a cache, which takes its keys
    at their indices and position_ids as those indices (what transformers passes)."""
    if mask is None or mask.dtype != torch.bool:
        if rotated is None:
            return None
        kernel = torch.arange(kv_len, device=device) if positions is None else positions
        return (rotated.to(torch.long) - kernel).expand(batch, kv_len)
    if position_ids is None:
        return None
    rope_positions = position_ids.to(device=device, dtype=torch.long).expand(batch, q_len)
    ranks = (positions if positions is not None else mask_ranks(mask)).expand(batch, kv_len)
    real = mask.expand(batch, kv_len)
    if q_len == kv_len:
        return (rope_positions - ranks).masked_fill(~real, 0)
    last = rope_positions[:, -1:]
    index = torch.arange(kv_len, device=device)
    offset = torch.where(last == kv_len - 1, index - ranks, last - ranks[:, -1:])
    return offset.masked_fill(~real, 0)


def from_model_inputs(mask, position_ids, *, batch: int, q_len: int, kv_len: int, device,
                      cu_seq_lens=None) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """transformers' rule (module docstring): (attention_mask, position_ids) for a kernel, from
    what a model hands its attention function, and `rotated`: in a call over the whole row without a
    mask, the positions the model rotated the keys at (its position_ids, or its indices without
    them) where they may differ from the kernels' (cu_seq_lens' documents; ids that are not
    consecutive, which transformers does not split with a cache), else None.

    mask: what hf_dilated's mask function (`padding_mask`, above) returned: a bool
        (batch, seen) mask when the model was given an attention mask or transformers saw no
        packing (the row is one document; seen > kv_len when a sliding-window cache dropped the
        first seen - kv_len keys), an int64 tensor when transformers detected packed sequences
        (only its presence is read: the documents come from position_ids), or None (no mask, no
        packing).
    position_ids: (batch or 1, q_len) or None, the queries' positions (only read without a mask).
    cu_seq_lens: flash-attention style sequence boundaries (1-D, cumulative), for packed batches
        that carry no position_ids.
    """
    if mask is not None and mask.dtype == torch.bool:
        if mask.shape[-1] > kv_len:  # sliding-window cache: the keys are the last kv_len tokens seen
            ranks = mask_ranks(mask)
            return mask[:, -kv_len:], ranks[:, -kv_len:], None
        return mask, None, None
    if position_ids is not None:
        if position_ids.dim() != 2 or position_ids.shape[-1] != q_len or position_ids.shape[0] not in (1, batch):
            raise ValueError(f"position_ids must have shape (batch, q_len={q_len}), got {tuple(position_ids.shape)}")
        position_ids = position_ids.to(device).expand(batch, q_len)
    if mask is not None:  # packed sequences, as transformers detected them from position_ids
        if position_ids is None or q_len != kv_len:
            raise ValueError("packed sequences need position_ids covering the whole key sequence")
        if cu_seq_lens is not None:  # they define the documents here, and must be the same ones (one read back)
            _positions_from_boundaries(cu_seq_lens, batch, kv_len, device, position_ids)
        return None, position_ids, None
    if cu_seq_lens is not None and q_len == kv_len:
        rotated = torch.arange(kv_len, device=device).expand(batch, kv_len) if position_ids is None else position_ids
        return None, _positions_from_boundaries(cu_seq_lens, batch, kv_len, device, position_ids, True), rotated
    if position_ids is None or q_len != kv_len:
        return None, None, None  # one document; with a cache the keys are 0..kv_len-1
    steps = position_ids[:, 1:] - position_ids[:, :-1]
    # One read back for both facts (a stall on a GPU): positions that are the indices themselves
    # (what transformers builds for an unpadded batch) are the kernels' own default, and with None
    # the kernels plan from shapes alone, without reading positions again.
    consecutive, from_zero = torch.stack([(steps == 1).all(), (position_ids[:, 0] == 0).all()]).tolist()
    if consecutive and not from_zero:
        return None, position_ids, None  # one document at the given positions
    # Indices 0..n-1, or transformers saw no packing (it skips the check with a KV cache): one
    # document at its indices, like sdpa (rotated at other positions where the ids are not the indices).
    return None, None, None if consecutive else position_ids


def _positions_from_boundaries(cu_seq_lens, batch, kv_len, device, position_ids=None,
                               or_indices: bool = False) -> torch.Tensor:
    """Positions 0, 1, ... per document of cu_seq_lens (checked: the boundaries of one row of kv_len
    tokens), and, given position_ids beside them, checked equal to those (or, with or_indices, to
    the indices 0..n-1, transformers' own position_ids: the same documents, or none said)."""
    cu = cu_seq_lens.to(device=device, dtype=torch.long).reshape(-1)
    valid = batch == 1 and cu.numel() >= 2
    if valid:
        index = torch.arange(kv_len, device=device)
        positions = (index - cu[:-1][torch.searchsorted(cu[1:], index, right=True).clamp(max=cu.numel() - 2)])[None]
        differ = torch.zeros((), dtype=torch.bool, device=device) if position_ids is None else \
            (positions != position_ids).any()
        if or_indices and position_ids is not None:
            differ = differ & (position_ids != index).any()
        differ = differ.long()
        # (the facts in one read back, once per forward: the call is cached by the tensor's identity)
        first, last, falls, differ = torch.stack([cu[0], cu[-1], (cu[1:] < cu[:-1]).any().long(), differ]).tolist()
        valid = first == 0 and last == kv_len and not falls
    if not valid:
        raise ValueError(
            f"cu_seq_lens_q must be the cumulative lengths 0 <= ... <= {kv_len} of the packed sequences of one "
            f"row of {kv_len} tokens, got {cu.tolist()[:8]} for batch {batch}"
        )
    if differ:
        raise ValueError("cu_seq_lens_q and position_ids describe different documents (position_ids must restart "
                         "at 0 at each boundary of cu_seq_lens_q, as DataCollatorWithFlattening makes them)")
    return positions


def padded_last_query_as_sdpa(out, query, key, value, mask, scale, window=None):
    """docs/contract.md 3.1 leaves outputs at padded query slots unspecified, but generate() reads
    the logits of the last slot even when it is padding (a right-padded prompt's first new token
    comes from there; docs/contract.md 3.2, "The last padded slot"). For those rows the last slot
    gets exactly what sdpa gives it: attention over the row's real keys (within the sliding window,
    if any). One query per row, so O(kv_len)."""
    plan_key = ("padded last query", tuple(mask.shape), str(mask.device), window)
    held = _INPUTS.get(plan_key, mask, None)  # every layer passes the same mask: one read back a step, not a layer
    if held is None:
        visible = mask
        if window is not None:  # the last slot sees the keys of index > kv_len - 1 - window only
            visible = mask & (torch.arange(mask.shape[-1], device=mask.device) >= mask.shape[-1] - window)
        held = ((~visible[:, -1] & visible.any(-1)).nonzero().squeeze(1), visible)
        _INPUTS.put(plan_key, mask, None, held)
    rows, mask = held
    if rows.numel() == 0:
        return out
    last = torch.nn.functional.scaled_dot_product_attention(
        query[rows, :, -1:], key[rows], value[rows], attn_mask=mask[rows, None, None, :], scale=scale,
        enable_gqa=query.shape[1] != key.shape[1])
    out = out.clone()  # out of place: autograd may hold the kernel's output
    out[rows, :, -1:] = last.to(out.dtype)
    return out
