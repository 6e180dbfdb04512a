"""What a user meets through transformers' own entry points: mixed precision, save and reload,
config edits and validation, packed batches from DataCollatorWithFlattening, output_attentions,
unsupported families (issue 15). Real tiny models, saved and loaded as safetensors."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import (AutoModelForCausalLM, DataCollatorWithFlattening, GPT2Config, GPTNeoXConfig,
                          LlamaConfig)

import hf_dilated
from hf_dilated.integrations.transformers import NAMES


def _config(family, **extra):
    common = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
                  max_position_embeddings=64, pad_token_id=0, **extra)
    return LlamaConfig(num_key_value_heads=2, **common) if family == "llama" else GPTNeoXConfig(**common)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    dirs = {}
    for family in ("llama", "gpt_neox"):
        path = tmp_path_factory.mktemp(family)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(_config(family)).save_pretrained(path, safe_serialization=True)
        dirs[family] = path
    return dirs


def ids(batch, n, seed=0):
    return torch.randint(3, 99, (batch, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", ("llama", "gpt_neox"))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
def test_autocast_training_step_follows_sdpa(saved, family, dtype):
    x = ids(2, 40)
    results = {}
    for name in ("sdpa", *NAMES):
        model = AutoModelForCausalLM.from_pretrained(saved[family], attn_implementation=name, dtype=torch.float32)
        model.train()
        with torch.autocast("cpu", dtype=dtype):
            loss = model(x, labels=x, use_cache=False).loss
        loss.backward()
        grad = next(p for n, p in model.named_parameters() if "layers.0" in n and p.grad is not None).grad
        results[name] = (loss.detach().float(), grad.float())
    want_loss, want_grad = results["sdpa"]
    for name in NAMES:
        loss, grad = results[name]
        assert torch.isfinite(grad).all(), name
        torch.testing.assert_close(loss, want_loss, atol=2e-2, rtol=2e-2, msg=name)
        torch.testing.assert_close(grad, want_grad, atol=5e-2 * float(want_grad.abs().max()), rtol=0.1, msg=name)


@pytest.mark.parametrize("name", NAMES)
def test_a_checkpoint_configured_for_our_name_reloads_with_it(saved, tmp_path, name):
    model = hf_dilated.patch(AutoModelForCausalLM.from_pretrained(saved["llama"]), name, context_length=128)
    model.eval()
    x = ids(1, 100)
    with torch.no_grad():
        want = model(x).logits
    model.save_pretrained(tmp_path / "saved")
    shutil.copytree(tmp_path / "saved", tmp_path / "copied")  # what pushing and pulling a folder does
    for folder in ("saved", "copied"):
        again = AutoModelForCausalLM.from_pretrained(tmp_path / folder).eval()
        assert again.config._attn_implementation == name
        with torch.no_grad():
            torch.testing.assert_close(again(x).logits, want, atol=1e-5, rtol=1e-5)
    # An explicit choice still wins, and is what the next save records.
    dense = AutoModelForCausalLM.from_pretrained(tmp_path / "saved", attn_implementation="sdpa")
    assert dense.config._attn_implementation == "sdpa"
    dense.save_pretrained(tmp_path / "dense")
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "dense").config._attn_implementation == "sdpa"


def test_config_edits_after_the_first_forward_are_noticed(saved):
    model = hf_dilated.patch(AutoModelForCausalLM.from_pretrained(saved["llama"]), "dilated").eval()
    x = ids(1, 60)
    with torch.no_grad():
        dense = model(x).logits
        model.config.hf_dilated["segment_lengths"] = [16, 32, 64]
        model.config.hf_dilated["dilation_rates"] = [1, 2, 4]
        sparse = model(x).logits
        assert (sparse - dense).abs().max() > 1e-3  # the new segments took effect
        model.config.hf_dilated["dilation_rates"] = [1, 3, 4]  # 3 does not divide 32
        with pytest.raises(ValueError, match="dilation"):
            model(x)


def test_a_corrupt_entry_fails_at_load_not_at_the_first_forward(saved, tmp_path):
    hf_dilated.patch(AutoModelForCausalLM.from_pretrained(saved["llama"]), "dilated").save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["hf_dilated"]["segment_lengths"] = [64, 100]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="invalid 'hf_dilated' config entry"):
        AutoModelForCausalLM.from_pretrained(tmp_path)


def _flattened_and_alone(model, lengths):
    """(packed, alone) logits per document of `lengths` tokens: a DataCollatorWithFlattening batch
    without position_ids (cu_seq_lens only), and each document on its own."""
    docs = [ids(1, n, seed=n)[0].tolist() for n in lengths]
    collate = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_position_ids=False)
    batch = collate([{"input_ids": d} for d in docs])
    assert "position_ids" not in batch and "cu_seq_lens_q" in batch
    pairs, start = [], 0
    with torch.no_grad():
        packed = model(input_ids=batch["input_ids"], cu_seq_lens_q=batch["cu_seq_lens_q"],
                       cu_seq_lens_k=batch["cu_seq_lens_k"], max_length_q=batch["max_length_q"],
                       max_length_k=batch["max_length_k"], use_cache=False).logits[0]
        for d in docs:
            pairs.append((packed[start:start + len(d)], model(torch.tensor([d])).logits[0]))
            start += len(d)
    return pairs


@pytest.mark.parametrize("name", NAMES)
def test_flattened_batches_without_position_ids_keep_documents_apart(saved, name):
    model = AutoModelForCausalLM.from_pretrained(saved["llama"], attn_implementation=name).eval()
    for packed, alone in _flattened_and_alone(model, (12, 20, 9)):
        torch.testing.assert_close(packed, alone, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("use_cache", (False, True))
def test_boundaries_that_are_not_one_packed_row_are_refused(saved, use_cache):
    """cu_seq_lens beside position_ids that restart (packing transformers detected, use_cache=False)
    were not read at all: boundaries past the row, or of other documents than the position_ids'
    (which then decide, so the documents changed with use_cache: 0.49 apart), passed in silence, as
    cu_seq_lens_k without cu_seq_lens_q did. Each now raises, naming them."""
    model = AutoModelForCausalLM.from_pretrained(saved["llama"], attn_implementation="dilated").eval()
    x = ids(1, 30, seed=3)
    positions = torch.cat([torch.arange(10), torch.arange(20)])[None]
    cases = [(dict(position_ids=positions, cu_seq_lens_q=torch.tensor([0, 10, 25]), cu_seq_lens_k=torch.tensor([0, 10, 25])),
              "cu_seq_lens_q must be the cumulative lengths"),
             (dict(position_ids=positions, cu_seq_lens_q=torch.tensor([0, 12, 30]), cu_seq_lens_k=torch.tensor([0, 12, 30])),
              "cu_seq_lens_q and position_ids describe different documents"),
             (dict(cu_seq_lens_k=torch.tensor([0, 10, 30])), "cu_seq_lens_k without cu_seq_lens_q")]
    for kwargs, message in cases:
        with torch.no_grad(), pytest.raises(ValueError, match=message):
            model(x, use_cache=use_cache, **kwargs)
    cu = torch.tensor([0, 10, 30])  # the same documents as the position_ids: taken
    with torch.no_grad():
        both = model(x, position_ids=positions, cu_seq_lens_q=cu, cu_seq_lens_k=cu, use_cache=False).logits
        torch.testing.assert_close(both, model(x, position_ids=positions, use_cache=False).logits)


@pytest.mark.parametrize("name", ("dilated", "dilated_ring"))
def test_flattened_batches_keep_documents_apart_with_sparse_far_keys(saved, name, tmp_path):
    """The default conversion (far keys at grouped positions, far_top_k) on a flattened batch without
    position_ids: the model rotated every token at its index, the documents restart at cu_seq_lens,
    and far keys move from where the model rotated them (docs/contract.md 4.1): each document gets
    its logits alone (2.4e-2 apart before, the blocks' bounds taken at the wrong positions)."""
    model = hf_dilated.patch(AutoModelForCausalLM.from_pretrained(saved["llama"], dtype=torch.float64), name,
                             context_length=256, local_window=16, far_group=4, far_band=8, far_block_size=4, far_top_k=1)
    model.save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64).eval()
    assert model.config.hf_dilated["far_group"] > 1
    for packed, alone in _flattened_and_alone(model, (40, 70, 50)):
        # (transformers' RoPE angles are float32: a rotation back and on rounds at 1e-8)
        torch.testing.assert_close(packed, alone, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_a_model_that_generated_can_be_pickled_and_copied(saved, name, tmp_path):
    """torch.save(model) / pickle after generate(): the kernels' per-layer state (block summaries
    kept between decode steps, with weak references) used to make pickle raise "cannot pickle
    'weakref.ReferenceType' object". It travels empty; the copy computes what the model computes."""
    import copy
    import io

    model = hf_dilated.patch(AutoModelForCausalLM.from_pretrained(saved["llama"]), name, context_length=256)
    model.eval()
    x = ids(1, 80)
    with torch.no_grad():
        model.generate(x[:, :70], max_new_tokens=4, do_sample=False)
        want = model(x).logits
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    for other in (torch.load(buffer, weights_only=False), copy.deepcopy(model)):
        with torch.no_grad():
            torch.testing.assert_close(other(x).logits, want, atol=0, rtol=0)


def test_new_document_boundaries_with_the_same_position_ids_are_read(saved):
    """The inputs derived from one call are reused by tensor identity: a later call passing the same
    position_ids tensor with other cu_seq_lens used to get the first call's documents."""
    model = AutoModelForCausalLM.from_pretrained(saved["llama"], attn_implementation="ring").eval()
    x, position_ids = ids(1, 40), torch.arange(40)[None]

    def boundaries(*cut):
        cu = torch.tensor(cut, dtype=torch.int32)
        return dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=40, max_length_k=40)

    with torch.no_grad():
        first = model(x, position_ids=position_ids, use_cache=False, **boundaries(0, 10, 40)).logits
        again = model(x, position_ids=position_ids, use_cache=False, **boundaries(0, 25, 40)).logits
        fresh = model(x, position_ids=position_ids.clone(), use_cache=False, **boundaries(0, 25, 40)).logits
    assert (again - first).abs().max() > 1e-3
    torch.testing.assert_close(again, fresh, atol=0, rtol=0)


