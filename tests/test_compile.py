"""transformers' fast-generation recipe, StaticCache + torch.compile(fullgraph=True), with every
name: the compiled decode step traces without a graph break, gives the tokens of eager generation
with a DynamicCache, and a second generation with other inputs of the same shapes reuses the
graph (it runs under torch.compiler's "fail_on_recompile" stance), also with a shorter prompt in
a cache of the same size. These are the checks of transformers' own
`test_generate_compile_model_forward_fullgraph` and `test_static_cache_no_recompile_with_smaller_length`
(its tests are not installed with the package, so the checks are written here). Most cases compile with the "eager" backend (dynamo's
tracing and guards, without inductor's code generation); one case runs inductor."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, CompileConfig, Qwen2Config

from hf_dilated.convert import convert_checkpoint
from hf_dilated.model_configs import build_model_config

NAMES = ("dilated", "dilated_ring", "ring", "block_sparse", "block_sparse_ring")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> converted checkpoint (random weights, safetensors): the tiny presets' levels for
    Llama and GPT-NeoX, and the default conversion (a local band with far keys at grouped positions)."""
    out = {}
    for preset in ("tiny-llama", "tiny-gpt-neox"):
        root = tmp_path_factory.mktemp(preset)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(build_model_config(preset)).save_pretrained(root / "base")
        out[preset] = convert_checkpoint(root / "base", root / "long", preset=preset)
        if preset == "tiny-llama":
            out["tiny-llama-band"] = convert_checkpoint(root / "base", root / "band", attn_implementation="dilated",
                                                        context_length=128)
    # Qwen2 without its sliding window (the default): its static cache layers are plain ones
    root = tmp_path_factory.mktemp("qwen2")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(Qwen2Config(vocab_size=256, hidden_size=32, num_hidden_layers=2,
                                                 num_attention_heads=4, num_key_value_heads=2, intermediate_size=37,
                                                 max_position_embeddings=128)).save_pretrained(root)
    out["qwen2"] = root
    return out


def _inputs(seed, length):
    """Two rows of `length` tokens, the second left-padded by 5: both decode across position 64."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 200, (2, length), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    return ids, mask


def _generate(model, ids, mask, **kwargs):
    return model.generate(ids, attention_mask=mask, max_new_tokens=30, min_new_tokens=30, do_sample=False,
                          pad_token_id=0, **kwargs)


def _compiled_matches_eager(path, name, backend):
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=name, dtype=torch.float32).eval()
    config = CompileConfig(fullgraph=True, dynamic=False, backend=backend)
    config._compile_all_devices = True  # transformers compiles on CPU only when told to
    torch.compiler.reset()
    with torch.no_grad():
        for run, (seed, length) in enumerate(((1, 40), (2, 36))):
            ids, mask = _inputs(seed, length)
            with torch.compiler.set_stance("force_eager"):
                eager = _generate(model, ids, mask)
            stance = "fail_on_recompile" if run else "default"  # the second run must reuse the first's graph
            with torch.compiler.set_stance(stance):
                compiled = _generate(model, ids, mask, cache_implementation="static", compile_config=config,
                                     max_cache_len=80)  # one cache size for both runs
            assert torch.equal(compiled, eager), (name, run)
    assert hasattr(model, "_compiled_call")  # the decode steps did run compiled


@pytest.mark.parametrize("name", NAMES)
def test_static_cache_compiled_fullgraph_equals_eager_without_recompiling(checkpoints, name):
    _compiled_matches_eager(checkpoints["tiny-llama"], name, backend="eager")


@pytest.mark.parametrize("case", ["tiny-gpt-neox", "tiny-llama-band", "qwen2"])
def test_static_cache_compiled_fullgraph_other_family_and_band(checkpoints, case):
    _compiled_matches_eager(checkpoints[case], "dilated", backend="eager")


def test_static_cache_compiled_with_inductor(checkpoints):
    _compiled_matches_eager(checkpoints["tiny-llama"], "dilated", backend="inductor")
