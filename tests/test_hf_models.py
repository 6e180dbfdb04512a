"""Real transformers models (tiny Llama and GPT-NeoX built from the model_configs presets, saved and
loaded as safetensors) running every attention name hf_dilated registers."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import AttentionInterface, AutoModelForCausalLM
from transformers.masking_utils import AttentionMaskInterface

import hf_dilated
from hf_dilated.convert import convert_checkpoint
from hf_dilated.integrations import transformers as glue
from hf_dilated.config import DilatedConfig
from hf_dilated.model_configs import build_model_config, load_preset
from reference import dilated_reference

FAMILIES = ("tiny-llama", "tiny-gpt-neox")
NAMES = ("dilated", "dilated_ring", "ring", "block_sparse", "block_sparse_ring")
FIRST_SEGMENT = 32  # the tiny presets' pretraining context = first dilated segment
LONG = 100  # crosses the 32- and 64-token segment boundaries


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """preset -> (original checkpoint dir, converted long-context dir), random weights, safetensors."""
    out = {}
    for preset in FAMILIES:
        root = tmp_path_factory.mktemp(preset)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(build_model_config(preset))
        model.save_pretrained(root / "base", safe_serialization=True)
        convert_checkpoint(root / "base", root / "long", preset=preset)
        out[preset] = (root / "base", root / "long")
    return out


def load(path, attn_implementation):
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn_implementation, dtype=torch.float32)
    return model.eval()


def tokens(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 200, shape, generator=g)


def test_import_registers_every_name_with_attention_and_mask_interfaces():
    for name in NAMES:
        assert AttentionInterface._global_mapping[name] is glue.ATTENTION_FUNCTIONS[name]
        assert AttentionMaskInterface._global_mapping[name] is glue.padding_mask


def test_mask_function_passes_the_2d_padding_mask_never_a_dense_one(checkpoints):
    seen = []
    original = glue.ATTENTION_FUNCTIONS["dilated"]

    def spy(module, query, key, value, attention_mask, **kwargs):
        seen.append(None if attention_mask is None else (tuple(attention_mask.shape), attention_mask.dtype))
        return original(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("dilated", spy)
    try:
        model = load(checkpoints["tiny-llama"][1], "dilated")
        mask = torch.ones(2, 40, dtype=torch.long)
        mask[1, :5] = 0
        model(tokens(2, 40), attention_mask=mask)
        model(tokens(2, 40), attention_mask=torch.ones(2, 40, dtype=torch.long))
        model(tokens(2, 40), use_cache=False)
    finally:
        AttentionInterface.register("dilated", original)
    # 2 layers each. A given mask, even all ones, arrives (it makes each row one document, as for
    # sdpa); no mask and no packing -> None.
    mask2d = ((2, 40), torch.bool)
    assert seen == [mask2d, mask2d, mask2d, mask2d, None, None]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("preset", FAMILIES)
def test_forward_and_backward(checkpoints, preset, name):
    model = load(checkpoints[preset][1], name).train()
    ids = tokens(1, LONG)
    loss = model(ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)
    grads = {n: p.grad for n, p in model.named_parameters() if "layers.0" in n and p.dim() == 2}
    assert grads and all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads.values())


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("preset", FAMILIES)
def test_equals_sdpa_within_the_first_segment(checkpoints, preset, name):
    sdpa, ours = load(checkpoints[preset][1], "sdpa"), load(checkpoints[preset][1], name)
    ids = tokens(2, FIRST_SEGMENT)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, sdpa(ids).logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("preset", FAMILIES)
def test_ring_on_one_process_equals_sdpa_at_any_length(checkpoints, preset):
    sdpa, ring = load(checkpoints[preset][1], "sdpa"), load(checkpoints[preset][1], "ring")
    ids = tokens(2, LONG)
    with torch.no_grad():
        torch.testing.assert_close(ring(ids).logits, sdpa(ids).logits, atol=1e-4, rtol=1e-4)


def _reference_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    # Independent float64 evaluation of docs/contract.md 4 for inputs without padding or packing.
    assert attention_mask is None and query.shape[2] == key.shape[2]
    cfg = DilatedConfig.from_model_config(module.config)
    out = dilated_reference(query.double(), key.double(), value.double(), cfg.segment_lengths, cfg.dilation_rates,
                            cfg.mode, scale=scaling)
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


@pytest.mark.parametrize("preset", FAMILIES)
def test_dilated_model_matches_the_float64_reference_beyond_the_first_segment(checkpoints, preset):
    AttentionInterface.register("hf_dilated_test_reference", _reference_attention)
    AttentionMaskInterface.register("hf_dilated_test_reference", glue.padding_mask)
    ref, ours = load(checkpoints[preset][1], "hf_dilated_test_reference"), load(checkpoints[preset][1], "dilated")
    sdpa = load(checkpoints[preset][1], "sdpa")
    ids = tokens(1, LONG)
    with torch.no_grad():
        got, want = ours(ids).logits, ref(ids).logits
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        # and the pattern is really sparse there: beyond the first segment it is not sdpa
        assert (got[:, FIRST_SEGMENT:] - sdpa(ids).logits[:, FIRST_SEGMENT:]).abs().max() > 1e-3


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("preset", FAMILIES)
def test_padded_batch_equals_rows_alone(checkpoints, preset, name):
    model = load(checkpoints[preset][1], name)
    lengths = (LONG, 70)
    rows = [tokens(1, n, seed=i) for i, n in enumerate(lengths)]
    with torch.no_grad():
        alone = [model(r).logits[0] for r in rows]
        for side in ("left", "right"):
            ids = torch.zeros(2, LONG, dtype=torch.long)
            mask = torch.zeros(2, LONG, dtype=torch.long)
            for i, r in enumerate(rows):
                sl = slice(LONG - r.shape[1], LONG) if side == "left" else slice(0, r.shape[1])
                ids[i, sl], mask[i, sl] = r[0], 1
            logits = model(ids, attention_mask=mask).logits
            for i, r in enumerate(rows):
                sl = slice(LONG - r.shape[1], LONG) if side == "left" else slice(0, r.shape[1])
                torch.testing.assert_close(logits[i, sl], alone[i], atol=1e-4, rtol=1e-4, msg=f"{side} row {i}")


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("preset", FAMILIES)
def test_packed_documents_equal_documents_alone(checkpoints, preset, name):
    model = load(checkpoints[preset][1], name)
    docs = [tokens(1, n, seed=10 + i) for i, n in enumerate((40, 50, 30))]
    ids = torch.cat(docs, dim=1)
    position_ids = torch.cat([torch.arange(d.shape[1]) for d in docs])[None]
    with torch.no_grad():
        # use_cache=False: with a KV cache transformers does not look for packed sequences (sdpa then
        # lets the documents see each other, and so do we: test_layouts_match_sdpa covers that).
        packed = model(ids, position_ids=position_ids, use_cache=False).logits[0]
        start = 0
        for d in docs:
            n = d.shape[1]
            torch.testing.assert_close(packed[start:start + n], model(d).logits[0], atol=1e-4, rtol=1e-4)
            start += n


def _greedy(model, ids, attention_mask=None, use_cache=True, new=6):
    return model.generate(ids, attention_mask=attention_mask, max_new_tokens=new, min_new_tokens=new,
                          do_sample=False, use_cache=use_cache, pad_token_id=0)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("preset", FAMILIES)
def test_generate_with_cache_equals_without_and_left_padding_equals_alone(checkpoints, preset, name):
    model = load(checkpoints[preset][1], name)
    prompts = [tokens(1, 61, seed=20), tokens(1, 41, seed=21)]  # the first one decodes across position 64
    with torch.no_grad():
        alone = [_greedy(model, p) for p in prompts]
        assert torch.equal(alone[0], _greedy(model, prompts[0], use_cache=False))
        width = max(p.shape[1] for p in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - p.shape[1]:], mask[i, width - p.shape[1]:] = p[0], 1
        batch = _greedy(model, ids, attention_mask=mask)
    for i, p in enumerate(prompts):
        assert torch.equal(batch[i, width:], alone[i][0, p.shape[1]:])


def test_decode_steps_pass_one_query_against_the_cache(checkpoints, monkeypatch):
    shapes = []
    import hf_dilated.ops.dilated as dilated_module

    kernel = dilated_module.dilated_attention

    def recording(q, k, v, *args, **kwargs):
        shapes.append((q.shape[2], k.shape[2]))
        return kernel(q, k, v, *args, **kwargs)

    monkeypatch.setattr(dilated_module, "dilated_attention", recording)
    model = load(checkpoints["tiny-llama"][1], "dilated")
    with torch.no_grad():
        _greedy(model, tokens(1, 50), new=5)
    layers = model.config.num_hidden_layers
    assert shapes[:layers] == [(50, 50)] * layers  # prefill
    assert shapes[layers:] == [(1, 50 + s) for s in range(1, 5) for _ in range(layers)]


def test_static_cache_generate_equals_dynamic_cache(checkpoints):
    # A static cache hands the attention max_cache_len keys, most still empty: they must be dropped.
    model = load(checkpoints["tiny-llama"][1], "dilated")
    ids = torch.cat([torch.zeros(1, 7, dtype=torch.long), tokens(1, 43, seed=30)], dim=1).repeat(2, 1)
    ids[0, :7] = tokens(1, 7, seed=31)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    with torch.no_grad():
        dynamic = _greedy(model, ids, attention_mask=mask, new=8)
        static = model.generate(ids, attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False,
                                pad_token_id=0, cache_implementation="static")
    assert torch.equal(static, dynamic)


@pytest.mark.parametrize("preset", FAMILIES)
def test_set_attn_implementation_and_save_roundtrip(checkpoints, preset, tmp_path):
    base, long = checkpoints[preset]
    ids = tokens(1, LONG)
    # the converted checkpoint names its implementation in config.json
    model = AutoModelForCausalLM.from_pretrained(long, dtype=torch.float32).eval()
    assert model.config._attn_implementation == load_preset(preset)["attn_implementation"]
    with torch.no_grad():
        want = model(ids).logits
        switched = load(long, "sdpa")
        switched.set_attn_implementation("dilated")
        torch.testing.assert_close(switched(ids).logits, want)
    model.save_pretrained(tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    # The entry survives, with the name it runs under recorded (save_pretrained drops the
    # top-level attn_implementation); test_model_entry_points checks the reload picks it up.
    recorded = saved["hf_dilated"].pop("attn_implementation")
    assert recorded == load_preset(preset)["attn_implementation"]
    assert saved["hf_dilated"] == json.loads((long / "config.json").read_text())["hf_dilated"]
    reloaded = load(tmp_path / "saved", "dilated_ring")
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, want)


@pytest.mark.parametrize("preset", FAMILIES)
def test_patch_in_place_equals_the_converted_checkpoint(checkpoints, preset):
    base, long = checkpoints[preset]
    p = load_preset(preset)
    model = load(base, "sdpa")
    returned = hf_dilated.patch(model, "dilated", context_length=p["context_length"], rope=p["rope"], **p["hf_dilated"])
    assert returned is model and model.config._attn_implementation == "dilated"
    converted = load(long, "dilated")
    assert model.config.hf_dilated == converted.config.hf_dilated
    assert model.config.rope_parameters == converted.config.rope_parameters
    ids = tokens(1, LONG)
    with torch.no_grad():  # same RoPE scaling (rotary embeddings rebuilt) and same pattern
        torch.testing.assert_close(model(ids).logits, converted(ids).logits)


@pytest.mark.parametrize("loaded_as", ("sdpa", "dilated"))
def test_patch_declares_the_context_and_records_the_name_whatever_the_model_was_loaded_as(checkpoints, loaded_as,
                                                                                         tmp_path):
    """README's Quick start: load under "dilated", then patch to "dilated" with a context. transformers'
    set_attn_implementation skips its hook when the name does not change: the model declared its
    original 32 tokens (generate() then refused longer prompts) and saved no name (reloaded as sdpa)."""
    model = load(checkpoints["tiny-llama"][0], loaded_as)
    hf_dilated.patch(model, "dilated", context_length=128)
    assert model.config.max_position_embeddings == 128
    assert model.config.hf_dilated["attn_implementation"] == "dilated"
    model.save_pretrained(tmp_path / "saved")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    assert reloaded.config._attn_implementation == "dilated"
    assert reloaded.config.max_position_embeddings == 128
    with torch.no_grad():
        assert _greedy(model, tokens(1, 40), new=3).shape[1] == 43


def test_patch_family_makes_later_loads_use_ours(checkpoints):
    base, _ = checkpoints["tiny-llama"]
    from transformers import PreTrainedModel
    from transformers.models.llama.modeling_llama import LlamaPreTrainedModel

    hook = PreTrainedModel._check_and_adjust_attn_implementation
    hf_dilated.patch_family("llama", "dilated_ring", mode="longnet")
    try:
        # One wrapper of transformers' hook (hf_dilated's, installed at import): patch_family records a default.
        assert PreTrainedModel._check_and_adjust_attn_implementation is hook and hook._hf_dilated
        assert "_check_and_adjust_attn_implementation" not in vars(LlamaPreTrainedModel)
        model = AutoModelForCausalLM.from_pretrained(base)
        assert model.config._attn_implementation == "dilated_ring"
        assert model.config.hf_dilated["mode"] == "longnet"
        assert load(base, "sdpa").config._attn_implementation == "sdpa"  # an explicit choice still wins
        neox = AutoModelForCausalLM.from_pretrained(checkpoints["tiny-gpt-neox"][0])
        assert neox.config._attn_implementation == "sdpa"  # other families untouched
    finally:
        hf_dilated.unpatch_family("llama")
    assert AutoModelForCausalLM.from_pretrained(base).config._attn_implementation == "sdpa"


@pytest.mark.parametrize("preset", FAMILIES)
def test_lora_trains_a_step_and_its_adapter_reloads(checkpoints, preset, tmp_path):
    from peft import PeftModel, get_peft_model

    long = checkpoints[preset][1]
    model = get_peft_model(load(long, "dilated"), hf_dilated.lora_config(preset.removeprefix("tiny-").replace("-", "_"), r=4))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any("lora_A" in n for n in trainable)
    assert any("embed" in n for n in trainable) and any("norm" in n for n in trainable)  # LongLoRA extras
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = tokens(2, 80)
    before = model(ids, labels=ids).loss
    before.backward()
    opt.step()
    opt.zero_grad()
    model.eval()
    with torch.no_grad():
        after = model(ids, labels=ids).loss
        trained = model(ids).logits
    assert after < before
    model.save_pretrained(tmp_path / "adapter")
    reloaded = PeftModel.from_pretrained(load(long, "dilated"), tmp_path / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, trained)


def test_lora_keeps_a_tied_output_head_tied_through_training_merge_and_reload(tmp_path):
    """A model that ties its output head to its input embeddings (SmolLM2): lora_config trains the
    embeddings (LongLoRA), and peft trained them apart from the head ("a tied layer is part of the
    adapter, but ensure_weight_tying is not set"), so the merged model came out untied. Now they stay
    one matrix: trained, merged, saved and reloaded, and the adapter reloaded on a fresh base."""
    import warnings

    from peft import PeftModel, get_peft_model
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "base")
    assert not getattr(hf_dilated.lora_config("llama"), "ensure_weight_tying", False)  # a model_type: nothing to go by
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*tied layer is part of the adapter.*")
        base = load(tmp_path / "base", "dilated")
        model = get_peft_model(base, hf_dilated.lora_config(base, r=4))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = tokens(2, 40) % 100
    for _ in range(3):
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    with torch.no_grad():
        trained = model(ids).logits
    model.save_pretrained(tmp_path / "adapter")
    merged = model.merge_and_unload()
    assert merged.lm_head.weight is merged.model.embed_tokens.weight and merged.config.tie_word_embeddings
    merged.save_pretrained(tmp_path / "merged")
    for again in (load(tmp_path / "merged", "dilated"),
                  PeftModel.from_pretrained(load(tmp_path / "base", "dilated"), tmp_path / "adapter")):
        with torch.no_grad():
            torch.testing.assert_close(again.eval()(ids).logits, trained, atol=1e-5, rtol=1e-5)


def test_lora_config_takes_peft_fields_in_place_of_the_family_defaults():
    """A peft user extending the targets or the saved modules got "got multiple values for keyword
    argument 'target_modules'"."""
    config = hf_dilated.lora_config("llama", target_modules=["q_proj", "v_proj", "gate_proj"],
                                    modules_to_save=["lm_head"], bias="lora_only")
    assert set(config.target_modules) == {"q_proj", "v_proj", "gate_proj"}
    assert list(config.modules_to_save) == ["lm_head"] and config.bias == "lora_only"
    default = hf_dilated.lora_config("llama")
    assert set(default.target_modules) == {"q_proj", "k_proj", "v_proj", "o_proj"} and "norm" in default.modules_to_save
    assert hf_dilated.lora_config("llama", long_context=False).modules_to_save is None


def _windowed_configs():
    from transformers import MistralConfig, Qwen2Config

    small = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=32)
    return (MistralConfig(sliding_window=16, **small),
            Qwen2Config(use_sliding_window=True, sliding_window=16, max_window_layers=0, **small))