def test_far_keys_move_from_where_the_model_rotated_them_without_a_mask():
    """kernel_inputs' RoPE offsets where no mask is given: position_ids that are not consecutive (a
    packed row with a cache, which transformers keeps one document at its indices, as sdpa) and
    cu_seq_lens' documents (the model rotated at its indices) are offsets from the kernels'
    positions; consecutive ids are none (nothing to move, and nothing read back). They used to be
    taken as none in every case without a mask: far keys then sat at grouped positions of the
    wrong positions (a review measured 0.05 in the logits and 0.7 relative in the gradients)."""
    from hf_dilated.integrations.model_inputs import kernel_inputs

    q = k = v = torch.zeros(1, 2, 10, 4)
    packed = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2]])
    *_, offset = kernel_inputs(q, k, v, None, packed, rope=True)
    assert torch.equal(offset.per_key, packed - torch.arange(10)) and offset.per_row == [-7]
    cu = torch.tensor([0, 4, 7, 10], dtype=torch.int32)
    *_, offset = kernel_inputs(q, k, v, None, None, cu_seq_lens=cu, rope=True)
    assert torch.equal(offset.per_key, torch.arange(10)[None] - packed)
    assert kernel_inputs(q, k, v, None, packed.clone(), cu_seq_lens=cu, rope=True)[-1] is None  # rotated there
    for consecutive in (torch.arange(10)[None], torch.arange(5, 15)[None], None):
        assert kernel_inputs(q, k, v, None, consecutive, rope=True)[-1] is None


