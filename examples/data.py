"""Training data for the examples: passkey samples generated on the fly, or real text from local
files through `datasets`, tokenized and packed to the context length.

Every dataset item is a dict of 1-D tensors of one length: input_ids, labels (already shifted:
labels[t] is the token t+1 should predict, -100 where nothing is learned) and position_ids.
Packing keeps document boundaries: positions restart at 0 at each document, which is how the
attention implementations (ours, and sdpa through transformers) tell documents apart, and the
label at the last token of a document is -100, so nothing learns across a boundary.
"""
from __future__ import annotations

import random
from pathlib import Path

import torch
from torch.utils.data import Dataset

from passkey import IGNORE_INDEX, min_length, multikey_length, multikey_sample, passkey_sample

TEXT_SUFFIXES = {".txt", ".md", ".py", ".rst"}
JSON_SUFFIXES = {".jsonl", ".json"}


class PasskeyDataset(Dataset):
    """Passkey samples packed into rows of `seq_len` tokens; item i is the same on every call
    and every process (seeded by (seed, i)), so resuming replays exactly the data it would have seen.

    Each row holds documents of random lengths between `min_doc_len` and `max_doc_len` (default
    `seq_len`; a row's last document takes whatever room is left, so it may be longer), with the
    key at a random depth: short documents keep the short-range skill, long ones teach the long range.
    recalls: at most this many questions answered mid-text per document (a random number from 0,
    so some documents look exactly like the evaluation's), at random distances from the key.
    learn_all: learn every token (see passkey.passkey_sample).
    keys: above 1, each document holds 1..keys keys (as many as its length allows), each in its own
    brackets and asked for at the end (passkey.multikey_sample): several long-range answers per document.
    """

    def __init__(self, tokenizer, seq_len: int, num_rows: int, *, min_doc_len: int | None = None,
                 max_doc_len: int | None = None, seed: int = 0, recalls: int = 0, learn_all: bool = False,
                 keys: int = 1):
        self.tokenizer, self.seq_len, self.num_rows, self.seed, self.keys = tokenizer, seq_len, num_rows, seed, keys
        self.recalls, self.learn_all = recalls, learn_all
        self.min_doc_len = max(min_length(), min_doc_len or min_length())
        if seq_len < self.min_doc_len:
            raise ValueError(f"seq_len must be at least {self.min_doc_len} for passkey data, got {seq_len}")
        self.max_doc_len = min(seq_len, max_doc_len or seq_len)
        if self.max_doc_len < self.min_doc_len:
            raise ValueError(f"max_doc_len must be at least {self.min_doc_len} for passkey data, got {self.max_doc_len}")

    def __len__(self):
        return self.num_rows

    def __getitem__(self, index):
        rng = random.Random(f"{self.seed}:{index}")
        docs, free = [], self.seq_len
        while free >= self.min_doc_len:
            length = rng.randint(self.min_doc_len, min(free, self.max_doc_len))
            # Leave no gap shorter than a document: the last document takes the rest.
            if free - length < self.min_doc_len:
                length = free
            if self.keys > 1:
                fit = max(k for k in range(1, self.keys + 1) if multikey_length(k) <= length)
                docs.append(multikey_sample(self.tokenizer, length, rng, rng.randint(1, fit)))
            else:
                docs.append(passkey_sample(self.tokenizer, length, rng.random(), rng, recalls=rng.randint(0, self.recalls),
                                           learn_all=self.learn_all))
            free -= length
        input_ids = torch.cat([d["input_ids"] for d in docs])
        labels = torch.cat([d["labels"] for d in docs])
        position_ids = torch.cat([torch.arange(len(d["input_ids"])) for d in docs])
        if free:  # a short tail: padding tokens that are their own document and learn nothing
            input_ids = torch.cat([input_ids, torch.full((free,), self.tokenizer.pad_token_id)])
            labels = torch.cat([labels, torch.full((free,), IGNORE_INDEX)])
            position_ids = torch.cat([position_ids, torch.arange(free)])
        return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}


