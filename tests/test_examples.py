"""The examples run end to end: the fine-tuning script (one process, and two processes under
`accelerate launch` with sequence parallelism), resume, the merged checkpoint, packing, and the
passkey evaluation. Real scripts in real subprocesses, on a tiny Llama built from the tiny-llama
preset with the examples' byte-level tokenizer (nothing downloaded)."""
from __future__ import annotations

import contextlib
import json
import math
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
sys.path.insert(0, str(EXAMPLES))

from byte_tokenizer import build_byte_tokenizer  # noqa: E402
from data import AlternatingDataset, PackedTextDataset, PasskeyDataset, pack_documents  # noqa: E402
from passkey import IGNORE_INDEX, INTRO, KEY_COPIES, KEY_DIGITS, min_length, passkey_sample  # noqa: E402

SEQ_LEN = 256  # 4x the tiny model's 64-token "pretraining" context: three dilated levels
TIMEOUT = 300


def run(cmd, **kwargs):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "ACCELERATE_DISABLE_RICH": "1"}
    proc = subprocess.run([str(c) for c in cmd], cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT,
                          **kwargs)
    if proc.returncode != 0:
        raise AssertionError(f"{cmd} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[:4000]}\n...\n{proc.stderr[-3000:]}")
    return proc


def read_log(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Llama (tiny-llama preset, byte vocabulary, 64-token context), converted to SEQ_LEN
    tokens with `hf-dilated convert`."""
    from transformers import AutoModelForCausalLM

    import hf_dilated  # noqa: F401
    from hf_dilated.model_configs import build_model_config

    root = tmp_path_factory.mktemp("examples")
    tokenizer = build_byte_tokenizer()
    config = build_model_config("tiny-llama")
    config.vocab_size = len(tokenizer)
    config.bos_token_id, config.eos_token_id, config.pad_token_id = (
        tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    config.max_position_embeddings = 64
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model.save_pretrained(root / "base")
    tokenizer.save_pretrained(root / "base")
    run(["hf-dilated", "convert", root / "base", root / "long", "--attn", "dilated_ring", "--context", SEQ_LEN])
    return root


def finetune_cmd(checkpoint, out, *extra, python=(sys.executable,)):
    return [*python, EXAMPLES / "finetune_long_context.py", "--model", checkpoint / "long", "--output-dir", out,
            "--attn", "dilated_ring", "--seq-len", SEQ_LEN, "--max-steps", 2, "--lr", "1e-2", "--warmup-steps", 0,
            "--save-every", 1, "--no-progress", "--log-file", out / "log.jsonl", *extra]


@pytest.fixture(scope="module")
def single_run(checkpoint):
    out = checkpoint / "single"
    run(finetune_cmd(checkpoint, out))
    return out


def test_two_steps_single_process(single_run):
    log = read_log(single_run / "log.jsonl")
    assert [r["step"] for r in log] == [1, 2]
    assert all(torch.isfinite(torch.tensor(r["loss"])) and r["tokens_per_s"] > 0 for r in log)
    assert log[1]["loss"] != log[0]["loss"]  # the first step changed the weights
    for path in ("adapter/adapter_model.safetensors", "adapter/adapter_config.json", "model/model.safetensors",
                 "model/config.json", "model/tokenizer.json", "checkpoints/step-000002/trainable.safetensors",
                 "checkpoints/step-000002/optimizer.safetensors"):
        assert (single_run / path).is_file(), path
    adapter = json.loads((single_run / "adapter/adapter_config.json").read_text())
    assert set(adapter["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert {"embed_tokens", "norm"} <= set(adapter["modules_to_save"])


def test_sequence_parallel_two_processes_matches_single_process(checkpoint, single_run, tmp_path, monkeypatch):
    """Two processes under sequence parallelism train as one does, and each rank leaves without the
    interpreter's teardown of its process groups (there DDP's reducer once destroyed a gloo group
    with the GIL held, and the rank hung in its destructor): a sitecustomize on the ranks' path marks
    every interpreter that runs its atexit handlers, and no rank of the script may."""
    out = checkpoint / "sp2"
    marks = tmp_path / "teardowns"
    marks.mkdir()
    (tmp_path / "sitecustomize.py").write_text(
        "import atexit, os, sys\n"
        f"atexit.register(lambda: open(os.path.join({str(marks)!r}, str(os.getpid())), 'w')"
        ".write(sys.argv[0]))\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, (str(tmp_path), os.environ.get("PYTHONPATH")))))
    run(["accelerate", "launch", "--config_file", EXAMPLES / "accelerate_configs/cpu_2proc.yaml",
         "--main_process_port", free_port(), *finetune_cmd(checkpoint, out, "--sp-size", 2, "--no-final-model", python=())])
    torn_down = [Path(p.read_text()).name for p in marks.iterdir()]  # each interpreter's program
    assert "accelerate" in torn_down  # the launcher's own exit: the marks work
    assert "finetune_long_context.py" not in torn_down, torn_down
    single, sp = read_log(single_run / "log.jsonl"), read_log(out / "log.jsonl")
    assert [r["step"] for r in sp] == [1, 2]
    for a, b in zip(single, sp):  # step 2's loss also checks step 1's gradients
        assert abs(a["loss"] - b["loss"]) < 1e-4 * max(1.0, abs(a["loss"])), (a, b)
        assert a["accuracy"] == b["accuracy"]
    w_single = load_trainable(single_run / "checkpoints/step-000002")
    w_sp = load_trainable(out / "checkpoints/step-000002")
    assert w_single.keys() == w_sp.keys()
    for name in w_single:
        torch.testing.assert_close(w_sp[name], w_single[name], atol=1e-4, rtol=1e-3, msg=name)


def test_sequence_parallel_row_mean_loss_matches_single_process(checkpoint):
    """--loss-mean row under sequence parallelism: each rank divides its shard of a row by the
    whole row's label count. Passkey rows with 0..2 recalls give rows different counts."""
    extra = ("--data", "passkey", "--passkey-recalls", 2, "--batch-size", 2, "--loss-mean", "row", "--no-final-model")
    single, sp = checkpoint / "row_single", checkpoint / "row_sp2"
    run(finetune_cmd(checkpoint, single, *extra))
    run(["accelerate", "launch", "--config_file", EXAMPLES / "accelerate_configs/cpu_2proc.yaml",
         "--main_process_port", free_port(), *finetune_cmd(checkpoint, sp, "--sp-size", 2, *extra, python=())])
    for a, b in zip(read_log(single / "log.jsonl"), read_log(sp / "log.jsonl"), strict=True):
        assert abs(a["loss"] - b["loss"]) < 1e-4 * max(1.0, abs(a["loss"])), (a, b)