@pytest.mark.parametrize("family", ("llama", "gpt_neox"))
@pytest.mark.parametrize("name", NAMES)
def test_output_attentions_does_what_sdpa_does(saved, family, name):
    """transformers' convention (sdpa_attention.py): a warning naming the attention and `eager`,
    no weights (the same empty tuple sdpa gives), outputs unchanged. Tools pass the flag generically."""
    import logging

    from transformers.utils.logging import get_logger

    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    root = get_logger("transformers")
    root.addHandler(handler)
    get_logger("transformers.hf_dilated").warning_once.cache_clear()  # once per process: reset it
    model = AutoModelForCausalLM.from_pretrained(saved[family], attn_implementation=name)
    sdpa = AutoModelForCausalLM.from_pretrained(saved[family], attn_implementation="sdpa")
    x = ids(2, 12)
    plain = model(x).logits
    out = model(x, output_attentions=True)
    expected = sdpa(x, output_attentions=True)
    assert out.attentions == expected.attentions == ()
    torch.testing.assert_close(out.logits, plain, atol=0, rtol=0)
    torch.testing.assert_close(out.logits, expected.logits, atol=1e-5, rtol=1e-5)
    root.removeHandler(handler)
    assert any(f"`{name}` attention does not support `output_attentions=True`" in line and "`eager`" in line
               for line in lines), lines