class AlternatingDataset(Dataset):
    """Rows alternate between two datasets: `first_rows` from the first, then `second_rows` from
    the second, and again; as long as the shorter allows."""

    def __init__(self, first: Dataset, second: Dataset, *, first_rows: int = 1, second_rows: int = 1):
        for name, value in (("first_rows", first_rows), ("second_rows", second_rows)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.parts, self.counts = (first, second), (first_rows, second_rows)
        self.rounds = min(len(first) // first_rows, len(second) // second_rows)

    def __len__(self):
        return self.rounds * sum(self.counts)

    def __getitem__(self, index):
        return self.row(index)

    def row(self, index: int, epoch: int = 0):
        """Row `index` of epoch `epoch`: each epoch reads a part's next rows, so that a part longer
        than the other allows (generated passkey rows beside a little text) is not cut to the
        rows of the first epoch, read again and again."""
        if not 0 <= index < len(self):
            raise IndexError(index)
        a, b = self.counts
        round_, r = divmod(index, a + b)
        part, count, i = (0, a, r) if r < a else (1, b, r - a)
        return self.parts[part][(epoch * self.rounds * count + round_ * count + i) % len(self.parts[part])]


def find_text_files(paths: list[str]) -> list[str]:
    """Expands directories (recursively, text and JSON-lines files only, sorted) and checks files exist."""
    files = []
    for path in map(Path, paths):
        if path.is_dir():
            files += sorted(str(p) for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES | JSON_SUFFIXES)
        elif path.is_file():
            files.append(str(path))
        else:
            raise ValueError(f"--data: no such file or directory: {path}")
    if not files:
        raise ValueError(f"--data: no text or JSON-lines files under {paths}")
    return files


def load_documents(files: list[str], *, text_field: str = "text", cache_dir: str | None = None):
    """A `datasets.Dataset` with one document per row in column `text`: a whole file for text files,
    one record's `text_field` for JSON lines."""
    import datasets

    text_files = [f for f in files if Path(f).suffix not in JSON_SUFFIXES]
    json_files = [f for f in files if Path(f).suffix in JSON_SUFFIXES]
    parts = []
    if text_files:
        parts.append(datasets.load_dataset("text", data_files=text_files, sample_by="document",
                                           split="train", cache_dir=cache_dir))
    if json_files:
        records = datasets.load_dataset("json", data_files=json_files, split="train", cache_dir=cache_dir)
        if text_field not in records.column_names:
            raise ValueError(f"--text-field {text_field!r} is not a field of {json_files} (fields: {records.column_names})")
        records = records.select_columns([text_field])
        parts.append(records if text_field == "text" else records.rename_column(text_field, "text"))
    return datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]


def pack_documents(token_lists, seq_len: int, *, pad_token_id: int) -> dict[str, torch.Tensor]:
    """Concatenates tokenized documents and cuts them into rows of `seq_len` tokens.

    A document that runs over a row boundary continues in the next row as a new document
    (positions restart), so no row attends into another. Returns (rows, seq_len) tensors.
    """
    ids, labels, positions = [], [], []
    for tokens in token_lists:
        tokens = list(tokens)
        while tokens:
            room = seq_len - len(ids) % seq_len
            piece, tokens = tokens[:room], tokens[room:]
            ids += piece
            labels += piece[1:] + [IGNORE_INDEX]
            positions += range(len(piece))
    tail = (-len(ids)) % seq_len
    ids += [pad_token_id] * tail
    labels += [IGNORE_INDEX] * tail
    positions += list(range(tail))
    shape = (-1, seq_len)
    return {"input_ids": torch.tensor(ids).view(shape), "labels": torch.tensor(labels).view(shape),
            "position_ids": torch.tensor(positions).view(shape)}


class PackedTextDataset(Dataset):
    """Local text or JSON-lines files, tokenized (eos after each document) and packed to `seq_len`."""

    def __init__(self, tokenizer, files: list[str], seq_len: int, *, text_field: str = "text",
                 max_rows: int | None = None, cache_dir: str | None = None):
        docs = load_documents(files, text_field=text_field, cache_dir=cache_dir)
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []

        def tokenize(batch):
            return {"tokens": [bos + t + eos for t in tokenizer(batch["text"], add_special_tokens=False)["input_ids"]]}

        tokens = docs.map(tokenize, batched=True, remove_columns=docs.column_names, desc="tokenizing")
        # (a padded slot is its own document with no label: any id does; Llama's and Mistral's tokenizers have no pad)
        pad = next((t for t in (tokenizer.pad_token_id, tokenizer.eos_token_id) if t is not None), 0)
        self.rows = pack_documents(tokens["tokens"], seq_len, pad_token_id=pad)
        if max_rows is not None:
            self.rows = {k: v[:max_rows] for k, v in self.rows.items()}
        if len(self.rows["input_ids"]) == 0:
            raise ValueError("--data: the files hold no text")

    def __len__(self):
        return len(self.rows["input_ids"])

    def __getitem__(self, index):
        return {k: v[index] for k, v in self.rows.items()}


# --- the embedded default's text: the standard library's sources, split by file name -------------

HELDOUT_MODULUS = 8  # one top-level stdlib file in about 8 is held out from every training run


def _heldout(name: str) -> bool:
    import zlib

    return zlib.crc32(name.encode()) % HELDOUT_MODULUS == 0


def stdlib_files(split: str, *, min_bytes: int = 0) -> list[str]:
    """Top-level .py files of the running Python's standard library, sorted by name: split "train"
    or "heldout" (chosen by a hash of the file name, so the split does not depend on which files a
    Python version has), at least `min_bytes` long."""
    import sysconfig

    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if _heldout(p.name) == (split == "heldout") and p.stat().st_size >= min_bytes)
    if not files:
        raise ValueError(f"no standard-library sources under {root}")
    return [str(p) for p in files]


