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
            # (2 blocks of 4 per query: the kept steps rank their candidates, as at length)
            out["tiny-llama-band"] = convert_checkpoint(root / "base", root / "band", attn_implementation="dilated",
                                                        context_length=128, far_top_k=2, far_block_size=4)
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
    return model


def _kept_summaries(cache):
    """The far keys' block summaries kept on each layer's key tensor of a static cache."""
    from hf_dilated.ops.sparse_far_static import ATTRIBUTE

    return [getattr(layer.keys, ATTRIBUTE, None) for layer in cache.layers]


@pytest.mark.parametrize("name", NAMES)
def test_static_cache_compiled_fullgraph_equals_eager_without_recompiling(checkpoints, name):
    _compiled_matches_eager(checkpoints["tiny-llama"], name, backend="eager")


@pytest.mark.parametrize("case", ["tiny-gpt-neox", "tiny-llama-band", "qwen2"])
def test_static_cache_compiled_fullgraph_other_family_and_band(checkpoints, case):
    model = _compiled_matches_eager(checkpoints[case], "dilated", backend="eager")
    if case == "tiny-llama-band":  # sparse far keys: the compiled steps read the block summaries kept on the cache
        ids, mask = _inputs(1, 40)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=30, min_new_tokens=30, do_sample=False,
                                 pad_token_id=0, cache_implementation="static", max_cache_len=80,
                                 compile_config=CompileConfig(fullgraph=True, dynamic=False, backend="eager"),
                                 return_dict_in_generate=True)
        kept = _kept_summaries(out.past_key_values)
        assert kept and all(s is not None and int(s.cut) == 0 for s in kept)


def test_static_cache_steps_after_a_prefill_without_mask_match_eager(checkpoints):
    """A StaticCache prefill without an attention mask (every written slot real), then compiled
    steps reading the far keys' kept summaries: the logits of eager steps with a DynamicCache
    (the prefill failed here once: the kept summaries read the mask kernel_inputs had dropped)."""
    from transformers import DynamicCache, StaticCache

    model = AutoModelForCausalLM.from_pretrained(checkpoints["tiny-llama-band"], attn_implementation="dilated",
                                                 dtype=torch.float32).eval()
    ids = torch.randint(3, 200, (1, 60), generator=torch.Generator().manual_seed(3))
    torch.compiler.reset()
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    with torch.no_grad():
        static, dynamic = StaticCache(config=model.config, max_cache_len=80), DynamicCache(config=model.config)
        model(ids[:, :50], past_key_values=static, cache_position=torch.arange(50))
        model(ids[:, :50], past_key_values=dynamic)
        for t in range(50, 60):
            got = compiled(ids[:, t:t + 1], past_key_values=static, cache_position=torch.tensor([t])).logits
            want = model(ids[:, t:t + 1], past_key_values=dynamic).logits
            assert (got - want).abs().max().item() < 1e-4, t
    assert all(s is not None for s in _kept_summaries(static))


@pytest.mark.parametrize("kept", (True, False), ids=("kept_summaries", "every_slot"))
def test_compiled_static_steps_of_a_left_padded_row_at_default_positions_match_a_forward(checkpoints, kept,
                                                                                       monkeypatch):
    """A loop of its own on a StaticCache (transformers' default position_ids, the indices: a
    left-padded row rotated `padding` further than its mask ranks): the compiled steps took the
    model's positions to be the ranks, and chose far blocks by summaries and a query moved from the
    wrong place (0.069 off a forward here in the padded row, 4.6 in a review's model; the eager steps
    matched). Now they take the
    offset from the step's position_ids, on the device. In float64, with the kept summaries and
    without them (every slot summarised in the step)."""
    from transformers import StaticCache

    from hf_dilated.ops import sparse_far_static

    if not kept:
        monkeypatch.setattr(sparse_far_static, "kept_for", lambda *args: None)
    model = AutoModelForCausalLM.from_pretrained(checkpoints["tiny-llama-band"], attn_implementation="dilated",
                                                 dtype=torch.float64).eval()
    with torch.no_grad():  # a pad row of zeros would tie every far block (a query of zeros)
        model.model.embed_tokens.weight[0].normal_(generator=torch.Generator().manual_seed(9))
    ids = torch.randint(3, 200, (2, 66), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    torch.compiler.reset()
    step = torch.compile(model, fullgraph=True, backend="eager", dynamic=False)
    with torch.no_grad():
        cache = StaticCache(config=model.config, max_cache_len=80)
        model(ids[:, :60], attention_mask=mask[:, :60], past_key_values=cache)
        got = torch.cat([step(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], past_key_values=cache,
                              cache_position=torch.tensor([t])).logits for t in range(60, 66)], 1)
        want = model(ids, attention_mask=mask, use_cache=False).logits[:, 60:]
    assert (got - want).abs().max().item() < 1e-10


@pytest.mark.parametrize("case", ["tiny-llama", "tiny-llama-band"])
def test_static_cache_compiled_with_inductor(checkpoints, case):
    """Inductor's code for the compiled steps: union levels, and sparse far keys (the kept block
    summaries read and written through the cache's key tensor)."""
    _compiled_matches_eager(checkpoints[case], "dilated", backend="inductor")


# --- transformers' own two compile tests, as its test suite runs them with a forced name -------
# (tests/generation/test_utils.py `test_generate_compile_model_forward_fullgraph` and
# `test_static_cache_no_recompile_with_smaller_length`): the model tester's tiny config (2 layers,
# hidden 32, 7-token prompts whose attention masks are torch.tril of ones, so right-padded rows),
# the model built from it and, here, saved and reloaded as safetensors; compile_config
# CompileConfig(fullgraph=True, dynamic=False) with the default backend (inductor).