def load_trainable(path):
    from safetensors.torch import load_file

    return load_file(str(path / "trainable.safetensors"))


def test_resume_continues_exactly(checkpoint, single_run):
    out = checkpoint / "resumed"
    run(finetune_cmd(checkpoint, out, "--stop-after-steps", 1))
    assert not (out / "model").exists()  # an interrupted run writes no final model
    assert [r["step"] for r in read_log(out / "log.jsonl")] == [1]
    proc = run(finetune_cmd(checkpoint, out, "--resume", "auto"))
    assert "resumed from" in proc.stdout + proc.stderr
    log, reference = read_log(out / "log.jsonl"), read_log(single_run / "log.jsonl")
    assert [r["step"] for r in log] == [1, 2]
    assert log[1]["loss"] == pytest.approx(reference[1]["loss"], rel=1e-6, abs=1e-6)
    resumed, straight = load_trainable(out / "checkpoints/step-000002"), load_trainable(single_run / "checkpoints/step-000002")
    for name in straight:
        torch.testing.assert_close(resumed[name], straight[name], atol=1e-6, rtol=1e-5, msg=name)


def test_merged_checkpoint_equals_base_plus_adapter(checkpoint, single_run):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    import hf_dilated  # noqa: F401

    sample = passkey_sample(build_byte_tokenizer(), SEQ_LEN, 0.3, random.Random(5))
    ids = sample["input_ids"][None]
    base = AutoModelForCausalLM.from_pretrained(checkpoint / "long", attn_implementation="dilated_ring")
    with_adapter = PeftModel.from_pretrained(base, single_run / "adapter").eval()
    merged = AutoModelForCausalLM.from_pretrained(single_run / "model", attn_implementation="dilated_ring").eval()
    assert merged.config.hf_dilated == base.config.hf_dilated
    with torch.no_grad():
        expected = with_adapter(input_ids=ids).logits
        got = merged(input_ids=ids).logits
        untrained = AutoModelForCausalLM.from_pretrained(checkpoint / "long", attn_implementation="dilated_ring")(input_ids=ids).logits
    assert (expected - untrained).abs().max() > 1e-3  # the adapter does something
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)


def test_eval_writes_table_json_and_plots(checkpoint, single_run, tmp_path):
    """`python -m hf_dilated.eval` (formerly examples/eval_passkey.py) on the fine-tuned tiny model."""
    doc = tmp_path / "held_out.txt"
    doc.write_text("def f(x):\n    return x + 1\n" * 20)
    out = checkpoint / "eval"
    proc = run([sys.executable, "-m", "hf_dilated.eval", "--model", f"ft={single_run / 'model'}@dilated_ring,sdpa",
                "--text", doc, "--lengths", min_length(), SEQ_LEN, "--depths", 0, 1, "--samples", 2, "--bucket", 64,
                "--output-dir", out, "--no-progress"])
    result = json.loads((out / "eval.json").read_text())
    assert [(r["model"], r["attn"]) for r in result["rows"]] == [("ft", "dilated_ring"), ("ft", "sdpa")]
    for r in result["rows"]:
        assert {(c["length"], c["depth"]) for c in r["passkey"]} == {(n, d) for n in (min_length(), SEQ_LEN) for d in (0.0, 1.0)}
        assert all(c["samples"] == 2 and 0 <= c["correct"] <= 2 for c in r["passkey"])
        assert len(r["loss_by_bucket"]) == SEQ_LEN // 64 and r["windowed_loss_by_bucket"][0] is None
        assert [c["length"] for c in r["cost"]] == [min_length(), SEQ_LEN]
    table = (out / "eval.md").read_text()
    assert "| ft | dilated_ring | 256 |" in table and table.strip() in proc.stdout
    for png in ("passkey.png", "loss_by_position.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_pretrain_tiny_names_what_it_cannot_take(tmp_path, capsys):
    """--export dropped every training option (a misspelt one too) without a word; --export onto
    itself raised SameFileError; a missing --init raised FileNotFoundError from copytree."""
    import pretrain_tiny

    for argv, match in (([ "--export", "m", "--output-dir", str(tmp_path / "e"), "--bogus-flag", "3"],
                         "--export copies a model and trains nothing: --bogus-flag 3 not taken"),
                        (["--export", str(tmp_path / "m"), "--output-dir", str(tmp_path / "m")],
                         "--output-dir: --export copies MODEL_DIR elsewhere"),
                        (["--output-dir", str(tmp_path / "p"), "--init", str(tmp_path / "none")],
                         "--init: no checkpoint")):
        with pytest.raises(SystemExit) as stop:
            pretrain_tiny.main(argv)
        assert stop.value.code == 2 and match in capsys.readouterr().err
    assert not (tmp_path / "e").exists() and not (tmp_path / "p").exists()


def test_text_and_passkey_mixture_trains(checkpoint, tmp_path):
    """pretrain_tiny's data: local text files and generated passkey rows, alternating."""
    text = tmp_path / "doc.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 200)
    out = tmp_path / "mix"
    run(finetune_cmd(checkpoint, out, "--data", "passkey", text, "--passkey-recalls", 2, "--passkey-max-doc-len", 200,
                     "--batch-size", 2, "--no-final-model", "--loss-mean", "row"))
    logs = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logs] == [1, 2] and all(math.isfinite(r["loss"]) for r in logs)


