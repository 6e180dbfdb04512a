"""`hf-dilated convert` / `info`, the model_configs presets and the RoPE conversion."""
from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import hf_dilated
from hf_dilated.cli import main as cli
from hf_dilated.convert import convert_checkpoint, describe
from hf_dilated.config import DilatedConfig
from hf_dilated.model_configs import build_model_config, list_presets, load_preset, validate_preset
from hf_dilated.patches.context import original_length, rope_updates


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
    dst = convert_checkpoint(source, tmp_path / "long", context_length=128, attn_implementation="dilated")
    assert _digest(source) == before
    assert sorted(os.listdir(tmp_path)) == ["long"]  # no temporary directory left behind
    weights = dst / "model.safetensors"
    assert weights.read_bytes() == (source / "model.safetensors").read_bytes()
    assert os.path.samefile(weights, source / "model.safetensors")  # hard link on the same filesystem
    assert (dst / "tokenizer.json").read_text() == (source / "tokenizer.json").read_text()
    assert (dst / "extra" / "notes.txt").read_text() == "kept as is\n"
    config = json.loads((dst / "config.json").read_text())
    assert config["attn_implementation"] == "dilated"
    # The RoPE is kept (the default conversion): so is the context any other engine may read
    # (max_position_embeddings); the extended one is the hf_dilated entry's (issue 33, item 11).
    assert config["max_position_embeddings"] == 32 and config["hf_dilated"]["target_length"] == 128
    # The default conversion (issue 28): the checkpoint's own RoPE, the original context as a local
    # band, far keys at grouped positions within the original context of relative position.
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}
    cfg = DilatedConfig.from_dict(config["hf_dilated"])
    assert (cfg.segment_lengths, cfg.dilation_rates) == ([128], [1])  # every far key, one level
    assert (cfg.original_length, cfg.target_length, cfg.mode) == (32, 128, "union")
    # far keys as Self-Extend's with a neighbour window of 32 / 8 = 4: G the smallest power of two that
    # keeps the farthest key (127 back) within 32 of relative position; 8 far blocks per doubling
    assert (cfg.local_window, cfg.far_group, cfg.far_window, cfg.far_top_k) == (32, 8, 4, 16)
    assert 127 // 8 + 4 - 4 // 8 <= 32 < 127 // 4 + 4 - 4 // 4
    model = AutoModelForCausalLM.from_pretrained(dst)
    assert model.config._attn_implementation == "dilated"
    assert model.model.rotary_emb.rope_type == "default"


def test_default_conversion_for_dilated_ring_is_the_band(source, tmp_path):
    """dilated_ring runs the band across ranks, so its default conversion is dilated's: the
    checkpoint's RoPE, the original context as a band, far keys at grouped positions (it was YaRN
    without a band while the ring refused a band)."""
    dst = convert_checkpoint(source, tmp_path / "long", context_length=128, attn_implementation="dilated_ring")
    config = json.loads((dst / "config.json").read_text())
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}
    cfg = DilatedConfig.from_dict(config["hf_dilated"])
    assert (cfg.local_window, cfg.far_group, cfg.far_window, cfg.segment_lengths, cfg.dilation_rates) == \
        (32, 8, 4, [128], [1])
    assert AutoModelForCausalLM.from_pretrained(dst).config._attn_implementation == "dilated_ring"


@pytest.mark.parametrize("attn", ["ring", "block_sparse", "block_sparse_ring"])
def test_default_conversion_for_the_other_names_is_yarn_without_a_band(source, tmp_path, attn):
    """Names that read no band need scaled positions for far keys: YaRN by default, which a model
    survives inside its context far better than linear."""
    dst = convert_checkpoint(source, tmp_path / "long", context_length=128, attn_implementation=attn)
    config = json.loads((dst / "config.json").read_text())
    assert config["rope_parameters"] == {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                         "original_max_position_embeddings": 32}
    cfg = DilatedConfig.from_dict(config["hf_dilated"])
    assert (cfg.local_window, cfg.far_group) == (None, 1)
    assert AutoModelForCausalLM.from_pretrained(dst).config._attn_implementation == attn


@pytest.mark.parametrize("mode", ("longnet", "head_groups"))
def test_default_conversion_for_another_mode_is_yarn_without_a_band(source, tmp_path, mode):
    """A band is defined for mode "union" alone: `--mode longnet --context N` failed on the default
    band (an error about local_window, which the user never set)."""
    dst = convert_checkpoint(source, tmp_path / "long", context_length=128, mode=mode,
                             segment_lengths=[32, 64, 128], dilation_rates=[1, 2, 4])
    config = json.loads((dst / "config.json").read_text())
    assert config["rope_parameters"]["rope_type"] == "yarn"
    cfg = DilatedConfig.from_dict(config["hf_dilated"])
    assert (cfg.mode, cfg.local_window, cfg.far_group) == (mode, None, 1)
    model = AutoModelForCausalLM.from_pretrained(source)
    hf_dilated.patch(model, "dilated", context_length=128, mode=mode)
    assert model.config.hf_dilated["mode"] == mode and model.config.rope_parameters["rope_type"] == "yarn"


def test_fields_the_chosen_name_does_not_read_are_named(source, tmp_path):
    """A field of another attention (a band for block_sparse, levels for ring) was stored without a
    word; a preset's fields, which configure every name, are not the caller's and say nothing."""
    with pytest.warns(UserWarning, match="local_window: attn_implementation 'block_sparse' does not read it"):
        convert_checkpoint(source, tmp_path / "a", context_length=128, attn_implementation="block_sparse",
                           local_window=16)
    model = AutoModelForCausalLM.from_pretrained(source)
    with pytest.warns(UserWarning, match="dilation_rates, segment_lengths: attn_implementation 'ring' does not"):
        hf_dilated.patch(model, "ring", segment_lengths=[32, 64], dilation_rates=[1, 2])
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        convert_checkpoint(source, tmp_path / "b", preset="tiny-llama", attn_implementation="dilated")
        hf_dilated.patch(AutoModelForCausalLM.from_pretrained(source), "dilated_ring", ring_layout="zigzag",
                         segment_lengths=[32, 64], dilation_rates=[1, 2])


def test_copy_flag_copies_weights(source, tmp_path):
    dst = convert_checkpoint(source, tmp_path / "long", context_length=128, copy=True)
    assert not os.path.samefile(dst / "model.safetensors", source / "model.safetensors")
    assert (dst / "model.safetensors").read_bytes() == (source / "model.safetensors").read_bytes()


