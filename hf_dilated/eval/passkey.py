"""Passkey retrieval data: a five-digit number hidden at a chosen depth in filler text, asked for
at the end. The format never varies, so a tiny model can learn the task; the loss is on the
answer digits only.

    <bos>Remember the pass key.
    The grass is green. The sky is blue. ...  The pass key is <71432>. <71432>. <71432>. <71432>.
    The grass is green. ... What is the pass key? The pass key is <71432

The "<" before the key occurs nowhere else, so finding the key needs a one-token match, not
"key is " told apart from the filler's "sky is ". The key is written KEY_COPIES = 4 times, 9
tokens apart: 9 is odd and 1 mod 4, so the copies fall in every offset class of dilation rates 1,
2 and 4. Under dilated attention a query of class c reads only keys of class c at a dilated level
(docs/contract.md 4), so whichever class the question's tokens fall in, one copy lies in it and a
single content-matching (induction) head can reach it; with one copy, 3 queries in 4 would have to
route the key through extra layers.
Lengths are in tokens of the byte-level tokenizer (one token per character here: all ASCII).
"""
from __future__ import annotations

import random
import re

import torch

INTRO = "Remember the pass key.\n"
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
KEY_COPIES = 4
KEY_SENTENCE = "The pass key is " + "<{key}>. " * KEY_COPIES
QUESTION = "What is the pass key? The pass key is <"
RECALL_END = ">. "
KEY_DIGITS = 5
IGNORE_INDEX = -100


def min_length() -> int:
    """The shortest context that still holds the intro, the key sentence, the question and the answer."""
    return 1 + len(INTRO) + len(KEY_SENTENCE.format(key="0" * KEY_DIGITS)) + len(QUESTION) + KEY_DIGITS