def test_mistral_and_qwen2_keep_their_sliding_window_when_patched_at_their_context():
    """patch() without a longer context used to drop the window, changing the model within its own
    context; every name now keeps it, so the patched model is the checkpoint as it was trained."""
    for config in _windowed_configs():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).eval()
        sdpa = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
        sdpa.load_state_dict(model.state_dict())
        hf_dilated.patch(model, "dilated")
        assert model.config.sliding_window == 16
        ids = tokens(1, 30)  # longer than the window
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, sdpa(ids).logits, atol=1e-4, rtol=1e-4)


def test_mistral_and_qwen2_lose_their_sliding_window_when_their_context_is_extended():
    from hf_dilated.patches.context import ConversionWarning

    for config in _windowed_configs():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).eval()
        with pytest.warns(ConversionWarning, match="removed the checkpoint's 16-token sliding window"):
            hf_dilated.patch(model, "dilated", context_length=128, rope="none")
        assert model.config.sliding_window is None
        assert all(getattr(m, "sliding_window", None) is None for m in model.modules())
        ids = tokens(1, 30)
        sdpa = AutoModelForCausalLM.from_config(model.config, attn_implementation="sdpa").eval()
        sdpa.load_state_dict(model.state_dict())
        with torch.no_grad():  # within the first segment: exactly full causal attention
            torch.testing.assert_close(model(ids).logits, sdpa(ids).logits, atol=1e-4, rtol=1e-4)


