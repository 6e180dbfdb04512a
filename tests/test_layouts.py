"""Every registered name sees exactly the keys sdpa sees (docs/contract.md 3.2):
a differential test against sdpa on real tiny Llama and GPT-NeoX models (saved and loaded as
safetensors) over a grid of layouts, with inputs shorter than the first segment so that every
pattern is dense; and the same layouts beyond the first segment against the float64 reference."""
from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface, AutoModelForCausalLM, GPTNeoXConfig, LlamaConfig

import hf_dilated  # noqa: F401  (registers the names)
from hf_dilated.integrations import transformers as glue
from reference import block_sparse_reference, dense_causal_reference, dilated_reference

NAMES = ("dilated", "dilated_ring", "ring", "block_sparse", "block_sparse_ring")
FAMILIES = ("llama", "gpt_neox")
ATOL = 1e-4


def _config(family, **extra):
    common = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
                  max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2, **extra)
    if family == "llama":
        return LlamaConfig(num_key_value_heads=2, **common)
    return GPTNeoXConfig(**common)


@pytest.fixture(scope="module")
def checkpoint_dirs(tmp_path_factory):
    dirs = {}
    for family in FAMILIES:
        path = tmp_path_factory.mktemp(family)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(_config(family)).save_pretrained(path, safe_serialization=True)
        dirs[family] = path
    return dirs


_MODELS = {}


def model(dirs, family, name):
    if (family, name) not in _MODELS:
        m = AutoModelForCausalLM.from_pretrained(dirs[family], attn_implementation=name, dtype=torch.float32)
        _MODELS[family, name] = m.eval()
    return _MODELS[family, name]


def ids(batch, n, seed=0):
    return torch.randint(3, 99, (batch, n), generator=torch.Generator().manual_seed(seed))


def holes_mask(batch, n, seed=1):
    """Random padding anywhere (left, right, in the middle), at least 4 real tokens per row."""
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(batch, n, generator=g) > 0.3).long()
    mask[:, -4:] = 1
    mask[0, :3] = 0  # a left-padded row with holes
    return mask


def packed_positions(lengths):
    return torch.cat([torch.arange(n) for n in lengths])[None]


def right_padded(batch, n, pad):
    mask = torch.ones(batch, n, dtype=torch.long)
    mask[1, n - pad:] = 0
    return mask


def left_padded(batch, n, pad):
    mask = torch.ones(batch, n, dtype=torch.long)
    mask[1, :pad] = 0
    return mask


# name -> (model call kwargs, which query positions to compare)
FORWARD_LAYOUTS = {
    "no_padding": lambda: (dict(input_ids=ids(3, 24)), None),
    "left_padding": lambda: (dict(input_ids=ids(3, 24), attention_mask=left_padded(3, 24, 7)), "mask"),
    "right_padding": lambda: (dict(input_ids=ids(3, 24), attention_mask=right_padded(3, 24, 9)), "mask"),
    "holes": lambda: (dict(input_ids=ids(3, 30), attention_mask=holes_mask(3, 30)), "mask"),
    "holes_generate_positions": lambda: (  # what generate() passes: cumsum(mask) - 1, 1 at the holes
        dict(input_ids=ids(3, 30), attention_mask=holes_mask(3, 30),
             position_ids=(holes_mask(3, 30).cumsum(-1) - 1).masked_fill(holes_mask(3, 30) == 0, 1)), "mask"),
    "packed_no_mask": lambda: (dict(input_ids=ids(1, 36), position_ids=packed_positions([10, 16, 10]),
                                    use_cache=False), None),
    # With a KV cache transformers does not look for packed sequences: sdpa lets them see each other.
    "packed_no_mask_with_cache": lambda: (dict(input_ids=ids(1, 36), position_ids=packed_positions([10, 16, 10]),
                                               use_cache=True), None),
    "packed_with_all_ones_mask": lambda: (dict(input_ids=ids(1, 36), position_ids=packed_positions([10, 16, 10]),
                                               attention_mask=torch.ones(1, 36, dtype=torch.long)), None),
    "offset_positions": lambda: (dict(input_ids=ids(2, 40), position_ids=torch.arange(100, 140)[None],
                                      use_cache=False), None),
}