@pytest.mark.parametrize("loss_mean", ["token", "row"])
def test_loss_mean_over_tokens_or_rows(checkpoint, loss_mean):
    """--loss-mean token: every labelled token weighs the same; row: every row weighs the same,
    whatever its number of labels (a passkey row's few answer digits against a text row)."""
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from finetune_long_context import forward_loss

    model = AutoModelForCausalLM.from_pretrained(checkpoint / "base", attn_implementation="sdpa")
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, 256, (3, 32), generator=g)
    labels = torch.full((3, 32), IGNORE_INDEX)
    labels[0, :31] = input_ids[0, 1:]  # a fully labelled text row
    labels[1, 10:13] = input_ids[1, 11:14]  # three labels
    # row 2 has no label: it counts in neither mean
    batch = {"input_ids": input_ids, "labels": labels, "position_ids": torch.arange(32).expand(3, 32)}
    loss, hits, count = forward_loss(model, batch, "cpu", None, loss_mean)
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits.float()
    per_token = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX,
                                reduction="none").view(3, 32)
    mask = labels != IGNORE_INDEX
    if loss_mean == "token":
        expected = per_token[mask].mean()
    else:
        expected = (per_token[0, mask[0]].mean() + per_token[1, mask[1]].mean()) / 2
    assert int(count) == 34
    torch.testing.assert_close(loss.detach(), expected, rtol=1e-5, atol=1e-6)


def test_bad_training_options_are_named_before_anything_runs():
    """--keep-checkpoints 0 deleted every checkpoint --save-every had saved; LoRA's options under
    --full-finetune were ignored; a --seq-len too short for passkey rows raised a traceback from the
    dataset; other out-of-range values trained on."""
    from finetune_long_context import parse_args

    base = ["--model", "m", "--output-dir", "o", "--seq-len", "256", "--max-steps", "1"]
    for extra, match in ((["--keep-checkpoints", "0"], "--keep-checkpoints must be >= 1, got 0"),
                         (["--lora-dropout", "7"], r"--lora-dropout must be in \[0, 1\), got 7"),
                         (["--lr", "-1"], "--lr must be > 0"),
                         (["--min-lr-ratio", "2"], r"--min-lr-ratio must be in \[0, 1\]"),
                         (["--full-finetune", "--lora-rank", "64"], "--lora-rank configure LoRA, which --full-finetune"),
                         (["--seq-len", "64"], "--seq-len 64 is shorter than a passkey row"),
                         (["--data", "doc.txt", "--passkey-recalls", "2"],
                          r"--passkey-recalls shapes passkey rows \(--data passkey\), which --data does not read"),
                         (["--max-rows", "5"], r"--max-rows shapes text files \(--data FILE \.\.\.\), which --data")):
        with pytest.raises(SystemExit, match=match):
            parse_args([*base, *extra])
    assert parse_args([*base, "--full-finetune", "--keep-checkpoints", "1"]).full_finetune


def test_passkey_ratio_without_a_mixture_is_refused():
    from finetune_long_context import parse_args

    base = ["--model", "m", "--output-dir", "o", "--seq-len", "256", "--max-steps", "1"]
    for data in (["passkey"], ["doc.txt"]):
        with pytest.raises(SystemExit, match="--passkey-ratio"):
            parse_args([*base, "--data", *data, "--passkey-ratio", "3"])
    with pytest.raises(SystemExit, match="--passkey-ratio"):
        parse_args([*base, "--data", "passkey", "doc.txt", "--passkey-ratio", "0"])
    assert parse_args([*base, "--data", "passkey", "doc.txt", "--passkey-ratio", "3"]).passkey_ratio == 3