def test_unsupported_families_and_objects_are_refused_with_the_supported_list():
    def gpt2():
        return GPT2Config(vocab_size=99, n_embd=32, n_layer=1, n_head=4, n_positions=64, bos_token_id=1,
                          eos_token_id=2)

    for name in NAMES:
        with pytest.raises(ValueError, match="supported: llama"):
            AutoModelForCausalLM.from_config(gpt2(), attn_implementation=name)
    model = AutoModelForCausalLM.from_config(gpt2())
    with pytest.raises(ValueError, match="supported: llama"):
        model.set_attn_implementation("dilated")
    with pytest.raises(TypeError, match="transformers model"):
        hf_dilated.patch(torch.nn.Linear(4, 4))


@pytest.mark.parametrize("name", ("dilated", "block_sparse"))
def test_patch_names_a_bad_rope_or_context_length_and_changes_nothing(saved, name):
    """A RoPE scaling without a context was ignored (even an unknown one), and a context of the wrong
    type raised an error that named neither context_length nor the call (a comparison of str and int)."""
    model = AutoModelForCausalLM.from_pretrained(saved["llama"])
    before = model.config.to_dict()
    for kwargs, error, match in ((dict(rope="yarn"), ValueError, "rope='yarn' .* pass context_length"),
                                 (dict(rope="bogus"), ValueError, "rope must be one of"),
                                 (dict(context_length=128, rope="bogus"), ValueError, "rope must be one of"),
                                 (dict(context_length="128"), TypeError, r"context_length \(--context\) must be"),
                                 (dict(context_length=128.0), TypeError, r"context_length \(--context\) must be")):
        with pytest.raises(error, match=match):
            hf_dilated.patch(model, name, **kwargs)
        assert model.config.to_dict() == before, kwargs


def test_patch_that_transformers_cannot_build_the_rotary_for_changes_nothing():
    """GPT-NeoX rotating 5 dimensions of 20 (rotary_pct 0.25): transformers' YaRN initialisation
    raises on the odd dimension. patch had written the converted RoPE scaling and its hf_dilated
    entry into the config by then, and left the model's rotary and attention as they were (a
    config that save_pretrained would write); now nothing changes and the error names rope."""
    from hf_dilated.config import CONFIG_KEY

    config = GPTNeoXConfig(vocab_size=99, hidden_size=80, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=64, max_position_embeddings=128)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    before, rotary = model.config.to_dict(), model.gpt_neox.rotary_emb
    with pytest.raises(ValueError, match="rope: transformers could not build .* the model is unchanged"):
        hf_dilated.patch(model, "ring", context_length=512)
    assert model.config.to_dict() == before and not hasattr(model.config, CONFIG_KEY)
    assert model.gpt_neox.rotary_emb is rotary and model.config._attn_implementation == "sdpa"


def test_attention_dropout_under_a_local_band_is_refused_naming_the_setting():
    """The default conversion's band has no attention dropout: refused at a training forward, naming
    the name and transformers' attention_dropout (the kernel's own message named neither)."""
    from conftest import tiny_default_llama

    model, _, ids = tiny_default_llama(300, 128)
    for module in model.modules():
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = 0.5
    with pytest.raises(ValueError, match="attn_implementation='dilated' with a local band .* set attention_dropout=0"):
        model.train()(ids)


def test_dynamic_rope_under_far_keys_at_grouped_positions_is_refused_before_any_forward(saved, tmp_path):
    """Far keys at grouped positions (far_group > 1, the default conversion's) need fixed rotary
    frequencies. Re-converting with rope='dynamic' used to keep the earlier band, write the
    checkpoint, and fail at every forward; now the conversion is refused naming rope, and such an
    entry is refused when the model loads (docs/contract.md 9)."""
    model = hf_dilated.patch(AutoModelForCausalLM.from_pretrained(saved["llama"]), "dilated", context_length=256)
    assert model.config.hf_dilated["far_group"] > 1
    before = model.config.to_dict()
    with pytest.raises(ValueError, match="rope='dynamic': far_group=.*fixed rotary frequencies"):
        hf_dilated.patch(model, context_length=512, rope="dynamic")
    assert model.config.to_dict() == before
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["rope_parameters"] = {**config["rope_parameters"], "rope_type": "dynamic", "factor": 4.0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="invalid 'hf_dilated' config entry: far_group=.*fixed rotary frequencies"):
        AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="dilated")
    # A RoPE made dynamic after loading fails at the first call, naming the entry's far_group (it said 2)
    model.config.rope_parameters = {**model.config.rope_parameters, "rope_type": "dynamic", "factor": 4.0}
    with pytest.raises(ValueError, match=f"far_group={model.config.hf_dilated['far_group']}: grouped far"):
        model(ids(1, 20))