def test_convert_refuses_an_existing_dst_without_force_and_is_idempotent(source, tmp_path):
    first = convert_checkpoint(source, tmp_path / "a", preset="tiny-llama")
    text = (first / "config.json").read_text()
    with pytest.raises(FileExistsError, match="exists; pass --force"):
        convert_checkpoint(source, first, preset="tiny-llama")
    convert_checkpoint(source, first, preset="tiny-llama", force=True)
    assert (first / "config.json").read_text() == text
    again = convert_checkpoint(source, tmp_path / "b", preset="tiny-llama")
    assert (again / "config.json").read_text() == text  # same inputs, same bytes
    twice = convert_checkpoint(first, tmp_path / "c", preset="tiny-llama")
    assert (twice / "config.json").read_text() == text  # converting a converted checkpoint changes nothing
    assert sorted(os.listdir(tmp_path)) == ["a", "b", "c"]


def test_force_replaces_only_what_a_conversion_wrote(source, tmp_path):
    """--force replaced any directory whose config.json had an hf_dilated entry: a fine-tuned model
    saved from a converted one has it too, and its weights and notes were destroyed (a review,
    2026-11-28). Now only a directory that holds exactly what a conversion's manifest lists."""
    first = convert_checkpoint(source, tmp_path / "a", context_length=128)
    manifest = json.loads((first / "hf_dilated_conversion.json").read_text())
    assert set(manifest["files"]) == {"config.json", "extra/notes.txt", "generation_config.json", "model.safetensors",
                                      "tokenizer.json"}
    tuned = tmp_path / "tuned"
    model = AutoModelForCausalLM.from_pretrained(first)
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)
    model.save_pretrained(tuned)
    (tuned / "training_notes.txt").write_text("two days of fine-tuning\n")
    before = _digest(tuned)
    with pytest.raises(ValueError, match="no readable hf_dilated_conversion.json"):
        convert_checkpoint(source, tuned, context_length=128, force=True)
    assert _digest(tuned) == before
    (first / "notes.md").write_text("mine\n")  # a file added to a conversion
    with pytest.raises(ValueError, match="added, removed or changed since, e.g. notes.md"):
        convert_checkpoint(source, first, context_length=128, force=True)
    (first / "notes.md").unlink()
    for name, to in (("linkdir", "extra"), ("broken", "nowhere")):  # links added: named, never followed
        (first / name).symlink_to(to)
        with pytest.raises(ValueError, match=f"changed since, e.g. {name}"):
            convert_checkpoint(source, first, context_length=128, force=True)
        (first / name).unlink()
    model.save_pretrained(first)  # weights rewritten in place (what the README warns against)
    with pytest.raises(ValueError, match="changed since"):
        convert_checkpoint(source, first, context_length=128, force=True)
    again = convert_checkpoint(source, tmp_path / "b", context_length=128)
    assert convert_checkpoint(source, again, context_length=128, force=True) == again  # untouched: replaced
    twice = convert_checkpoint(again, tmp_path / "c", context_length=128)  # a converted SRC's manifest is its own
    assert (twice / "hf_dilated_conversion.json").read_text() != "" and convert_checkpoint(
        again, twice, context_length=128, force=True) == twice


def test_a_generation_max_length_at_the_checkpoints_context_follows_the_conversion(source, tmp_path):
    """Llama-2's generation_config.json says max_length 4096: copied as it was, generate() without
    max_new_tokens refused a converted model's longer prompts ("Input length of input_ids is 100, but
    max_length is set to 64", a review). A max_length at the checkpoint's context follows the
    converted one; any other stays."""
    src = _copy_of(source, tmp_path / "src")
    (src / "generation_config.json").write_text(json.dumps({"max_length": 32, "do_sample": False}))
    before = _digest(src)
    with pytest.warns(UserWarning, match="max_length 32 .* became 128"):
        dst = convert_checkpoint(src, tmp_path / "long", context_length=128)
    assert _digest(src) == before
    assert json.loads((dst / "generation_config.json").read_text()) == {"max_length": 128, "do_sample": False}
    model = AutoModelForCausalLM.from_pretrained(dst)
    out = model.generate(torch.randint(3, 100, (1, 60)))  # (the default band's name: 128 tokens declared)
    assert out.shape[1] == 128
    assert json.loads((convert_checkpoint(dst, tmp_path / "longer", context_length=256) / "generation_config.json")
                      .read_text())["max_length"] == 256  # an earlier conversion's too
    (src / "generation_config.json").write_text("{not json")  # transformers reads it as it can: copied
    assert (convert_checkpoint(src, tmp_path / "bad", context_length=128) / "generation_config.json").read_text() \
        == "{not json"
    (src / "generation_config.json").write_text(json.dumps({"max_length": 20}))
    assert json.loads((convert_checkpoint(src, tmp_path / "kept", context_length=128) / "generation_config.json")
                      .read_text()) == {"max_length": 20}


def test_levels_that_end_before_the_context_are_refused(source, tmp_path):
    """Levels chosen by hand that end before the context (--segment-lengths 16,32 --context 128)
    were written without a word (the preset path refused the same): queries past 32 read no key of
    an earlier segment."""
    with pytest.raises(ValueError, match=r"segment_lengths \(--segment-lengths\): the levels end at 32 tokens"):
        convert_checkpoint(source, tmp_path / "x", context_length=128, segment_lengths=[16, 32],
                           dilation_rates=[1, 2])
    assert not (tmp_path / "x").exists()
    with pytest.raises(ValueError, match=r"segment_lengths \(--segment-lengths\): the levels end at 32 tokens"):
        hf_dilated.patch(AutoModelForCausalLM.from_pretrained(source), "dilated", context_length=128,
                         segment_lengths=[16, 32], dilation_rates=[1, 2])
    # Levels of one's own without a new context (the README's longnet example), or under a band that
    # reads every key of the context, are the caller's choice.
    convert_checkpoint(source, tmp_path / "own", mode="longnet", segment_lengths=[8, 16], dilation_rates=[1, 2])
    hf_dilated.patch(AutoModelForCausalLM.from_pretrained(source), "dilated", context_length=128,
                     segment_lengths=[16, 32], dilation_rates=[1, 2], local_window=128)