def test_seq_len_beyond_the_checkpoint_context_asks_for_a_conversion(checkpoint, tmp_path):
    cmd = finetune_cmd(checkpoint, tmp_path, "--seq-len", 2 * SEQ_LEN)
    cmd[cmd.index("--model") + 1] = checkpoint / "base"
    proc = subprocess.run([str(c) for c in cmd], cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode != 0 and "hf-dilated convert" in proc.stderr


# --- data (in process) ---------------------------------------------------------------------------


def test_passkey_sample_format():
    tokenizer = build_byte_tokenizer()
    for length, depth in ((min_length(), 0.0), (500, 0.5), (1000, 1.0), (1000, 0.25)):
        s = passkey_sample(tokenizer, length, depth, random.Random(length))
        assert s["input_ids"].shape == s["labels"].shape == (length,)
        answer = s["labels"][s["labels"] != IGNORE_INDEX]
        assert tokenizer.decode(answer) == s["key"] and len(s["key"]) == KEY_DIGITS
        # labels are shifted: the last five tokens are the answer, predicted from the five before
        assert torch.equal(s["labels"][-KEY_DIGITS - 1:-1], s["input_ids"][-KEY_DIGITS:])
        text = tokenizer.decode(s["input_ids"][1:])
        assert text.endswith(f"The pass key is <{s['key']}")
        filler = length - min_length()
        where = text.index("The pass key is " + f"<{s['key']}>. " * KEY_COPIES) - len(INTRO)
        assert abs(where - depth * filler) <= 60  # the nearest sentence boundary
    with pytest.raises(ValueError, match="length"):
        passkey_sample(tokenizer, min_length() - 1, 0.5, random.Random(0))
    with pytest.raises(ValueError, match="depth"):
        passkey_sample(tokenizer, 500, 1.5, random.Random(0))
    with pytest.raises(ValueError, match="recalls"):
        passkey_sample(tokenizer, 500, 0.5, random.Random(0), recalls=-1)


def test_passkey_recalls_are_answered_mid_text_and_labelled():
    tokenizer = build_byte_tokenizer()
    s = passkey_sample(tokenizer, 1000, 0.1, random.Random(3), recalls=3)
    text = tokenizer.decode(s["input_ids"][1:])
    question = "What is the pass key? The pass key is <"
    assert s["input_ids"].shape == (1000,) and text.count(question) == 4 and text.endswith(question + s["key"])
    assert text.count(f"{question}{s['key']}>. ") == 3 and text.index(question) > text.index(f"<{s['key']}>. " * KEY_COPIES)
    labelled = s["labels"] != IGNORE_INDEX
    assert tokenizer.decode(s["labels"][labelled]) == s["key"] * 4
    # every labelled position predicts the token after it, and sits right after a question's "<" or a key digit
    at = labelled.nonzero().flatten()
    assert torch.equal(s["labels"][at], s["input_ids"][at + 1])
    assert all(tokenizer.decode(s["input_ids"][t]) == "<" for t in at[::KEY_DIGITS].tolist())
    # too many recalls for the room: as many as fit, the length is still exact
    crowded = passkey_sample(tokenizer, min_length() + 60, 0.0, random.Random(3), recalls=10)
    assert crowded["input_ids"].shape == (min_length() + 60,)
    assert (crowded["labels"] != IGNORE_INDEX).sum() == 2 * KEY_DIGITS


def test_passkey_rows_pack_documents_deterministically():
    tokenizer = build_byte_tokenizer()
    data = PasskeyDataset(tokenizer, 1024, 10, seed=3)
    row = data[7]
    assert all(torch.equal(row[k], data[7][k]) for k in row)  # item i never changes (resume relies on it)
    starts = (row["position_ids"] == 0).nonzero().flatten().tolist()
    assert starts[0] == 0 and len(starts) >= 1
    assert (row["position_ids"][1:] - row["position_ids"][:-1] != 1).nonzero().flatten().add(1).tolist() == starts[1:]
    assert (row["labels"] != IGNORE_INDEX).sum() == KEY_DIGITS * len(starts)  # the answers
    recalled = PasskeyDataset(tokenizer, 1024, 10, seed=3, recalls=2)[7]  # 0..2 extra answers per document
    answers = int((recalled["labels"] != IGNORE_INDEX).sum()) // KEY_DIGITS
    docs = int((recalled["position_ids"] == 0).sum())
    assert docs <= answers <= 3 * docs
    short = PasskeyDataset(tokenizer, 1024, 10, seed=3, max_doc_len=300)[7]
    doc_starts = (short["position_ids"] == 0).nonzero().flatten().tolist() + [1024]
    lengths = [b - a for a, b in zip(doc_starts, doc_starts[1:])]
    assert len(lengths) >= 1024 // 300 and all(n <= 300 for n in lengths[:-1])  # the last takes the rest
    with pytest.raises(ValueError, match="max_doc_len"):
        PasskeyDataset(tokenizer, 1024, 10, max_doc_len=10)
    everything = PasskeyDataset(tokenizer, 1024, 10, seed=3, learn_all=True)[7]  # only document ends unlabelled
    assert torch.equal(torch.nonzero(everything["labels"] == IGNORE_INDEX).flatten() + 1,
                       torch.tensor(starts[1:] + [1024]))


def test_alternating_dataset_interleaves_rows():
    first, second = [{"x": torch.tensor([i])} for i in range(3)], [{"x": torch.tensor([10 + i])} for i in range(5)]
    data = AlternatingDataset(first, second)
    assert len(data) == 6 and [int(data[i]["x"]) for i in range(6)] == [0, 10, 1, 11, 2, 12]
    with pytest.raises(IndexError):
        data[6]
    data = AlternatingDataset(first, second, second_rows=2)  # one row of the first, then two of the second
    assert len(data) == 6 and [int(data[i]["x"]) for i in range(6)] == [0, 10, 11, 1, 12, 13]
    with pytest.raises(ValueError, match="second_rows"):
        AlternatingDataset(first, second, second_rows=0)


def test_pack_documents_keeps_boundaries():
    rows = pack_documents([[1, 2, 3], [4, 5, 6, 7, 8], [9]], 4, pad_token_id=0)
    assert rows["input_ids"].tolist() == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 0, 0, 0]]
    assert rows["position_ids"].tolist() == [[0, 1, 2, 0], [0, 1, 2, 3], [0, 0, 1, 2]]
    assert rows["labels"].tolist() == [[2, 3, -100, -100], [6, 7, 8, -100], [-100, -100, -100, -100]]


