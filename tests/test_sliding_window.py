"""Sliding windows (docs/contract.md 3.3): every kernel keeps the window of a Mistral or Qwen2
model, by key index as transformers' `sliding_window_overlay` does.

- Kernels (dilated in every mode, block-sparse, dense) against the float64 reference extended
  with the window, at lengths beyond the first segment, forward and gradients, with padding,
  packing, chunked prefill and decode; the window bounds the work (no call reads keys far
  outside it).
- Tiny Mistral and Qwen2 models saved as safetensors, every name against sdpa: forward logits
  with left padding, generation past the window with DynamicCache and StaticCache (whose sliding
  layers keep only the last keys), beam search, and a training step's gradients.
"""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, MistralConfig, Qwen2Config

import hf_dilated  # noqa: F401  (registers the names)
from hf_dilated import create_attention
from hf_dilated.ops import dilated_attention
from hf_dilated.ops.block_sparse import block_sparse_attention
from hf_dilated.ops.dense import dense_attention
from reference import block_sparse_reference, dense_causal_reference, dilated_reference

TOL = 1e-4  # docs/contract.md 8: float32 against the float64 reference
NAMES = ("dilated", "dilated_ring", "ring", "block_sparse", "block_sparse_ring")
SEGMENTS, RATES = [16, 32, 64], [1, 2, 4]


def _inputs(case, n=150, q_len=None, seed=0):
    """(q, k, v, attention_mask, position_ids) for a layout; 2 rows, 4 query heads over 2 kv heads."""
    g = torch.Generator().manual_seed(seed)
    q_len = n if q_len is None else q_len
    q = torch.randn(2, 4, q_len, 8, generator=g)
    k, v = torch.randn(2, 2, n, 8, generator=g), torch.randn(2, 2, n, 8, generator=g)
    mask = pos = None
    if case == "left_padding":
        mask = torch.ones(2, n, dtype=torch.long)
        mask[1, :23] = 0
    elif case == "holes":
        mask = (torch.rand(2, n, generator=g) > 0.25).long()
        mask[:, -1] = 1
    elif case == "packed":
        pos = torch.cat([torch.arange(61), torch.arange(n - 61)])[None]
    return q, k, v, mask, pos


LAYOUTS = {  # name -> (layout, q_len)
    "plain": ("plain", None), "left_padding": ("left_padding", None), "holes": ("holes", None),
    "packed": ("packed", None), "chunked_prefill": ("holes", 40), "decode": ("left_padding", 1),
}


def _check(run, reference, case, window, seed=0):
    layout, q_len = LAYOUTS[case]
    q, k, v, mask, pos = _inputs(layout, q_len=q_len, seed=seed)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = run(*leaves, mask, pos, window)
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref = reference(*ref_leaves, mask, pos, window)
    # Outputs at padded query slots are unspecified (docs/contract.md 3.1): left out of the loss and
    # the check.
    real = torch.ones(2, k.shape[2]) if mask is None else mask.float()
    weight = real[:, None, k.shape[2] - q.shape[2]:, None]
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1)) * weight
    (out * dout).sum().backward()
    (ref * dout.double()).sum().backward()
    assert ((out.double() - ref) * weight).abs().max() < TOL
    for name, a, b in zip("qkv", leaves, ref_leaves):
        err = (a.grad.double() - b.grad).abs().max()
        assert err < TOL, f"d{name} differs from the reference by {err}"


WINDOWS = (1, 7, 20, 70)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("case", LAYOUTS)
@pytest.mark.parametrize("mode", ("union", "longnet", "head_groups"))
def test_dilated_with_a_window_matches_the_reference(mode, case, window):
    _check(lambda q, k, v, m, p, w: dilated_attention(q, k, v, SEGMENTS, RATES, mode=mode, attention_mask=m,
                                                      position_ids=p, sliding_window=w),
           lambda q, k, v, m, p, w: dilated_reference(q, k, v, SEGMENTS, RATES, mode, attention_mask=m,
                                                      position_ids=p, sliding_window=w),
           case, window)