def test_failed_conversions_leave_nothing_behind(source, tmp_path):
    with pytest.raises(ValueError, match="assumes max_position_embeddings = 4096"):
        convert_checkpoint(source, tmp_path / "x", preset="llama2-7b-32k")
    with pytest.raises(ValueError, match="3 does not divide 64"):
        convert_checkpoint(source, tmp_path / "x", segment_lengths=[32, 64], dilation_rates=[1, 3])
    with pytest.raises(ValueError, match="must not be src, lie inside it or contain it"):
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
    assert "exists; pass --force" in capsys.readouterr().err
    assert cli(["info", str(dst)]) == 0
    out = capsys.readouterr().out
    assert "attn_implementation:  dilated" in out and "yarn (factor 8); written by hf_dilated's conversion" in out
    assert "segment_lengths=[32, 64, 128, 256] dilation_rates=[1, 2, 4, 8]" in out
    assert "decode keys/query:  <= 128" in out
    assert cli(["info", str(source)]) == 0
    assert "absent: the default derived from the config" in capsys.readouterr().out


def test_cli_convert_with_sparse_far_keys_and_info(source, tmp_path, capsys):
    """The sparse far keys' fields (docs/contract.md 4.2) go from the CLI into config.json, on top of
    the default band, and `info` says what a query reads."""
    dst = tmp_path / "sparse"
    assert cli(["convert", str(source), str(dst), "--context", "128", "--far-band", "16", "--far-top-k", "2",
                "--far-block-size", "4", "--far-sinks", "1"]) == 0
    entry = json.loads((dst / "config.json").read_text())["hf_dilated"]
    assert (entry["local_window"], entry["far_band"], entry["far_top_k"], entry["far_block_size"],
            entry["far_sinks"]) == (32, 16, 2, 4, 1)
    assert entry["far_group"] > 1  # the default band's grouped positions are kept
    assert cli(["info", str(dst)]) == 0
    out = capsys.readouterr().out
    assert "16 positions for a query at a position >= 32 (far_band)" in out
    assert "the first 1 block(s) of the document and the 2 blocks of 4 positions" in out
    assert "decode keys/query:  <= 32 (blocks tied" in out  # a query inside the band reads 32; past it 16 + 3 * 4
    assert "rope:                 default; the checkpoint's own, kept by hf_dilated's conversion" in out
    assert cli(["convert", str(source), str(tmp_path / "bad"), "--context", "128", "--far-band", "64"]) == 2
    assert "far_band: at most local_window (32)" in capsys.readouterr().err


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
    # A checkpoint without an hf_dilated entry whose RoPE is already scaled was trained at its
    # configured length: one dense-within-segment level covers all of it.
    derived = DilatedConfig.from_model_config(config)
    assert derived.segment_lengths == [131072] and derived.original_length == 131072
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


def test_a_preset_with_a_longer_context_than_its_levels_is_refused(tmp_path):
    """--preset with a --context beyond the preset's levels wrote the longer context (and its RoPE)
    with levels that never read a key further back than their last segment, without a word."""
    preset = "tiny-llama-passkey"  # levels [256, 512, 1024] of its own
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(build_model_config(preset)).save_pretrained(tmp_path / "src")
    with pytest.raises(TypeError, match=r"context_length \(--context\) must be a positive int"):
        convert_checkpoint(tmp_path / "src", tmp_path / "long", preset=preset, context_length="2048")
    with pytest.raises(ValueError, match=rf"context_length \(--context\) with preset '{preset}': the levels end at 1024"):
        convert_checkpoint(tmp_path / "src", tmp_path / "long", preset=preset, context_length=2048)
    assert not (tmp_path / "long").exists()
    shorter = convert_checkpoint(tmp_path / "src", tmp_path / "short", preset=preset, context_length=512)
    assert json.loads((shorter / "config.json").read_text())["hf_dilated"]["segment_lengths"] == [256, 512, 1024]
    chosen = convert_checkpoint(tmp_path / "src", tmp_path / "chosen", preset=preset, context_length=2048,
                                segment_lengths=[256, 512, 1024, 2048], dilation_rates=[1, 2, 4, 8])
    assert json.loads((chosen / "config.json").read_text())["hf_dilated"]["target_length"] == 2048


# --- issue 15: nothing lost, nothing silent ---------------------------------------------------

def _copy_of(source, where):
    """A private copy of the tiny checkpoint (tests that need SRC in a particular place)."""
    shutil.copytree(source, where)
    return where


def _hub_cache(source, root):
    """`source` laid out as the Hugging Face cache does (what `snapshot_download` returns): every
    file of snapshots/<rev>/ a relative symlink to blobs/<sha256>."""
    repo = root / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / ("0123456789abcdef" * 3)[:40]
    for path in sorted(source.rglob("*")):
        rel = path.relative_to(source)
        if path.is_dir():
            (snapshot / rel).mkdir(parents=True)
            continue
        data = path.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / rel).parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(blob, (snapshot / rel).parent), snapshot / rel)
    return repo, snapshot