def test_packed_text_dataset_from_text_and_jsonl(tmp_path):
    tokenizer = build_byte_tokenizer()
    (tmp_path / "a.txt").write_text("first document\nwith two lines\n")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "second"}) + "\n" + json.dumps({"text": "third doc"}) + "\n")
    data = PackedTextDataset(tokenizer, [str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl")], 16,
                             cache_dir=str(tmp_path / "cache"))
    ids = torch.cat([data[i]["input_ids"] for i in range(len(data))])
    positions = torch.cat([data[i]["position_ids"] for i in range(len(data))])
    text = tokenizer.decode([t for t in ids.tolist() if t != tokenizer.pad_token_id])
    for doc in ("first document\nwith two lines\n", "second", "third doc"):
        assert f"<|bos|>{doc}<|eos|>" in text
    # every document (bos) starts at position 0, and no label crosses into the next document
    bos = (ids == tokenizer.bos_token_id).nonzero().flatten()
    assert (positions[bos] == 0).all()
    labels = torch.cat([data[i]["labels"] for i in range(len(data))])
    eos = (ids == tokenizer.eos_token_id).nonzero().flatten()
    assert (labels[eos] == IGNORE_INDEX).all()
    with pytest.raises(ValueError, match="text_field|--text-field"):
        PackedTextDataset(tokenizer, [str(tmp_path / "b.jsonl")], 16, text_field="body", cache_dir=str(tmp_path / "c2"))


@pytest.mark.parametrize("attn", ["sdpa", "dilated_ring"])
def test_training_model_keeps_packed_documents_apart(checkpoint, attn):
    """A packed row's second document gets the same logits as the document on its own, with the model
    as the training loop loads it. For sdpa this rests on use_cache=False: with a cache, transformers
    skips its packed-sequence detection (masking_utils, transformers 5.23), so documents attend to each
    other; our attentions read the documents from the position ids either way."""
    import finetune_long_context

    args = finetune_long_context.parse_args(
        ["--model", str(checkpoint / "long"), "--output-dir", str(checkpoint / "unused"), "--attn", attn,
         "--seq-len", str(SEQ_LEN), "--max-steps", "1", "--full-finetune", "--no-gradient-checkpointing"])
    model = finetune_long_context.load_model(args, torch.float32)
    tokenizer = build_byte_tokenizer()
    rng = random.Random(0)
    docs = [[rng.randrange(256) for _ in range(n)] for n in (100, SEQ_LEN - 100)]
    rows = pack_documents(docs, SEQ_LEN, pad_token_id=tokenizer.pad_token_id)
    row = {k: v[0] for k, v in rows.items()}
    second = slice(100, SEQ_LEN)
    assert row["position_ids"][100] == 0 and len(rows["input_ids"]) == 1
    with torch.no_grad():
        packed = model(input_ids=row["input_ids"][None], position_ids=row["position_ids"][None]).logits[0, second]
        alone = model(input_ids=row["input_ids"][None, second], position_ids=row["position_ids"][None, second]).logits[0]
    torch.testing.assert_close(packed, alone, atol=1e-4, rtol=1e-4)


def logged_steps(path) -> list[int]:
    """The steps of a log file another process may be writing (complete lines only)."""
    if not Path(path).is_file():
        return []
    return [json.loads(line)["step"] for line in Path(path).read_text().splitlines(keepends=True) if line.endswith("\n")]


def launched_workers(launcher, script: str) -> dict:
    """A launcher's worker processes running `script`, by their RANK (their environment's)."""
    import psutil

    workers = {}
    for child in psutil.Process(launcher.pid).children(recursive=True):
        try:
            if any(part.endswith(script) for part in child.cmdline()):
                workers[int(child.environ()["RANK"])] = child
        except (psutil.NoSuchProcess, psutil.AccessDenied, KeyError):
            pass
    return workers


def end_process_tree(launcher, workers=()):
    """Continues (SIGCONT) and kills whatever still runs of the launcher, its children and `workers`."""
    import psutil

    procs = list(workers)
    try:
        procs += [psutil.Process(launcher.pid), *psutil.Process(launcher.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        pass
    for proc in procs:
        try:
            proc.resume()
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=30)
    launcher.wait(timeout=30)


def test_a_stopped_rank_becomes_an_error_within_the_timeout(checkpoint, tmp_path):
    """--timeout: two real gloo processes under accelerate launch; once step 1 is logged the test
    stops rank 1's process (SIGSTOP: a hung peer, nothing in the example helps). Rank 0's next
    collective fails after the 5 s timeout instead of blocking forever, and the launch fails."""
    import signal
    import time

    import psutil

    out = tmp_path / "stall"
    # --max-steps far beyond the stop (argparse keeps the last one): the run cannot end before it.
    cmd = ["accelerate", "launch", "--config_file", EXAMPLES / "accelerate_configs/cpu_2proc.yaml",
           "--main_process_port", free_port(),
           *finetune_cmd(checkpoint, out, "--no-final-model", "--timeout", 5, "--save-every", 0, "--max-steps", 50,
                         python=())]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "ACCELERATE_DISABLE_RICH": "1"}
    stderr_path = tmp_path / "stderr.txt"
    t0 = time.monotonic()
    with open(tmp_path / "stdout.txt", "w") as stdout, open(stderr_path, "w") as stderr:
        launcher = subprocess.Popen([str(c) for c in cmd], cwd=ROOT, env=env, stdout=stdout, stderr=stderr)
    workers = {}
    try:
        while not logged_steps(out / "log.jsonl"):  # training has started: step 1 is done on both ranks
            assert launcher.poll() is None, f"the launch ended before step 1:\n{stderr_path.read_text()[-3000:]}"
            assert time.monotonic() - t0 < TIMEOUT, "no step logged"
            time.sleep(0.02)
        workers = launched_workers(launcher, "finetune_long_context.py")
        assert sorted(workers) == [0, 1], workers
        workers[1].send_signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        while workers[1].status() != psutil.STATUS_STOPPED:
            assert time.monotonic() - stopped_at < 10, workers[1].status()
            time.sleep(0.01)
        seen = logged_steps(out / "log.jsonl")
        # Rank 0 alone: its next collective must fail (the launcher then ends rank 1).
        _, blocked = psutil.wait_procs([workers[0]], timeout=TIMEOUT)
        failed_after = time.monotonic() - stopped_at
        assert not blocked, "rank 0 still blocked"
        with contextlib.suppress(psutil.NoSuchProcess):
            workers[1].resume()  # the launcher's SIGTERM is pending on it: no waiting out its 30 s grace
        launcher.wait(timeout=TIMEOUT)
        elapsed = time.monotonic() - t0
    finally:
        end_process_tree(launcher, workers.values())
    stderr_text = stderr_path.read_text()
    assert launcher.returncode != 0, stderr_text[-2000:]
    assert failed_after < 60, failed_after  # bounded by the 5 s timeout, not by the stopped rank
    assert elapsed < 200, elapsed
    # Nothing after the step rank 1 was stopped in completed: rank 0 logged the steps it had seen,
    # or one more if rank 1 stopped right after that step's last collective, before rank 0's log line.
    steps = logged_steps(out / "log.jsonl")
    assert steps == list(range(1, len(steps) + 1)) and len(seen) <= len(steps) <= len(seen) + 1, (seen, steps)
    assert "timed out" in stderr_text.lower() or "timeout" in stderr_text.lower(), stderr_text[-3000:]


def test_copy_rows_repeat_a_span_far_back_and_label_only_the_repeat(tmp_path):
    from data import CopySpanDataset

    text = tmp_path / "doc.py"
    text.write_text("".join(f"line_{i} = {i * i}\n" for i in range(400)))
    tokenizer = build_byte_tokenizer()
    data = CopySpanDataset(tokenizer, [str(text)], 256, 20, seed=1, min_span=8, max_span=32)
    for i in range(20):
        row = data[i]
        assert all(torch.equal(row[k], data[i][k]) for k in row)  # seeded by index
        at = (row["labels"] != IGNORE_INDEX).nonzero().flatten()
        span = len(at) + 1
        assert 8 <= span <= 32 and torch.equal(at, torch.arange(at[0], at[0] + span - 1))  # one contiguous run
        second = int(at[0])
        ids = row["input_ids"]
        # the labelled tokens repeat a span that starts 64..(256 - 32 - 1) tokens earlier
        gaps = [g for g in range(64, second + 1) if torch.equal(ids[second - g:second - g + span], ids[second:second + span])]
        assert gaps, i
        assert torch.equal(row["labels"][at], ids[at + 1])


def test_multikey_documents_ask_every_key_at_the_end():
    from passkey import BRACKETS, multikey_length, multikey_sample

    tokenizer = build_byte_tokenizer()
    for keys in (1, 2, 4):
        s = multikey_sample(tokenizer, multikey_length(keys) + 100, random.Random(keys), keys)
        text = tokenizer.decode(s["input_ids"][1:])
        assert s["input_ids"].shape == (multikey_length(keys) + 100,) and text.endswith("The pass key is <" + s["key"])
        labelled = s["labels"] != IGNORE_INDEX
        assert int(labelled.sum()) == KEY_DIGITS * keys
        for o, c in BRACKETS[:keys]:
            assert text.count(o) == KEY_COPIES + 1  # the copies and the question
    with pytest.raises(ValueError, match="too short"):
        multikey_sample(tokenizer, multikey_length(3) - 1, random.Random(0), 3)


def test_stdlib_split_is_disjoint_and_mixture_rows_are_seeded():
    from data import TextPasskeyMixture, stdlib_files

    train, held = stdlib_files("train"), stdlib_files("heldout")
    assert train and held and not set(train) & set(held)
    tokenizer = build_byte_tokenizer()
    mix = TextPasskeyMixture(tokenizer, train[:3], 256, 50, passkey_fraction=0.5, seed=2)
    kinds = [int((mix[i]["labels"] != IGNORE_INDEX).sum()) == 256 for i in range(50)]
    assert 10 < sum(kinds) < 40  # text rows label every token, passkey rows only the digits
    assert all(torch.equal(mix[7][k], mix[7][k]) for k in mix[7])


def test_copy_rows_need_a_text_and_passkey_mixture():
    from finetune_long_context import parse_args

    with pytest.raises(SystemExit, match="--copy-rows"):
        parse_args(["--model", "m", "--output-dir", "o", "--seq-len", "64", "--max-steps", "1", "--copy-rows"])


def test_fsdp_with_sequence_parallelism_matches_single_process_and_resumes(checkpoint, single_run):
    """--fsdp --sp-size 4 on 4 gloo processes (FSDP2 over all of them, one sequence split 4 ways),
    stopped after step 1 and resumed from its sharded checkpoint: the same losses and accuracies as
    one process, and the saved model (LoRA merged, gathered from the shards) loads with
    from_pretrained and gives one process's logits under every attention name."""
    from transformers import AutoModelForCausalLM

    out = checkpoint / "fsdp_sp4"
    launch = ["accelerate", "launch", "--config_file", EXAMPLES / "accelerate_configs/cpu_4proc_fsdp.yaml"]
    run([*launch, "--main_process_port", free_port(),
         *finetune_cmd(checkpoint, out, "--fsdp", "--sp-size", 4, "--stop-after-steps", 1, python=())])
    assert (out / "checkpoints/step-000001/sharded/.metadata").is_file()
    assert not (out / "model").exists()
    proc = run([*launch, "--main_process_port", free_port(),
                *finetune_cmd(checkpoint, out, "--fsdp", "--sp-size", 4, "--resume", "auto", python=())])
    assert "resumed from" in proc.stdout + proc.stderr and "fsdp=dp_sp" in proc.stdout + proc.stderr
    single, sharded = read_log(single_run / "log.jsonl"), read_log(out / "log.jsonl")
    assert [r["step"] for r in sharded] == [1, 2]
    for a, b in zip(single, sharded):  # step 2's loss also checks step 1's update
        assert abs(a["loss"] - b["loss"]) < 1e-4 * max(1.0, abs(a["loss"])), (a, b)
        assert a["accuracy"] == b["accuracy"]
    ids = torch.randint(3, 200, (1, SEQ_LEN), generator=torch.Generator().manual_seed(3))
    for attn in ("dilated_ring", "ring", "block_sparse_ring", "dilated", "block_sparse", "sdpa"):
        with torch.no_grad():
            got = AutoModelForCausalLM.from_pretrained(out / "model", attn_implementation=attn)(ids).logits
            want = AutoModelForCausalLM.from_pretrained(single_run / "model", attn_implementation=attn)(ids).logits
        assert torch.isfinite(got).all(), attn
        torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3, msg=attn)