import logging

from transformers import GPTNeoXConfig, LlamaConfig, MistralConfig
from transformers.testing_utils import CaptureLogger

_TESTER = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
               intermediate_size=37, hidden_act="gelu", max_position_embeddings=512, pad_token_id=0, bos_token_id=1,
               eos_token_id=None)
_FAMILIES = {"llama": LlamaConfig, "gpt_neox": GPTNeoXConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}


@pytest.fixture(scope="module")
def tester_checkpoints(tmp_path_factory):
    out = {}
    for family, config_class in _FAMILIES.items():
        root = tmp_path_factory.mktemp(f"tester-{family}")
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config_class(**_TESTER)).save_pretrained(root)
        out[family] = root
    return out


def _tester_inputs(batch=4, length=7):
    ids = torch.randint(0, 99, (batch, length), generator=torch.Generator().manual_seed(0))
    return ids, torch.tril(torch.ones_like(ids))


def _compile_config():
    config = CompileConfig(fullgraph=True, dynamic=False)  # errors out on dynamic shapes
    config._compile_all_devices = True  # compile on CPU too
    return config


def _load(path, name):
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation=name, dtype=torch.float32).eval()


def _generate_compile_model_forward_fullgraph(path, name):
    """transformers' test: two input sets of one shape (the halves of a batch of 4), eager generation
    with the dynamic cache, then compiled generation with the static cache; any recompilation in
    the compiled runs (dynamo's recompile log) fails, except on a model with sliding-window layers,
    where transformers' own static sliding layer recompiles per step with dynamic=False."""
    model = _load(path, name)
    ids, mask = _tester_inputs()
    sets = [dict(input_ids=ids[:2], attention_mask=mask[:2]), dict(input_ids=ids[2:4], attention_mask=mask[2:4])]
    torch.compiler.reset()
    kwargs = dict(use_cache=True, do_sample=False, max_new_tokens=5, return_dict_in_generate=True, output_scores=True,
                  compile_config=_compile_config())
    with torch.compiler.set_stance("force_eager"):
        dynamic = [model.generate(**inputs, **kwargs) for inputs in sets]
    assert not hasattr(model, "_compiled_call")
    kwargs["cache_implementation"] = "static"
    compiled = []
    try:
        torch._logging.set_logs(recompiles_verbose=True)
        with CaptureLogger(logging.getLogger("torch._dynamo.guards")) as cl:
            for inputs in sets:
                out = model.generate(**inputs, **kwargs)
                assert out.past_key_values.is_compileable
                assert hasattr(model, "_compiled_call")
                compiled.append(out)
    finally:
        torch._logging.set_logs()
    recompiled = "Recompiling" in cl.out or ("guard" in cl.out and "failure" in cl.out)
    if not any(out.past_key_values.is_sliding):
        assert not recompiled, cl.out
    for eager, comp in zip(dynamic, compiled):
        assert torch.equal(eager.sequences, comp.sequences)


@pytest.mark.parametrize("name", NAMES)
def test_transformers_generate_compile_model_forward_fullgraph(tester_checkpoints, name):
    _generate_compile_model_forward_fullgraph(tester_checkpoints["llama"], name)


@pytest.mark.parametrize("family", ["gpt_neox", "qwen2", "mistral"])
def test_transformers_generate_compile_model_forward_fullgraph_families(tester_checkpoints, family):
    """Mistral's layers are all sliding-window ones (a window of 4096 over a 12-slot static cache):
    their steps trace in full too, with the window kept by the static decode."""
    _generate_compile_model_forward_fullgraph(tester_checkpoints[family], "dilated")


def _static_cache_no_recompile_with_smaller_length(path, name):
    """A compiled static-cache generation, then one from a shorter prompt into a cache of the same
    size (max_length) under "fail_on_recompile"; both give eager generation's tokens."""
    model = _load(path, name)
    ids, mask = _tester_inputs(batch=2)
    kwargs = dict(do_sample=False, max_length=20, min_length=20, compile_config=_compile_config())
    torch.compiler.reset()
    for run, length in enumerate((7, 4)):
        inputs = dict(input_ids=ids[:, :length], attention_mask=mask[:, :length])
        with torch.compiler.set_stance("force_eager"):
            eager = model.generate(**inputs, **kwargs)
        with torch.compiler.set_stance("fail_on_recompile" if run else "default"):
            compiled = model.generate(**inputs, cache_implementation="static", **kwargs)
        assert torch.equal(compiled, eager), (name, length)
    assert hasattr(model, "_compiled_call")


@pytest.mark.parametrize("name", NAMES)
def test_transformers_static_cache_no_recompile_with_smaller_length(tester_checkpoints, name):
    _static_cache_no_recompile_with_smaller_length(tester_checkpoints["llama"], name)


@pytest.mark.parametrize("family", ["gpt_neox", "qwen2"])
def test_transformers_static_cache_no_recompile_with_smaller_length_families(tester_checkpoints, family):
    _static_cache_no_recompile_with_smaller_length(tester_checkpoints[family], "dilated")


def test_compiled_call_off_a_static_cache_names_the_limitation(tester_checkpoints):
    """A fullgraph-compiled forward that is not a static cache's step (here a prefill without a
    cache) fails with the limitation named, not on the first untraceable line of the eager path."""
    model = _load(tester_checkpoints["llama"], "dilated")
    ids, mask = _tester_inputs(batch=2)
    torch.compiler.reset()
    forward = torch.compile(model, fullgraph=True, backend="eager")
    with torch.no_grad(), pytest.raises(Exception, match="only decode steps on a static cache"):
        forward(input_ids=ids, attention_mask=mask, use_cache=False)
