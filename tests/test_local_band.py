"""Union dilated attention with a local band (docs/contract.md 4.1) against the independent float64
reference (tests/reference.py: local_band_reference), in every layout the other patterns are
tested in: padding left/right/inside, packed documents, GQA, decode and chunked prefill, with and
without far projections, forward and gradients."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from hf_dilated.ops import dilated_attention
from reference import local_band_reference
from test_dilated import F32_TOL, LOW_TOL, Case, make_inputs

LAYOUTS = ("plain", "left", "right", "packed", "pad_packed", "holes", "holes_index", "offset")
BASE = Case(mode="union", segment_lengths=(8, 16, 32), dilation_rates=(1, 2, 4), batch=2, q_heads=4, kv_heads=2,
            kv_len=45, seed=5)
CASES = [replace(BASE, layout=layout, seed=5 + n) for n, layout in enumerate(LAYOUTS)]
WINDOWS = (3, 8, 12)


def far_projections(q, k, seed):
    g = torch.Generator().manual_seed(seed)
    q_far = torch.randn(q.shape, generator=g, dtype=torch.float64).to(q.dtype).requires_grad_()
    k_far = torch.randn(k.shape, generator=g, dtype=torch.float64).to(k.dtype).requires_grad_()
    return q_far, k_far


def run(case, q, k, v, mask, pos, window, far=None, **kw):
    q_far, k_far = far or (None, None)
    return dilated_attention(q, k, v, list(case.segment_lengths), list(case.dilation_rates), local_window=window,
                             q_far=q_far, k_far=k_far, attention_mask=mask, position_ids=pos, **kw)


def reference(case, q, k, v, mask, pos, window, far=None):
    q_far, k_far = far or (None, None)
    return local_band_reference(q, k, v, list(case.segment_lengths), list(case.dilation_rates), window,
                                q_far=q_far, k_far=k_far, attention_mask=mask, position_ids=pos)


@pytest.fixture(params=(512, 7), ids=("one_chunk", "chunks_of_7"))
def chunk(request, monkeypatch):
    """The kernel's query chunk: one chunk, or many (bands and far ranges that move per chunk)."""
    from hf_dilated.ops import local_band

    monkeypatch.setattr(local_band, "_CHUNK", request.param)
    return request.param


@pytest.mark.parametrize("with_far", (False, True), ids=("one_projection", "far_projections"))
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("case", CASES, ids=[c.layout for c in CASES])
def test_forward_and_gradients_match_reference(case, window, with_far, chunk):
    q, k, v, mask, pos, real_query = make_inputs(case, torch.float32)
    far = far_projections(q, k, case.seed) if with_far else None
    out = run(case, q, k, v, mask, pos, window, far)
    leaves = [q, k, v] + (list(far) if far else [])
    refs = [t.detach().double().requires_grad_() for t in leaves]
    ref = reference(case, *refs[:3], mask, pos, window, tuple(refs[3:]) if far else None)
    rows = real_query[:, None, :, None]
    assert torch.isfinite(out).all()
    assert ((out.double() - ref) * rows).abs().max().item() < F32_TOL
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * rows
    (out.double() * grad).sum().backward()
    (ref * grad).sum().backward()
    for mine, theirs in zip(leaves, refs):
        assert (mine.grad.double() - theirs.grad).abs().max().item() < F32_TOL