def passkey_sample(tokenizer, length: int, depth: float, rng: random.Random, *, recalls: int = 0,
                   learn_all: bool = False) -> dict:
    """One sample of exactly `length` tokens, the key sentence after `depth` (0..1) of the filler.

    Returns input_ids (the whole text, answer included) and labels shifted for next-token
    prediction (labels[t] is the token t+1 should predict, IGNORE_INDEX everywhere but the
    positions that predict answer digits), plus the key itself.

    recalls: training only. Also ask and answer the question this many times at random sentence
    boundaries between the key and the end ("What is the pass key? The pass key is <71432>. "),
    each answer labelled. Every answer is then a copy from a different, random distance, so the
    model must learn to find the key by its content; a copy from a fixed distance (the key's repeat
    inside the key sentence) is learnt by position instead and does not carry over to the answer.
    learn_all: label every token (plain language modelling of the sample).
    Evaluation uses neither.
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    if recalls < 0:
        raise ValueError(f"recalls must be >= 0, got {recalls}")
    if length < min_length():
        raise ValueError(f"length must be at least {min_length()} tokens for a passkey sample, got {length}")
    key = "".join(rng.choice("0123456789") for _ in range(KEY_DIGITS))
    key_sentence = KEY_SENTENCE.format(key=key)
    recall = QUESTION + key + RECALL_END
    recalls = min(recalls, (length - min_length()) // len(recall))  # as many as fit
    filler_chars = length - min_length() - recalls * len(recall)
    filler = (FILLER * (filler_chars // len(FILLER) + 1))[:filler_chars]
    # The key goes in at the sentence boundary nearest the requested depth; recalls at random
    # boundaries after it.
    boundaries = [0] + [m.end() for m in re.finditer(r"\. ", filler)] + [filler_chars]
    cut = min(boundaries, key=lambda b: abs(b - depth * filler_chars))
    later = [b for b in boundaries if b >= cut]
    recall_cuts = sorted(rng.choice(later) for _ in range(recalls))
    pieces, answers = [INTRO + filler[:cut] + key_sentence], []  # answers: offsets of the labelled keys
    for start, end in zip([cut] + recall_cuts, recall_cuts + [filler_chars]):
        pieces.append(filler[start:end])
        answers.append(sum(map(len, pieces)) + len(QUESTION))
        pieces.append(recall if len(answers) <= len(recall_cuts) else QUESTION + key)
    text = "".join(pieces)
    ids = [tokenizer.bos_token_id] + tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) != length:
        raise ValueError(f"the tokenizer must give one token per character (got {len(ids)} tokens for {length})")
    labels = ids[1:] + [IGNORE_INDEX] if learn_all else [IGNORE_INDEX] * length
    for offset in answers:  # text offset o is token 1 + o (after bos), predicted at token o
        for t in range(offset, offset + KEY_DIGITS):
            labels[t] = ids[t + 1]
    return {"input_ids": torch.tensor(ids), "labels": torch.tensor(labels), "key": key}


# Training only: several keys per document, each with its own brackets, so that one document asks
# several long-range questions whose nearest copy is the key itself. The first pair is the
# evaluation's "<" ">"; the question names the key by its opening bracket.
BRACKETS = (("<", ">"), ("[", "]"), ("{", "}"), ("(", ")"))


def multikey_length(keys: int) -> int:
    """The shortest document that holds `keys` keys and their questions."""
    sentence = len("The pass key is ") + (KEY_DIGITS + 4) * KEY_COPIES
    return 1 + len(INTRO) + keys * (sentence + len(QUESTION) + KEY_DIGITS + 3) - 3


def multikey_sample(tokenizer, length: int, rng: random.Random, keys: int) -> dict:
    """One training document of exactly `length` tokens holding `keys` (1..4) keys, each written
    KEY_COPIES times in its own brackets at a random depth of the filler, then asked for one after
    another at the end in random order ("What is the pass key? The pass key is [71432]. ..."),
    each answer's digits labelled. With keys=1 it is the evaluation's format with a random depth."""
    if not 1 <= keys <= len(BRACKETS):
        raise ValueError(f"keys must be in 1..{len(BRACKETS)}, got {keys}")
    values = ["".join(rng.choice("0123456789") for _ in range(KEY_DIGITS)) for _ in range(keys)]
    sentences = ["The pass key is " + f"{o}{v}{c}. " * KEY_COPIES for (o, c), v in zip(BRACKETS, values)]
    order = list(range(keys))
    rng.shuffle(order)
    if 0 in order:  # the evaluation's "<" question last, as in evaluation
        order.remove(0)
        order.append(0)
    questions = ["What is the pass key? The pass key is " + BRACKETS[i][0] + values[i] + (BRACKETS[i][1] + ". " if n < keys - 1 else "")
                 for n, i in enumerate(order)]
    fixed = 1 + len(INTRO) + sum(map(len, sentences)) + sum(map(len, questions))
    assert fixed == multikey_length(keys)
    if length < fixed:
        raise ValueError(f"length {length} is too short for {keys} keys (needs {fixed})")
    filler_chars = length - fixed
    filler = (FILLER * (filler_chars // len(FILLER) + 1))[:filler_chars]
    boundaries = [0] + [m.end() for m in re.finditer(r"\. ", filler)] + [filler_chars]
    cuts = sorted(rng.choice(boundaries) for _ in range(keys))
    placed = list(range(keys))
    rng.shuffle(placed)
    pieces, prev = [INTRO], 0
    for cut, i in zip(cuts, placed):
        pieces += [filler[prev:cut], sentences[i]]
        prev = cut
    pieces.append(filler[prev:])
    answers = []
    for q, i in zip(questions, order):
        answers.append(sum(map(len, pieces)) + q.index(values[i]))  # text offset of the answer's digits
        pieces.append(q)
    text = "".join(pieces)
    ids = [tokenizer.bos_token_id] + tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) != length:
        raise ValueError(f"the tokenizer must give one token per character (got {len(ids)} tokens for {length})")
    labels = [IGNORE_INDEX] * length
    for offset in answers:
        for t in range(offset, offset + KEY_DIGITS):
            labels[t] = ids[t + 1]
    return {"input_ids": torch.tensor(ids), "labels": torch.tensor(labels), "key": values[0]}


# A pretrained (instruct) model is asked in plain text instead and answers by greedy generation,
# the format of the long-context literature (Mohtashami and Jaggi, 2023): the text continues "The
# pass key is" after the question. Not its chat template: asked in a user turn, SmolLM2-135M-Instruct
# answers about pass keys in general even at 2,000 tokens ("The pass key is a magical item ..."),
# while it continues the plain text with the key up to its 8K context.
TEXT_INTRO = ("There is an important pass key hidden inside a lot of irrelevant text. Find it and memorize it. "
              "I will quiz you about the pass key.\n")
TEXT_KEY = " The pass key is {key}. Remember it. {key} is the pass key. "
TEXT_QUESTION = "\nWhat is the pass key? The pass key is"
TEXT_NEW_TOKENS = 16  # the five digits (a token each) and what a model says after them


def text_passkey_sample(tokenizer, length: int, depth: float, rng: random.Random) -> dict:
    """One plain-text prompt of at most `length` tokens (the most filler that fits, after the
    tokenizer's bos token if it has one), the key after `depth` (0..1) of the filler."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    key = "".join(rng.choice("123456789") for _ in range(KEY_DIGITS))
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []

    def prompt(repeats: int) -> list[int]:
        filler = FILLER * repeats
        boundaries = [0] + [m.end() for m in re.finditer(r"\. ", filler)]
        cut = min(boundaries, key=lambda b: abs(b - depth * len(filler)))
        content = TEXT_INTRO + filler[:cut] + TEXT_KEY.format(key=key) + filler[cut:] + TEXT_QUESTION
        return bos + tokenizer(content, add_special_tokens=False)["input_ids"]

    empty = len(prompt(0))
    if empty > length:
        raise ValueError(f"length must be at least {empty} tokens for a passkey prompt, got {length}")
    per_repeat = (len(prompt(16)) - empty) / 16
    repeats = int((length - empty) / per_repeat)
    ids = prompt(repeats)
    while len(ids) > length:  # the estimate overshot by a few tokens
        repeats -= 1
        ids = prompt(repeats)
    return {"input_ids": torch.tensor(ids), "key": key}
