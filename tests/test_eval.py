"""hf_dilated.eval: bucketing and windowing against a hand computation, passkey scoring on models
whose answers are known, the command's errors, and the committed base model's recorded figures."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from hf_dilated.eval import core, runner
from hf_dilated.eval.passkey import min_length

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from byte_tokenizer import build_byte_tokenizer  # noqa: E402

BASE = ROOT / "examples" / "tiny_base"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random tiny Llama with the byte tokenizer, saved (32-token original context)."""
    from transformers import AutoModelForCausalLM

    from hf_dilated.model_configs import build_model_config

    tokenizer = build_byte_tokenizer()
    config = build_model_config("tiny-llama")
    config.vocab_size = len(tokenizer)
    config.bos_token_id, config.eos_token_id, config.pad_token_id = (
        tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    path = tmp_path_factory.mktemp("eval") / "tiny"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model, tokenizer, path


def hand_loss(model, tokens: torch.Tensor, t: int, start: int = 0) -> float:
    """The loss of token t given tokens start..t-1 only (positions from 0), one forward per target."""
    with torch.no_grad():
        logits = model(input_ids=tokens[None, start:t], use_cache=False).logits[0, -1].float()
    return float(F.cross_entropy(logits[None], tokens[t:t + 1]))


def test_buckets_and_windows_match_a_hand_computation(tiny):
    model, _, _ = tiny
    torch.manual_seed(1)
    docs = [torch.randint(0, 256, (50,)) for _ in range(2)]
    length, bucket, window, stride = 40, 16, 12, 5
    got = core.bucket_losses(model, docs, length, bucket, batch_size=1)
    per = {t: [hand_loss(model, d, t) for d in docs] for t in range(1, length)}
    want = []
    for k in range(3):  # buckets 1..15, 16..31, 32..39 (target positions)
        ts = [t for t in range(max(1, k * bucket), min(length, (k + 1) * bucket))]
        want.append(sum(sum(per[t]) for t in ts) / (len(ts) * len(docs)))
    assert got == pytest.approx(want, abs=1e-4)

    cut = core.windowed_losses(model, docs, length, bucket, window, stride, batch_size=3)
    assert cut[0] is None and len(cut) == 3
    # by hand: targets from `bucket` on, in chunks of `stride`; a chunk's last target sees exactly
    # `window` tokens, so target t sees tokens (chunk end - 1 - window)..t-1
    seen = {}
    for s in range(bucket, length, stride):
        end = min(s + stride, length)
        for t in range(s, end):
            seen[t] = end - 1 - window
    assert min(t - a for t, a in seen.items()) == window - stride + 1 and max(t - a for t, a in seen.items()) == window
    for k in (1, 2):
        ts = [t for t in seen if t // bucket == k]
        want = sum(hand_loss(model, d, t, seen[t]) for d in docs for t in ts) / (len(ts) * len(docs))
        assert cut[k] == pytest.approx(want, abs=1e-4)


class Oracle(torch.nn.Module):
    """Predicts the next input token (it sees the whole row), except at positions in `wrong`
    (counted from the end), where it predicts token 0."""

    def __init__(self, wrong=()):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.wrong = wrong

    def forward(self, input_ids, position_ids=None, use_cache=False):
        nxt = torch.cat([input_ids[:, 1:], input_ids[:, :1]], 1)
        for w in self.wrong:
            nxt[:, -w] = 0
        return SimpleNamespace(logits=F.one_hot(nxt, 300).float() + self.weight)


@pytest.mark.parametrize("wrong, keys, digits", [((), 1, 5), ((3,), 0, 4), ((7,), 1, 5)])
def test_passkey_scoring_on_models_with_known_answers(wrong, keys, digits):
    # the answer digits are the last five tokens, predicted at positions -6..-2: a wrong prediction
    # at -3 spoils one digit; one at -7 (before the answer) changes nothing
    tokenizer = build_byte_tokenizer()
    samples = core.make_passkey_samples(tokenizer, 300, 0.5, 3, seed=0)
    got_keys, got_digits = core.passkey_scores(Oracle(wrong), samples, batch_size=2)
    assert got_keys == [bool(keys)] * 3 and got_digits == [digits] * 3


def test_passkey_samples_are_the_same_for_every_run():
    tokenizer = build_byte_tokenizer()
    a = core.make_passkey_samples(tokenizer, 256, 0.25, 4, seed=5)
    b = core.make_passkey_samples(tokenizer, 256, 0.25, 4, seed=5)
    assert [s["key"] for s in a] == [s["key"] for s in b] and len({s["key"] for s in a}) > 1


def test_a_checkpoint_is_evaluated_under_the_attention_it_loads_with(tiny, tmp_path):
    """Without @ or --attn, eval read config.json's attn_implementation alone, which save_pretrained
    drops: a model saved under dilated_ring (the name kept in its hf_dilated entry, where
    from_pretrained reads it) was evaluated under sdpa."""
    import hf_dilated
    from transformers import AutoModelForCausalLM

    model, tokenizer, path = tiny
    saved = tmp_path / "saved"
    hf_dilated.patch(AutoModelForCausalLM.from_pretrained(path), "dilated_ring", context_length=64).save_pretrained(saved)
    tokenizer.save_pretrained(saved)
    assert "attn_implementation" not in json.loads((saved / "config.json").read_text())
    assert AutoModelForCausalLM.from_pretrained(saved).config._attn_implementation == "dilated_ring"
    assert runner.parse_runs([str(saved)], None)[0].attns == ["dilated_ring"]


def _bpe_tokenizer():
    """The byte tokenizer with one merge ("Th"): not one token per character, no chat template
    (a base model's, as Llama-2's)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from byte_tokenizer import SPECIAL_TOKENS, _byte_symbols

    vocab = {s: i for i, s in enumerate(_byte_symbols())}
    vocab["Th"] = len(vocab)
    for i, token in enumerate(SPECIAL_TOKENS.values()):
        vocab[token] = 257 + i
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[("T", "h")]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(SPECIAL_TOKENS.values()))
    return PreTrainedTokenizerFast(tokenizer_object=backend, **SPECIAL_TOKENS)


def test_passkey_samples_of_a_base_model_with_another_tokenizer_are_plain_text():
    """The trained format counts characters as tokens; a tokenizer without a chat template that is
    not one token per character (a base model's) raised after the perplexity had run, and nothing
    was written. It takes the plain-text format, answered by generation."""
    tokenizer = _bpe_tokenizer()
    assert tokenizer.chat_template is None
    samples = core.make_passkey_samples(tokenizer, 300, 0.5, 2, seed=0)
    assert all("labels" not in s and s["key"] in tokenizer.decode(s["input_ids"]) for s in samples)
    assert all(len(s["input_ids"]) <= 300 for s in samples)


def test_a_generated_answer_is_right_when_the_number_it_says_is_the_key():
    """The key counted as found anywhere in the generated text: " 171432." and "12345. No wait,
    71432" were right answers for 71432."""
    tokenizer = build_byte_tokenizer()

    class Says(torch.nn.Module):
        def __init__(self, answer):
            super().__init__()
            self.answer = answer
            self.weight = torch.nn.Parameter(torch.zeros(1))

        def generate(self, ids, **kwargs):
            return torch.cat([ids, torch.tensor([tokenizer(self.answer, add_special_tokens=False)["input_ids"]])], 1)

    sample = {"input_ids": torch.tensor([1, 2, 3]), "key": "71432"}
    for answer, right, digits in ((" 71432.", True, 5), (" 171432.", False, 0), (" 714329.", False, 5),
                                  (" 12345. No wait, 71432", False, 0), (" 7143", False, 4)):
        assert core.generated_passkey_scores(Says(answer), tokenizer, [sample]) == ([right], [digits]), answer


def cli(argv, capsys):
    code = runner.cli([str(a) for a in argv])
    return code, capsys.readouterr()


def test_errors_name_the_argument(tiny, tmp_path, capsys):
    model, _, path = tiny
    no_tokenizer = tmp_path / "bare"
    model.save_pretrained(no_tokenizer)
    capsys.readouterr()  # (its progress bar)
    short = tmp_path / "short.txt"
    short.write_text("x = 1\n")
    long = tmp_path / "long.txt"
    long.write_text("x = 1\n" * 60)
    cases = [
        (["--model", tmp_path / "nothing"], "--model: no checkpoint at"),
        (["--model", f"{path}@nope"], "--model: unknown attention 'nope'"),
        (["--model", f"{path}@sdpa", "--attn", "dilated"], "--attn: every --model entry names its attentions"),
        # options of a part that does not run, and nothing to run
        (["--model", path, "--bucket", 16], "--bucket: --text measures nothing here"),
        (["--model", path, "--samples", 0, "--depths", 0.5, "--text", long], "--depths: --samples measures nothing"),
        (["--model", path, "--no-cost", "--cost-repeats", 7], "--cost-repeats: the cost (--no-cost) measures nothing"),
        (["--model", path, "--samples", 0, "--no-cost"], "nothing to measure"),
        (["--model", path, "--attn", "nope"], "--attn: unknown attention 'nope'"),
        (["--model", path, "--text", tmp_path / "missing.txt"], "--text: no such file or directory"),
        (["--model", path, "--text", short, "--lengths", 200], "--text: " + str(short) + " has 7 tokens, fewer than --ppl-length 200"),
        (["--model", path, "--lengths", 50], f"--lengths: a passkey sample needs at least {min_length()} tokens"),
        (["--model", path, "--depths", 2], "--depths must lie in [0, 1]"),
        # 0 was taken for the default, a negative value raised a traceback, a stride past the window too
        (["--model", path, "--ppl-length", 0], "--ppl-length must be >= 1, got 0"),
        (["--model", path, "--window-stride", 0], "--window-stride must be >= 1, got 0"),
        (["--model", path, "--bucket", -64], "--bucket must be >= 1, got -64"),
        (["--model", path, "--max-docs", 0], "--max-docs must be >= 1, got 0"),
        (["--model", path, "--text", long, "--samples", 0, "--bucket", 16, "--window-stride", 100],
         "--window-stride (100) must not exceed --window (16)"),
        # no position past --bucket to cut: "stack expects a non-empty TensorList"
        (["--model", path, "--text", long, "--samples", 0, "--lengths", 128, "--bucket", 256],
         "--ppl-length (128, else the longest --lengths) must exceed --bucket (256"),
        # a window without cut rows cut nothing, and the report described it; a checkpoint without a
        # tokenizer failed after the models before it had run, with transformers' traceback
        (["--model", path, "--text", long, "--samples", 0, "--cut-rows", "none", "--window", 16],
         "--window: --cut-rows none measures nothing here"),
        (["--model", path, "--model", f"bare={no_tokenizer}"], f"--model: {no_tokenizer} holds no tokenizer that loads"),
    ]
    for argv, message in cases:
        code, out = cli(argv + ["--no-progress"], capsys)
        assert code == 2, argv
        lines = out.err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("hf-dilated eval: error: ") and message in lines[0], (argv, out.err)


def test_add_arguments_and_main_are_what_the_cli_uses(tiny, tmp_path, capsys):
    _, _, path = tiny
    doc = tmp_path / "doc.txt"
    doc.write_text("def f(x):\n    return x + 1\n" * 10)
    parser = argparse.ArgumentParser()
    runner.add_arguments(parser)
    from hf_dilated import eval as package

    assert package.add_arguments is runner.add_arguments and package.main is runner.main
    args = parser.parse_args(["--model", f"t={path}@sdpa,dilated", "--text", str(doc), "--lengths", str(min_length()),
                              "128", "--samples", "1", "--depths", "0", "--bucket", "32", "--no-progress",
                              "--output-dir", str(tmp_path / "out")])
    assert package.main(args) == 0
    result = json.loads((tmp_path / "out" / "eval.json").read_text())
    sdpa, dilated = result["rows"]
    assert len(sdpa["loss_by_bucket"]) == 4 and sdpa["windowed_loss_by_bucket"][0] is None
    assert all(c["peak_bytes"] >= 0 and c["seconds"] > 0 for c in sdpa["cost"])
    # the dilated levels of this preset cover the first 32 tokens densely: bucket 0 agrees with sdpa
    assert dilated["loss_by_bucket"][0] == pytest.approx(sdpa["loss_by_bucket"][0], abs=1e-4)
    assert "| t | sdpa |" in (tmp_path / "out" / "eval.md").read_text()
    # Another run into the same folder, without --text: the first run's loss plot went with its report
    # (it stayed beside the new one); the user's own file stays, and nothing is left aside.
    (tmp_path / "out" / "mine.txt").write_text("kept\n")
    args = parser.parse_args(["--model", f"t={path}@sdpa", "--lengths", str(min_length()), "--samples", "1",
                              "--depths", "0", "--no-cost", "--no-progress", "--output-dir", str(tmp_path / "out")])
    assert package.main(args) == 0
    printed = capsys.readouterr().out  # where the plots are, not where they were written first
    assert f"wrote {tmp_path / 'out' / 'passkey.png'}" in printed and ".eval-" not in printed
    left = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert "loss_by_position.png" not in left and "mine.txt" in left and "eval.json" in left
    assert not [name for name in left if name.startswith(".")]
    args.output_dir = str(doc / "sub")  # under a file: an error before anything is evaluated
    assert package.main(args) == 2 and "--output-dir: " in capsys.readouterr().err


def test_plots_are_skipped_with_a_note_without_matplotlib(monkeypatch, tmp_path):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *a, **k):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    notes = runner.plots({"settings": {}, "rows": []}, tmp_path)
    assert notes == ["plots skipped: matplotlib is not installed (pip install matplotlib)"]


@pytest.mark.skipif(not (BASE / "model.safetensors").is_file(), reason="no committed base model")
def test_committed_base_model_scores_within_its_recorded_figures():
    """The committed base model at its own context: loss on a held-out slice and passkey keys."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from data import stdlib_files, tokenize_files

    record = json.loads((BASE / "training.json").read_text())
    figures = record["figures"]
    L = record["context"]
    model = AutoModelForCausalLM.from_pretrained(BASE, attn_implementation="sdpa").eval()
    tokenizer = AutoTokenizer.from_pretrained(BASE)
    files = stdlib_files("heldout", min_bytes=4 * L + 64)[:4]
    docs = [d[:L] for d in tokenize_files(tokenizer, files)]
    loss = core.bucket_losses(model, docs, L, L)[0]
    assert loss == pytest.approx(figures["slice_loss_0_L"], abs=0.02)
    assert figures["heldout_loss_0_L"] < 3.0  # nats per byte; a random model scores about 5.6
    samples = [s for d in (0.0, 0.5, 1.0) for s in core.make_passkey_samples(tokenizer, L, d, 4, seed=1234)]
    keys, _ = core.passkey_scores(model, samples, batch_size=6)
    assert sum(keys) / len(keys) >= figures["slice_passkey_keys_at_L"] - 1 / 12


def test_pairs_read_are_counted_exactly(tiny, tmp_path):
    """eval's "pairs" column: 1 for sdpa and for a band that reads every far key; with sparse far keys
    (docs/contract.md 4.2) between what the band and the sinks read and that plus one block each."""
    _, _, path = tiny
    config = json.loads((path / "config.json").read_text())
    sparse = tmp_path / "sparse"
    sparse.mkdir()
    for f in path.iterdir():
        (sparse / f.name).write_bytes(f.read_bytes())
    config["hf_dilated"] = {"segment_lengths": [256], "dilation_rates": [1], "local_window": 32, "far_band": 16,
                            "far_top_k": 1, "far_block_size": 8, "far_sinks": 1}
    (sparse / "config.json").write_text(json.dumps(config))
    doc = tmp_path / "doc.txt"
    doc.write_text("def f(x):\n    return x + 1\n" * 10)
    args = argparse.ArgumentParser()
    runner.add_arguments(args)
    args = args.parse_args(["--model", f"t={path}@sdpa", f"s={sparse}@dilated", "--text", str(doc), "--lengths", "128",
                            "--samples", "0", "--no-cost", "--bucket", "32", "--no-progress",
                            "--output-dir", str(tmp_path / "out")])
    assert runner.main(args) == 0
    dense, ours = json.loads((tmp_path / "out" / "eval.json").read_text())["rows"]
    assert dense["pairs_read"] == 1.0
    n = 128
    full = n * (n + 1) // 2
    inside = 32 * 33 // 2  # queries before the local window read every key
    low = inside + (n - 32) * (16 + 8 + 1)  # band, sink block, at least one selected key
    high = inside + (n - 32) * (16 + 8 + 8)
    assert low / full <= ours["pairs_read"] <= high / full
    assert "| s | dilated |" in (tmp_path / "out" / "eval.md").read_text()