def tokenize_files(tokenizer, files: list[str]) -> list[torch.Tensor]:
    """Each file as one document: bos + its text's tokens + eos (UTF-8, undecodable bytes replaced)."""
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    docs = []
    for f in files:
        text = Path(f).read_text(encoding="utf-8", errors="replace")
        docs.append(torch.tensor(bos + tokenizer(text, add_special_tokens=False)["input_ids"] + eos))
    return docs


class TextPasskeyMixture(Dataset):
    """Rows of `seq_len` tokens, each drawn by (seed, index): with probability `passkey_fraction` a
    row of packed passkey documents (PasskeyDataset's row `index`), else a window of one text
    document: a random document (chance proportional to its length), from its start one time in
    `start_every` (so the model meets bos and a file's opening), else from a random offset;
    positions 0..seq_len-1 either way. Text rows label every token, passkey rows the key digits."""

    def __init__(self, tokenizer, files: list[str], seq_len: int, num_rows: int, *, passkey_fraction: float = 0.5,
                 seed: int = 0, recalls: int = 0, max_doc_len: int | None = None, start_every: int = 8):
        if not 0.0 <= passkey_fraction <= 1.0:
            raise ValueError(f"passkey_fraction must be in [0, 1], got {passkey_fraction}")
        self.seq_len, self.num_rows, self.seed = seq_len, num_rows, seed
        self.passkey_fraction, self.start_every = passkey_fraction, start_every
        self.passkey = PasskeyDataset(tokenizer, seq_len, num_rows, max_doc_len=max_doc_len, seed=seed, recalls=recalls)
        self.docs = [d for d in tokenize_files(tokenizer, files) if len(d) > seq_len] if passkey_fraction < 1 else []
        if passkey_fraction < 1 and not self.docs:
            raise ValueError(f"no text document is longer than seq_len ({seq_len})")
        self.cumulative = torch.tensor([len(d) for d in self.docs]).cumsum(0) if self.docs else None

    def __len__(self):
        return self.num_rows

    def __getitem__(self, index):
        rng = random.Random(f"mixture:{self.seed}:{index}")
        if rng.random() < self.passkey_fraction:
            return self.passkey[index]
        at = rng.randrange(int(self.cumulative[-1]))
        doc = self.docs[int(torch.searchsorted(self.cumulative, at, right=True))]
        start = 0 if rng.randrange(self.start_every) == 0 else rng.randrange(len(doc) - self.seq_len)
        window = doc[start:start + self.seq_len + 1]
        return {"input_ids": window[:-1].clone(), "labels": window[1:].clone(),
                "position_ids": torch.arange(self.seq_len)}