@pytest.mark.parametrize("with_far", (False, True), ids=("one_projection", "far_projections"))
@pytest.mark.parametrize("case", CASES, ids=[c.layout for c in CASES])
def test_decode_and_chunked_prefill_match_reference(case, with_far, chunk):
    q, k, v, mask, pos, real_query = make_inputs(case, torch.float32)
    q, k, v = q.detach(), k.detach(), v.detach()
    far = tuple(t.detach() for t in far_projections(q, k, case.seed)) if with_far else None
    window = 8
    ref = reference(case, q.double(), k.double(), v.double(), mask, pos, window,
                    tuple(t.double() for t in far) if far else None)
    for q_len in (1, 2, 5, 17, 30):
        qs = q[:, :, -q_len:]
        far_q = (far[0][:, :, -q_len:], far[1]) if far else None
        out = run(case, qs, k, v, mask, pos, window, far_q)
        rows = real_query[:, None, -q_len:, None]
        err = ((out.double() - ref[:, :, -q_len:]) * rows).abs().max().item()
        assert err < F32_TOL, f"q_len {q_len}: {err}"


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
def test_low_precision_forward(dtype):
    case = replace(BASE, layout="left")
    q, k, v, mask, pos, real_query = make_inputs(case, dtype)
    far = far_projections(q, k, 3)
    out = run(case, q, k, v, mask, pos, 8, far)
    assert out.dtype == dtype
    ref = reference(case, q.double(), k.double(), v.double(), mask, pos, 8, tuple(t.double() for t in far))
    assert ((out.double() - ref) * real_query[:, None, :, None]).abs().max().item() < LOW_TOL


def test_band_covering_every_document_is_dense_causal_attention():
    """A band at least as long as every document sees every earlier key: dense causal attention,
    whatever the levels (what keeps a converted model unchanged inside its original context)."""
    import torch.nn.functional as F

    case = replace(BASE, layout="plain", kv_len=40)
    q, k, v, _, _, _ = make_inputs(case, torch.float32)
    out = run(case, q, k, v, None, None, 40)
    dense = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
    torch.testing.assert_close(out, dense, atol=1e-5, rtol=1e-5)


def test_bad_input_is_an_error_naming_the_argument():
    case = BASE
    q, k, v, mask, pos, _ = make_inputs(case, torch.float32)
    q_far, k_far = far_projections(q, k, 0)
    with pytest.raises(ValueError, match="local_window"):
        run(case, q, k, v, mask, pos, 0)
    with pytest.raises(ValueError, match="local_window"):
        dilated_attention(q, k, v, [8, 16], [1, 2], mode="longnet", local_window=4)
    with pytest.raises(ValueError, match="q_far"):
        dilated_attention(q, k, v, [8, 16], [1, 2], q_far=q_far)
    with pytest.raises(ValueError, match="k_far"):
        dilated_attention(q, k, v, [8, 16], [1, 2], local_window=4, q_far=q_far)
    with pytest.raises(ValueError, match="q_far"):
        dilated_attention(q, k, v, [8, 16], [1, 2], local_window=4, q_far=q_far[..., :4], k_far=k_far)


# --- through transformers: far keys at Self-Extend's grouped positions -------------------------

def _tiny(family, tmp_path, entry, **fields):
    from transformers import AutoModelForCausalLM, GPTNeoXConfig, LlamaConfig

    common = {**dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
                     max_position_embeddings=16), **fields}
    if family == "llama":
        config = LlamaConfig(**{"num_key_value_heads": 2, **common})
    else:
        config = GPTNeoXConfig(rotary_pct=0.5, **common)  # partial rotary: half of each head rotates
    config.hf_dilated = entry
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path, safe_serialization=True)
    return tmp_path