# --- errors -----------------------------------------------------------------------------------


def test_unsupported_family_gets_a_clear_error():
    from transformers import GPT2Config

    model = AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(ValueError, match=r"does not support model_type 'gpt2'; supported: llama, mistral, qwen2, gpt_neox"):
        hf_dilated.patch(model)
    with pytest.raises(ValueError, match="supported: llama"):
        hf_dilated.patch_family("gpt2")
    with pytest.raises(ValueError, match="supported: llama"):
        hf_dilated.lora_config(model)


@pytest.mark.parametrize(
    "entry, match",
    [
        ({"segment_lengths": [32, 64], "dilation_rates": [1, 3]}, "3 does not divide 64"),
        ({"segment_lengths": [32, 48], "dilation_rates": [1, 2]}, "nested levels"),
        ({"segment_lengths": [32], "dilation_rates": [1, 2]}, "same length"),
        ({"segment_lengths": [32], "dilation_rates": [1], "mode": "sparse"}, "mode must be one of"),
        ({"segment_lengths": [32], "dilation_rates": [1], "colour": 1}, r"unknown field\(s\).*colour"),
        ({"segment_lengths": [32], "dilation_rates": [1], "pattern": {"type": "nope"}}, "unknown type 'nope'"),
        ({"segment_lengths": [32], "dilation_rates": [1], "ring_layout": "spiral"}, "ring_layout must be one of"),
    ],
)
def test_bad_config_entries_fail_clearly_at_the_first_forward(checkpoints, entry, match):
    model = load(checkpoints["tiny-llama"][1], "dilated")
    model.config.hf_dilated = entry
    with pytest.raises(ValueError, match=match):
        model(tokens(1, 8))


