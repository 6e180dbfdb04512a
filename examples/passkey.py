"""Passkey retrieval data: a five-digit number hidden at a chosen depth in filler text, asked for
at the end. The format never varies, so a tiny model can learn the task; the loss is on the
answer digits only.

    <bos>There is a pass key hidden in this text. Find it and remember it.
    The grass is green. The sky is blue. ...  The pass key is 71432. Remember it. 71432 is the pass key.
    The grass is green. ... What is the pass key? The pass key is 71432

Lengths are in tokens of the byte-level tokenizer (one token per character here: all ASCII).
"""
from __future__ import annotations

import random
import re

import torch

INTRO = "There is a pass key hidden in this text. Find it and remember it.\n"
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
KEY_SENTENCE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "What is the pass key? The pass key is "
KEY_DIGITS = 5
IGNORE_INDEX = -100


def min_length() -> int:
    """The shortest context that still holds the intro, the key sentence, the question and the answer."""
    return 1 + len(INTRO) + len(KEY_SENTENCE.format(key="0" * KEY_DIGITS)) + len(QUESTION) + KEY_DIGITS


def passkey_sample(tokenizer, length: int, depth: float, rng: random.Random, *, learn_repeat: bool = False,
                   learn_all: bool = False) -> dict:
    """One sample of exactly `length` tokens, the key sentence after `depth` (0..1) of the filler.

    Returns input_ids (the whole text, answer included) and labels shifted for next-token
    prediction (labels[t] is the token t+1 should predict, IGNORE_INDEX everywhere but the five
    positions that predict the answer digits), plus the key itself.

    learn_repeat: also label the key's repeat inside the key sentence ("Remember it. 71432 is ..."),
    a short-range copy of the same key that trains the copying the long-range answer needs.
    learn_all: label every token (plain language modelling of the sample): the repeated filler
    trains copying from earlier text on thousands of tokens per row instead of ten.
    Evaluation uses neither.
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    if length < min_length():
        raise ValueError(f"length must be at least {min_length()} tokens for a passkey sample, got {length}")
    key = "".join(rng.choice("0123456789") for _ in range(KEY_DIGITS))
    key_sentence = KEY_SENTENCE.format(key=key)
    filler_chars = length - min_length()
    filler = (FILLER * (filler_chars // len(FILLER) + 1))[:filler_chars]
    # The key goes in at the sentence boundary nearest the requested depth.
    boundaries = [0] + [m.end() for m in re.finditer(r"\. ", filler)] + [filler_chars]
    cut = min(boundaries, key=lambda b: abs(b - depth * filler_chars))
    text = INTRO + filler[:cut] + key_sentence + filler[cut:] + QUESTION + key
    ids = [tokenizer.bos_token_id] + tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) != length:
        raise ValueError(f"the tokenizer must give one token per character (got {len(ids)} tokens for {length})")
    labels = ids[1:] + [IGNORE_INDEX] if learn_all else [IGNORE_INDEX] * length
    for t in range(length - KEY_DIGITS - 1, length - 1):
        labels[t] = ids[t + 1]
    if learn_repeat:
        repeat = 1 + len(INTRO) + cut + key_sentence.index(key, KEY_DIGITS + len("The pass key is "))
        for t in range(repeat - 1, repeat + KEY_DIGITS - 1):
            labels[t] = ids[t + 1]
    return {"input_ids": torch.tensor(ids), "labels": torch.tensor(labels), "key": key}