def _reference_attention(entry, rotary=None):
    """A transformers attention function computing docs/contract.md 4.1 from the float64 reference,
    with the far projections made by transformers' own rotary class: q and k are rotated back from
    their positions and forward to the grouped ones (cos/sin of the family's RotaryEmbedding, or of
    the module `rotary()` returns: the one the model runs)."""
    import sys

    def rotate(x, cos, sin, sign):  # transformers' rotate-half formula, on the rotary dims only
        rot = cos.shape[-1]
        x_rot, x_pass = x[..., :rot], x[..., rot:]
        half = torch.cat([-x_rot[..., rot // 2:], x_rot[..., :rot // 2]], -1)
        return torch.cat([x_rot * cos + sign * half * sin, x_pass], -1)

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        modeling = sys.modules[type(module).__module__]
        rotary_cls = next(obj for name, obj in vars(modeling).items() if name.endswith("RotaryEmbedding"))
        turn = rotary_cls(config=module.config) if rotary is None else rotary()
        n = key.shape[2]
        pos = torch.arange(n)[None]
        w, g = entry["local_window"], entry["far_group"]
        f = entry.get("far_window") or w  # Self-Extend's neighbour window of the far positions
        cos, sin = (t[:, None].double() for t in turn(query, pos))
        cos_k, sin_k = (t[:, None].double() for t in turn(query, pos // g))
        cos_q, sin_q = (t[:, None].double() for t in turn(query, pos // g + f - f // g))
        q, k = query.double(), key.double()
        q_plain, k_plain = rotate(q, cos, sin, -1), rotate(k, cos, sin, -1)  # rotate back to position 0
        q_far, k_far = rotate(q_plain, cos_q, sin_q, 1), rotate(k_plain, cos_k, sin_k, 1)
        sparse = {name: entry[name] for name in ("far_band", "far_top_k", "far_block_size", "far_sinks")
                  if entry.get(name) is not None}  # docs/contract.md 4.2, where the entry asks for it
        out = local_band_reference(q, k, value.double(), entry["segment_lengths"], entry["dilation_rates"], w,
                                   q_far=q_far, k_far=k_far, scale=scaling, **sparse)
        return out.to(query.dtype).transpose(1, 2).contiguous(), None

    return attention


@pytest.mark.parametrize("family, far_window", (("llama", None), ("gpt_neox", None), ("llama", 2)))
def test_model_with_grouped_far_positions_matches_reference(family, far_window, tmp_path):
    """far_window 2: far keys as Self-Extend's beyond a neighbour window of 2, not the band's 6."""
    from transformers import AttentionInterface, AutoModelForCausalLM

    entry = {"segment_lengths": [8, 16, 32], "dilation_rates": [1, 2, 4], "local_window": 6, "far_group": 3,
             "original_length": 8, "target_length": 32, "far_window": far_window}
    path = _tiny(family, tmp_path, entry)
    AttentionInterface.register("test_band_reference", _reference_attention(entry))
    ids = torch.randint(3, 99, (2, 30), generator=torch.Generator().manual_seed(0))
    ours = AutoModelForCausalLM.from_pretrained(path, attn_implementation="dilated").eval()
    theirs = AutoModelForCausalLM.from_pretrained(path, attn_implementation="test_band_reference").eval()
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, theirs(ids).logits, atol=1e-4, rtol=1e-4)
        # and generation: a decode step reads the cache at the same grouped positions
        prompt = ids[:, :20]
        mine = ours.generate(prompt, max_new_tokens=8, do_sample=False)
        steps = [theirs(mine[:, :t]).logits[:, -1].argmax(-1) for t in range(20, 28)]
    assert torch.equal(mine[:, 20:], torch.stack(steps, 1))


@pytest.mark.parametrize("family", ("llama", "gpt_neox"))
def test_far_keys_turn_by_the_frequencies_a_cast_model_runs(family, tmp_path):
    """`model.to(torch.bfloat16)` rounds the rotary module's inv_freq buffer, and transformers turns q
    and k by the rounded frequencies; the far keys were moved on by frequencies made afresh from the
    config, so they sat at no grouped position. Here both models went to bfloat16 and back (the
    weights and the buffer rounded, the arithmetic float32): the logits were 0.74 (Llama) and 0.41
    (GPT-NeoX) off the reference."""
    import copy as copy_module
    import pickle

    from transformers import AttentionInterface, AutoModelForCausalLM

    entry = {"segment_lengths": [256], "dilation_rates": [1], "local_window": 16, "far_group": 8,
             "original_length": 16, "target_length": 256}
    # heads of 32 (16 frequencies, most of them rounded in bfloat16) and weights that make attention sharp
    path = _tiny(family, tmp_path, entry, hidden_size=64, num_attention_heads=2, initializer_range=0.3,
                 **({"head_dim": 32, "num_key_value_heads": 1} if family == "llama" else {}))
    held = {}
    AttentionInterface.register("test_band_reference_cast", _reference_attention(entry, lambda: held["rotary"]))
    ours = AutoModelForCausalLM.from_pretrained(path, attn_implementation="dilated").eval()
    theirs = AutoModelForCausalLM.from_pretrained(path, attn_implementation="test_band_reference_cast").eval()
    held["rotary"] = theirs.base_model.rotary_emb
    ids = torch.randint(3, 99, (1, 250), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = ours(ids).logits  # (the frequencies made for the float32 model are kept until the buffer changes)
        for model in (ours, theirs):
            model.to(torch.bfloat16).to(torch.float32)
        assert not torch.equal(ours.base_model.rotary_emb.inv_freq,
                               AutoModelForCausalLM.from_pretrained(path).base_model.rotary_emb.inv_freq)
        torch.testing.assert_close(ours(ids).logits, theirs(ids).logits, atol=1e-4, rtol=1e-4)
        # a copy, deep or pickled (trl's reference model is a deepcopy), runs its own rotary module too:
        # a first form found the rotary through a registry of the models built, which copies are not in
        for copy in (copy_module.deepcopy(ours), pickle.loads(pickle.dumps(ours))):
            torch.testing.assert_close(copy(ids).logits, theirs(ids).logits, atol=1e-4, rtol=1e-4)
        # a model built on the same config object, left in float32, keeps its own frequencies
        other = type(ours)(ours.config).eval()
        other.load_state_dict(ours.state_dict())
        other.base_model.rotary_emb.inv_freq.copy_(AutoModelForCausalLM.from_pretrained(path).base_model.rotary_emb.inv_freq)
        plain = AutoModelForCausalLM.from_pretrained(path, attn_implementation="dilated").eval()
        plain.load_state_dict(ours.state_dict())
        torch.testing.assert_close(other(ids).logits, plain(ids).logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ours(ids).logits, theirs(ids).logits, atol=1e-4, rtol=1e-4)
    assert before.shape == (1, 250, 99)


# --- plain layouts without autograd: structured calls, no masks ----------------------------------

PLAIN_LEVELS = [((8, 16, 32), (1, 2, 4)), ((16, 32), (1, 2)), ((8,), (1,)), ((4, 8, 16, 32), (1, 2, 4, 8)),
                ((8, 16), (2, 4))]


@pytest.mark.parametrize("levels", PLAIN_LEVELS, ids=lambda lv: "x".join(map(str, lv[0])))
@pytest.mark.parametrize("window", (1, 3, 8, 12, 40))
@pytest.mark.parametrize("heads", ((4, 2), (6, 3), (3, 1)), ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_plain_inference_path_matches_reference(levels, window, heads, monkeypatch):
    """Prefill of plain rows under no_grad (what evaluation and generate() run) takes the structured
    calls of local_band.plain_forward; they equal the float64 reference."""
    from hf_dilated.ops import local_band

    taken = []
    original = local_band.plain_forward
    monkeypatch.setattr(local_band, "plain_forward", lambda *a, **kw: taken.append(1) or original(*a, **kw))
    seg, dil = levels
    n = 2 * max(seg)
    g = torch.Generator().manual_seed(window)
    q, q_far = (torch.randn(2, heads[0], n, 8, generator=g, dtype=torch.float64) for _ in range(2))
    k, v, k_far = (torch.randn(2, heads[1], n, 8, generator=g, dtype=torch.float64) for _ in range(3))
    with torch.no_grad():
        out = dilated_attention(q.float(), k.float(), v.float(), list(seg), list(dil), local_window=window,
                                q_far=q_far.float(), k_far=k_far.float())
    assert taken
    ref = local_band_reference(q, k, v, list(seg), list(dil), window, q_far=q_far, k_far=k_far)
    assert (out.double() - ref).abs().max().item() < F32_TOL


@pytest.mark.parametrize("levels, n", [(((64,), (1,)), 40), (((8, 16, 32), (1, 2, 4)), 16),
                                       (((16, 32, 64), (1, 2, 4)), 32), (((8, 16), (2, 4)), 8)],
                         ids=("one_level_past_the_row", "last_level_past", "last_level_past_rate_4", "all_past"))
@pytest.mark.parametrize("window", (3, 12))
def test_plain_inference_path_takes_rows_shorter_than_a_segment(levels, n, window, monkeypatch):
    """Rows shorter than a level's segment (a segment that holds the whole row; its rate divides the
    row) take plain_forward too, and equal the float64 reference. The default conversion reading
    every far key has one level of dilation 1 covering its target: every prompt shorter than the
    target took the masked calls (on a GPU the memory-efficient kernel with an additive bias)."""
    _check_plain_path(levels, n, window, monkeypatch, plain=True)


@pytest.mark.parametrize("levels", [((64,), (1,)), ((8, 64), (1, 1)), ((16, 32), (1, 2))],
                         ids=("one_level", "two_levels_of_rate_1", "segments_tile_the_row"))
@pytest.mark.parametrize("window", (3, 12))
@pytest.mark.parametrize("dtype, batch", ((torch.float64, 1), (torch.bfloat16, 2)), ids=("float64", "bfloat16_batch_2"))
def test_every_far_key_on_flashs_band_writes_the_models_layout(levels, window, dtype, batch, flash_band):
    """A level of dilation 1 holding the whole row (the default conversion reading every far key), with
    the band from flash as on a GPU (the flash_band fixture: the CPU's band, in flash's layout and
    float32 lse): one more call for every far key, merged straight into q's dtype in transformers'
    layout (its transpose there copies nothing), equal to the float64 reference (bfloat16: within its
    rounding, as the accumulators' path). Levels without such a level keep the accumulators (the band
    is asked for in their near_plain)."""
    seg, dil = levels
    n = 32
    g = torch.Generator().manual_seed(window)
    q, q_far = (torch.randn(batch, n, 4, 8, generator=g, dtype=torch.float64).to(dtype).transpose(1, 2)
                for _ in range(2))
    k, v, k_far = (torch.randn(batch, n, 2, 8, generator=g, dtype=torch.float64).to(dtype).transpose(1, 2)
                   for _ in range(3))
    with torch.no_grad():
        out = dilated_attention(q, k, v, list(seg), list(dil), local_window=window, q_far=q_far, k_far=k_far)
    ref = local_band_reference(*(t.double() for t in (q, k, v)), list(seg), list(dil), window, q_far=q_far.double(),
                               k_far=k_far.double())
    assert out.dtype == dtype and (out.double() - ref).abs().max().item() < (1e-12 if dtype == torch.float64 else 2e-2)
    assert flash_band and out.transpose(1, 2).is_contiguous() == any(w >= n and r == 1 for w, r in zip(seg, dil))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
def test_cuda_every_far_key_on_flash_matches_reference(dtype):
    """On CUDA, reading every far key (one level of dilation 1 holding the row) in half precision takes
    flash's band and one far call merged into transformers' layout (local_band._every_far): 1,000
    tokens, band 256, grouped-query heads of 64, a batch of two, against the float64 reference on
    the same rounded inputs."""
    g = torch.Generator().manual_seed(8)
    q, q_far = (torch.randn(2, 1000, 8, 64, generator=g, dtype=torch.float64).to(dtype).transpose(1, 2)
                for _ in range(2))
    k, v, k_far = (torch.randn(2, 1000, 2, 64, generator=g, dtype=torch.float64).to(dtype).transpose(1, 2)
                   for _ in range(3))
    with torch.no_grad():
        out = dilated_attention(*(t.cuda() for t in (q, k, v)), [2048], [1], local_window=256, q_far=q_far.cuda(),
                                k_far=k_far.cuda())
    ref = local_band_reference(*(t.double() for t in (q, k, v)), [2048], [1], 256, q_far=q_far.double(),
                               k_far=k_far.double())
    assert out.transpose(1, 2).is_contiguous()  # (the path taken: the accumulators' output is not)
    assert (out.cpu().double() - ref).abs().max().item() / ref.abs().max().item() < 2e-2


@pytest.mark.parametrize("levels, n", [(((6, 24), (1, 4)), 24), (((6, 24), (1, 4)), 12), (((4, 16), (1, 8)), 16),
                                       (((4, 16), (1, 8)), 8), (((2, 6, 24), (1, 2, 4)), 24)],
                         ids=("6x24_rate_4", "6x24_rate_4_shorter_row", "4x16_rate_8", "4x16_rate_8_shorter_row",
                              "three_levels_2x6x24"))
@pytest.mark.parametrize("window", (1, 3, 5))
def test_levels_whose_rate_does_not_divide_the_segment_before_take_the_masked_calls(levels, n, window, monkeypatch):
    """Nested levels (each segment divides the next, each rate the next) whose rate does not divide
    the segment before it: plain_forward cuts a level into pieces of the segment before it in whole
    classes, so these read the wrong keys there (0.27-0.58 off the reference for [6, 24] x [1, 4] on 24
    tokens, a division by zero for [4, 16] x [1, 8] on 16; a review found them). They take the masked
    calls, exact."""
    _check_plain_path(levels, n, window, monkeypatch, plain=False)


def _check_plain_path(levels, n, window, monkeypatch, plain: bool):
    from hf_dilated.ops import local_band

    taken = []
    original = local_band.plain_forward
    monkeypatch.setattr(local_band, "plain_forward", lambda *a, **kw: taken.append(1) or original(*a, **kw))
    seg, dil = levels
    g = torch.Generator().manual_seed(n + window)
    q, q_far = (torch.randn(2, 4, n, 8, generator=g, dtype=torch.float64) for _ in range(2))
    k, v, k_far = (torch.randn(2, 2, n, 8, generator=g, dtype=torch.float64) for _ in range(3))
    with torch.no_grad():
        out = dilated_attention(q.float(), k.float(), v.float(), list(seg), list(dil), local_window=window,
                                q_far=q_far.float(), k_far=k_far.float())
    assert bool(taken) == plain
    ref = local_band_reference(q, k, v, list(seg), list(dil), window, q_far=q_far, k_far=k_far)
    assert (out.double() - ref).abs().max().item() < F32_TOL


# --- the rules docs/contract.md binds every extension to: windows, non-causal calls, gradcheck ----

@pytest.mark.parametrize("sliding_window", (4, 9, 30))
@pytest.mark.parametrize("layout", ("plain", "left", "holes"))
def test_sliding_window_on_top_of_the_band_matches_reference(layout, sliding_window, chunk):
    case = replace(BASE, layout=layout, seed=40)
    q, k, v, mask, pos, real_query = make_inputs(case, torch.float32)
    far = far_projections(q, k, 2)
    for q_len in (45, 6, 1):
        out = run(case, q[:, :, -q_len:], k, v, mask, pos, 8, (far[0][:, :, -q_len:], far[1]),
                  sliding_window=sliding_window)
        ref = local_band_reference(q.double()[:, :, -q_len:], k.double(), v.double(), list(case.segment_lengths),
                                   list(case.dilation_rates), 8, q_far=far[0].double()[:, :, -q_len:],
                                   k_far=far[1].double(), attention_mask=mask, position_ids=pos,
                                   sliding_window=sliding_window)
        rows = real_query[:, None, -q_len:, None]
        assert ((out.double() - ref) * rows).abs().max().item() < F32_TOL


@pytest.mark.parametrize("layout", ("plain", "packed", "holes"))
def test_non_causal_band_matches_reference(layout, chunk):
    case = replace(BASE, layout=layout, seed=41)
    q, k, v, mask, pos, real_query = make_inputs(case, torch.float32)
    far = far_projections(q, k, 4)
    out = run(case, q, k, v, mask, pos, 8, far, is_causal=False)
    ref = local_band_reference(q.double(), k.double(), v.double(), list(case.segment_lengths),
                               list(case.dilation_rates), 8, q_far=far[0].double(), k_far=far[1].double(),
                               attention_mask=mask, position_ids=pos, is_causal=False)
    assert ((out.double() - ref) * real_query[:, None, :, None]).abs().max().item() < F32_TOL


@pytest.mark.parametrize("with_far", (False, True), ids=("one_projection", "far_projections"))
def test_gradcheck_float64(with_far, chunk):
    case = replace(BASE, layout="left", kv_len=13, segment_lengths=(4, 8), dilation_rates=(1, 2), batch=1, seed=42)
    q, k, v, mask, pos, _ = make_inputs(case, torch.float64)
    leaves = (q, k, v) + (far_projections(q, k, 5) if with_far else ())

    def f(*t):
        return run(case, *t[:3], mask, pos, 3, t[3:] if with_far else None)

    assert torch.autograd.gradcheck(f, leaves, atol=1e-6)


@pytest.mark.parametrize("fields, message", (
    ({"far_window": 4}, "far_window: 4 places grouped far positions; it needs far_group > 1"),
    ({"far_window": 7, "far_group": 2}, "far_window: at most local_window (6)"),
    ({"far_window": 0, "far_group": 2}, "far_window"),
))
def test_far_window_is_checked(fields, message):
    from hf_dilated import DilatedConfig

    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        DilatedConfig(segment_lengths=[8], dilation_rates=[1], local_window=6, **fields)



def test_calls_of_different_head_counts_do_not_share_a_cached_plan():
    """Which far calls hold a visible pair depends on the head count (a level of dilation r reads
    class h mod r): a plan cached for one head must not serve four (review of issue 33: a call
    with 4 heads after one with 1 skipped the far keys of heads 1-3)."""
    from hf_dilated.ops.local_band import local_band_attention

    torch.manual_seed(0)
    for heads in (1, 4):
        # One query at position 63 (class 3 of dilation 4): head 0 reads no far key, head 3 does.
        # The band's own module, as dilated_attention sends one query to its decode path.
        q = torch.randn(1, heads, 1, 8, dtype=torch.float64)
        k, v = torch.randn(1, heads, 64, 8, dtype=torch.float64), torch.randn(1, heads, 64, 8, dtype=torch.float64)
        out = local_band_attention(q, k, v, [64], [4], local_window=8, scale=8 ** -0.5)
        ref = local_band_reference(q, k, v, [64], [4], 8)
        torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("whole_width", (False, True), ids=("half_rows", "whole_width"))
@pytest.mark.parametrize("shapes", (((2, 3, 5, 8), (1, 1, 5, 4)), ((2, 3, 5, 12), (1, 1, 5, 4)),
                                    ((3, 1, 8), (3, 7, 4)), ((4, 2, 6, 8), (6, 4))),
                         ids=("full_rotary", "partial_rotary", "broadcast_x", "per_offset_table"))
def test_rotate_with_turns_each_pair_by_its_angle(shapes, whole_width, monkeypatch):
    """ops/rope.rotate_with in both of its eager forms (the one for large tensors, the one for
    few elements) against each pair (t, t + rot / 2) turned as a complex number by its angle, float64;
    dims past the rotary ones unchanged, x broadcast against the angles."""
    from hf_dilated.ops import rope

    monkeypatch.setattr(rope, "_WHOLE_WIDTH_ELEMENTS", 0 if whole_width else 1 << 40)
    x_shape, angle_shape = shapes
    g = torch.Generator().manual_seed(3)
    x = torch.randn(x_shape, generator=g, dtype=torch.float64)
    angle = torch.randn(angle_shape, generator=g, dtype=torch.float64)
    half = angle.shape[-1]
    with torch.no_grad():
        out = rope.rotate_with(x, angle.cos(), angle.sin())
    turned = torch.complex(x[..., :half], x[..., half:2 * half]) * torch.polar(torch.ones_like(angle), angle)
    shape = torch.broadcast_shapes(x[..., :half].shape, angle.shape)[:-1]
    expected = torch.cat([turned.real, turned.imag, x[..., 2 * half:].expand(*shape, -1)], -1)
    assert out.shape == expected.shape
    assert (out - expected).abs().max().item() < 1e-12