def test_fsdp_bf16_full_finetune_runs(checkpoint):
    """--fsdp with FSDP2's bf16 MixedPrecisionPolicy (float32 reduction), sharded over the
    data-parallel replicas only (--fsdp-shard dp), full fine-tuning, 2 micro-steps per step, 2 x 2:
    it trains (finite, changing losses); exactness is not expected of bf16."""
    out = checkpoint / "fsdp_bf16"
    proc = run(["accelerate", "launch", "--config_file", EXAMPLES / "accelerate_configs/cpu_4proc_fsdp.yaml",
                "--main_process_port", free_port(),
                *finetune_cmd(checkpoint, out, "--fsdp", "--fsdp-shard", "dp", "--sp-size", 2, "--full-finetune",
                              "--mixed-precision", "bf16", "--attn", "ring", "--grad-accum", 2, "--no-final-model",
                              python=())])
    assert "fsdp=dp precision=bf16" in proc.stdout
    log = read_log(out / "log.jsonl")
    assert [r["step"] for r in log] == [1, 2]
    assert all(math.isfinite(r["loss"]) for r in log) and log[0]["loss"] != log[1]["loss"]


def test_fsdp_on_one_process_asks_for_a_launcher(checkpoint, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([str(c) for c in finetune_cmd(checkpoint, tmp_path / "out", "--fsdp")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode != 0
    assert "--fsdp shards over several processes: start them with accelerate launch" in proc.stderr


def test_fsdp_options_are_checked():
    import finetune_long_context

    base = ["--model", "m", "--output-dir", "o", "--seq-len", "256", "--max-steps", "1"]
    with pytest.raises(SystemExit, match="--fsdp-shard says how --fsdp shards"):
        finetune_long_context.parse_args([*base, "--fsdp-shard", "dp"])
    with pytest.raises(SystemExit, match="fp16 is not supported"):
        finetune_long_context.parse_args([*base, "--fsdp", "--mixed-precision", "fp16"])
    assert finetune_long_context.parse_args([*base, "--fsdp"]).fsdp_shard == "dp_sp"


# --- found by a review of the example (each failed before its fix) ------------------------------

def test_a_run_never_writes_over_its_source_or_an_earlier_runs_checkpoints(tmp_path):
    """--model X/model --output-dir X (continuing from a fine-tuned model): the final save replaced
    X/model, the run's own source. A fresh run into a directory holding an earlier run's
    checkpoints pruned its own first checkpoint (the old ones sort later) and --resume auto took the
    earlier run's for its own. --passkey-keys outside 1..4 acted as 1, or raised in the data loader."""
    from finetune_long_context import parse_args

    (tmp_path / "model").mkdir()
    base = ["--seq-len", "256", "--max-steps", "1"]
    for model in (tmp_path / "model", tmp_path / "checkpoints" / "step-000002"):
        with pytest.raises(SystemExit, match=f"--output-dir {tmp_path}: the run writes .*which holds --model"):
            parse_args(["--model", str(model), "--output-dir", str(tmp_path), *base])
    (tmp_path / "checkpoints" / "step-000004").mkdir(parents=True)
    with pytest.raises(SystemExit, match="holds an earlier run's checkpoints \\(step-000004\\): continue it with"):
        parse_args(["--model", "m", "--output-dir", str(tmp_path), *base])
    assert parse_args(["--model", "m", "--output-dir", str(tmp_path), "--resume", "auto", *base]).resume == "auto"
    for keys in ("0", "-3", "5"):
        with pytest.raises(SystemExit, match=f"--passkey-keys must be in 1..4, got {keys}"):
            parse_args(["--model", "m", "--output-dir", str(tmp_path / "new"), *base, "--passkey-keys", keys])


def test_a_resumed_run_keeps_its_options_and_its_log_holds_each_step_once(tmp_path):
    """A run resumed with another --lr followed the checkpoint's schedule without a word; and the
    log kept the steps after the checkpoint that ran again (1, 2, 3, 3, 4, ...)."""
    from types import SimpleNamespace

    from finetune_long_context import StepLog, check_resumed_options, parse_args

    argv = ["--model", "m", "--output-dir", str(tmp_path / "out"), "--seq-len", "256", "--max-steps", "6"]
    saved = tmp_path / "step-000002"
    saved.mkdir()
    (saved / "trainer_state.json").write_text(json.dumps({"step": 2, "args": vars(parse_args(argv))}))
    check_resumed_options(saved, parse_args([*argv, "--resume", str(saved), "--save-every", "1"]))  # may change
    with pytest.raises(SystemExit, match=r"--resume .*other options \(--lr 0.0002 -> 0.0001\)"):
        check_resumed_options(saved, parse_args([*argv, "--resume", str(saved), "--lr", "1e-4"]))
    # (a review's cases, refused by a first form: the model by another path, a memory trade-off, an option
    # the saved run did not have yet)
    (tmp_path / "m").mkdir()
    state = {"step": 2, "args": {k: v for k, v in vars(parse_args(argv)).items() if k != "loss_mean"}}
    (saved / "trainer_state.json").write_text(json.dumps({**state, "args": {**state["args"], "model": "m"}}))
    import os

    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        check_resumed_options(saved, parse_args([*argv[:1], str(tmp_path / "m"), *argv[2:], "--resume", str(saved),
                                                 "--no-gradient-checkpointing"]))
    finally:
        os.chdir(cwd)
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2, 3)) + '{"step": 4, "lo')
    args = SimpleNamespace(log_file=str(log), no_progress=True, max_steps=6)
    step_log = StepLog(args, SimpleNamespace(is_main_process=True), start_step=2)
    step_log.write({"step": 3, "loss": 0.5, "accuracy": 0.0, "tokens_per_s": 1.0})
    step_log.close()
    assert [r["step"] for r in read_log(log)] == [1, 2, 3]


