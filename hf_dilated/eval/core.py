"""What `hf-dilated eval` measures, as plain functions of a loaded model (no files, no printing).

Perplexity by position (`bucket_losses`): each document's first `length` tokens in one forward
pass; the loss of predicting token t (t >= 1, from the tokens before it) goes to bucket t // bucket.
For buckets >= 1 the same tokens are scored again with the context cut to a window
(`windowed_losses`): rows of exactly `window` tokens, of which the last `stride` are scored, so a
token sees between window - stride + 1 and window tokens before it (positions 0..window-1, the
range a model pre-trained at `window` tokens knows). full < windowed in a far bucket means the
model uses context beyond the window there.

Retrieval (`passkey_scores`): the passkey format of hf_dilated.eval.passkey; a key counts as right
when the argmax at every answer position is the right digit given the right digits before it,
which is exactly when greedy generation after the question produces the key (the first wrong
digit would be the first one greedy decoding gets wrong). One forward pass per sample.

Cost (`forward_cost`): wall time of a no-grad forward of the decoder (the model without its LM head)
over one row of `length` tokens (median of a few calls after a warm-up) and the peak memory above
what was held before it (CUDA: the allocator's peak; CPU: the resident high-water mark, reset
through /proc/self/clear_refs where Linux allows it, under glibc settings that map each large block on its own so that the resident
set follows the live tensors; elsewhere an upper bound, flagged).
"""
from __future__ import annotations

import random
import re
import statistics
import time

import torch
import torch.nn.functional as F

from ..measure import MemoryProbe, strict_allocator, sync
from .passkey import IGNORE_INDEX, KEY_DIGITS, TEXT_NEW_TOKENS, passkey_sample, text_passkey_sample


def _device(model) -> torch.device:
    return next(model.parameters()).device


# Tokens whose logits are formed at once: a 49K-word vocabulary over 16K tokens would be 3 GB of
# float32 logits; the loss is taken from the final hidden states in chunks of this many positions.
LOGIT_CHUNK = 2048


def _logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    return model(input_ids=input_ids, position_ids=positions, use_cache=False).logits.float()


def _final_hidden(model, input_ids: torch.Tensor) -> torch.Tensor:
    """The decoder's final hidden states (batch, n, hidden): the model without its LM head."""
    positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    return model.get_decoder()(input_ids=input_ids, position_ids=positions, use_cache=False).last_hidden_state


@torch.no_grad()
def token_losses(model, rows: torch.Tensor, batch_size: int = 4, progress=None) -> torch.Tensor:
    """(rows, n - 1) losses: [:, t - 1] is the loss of predicting token t from tokens 0..t-1. The LM
    head runs on LOGIT_CHUNK positions at a time (the same logits, never all of them at once)."""
    out = []
    head = model.get_output_embeddings()
    for start in range(0, len(rows), batch_size):
        ids = rows[start:start + batch_size].to(_device(model))
        hidden = _final_hidden(model, ids)[:, :-1]
        losses = [F.cross_entropy(head(hidden[:, s:s + LOGIT_CHUNK]).float().transpose(1, 2),
                                  ids[:, 1 + s:1 + s + LOGIT_CHUNK], reduction="none")
                  for s in range(0, hidden.shape[1], LOGIT_CHUNK)]
        out.append(torch.cat(losses, 1).cpu())
        if progress is not None:
            progress.update(len(ids))
    return torch.cat(out)