def test_bad_patch_arguments_fail_clearly(checkpoints):
    model = load(checkpoints["tiny-llama"][0], "sdpa")
    with pytest.raises(ValueError, match="attn_implementation must be one of"):
        hf_dilated.patch(model, "sdpa")
    with pytest.raises(ValueError, match="3 does not divide 64"):
        hf_dilated.patch(model, "dilated", segment_lengths=[32, 64], dilation_rates=[1, 3])
    with pytest.raises(ValueError, match="rope must be one of"):
        hf_dilated.patch(model, "dilated", context_length=128, rope="ntk")
    with pytest.raises(TypeError, match="unknown hf_dilated config field"):
        hf_dilated.patch(model, "dilated", segments=[32])


def test_dense_4d_masks_are_rejected(checkpoints):
    model = load(checkpoints["tiny-llama"][1], "dilated")
    with torch.no_grad():
        with pytest.raises(ValueError, match="2-D padding mask"):
            model(tokens(1, 8), attention_mask=torch.ones(1, 1, 8, 8, dtype=torch.bool))


def test_unsupported_attention_features_raise_instead_of_being_ignored():
    class Attn(torch.nn.Module):
        config = type("C", (), {"max_position_embeddings": 32})()
        is_causal = True

    q = k = v = torch.randn(1, 2, 4, 8)
    for name in NAMES:
        fn = glue.ATTENTION_FUNCTIONS[name]
        with pytest.raises(ValueError, match="sliding_window must be a positive int"):
            fn(Attn(), q, k, v, None, sliding_window=0)
        with pytest.raises(NotImplementedError, match="soft-capping"):
            fn(Attn(), q, k, v, None, softcap=30.0)
        with pytest.raises(ValueError, match="is_causal: .*causal attention only"):
            fn(Attn(), q, k, v, None, is_causal=False)


