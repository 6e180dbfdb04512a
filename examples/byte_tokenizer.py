"""A byte-level tokenizer built locally (no download): token id = byte value, plus three specials.

It is a plain `tokenizers` BPE model with the 256 byte-level symbols and no merges, wrapped in
transformers' fast tokenizer, so `save_pretrained` writes a `tokenizer.json` that
`AutoTokenizer.from_pretrained` reloads anywhere. Every digit is one token, which keeps the
passkey answer a fixed five tokens.
"""
from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>"}
VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)


def _byte_symbols() -> list[str]:
    """The printable stand-in the byte-level pre-tokenizer uses for each byte value 0..255 (GPT-2's table)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    symbols, extra = {}, 0
    for b in range(256):
        if b in printable:
            symbols[b] = chr(b)
        else:
            symbols[b] = chr(256 + extra)
            extra += 1
    return [symbols[b] for b in range(256)]


def build_byte_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {symbol: i for i, symbol in enumerate(_byte_symbols())}
    for i, token in enumerate(SPECIAL_TOKENS.values()):
        vocab[token] = 256 + i
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS.values()))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, model_max_length=1 << 30, **SPECIAL_TOKENS)