def test_longrope_under_far_keys_at_grouped_positions_is_refused(tmp_path):
    """LongRoPE switches the rotary module to its long factors once a call's positions pass its
    original context, while the far keys were moved by the short ones (a fresh rotary class): 8.9
    off the reference at 60 tokens. Like dynamic NTK, its frequencies change with the length, so
    patch and load refuse it with far_group > 1 (docs/contract.md 4.1)."""
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0, 1.0, 1.0, 1.0],
            "long_factor": [1.0, 2.0, 4.0, 8.0], "original_max_position_embeddings": 16, "factor": 4.0}
    config = LlamaConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=37, max_position_embeddings=16, rope_parameters=rope)
    model = AutoModelForCausalLM.from_config(config)
    before = model.config.to_dict()
    with pytest.raises(ValueError, match="far_group=4: .*LongRoPE RoPE \\(rope_type 'longrope'\\)"):
        hf_dilated.patch(model, "dilated", context_length=64, local_window=8, far_group=4, far_window=4)
    assert model.config.to_dict() == before
    config.hf_dilated = {"segment_lengths": [64], "dilation_rates": [1], "local_window": 8, "far_group": 4,
                         "original_length": 16, "target_length": 64}
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="invalid 'hf_dilated' config entry: far_group=4: .*LongRoPE"):
        AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="dilated")
    # far_group 1 reads far keys where the model turned them: LongRoPE is fine there
    AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="dilated", hf_dilated={**config.hf_dilated,
                                                                                              "far_group": 1})


def test_patch_family_refuses_fields_it_cannot_take_at_once(saved):
    """A misspelt or invalid field was stored, and every later load of the family failed on it,
    naming not the call that set it."""
    with pytest.raises(TypeError, match="segment_lenghts"):
        hf_dilated.patch_family("llama", "dilated", segment_lenghts=[32])
    with pytest.raises(ValueError, match="mode must be one of"):
        hf_dilated.patch_family("llama", "dilated", mode="bogus")
    model = AutoModelForCausalLM.from_pretrained(saved["llama"])  # the family is not patched
    assert model.config._attn_implementation == "sdpa"
    # A field of the band, valid over an entry that has one (a converted checkpoint's), is taken.
    hf_dilated.patch(model, "dilated", context_length=256)
    model.save_pretrained(saved["llama"].parent / "converted")
    hf_dilated.patch_family("llama", "dilated", far_top_k=4)
    try:
        reloaded = AutoModelForCausalLM.from_pretrained(saved["llama"].parent / "converted")
        assert reloaded.config.hf_dilated["far_top_k"] == 4
    finally:
        hf_dilated.unpatch_family("llama")


def test_a_hand_written_entry_without_pattern_gets_the_documented_default():
    """One default per field: the block-sparse window of an entry that names no pattern is the one
    DilatedConfig.default gives (dense within the first segment), not a 1-block window."""
    from hf_dilated.config import DilatedConfig

    written = DilatedConfig.from_dict({"segment_lengths": [512, 1024], "dilation_rates": [1, 2]})
    assert written.pattern == DilatedConfig.default(512, 1024).pattern == {"type": "local", "window": 8}


def test_a_checkpoint_with_scaled_rope_is_unchanged_on_every_input_it_supports(tmp_path):
    """Llama-3.1 style RoPE (rope_type "llama3": pre-scaling length 32, configured for 256): the
    default first segment is the configured 256 tokens, so our names equal sdpa up to 256 tokens
    (the first segment used to be the pre-scaling 32)."""
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=37, max_position_embeddings=256,
                         rope_parameters=rope)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    x = ids(1, 200)
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa").eval()(x).logits
        for name in ("dilated", "block_sparse"):
            model = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=name).eval()
            torch.testing.assert_close(model(x).logits, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ("block_sparse", "block_sparse_ring"))
def test_adaptive_block_sparse_says_that_generation_pools_fewer_queries(saved, name):
    """`adaptive` pools each query block's queries, later ones included (SPEC): a decode step has its
    own query alone and chose other blocks than the whole sequence's forward (0.2 off in logits),
    without a word."""
    import warnings

    model = AutoModelForCausalLM.from_pretrained(saved["llama"])
    hf_dilated.patch(model, name, pattern={"type": "adaptive", "top_k": 1, "window": 1}, block_size=8)
    prompt = ids(1, 40)
    with torch.no_grad():
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a forward over the whole sequence pools every query: no warning
            model(prompt, use_cache=False)
        with pytest.warns(UserWarning, match="'adaptive' pools every query of a query block"):
            model.generate(prompt, max_new_tokens=2, do_sample=False, pad_token_id=0)