PATTERNS = {
    "local": {"type": "local", "window": 3},
    "dilated": {"type": "dilated", "window": 1, "stride": 3},
    "global_local": {"type": "global_local", "global_blocks": 1, "window": 2},
    "adaptive": {"type": "adaptive", "top_k": 2, "window": 1},
}


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("case", LAYOUTS)
@pytest.mark.parametrize("pattern", PATTERNS)
def test_block_sparse_with_a_window_matches_the_reference(pattern, case, window):
    used = {}

    def run(q, k, v, m, p, w):
        out, used["layout"] = block_sparse_attention(q, k, v, PATTERNS[pattern], block_size=8, attention_mask=m,
                                                     position_ids=p, sliding_window=w, return_layout=True)
        return out

    _check(run, lambda q, k, v, m, p, w: block_sparse_reference(q, k, v, used["layout"], 8, attention_mask=m,
                                                                position_ids=p, sliding_window=w),
           case, window)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("case", LAYOUTS)
def test_dense_and_create_attention_with_a_window_match_the_reference(case, window):
    reference = (lambda q, k, v, m, p, w: dense_causal_reference(q, k, v, attention_mask=m, position_ids=p,
                                                                 sliding_window=w))
    _check(lambda q, k, v, m, p, w: dense_attention(q, k, v, attention_mask=m, position_ids=p, sliding_window=w),
           reference, case, window)
    ring = create_attention("ring")  # no process group: dense attention on one process
    _check(lambda q, k, v, m, p, w: ring(q, k, v, attention_mask=m, position_ids=p, sliding_window=w),
           reference, case, window, seed=3)


def test_a_window_covering_the_sequence_changes_nothing():
    q, k, v, mask, _ = _inputs("holes")
    for w in (150, 151, 10 ** 6):
        torch.testing.assert_close(dilated_attention(q, k, v, SEGMENTS, RATES, attention_mask=mask, sliding_window=w),
                                   dilated_attention(q, k, v, SEGMENTS, RATES, attention_mask=mask), rtol=0, atol=0)


@pytest.mark.parametrize("bad, exc", ((0, ValueError), (-3, ValueError), (2.5, TypeError), (True, TypeError),
                                      ("16", TypeError)))
def test_a_bad_window_is_an_error_naming_it(bad, exc):
    q, k, v, _, _ = _inputs("plain", n=8)
    for call in (lambda: dilated_attention(q, k, v, [8], [1], sliding_window=bad),
                 lambda: block_sparse_attention(q, k, v, PATTERNS["local"], block_size=4, sliding_window=bad),
                 lambda: dense_attention(q, k, v, sliding_window=bad)):
        with pytest.raises(exc, match="sliding_window must be a positive int"):
            call()


def test_the_window_bounds_the_work():
    """A query never reads keys far outside its window: the (query x key) slots of every call of
    the dilated plan, and the key blocks of every block-sparse call, grow with N x W, not N^2."""
    from hf_dilated.ops import block_sparse as bs_mod
    from hf_dilated.ops.dilated import plan_levels
    from hf_dilated.ops.token_layout import token_layout

    n, window = 2048, 64
    levels = plan_levels(token_layout(1, n, "cpu"), n, 4, 4, [n], [1], "union", True, window)
    pairs = sum((c.q_slots.stop - c.q_slots.start) * (c.k_slots.stop - c.k_slots.start)
                for level in levels for c in level.calls)
    assert pairs <= n * 3 * window, pairs  # the dense causal square would be n^2 / 2 = 32 x this bound
    for c in levels[0].calls:  # every key slot a call reads is within its window (+ the chunk)
        assert c.k_slots.start >= c.q_slots.start - window + 1 and c.k_slots.stop <= c.q_slots.stop

    q = torch.randn(1, 4, n, 8)
    st = bs_mod._structure(1, n, n, 16, q.device, None, None)
    _, rows = bs_mod._layout(bs_mod.make_pattern({"type": "global_local", "global_blocks": 1, "window": 200}),
                             q, q, st, whole=False)
    plan = bs_mod._plan(st, rows, True, 4, 4, 8, window)
    blocks = sum(c.blocks.numel() for c in plan.calls)
    assert blocks <= (n // 16) * (window // 16 + 2), blocks  # a global block outside the window is never read


# --- models: tiny Mistral and Qwen2 against sdpa -------------------------------------------------

WINDOW = 12


def _config(family, window=WINDOW, **extra):
    common = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=37, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                  **extra)
    if family == "mistral":
        return MistralConfig(sliding_window=window, **common)
    if family == "qwen2":  # layer 0 full attention, layer 1 sliding
        return Qwen2Config(use_sliding_window=True, sliding_window=window, max_window_layers=1, **common)
    return Qwen2Config(use_sliding_window=False, sliding_window=window, **common)  # "qwen2_no_window"


