"""`hf-dilated convert` / `info`, the model_configs presets and the RoPE conversion."""
from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import hf_dilated  # noqa: F401  (registers the names)
from hf_dilated.cli import main as cli
from hf_dilated.convert import convert_checkpoint, describe
from hf_dilated.integrations.config import DilatedConfig
from hf_dilated.model_configs import build_model_config, list_presets, load_preset, validate_preset
from hf_dilated.patches.context import rope_updates


def _digest(directory):
    """{relative path: (sha256, mtime_ns)} of every file under `directory`."""
    out = {}
    for path in sorted(directory.rglob("*")):
        if path.is_file():
            out[str(path.relative_to(directory))] = (hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_mtime_ns)
    return out


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A tiny Llama checkpoint (safetensors) with a tokenizer file and a nested extra file."""
    src = tmp_path_factory.mktemp("convert") / "src"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(build_model_config("tiny-llama")).save_pretrained(src)
    (src / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE"}}\n')
    (src / "extra").mkdir()
    (src / "extra" / "notes.txt").write_text("kept as is\n")
    return src


def test_convert_writes_a_patched_copy_and_never_touches_src(source, tmp_path):
    before = _digest(source)
    dst = convert_checkpoint(source, tmp_path / "long", context_length=128, attn_implementation="dilated_ring")
    assert _digest(source) == before
    assert sorted(os.listdir(tmp_path)) == ["long"]  # no temporary directory left behind
    weights = dst / "model.safetensors"
    assert weights.read_bytes() == (source / "model.safetensors").read_bytes()
    assert os.path.samefile(weights, source / "model.safetensors")  # hard link on the same filesystem
    assert (dst / "tokenizer.json").read_text() == (source / "tokenizer.json").read_text()
    assert (dst / "extra" / "notes.txt").read_text() == "kept as is\n"
    config = json.loads((dst / "config.json").read_text())
    assert config["attn_implementation"] == "dilated_ring"
    assert config["max_position_embeddings"] == 128
    assert config["rope_parameters"] == {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}
    cfg = DilatedConfig.from_dict(config["hf_dilated"])
    assert (cfg.segment_lengths, cfg.dilation_rates) == ([32, 64, 128], [1, 2, 4])
    assert (cfg.original_length, cfg.target_length, cfg.mode) == (32, 128, "union")
    model = AutoModelForCausalLM.from_pretrained(dst)
    assert model.config._attn_implementation == "dilated_ring"
    assert model.model.rotary_emb.rope_type == "linear"


def test_copy_flag_copies_weights(source, tmp_path):
    dst = convert_checkpoint(source, tmp_path / "long", context_length=128, copy=True)
    assert not os.path.samefile(dst / "model.safetensors", source / "model.safetensors")
    assert (dst / "model.safetensors").read_bytes() == (source / "model.safetensors").read_bytes()


def test_convert_refuses_an_existing_dst_without_force_and_is_idempotent(source, tmp_path):
    first = convert_checkpoint(source, tmp_path / "a", preset="tiny-llama")
    text = (first / "config.json").read_text()
    with pytest.raises(FileExistsError, match="exists; pass --force"):
        convert_checkpoint(source, first, preset="tiny-llama")
    (first / "stale.txt").write_text("from an older conversion")
    convert_checkpoint(source, first, preset="tiny-llama", force=True)
    assert (first / "config.json").read_text() == text and not (first / "stale.txt").exists()
    again = convert_checkpoint(source, tmp_path / "b", preset="tiny-llama")
    assert (again / "config.json").read_text() == text  # same inputs, same bytes
    twice = convert_checkpoint(first, tmp_path / "c", preset="tiny-llama")
    assert (twice / "config.json").read_text() == text  # converting a converted checkpoint changes nothing
    assert sorted(os.listdir(tmp_path)) == ["a", "b", "c"]


def test_failed_conversions_leave_nothing_behind(source, tmp_path):
    with pytest.raises(ValueError, match="assumes max_position_embeddings = 4096"):
        convert_checkpoint(source, tmp_path / "x", preset="llama2-7b-32k")
    with pytest.raises(ValueError, match="3 does not divide 64"):
        convert_checkpoint(source, tmp_path / "x", segment_lengths=[32, 64], dilation_rates=[1, 3])
    with pytest.raises(ValueError, match="must not be src or lie inside it"):
        convert_checkpoint(source, source / "inner")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        convert_checkpoint(tmp_path, tmp_path / "x")
    with pytest.raises(ValueError, match="unknown preset 'nope'"):
        convert_checkpoint(source, tmp_path / "x", preset="nope")
    assert os.listdir(tmp_path) == []


def test_cli_convert_and_info(source, tmp_path, capsys):
    dst = tmp_path / "long"
    assert cli(["convert", str(source), str(dst), "--attn", "dilated", "--context", "256", "--rope", "yarn",
                "--mode", "longnet"]) == 0
    config = json.loads((dst / "config.json").read_text())
    assert config["rope_parameters"] == {"rope_type": "yarn", "factor": 8.0, "rope_theta": 10000.0,
                                         "original_max_position_embeddings": 32}
    assert config["hf_dilated"]["mode"] == "longnet"
    assert config["hf_dilated"]["segment_lengths"] == [32, 64, 128, 256]
    assert cli(["convert", str(source), str(dst), "--context", "256"]) == 2
    assert "exists; pass --force" in capsys.readouterr().out
    assert cli(["info", str(dst)]) == 0
    out = capsys.readouterr().out
    assert "attn_implementation:  dilated" in out and "yarn (factor 8)" in out
    assert "segment_lengths=[32, 64, 128, 256] dilation_rates=[1, 2, 4, 8]" in out
    assert "decode keys/query:  <= 128" in out
    assert cli(["info", str(source)]) == 0
    assert "absent: the default derived from the config" in capsys.readouterr().out


def test_converted_checkpoint_loads_and_runs_with_each_rope(source, tmp_path):
    ids = torch.randint(3, 200, (1, 80))
    for rope in ("linear", "dynamic", "yarn"):
        dst = convert_checkpoint(source, tmp_path / rope, context_length=128, rope=rope)
        model = AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32).eval()
        assert model.config.rope_parameters["rope_type"] == rope
        with torch.no_grad():
            assert torch.isfinite(model(ids).logits).all()


def test_rope_updates_follow_each_scheme():
    config = build_model_config("tiny-gpt-neox")  # partial rotary factor 0.25, 32 tokens
    linear = rope_updates(config, 128, "linear")
    assert linear == {"max_position_embeddings": 128, "rope_parameters": {
        "rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0, "partial_rotary_factor": 0.25}}
    dynamic = rope_updates(config, 128, "dynamic")
    assert dynamic["max_position_embeddings"] == 32  # dynamic NTK stretches beyond the original length
    assert rope_updates(config, 128, "yarn")["rope_parameters"]["original_max_position_embeddings"] == 32
    assert rope_updates(config, 128, None)["rope_parameters"]["rope_type"] == "linear"
    assert "rope_parameters" not in rope_updates(config, 128, "none")
    scaled = build_model_config("tiny-llama")
    scaled.rope_parameters = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8}
    with pytest.raises(ValueError, match="already scaled .*'llama3'.*rope='none'"):
        rope_updates(scaled, 128, "linear")
    assert "rope_parameters" not in rope_updates(scaled, 128, None)  # keeps a scaling it did not write


def test_default_config_doubles_segments_and_dilations_up_to_the_target():
    cfg = DilatedConfig.default(4096, 65536)
    assert cfg.segment_lengths == [4096, 8192, 16384, 32768, 65536]
    assert cfg.dilation_rates == [1, 2, 4, 8, 16]
    assert DilatedConfig.default(4096, 40000).segment_lengths[-1] == 65536  # first power covering the target
    assert DilatedConfig.default(4096).segment_lengths == [4096]
    assert DilatedConfig.default(4096).pattern == {"type": "local", "window": 64}
    config = AutoConfig.for_model("llama", max_position_embeddings=131072, rope_parameters={
        "rope_type": "yarn", "rope_theta": 1e4, "factor": 16.0, "original_max_position_embeddings": 8192})
    derived = DilatedConfig.from_model_config(config)  # a checkpoint without an hf_dilated entry
    assert derived.segment_lengths == [8192, 16384, 32768, 65536, 131072]
    assert DilatedConfig.from_dict(derived.to_dict()) == derived


@pytest.mark.parametrize("name", list_presets())
def test_every_preset_is_valid(name):
    preset = load_preset(name)
    cfg = DilatedConfig.default(preset["assumes"]["max_position_embeddings"], preset["context_length"],
                                **preset.get("hf_dilated", {}))
    assert cfg.segment_lengths[0] == preset["assumes"]["max_position_embeddings"]
    assert cfg.segment_lengths[-1] >= preset["context_length"]
    if "model_config" in preset:
        config = build_model_config(name)
        assert config.model_type == preset["model_type"]


def test_expected_presets_exist_and_bad_presets_are_rejected():
    assert {"llama2-7b-32k", "llama3-8b-128k", "pythia-32k", "tiny-llama", "tiny-gpt-neox"} <= set(list_presets())
    good = load_preset("llama2-7b-32k")
    for change, match in [
        ({"model_type": "gpt2"}, "does not support model_type 'gpt2'"),
        ({"rope": "ntk"}, "rope must be one of"),
        ({"attn_implementation": "sdpa"}, "attn_implementation must be one of"),
        ({"context_length": 1024}, "original <= context"),
        ({"hf_dilated": {"segment_lengths": [2048, 32768], "dilation_rates": [1, 8]}}, "first level must be"),
        ({"hf_dilated": {"segment_lengths": [4096, 8192], "dilation_rates": [1, 2]}}, "must cover context_length"),
        ({"colour": "red"}, "unknown keys"),
    ]:
        with pytest.raises(ValueError, match=match):
            validate_preset({**good, **change}, "edited")