class CopySpanDataset(Dataset):
    """Long-range copying in real text: a `seq_len`-token window of one document (chosen as in
    TextPasskeyMixture) in which a span of `min_span`..`max_span` tokens is written again
    `min_gap`..`max_gap` tokens after its first occurrence (overwriting the text there). Only the
    repeated span is labelled (from its second token: the first cannot be known), so every label
    is a copy from far back; seeded by (seed, index). The fine-tune's densest long-range signal:
    a passkey row has 5 labels, a copy row tens."""

    def __init__(self, tokenizer, files: list[str], seq_len: int, num_rows: int, *, seed: int = 0,
                 min_gap: int | None = None, max_gap: int | None = None, min_span: int = 32, max_span: int = 128):
        self.seq_len, self.num_rows, self.seed = seq_len, num_rows, seed
        self.min_gap = min_gap if min_gap is not None else seq_len // 4
        self.max_gap = max_gap if max_gap is not None else seq_len - max_span - 1
        self.min_span, self.max_span = min_span, max_span
        if not 0 < self.min_gap <= self.max_gap or self.max_gap + max_span >= seq_len or min_span < 2:
            raise ValueError(f"copy rows: need 0 < min_gap <= max_gap and max_gap + max_span < seq_len ({seq_len})")
        # a span and its copy min_gap or more later fit in a row: spans longer than that are not drawn
        # (a draw past it left an empty range for the gap: rows of --seq-len below 342 raised mid-training)
        self.max_span = min(max_span, (seq_len - self.min_gap) // 2)
        if self.max_span < min_span:
            raise ValueError(f"copy rows: a span of {min_span} tokens and its copy {self.min_gap} later do not fit in "
                             f"seq_len ({seq_len})")
        self.docs = [d for d in tokenize_files(tokenizer, files) if len(d) > seq_len]
        if not self.docs:
            raise ValueError(f"no text document is longer than seq_len ({seq_len})")
        self.cumulative = torch.tensor([len(d) for d in self.docs]).cumsum(0)

    def __len__(self):
        return self.num_rows

    def __getitem__(self, index):
        rng = random.Random(f"copy:{self.seed}:{index}")
        doc = self.docs[int(torch.searchsorted(self.cumulative, rng.randrange(int(self.cumulative[-1])), right=True))]
        start = rng.randrange(len(doc) - self.seq_len)
        ids = doc[start:start + self.seq_len].clone()
        span = rng.randint(self.min_span, self.max_span)
        gap = rng.randint(self.min_gap, min(self.max_gap, self.seq_len - 2 * span))
        first = rng.randrange(0, self.seq_len - gap - span + 1)
        second = first + gap
        ids[second:second + span] = ids[first:first + span].clone()
        labels = torch.full((self.seq_len,), IGNORE_INDEX)
        labels[second:second + span - 1] = ids[second + 1:second + span]  # labels[t] is token t + 1
        return {"input_ids": ids, "labels": labels, "position_ids": torch.arange(self.seq_len)}