def _default_conversion_with_selection(checkpoints, preset, name):
    """The preset's base (original context 32) given the default conversion to 256 tokens, with 2
    far blocks a query (of 16 keys) so that the selection decides what a query reads past the
    band, and its query and key projections scaled up so that the blocks' bounds differ widely."""
    model = load(checkpoints[preset][0], "sdpa")
    hf_dilated.patch(model, name, context_length=256, far_top_k=2)
    with torch.no_grad():
        for layer in model.base_model.layers:
            attention = getattr(layer, "self_attn", None) or layer.attention
            for projection in ("q_proj", "k_proj", "query_key_value"):
                if hasattr(attention, projection):
                    getattr(attention, projection).weight.mul_(4)
    return model


@pytest.mark.parametrize("name", ("dilated", "dilated_ring"))
@pytest.mark.parametrize("preset", FAMILIES)
def test_selected_far_blocks_do_not_depend_on_padding_or_rope_positions(checkpoints, preset, name):
    """A left-padded row with transformers' default position_ids (its indices: RoPE rotated its
    tokens `pad` positions further than their mask ranks) equals the row alone, past the original
    context where far blocks are selected by their bounds (docs/contract.md 3, 4.1: far keys at the
    grouped positions of the kernels' positions). The scores are relative, the bounds are not: the
    blocks chosen followed the RoPE offset (0.05 off in logits), in a forward and in decode steps."""
    model = _default_conversion_with_selection(checkpoints, preset, name)
    n, pad, new = 150, 13, 4
    row = tokens(1, n + new, seed=40)
    longer = torch.cat([tokens(1, pad, seed=41), row], 1)  # a second row, unpadded, beside it
    ids = torch.cat([torch.cat([torch.zeros(1, pad, dtype=torch.long), row], 1), longer])
    mask = torch.ones_like(ids)
    mask[0, :pad] = 0
    with torch.no_grad():
        alone = [model(row).logits[0], model(longer).logits[0, pad:]]
        padded = model(ids, attention_mask=mask).logits[:, pad:]
        for i in range(2):
            torch.testing.assert_close(padded[i], alone[i], atol=1e-4, rtol=1e-4, msg=f"row {i}")
        # decode steps of the batch, default position_ids (the cache's indices), one token a step
        out = model(ids[:, :pad + n], attention_mask=mask[:, :pad + n], use_cache=True)
        cache = out.past_key_values
        for t in range(new):
            step = model(ids[:, pad + n + t:pad + n + t + 1], attention_mask=mask[:, :pad + n + t + 1],
                         past_key_values=cache)
            for i in range(2):
                torch.testing.assert_close(step.logits[i, -1], alone[i][n + t], atol=1e-4, rtol=1e-4,
                                           msg=f"row {i}, step {t}")
    # A hole of 7 in the row: its default position_ids jump there, its mask ranks do not, so the keys
    # before and after it were rotated at different offsets from their ranks; the cache's steps
    # equal one forward over the same inputs (they took the last query's offset for every key).
    hole = torch.cat([row[:, :60], torch.zeros(1, 7, dtype=torch.long), row[:, 60:]], 1)
    hole_mask = torch.ones_like(hole)
    hole_mask[:, 60:67] = 0
    with torch.no_grad():
        whole = model(hole, attention_mask=hole_mask).logits[0]
        prompt = hole.shape[1] - new
        cache = model(hole[:, :prompt], attention_mask=hole_mask[:, :prompt], use_cache=True).past_key_values
        for t in range(new):
            at = prompt + t
            step = model(hole[:, at:at + 1], attention_mask=hole_mask[:, :at + 1], past_key_values=cache)
            torch.testing.assert_close(step.logits[0, -1], whole[at], atol=1e-4, rtol=1e-4, msg=f"hole, step {t}")