def test_force_never_replaces_a_dst_that_holds_src(source, tmp_path, capsys):
    models = tmp_path / "models"
    src = _copy_of(source, models / "llama")
    (models / "other.txt").write_text("someone else's file\n")
    before = _digest(tmp_path)
    for dst in (models, tmp_path, src, src / "inner"):
        with pytest.raises(ValueError, match="must not be src, lie inside it or contain it"):
            convert_checkpoint(src, dst, context_length=128, force=True)
    assert cli(["convert", str(src), str(models), "--context", "128", "--force"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hf-dilated convert: error: dst:") and err.count("\n") == 1
    # The same through a symlink to the parent, and through a relative path.
    os.symlink(models, tmp_path / "alias")
    with pytest.raises(ValueError, match="contain it"):
        convert_checkpoint(src, tmp_path / "alias", context_length=128, force=True)
    os.unlink(tmp_path / "alias")
    cwd = os.getcwd()
    try:
        os.chdir(src)
        with pytest.raises(ValueError, match="contain it"):
            convert_checkpoint(".", "..", context_length=128, force=True)
    finally:
        os.chdir(cwd)
    assert _digest(tmp_path) == before


def test_force_replaces_only_a_converted_checkpoint(source, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("not a checkpoint\n")
    plain = _copy_of(source, tmp_path / "plain")  # a checkpoint hf-dilated did not write
    (tmp_path / "file").write_text("a file\n")
    before = _digest(tmp_path)
    for dst, match in ((work, "not a checkpoint hf-dilated convert wrote"),
                       (plain, "not a checkpoint hf-dilated convert wrote"),
                       (tmp_path / "file", "not a directory")):
        with pytest.raises(ValueError, match=match):
            convert_checkpoint(source, dst, context_length=128, force=True)
    assert _digest(tmp_path) == before
    (tmp_path / "empty").mkdir()
    assert (convert_checkpoint(source, tmp_path / "empty", context_length=128, force=True) / "config.json").is_file()


def test_hub_cache_layout_converts_to_real_files(source, tmp_path):
    repo, snapshot = _hub_cache(source, tmp_path / "hub")
    assert (snapshot / "model.safetensors").is_symlink()
    before = _digest(repo)
    for copy in (False, True):
        dst = convert_checkpoint(snapshot, tmp_path / f"long-{copy}", context_length=128, copy=copy)
        for path in dst.rglob("*"):
            assert not path.is_symlink(), path
        weights = dst / "model.safetensors"
        assert weights.read_bytes() == (source / "model.safetensors").read_bytes()
        assert os.path.samefile(weights, (snapshot / "model.safetensors").resolve()) is not copy
        assert (dst / "extra" / "notes.txt").read_text() == "kept as is\n"
        model = AutoModelForCausalLM.from_pretrained(dst)
        assert model.model.rotary_emb.rope_type == "default"  # the default conversion keeps the RoPE
    assert _digest(repo) == before
    # A DST holding the blobs SRC links to is refused like one holding SRC itself.
    with pytest.raises(ValueError, match="links to"):
        convert_checkpoint(snapshot, repo / "blobs", context_length=128, force=True)
    assert _digest(repo) == before


def test_a_broken_symlink_in_src_is_a_clear_error(source, tmp_path):
    repo, snapshot = _hub_cache(source, tmp_path / "hub")
    (snapshot / "model.safetensors").resolve().unlink()  # an interrupted download
    with pytest.raises(FileNotFoundError, match="src: .*model.safetensors is a broken symbolic link"):
        convert_checkpoint(snapshot, tmp_path / "long", context_length=128)
    assert sorted(os.listdir(tmp_path)) == ["hub"]


_CHILD = r"""
import os, signal, sys
from hf_dilated.convert import convert_checkpoint

src, dst, when, sig = sys.argv[1:5]

fired = []

def hook(event, args):
    # Stops this process once, at a chosen point of a real conversion, as `kill` would at random.
    copying = when == "copy" and event in ("os.link", "shutil.copyfile") and ".tmp-" in str(args[1])
    swapping = when == "swap" and event == "os.rename" and ".tmp-" in str(args[0]) and str(args[1]) == dst
    if (copying or swapping) and not fired:
        fired.append(event)
        os.kill(os.getpid(), getattr(signal, sig))

sys.addaudithook(hook)
convert_checkpoint(src, dst, context_length=128, force=True)
"""


def _child(src, dst, when, sig):
    import subprocess
    import sys

    return subprocess.Popen([sys.executable, "-c", _CHILD, str(src), str(dst), when, sig])


def test_a_later_run_removes_what_a_killed_run_left(source, tmp_path):
    dst = tmp_path / "long"
    child = _child(source, dst, "copy", "SIGKILL")
    assert child.wait(timeout=120) == -9
    left = os.listdir(tmp_path)
    assert len(left) == 1 and left[0].startswith(".long.tmp-")  # what the killed run left
    (tmp_path / left[0] / "big.bin").write_bytes(b"\0" * 1024)  # as a half-copied weight file
    convert_checkpoint(source, dst, context_length=128)
    assert sorted(os.listdir(tmp_path)) == ["long"]


def test_a_run_killed_while_replacing_dst_loses_nothing(source, tmp_path):
    dst = convert_checkpoint(source, tmp_path / "long", context_length=64)
    child = _child(source, dst, "swap", "SIGKILL")
    assert child.wait(timeout=120) == -9
    assert not dst.exists()  # killed between moving the old DST aside and moving the new one in
    # A later run, even a failing one, puts the previous DST back before anything else ...
    with pytest.raises(ValueError, match="assumes max_position_embeddings = 4096"):
        convert_checkpoint(source, dst, preset="llama2-7b-32k", force=True)
    assert sorted(os.listdir(tmp_path)) == ["long"]
    assert json.loads((dst / "config.json").read_text())["hf_dilated"]["target_length"] == 64
    convert_checkpoint(source, dst, context_length=128, force=True)  # ... and a good one replaces it
    assert json.loads((dst / "config.json").read_text())["hf_dilated"]["target_length"] == 128
    assert sorted(os.listdir(tmp_path)) == ["long"]


def test_a_concurrent_run_keeps_its_temporary_directory(source, tmp_path):
    import signal

    dst = tmp_path / "long"
    child = _child(source, dst, "copy", "SIGSTOP")
    try:
        _, status = os.waitpid(child.pid, os.WUNTRACED)
        assert os.WIFSTOPPED(status)
        theirs = [n for n in os.listdir(tmp_path) if n.startswith(".long.tmp-")]
        assert len(theirs) == 1
        convert_checkpoint(source, dst, context_length=64, force=True)  # cleans only dead runs' leftovers
        assert (tmp_path / theirs[0]).is_dir()
    finally:
        os.kill(child.pid, signal.SIGCONT)
    assert child.wait(timeout=120) == 0  # the other run completes: it replaced ours
    assert json.loads((dst / "config.json").read_text())["hf_dilated"]["target_length"] == 128
    assert sorted(os.listdir(tmp_path)) == ["long"]


def test_dst_permissions_follow_the_umask(source, tmp_path):
    for umask, mode in ((0o022, 0o755), (0o027, 0o750)):
        old = os.umask(umask)
        try:
            dst = convert_checkpoint(source, tmp_path / f"long-{umask:o}", context_length=128)
        finally:
            os.umask(old)
        assert os.stat(dst).st_mode & 0o777 == mode
        assert os.stat(dst / "extra").st_mode & 0o777 == mode
        assert os.stat(dst / "config.json").st_mode & 0o777 == mode & 0o666


def _make_read_only(directory):
    """Makes `directory` unwritable even for root (chattr +i); returns the undo, or skips."""
    import subprocess

    if os.geteuid() != 0:
        os.chmod(directory, 0o555)
        undo = lambda: os.chmod(directory, 0o755)  # noqa: E731
    elif subprocess.run(["chattr", "+i", str(directory)], capture_output=True).returncode == 0:
        undo = lambda: subprocess.run(["chattr", "-i", str(directory)], check=True)  # noqa: E731
    else:
        pytest.skip("cannot make a directory read-only here (root without chattr +i)")
    try:
        os.mkdir(directory / "probe")
    except PermissionError:
        return undo
    os.rmdir(directory / "probe")
    undo()
    pytest.skip("could not make a directory read-only here")


def test_an_unwritable_parent_is_a_one_line_cli_error(source, tmp_path, capsys):
    parent = tmp_path / "ro"
    parent.mkdir()
    undo = _make_read_only(parent)
    try:
        assert cli(["convert", str(source), str(parent / "long"), "--context", "128"]) == 2
        assert cli(["convert", str(source), str(parent / "a" / "long"), "--context", "128"]) == 2
    finally:
        undo()
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and all(line.startswith("hf-dilated convert: error: dst: cannot create") for line in err)
    assert os.listdir(parent) == []


def test_reconverting_keeps_the_rope_and_attention_it_had(source, tmp_path):
    first = convert_checkpoint(source, tmp_path / "a", context_length=128, rope="yarn", attn_implementation="dilated_ring")
    with pytest.warns(UserWarning) as caught:
        second = convert_checkpoint(first, tmp_path / "b", context_length=256)
    messages = " | ".join(str(w.message) for w in caught)
    assert "kept the earlier conversion's 'yarn'" in messages and "'dilated_ring'" in messages
    config = json.loads((second / "config.json").read_text())
    assert config["attn_implementation"] == "dilated_ring"
    assert config["rope_parameters"] == {"rope_type": "yarn", "factor": 8.0, "rope_theta": 10000.0,
                                         "original_max_position_embeddings": 32}
    assert config["hf_dilated"]["original_length"] == 32 and config["hf_dilated"]["target_length"] == 256
    # Options still win.
    third = convert_checkpoint(first, tmp_path / "c", context_length=256, rope="linear", attn_implementation="dilated")
    config = json.loads((third / "config.json").read_text())
    assert config["attn_implementation"] == "dilated" and config["rope_parameters"]["rope_type"] == "linear"
    # An earlier `--rope none` is kept too.
    unscaled = convert_checkpoint(source, tmp_path / "d", context_length=64, rope="none")
    with pytest.warns(UserWarning, match="unscaled RoPE"):
        again = convert_checkpoint(unscaled, tmp_path / "e", context_length=128)
    config = json.loads((again / "config.json").read_text())
    assert config["rope_parameters"]["rope_type"] == "default" and config["max_position_embeddings"] == 32
    assert config["hf_dilated"]["target_length"] == 128


def test_a_saved_model_keeps_its_attention_through_info_and_reconversion(source, tmp_path):
    """save_pretrained drops config.json's attn_implementation and keeps the name in the hf_dilated
    entry, which from_pretrained reads: `info` said "not set" and a reconversion switched to the
    default name without a word."""
    converted = convert_checkpoint(source, tmp_path / "a", context_length=64, attn_implementation="dilated_ring")
    model = AutoModelForCausalLM.from_pretrained(converted)
    model.save_pretrained(tmp_path / "saved")
    assert "attn_implementation" not in json.loads((tmp_path / "saved" / "config.json").read_text())
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "saved").config._attn_implementation == "dilated_ring"
    assert "attn_implementation:  dilated_ring" in describe(tmp_path / "saved")
    with pytest.warns(UserWarning, match="kept the earlier conversion's attn_implementation 'dilated_ring'"):
        again = convert_checkpoint(tmp_path / "saved", tmp_path / "b", context_length=128)
    assert json.loads((again / "config.json").read_text())["attn_implementation"] == "dilated_ring"


def test_bad_context_lengths_are_clear_errors(source, tmp_path, capsys):
    for value, match in ((16, "shorter than the checkpoint's original context of 32 tokens"),
                         (10**12, "above the limit of 16,777,216 tokens"),
                         (0, "must be a positive int"), (-5, "must be a positive int")):
        with pytest.raises(ValueError, match=match):
            convert_checkpoint(source, tmp_path / "x", context_length=value)
        with pytest.raises(ValueError, match=match):
            convert_checkpoint(source, tmp_path / "x", context_length=value, preset="tiny-llama")
        assert cli(["convert", str(source), str(tmp_path / "x"), "--context", str(value)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("hf-dilated convert: error: context_length (--context)") and err.count("\n") == 1
    converted = convert_checkpoint(source, tmp_path / "long", context_length=128)
    with pytest.raises(ValueError, match="original context of 32 tokens"):  # the original, not the converted one
        convert_checkpoint(converted, tmp_path / "x", context_length=16)
    with pytest.raises(ValueError, match="--rope needs --context"):
        convert_checkpoint(source, tmp_path / "x", rope="yarn")
    with pytest.raises(ValueError, match=r"segment_lengths \(--segment-lengths\): a level of 68,719,476,736 tokens"):
        convert_checkpoint(source, tmp_path / "x", segment_lengths=[32, 2**36], dilation_rates=[1, 2])
    assert cli(["info", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hf-dilated info: error:") and "no config.json" in err and err.count("\n") == 1
    assert sorted(os.listdir(tmp_path)) == ["long"]


def test_info_and_convert_name_a_config_they_cannot_read(tmp_path, capsys):
    """A config.json that is not JSON was reported by the parser's words alone, naming neither the
    file nor the argument; `info` described a family convert refuses (gpt2) as if hf_dilated served it."""
    from transformers import GPT2Config

    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text('{"model_type": "llama",\n oops}')
    for argv, start in ((["info", str(tmp_path / "bad")], "hf-dilated info: error: dir: "),
                        (["convert", str(tmp_path / "bad"), str(tmp_path / "out"), "--context", "128"],
                         "hf-dilated convert: error: src: ")):
        assert cli(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith(start) and "bad/config.json is not valid JSON" in err and err.count("\n") == 1
    GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(tmp_path / "gpt2")
    assert cli(["info", str(tmp_path / "gpt2")]) == 2
    assert "does not support model_type 'gpt2'; supported: llama" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_reconverting_for_a_name_without_far_keys_scales_the_rope_as_a_first_conversion(source, tmp_path):
    """The default conversion keeps the RoPE unscaled for far keys at grouped positions. Converted
    again for block_sparse, which reads none, the RoPE used to stay unscaled too: block_sparse got
    the original 32 tokens, not 256. It now gets what a first conversion for it gets (YaRN), said."""
    converted = convert_checkpoint(source, tmp_path / "long", context_length=128)
    with pytest.warns(UserWarning, match="'block_sparse' reads no far keys at grouped positions.*'yarn' for 256"):
        again = convert_checkpoint(converted, tmp_path / "bs", context_length=256, attn_implementation="block_sparse")
    first = convert_checkpoint(source, tmp_path / "first", context_length=256, attn_implementation="block_sparse")
    # A new name alone (no context): at the earlier conversion's target. The RoPE stayed unscaled
    # there without a word (block_sparse then read 32 tokens of the 128 converted for; a review).
    with pytest.warns(UserWarning, match="'block_sparse' reads no far keys at grouped positions.*'yarn' for 128"):
        renamed = convert_checkpoint(converted, tmp_path / "renamed", attn_implementation="block_sparse")
    model = AutoModelForCausalLM.from_pretrained(source)
    with pytest.warns(UserWarning, match="'yarn' for 128"):
        hf_dilated.patch(model, "dilated", context_length=128)  # (the default conversion, then a name alone)
        hf_dilated.patch(model, "block_sparse")
    for path, length in ((again, 256), (first, 256), (renamed, 128), (None, 128)):
        config = model.config if path is None else AutoConfig.from_pretrained(path)
        assert (config.rope_parameters["rope_type"], config.max_position_embeddings) == ("yarn", length), path
    # The name alone changes the RoPE, not the earlier conversion's entry (a first form rebuilt it
    # for the target, dropping the caller's levels and far keys' settings).
    chosen = convert_checkpoint(source, tmp_path / "chosen", context_length=128, segment_lengths=[16, 128],
                                dilation_rates=[1, 2], far_top_k=3, far_sinks=2)
    with pytest.warns(UserWarning, match="'yarn' for 128"):
        renamed = convert_checkpoint(chosen, tmp_path / "chosen_bs", attn_implementation="block_sparse")
    entry = json.loads((renamed / "config.json").read_text())["hf_dilated"]
    assert {k: v for k, v in entry.items() if k not in ("attn_implementation", "scaled_rope")} == {
        k: v for k, v in json.loads((chosen / "config.json").read_text())["hf_dilated"].items()
        if k not in ("attn_implementation", "scaled_rope")}
    assert entry["scaled_rope"] is True


def test_a_scaled_rope_kept_for_a_longer_context_is_said(source, tmp_path):
    """A checkpoint whose RoPE is already scaled keeps it (rope_updates), and with it the context it
    covers: converted for more without far keys, nothing said so (info then showed the old context
    beside the new target). Far keys at grouped positions read past it: then nothing is said."""
    import warnings

    config = json.loads((source / "config.json").read_text())
    scaled = tmp_path / "scaled"
    shutil.copytree(source, scaled)
    config["rope_parameters"] = {**config["rope_parameters"], "rope_type": "linear", "factor": 2.0}
    (scaled / "config.json").write_text(json.dumps(config))
    with pytest.warns(UserWarning, match="rope_type='linear'\\) is kept, and covers 32 tokens .*not 128"):
        convert_checkpoint(scaled, tmp_path / "a", context_length=128)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        convert_checkpoint(scaled, tmp_path / "b", context_length=128, local_window=16, far_group=4)


def test_a_scaling_the_checkpoint_came_with_is_not_taken_for_an_earlier_conversions(source, tmp_path):
    """A checkpoint whose RoPE came scaled (linear x2) keeps it when converted (rope_updates). Converted
    again, that scaling was taken for the earlier conversion's own and replaced by 256 / 32 = 8 times
    the base frequencies, dropping the checkpoint's own x2 (a review's suspicion, confirmed here): it
    is kept again, and scaling it to another scheme is refused as at the first conversion."""
    import warnings

    config = json.loads((source / "config.json").read_text())
    scaled = tmp_path / "scaled"
    shutil.copytree(source, scaled)
    config["rope_parameters"] = {**config["rope_parameters"], "rope_type": "linear", "factor": 2.0}
    (scaled / "config.json").write_text(json.dumps(config))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        once = convert_checkpoint(scaled, tmp_path / "once", context_length=128)
        twice = convert_checkpoint(once, tmp_path / "twice", context_length=256)
    assert AutoConfig.from_pretrained(twice).rope_parameters["factor"] == 2.0
    with pytest.raises(ValueError, match="already scaled .*rope_type='linear'"):
        convert_checkpoint(once, tmp_path / "yarn", context_length=256, rope="yarn")
    # Its x2 equal to the first conversion's target over the original (32 -> 64): taken for ours by the
    # factor, and replaced by 256 / 32 = 8 (10.5 off the source inside its own context). The entry now
    # records who wrote the scaling.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        once = convert_checkpoint(scaled, tmp_path / "once-64", context_length=64)
        twice = convert_checkpoint(once, tmp_path / "twice-256", context_length=256)
    assert AutoConfig.from_pretrained(twice).rope_parameters["factor"] == 2.0
    assert AutoConfig.from_pretrained(once).hf_dilated["scaled_rope"] is False


def test_an_entry_from_before_scaled_rope_still_rescales_its_own_scaling(source, tmp_path):
    """Entries written before DilatedConfig.scaled_rope: an earlier conversion's own scaling (its factor
    the target over the original) is still rescaled on reconversion."""
    ours = convert_checkpoint(source, tmp_path / "ours", context_length=128, rope="linear",
                              attn_implementation="block_sparse")
    config = json.loads((ours / "config.json").read_text())
    assert config["hf_dilated"].pop("scaled_rope") is True
    (ours / "config.json").write_text(json.dumps(config))
    again = convert_checkpoint(ours, tmp_path / "again", context_length=256)
    assert AutoConfig.from_pretrained(again).rope_parameters["factor"] == 256 / 32



def test_a_scaling_kept_with_rope_none_is_kept_by_the_next_conversion(source, tmp_path):
    """Our linear scaling kept as it was with rope='none' (a choice to stop scaling) is kept by a later
    conversion without rope, as the factor rule kept it (a first form of scaled_rope recorded it as
    ours, and the next conversion scaled it to x8). Without rope='none' it is scaled again."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = convert_checkpoint(source, tmp_path / "ours", context_length=64, rope="linear",
                                  attn_implementation="block_sparse")
        kept = convert_checkpoint(ours, tmp_path / "kept", context_length=128, rope="none")
        later = convert_checkpoint(kept, tmp_path / "later", context_length=256)
        scaled = convert_checkpoint(ours, tmp_path / "scaled", context_length=256)
    assert AutoConfig.from_pretrained(later).rope_parameters["factor"] == 2.0
    assert AutoConfig.from_pretrained(scaled).rope_parameters["factor"] == 256 / 32


def test_what_was_chosen_before_is_kept_where_nothing_is_odd(source, tmp_path):
    """Found by a review of the three checks above: a dynamic NTK RoPE kept on re-conversion covers
    any length (no warning that it covers only its own); an unscaled RoPE chosen with rope='none'
    for a name without far keys stays unscaled (it is not kept *for far keys*); and dynamic NTK is
    refused only for the names that read far keys at grouped positions."""
    import warnings

    dynamic = convert_checkpoint(source, tmp_path / "dyn", context_length=64, rope="dynamic",
                                 attn_implementation="ring")
    with pytest.warns(UserWarning) as caught:
        convert_checkpoint(dynamic, tmp_path / "dyn2", context_length=128)
    assert not [w for w in caught if "covers" in str(w.message)], [str(w.message) for w in caught]
    plain = convert_checkpoint(source, tmp_path / "none", context_length=64, rope="none", attn_implementation="ring")
    with pytest.warns(UserWarning, match="kept the earlier conversion's unscaled RoPE"):
        again = convert_checkpoint(plain, tmp_path / "none2", context_length=128)
    assert AutoConfig.from_pretrained(again).rope_parameters["rope_type"] == "default"
    banded = convert_checkpoint(source, tmp_path / "band", context_length=128)  # far_group > 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for_ring = convert_checkpoint(banded, tmp_path / "ring", context_length=256, rope="dynamic",
                                      attn_implementation="ring")
    assert AutoConfig.from_pretrained(for_ring).hf_dilated["far_group"] > 1
    AutoModelForCausalLM.from_pretrained(for_ring, attn_implementation="ring")  # reads no far keys: loads
    with pytest.raises(ValueError, match="invalid 'hf_dilated' config entry: far_group="):
        AutoModelForCausalLM.from_pretrained(for_ring, attn_implementation="dilated")


def test_odd_but_valid_options_warn_what_was_kept(source, tmp_path):
    converted = convert_checkpoint(source, tmp_path / "long", context_length=128)
    with pytest.warns(UserWarning, match="kept the earlier conversion's context of 128 tokens"):
        yarn = convert_checkpoint(converted, tmp_path / "yarn", rope="yarn")  # --rope without --context
    config = json.loads((yarn / "config.json").read_text())
    assert config["rope_parameters"]["rope_type"] == "yarn" and config["max_position_embeddings"] == 128
    native = _copy_of(source, tmp_path / "native")  # a checkpoint whose own RoPE already covers 256 tokens
    raw = json.loads((native / "config.json").read_text())
    raw.update(max_position_embeddings=256, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
                                                             "original_max_position_embeddings": 32})
    (native / "config.json").write_text(json.dumps(raw))
    if original_length(AutoConfig.from_pretrained(native)) == 256:  # a scaled RoPE counts as trained at its length
        with pytest.raises(ValueError, match="shorter than the checkpoint's original context of 256 tokens"):
            convert_checkpoint(native, tmp_path / "native-128", context_length=128)
        return
    with pytest.warns(UserWarning, match="kept max_position_embeddings = 256"):  # original: the pre-scaling 32
        dst = convert_checkpoint(native, tmp_path / "native-128", context_length=128)
    config = json.loads((dst / "config.json").read_text())
    assert config["max_position_embeddings"] == 256 and config["hf_dilated"]["target_length"] == 128


def test_convert_removes_a_sliding_window_only_when_it_extends_the_context(tmp_path, capsys):
    """A Mistral checkpoint converted for a longer context loses its window and the CLI says so;
    converted at its own context it keeps the window (every name honours it)."""
    from transformers import MistralConfig

    src = tmp_path / "mistral"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(MistralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, sliding_window=16)).save_pretrained(src)
    assert cli(["convert", str(src), str(tmp_path / "long"), "--context", "256", "--rope", "none"]) == 0
    err = capsys.readouterr().err
    assert "warning: sliding_window: removed the checkpoint's 16-token sliding window" in err, err
    assert json.loads((tmp_path / "long" / "config.json").read_text())["sliding_window"] is None
    assert cli(["convert", str(src), str(tmp_path / "same"), "--context", "64"]) == 0
    assert "sliding_window" not in capsys.readouterr().err
    assert json.loads((tmp_path / "same" / "config.json").read_text())["sliding_window"] == 16
    assert json.loads((src / "config.json").read_text())["sliding_window"] == 16  # the source is untouched


def test_reconverting_a_default_conversion_gives_the_default_band_of_the_new_length(source, tmp_path):
    first = convert_checkpoint(source, tmp_path / "a", context_length=64)
    second = convert_checkpoint(first, tmp_path / "b", context_length=256)
    a = DilatedConfig.from_dict(json.loads((first / "config.json").read_text())["hf_dilated"])
    b = DilatedConfig.from_dict(json.loads((second / "config.json").read_text())["hf_dilated"])
    assert (a.local_window, a.far_group, a.far_window, a.segment_lengths, a.dilation_rates) == (32, 4, 4, [64], [1])
    assert (b.local_window, b.far_group, b.far_window, b.segment_lengths, b.dilation_rates) == (32, 16, 4, [256], [1])
    assert (a.far_top_k, b.far_top_k) == (8, 24)
    assert json.loads((second / "config.json").read_text())["rope_parameters"]["rope_type"] == "default"


def test_a_default_conversion_read_without_our_attention_declares_only_what_its_rope_supports(source, tmp_path):
    """Issue 33, item 11: the default conversion keeps the RoPE, so past the original context only
    hf_dilated's far keys at grouped positions are right. Engines that ignore the hf_dilated entry
    read max_position_embeddings: it stays the original context; the extended one is the entry's.
    Loaded under sdpa with hf_dilated imported, the model says so once; under our names it reads all."""
    import logging

    from transformers.utils.logging import get_logger

    from hf_dilated.integrations.transformers import supported_context

    dst = convert_checkpoint(source, tmp_path / "long", context_length=128)
    raw = json.loads((dst / "config.json").read_text())
    assert raw["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}
    assert raw["max_position_embeddings"] == 32 and raw["hf_dilated"]["target_length"] == 128
    config = AutoConfig.from_pretrained(dst)
    assert supported_context(config, "sdpa") == supported_context(config, "eager") == 32
    assert supported_context(config, "dilated") == supported_context(config, "dilated_ring") == 128
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    root = get_logger("transformers")
    root.addHandler(handler)
    get_logger("transformers.hf_dilated").warning_once.cache_clear()
    try:
        AutoModelForCausalLM.from_pretrained(dst, attn_implementation="dilated")
        assert not any("converted for" in line for line in lines), lines
        AutoModelForCausalLM.from_pretrained(dst, attn_implementation="sdpa")
    finally:
        root.removeHandler(handler)
    assert any("converted for 128 tokens" in line and "under 'sdpa' it is valid for up to 32 tokens" in line
               for line in lines), lines
    # An unconverted checkpoint, or one whose RoPE was scaled for the new context, says nothing.
    yarn = convert_checkpoint(source, tmp_path / "yarn", context_length=128, rope="yarn")
    assert json.loads((yarn / "config.json").read_text())["max_position_embeddings"] == 128
    assert supported_context(AutoConfig.from_pretrained(yarn), "sdpa") == 128


def test_a_conversion_that_keeps_the_rope_declares_its_target_under_our_names(source, tmp_path, capsys):
    """rope="none" with levels of one's own (as the main job's preset): the entry's target is what
    hf_dilated's attention reads, and config.json keeps the RoPE's own context, but in memory the
    model declared that too under our names, so generate() without max_new_tokens stopped at it
    ("max_length is set to 32") and `hf-dilated info` said 32 tokens (a review, 2026-11-28)."""
    from hf_dilated.integrations.transformers import supported_context

    dst = convert_checkpoint(source, tmp_path / "none", context_length=128, rope="none",
                             segment_lengths=[32, 64, 128], dilation_rates=[1, 2, 4])
    assert json.loads((dst / "config.json").read_text())["max_position_embeddings"] == 32
    config = AutoConfig.from_pretrained(dst)
    assert supported_context(config, "sdpa") == 32
    assert all(supported_context(config, name) == 128 for name in ("dilated", "dilated_ring", "block_sparse"))
    assert supported_context(config, "ring") == 32  # (dense: what sdpa computes, as wrong past 32)
    model = AutoModelForCausalLM.from_pretrained(dst)
    assert model.config.max_position_embeddings == 128
    assert model.generate(torch.randint(3, 100, (1, 60))).shape[1] == 80  # (transformers' default: 20 more)
    model.save_pretrained(tmp_path / "saved")
    assert json.loads((tmp_path / "saved" / "config.json").read_text())["max_position_embeddings"] == 32
    model.set_attn_implementation("sdpa")
    assert model.config.max_position_embeddings == 32
    assert cli(["info", str(dst)]) == 0
    assert "context:              128 tokens under dilated, block_sparse, dilated_ring, block_sparse_ring " \
           "(the entry's attention); 32 under any other" in capsys.readouterr().out


def test_an_older_conversion_that_raised_max_position_embeddings_is_put_back_on_reconversion(source, tmp_path):
    """Conversions before issue 33 declared the extended context in max_position_embeddings with
    the RoPE unscaled; re-converting one declares what its RoPE supports again."""
    dst = convert_checkpoint(source, tmp_path / "long", context_length=128)
    raw = json.loads((dst / "config.json").read_text())
    raw["max_position_embeddings"] = 128  # what an older hf_dilated wrote
    old = _copy_of(dst, tmp_path / "old")
    (old / "config.json").write_text(json.dumps(raw))
    again = convert_checkpoint(old, tmp_path / "again", context_length=256)
    config = json.loads((again / "config.json").read_text())
    assert config["max_position_embeddings"] == 32 and config["hf_dilated"]["target_length"] == 256


def test_a_default_conversion_under_dilated_declares_its_converted_context_in_memory_only(source, tmp_path):
    """transformers' generate() reads max_position_embeddings as the model's context (it caps a
    default max_length there): under the names that read far keys it is the converted target in
    memory, while save_pretrained keeps writing the RoPE's own context for other engines (review
    of issue 33: generate() refused a prompt past L under dilated)."""
    dst = convert_checkpoint(source, tmp_path / "long", context_length=128)
    model = AutoModelForCausalLM.from_pretrained(dst, attn_implementation="dilated")
    assert model.config.max_position_embeddings == 128
    prompt = torch.randint(3, 60, (1, 100), generator=torch.Generator().manual_seed(0))
    out = model.generate(prompt, do_sample=False)  # no max_new_tokens: transformers' default, 20 more
    assert out.shape[1] == 120
    model.save_pretrained(tmp_path / "saved")
    assert model.config.max_position_embeddings == 128
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert saved["max_position_embeddings"] == 32 and saved["hf_dilated"]["target_length"] == 128
    model.config.save_pretrained(tmp_path / "config_alone")  # (it wrote 128)
    assert model.config.max_position_embeddings == 128
    assert json.loads((tmp_path / "config_alone" / "config.json").read_text())["max_position_embeddings"] == 32
    model.set_attn_implementation("sdpa")
    assert model.config.max_position_embeddings == 32
    model.set_attn_implementation("dilated")
    assert model.config.max_position_embeddings == 128


def test_an_entry_we_cannot_read_never_stops_a_load_under_another_attention(source, tmp_path):
    """A checkpoint whose hf_dilated entry this version cannot parse (a newer field, a corrupt value)
    still loads under sdpa: only our names read it."""
    dst = convert_checkpoint(source, tmp_path / "long", context_length=128)
    raw = json.loads((dst / "config.json").read_text())
    for entry in ({**raw["hf_dilated"], "from_the_future": 1}, {**raw["hf_dilated"], "target_length": "long"}, [1]):
        broken = _copy_of(dst, tmp_path / f"broken{len(str(entry))}")
        (broken / "config.json").write_text(json.dumps({**raw, "hf_dilated": entry}))
        model = AutoModelForCausalLM.from_pretrained(broken, attn_implementation="sdpa")
        assert model.config._attn_implementation == "sdpa"


def test_reconverting_keeps_a_band_the_user_chose_with_its_far_grouping(source, tmp_path):
    """Only the default band is recomputed for a new length; a band the user chose keeps its far
    grouping (it was dropped, leaving far keys at unscaled positions past L)."""
    first = convert_checkpoint(source, tmp_path / "a", context_length=64, local_window=32, far_group=4)
    second = convert_checkpoint(first, tmp_path / "b", context_length=256)
    b = DilatedConfig.from_dict(json.loads((second / "config.json").read_text())["hf_dilated"])
    assert (b.local_window, b.far_group, b.target_length) == (32, 4, 256)