def test_token_mean_is_over_the_step_whatever_its_micro_batches(checkpoint, tmp_path):
    """--loss-mean token under --grad-accum took each micro-batch's own mean and averaged them: with
    one row a micro-batch it was the row mean. The same two rows (a passkey row and a text row) in
    one step now train alike as one batch of 2 and as 2 micro-batches of 1."""
    doc = tmp_path / "doc.py"
    doc.write_text("".join(f"value_{i} = {i} * {i}\n" for i in range(2000)))
    runs = {}
    for batch, accum in ((2, 1), (1, 2)):
        out = tmp_path / f"b{batch}a{accum}"
        run([sys.executable, EXAMPLES / "finetune_long_context.py", "--model", checkpoint / "long", "--output-dir", out,
             "--seq-len", SEQ_LEN, "--data", "passkey", doc, "--max-steps", 3, "--save-every", 3, "--lr", "1e-2",
             "--warmup-steps", 0, "--no-progress", "--no-final-model", "--full-finetune", "--no-gradient-checkpointing",
             "--batch-size", batch, "--grad-accum", accum, "--log-file", out / "log.jsonl"])
        runs[batch] = [r["loss"] for r in read_log(out / "log.jsonl")], load_trainable(out / "checkpoints/step-000003")
    assert runs[1][0] == pytest.approx(runs[2][0], rel=1e-4)
    for name, weight in runs[2][1].items():  # (AdamW: rounding moves a weight whose gradient is near 0 by up to lr)
        torch.testing.assert_close(runs[1][1][name], weight, atol=1e-3, rtol=0, msg=name)