def _compare(got, want, mask):
    if mask is not None:
        real = mask.bool()
        got, want = got[real], want[real]
    torch.testing.assert_close(got, want, atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("layout", FORWARD_LAYOUTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_forward_logits_match_sdpa(checkpoint_dirs, family, layout):
    kwargs, compare = FORWARD_LAYOUTS[layout]()
    with torch.no_grad():
        want = model(checkpoint_dirs, family, "sdpa")(**kwargs).logits
        for name in NAMES:
            got = model(checkpoint_dirs, family, name)(**kwargs).logits
            _compare(got, want, kwargs["attention_mask"] if compare == "mask" else None)


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_from_a_cache_matches_sdpa(checkpoint_dirs, family):
    x, mask = ids(3, 32, seed=3), holes_mask(3, 32, seed=4)
    with torch.no_grad():
        results = {}
        for name in ("sdpa", *NAMES):
            m = model(checkpoint_dirs, family, name)
            first = m(x[:, :20], attention_mask=mask[:, :20], use_cache=True)
            second = m(x[:, 20:], attention_mask=mask, past_key_values=first.past_key_values, use_cache=True)
            results[name] = torch.cat([first.logits, second.logits], dim=1)
        for name in NAMES:
            _compare(results[name], results["sdpa"], mask)


def _generate(m, x, mask, **kwargs):
    kwargs = {"max_new_tokens": 5, "min_new_tokens": 5, "do_sample": False, "pad_token_id": 0, **kwargs}
    return m.generate(x, attention_mask=mask, **kwargs)


GENERATE_CASES = {
    "greedy_holes": lambda: (ids(3, 12, seed=5), holes_mask(3, 12, seed=6), {}),
    "greedy_left_padding": lambda: (ids(2, 12, seed=7), left_padded(2, 12, 5), {}),
    "greedy_right_padding": lambda: (ids(2, 12, seed=8), right_padded(2, 12, 2), {}),
    "beam_search_holes": lambda: (ids(2, 12, seed=9), holes_mask(2, 12, seed=10), {"num_beams": 3}),
    "static_cache_holes": lambda: (ids(2, 12, seed=11), holes_mask(2, 12, seed=12),
                                   {"cache_implementation": "static"}),
    "assisted_prompt_lookup": lambda: (ids(1, 14, seed=13).repeat(1, 2), None, {"prompt_lookup_num_tokens": 3}),
}


@pytest.mark.parametrize("case", GENERATE_CASES)
@pytest.mark.parametrize("family", FAMILIES)
def test_generate_matches_sdpa(checkpoint_dirs, family, case):
    x, mask, kwargs = GENERATE_CASES[case]()
    with torch.no_grad():
        want = _generate(model(checkpoint_dirs, family, "sdpa"), x, mask, **kwargs)
        for name in NAMES:
            got = _generate(model(checkpoint_dirs, family, name), x, mask, **kwargs)
            assert torch.equal(got, want), (name, got[:, x.shape[1]:].tolist(), want[:, x.shape[1]:].tolist())


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_continues_from_past_key_values_with_a_new_prompt_chunk(checkpoint_dirs, family):
    x, more = ids(1, 10, seed=14), ids(1, 6, seed=15)
    outs = {}
    with torch.no_grad():
        for name in ("sdpa", *NAMES):
            m = model(checkpoint_dirs, family, name)
            first = m.generate(x, max_new_tokens=4, do_sample=False, pad_token_id=0, return_dict_in_generate=True)
            follow = torch.cat([first.sequences, more], dim=1)
            outs[name] = m.generate(follow, past_key_values=first.past_key_values, max_new_tokens=4,
                                    do_sample=False, pad_token_id=0)
    for name in NAMES:
        assert torch.equal(outs[name], outs["sdpa"]), name


def test_the_three_reported_defects(checkpoint_dirs):
    """The issue's reproductions: a hole in the mask, right-padded generate(), packed positions
    with a mask."""
    m_sdpa = model(checkpoint_dirs, "llama", "sdpa")
    x, mask = ids(1, 7, seed=16), torch.tensor([[1, 1, 0, 1, 1, 1, 1]])
    with torch.no_grad():
        want = _generate(m_sdpa, x, mask, max_new_tokens=4, min_new_tokens=4)
        right = _generate(m_sdpa, ids(2, 7, seed=17), right_padded(2, 7, 2), max_new_tokens=3, min_new_tokens=3)
        for name in NAMES:
            m = model(checkpoint_dirs, "llama", name)
            assert torch.equal(_generate(m, x, mask, max_new_tokens=4, min_new_tokens=4), want), name
            got = _generate(m, ids(2, 7, seed=17), right_padded(2, 7, 2), max_new_tokens=3, min_new_tokens=3)
            assert torch.equal(got, right), name


# --- beyond the first segment: the float64 reference of docs/contract.md --------------------

SEGMENTS, RATES, BLOCK, WINDOW = [16, 32, 64], [1, 2, 4], 8, 2
LONG_ENTRY = {"segment_lengths": SEGMENTS, "dilation_rates": RATES, "mode": "union", "block_size": BLOCK,
              "pattern": {"type": "local", "window": WINDOW}}


def _local_layout(n):
    blocks = -(-n // BLOCK)
    bq, bk = torch.arange(blocks)[:, None], torch.arange(blocks)[None, :]
    return ((bq - bk >= 0) & (bq - bk < WINDOW))[None, None]


def _reference(name, q, k, v, scale, attention_mask, position_ids):
    q, k, v = (t.double() for t in (q, k, v))
    kw = dict(scale=scale, attention_mask=attention_mask, position_ids=position_ids)
    if name == "ring":
        return dense_causal_reference(q, k, v, **kw)
    if name.startswith("block_sparse"):
        return block_sparse_reference(q, k, v, _local_layout(k.shape[2]), BLOCK, **kw)
    return dilated_reference(q, k, v, SEGMENTS, RATES, "union", **kw)


LONG_LAYOUTS = {  # model kwargs, and the kernel inputs transformers' rule gives: (mask, positions)
    "holes": lambda: (dict(input_ids=ids(2, 70, seed=18), attention_mask=holes_mask(2, 70, seed=19)), "mask"),
    "right_padding": lambda: (dict(input_ids=ids(2, 70, seed=20), attention_mask=right_padded(2, 70, 20)), "mask"),
    "packed_no_mask": lambda: (dict(input_ids=ids(1, 72, seed=21), position_ids=packed_positions([40, 20, 12]),
                                    use_cache=False), "positions"),
}


@pytest.mark.parametrize("layout", LONG_LAYOUTS)
@pytest.mark.parametrize("name", NAMES)
def test_beyond_the_first_segment_matches_the_reference(checkpoint_dirs, name, layout):
    kwargs, rule = LONG_LAYOUTS[layout]()
    m = AutoModelForCausalLM.from_pretrained(checkpoint_dirs["llama"], attn_implementation=name,
                                             dtype=torch.float32).eval()
    m.config.hf_dilated = dict(LONG_ENTRY)
    calls, original = [], glue.ATTENTION_FUNCTIONS[name]

    def spy(module, query, key, value, attention_mask, scaling=None, **kw):
        out = original(module, query, key, value, attention_mask, scaling=scaling, **kw)
        calls.append((query, key, value, scaling, out[0]))
        return out

    AttentionInterface.register(name, spy)
    try:
        with torch.no_grad():
            m(**kwargs)
    finally:
        AttentionInterface.register(name, original)
    mask = kwargs.get("attention_mask") if rule == "mask" else None
    positions = kwargs.get("position_ids") if rule == "positions" else None
    for query, key, value, scaling, out in calls:
        want = _reference(name, query, key, value, scaling, mask, positions).transpose(1, 2)
        _compare(out.double(), want, mask)


@pytest.mark.parametrize("name", ("dilated", "ring"))
@pytest.mark.parametrize("layout", ("packed_no_mask", "holes", "no_padding"))
def test_every_layer_after_the_first_reuses_the_plan(checkpoint_dirs, monkeypatch, name, layout):
    """The kernel's plan cache is keyed by the identity of the mask and position tensors; the glue
    hands every layer the same derived tensors (it used to expand position_ids anew per layer, so
    packed inputs rebuilt the plan in every layer)."""
    import hf_dilated.ops.dilated as dilated_module

    builds, plan = [], dilated_module.plan_levels

    def counting(*args, **kwargs):
        builds.append(1)
        return plan(*args, **kwargs)

    monkeypatch.setattr(dilated_module, "plan_levels", counting)
    kwargs, _ = FORWARD_LAYOUTS[layout]()
    m = model(checkpoint_dirs, "llama", name)
    with torch.no_grad():
        m(**kwargs)
    layers = m.config.num_hidden_layers
    assert layers > 1 and len(builds) <= 1


@pytest.mark.parametrize("name", ("block_sparse", "block_sparse_ring"))
def test_the_block_pattern_is_built_once_per_configuration(checkpoint_dirs, monkeypatch, name):
    """The glue builds the block pattern of the model's entry once, with the parsed config (it
    used to build it in every layer call); an edited entry gets its pattern built anew."""
    import hf_dilated.ops.block_patterns as patterns

    builds, make = [], patterns.make_pattern

    def counting(spec):
        builds.append(spec)
        return make(spec)

    m = AutoModelForCausalLM.from_pretrained(checkpoint_dirs["llama"], attn_implementation=name,
                                             dtype=torch.float32).eval()
    monkeypatch.setattr(patterns, "make_pattern", counting)  # checking a config builds it too
    kwargs, _ = FORWARD_LAYOUTS["no_padding"]()
    with torch.no_grad():
        m(**kwargs)
        first = len(builds)
        m(**kwargs)
    assert m.config.num_hidden_layers > 1 and 1 <= first <= 2 and len(builds) == first  # parse + settings
    entry = hf_dilated.DilatedConfig.from_model_config(m.config).to_dict()
    m.config.hf_dilated = {**entry, "pattern": {"type": "local", "window": 1}}
    with torch.no_grad():
        m(**kwargs)
    assert len(builds) > first and builds[-1] == {"type": "local", "window": 1}


# --- sliding windows longer than the sequence (shorter ones: tests/test_sliding_window.py) --------

def _windowed(family, window):
    from transformers import MistralConfig, Qwen2Config

    common = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=37, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if family == "mistral":
        return MistralConfig(sliding_window=window, **common)
    return Qwen2Config(use_sliding_window=True, sliding_window=window, max_window_layers=1, **common)


@pytest.mark.parametrize("family", ("mistral", "qwen2"))
def test_a_sliding_window_longer_than_the_sequence_runs_like_sdpa(tmp_path, family):
    """Mistral's default config has sliding_window=4096: it used to refuse every forward. A window
    that covers the whole sequence hides nothing, so every name equals sdpa there; past it, the
    window hides keys, as in sdpa."""
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(_windowed(family, 48)).save_pretrained(tmp_path)
    x, mask = ids(2, 30, seed=40), left_padded(2, 30, 6)
    with torch.no_grad():
        sdpa = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa").eval()
        want_logits = sdpa(x, attention_mask=mask).logits
        want_tokens = _generate(sdpa, x, mask)  # 35 tokens in all: still within the window
        want_long = sdpa(ids(1, 60)).logits  # it refused this (60 keys, a 48-token window)
        for name in NAMES:
            m = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=name).eval()
            _compare(m(x, attention_mask=mask).logits, want_logits, mask)
            assert torch.equal(_generate(m, x, mask), want_tokens), name
            _compare(m(ids(1, 60)).logits, want_long, None)


def test_ops_know_none_of_transformers_conventions():
    """transformers' rule (docs/contract.md 3.2) lives in hf_dilated/integrations/, next to the mask
    function; no module of hf_dilated/ops/ imports transformers or the glue."""
    import ast
    from pathlib import Path

    ops = Path(hf_dilated.__file__).parent / "ops"
    for path in sorted(ops.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = ["." * node.level + (node.module or "") + "." + alias.name for alias in node.names]
            else:
                continue
            for name in names:
                assert not name.lstrip(".").startswith("transformers") and "integrations" not in name, (path.name, name)