def bucket_means(losses: torch.Tensor, bucket: int) -> list[float]:
    """Mean loss per bucket of target positions t = 1..n-1 (bucket k holds t in [k*bucket, (k+1)*bucket))."""
    n = losses.shape[1] + 1
    targets = torch.arange(1, n)
    return [float(losses[:, (targets // bucket) == k].mean()) for k in range((n - 1) // bucket + 1)
            if ((targets // bucket) == k).any()]


def bucket_losses(model, docs: list[torch.Tensor], length: int, bucket: int, batch_size: int = 4,
                  progress=None) -> list[float]:
    """The mean loss per position bucket over the documents' first `length` tokens, whole context."""
    rows = torch.stack([d[:length] for d in docs])
    return bucket_means(token_losses(model, rows, batch_size, progress), bucket)


def window_rows(docs: list[torch.Tensor], length: int, first: int, window: int, stride: int):
    """Rows of window + 1 tokens; row i scores targets `targets[i]` (consecutive, its last
    predictions), each target t seeing tokens a..t-1 of its document, a = last target - window: at
    least window - stride + 1 and at most `window` tokens. Targets first..length-1 of every document
    are scored once. The row's last token is only a target, so the inputs used sit at positions
    0..window-1."""
    if not 0 < stride <= window:
        raise ValueError(f"stride must be in 1..window ({window}), got {stride}")
    if first < window - stride + 1:
        raise ValueError(f"the first windowed target ({first}) must be at least window - stride + 1")
    rows, targets = [], []
    for d in docs:
        for s in range(first, length, stride):
            t_end = min(s + stride, length)
            a = t_end - 1 - window
            rows.append(d[a:t_end])
            targets.append(range(s, t_end))
    return rows, targets


@torch.no_grad()
def windowed_losses(model, docs: list[torch.Tensor], length: int, bucket: int, window: int, stride: int,
                    batch_size: int = 4, progress=None) -> list[float | None]:
    """Per bucket (None for bucket 0), the mean loss of the same targets as `bucket_losses` with
    each target seeing only the previous window - stride + 1 .. window tokens."""
    first = bucket
    rows, targets = window_rows(docs, length, first, window, stride)
    losses = token_losses(model, torch.stack(rows), batch_size, progress)  # (rows, window): targets a+1..a+window
    per_target = torch.zeros(len(docs), length)
    per_doc = len(range(first, length, stride))
    for i, span in enumerate(targets):
        per_target[i // per_doc, span.start:span.stop] = losses[i, -len(span):]
    means = [None]
    t = torch.arange(length)
    for k in range(1, (length - 1) // bucket + 1):
        sel = (t // bucket == k) & (t >= first)
        means.append(float(per_target[:, sel].mean()))
    return means


def make_passkey_samples(tokenizer, length: int, depth: float, count: int, seed: int) -> list[dict]:
    """The same samples for every checkpoint and attention (seeded by seed, length and depth): the
    plain-text format answered by generation (passkey.text_passkey_sample) for a pretrained
    instruct model (a tokenizer with a chat template), else the trained format."""
    rng = random.Random(f"{seed}:{length}:{depth}")
    if getattr(tokenizer, "chat_template", None) or not _one_token_per_character(tokenizer):
        # (the trained format counts characters as tokens: another tokenizer, a base model's, takes plain text)
        return [text_passkey_sample(tokenizer, length, depth, rng) for _ in range(count)]
    return [passkey_sample(tokenizer, length, depth, rng) for _ in range(count)]


def _one_token_per_character(tokenizer) -> bool:
    probe = "The pass key is 12345. Remember it. 12345 is the pass key."
    return len(tokenizer(probe, add_special_tokens=False)["input_ids"]) == len(probe)


@torch.no_grad()
def generated_passkey_scores(model, tokenizer, samples: list[dict], progress=None) -> tuple[list[bool], list[int]]:
    """For each plain-text sample: whether the first number greedy generation says is the key, and
    how many of the key's digits it gets at their places."""
    keys, digits = [], []
    for sample in samples:
        ids = sample["input_ids"][None].to(_device(model))
        out = model.generate(ids, max_new_tokens=TEXT_NEW_TOKENS, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
        text = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        answer = (re.findall(r"\d+", text) or [""])[0]  # the first number it says
        keys.append(answer == sample["key"])  # (as the trained format's: the number it says is the key)
        digits.append(sum(a == b for a, b in zip(answer, sample["key"])))
        if progress is not None:
            progress.update(1)
    return keys, digits


@torch.no_grad()
def passkey_scores(model, samples: list[dict], batch_size: int = 4, progress=None) -> tuple[list[bool], list[int]]:
    """For each sample: whether the whole key is right (see the module docstring) and how many of
    its digits the teacher-forced argmax gets right."""
    keys, digits = [], []
    for start in range(0, len(samples), batch_size):
        chunk = samples[start:start + batch_size]
        input_ids = torch.stack([s["input_ids"] for s in chunk]).to(_device(model))
        labels = torch.stack([s["labels"] for s in chunk]).to(input_ids.device)
        answer = labels != IGNORE_INDEX
        predicted = _logits(model, input_ids).argmax(-1)[answer].view(len(chunk), KEY_DIGITS)
        right = predicted == labels[answer].view(len(chunk), KEY_DIGITS)
        keys += right.all(-1).tolist()
        digits += right.sum(-1).tolist()
        if progress is not None:
            progress.update(len(chunk))
    return keys, digits


# transformers' own attentions, which read every (query, key) pair of causal attention.
DENSE_ATTENTIONS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")


def pairs_read_fraction(model, attn: str, tally, rows: int, length: int) -> float | None:
    """The (query, key) pairs one forward over `rows` rows of `length` tokens read, over dense causal
    attention's (heads x layers x length (length + 1) / 2 per row), from the kernels' exact count
    (hf_dilated.ops.pair_count); 1 for transformers' dense attentions; None where the attention's
    kernels do not count."""
    if attn in DENSE_ATTENTIONS:
        return 1.0
    if tally.counted_calls == 0:
        return None
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    dense = cfg.num_hidden_layers * cfg.num_attention_heads * rows * length * (length + 1) // 2
    return tally.pairs / dense


@torch.no_grad()
def forward_cost(model, length: int, vocab_size: int, repeats: int = 3) -> dict:
    """Median seconds of a no-grad forward of one row of `length` tokens, and its peak memory (bytes)
    above the memory held before it; `memory_exact` False where only an upper bound was available."""
    device = _device(model)
    ids = torch.randint(0, vocab_size, (1, length), generator=torch.Generator().manual_seed(length)).to(device)
    if repeats > 1:  # warm-up (plans, kernels); one timed call of a long row is dominated by its work
        _final_hidden(model, ids)
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        _final_hidden(model, ids)
        sync(device)
        times.append(time.perf_counter() - t0)
    # Memory after the timed calls (measure.py): one more call, its peak above what was held before.
    exact = device.type == "cuda" or strict_allocator(True)
    probe = MemoryProbe(device)
    try:
        probe.start()
        _final_hidden(model, ids)
        peak = probe.peak_extra()
    finally:
        if device.type != "cuda":
            strict_allocator(False)
    exact = exact and (device.type == "cuda" or probe.can_reset)
    return {"seconds": statistics.median(times), "peak_bytes": int(peak), "memory_exact": exact}