def test_text_rows_pack_with_a_tokenizer_without_pad_and_short_copy_rows_draw(tmp_path):
    """Llama's and Mistral's tokenizers have no pad token: packing text raised (a None in the last
    row). Copy rows of --seq-len below 342 drew spans whose copy did not fit, and raised mid-training."""
    from data import CopySpanDataset

    text = tmp_path / "doc.py"
    text.write_text("".join(f"line_{i} = {i * i}\n" for i in range(400)))
    tokenizer = build_byte_tokenizer()
    tokenizer.pad_token = None
    rows = PackedTextDataset(tokenizer, [str(text)], 100).rows
    assert rows["input_ids"][-1, -1] == tokenizer.eos_token_id and rows["labels"][-1, -1] == IGNORE_INDEX
    for seq_len in (200, 256, 300):
        data = CopySpanDataset(tokenizer, [str(text)], seq_len, 200, seed=0)
        for i in range(200):
            assert (data[i]["labels"] != IGNORE_INDEX).sum() >= 31
    with pytest.raises(ValueError, match="copy rows: a span of 32 tokens and its copy"):
        CopySpanDataset(tokenizer, [str(text)], 200, 5, seed=0, min_gap=150, max_gap=150, max_span=40)


def test_a_mixture_reads_the_longer_parts_next_rows_each_epoch():
    """A text + passkey mixture's epoch follows its shorter part: with 10 text rows, the run read the
    same 10 passkey rows every epoch, whatever --num-rows asked for (200 rows trained, 10 distinct)."""
    from types import SimpleNamespace

    from finetune_long_context import rows_for

    text, passkey = [{"x": torch.tensor([i])} for i in range(10)], [{"x": torch.tensor([100 + i])} for i in range(1000)]
    data = AlternatingDataset(text, passkey)
    args = SimpleNamespace(grad_accum=1, batch_size=2)
    seen = [int(x) for step in range(100) for x in rows_for(data, step, 0, args, 0, 1, 0)["x"][:, 0]]
    assert len({x for x in seen if x >= 100}) == 100  # every passkey row read is a new one
    assert {x for x in seen if x < 100} == set(range(10))
    assert [int(data[i]["x"]) for i in range(4)] == [0, 100, 1, 101]  # (epoch 0 as before)


def test_a_layout_without_a_sequence_parallel_group_is_refused():
    """--sp-layout contiguous with --sp-size 1 (finetune_long_context.py) and --layout contiguous with
    --sp 1 (sequence_parallel_demo.py) were accepted and ignored: no group, nothing split."""
    import finetune_long_context
    import sequence_parallel_demo

    base = ["--model", "m", "--output-dir", "o", "--seq-len", "256", "--max-steps", "1"]
    with pytest.raises(SystemExit, match="--sp-layout contiguous splits a row over a sequence-parallel group, which "
                                         "--sp-size 1 does not form"):
        finetune_long_context.parse_args([*base, "--sp-layout", "contiguous"])
    assert finetune_long_context.parse_args([*base, "--sp-layout", "contiguous", "--sp-size", "2"]).sp_layout == "contiguous"
    assert finetune_long_context.parse_args([*base, "--sp-layout", "zigzag"]).sp_size == 1  # the default: nothing changed
    with pytest.raises(SystemExit, match="--layout contiguous splits a row over a sequence-parallel group, which --sp 1"):
        sequence_parallel_demo.parse_args(["--layout", "contiguous"])
    assert sequence_parallel_demo.parse_args(["--layout", "contiguous", "--sp", "2"]).layout == "contiguous"
    assert sequence_parallel_demo.parse_args(["--layout", "zigzag"]).sp == 1


def test_a_resume_on_another_data_parallel_size_is_refused(checkpoint):
    """A run stopped on one process and resumed on two (--sp-size 1: dp_size 1 -> 2) doubled its global
    batch and skipped rows without a word (rows_for starts step s at s * dp_size * batch_size). The
    checkpoint now records dp_size; a checkpoint without it is resumed as before."""
    out = checkpoint / "resume_dp"
    run(finetune_cmd(checkpoint, out, "--stop-after-steps", 1, "--no-final-model"))
    saved = out / "checkpoints/step-000001"
    with pytest.raises(AssertionError) as failed:
        run(["accelerate", "launch", "--config_file", EXAMPLES / "accelerate_configs/cpu_2proc.yaml",
             "--main_process_port", free_port(), *finetune_cmd(checkpoint, out, "--resume", "auto", "--no-final-model",
                                                               python=())])
    assert (f"--resume {saved}: the run was trained with dp_size 1 (data-parallel replicas: processes / --sp-size), "
            "this one has dp_size 2") in str(failed.value)
    assert "resume on 1 process (or train anew" in str(failed.value)
    assert [r["step"] for r in read_log(out / "log.jsonl")] == [1]  # nothing trained on
    assert json.loads((saved / "trainer_state.json").read_text())["dp_size"] == 1
    from finetune_long_context import check_resumed_dp_size

    check_resumed_dp_size(saved, 1, 1)
    state = json.loads((saved / "trainer_state.json").read_text())
    del state["dp_size"]  # (saved before dp_size was recorded)
    (saved / "trainer_state.json").write_text(json.dumps(state))
    check_resumed_dp_size(saved, 2, 1)