FAMILIES = ("mistral", "qwen2", "qwen2_no_window")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    dirs = {}
    for family in FAMILIES:
        path = tmp_path_factory.mktemp(family)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(_config(family)).save_pretrained(path, safe_serialization=True)
        assert (path / "model.safetensors").is_file()
        dirs[family] = path
    return dirs


def _load(dirs, family, name):
    return AutoModelForCausalLM.from_pretrained(dirs[family], attn_implementation=name, dtype=torch.float32).eval()


def _ids(batch, n, seed):
    return torch.randint(3, 99, (batch, n), generator=torch.Generator().manual_seed(seed))


def _left_padded(batch, n, pad):
    mask = torch.ones(batch, n, dtype=torch.long)
    mask[1, :pad] = 0
    return mask


@pytest.mark.parametrize("family", FAMILIES)
def test_forward_with_left_padding_matches_sdpa(checkpoints, family):
    x, mask = _ids(2, 40, seed=1), _left_padded(2, 40, 9)  # 40 tokens, a 12-token window
    with torch.no_grad():
        want = _load(checkpoints, family, "sdpa")(x, attention_mask=mask).logits
        for name in NAMES:
            got = _load(checkpoints, family, name)(x, attention_mask=mask).logits
            real = mask.bool()
            torch.testing.assert_close(got[real], want[real], atol=TOL, rtol=TOL, msg=name)


GENERATE = {
    "dynamic_cache": {},
    "static_cache": {"cache_implementation": "static"},
    "beam_search": {"num_beams": 3},
}


@pytest.mark.parametrize("case", GENERATE)
@pytest.mark.parametrize("family", ("mistral", "qwen2"))
def test_generation_past_the_window_matches_sdpa(checkpoints, family, case):
    """A 20-token prompt and 16 new tokens under a 12-token window: the caches' sliding layers keep
    only the last keys, so the attention sees keys from an offset (kv_offset > 0)."""
    x, mask = _ids(2, 20, seed=2), _left_padded(2, 20, 5)
    kwargs = dict(max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=0,
                  return_dict_in_generate=True, **GENERATE[case])
    with torch.no_grad():
        want = _load(checkpoints, family, "sdpa").generate(x, attention_mask=mask, **kwargs)
        sliding = [type(layer).__name__ for layer in want.past_key_values.layers]
        assert any("Sliding" in kind for kind in sliding), sliding  # the offset path is exercised
        for name in NAMES:
            got = _load(checkpoints, family, name).generate(x, attention_mask=mask, **kwargs)
            assert torch.equal(got.sequences, want.sequences), (name, got.sequences[:, 20:].tolist(),
                                                                want.sequences[:, 20:].tolist())


@pytest.mark.parametrize("family", ("mistral", "qwen2"))
def test_a_training_step_has_the_gradients_of_sdpa(checkpoints, family):
    x, mask = _ids(2, 36, seed=3), _left_padded(2, 36, 7)
    labels = x.masked_fill(mask == 0, -100)

    def grads(name):
        model = _load(checkpoints, family, name).train()
        model.config.use_cache = False
        loss = model(x, attention_mask=mask, labels=labels).loss
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters()}

    want_loss, want = grads("sdpa")
    for name in NAMES:
        loss, got = grads(name)
        torch.testing.assert_close(loss, want_loss, atol=TOL, rtol=TOL, msg=name)
        for param, g in want.items():
            torch.testing.assert_close(got[param], g, atol=TOL, rtol=1e-3, msg=f"{name}: {param}")
