"""Sparse far keys (docs/contract.md 4.2: far_band, far_top_k, far_block_size, far_sinks) against
the independent float64 reference (tests/reference.py: local_band_reference, whose selection is
written loop by loop from the contract), in every layout: padding, packing, holes, GQA, decode and
chunked prefill, gradients, the plain inference path, and through a transformers model saved and
loaded as safetensors. Inputs are float64 where the selection is compared, so that the kernel's
bounds and the reference's rank the blocks alike (a float32 bound may order a near tie otherwise)."""
from __future__ import annotations

import warnings
from dataclasses import replace

import pytest
import torch

from hf_dilated import DilatedConfig
from hf_dilated.ops import dilated_attention, pair_count
from hf_dilated.ops.far_selection import FarSelection
from reference import local_band_key_sets, local_band_reference
from test_dilated import Case, make_inputs
from test_local_band import _reference_attention, _tiny

LAYOUTS = ("plain", "left", "right", "packed", "pad_packed", "holes", "holes_index", "offset")
BASE = Case(mode="union", segment_lengths=(64,), dilation_rates=(1,), batch=2, q_heads=4, kv_heads=2,
            kv_len=60, seed=11)
CASES = [replace(BASE, layout=layout, seed=11 + n) for n, layout in enumerate(LAYOUTS)]
# (far_band, far_top_k, far_block_size, far_sinks) with a local_window of 16
SETTINGS = [(None, 2, 4, 1), (8, 2, 4, 1), (8, 0, 4, 2), (12, 3, 8, 0), (16, 1, 2, 1), (6, 50, 4, 1), (8, None, 4, 1),
            (8, 0, 4, 0)]
WINDOW = 16
TOL = 1e-10


def far_inputs(q, k, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(q.shape, generator=g, dtype=torch.float64).requires_grad_(),
            torch.randn(k.shape, generator=g, dtype=torch.float64).requires_grad_())


def sparse(setting):
    band, top_k, size, sinks = setting
    kernel = dict(far_band=band, far_selection=None if top_k is None else FarSelection(top_k, size, sinks))
    ref = dict(far_band=band, far_top_k=top_k, far_block_size=size, far_sinks=sinks)
    return kernel, ref


def run(case, q, k, v, mask, pos, far, kernel, levels=None):
    seg, dil = levels or (list(case.segment_lengths), list(case.dilation_rates))
    return dilated_attention(q, k, v, seg, dil, local_window=WINDOW, q_far=far[0], k_far=far[1],
                             attention_mask=mask, position_ids=pos, **kernel)


@pytest.fixture(params=(128, 7), ids=("one_chunk", "chunks_of_7"))
def chunk(request, monkeypatch):
    from hf_dilated.ops import local_band

    monkeypatch.setattr(local_band, "_SELECT_CHUNK", request.param)
    monkeypatch.setattr(local_band, "_CHUNK", request.param)
    return request.param


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: "band{}_k{}_B{}_s{}".format(*s))
@pytest.mark.parametrize("case", CASES, ids=[c.layout for c in CASES])
def test_forward_and_gradients_match_reference(case, setting, chunk):
    q, k, v, mask, pos, real_query = make_inputs(case, torch.float64)
    far = far_inputs(q, k, case.seed)
    kernel, ref_kw = sparse(setting)
    out = run(case, q, k, v, mask, pos, far, kernel)
    leaves = [q, k, v, *far]
    refs = [t.detach().clone().requires_grad_() for t in leaves]
    ref = local_band_reference(*refs[:3], list(case.segment_lengths), list(case.dilation_rates), WINDOW,
                               q_far=refs[3], k_far=refs[4], attention_mask=mask, position_ids=pos, **ref_kw)
    rows = real_query[:, None, :, None]
    assert ((out - ref) * rows).abs().max().item() < TOL
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * rows
    (out * grad).sum().backward()
    (ref * grad).sum().backward()
    for mine, theirs in zip(leaves, refs):
        assert (mine.grad - theirs.grad).abs().max().item() < TOL


@pytest.mark.parametrize("setting", SETTINGS[:4], ids=lambda s: "band{}_k{}_B{}_s{}".format(*s))
@pytest.mark.parametrize("case", CASES, ids=[c.layout for c in CASES])
def test_decode_and_chunked_prefill_match_reference(case, setting, chosen_by_kv_head):
    """A decode step or a chunk computes the set the prefill computes for its queries."""
    q, k, v, mask, pos, real_query = make_inputs(case, torch.float64)
    q, k, v = q.detach(), k.detach(), v.detach()
    far = tuple(t.detach() for t in far_inputs(q, k, case.seed))
    kernel, ref_kw = sparse(setting)
    ref = local_band_reference(q, k, v, list(case.segment_lengths), list(case.dilation_rates), WINDOW,
                               q_far=far[0], k_far=far[1], attention_mask=mask, position_ids=pos, **ref_kw)
    for q_len in (1, 2, 5, 17):
        out = run(case, q[:, :, -q_len:], k, v, mask, pos, (far[0][:, :, -q_len:], far[1]), kernel)
        err = ((out - ref[:, :, -q_len:]) * real_query[:, None, -q_len:, None]).abs().max().item()
        assert err < TOL, f"q_len {q_len}: {err}"


# one_level covers the 70 tokens (the plain path, sparse_far_plain); the dilated levels do not (masked calls)
@pytest.mark.parametrize("levels", (((128,), (1,)), ((8, 16, 64), (1, 2, 4))), ids=("one_level", "dilated_levels"))
@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: "band{}_k{}_B{}_s{}".format(*s))
@pytest.mark.parametrize("heads", ((4, 2), (3, 1)), ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("plain_chunk", (None, 5), ids=("one_chunk", "chunks_of_5"))
def test_inference_matches_reference_and_counts_its_pairs(levels, setting, heads, plain_chunk, monkeypatch):
    """Prefill under no_grad (the plain path where a level holds every earlier key, the masked
    calls otherwise) equals the reference, and `pair_count` counts exactly the reference's pairs;
    the plain path selects its queries at once or in chunks of 5."""
    if plain_chunk:
        from hf_dilated.ops import sparse_far_plain

        monkeypatch.setattr(sparse_far_plain, "_MIN_CHUNK", plain_chunk)
        monkeypatch.setattr(sparse_far_plain, "_BOUND_ELEMENTS", 1)  # selections of 5 queries
        monkeypatch.setattr(sparse_far_plain, "_PAIR_ELEMENTS", 1)  # and products of 5
    case = replace(BASE, layout="plain", kv_len=70, q_heads=heads[0], kv_heads=heads[1])
    q, k, v, _, _, _ = make_inputs(case, torch.float64)
    far = far_inputs(q, k, 3)
    kernel, ref_kw = sparse(setting)
    with torch.no_grad(), pair_count.counting() as tally:
        out = run(case, q, k, v, None, None, far, kernel, levels=[list(x) for x in levels])
    near, far_read = local_band_key_sets(q, k, list(levels[0]), list(levels[1]), WINDOW, q_far=far[0], k_far=far[1],
                                         **ref_kw)
    ref = local_band_reference(q, k, v, list(levels[0]), list(levels[1]), WINDOW, q_far=far[0], k_far=far[1],
                               **ref_kw)
    assert (out - ref).abs().max().item() < TOL
    assert tally.pairs == int((near | far_read).sum())


def test_selection_reads_fewer_keys_and_changes_the_result():
    """The selection is not a no-op: far_top_k=1 reads fewer pairs than every far key, and the
    outputs of queries with more than one candidate block differ."""
    case = replace(BASE, layout="plain", kv_len=60)
    q, k, v, _, _, _ = make_inputs(case, torch.float64)
    far = far_inputs(q, k, 4)
    every, ref_every = sparse((None, None, 4, 1))
    one, ref_one = sparse((None, 1, 4, 1))
    with torch.no_grad():
        a, b = run(case, q, k, v, None, None, far, every), run(case, q, k, v, None, None, far, one)
    n_every = sum(int(m.sum()) for m in local_band_key_sets(q, k, [64], [1], WINDOW, **ref_every))
    n_one = sum(int(m.sum()) for m in local_band_key_sets(q, k, [64], [1], WINDOW, q_far=far[0], k_far=far[1],
                                                         **ref_one))
    assert n_one < n_every
    assert (a[:, :, 30:] - b[:, :, 30:]).abs().max().item() > 1e-3


def test_selection_is_causal():
    """A query's selection reads blocks before its band only: changing later tokens leaves it as it was."""
    case = replace(BASE, layout="plain", kv_len=60)
    q, k, v, _, _, _ = make_inputs(case, torch.float64)
    q, k, v = q.detach(), k.detach(), v.detach()
    far = tuple(t.detach() for t in far_inputs(q, k, 5))
    kernel, _ = sparse((8, 2, 4, 1))
    before = run(case, q, k, v, None, None, far, kernel)
    k2, v2, kf2 = k.clone(), v.clone(), far[1].clone()
    for t in (k2, v2, kf2):
        t[:, :, 40:] = torch.randn(t[:, :, 40:].shape, dtype=torch.float64)
    after = run(case, q, k2, v2, None, None, (far[0], kf2), kernel)
    # Not bitwise: the inference path multiplies each block by the rows that chose it, and later
    # queries change those products' shapes (float64 rounding, ~1e-16); a changed selection moves
    # the output by far more.
    assert (before[:, :, :40] - after[:, :, :40]).abs().max().item() < 1e-12


def test_float32_forward_matches_reference():
    case = replace(BASE, layout="left")
    q, k, v, mask, pos, real_query = make_inputs(case, torch.float32)
    far = tuple(t.detach().float() for t in far_inputs(q, k, 6))
    kernel, ref_kw = sparse((8, 2, 4, 1))
    out = run(case, q, k, v, mask, pos, far, kernel)
    ref = local_band_reference(q.double(), k.double(), v.double(), [64], [1], WINDOW, q_far=far[0].double(),
                               k_far=far[1].double(), attention_mask=mask, position_ids=pos, **ref_kw)
    assert ((out.double() - ref) * real_query[:, None, :, None]).abs().max().item() < 1e-5


@pytest.mark.parametrize("fields, error, message", [
    (dict(far_band=20), ValueError, "far_band: at most local_window"),
    (dict(far_band=0), ValueError, "far_band"),
    (dict(far_top_k=2, far_band=8, far_block_size=16), ValueError, "far_block_size: at most the band"),
    (dict(far_top_k=-1), ValueError, "far_top_k"),
    (dict(far_top_k=1.5), TypeError, "far_top_k"),
    (dict(far_sinks=-1), ValueError, "far_sinks"),
    (dict(far_block_size=0), ValueError, "far_block_size"),
])
def test_config_fields_are_checked(fields, error, message):
    with pytest.raises(error, match=message):
        DilatedConfig(segment_lengths=[32], dilation_rates=[1], local_window=16, **fields)


def test_sparse_far_keys_need_a_band():
    for name in ("far_band", "far_top_k"):
        with pytest.raises(ValueError, match=f"{name}: .*needs a local_window"):
            DilatedConfig(segment_lengths=[32], dilation_rates=[1], **{name: 4})
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(ValueError, match="far_selection: needs a local_window"):
        dilated_attention(q, q, q, [8], [1], far_selection=FarSelection(1, 2, 1))
    with pytest.raises(ValueError, match="causal"):
        dilated_attention(q, q, q, [8], [1], local_window=4, far_selection=FarSelection(1, 2, 1), is_causal=False)


ENTRY = {"segment_lengths": [32], "dilation_rates": [1], "local_window": 8, "far_group": 2, "far_window": 4,
         "original_length": 8, "target_length": 32, "far_band": 6, "far_top_k": 2, "far_block_size": 3,
         "far_sinks": 1}


@pytest.mark.parametrize("family", ("llama", "gpt_neox"))
def test_model_matches_reference_in_prefill_and_generation(family, tmp_path):
    """A converted model's entry with sparse far keys, saved and loaded as safetensors: its logits are
    the reference's, and generate() (decode steps against the cache) picks the tokens the reference
    picks on the whole sequence, so prefill and decode compute one set."""
    from transformers import AttentionInterface, AutoModelForCausalLM

    path = _tiny(family, tmp_path, dict(ENTRY))
    AttentionInterface.register("test_sparse_far_reference", _reference_attention(ENTRY))
    ids = torch.randint(3, 99, (2, 30), generator=torch.Generator().manual_seed(0))
    ours = AutoModelForCausalLM.from_pretrained(path, attn_implementation="dilated", dtype=torch.float64).eval()
    theirs = AutoModelForCausalLM.from_pretrained(path, attn_implementation="test_sparse_far_reference",
                                                  dtype=torch.float64).eval()
    assert ours.config.hf_dilated["far_top_k"] == 2
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, theirs(ids).logits, atol=1e-8, rtol=1e-8)
        prompt = ids[:, :20]
        mine = ours.generate(prompt, max_new_tokens=8, do_sample=False)
        steps = [theirs(mine[:, :t]).logits[:, -1].argmax(-1) for t in range(20, 28)]
    assert torch.equal(mine[:, 20:], torch.stack(steps, 1))


@pytest.mark.parametrize("over", ({}, {"far_top_k": None}, {"far_sinks": 0, "far_group": 1, "far_window": None}),
                         ids=("grouped", "band_only", "own_positions"))
def test_static_cache_step_matches_reference(over):
    """A compiled step's kernel (a static cache: slots past `seen` unwritten, positions the mask ranks)
    computes the reference's set: the same as a prefill of the written tokens."""
    from hf_dilated.kinds import KINDS

    s = _decode_settings(**over)
    g = torch.Generator().manual_seed(8)
    batch, heads, kv_heads, slots, dim = 2, 4, 2, 80, 8
    k, v = (torch.randn(batch, kv_heads, slots, dim, generator=g, dtype=torch.float64) for _ in range(2))
    inv_freq = 1.0 / (100.0 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    real = torch.ones(batch, slots, dtype=torch.bool)
    real[1, :7] = False  # a left-padded row
    for seen in (30, 61):
        q = torch.randn(batch, heads, 2, dim, generator=g, dtype=torch.float64)
        out = KINDS["dilated"].static_decode(q, k, v, s, real=real, seen=torch.tensor(seen), scale=None,
                                             rope_frequencies=inv_freq)
        q_all = torch.cat([torch.zeros(batch, heads, seen - 2, dim, dtype=torch.float64), q], 2)
        ref = _decode_reference(q_all, k[:, :, :seen], v[:, :, :seen], s, inv_freq, real[:, :seen].long())
        assert (out - ref[:, :, -2:]).abs().max().item() < TOL, seen


def _kept_steps(s, q, k, v, real, inv_freq, first_seen, steps, prefill_queries=0):
    """Outputs of compiled-step kernels on a static cache of k, v's slots: an eager call at
    `first_seen` keeps the summaries (static_keep), then `steps` one-query steps each fold in its
    token (kept_step); or, with prefill_queries, one call of that many queries rebuilds them."""
    from hf_dilated.kinds import KINDS
    from hf_dilated.ops import sparse_far_static

    kind = KINDS["dilated"]
    slots = torch.arange(k.shape[2])
    kind.static_keep(k, s, real=real & (slots < first_seen), seen=first_seen, q_len=first_seen,
                     rope_frequencies=inv_freq)
    outs = []
    for seen in range(first_seen + 1, first_seen + 1 + steps):
        q_len = prefill_queries or 1
        outs.append(kind.static_decode(q[:, :, seen - q_len:seen], k, v, s, real=real & (slots < seen),
                                       seen=torch.tensor(seen), scale=None, rope_frequencies=inv_freq))
    return outs, getattr(k, sparse_far_static.ATTRIBUTE)


def _static_inputs(left_padding: int):
    """(q, k, v, inv_freq, real) of the static-step tests, float64: 2 rows of 80 slots, 4 query / 2
    kv heads of 8, row 1 left-padded by `left_padding` slots."""
    g = torch.Generator().manual_seed(8)
    batch, heads, kv_heads, slots, dim = 2, 4, 2, 80, 8
    q = torch.randn(batch, heads, slots, dim, generator=g, dtype=torch.float64)
    k, v = (torch.randn(batch, kv_heads, slots, dim, generator=g, dtype=torch.float64) for _ in range(2))
    inv_freq = 1.0 / (100.0 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    real = torch.ones(batch, slots, dtype=torch.bool)
    real[1, :left_padding] = False
    return q, k, v, inv_freq, real


@pytest.mark.parametrize("over", ({}, {"far_sinks": 0, "far_group": 1, "far_window": None}, {"far_sinks": 2}),
                         ids=("grouped", "own_positions", "two_sinks"))
def test_kept_static_steps_match_reference(over):
    """A compiled step with kept summaries (ops/sparse_far_static.kept_step: the band, the sinks and
    the chosen blocks gathered by rank) equals the reference of the whole sequence at every step,
    left padding included; its summaries, folded in one token a step, equal rebuilt ones."""
    from hf_dilated.ops import sparse_far_static

    s = _decode_settings(**over)
    q, k, v, inv_freq, real = _static_inputs(left_padding=7)
    slots = q.shape[2]
    first, steps = 20, 50
    outs, kept = _kept_steps(s, q, k, v, real, inv_freq, first, steps)
    seen = first + steps
    ref = _decode_reference(q[:, :, :seen], k[:, :, :seen], v[:, :, :seen], s, inv_freq, real[:, :seen].long())
    for t, out in enumerate(outs):
        assert (out - ref[:, :, first + t:first + t + 1]).abs().max().item() < TOL, t
    far = (s["far_window"] or s["local_window"], s["far_group"], inv_freq) if s["far_group"] > 1 else None
    rebuilt = sparse_far_static.KeptSummaries(k, s["far_block_size"], kept.settings)
    sparse_far_static.build(rebuilt, k, real & (torch.arange(slots) < seen), seen, s["far_block_size"], far)
    blocks = kept.mn.shape[2] - 1  # (the last row is where padding and unwritten slots go)
    assert torch.equal(kept.mn[:, :, :blocks], rebuilt.mn[:, :, :blocks])
    assert torch.equal(kept.mx[:, :, :blocks], rebuilt.mx[:, :, :blocks])
    assert int(kept.cut) == 0


@pytest.mark.parametrize("kept", (True, False), ids=("kept_summaries", "every_slot"))
def test_static_steps_of_rows_rotated_further_than_their_ranks_match_reference(kept):
    """q and k rotated `shift` positions further than their mask ranks (a left-padded row at
    transformers' default position_ids: its padding): the compiled static steps given that shift
    (rope_shift, one a row) equal the float64 reference of the rows at their ranks, with kept
    summaries and without (every slot summarised in the step). Without the shift the far blocks
    are chosen by bounds of keys moved from the wrong place."""
    from hf_dilated.kinds import KINDS
    from hf_dilated.ops.rope import rotate_by

    s = _decode_settings()
    q, k, v, inv_freq, real = _static_inputs(left_padding=9)  # the model rotated row 1 9 further than its ranks
    batch, slots = q.shape[0], q.shape[2]
    shift = torch.tensor([0, 9])
    turned = [rotate_by(x, shift[:, None].expand(batch, slots), inv_freq) for x in (q, k)]
    first, steps = 20, 50
    seen_all = first + steps
    ref = _decode_reference(q[:, :, :seen_all], k[:, :, :seen_all], v[:, :, :seen_all], s, inv_freq,
                            real[:, :seen_all].long())
    kind, positions = KINDS["dilated"], torch.arange(slots)

    def outputs(rope_shift):
        k_turned = turned[1].clone()  # (the summaries are kept on the cache's key tensor)
        if kept:
            kind.static_keep(k_turned, s, real=real & (positions < first), seen=first, q_len=first,
                             rope_frequencies=inv_freq, rope_shift=rope_shift)
        return [kind.static_decode(turned[0][:, :, seen - 1:seen], k_turned, v, s, real=real & (positions < seen),
                                   seen=torch.tensor(seen), scale=None, rope_frequencies=inv_freq, rope_shift=rope_shift)
                for seen in range(first + 1, seen_all + 1)]

    errors = [(out - ref[:, :, first + t:first + t + 1]).abs().max().item() for t, out in enumerate(outputs(shift))]
    assert max(errors) < TOL, errors
    unshifted = [(out - ref[:, :, first + t:first + t + 1]).abs().max().item() for t, out in enumerate(outputs(None))]
    assert max(unshifted) > 1e-3  # (the shift is what the steps need)


def test_eager_calls_on_a_static_cache_fold_in_their_tokens(monkeypatch):
    """Eager calls on one static cache buffer, written in place once a call (StaticCache): each
    call after the first folds in its own tokens (no rebuild), and the summaries equal rebuilt ones;
    a buffer written twice since (a refill) is rebuilt."""
    from hf_dilated.kinds import KINDS
    from hf_dilated.ops import sparse_far_static

    s = _decode_settings()
    g = torch.Generator().manual_seed(10)
    batch, kv_heads, slots, dim = 2, 2, 80, 8
    source = torch.randn(batch, kv_heads, slots, dim, generator=g, dtype=torch.float64)
    inv_freq = 1.0 / (100.0 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    real = torch.ones(batch, slots, dtype=torch.bool)
    cache = torch.zeros_like(source)
    builds = []
    real_build = sparse_far_static.build
    monkeypatch.setattr(sparse_far_static, "build", lambda *a, **kw: builds.append(1) or real_build(*a, **kw))
    at = torch.arange(slots)
    for seen in [30] + list(range(31, 50)):
        q_len = 30 if seen == 30 else 1
        cache.index_copy_(2, torch.arange(seen - q_len, seen), source[:, :, seen - q_len:seen])
        KINDS["dilated"].static_keep(cache, s, real=real & (at < seen), seen=seen, q_len=q_len,
                                     rope_frequencies=inv_freq)
    assert len(builds) == 1  # the first call only
    kept = getattr(cache, sparse_far_static.ATTRIBUTE)
    rebuilt = sparse_far_static.KeptSummaries(cache, s["far_block_size"], kept.settings)
    real_build(rebuilt, cache, real & (at < 49), 49, s["far_block_size"], (4, 2, inv_freq))
    assert torch.equal(kept.mn[:, :, :-1], rebuilt.mn[:, :, :-1]) and torch.equal(kept.mx[:, :, :-1], rebuilt.mx[:, :, :-1])
    cache.index_copy_(2, torch.arange(0, 49), source[:, :, 1:50])  # a refill...
    cache.index_copy_(2, torch.arange(49, 50), source[:, :, :1])  # ...and this call's token: two writes
    KINDS["dilated"].static_keep(cache, s, real=real & (at < 50), seen=50, q_len=1, rope_frequencies=inv_freq)
    assert len(builds) == 2


def _static_case(seed, slots=80, batch=2):
    g = torch.Generator().manual_seed(seed)
    heads, kv_heads, dim = 4, 2, 8
    q = torch.randn(batch, heads, slots, dim, generator=g, dtype=torch.float64)
    k, v = (torch.randn(batch, kv_heads, slots, dim, generator=g, dtype=torch.float64) for _ in range(2))
    inv_freq = 1.0 / (100.0 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    return q, k, v, inv_freq


def test_kept_static_steps_after_a_crop_fold_exact_blocks():
    """A static cache cropped and refilled by compiled one-query steps (assisted decoding crops after
    a compiled verification): each step's fold makes its block again from the block's keys, so a
    block that held cropped keys is exact, and every step equals the reference (it read stale
    keys cropped away once: the fold only took the min / max with what the block held)."""
    from hf_dilated.kinds import KINDS

    s = _decode_settings()
    q, k, v, inv_freq = _static_case(13)
    other_k, other_v = _static_case(14)[1:3]
    real = torch.ones(2, 80, dtype=torch.bool)
    slots = torch.arange(80)
    KINDS["dilated"].static_keep(k, s, real=real & (slots < 60), seen=60, q_len=60, rope_frequencies=inv_freq)
    k[:, :, 42:], v[:, :, 42:] = other_k[:, :, 42:], other_v[:, :, 42:]  # cropped to 42, refilled by the steps
    for seen in range(43, 70):
        out = KINDS["dilated"].static_decode(q[:, :, seen - 1:seen], k, v, s, real=real & (slots < seen),
                                             seen=torch.tensor(seen), scale=None, rope_frequencies=inv_freq)
        ref = _decode_reference(q[:, :, :seen], k[:, :, :seen], v[:, :, :seen], s, inv_freq)
        assert (out - ref[:, :, -1:]).abs().max().item() < TOL, seen


def test_kept_static_summaries_belong_to_their_cache():
    """Two static caches of one shape used in turn (an eager call on each, then steps on the first):
    each keeps its own summaries on its key tensor, and the steps on the first read the first's."""
    from hf_dilated.kinds import KINDS
    from hf_dilated.ops import sparse_far_static

    s = _decode_settings()
    q, k, v, inv_freq = _static_case(15)
    k_b, v_b = _static_case(16)[1:3]
    real = torch.ones(2, 80, dtype=torch.bool)
    slots = torch.arange(80)
    for keys in (k, k_b):
        KINDS["dilated"].static_keep(keys, s, real=real & (slots < 50), seen=50, q_len=50, rope_frequencies=inv_freq)
    assert getattr(k, sparse_far_static.ATTRIBUTE) is not getattr(k_b, sparse_far_static.ATTRIBUTE)
    ref = _decode_reference(q[:, :, :60], k[:, :, :60], v[:, :, :60], s, inv_freq)
    for seen in range(51, 61):
        out = KINDS["dilated"].static_decode(q[:, :, seen - 1:seen], k, v, s, real=real & (slots < seen),
                                             seen=torch.tensor(seen), scale=None, rope_frequencies=inv_freq)
        assert (out - ref[:, :, seen - 1:seen]).abs().max().item() < TOL, seen


def test_kept_static_prefill_with_padding_queries_gives_no_nan():
    """A compiled call of several queries whose first are left padding (rank -1: no key at all),
    with NaN in the padding slots' values (what a padded row's earlier layer may leave): the
    padding queries give 0, the real ones the reference, nothing NaN."""
    from hf_dilated.kinds import KINDS

    s = _decode_settings()
    q, k, v, inv_freq = _static_case(17)
    real = torch.ones(2, 80, dtype=torch.bool)
    real[1, :40] = False  # row 1: 40 slots of left padding, its first real token at slot 40
    v[1, :, :40] = float("nan")
    slots = torch.arange(80)
    KINDS["dilated"].static_keep(k, s, real=real & (slots < 30), seen=30, q_len=30, rope_frequencies=inv_freq)
    out = KINDS["dilated"].static_decode(q[:, :, 30:50], k, v, s, real=real & (slots < 50), seen=torch.tensor(50),
                                         scale=None, rope_frequencies=inv_freq)
    assert torch.isfinite(out).all()
    assert out[1, :, :10].abs().max() == 0  # row 1's queries at slots 30..39 are padding
    for row, first in ((0, 0), (1, 40)):
        ref = _decode_reference(q[row:row + 1, :, first:50], k[row:row + 1, :, first:50], v[row:row + 1, :, first:50],
                                s, inv_freq)
        got = out[row:row + 1, :, first - 30:] if first else out[row:row + 1]
        assert (got - ref[:, :, -got.shape[2]:]).abs().max().item() < TOL, row


def test_kept_static_prefill_rebuilds_the_summaries():
    """A compiled call of several queries (a compiled prefill) rebuilds the summaries before reading
    them: right after an eager call on another cache's keys, it still equals the reference."""
    s = _decode_settings()
    g = torch.Generator().manual_seed(9)
    batch, heads, kv_heads, slots, dim = 2, 4, 2, 80, 8
    q = torch.randn(batch, heads, slots, dim, generator=g, dtype=torch.float64)
    k, v, other = (torch.randn(batch, kv_heads, slots, dim, generator=g, dtype=torch.float64) for _ in range(3))
    inv_freq = 1.0 / (100.0 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    real = torch.ones(batch, slots, dtype=torch.bool)
    from hf_dilated.kinds import KINDS

    KINDS["dilated"].static_keep(k, s, real=real, seen=60, q_len=60, rope_frequencies=inv_freq)
    k.copy_(other)  # the cache rewritten (no eager call since): the compiled call of 5 queries rebuilds
    out = KINDS["dilated"].static_decode(q[:, :, 55:60], k, v, s, real=real & (torch.arange(slots) < 60),
                                         seen=torch.tensor(60), scale=None, rope_frequencies=inv_freq)
    ref = _decode_reference(q[:, :, :60], other[:, :, :60], v[:, :, :60], s, inv_freq)
    assert (out - ref[:, :, 55:60]).abs().max().item() < TOL


def test_kept_static_steps_read_ties_up_to_their_slots_and_count_the_rest(monkeypatch):
    """Small-integer keys (many bounds tied at the k-th): a kept step reads up to TIE_SLOTS tied
    blocks beyond its top_k, the reference's set while they fit; with fewer slots it cuts the rest,
    counts them, and the next eager call on the cache says so."""
    from hf_dilated.ops import sparse_far_static

    s = _decode_settings(far_group=1, far_window=None)
    g = torch.Generator().manual_seed(5)
    batch, heads, kv_heads, slots, dim = 2, 4, 2, 80, 8
    q = torch.randn(batch, heads, slots, dim, generator=g, dtype=torch.float64).mul(2).round()
    k = torch.randn(batch, kv_heads, slots, dim, generator=g, dtype=torch.float64).mul(2).round()
    v = torch.randn(batch, kv_heads, slots, dim, generator=g, dtype=torch.float64)
    real = torch.ones(batch, slots, dtype=torch.bool)
    first, steps = 40, 30
    ref = _decode_reference(q[:, :, :first + steps], k[:, :, :first + steps], v[:, :, :first + steps], s, None)
    monkeypatch.setattr(sparse_far_static, "TIE_SLOTS", 20)  # room for every tie here
    outs, kept = _kept_steps(s, q, k, v, real, None, first, steps)
    for t, out in enumerate(outs):
        assert (out - ref[:, :, first + t:first + t + 1]).abs().max().item() < TOL, t
    assert int(kept.cut) == 0
    monkeypatch.setattr(sparse_far_static, "TIE_SLOTS", 0)
    outs, kept = _kept_steps(s, q, k, v, real, None, first, steps)
    assert int(kept.cut) > 0  # ties were cut: these steps read only the top_k
    assert any((out - ref[:, :, first + t:first + t + 1]).abs().max().item() > 1e-6 for t, out in enumerate(outs))
    from hf_dilated.kinds import KINDS

    with pytest.warns(RuntimeWarning, match="tied at the far_top_k-th bound"):
        KINDS["dilated"].static_keep(k, s, real=real, seen=first + steps, q_len=1, rope_frequencies=None)


# --- decode: the band, the sinks and the chosen blocks only, summaries kept between steps ---------

def _decode_settings(**over):
    from hf_dilated.config import field_defaults
    from hf_dilated.kinds import KINDS

    s = {**field_defaults(*KINDS["dilated"].settings), "segment_lengths": [128], "dilation_rates": [1],
         "local_window": 16, "far_group": 2, "far_window": 4, "far_band": 8, "far_top_k": 2, "far_block_size": 4,
         "far_sinks": 1}
    s.update(over)
    return s


def _left_padded_case(s, seed):
    """(q, k, v, inv_freq, mask, reference) of 70 tokens in float64, row 1 left-padded by 9, with
    settings `s` (_decode_settings)."""
    g = torch.Generator().manual_seed(seed)
    batch, heads, kv_heads, n, dim = 2, 4, 2, 70, 8
    q, k, v = (torch.randn(batch, h, n, dim, generator=g, dtype=torch.float64) for h in (heads, kv_heads, kv_heads))
    inv_freq = 1.0 / (100.0 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    mask = torch.ones(batch, n, dtype=torch.long)
    mask[1, :9] = 0
    return q, k, v, inv_freq, mask, _decode_reference(q, k, v, s, inv_freq, mask)


def _decode_reference(q, k, v, s, inv_freq, mask=None, pos=None):
    """The whole sequence's reference, with the far projections at the grouped positions."""
    from hf_dilated.ops.rope import far_projections
    from hf_dilated.ops.token_layout import token_layout

    q_far, k_far = q, k
    if s["far_group"] > 1:
        positions = token_layout(k.shape[0], k.shape[2], k.device, mask, pos).positions
        q_far, k_far = far_projections(q, k, positions, s["far_window"] or s["local_window"], s["far_group"], inv_freq)
    return local_band_reference(q, k, v, s["segment_lengths"], s["dilation_rates"], s["local_window"], q_far=q_far,
                                k_far=k_far, attention_mask=mask, position_ids=pos, far_band=s["far_band"],
                                far_top_k=s["far_top_k"], far_block_size=s["far_block_size"], far_sinks=s["far_sinks"])


class _InPlaceCache:
    """A cache that writes each step's keys into one preallocated buffer, as hf_dilated.ReservedCache
    and StaticCache do (one in-place write per step), and hands out views of the filled part."""

    def __init__(self, k, v, filled):
        self.k = torch.zeros(k.shape[:2] + (k.shape[2] + 8,) + k.shape[3:], dtype=k.dtype)
        self.v = torch.zeros_like(self.k)
        self.k[:, :, :filled].copy_(k[:, :, :filled])
        self.v[:, :, :filled].copy_(v[:, :, :filled])
        self.filled = filled

    def append(self, k_new, v_new):
        n = k_new.shape[2]
        self.k[:, :, self.filled:self.filled + n].copy_(k_new)
        self.v[:, :, self.filled:self.filled + n].copy_(v_new)
        self.filled += n
        return self.k[:, :, :self.filled], self.v[:, :, :self.filled]

    def crop(self, n):
        self.filled = n


@pytest.mark.parametrize("over", ({}, {"far_block_size": 3}), ids=("grouped", "blocks_of_3"))  # 3: keys turned one by one
def test_keys_rotated_further_than_their_positions_match_reference(over):
    """The model may rotate q and k further than their kernel positions (transformers' default
    position_ids of a left-padded row are its indices, not its mask ranks). Told how much
    (RopeOffset), a prefill and decode steps equal the reference of q and k rotated at their
    positions: the far blocks' bounds are taken at the grouped positions themselves (they are not
    relative; taken as rotated, they chose other blocks)."""
    from hf_dilated.kinds import KINDS
    from hf_dilated.ops.rope import RopeOffset, rotate_by

    s = _decode_settings(**over)
    q, k, v, inv_freq, mask, ref = _left_padded_case(s, seed=11)
    n = k.shape[2]
    further = torch.tensor([[5], [9]]) * mask  # row 0 by explicit positions, row 1 by its padding
    q_model, k_model = rotate_by(q, further, inv_freq), rotate_by(k, further, inv_freq)
    kw = dict(is_causal=True, position_ids=None, scale=None, dropout_p=0.0, group=None, layout=None,
              rope_frequencies=inv_freq)
    real = mask.bool()[:, None, :, None]

    def off(out, expected):
        return (out - expected).masked_fill(~real[:, :, -out.shape[2]:], 0).abs().max().item()

    unaware = KINDS["dilated"].run(q_model, k_model, v, s, attention_mask=mask, **kw)
    assert off(unaware, ref) > 1e-3  # taken as rotated at their positions, other blocks are chosen
    out = KINDS["dilated"].run(q_model, k_model, v, s, attention_mask=mask, rope_offset=RopeOffset(further, [5, 9]),
                               **kw)
    assert off(out, ref) < TOL
    state = {}
    for t in range(40, n):
        out = KINDS["dilated"].run(q_model[:, :, t:t + 1], k_model[:, :, :t + 1], v[:, :, :t + 1], s,
                                   attention_mask=mask[:, :t + 1], state=state,
                                   rope_offset=RopeOffset(further[:, :t + 1], [5, 9]), **kw)
        assert off(out, ref[:, :, t:t + 1]) < TOL, t


class _ConcatCache:
    """A cache that concatenates each step's keys into a new tensor, as transformers' DynamicCache does."""

    def __init__(self, k, v, filled):
        self.k, self.v = k[:, :, :filled].clone(), v[:, :, :filled].clone()

    def append(self, k_new, v_new):
        self.k, self.v = torch.cat([self.k, k_new], 2), torch.cat([self.v, v_new], 2)
        return self.k, self.v

    def crop(self, n):
        self.k, self.v = self.k[:, :, :n], self.v[:, :, :n]


@pytest.fixture(params=(False, True), ids=("kv_heads_at_once", "kv_head_by_kv_head"))
def chosen_by_kv_head(request, monkeypatch):
    """A decode step's chosen keys and values copied for every kv head at once, or one kv head at a
    time (what the CPU does once they exceed sparse_far_decode._CPU_CHOSEN_BYTES)."""
    if request.param:
        from hf_dilated.ops import sparse_far_decode

        monkeypatch.setattr(sparse_far_decode, "_CPU_CHOSEN_BYTES", 1)
    return request.param


@pytest.mark.parametrize("cache_class", (_InPlaceCache, _ConcatCache), ids=("in_place", "concatenating"))
@pytest.mark.parametrize("layout", ("plain", "left", "offset", "far_offset"))
@pytest.mark.parametrize("over", ({}, {"far_group": 1, "far_window": None}, {"far_band": None, "far_sinks": 0},
                                  {"far_top_k": 0, "far_sinks": 2}, {"far_block_size": 3}),
                         ids=("grouped", "own_positions", "k_only", "sinks", "blocks_of_3"))  # 3: keys turned one by one
def test_decode_steps_match_reference_with_kept_summaries(layout, over, cache_class, chosen_by_kv_head):
    """Steps against a cache that grows in place, or into a new tensor each step (DynamicCache): each
    equals the reference of the whole sequence, the summaries are kept in `state` and extended (not
    rebuilt) between steps and equal rebuilt ones; a crop and refill with other keys before the last
    rebuilds them, still exact."""
    from hf_dilated.kinds import KINDS
    from hf_dilated.ops import sparse_far_decode as decode_module

    s = _decode_settings(**over)
    g = torch.Generator().manual_seed(7)
    batch, heads, kv_heads, n, dim = 2, 4, 2, 70, 8
    q, k, v = (torch.randn(batch, h, n, dim, generator=g, dtype=torch.float64) for h in (heads, kv_heads, kv_heads))
    inv_freq = 1.0 / (100.0 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    mask = pos = None
    if layout == "left":
        mask = torch.ones(batch, n, dtype=torch.long)
        mask[1, :9] = 0
    if layout in ("offset", "far_offset"):  # far_offset: blocks before the document's first (no key, no sink)
        pos = torch.arange(n)[None].expand(batch, n) + torch.tensor([[3 if layout == "offset" else 21], [0]])
    ref = _decode_reference(q, k, v, s, inv_freq, mask, pos)
    state, rebuilds = {}, []
    real_clear = decode_module.SummaryState.clear

    def counting_clear(self):
        rebuilds.append(getattr(self, "kv_len", None))
        real_clear(self)

    cache = cache_class(k, v, 40)
    decode_module.SummaryState.clear = counting_clear
    try:
        for t in range(40, n - 1):
            keys, values = cache.append(k[:, :, t:t + 1], v[:, :, t:t + 1])
            kw = dict(is_causal=True, attention_mask=None if mask is None else mask[:, :t + 1],
                      position_ids=None if pos is None else pos[:, :t + 1], scale=None, dropout_p=0.0, group=None,
                      layout=None, rope_frequencies=inv_freq)
            out = KINDS["dilated"].run(q[:, :, t:t + 1], keys, values, s, state=state, **kw)
            assert (out - ref[:, :, t:t + 1]).abs().max().item() < TOL, t
        assert rebuilds == [None, 0]  # the state's creation, and its first build: extended ever after
        kept = state["far_summaries"]
        fresh = decode_module.SummaryState()
        decode_module._summaries(fresh, k, *decode_module_rows(mask, pos, batch, n), list(kept.counts),
                                 s["far_block_size"], None if s["far_group"] == 1 else
                                 (s["far_window"], s["far_group"], inv_freq), torch.float64, 1)
        assert torch.equal(kept.mn[:, :, :fresh.mn.shape[2]], fresh.mn)
        assert torch.equal(kept.mx[:, :, :fresh.mx.shape[2]], fresh.mx)
        rebuilds.clear()
        # crop to 20 tokens and refill with other keys up to the same length, then step: the cache
        # has grown by the step's token since the last, but its keys are not those summarised
        k2 = k.clone()  # other keys from 20 on, the last one kept (the same last token: a check of it alone passes)
        k2[:, :, 20:n - 1] = torch.randn(k2[:, :, 20:n - 1].shape, generator=g, dtype=torch.float64)
        cache.crop(20)
        cache.append(k2[:, :, 20:n - 1], v[:, :, 20:n - 1])
        keys, values = cache.append(k2[:, :, n - 1:], v[:, :, n - 1:])
        ref2 = _decode_reference(q, k2, v, s, inv_freq, mask, pos)
        out = KINDS["dilated"].run(q[:, :, n - 1:], keys, values, s, state=state,
                                   **{**kw, "attention_mask": mask, "position_ids": pos})
        assert (out - ref2[:, :, n - 1:]).abs().max().item() < TOL
        assert rebuilds == [n - 1]  # the rewrite: rebuilt from the state built at n - 1 tokens
    finally:
        decode_module.SummaryState.clear = real_clear


@pytest.mark.parametrize("layout", ("plain", "left", "far_offset"))
def test_decode_steps_with_tied_bounds_match_reference(layout, monkeypatch, chosen_by_kv_head):
    """Small-integer queries and keys (exact bounds, many tied at the k-th): a decode step's heads
    whose k-th bound is tied read every block reaching it (plain_slots' tied rows, listed after the
    sinks), the reference's set; with left padding (whole blocks copied) and with a document that
    starts 21 positions in (blocks before it hold no key: rows copied)."""
    from hf_dilated.kinds import KINDS
    from hf_dilated.ops import sparse_far_decode as decode_module

    s = _decode_settings(far_group=1, far_window=None)
    g = torch.Generator().manual_seed(5)
    batch, heads, kv_heads, n, dim = 2, 4, 2, 70, 8
    q, k, v = (torch.randn(batch, h, n, dim, generator=g, dtype=torch.float64) for h in (heads, kv_heads, kv_heads))
    q, k = q.mul(2).round(), k.mul(2).round()
    mask = pos = None
    if layout == "left":
        mask = torch.ones(batch, n, dtype=torch.long)
        mask[1, :9] = 0
    if layout == "far_offset":
        pos = torch.arange(n)[None].expand(batch, n) + torch.tensor([[21], [0]])
        # a large first key: a block before the document, were it a candidate, would bound as high
        k[0, :, 0] = 6.0
    ref = _decode_reference(q, k, v, s, None, mask, pos)
    tied_rows = []
    real_slots = decode_module.plain_slots

    def recording_slots(*args, **kwargs):
        slots, tied = real_slots(*args, **kwargs)
        tied_rows.append(tied.shape[0])
        return slots, tied

    monkeypatch.setattr(decode_module, "plain_slots", recording_slots)
    state = {}
    for t in range(40, n):
        kw = dict(is_causal=True, attention_mask=None if mask is None else mask[:, :t + 1],
                  position_ids=None if pos is None else pos[:, :t + 1], scale=None, dropout_p=0.0, group=None,
                  layout=None, rope_frequencies=None)
        out = KINDS["dilated"].run(q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1], s, state=state, **kw)
        assert (out - ref[:, :, t:t + 1]).abs().max().item() < TOL, t
    assert sum(tied_rows) > 0  # some step did read tied blocks


def decode_module_rows(mask, pos, batch, n):
    from hf_dilated.ops.token_layout import regular_rows

    return regular_rows(batch, n, torch.device("cpu"), mask, pos)


def test_decode_step_summarises_only_new_blocks(monkeypatch):
    """A step against the same buffer grown in place summarises only the blocks completed since the
    last step (keys rotated once over a generation), and reads only its band, sinks and chosen
    blocks: O(band + (k + sinks) B) keys and O(N / B) bounds per step, not O(N) keys."""
    from hf_dilated.ops import sparse_far_decode as decode_module
    from hf_dilated.ops.far_selection import FarSelection

    g = torch.Generator().manual_seed(3)
    n, size = 4096, 16
    k, v = torch.randn(1, 1, n + 33, 8, generator=g), torch.randn(1, 1, n + 33, 8, generator=g)
    q = torch.randn(1, 2, 1, 8, generator=g)
    inv_freq = 1.0 / (100.0 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8))
    summarised = []
    real = decode_module._far_keys
    monkeypatch.setattr(decode_module, "_far_keys", lambda k, b, lo, hi, *a: (summarised.append(hi - lo),
                                                                              real(k, b, lo, hi, *a))[1])
    state = decode_module.SummaryState()
    cache = _InPlaceCache(k, v, n - 1)

    def step(keys, values, state):
        summarised.clear()
        return decode_module.sparse_far_decode(q, keys, values, local_window=256, far_band=64,
                                               selection=FarSelection(4, size, 1), scale=0.3, first=[0], shift=[0],
                                               rotation=(32, 4, inv_freq), state=state)

    for t in range(n, n + 33):
        keys, values = cache.append(k[:, :, t - 1:t], v[:, :, t - 1:t])
        step(keys, values, state)
        if t == n:  # the first step summarises every complete far block
            assert sum(summarised) == ((t - 1 - 64) // size + 1) * size
        else:  # later ones at most the block that just filled
            assert sum(summarised) <= size
    assert state.counts == [(n + 31 - 64) // size + 1]  # the last query sits at position n + 31
    # The same cache queried again, unwritten (a benchmark's repeated step, candidates scored
    # against one cache): nothing is summarised again (it rotated every key at every call), and a
    # write in place since makes it summarise again.
    for again in range(2):
        out = step(keys, values, state)
        assert sum(summarised) == 0
    assert torch.equal(out, step(keys, values, decode_module.SummaryState()))
    keys[:, :, :1].mul_(2.0)  # a write in place
    step(keys, values, state)
    assert sum(summarised) > 0


def test_selection_settings_without_a_selection_are_an_error():
    for name in ("far_block_size", "far_sinks"):
        with pytest.raises(ValueError, match=f"{name}: .* needs far_top_k"):
            DilatedConfig(segment_lengths=[32], dilation_rates=[1], local_window=16, **{name: 2})


@pytest.mark.parametrize("k", (1, 3, 8))
def test_kth_by_maxima_is_topks_last_value(k):
    """The GPU's k-th largest (passes of max and count) equals topk's, ties and -inf included."""
    from hf_dilated.ops.far_selection import kth_by_maxima

    g = torch.Generator().manual_seed(k)
    scores = torch.randn(6, 40, 12, generator=g)
    scores[0] = scores[0].round()  # many ties
    scores[1, :, 5:] = float("-inf")  # fewer than k candidates in some rows
    scores[2] = float("-inf")
    scores[3, :, :4] = scores[3, :, :1]  # ties at the top
    assert torch.equal(kth_by_maxima(scores, k), scores.topk(k, dim=-1).values[..., -1:])


@pytest.mark.parametrize("k", (0, 1, 3, 8))
def test_top_picks_and_their_ties_are_selects_set(k):
    """The CUDA prefill's selection (far_selection.top_picks: k row maxima, then the ties at the
    k-th) reads select()'s set, ties and -inf included, with one pick per slot."""
    from hf_dilated.ops.far_selection import select, top_picks

    g = torch.Generator().manual_seed(k)
    scores = torch.randn(6, 40, 12, generator=g)
    scores[0] = scores[0].round()  # many ties
    scores[1, :, 5:] = float("-inf")  # fewer than k candidates in some rows
    scores[2] = float("-inf")
    scores[3, :, :4] = scores[3, :, :1]  # ties at the top
    picks, tied = top_picks(scores, k)
    picked = (torch.nn.functional.one_hot(picks.clamp(min=0), 12) * (picks >= 0)[..., None]).sum(-2) > 0
    assert picks.shape[-1] == k and not (picked & tied).any()
    assert torch.equal((picks >= 0).sum(-1), (scores > float("-inf")).sum(-1).clamp(max=k))
    assert torch.equal(picked | tied, select(scores, scores > float("-inf"), k))
    assert tied[0].any() == (k > 0)


@pytest.mark.parametrize("first_query", (40, 70, 150))
@pytest.mark.parametrize("top_k, sinks", ((0, 1), (1, 0), (3, 1), (8, 2), (40, 1)))
@pytest.mark.parametrize("keys", ("random", "tied"))
def test_plain_slots_are_plain_choices_set(first_query, top_k, sinks, keys):
    """The CPU prefill's selection (far_selection.plain_slots: bounds of the candidate blocks only,
    top_k + 1 largest per row, the rows tied at the k-th read in full) reads plain_choice()'s set,
    with chunks starting before and past the band, blocks with ties in some rows, fewer candidates
    than top_k."""
    from hf_dilated.ops import far_selection
    from hf_dilated.ops.far_selection import FarSelection

    g = torch.Generator().manual_seed(first_query + top_k)
    size, band, queries, n = 8, 24, 30, 180
    q = torch.randn(1, 4, queries, 6, generator=g, dtype=torch.float64)
    k = torch.randn(1, 2, n, 6, generator=g, dtype=torch.float64)
    if keys == "tied":  # small integers: exact bounds in any order of the sums, many of them tied
        q, k = q.mul(2).round(), k.mul(2).round()
    selection = FarSelection(top_k, size, sinks)
    mn, mx = far_selection.plain_summaries(k, size, -(-n // size))
    expected = far_selection.plain_choice(q, mn, mx, first_query, band, selection)[0]
    summary = far_selection.bound_operands(mn, mx, 2)[0][0]
    slots, tied = far_selection.plain_slots(q[0], summary, first_query, band, selection)
    assert slots.shape == (4, queries, sinks + top_k)
    got = torch.zeros_like(expected)
    h, t, slot = (slots >= 0).nonzero().unbind(1)
    got[h, t, slots[h, t, slot]] = True
    assert int((slots >= 0).sum()) == int(got.sum())  # no block twice
    got[tied[:, 0], tied[:, 1], tied[:, 2]] = True
    assert torch.equal(got, expected)
    if keys == "tied" and top_k in (1, 3):
        assert tied.shape[0] > 0


def test_plain_summaries_are_the_blocks_min_and_max():
    from hf_dilated.ops import far_selection

    k = torch.randn(2, 3, 50, 4, generator=torch.Generator().manual_seed(1))
    blocks = far_selection.Blocks(torch.arange(50).div(16, rounding_mode="floor").expand(2, 50), None, 4)
    mn, mx = far_selection.plain_summaries(k, 16, 6)  # two blocks past the keys
    ref_mn, ref_mx = far_selection.summaries(k, blocks)
    assert torch.equal(mn[:, :, :4], ref_mn) and torch.equal(mx[:, :, :4], ref_mx)
    assert torch.isinf(mn[:, :, 4:]).all() and torch.isinf(mx[:, :, 4:]).all()


def _reference_picks(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """top_picks' tensors, row by row in Python: the k largest scores above -inf (equal ones by index),
    then those reaching the k-th among the others."""
    rows = scores.reshape(-1, scores.shape[-1]).tolist()
    picks, tied = [], []
    for row in rows:
        order = sorted((j for j, x in enumerate(row) if x > float("-inf")), key=lambda j: (-row[j], j))[:k]
        kth = row[order[-1]] if len(order) == k and k else None  # fewer scores than k: no ties
        picks.append(order + [-1] * (k - len(order)))
        tied.append([kth is not None and j not in order and x >= kth for j, x in enumerate(row)])
    return (torch.tensor(picks, dtype=torch.long).view(*scores.shape[:-1], k),
            torch.tensor(tied, dtype=torch.bool).view(scores.shape))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_top_picks_are_the_largest_scores_by_index_then_the_ties(dtype):
    """far_selection.top_picks against a sort in Python: float32 by its int64 keys (the fused form,
    also compiled), float64 by argmax and a mask; ties, -inf, +-0.0, subnormals, the extremes, rows
    with fewer scores than k."""
    from hf_dilated.ops import far_selection

    g = torch.Generator().manual_seed(1)
    scores = torch.randint(-3, 4, (48, 37), generator=g).to(dtype)  # many ties
    scores[scores == -3] = float("-inf")
    scores[:6] = torch.randn(6, 37, generator=g, dtype=torch.float64).to(dtype)
    scores[6, ::2], scores[6, 1::2] = -0.0, 0.0  # equal: by index
    scores[7, :8] = torch.tensor([1e-45, -1e-45, 3.4e38, -3.4e38, float("inf"), 1.0, -1.0, 0.0], dtype=dtype)
    scores[8:12, 2:] = float("-inf")  # fewer than k
    scores[12] = float("-inf")
    compiled = torch.compile(far_selection.top_picks, backend="inductor", dynamic=False)
    try:
        for k in (0, 1, 2, 5, 16, 37, 40):
            expected = _reference_picks(scores, k)
            for fn in (far_selection.top_picks, compiled):
                picks, tied = fn(scores, k)
                assert torch.equal(picks, expected[0]) and torch.equal(tied, expected[1]), (fn, k)
        transposed = scores.T.contiguous().T  # not contiguous: the same picks
        assert torch.equal(far_selection.top_picks(transposed, 5)[0], _reference_picks(scores, 5)[0])
    finally:
        torch._dynamo.reset()


@pytest.mark.cuda
@pytest.mark.slow  # three compiles
def test_cuda_compiled_top_picks_are_the_reference_picks():
    """far_selection.top_picks compiled for CUDA (Triton: the float32 bits as int32, int64 keys and
    their row maxima) against the sort in Python, on rows with ties, -inf, +-0.0 and the extremes."""
    from hf_dilated.ops import far_selection

    g = torch.Generator().manual_seed(2)
    scores = torch.randint(-3, 4, (300, 256), generator=g).float()
    scores[scores == -3] = float("-inf")
    scores[:100] = torch.randn(100, 256, generator=g)
    scores[100, ::2], scores[100, 1::2] = -0.0, 0.0
    scores[101, :6] = torch.tensor([1e-45, -1e-45, 3.4e38, -3.4e38, float("inf"), 0.0])
    scores[102:110, 3:] = float("-inf")
    compiled = torch.compile(far_selection.top_picks, backend="inductor", dynamic=False)
    try:
        for k in (1, 16, 40):
            picks, tied = compiled(scores.cuda(), k)
            expected = _reference_picks(scores, k)
            assert torch.equal(picks.cpu(), expected[0]) and torch.equal(tied.cpu(), expected[1]), k
    finally:
        torch._dynamo.reset()


def test_picks_by_sort_are_top_picks():
    """far_selection.top_picks_by_sort (sparse_far_flex.PICKS "sort") returns top_picks' tensors
    themselves: the picks in order, ties at the k-th, rows with fewer candidates than top_k, -inf."""
    from hf_dilated.ops import far_selection

    g = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 6, (64, 40), generator=g).float()  # many ties
    scores[scores == 0] = float("-inf")
    scores[:4, 3:] = float("-inf")  # rows with fewer than k candidates
    scores[4] = float("-inf")  # a row with none
    for k in (0, 1, 5, 16, 40, 45):
        picks, tied = far_selection.top_picks(scores, k)
        by_sort = far_selection.top_picks_by_sort(scores, k)
        assert torch.equal(by_sort[0], picks) and torch.equal(by_sort[1], tied), k
        compiled = torch.compile(far_selection.top_picks_by_sort, backend="inductor")(scores, k)
        assert torch.equal(compiled[0], picks) and torch.equal(compiled[1], tied), k
    torch._dynamo.reset()


def test_flex_plan_sorts_narrow_keys_in_the_order_of_block_numbers():
    """by_block_plan sorts its entries by block on keys of the narrowest dtype holding the block count
    (a GPU's radix sort: a pass per 8 bits): its one sort of entries takes int16 keys here; the stable
    order is that of the int64 block numbers, up to the dtypes' edges."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from hf_dilated.ops import far_selection, sparse_far_flex

    class Sorts(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.dtypes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in (torch.ops.aten.sort, torch.ops.aten.argsort):
                self.dtypes.append((args[0].dtype, args[0].shape[-1]))
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(5)
    q, k = torch.randn(1, 4, 256, 8, generator=g), torch.randn(1, 2, 512, 8, generator=g)
    operands = far_selection.bound_operands(*far_selection.plain_summaries(k, 32, 16), 2)
    with Sorts() as sorts:
        sparse_far_flex.by_block_plan(q, *operands, torch.arange(256) + 200, 3, 1, 32, 512)
    entries = [dtype for dtype, length in sorts.dtypes if length == 4 // 2 * 256 * 4]  # (heads in group) x rows x slots
    assert entries == [torch.int16], sorts.dtypes

    assert [sparse_far_flex.sort_key_dtype(n) for n in (1, (1 << 15) - 1, 1 << 15, (1 << 31) - 1, 1 << 31)] == [
        torch.int16, torch.int16, torch.int32, torch.int32, torch.int64]
    for n_blocks in ((1 << 15) - 1, (1 << 15)):  # the untaken entries sort last, as key n_blocks
        block = torch.randint(-1, n_blocks, (2, 3, 4096), generator=torch.Generator().manual_seed(n_blocks))
        block[..., :8] = torch.tensor([n_blocks - 1, -1, 0, n_blocks - 1, -1, 0, 5, 5])
        wide = torch.argsort(torch.where(block >= 0, block, n_blocks), dim=-1, stable=True)
        narrow = torch.where(block >= 0, block, n_blocks).to(sparse_far_flex.sort_key_dtype(n_blocks))
        assert torch.equal(torch.argsort(narrow, dim=-1, stable=True), wide)


def test_flex_plan_and_merge_compile_to_the_eager_results():
    """sparse_far_flex compiles its plan and merge on CUDA (torch.compile, inductor); compiled here
    for the CPU, they return the eager functions' results (the rows' order may differ only where
    blocks are equal: the plan's sort is stable)."""
    from hf_dilated.ops import far_selection, sparse_far_flex

    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 256, 8, generator=g)
    k = torch.randn(1, 2, 512, 8, generator=g)
    operands = far_selection.bound_operands(*far_selection.plain_summaries(k, 32, 16), 2)
    last = torch.where(torch.arange(256) < 200, torch.arange(256) + 200, -1)
    args = (q, *operands, last, 3, 1, 32, 512)
    torch._dynamo.reset()
    eager, compiled = sparse_far_flex.by_block_plan(*args), torch.compile(sparse_far_flex.by_block_plan)(*args)
    flat = [(a, b) for a, b in zip(eager, compiled) if not isinstance(a, tuple)] + list(zip(eager[-1], compiled[-1]))
    assert len(flat) == 11 and eager[5].any()  # blocks of 32: key tiles of 32, some of them full
    for a, b in flat:
        assert torch.equal(a, b)
    o = torch.randn(1, 2, eager[0].shape[2], 8, generator=g)
    part = torch.randn(1, 2, eager[0].shape[2], generator=g).masked_fill(eager[1] < 0, float("-inf"))
    rest = (eager[-2], 4, 256, torch.randn(1, 4, 256, 8, generator=g), torch.full((1, 4, 256), -1e9),
            torch.randn(1, 256, 4, 8, generator=g), torch.randn(1, 4, 256, generator=g))
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):  # (bfloat16: the output rounded once)
        out = sparse_far_flex.merge_entries(o.to(dtype), part, *rest)
        assert out.shape == (1, 256, 4, 8) and out.dtype == dtype  # the rows, in the output's layout and dtype
        for merge in (sparse_far_flex.merge_entries, sparse_far_flex.merge_entries_by_slot):  # MERGE's two sums
            out_c = torch.compile(merge)(o.to(dtype), part, *rest)
            assert out_c.is_contiguous() and torch.allclose(out.float(), out_c.float(), atol=tol)
    torch._dynamo.reset()


@pytest.mark.parametrize("plain_chunk", (None, 5), ids=("one_chunk", "chunks_of_5"))
@pytest.mark.parametrize("heads", ((2, 1), (4, 2)), ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_tied_bounds_all_count(heads, plain_chunk, monkeypatch):
    """Blocks whose bounds tie at the k-th largest are all read (docs/contract.md 4.2), in the kernel as
    in the reference: key blocks repeated exactly give equal summaries, hence equal bounds. The plain
    path lists the tied rows after the others, in every chunk and for every kv head's group."""
    if plain_chunk:
        from hf_dilated.ops import sparse_far_plain

        monkeypatch.setattr(sparse_far_plain, "_MIN_CHUNK", plain_chunk)
        monkeypatch.setattr(sparse_far_plain, "_BOUND_ELEMENTS", 1)  # selections of 5 queries
        monkeypatch.setattr(sparse_far_plain, "_PAIR_ELEMENTS", 1)  # and products of 5
    g = torch.Generator().manual_seed(9)
    q = torch.randn(1, heads[0], 40, 4, generator=g, dtype=torch.float64)
    block = torch.randn(1, heads[1], 4, 4, generator=g, dtype=torch.float64)
    k = block.repeat(1, 1, 10, 1)  # ten equal blocks of 4 per kv head
    v = torch.randn(1, heads[1], 40, 4, generator=g, dtype=torch.float64)
    kernel, ref_kw = sparse((8, 1, 4, 0))
    with torch.no_grad(), pair_count.counting() as tally:
        out = dilated_attention(q, k, v, [64], [1], local_window=16, **kernel)
    ref = local_band_reference(q, k, v, [64], [1], 16, **ref_kw)
    near, far = local_band_key_sets(q, k, [64], [1], 16, **ref_kw)
    every_near, every_far = local_band_key_sets(q, k, [64], [1], 16, far_band=8)
    assert torch.equal(far, every_far)  # one block asked for, every tied one read
    assert (out - ref).abs().max().item() < TOL
    assert tally.pairs == int((near | far).sum())


@pytest.mark.parametrize("cache", ("reserved", "dynamic"))
def test_model_generation_keeps_the_summaries_and_matches_reference(tmp_path, monkeypatch, cache):
    """generate() with hf_dilated.ReservedCache (one buffer written in place) or its default
    DynamicCache (a new tensor each step): the decode steps keep each layer's summaries between
    steps (never rebuilt after the first) and still pick the reference's tokens."""
    from transformers import AttentionInterface, AutoModelForCausalLM

    from hf_dilated import ReservedCache
    from hf_dilated.ops.sparse_far_decode import SummaryState

    from hf_dilated.ops import sparse_far_decode

    rebuilt = []
    real_clear = SummaryState.clear
    monkeypatch.setattr(SummaryState, "clear", lambda self: (rebuilt.append(getattr(self, "kv_len", 0)),
                                                             real_clear(self))[1])
    made = {"bounds": 0, "turns": 0}  # what a step keeps: the bounds' operands, the offsets' turns
    for name, fn in (("bounds", "bound_operands"), ("turns", "offset_turns")):
        real = getattr(sparse_far_decode, fn)
        monkeypatch.setattr(sparse_far_decode, fn, lambda *a, name=name, real=real: made.__setitem__(
            name, made[name] + 1) or real(*a))

    entry = dict(ENTRY, far_block_size=4)  # whole blocks of the group of 2: the turns per block and offset
    path = _tiny("llama", tmp_path, entry)
    AttentionInterface.register("test_sparse_far_reference", _reference_attention(entry))
    ids = torch.randint(3, 99, (1, 20), generator=torch.Generator().manual_seed(1))
    ours = AutoModelForCausalLM.from_pretrained(path, attn_implementation="dilated", dtype=torch.float64).eval()
    theirs = AutoModelForCausalLM.from_pretrained(path, attn_implementation="test_sparse_far_reference",
                                                  dtype=torch.float64).eval()
    with torch.no_grad():
        mine = ours.generate(ids, max_new_tokens=10, do_sample=False,
                             **({"cache": ReservedCache(config=ours.config)} if cache == "reserved" else {}))
        steps = [theirs(mine[:, :t]).logits[:, -1].argmax(-1) for t in range(20, 30)]
    assert torch.equal(mine[:, 20:], torch.stack(steps, 1))
    kept = [layer.self_attn.__dict__["_hf_dilated_state"]["far_summaries"] for layer in ours.model.layers]
    assert all(state.kv_len == 29 and state.counts for state in kept)
    assert all(n == 0 for n in rebuilt)  # each state built once (from empty), then extended by every step
    layers = len(ours.model.layers)
    assert made["turns"] == layers  # once per layer: they depend on the frequencies only
    # the bounds' operands once per layer and summary change, not once per decode step
    assert layers <= made["bounds"] < 9 * layers, made  # 9 steps after the prefill


def _left_padded_generation_matches_reference(family, tmp_path, seed, cache_of, grad_mode=torch.no_grad):
    """A tiny `family` model (ENTRY, blocks of 4) under `dilated` generates 13 greedy tokens for a
    left-padded batch of 2 x 20 (generate()'s extra arguments: cache_of(model), in grad_mode());
    asserts each row's tokens are the float64 reference's (per row, alone, unpadded); returns the
    model."""
    from transformers import AttentionInterface, AutoModelForCausalLM

    entry = dict(ENTRY, far_block_size=4)
    path = _tiny(family, tmp_path, entry)
    AttentionInterface.register("test_sparse_far_reference", _reference_attention(entry))
    ours = AutoModelForCausalLM.from_pretrained(path, attn_implementation="dilated", dtype=torch.float64).eval()
    theirs = AutoModelForCausalLM.from_pretrained(path, attn_implementation="test_sparse_far_reference",
                                                  dtype=torch.float64).eval()
    ids = torch.randint(3, 99, (2, 20), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding: the second row's positions are its ranks
    with grad_mode():
        mine = ours.generate(ids, attention_mask=mask, max_new_tokens=13, do_sample=False, pad_token_id=0,
                             **cache_of(ours))
    with torch.no_grad():
        for row, start in ((0, 0), (1, 3)):
            want = [theirs(mine[row:row + 1, start:t]).logits[:, -1].argmax(-1) for t in range(20, 33)]
            assert torch.equal(mine[row, 20:], torch.cat(want)), row
    return ours


@pytest.mark.parametrize("family, grad_mode", [("llama", torch.no_grad), ("gpt_neox", torch.no_grad),
                                               ("llama", torch.inference_mode)],
                         ids=("llama", "gpt_neox", "llama-inference_mode"))
def test_graphed_steps_on_an_in_place_cache_match_reference(tmp_path, monkeypatch, family, grad_mode):
    """The step a GPU replays as one CUDA graph (sparse_far_reserved.ReservedStep: kept_step over the
    whole buffer of hf_dilated.ReservedCache, the query and the written count its only inputs),
    called here on the CPU: generate() on a left-padded batch picks the reference's tokens (per
    row, each alone, unpadded); the summaries are built once per buffer and then folded one
    token a step, and the buffer's growth (past 30 tokens here) makes a new step that summarises
    the new buffer. Under torch.inference_mode too, where views keep no base and tensors no
    version: ReservedCache tells its views their buffer and writes (every step took the compiled
    O(N) form there before)."""
    from hf_dilated import ReservedCache
    from hf_dilated.integrations import cache as cache_module
    from hf_dilated.ops import sparse_far_reserved, sparse_far_static

    monkeypatch.setattr(sparse_far_reserved, "GRAPHED_ON", ("cuda", "cpu"))
    monkeypatch.setattr(cache_module, "_MIN_ROOM", 4)
    builds, steps = [], []
    real_build, real_step = sparse_far_static.build, sparse_far_reserved.reserved_step
    for module in (sparse_far_static, sparse_far_reserved):
        monkeypatch.setattr(module, "build", lambda kept, k, *a: builds.append(k.shape[2]) or real_build(kept, k, *a))
    monkeypatch.setattr(sparse_far_reserved, "reserved_step", lambda *a, **kw: (
        lambda out: steps.append(out is not None) or out)(real_step(*a, **kw)))
    ours = _left_padded_generation_matches_reference(family, tmp_path, 2, lambda model: {
        "cache": ReservedCache(config=model.config)}, grad_mode)
    layers = ours.config.num_hidden_layers
    assert len(steps) == 12 * layers and all(steps)  # every decode step took the graphed form
    capacities = sorted(set(builds))
    assert len(capacities) > 1  # the buffer grew, and the new one was summarised
    assert len(builds) == layers * len(capacities)  # once per layer and buffer, then one token folded a step


def test_graphed_steps_report_the_ties_they_cut(monkeypatch):
    """A far query of zeros (layer 0 of a token whose embedding is transformers' zero pad row) bounds
    every far block at 0: all tie at the k-th bound, and a graphed step reads TIE_SLOTS of them
    (contract 4.2 reads them all; 2.7 off a forward at the next step here). The ReservedCache steps
    counted the cut on the buffer's step, which went unread with the buffer (a new one each
    generation and as it grows): nothing was said. Now the next generation's first step says so."""
    import warnings

    from transformers import LlamaConfig, LlamaForCausalLM, LogitsProcessorList

    from hf_dilated import ReservedCache
    from hf_dilated.bench.gpu_table import _model_entry
    from hf_dilated.config import CONFIG_KEY
    from hf_dilated.ops import sparse_far_reserved

    monkeypatch.setattr(sparse_far_reserved, "GRAPHED_ON", ("cuda", "cpu"))
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=2,
                         intermediate_size=64, vocab_size=64, max_position_embeddings=256, pad_token_id=0,
                         initializer_range=0.2)
    setattr(config, CONFIG_KEY, {**_model_entry("default", 32, 256), "far_top_k": 2, "far_block_size": 4,
                                 "far_sinks": 1})
    torch.manual_seed(0)
    model = LlamaForCausalLM._from_config(config, attn_implementation="dilated").eval().double()
    assert bool((model.model.embed_tokens.weight[0] == 0).all())
    prompt = torch.randint(3, 64, (1, 70), generator=torch.Generator().manual_seed(3))

    def zero_first(ids, scores):  # the first new token is id 0
        if ids.shape[1] == prompt.shape[1]:
            scores[:] = -1e9
            scores[:, 0] = 0
        return scores

    def generate():
        with torch.no_grad():
            return model.generate(prompt, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=1,
                                  cache=ReservedCache(config=model.config),
                                  logits_processor=LogitsProcessorList([zero_first]))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        generate()
        generate()
    assert [w for w in caught if "tied at the far_top_k-th bound" in str(w.message)], [str(w.message) for w in caught]


def test_graphed_steps_leave_the_cache_tensors_plain(tmp_path, monkeypatch):
    """After graphed steps, under inference mode too (where ReservedCache records each view's buffer
    and writes), a key view saves and loads as the plain tensor it is (torch.save): the record is
    not the view's attribute, which took the buffer and the step kept on it along (the step holds
    local functions: saving raised)."""
    import io

    from transformers import AutoModelForCausalLM

    from hf_dilated import ReservedCache
    from hf_dilated.ops import sparse_far_reserved

    monkeypatch.setattr(sparse_far_reserved, "GRAPHED_ON", ("cuda", "cpu"))
    model = AutoModelForCausalLM.from_pretrained(_tiny("llama", tmp_path, dict(ENTRY, far_block_size=4)),
                                                 attn_implementation="dilated", dtype=torch.float64).eval()
    ids = torch.randint(3, 99, (1, 20), generator=torch.Generator().manual_seed(4))
    for mode in (torch.no_grad, torch.inference_mode):
        cache = ReservedCache(config=model.config)
        with mode():
            model.generate(ids, max_new_tokens=4, do_sample=False, cache=cache)
        keys = cache.layers[0].keys
        buffer = sparse_far_reserved._buffer_of(keys)[0]
        assert getattr(buffer, sparse_far_reserved._STEP_ATTRIBUTE, None) is not None, mode  # steps were graphed
        saved = io.BytesIO()
        torch.save(keys, saved)
        saved.seek(0)
        loaded = torch.load(saved)
        assert torch.equal(loaded, keys) and not vars(loaded), mode


@pytest.mark.parametrize("first_mode", [torch.no_grad, torch.inference_mode], ids=("no_grad", "inference_mode_first"))
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_graphed_steps_after_a_crop_and_refill_match_reference(monkeypatch, device, first_mode):
    """Steps on one buffer (views of its filled start, as hf_dilated.ReservedCache hands them),
    then a crop and a refill with other keys, then steps again: each equals the reference of the
    sequence the buffer then holds (the step summarises the buffer again when it is not the last
    step's plus one token). On CUDA the step is a captured CUDA graph, replayed (float64 there too);
    on the CPU the same function of the same fixed inputs, called. The room past the written slots
    holds NaN: no step reads it. The first steps may run under torch.inference_mode and the later
    ones outside it (the step made inside it held inference tensors, which the later steps could
    not write: they raised)."""
    from hf_dilated.kinds import KINDS
    from hf_dilated.ops import sparse_far_reserved

    monkeypatch.setattr(sparse_far_reserved, "GRAPHED_ON", ("cuda", "cpu"))
    s = _decode_settings()
    g = torch.Generator().manual_seed(12)
    batch, heads, kv_heads, n, dim = 1, 4, 2, 70, 8
    q, k, v = (torch.randn(batch, h, n, dim, generator=g, dtype=torch.float64) for h in (heads, kv_heads, kv_heads))
    k2, v2 = (torch.randn(batch, kv_heads, n, dim, generator=g, dtype=torch.float64) for _ in range(2))
    inv_freq = 1.0 / (100.0 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    kb, vb = (torch.full((batch, kv_heads, 96, dim), float("nan"), dtype=torch.float64, device=device) for _ in "kv")
    kw = dict(is_causal=True, attention_mask=None, position_ids=None, scale=None, dropout_p=0.0, group=None,
              layout=None, rope_frequencies=inv_freq)  # (on the host: the step moves them once, not per capture)
    state = {}

    def steps(keys, values, lo, hi, mode=torch.no_grad):
        ref = _decode_reference(q[:, :, :hi], keys[:, :, :hi], values[:, :, :hi], s, inv_freq)
        kb[:, :, :lo].copy_(keys[:, :, :lo])
        vb[:, :, :lo].copy_(values[:, :, :lo])
        kb[:, :, lo:], vb[:, :, lo:] = float("nan"), float("nan")
        for t in range(lo, hi):
            kb[:, :, t:t + 1].copy_(keys[:, :, t:t + 1])
            vb[:, :, t:t + 1].copy_(values[:, :, t:t + 1])
            with mode():
                out = KINDS["dilated"].run(q[:, :, t:t + 1].to(device), kb[:, :, :t + 1], vb[:, :, :t + 1], s,
                                           state=state, **kw)
            assert (out.cpu() - ref[:, :, t:t + 1]).abs().max().item() < TOL, t

    steps(k, v, 40, 60, first_mode)
    runner = getattr(kb, sparse_far_reserved._STEP_ATTRIBUTE)  # the graphed form ran
    assert (runner.graph is not None) == (device == "cuda")
    k2[:, :, :30], v2[:, :, :30] = k[:, :, :30], v[:, :, :30]
    steps(k2, v2, 50, 70)  # cropped to 30, refilled to 50 with other keys, then steps


def test_graphed_step_goes_with_its_buffer_and_beam_search_keeps_it(tmp_path, monkeypatch):
    """The step kept on a cache buffer holds nothing that refers back to it: it is freed with the
    buffer, without a garbage collection (on a GPU it holds a CUDA graph and its memory). Beam
    search reorders ReservedCache in place, so its steps keep one buffer and one step per layer
    (they made a new buffer, and captured a new graph, every step), and pick the tokens of
    beam search with a DynamicCache (the eager path)."""
    import gc
    import weakref

    from transformers import AutoModelForCausalLM

    from hf_dilated import ReservedCache
    from hf_dilated.ops import sparse_far_reserved

    monkeypatch.setattr(sparse_far_reserved, "GRAPHED_ON", ("cuda", "cpu"))
    made = []
    real_init = sparse_far_reserved.ReservedStep.__init__
    monkeypatch.setattr(sparse_far_reserved.ReservedStep, "__init__",
                        lambda self, *a, **kw: made.append(weakref.ref(self)) or real_init(self, *a, **kw))
    entry = dict(ENTRY, far_block_size=4)
    model = AutoModelForCausalLM.from_pretrained(_tiny("llama", tmp_path, entry), attn_implementation="dilated",
                                                 dtype=torch.float64).eval()
    ids = torch.randint(3, 99, (1, 20), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ours = model.generate(ids, max_new_tokens=8, do_sample=False, num_beams=2, cache=ReservedCache(config=model.config))
        monkeypatch.setattr(sparse_far_reserved, "GRAPHED_ON", ("cuda",))
        theirs = model.generate(ids, max_new_tokens=8, do_sample=False, num_beams=2)
    assert torch.equal(ours, theirs)
    assert len(made) == model.config.num_hidden_layers  # one step per layer for the whole generation
    monkeypatch.setattr(sparse_far_reserved, "GRAPHED_ON", ("cuda", "cpu"))
    gc.disable()
    try:
        cache = ReservedCache(config=model.config)
        with torch.no_grad():
            model.generate(ids, max_new_tokens=3, do_sample=False, cache=cache)
        step = made[-1]
        assert step() is not None
        del cache
        assert step() is None  # freed with its buffer, by reference counting alone
    finally:
        gc.enable()


@pytest.fixture
def compiled_steps(monkeypatch):
    """The compiled step of a concatenating cache (sparse_far_concatenated.concatenated_step) taken on the
    CPU too (COMPILED_ON widened), compiled by aot_eager (dynamo's graph, run as aten ops: the
    inductor build of the GPU is left to a test of its own); returns dynamo's frame counter."""
    import torch._dynamo.testing as dynamo_testing

    from hf_dilated.ops import sparse_far_concatenated

    counter = dynamo_testing.CompileCounterWithBackend("aot_eager")
    monkeypatch.setattr(sparse_far_concatenated, "COMPILED_ON", ("cuda", "cpu"))
    monkeypatch.setattr(sparse_far_concatenated, "BACKEND", counter)
    monkeypatch.setattr(sparse_far_concatenated, "_COMPILED", {})
    monkeypatch.setattr(sparse_far_concatenated, "_COMPILE_FAILED", None)
    torch._dynamo.reset()
    yield counter
    torch._dynamo.reset()


@pytest.mark.parametrize("layout", ("plain", "left", "offset"))
@pytest.mark.parametrize("over", ({}, {"far_group": 1, "far_window": None}, {"far_top_k": 0, "far_sinks": 2}),
                         ids=("grouped", "own_positions", "sinks"))
def test_compiled_steps_on_a_concatenating_cache_match_reference(layout, over, compiled_steps):
    """Steps against a cache that concatenates into a new tensor each step (DynamicCache), the GPU's
    form (summaries made again in each compiled step, no state to check): each equals the reference
    of the whole sequence, after a crop and refill with other keys too, and one graph serves every
    length (no recompile per step). Positions other than the mask ranks (offset) take the eager path,
    exact as well."""
    from hf_dilated.kinds import KINDS

    s = _decode_settings(**over)
    g = torch.Generator().manual_seed(17)
    batch, heads, kv_heads, n, dim = 2, 4, 2, 70, 8
    q, k, v = (torch.randn(batch, h, n, dim, generator=g, dtype=torch.float64) for h in (heads, kv_heads, kv_heads))
    k2, v2 = (torch.randn(batch, kv_heads, n, dim, generator=g, dtype=torch.float64) for _ in range(2))
    k2[:, :, :30], v2[:, :, :30] = k[:, :, :30], v[:, :, :30]
    inv_freq = 1.0 / (100.0 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    mask = pos = None
    if layout == "left":
        mask = torch.ones(batch, n, dtype=torch.long)
        mask[1, :9] = 0
    if layout == "offset":
        pos = torch.arange(n)[None].expand(batch, n) + torch.tensor([[3], [0]])
    state = {}
    for keys_all, values_all, lo, hi in ((k, v, 40, 60), (k2, v2, 50, 70)):  # the second: cropped to 30, refilled
        ref = _decode_reference(q[:, :, :hi], keys_all[:, :, :hi], values_all[:, :, :hi], s, inv_freq,
                                None if mask is None else mask[:, :hi], None if pos is None else pos[:, :hi])
        cache = _ConcatCache(keys_all, values_all, lo)
        for t in range(lo, hi):
            keys, values = cache.append(keys_all[:, :, t:t + 1], values_all[:, :, t:t + 1])
            kw = dict(is_causal=True, attention_mask=None if mask is None else mask[:, :t + 1],
                      position_ids=None if pos is None else pos[:, :t + 1], scale=None, dropout_p=0.0, group=None,
                      layout=None, rope_frequencies=inv_freq)
            with torch.no_grad():
                out = KINDS["dilated"].run(q[:, :, t:t + 1], keys, values, s, state=state, **kw)
            assert (out - ref[:, :, t:t + 1]).abs().max().item() < TOL, t
    if layout == "offset":
        assert compiled_steps.frame_count == 0 and "far_summaries" in state
    else:
        assert compiled_steps.frame_count == 1 and "far_summaries" not in state  # 40 lengths, one graph


@pytest.mark.parametrize("tie_slots", (8, 20), ids=("tie_slots_8", "tie_slots_20"))
def test_compiled_steps_on_a_concatenating_cache_keep_one_graph_from_the_first_block(compiled_steps, tie_slots,
                                                                                     monkeypatch):
    """A cache growing from 2 tokens to more blocks than top_k + the tie slots (where a compiled
    step's Python decisions on the block count would change): every step equals the reference,
    all of them with one graph (the summaries carry spare empty blocks, as many as the tie slots
    that sparse_far_static.kept_step reads: with 20 of them, the spare count followed a copy of 8
    and the growing cache made a second graph)."""
    from hf_dilated.ops import sparse_far_static

    monkeypatch.setattr(sparse_far_static, "TIE_SLOTS", tie_slots)

    # blocks of 4: 1 block at first, 18 at the end (3 + 8 tie slots + 1 sink)
    _concatenating_steps(_decode_settings(far_top_k=3), seed=23, n=70, filled=2)
    assert compiled_steps.frame_count == 1


def _concatenating_steps(s, *, seed: int, n: int, filled: int, after_step=None):
    """One-query steps of KINDS["dilated"] (4 query / 2 kv heads of 8, float64) on a cache that
    concatenates, from `filled` tokens to n, each against the whole sequence's reference;
    after_step(inv_freq) after each. Returns the frequencies."""
    from hf_dilated.kinds import KINDS

    g = torch.Generator().manual_seed(seed)
    heads, kv_heads, dim = 4, 2, 8
    q, k, v = (torch.randn(1, h, n, dim, generator=g, dtype=torch.float64) for h in (heads, kv_heads, kv_heads))
    inv_freq = 1.0 / (100.0 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    ref = _decode_reference(q, k, v, s, inv_freq)
    cache, state = _ConcatCache(k, v, filled), {}
    kw = dict(is_causal=True, attention_mask=None, position_ids=None, scale=None, dropout_p=0.0, group=None,
              layout=None, rope_frequencies=inv_freq)
    for t in range(filled, n):
        keys, values = cache.append(k[:, :, t:t + 1], v[:, :, t:t + 1])
        with torch.no_grad():
            out = KINDS["dilated"].run(q[:, :, t:t + 1], keys, values, s, state=state, **kw)
        assert (out - ref[:, :, t:t + 1]).abs().max().item() < TOL, t
        if after_step is not None:
            after_step(inv_freq)
    return inv_freq


def test_compiled_steps_on_a_concatenating_cache_read_the_keys_turns_from_a_table(compiled_steps):
    """The compiled step turns every key of the cache to its grouped far position each step (its
    summaries are made again from the whole cache). It reads the turns by rank from a table kept
    between steps (rope.far_turn_table), made again only when the cache outgrows it, and the chosen
    blocks' keys from the same table: the step's only cos and sin are the query's own turn (a float64
    cos and sin per key and head took 0.48 ms a layer at 16K on an H200; per chosen key and head,
    inductor's C++ build of the step spent most of its 0.53 ms a layer on them at 600 tokens), one
    graph across the table's growth, every step equal to the reference."""
    from hf_dilated.ops import sparse_far_concatenated

    s = _decode_settings()
    tables = set()

    def table_length(inv_freq):
        held = sparse_far_concatenated._TURNS.get(inv_freq)
        tables.add(None if held is None else held[(s["far_group"], torch.float64)][1][0].shape[0])

    # the table: 128 ranks, then 256 (blocks of 4, 14 spare)
    _concatenating_steps(s, seed=41, n=160, filled=40, after_step=table_length)
    trig = [node.meta["example_value"].shape for gm in compiled_steps.graphs for node in gm.graph.nodes
            if node.op in ("call_method", "call_function") and getattr(node.target, "__name__", node.target) in
            ("cos", "sin")]
    assert trig and all(shape.numel() == 8 // 2 for shape in trig), trig  # (one query of heads of 8)
    assert tables == {128, 256} and compiled_steps.frame_count == 1


def test_a_model_under_inference_mode_keeps_its_turn_table_between_steps(compiled_steps, monkeypatch):
    """A model's far-key frequencies (integrations: rope_frequencies_for) are made outside inference
    mode, so that they keep a version counter: the compiled DynamicCache step keeps its turn table by
    it. Made under inference mode (a model first called there: generate() under torch.inference_mode),
    they had none, and every step of every layer made its table again (a review, 2026-11-27). Here a
    tiny Llama of the default conversion under inference mode, prefill and five steps: one table."""
    from transformers import DynamicCache

    from conftest import tiny_default_llama
    from hf_dilated.bench.gpu_table import _cache_arg
    from hf_dilated.ops import sparse_far_concatenated

    made = []
    real = sparse_far_concatenated.far_turn_table
    monkeypatch.setattr(sparse_far_concatenated, "far_turn_table", lambda *a: made.append(a[0]) or real(*a))
    n = 300
    model, config, ids = tiny_default_llama(n, 128)
    arg = {_cache_arg(model): DynamicCache(config=config)}
    with torch.inference_mode():
        model(input_ids=ids[:, :-5], **arg)
        for t in range(5):
            model(input_ids=ids[:, n - 5 + t:n - 4 + t], **arg)
    assert compiled_steps.frame_count == 1 and len(made) == 1, made


def test_far_turns_are_rotate_by_and_kept_while_their_frequencies_stay():
    """sparse_far_concatenated.far_turns: rope.rotate_by's turns to the grouped far positions, read by
    position; one table per frequency tensor (a model's layers share it), kept while it is long
    enough and the frequencies unwritten; made again past its length (to a power of two) and after
    a write in place; made afresh each call for frequencies with no version counter (inference mode)."""
    from hf_dilated.ops import sparse_far_concatenated as concatenated
    from hf_dilated.ops.rope import rotate_by, rotate_with

    dim, group = 16, 4
    freq = 1.0 / (100.0 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    x = torch.randn(2, 3, 100, dim, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    cos, sin = table = concatenated.far_turns(100, group, freq, torch.float64)
    assert cos.shape == (128, dim // 2)
    ranks = torch.arange(100)[None].expand(2, -1)
    assert torch.equal(rotate_with(x, cos[:100], sin[:100]), rotate_by(x, ranks // group - ranks, freq))
    assert concatenated.far_turns(120, group, freq, torch.float64) is table  # another layer, a longer cache
    assert concatenated.far_turns(200, group, freq, torch.float64)[0].shape[0] == 256
    freq.mul_(2)  # written in place: made again, with the new frequencies
    cos2, sin2 = concatenated.far_turns(100, group, freq, torch.float64)
    assert torch.equal(rotate_with(x, cos2[:100], sin2[:100]), rotate_by(x, ranks // group - ranks, freq))
    with torch.inference_mode():
        frozen = freq.clone()
        first = concatenated.far_turns(100, group, frozen, torch.float64)
        frozen.mul_(3)  # no version counter to see this by: each call makes its table
        again = concatenated.far_turns(100, group, frozen, torch.float64)
    assert again is not first
    assert torch.equal(rotate_with(x, again[0][:100], again[1][:100]), rotate_by(x, ranks // group - ranks, freq * 3))


def test_compiled_step_waits_for_far_keys(compiled_steps):
    """A converted model used within its original context (no query past local_window: no far key)
    compiles nothing (tens of seconds on a GPU, for no far key): its steps take the eager path,
    which reads the band alone; the first step with a far key compiles."""
    from hf_dilated.ops import sparse_far_concatenated

    g = torch.Generator().manual_seed(37)
    settings = dict(local_window=16, far_band=8, selection=FarSelection(2, 4, 1), scale=0.3, rotation=None)
    q = torch.randn(2, 4, 1, 8, generator=g)
    k, v = (torch.randn(2, 2, 19, 8, generator=g) for _ in "kv")
    with torch.no_grad():  # row 1 starts at slot 3: its last token at position 15, row 0's at 18
        assert sparse_far_concatenated.concatenated_step(q, k[:, :, 3:].clone(), v[:, :, 3:].clone(), first=[0, 0],
                                                   shift=[0, 0], state={}, **settings) is None  # positions 0..15
        assert sparse_far_concatenated.concatenated_step(q, k.clone(), v.clone(), first=[0, 3], shift=[0, -3], state={},
                                                   **settings) is not None  # row 0 at 18: far keys
    assert compiled_steps.frame_count == 1


def test_compiled_steps_on_a_concatenating_cache_stay_compiled_across_settings_and_modes(compiled_steps):
    """Each layer's settings compile apart (dynamo's recompile limit counts per code object: shared,
    the settings of a few layers, or their dtypes and batch sizes, ran out of it and turned the
    compiled steps off for the process), and a step under inference mode, then one outside it,
    both stay compiled (the kept tie counter is a normal tensor)."""
    from hf_dilated.ops import sparse_far_concatenated

    g = torch.Generator().manual_seed(29)
    q = torch.randn(1, 4, 1, 8, generator=g)
    k, v = (torch.randn(1, 2, 60, 8, generator=g) for _ in "kv")
    with torch._dynamo.config.patch(recompile_limit=1), torch.no_grad():
        for top_k in (1, 2, 3):  # three settings, one graph each, under a limit of one graph per code object
            out = sparse_far_concatenated.concatenated_step(q, k, v, local_window=16, far_band=8,
                                                      selection=FarSelection(top_k, 4, 1), scale=0.3, first=[0],
                                                      shift=[0], rotation=None, state={})
            assert out is not None
    assert compiled_steps.frame_count == 3 and sparse_far_concatenated._COMPILE_FAILED is None
    state = {}
    settings = dict(local_window=16, far_band=8, selection=FarSelection(2, 4, 1), scale=0.3, first=[0], shift=[0],
                    rotation=None, state=state)
    with torch.inference_mode():
        assert sparse_far_concatenated.concatenated_step(q, k, v, **settings) is not None
    with torch.no_grad():
        assert sparse_far_concatenated.concatenated_step(q, k, v, **settings) is not None
    assert sparse_far_concatenated._COMPILE_FAILED is None


def test_generation_with_a_dynamic_cache_takes_the_compiled_step_and_matches_reference(tmp_path, compiled_steps):
    """generate() with transformers' DynamicCache on a left-padded batch, the GPU's form of its
    steps (compiled, summaries made in the step): the reference's tokens, row by row, and one
    graph for every step of every layer."""
    ours = _left_padded_generation_matches_reference("llama", tmp_path, 3, lambda model: {})  # its DynamicCache
    assert compiled_steps.frame_count == 1
    assert all("concatenated" in layer.self_attn.__dict__["_hf_dilated_state"] for layer in ours.model.layers)


@pytest.mark.cuda
@pytest.mark.slow
def test_cuda_compiled_steps_on_a_concatenating_cache_match_reference(monkeypatch):
    """On CUDA, as it runs there: steps against a DynamicCache-like cache (a new tensor each step),
    left-padded, compiled by inductor (Triton), float64: each equals the float64 reference, and no
    step fell back to the eager path (nothing failed to compile)."""
    import warnings

    from hf_dilated.kinds import KINDS
    from hf_dilated.ops import sparse_far_concatenated

    monkeypatch.setattr(sparse_far_concatenated, "_COMPILED", {})
    monkeypatch.setattr(sparse_far_concatenated, "_COMPILE_FAILED", None)
    s = _decode_settings()
    q, k, v, inv_freq, mask, ref = _left_padded_case(s, seed=19)
    n = k.shape[2]
    cache = _ConcatCache(k.cuda(), v.cuda(), 40)
    state = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a fallback warns
        for t in range(40, n - 1):
            keys, values = cache.append(k[:, :, t:t + 1].cuda(), v[:, :, t:t + 1].cuda())
            kw = dict(is_causal=True, attention_mask=mask[:, :t + 1].cuda(), position_ids=None, scale=None,
                      dropout_p=0.0, group=None, layout=None, rope_frequencies=inv_freq.cuda())
            with torch.no_grad():
                out = KINDS["dilated"].run(q[:, :, t:t + 1].cuda(), keys, values, s, state=state, **kw)
            assert (out.cpu() - ref[:, :, t:t + 1]).abs().max().item() < TOL, t
    assert "concatenated" in state and "far_summaries" not in state


@pytest.mark.parametrize("chunk_slots", (1 << 14, 8), ids=("one_pass", "chunks_of_2_blocks"))
def test_summaries_made_in_a_step_equal_the_kept_ones(chunk_slots, monkeypatch):
    """summarise_rows (the compiled step's summaries: a gather by rank, in chunks when uncompiled)
    equals `build` (the kept summaries' scatter by mask rank) on a left-padded cache, rotation to
    grouped positions included (by the step's table of turns); its spare blocks are empty."""
    from hf_dilated.ops import rope, sparse_far_concatenated, sparse_far_static

    monkeypatch.setattr(sparse_far_concatenated, "BUILD_SLOTS", chunk_slots)
    g = torch.Generator().manual_seed(31)
    k = torch.randn(3, 2, 45, 8, generator=g, dtype=torch.float64)
    first = torch.tensor([0, 5, 44])
    inv_freq = 1.0 / (100.0 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8))
    rotation = (8, 2, inv_freq)
    real = torch.arange(45)[None] >= first[:, None]
    kept = sparse_far_static.KeptSummaries(k, 4, sparse_far_static.settings_of(4, rotation))
    sparse_far_static.build(kept, k, real, torch.tensor(45), 4, rotation)
    turns = rope.far_turn_table(sparse_far_concatenated.summarised_slots(45, 4, 3), 2, inv_freq, k.dtype, k.device)
    mn, mx = sparse_far_concatenated.summarise_rows(k, first, 4, turns, kept.mn.dtype, spare=3)
    blocks = kept.mn.shape[2] - 1
    torch.testing.assert_close(mn[:, :, :blocks], kept.mn[:, :, :blocks], rtol=0, atol=1e-12)
    torch.testing.assert_close(mx[:, :, :blocks], kept.mx[:, :, :blocks], rtol=0, atol=1e-12)
    assert mn.shape[2] == blocks + 3 + 1 and bool((mn[:, :, blocks:] == float("inf")).all())
    assert bool((mx[:, :, blocks:] == float("-inf")).all())


def test_compiled_step_on_a_concatenating_cache_builds_with_inductor():
    """The GPU's form compiled as the GPU compiles it (inductor; C++ here, Triton there): it builds,
    and matches the eager path's kernel (sparse_far_decode, tested against the reference above) in
    float32, with the cache's length dynamic (one graph for two lengths)."""
    import torch._dynamo.testing as dynamo_testing

    from hf_dilated.ops import sparse_far_concatenated
    from hf_dilated.ops.sparse_far_decode import sparse_far_decode

    counter = dynamo_testing.CompileCounterWithBackend("inductor")
    g = torch.Generator().manual_seed(5)
    selection, dim = FarSelection(2, 8, 1), 16
    inv_freq = 1.0 / (100.0 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    settings = dict(local_window=32, far_band=16, selection=selection, scale=0.25, first=[0, 3], shift=[0, -3],
                    rotation=(8, 2, inv_freq))
    torch._dynamo.reset()
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(sparse_far_concatenated, "BACKEND", counter)
            mp.setattr(sparse_far_concatenated, "_COMPILED", {})
            for n in (150, 151):
                q = torch.randn(2, 4, 1, dim, generator=g)
                k, v = (torch.randn(2, 2, n, dim, generator=g) for _ in "kv")
                with torch.no_grad():
                    out = sparse_far_concatenated.concatenated_step(q, k, v, state={}, **settings)
                    want = sparse_far_decode(q, k, v, **settings)
                torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    finally:
        torch._dynamo.reset()
    assert counter.frame_count == 1


def test_inference_path_takes_strided_inputs():
    """q, k, v as transformers hands them (views of (batch, n, heads, d) projections, transposed):
    the plain path reads them without a flat view (a bug found by the eval's pair count)."""
    case = replace(BASE, layout="plain", kv_len=50)
    q, k, v, _, _, _ = make_inputs(case, torch.float64)
    q, k, v = (t.detach().transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    assert not k.is_contiguous()
    kernel, ref_kw = sparse((8, 2, 4, 1))
    with torch.no_grad():
        out = dilated_attention(q, k, v, [64], [1], local_window=16, **kernel)
    assert (out - local_band_reference(q, k, v, [64], [1], 16, **ref_kw)).abs().max().item() < TOL


@pytest.mark.parametrize("sliding_window", (5, 13, 30))
@pytest.mark.parametrize("layout", ("plain", "left", "packed"))
def test_sliding_window_on_top_of_sparse_far_keys_matches_reference(layout, sliding_window):
    """A model's sliding window (docs/contract.md 3.3) hides keys from the band and from the far
    blocks alike; the candidates are the blocks holding a far key the window leaves visible."""
    case = replace(BASE, layout=layout, seed=30)
    q, k, v, mask, pos, real_query = make_inputs(case, torch.float64)
    far = far_inputs(q, k, 31)
    kernel, ref_kw = sparse((8, 2, 4, 1))
    out = dilated_attention(
        q, k, v, [64], [1], local_window=WINDOW, q_far=far[0], k_far=far[1], attention_mask=mask, position_ids=pos,
        sliding_window=sliding_window, **kernel)
    ref = local_band_reference(q, k, v, [64], [1], WINDOW, q_far=far[0], k_far=far[1], attention_mask=mask,
                               position_ids=pos, sliding_window=sliding_window, **ref_kw)
    assert ((out - ref) * real_query[:, None, :, None]).abs().max().item() < TOL


@pytest.mark.parametrize("size,group", ((64, 8), (4, 2), (6, 3), (8, 8)))
def test_block_and_offset_turns_score_as_rotating_each_key(size, group):
    """The decode's move of whole blocks to their grouped positions, each key turned by its offset's
    angle and the query back by its block's, scores as rotate_by with each key's own move
    p // group - p (partial rotary included)."""
    from hf_dilated.ops.rope import block_turns, offset_turns, rotate_by, rotate_with

    g = torch.Generator().manual_seed(5)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 6, 2, dtype=torch.float64) / 6))  # 6 of 8 dims rotate
    blocks = torch.tensor([[0, 3, 15_000], [7, 1, 2]])  # (heads, blocks), one far into a long context
    keys = torch.randn(2, 3 * size, 8, generator=g, dtype=torch.float64)
    q = torch.randn(2, 8, generator=g, dtype=torch.float64)
    positions = (blocks[..., None] * size + torch.arange(size)).flatten(1)  # (heads, 3 * size)
    expected = (q[:, None, :] * rotate_by(keys[:, None], positions // group - positions, inv_freq)[:, 0]).sum(-1)
    turned = rotate_with(keys.unflatten(1, (3, size)), *offset_turns(size, group, inv_freq, "cpu"))
    cos, sin = block_turns(blocks, size, group, inv_freq, torch.float64)
    q_blocks = rotate_with(q[:, None, :].expand(-1, 3, -1), cos, -sin)  # (heads, blocks, d)
    scores = (q_blocks[:, :, None, :] * turned).sum(-1).flatten(1)
    assert (scores - expected).abs().max().item() < 1e-9
    with pytest.raises(ValueError, match="must divide the block size"):
        block_turns(blocks, 6, 4, inv_freq, torch.float64)


# The FlexAttention far path (ops/sparse_far_flex.py: the CUDA default), run eagerly here: the
# same BlockMask and mask_mod the compiled kernel gets. Rows of 300 keys span three 128-key tiles,
# one partial; block sizes below, dividing and above the tile.
FLEX_SETTINGS = [(None, 2, 4, 1), (24, 3, 16, 1), (40, 2, 48, 2), (32, 1, 200, 0), (20, 0, 8, 1), (16, 50, 32, 1)]


@pytest.mark.parametrize("setting", FLEX_SETTINGS, ids=lambda s: "band{}_k{}_B{}_s{}".format(*s))
@pytest.mark.parametrize("heads", ((4, 2), (2, 2)), ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("chunked", (False, True), ids=("one_call", "calls_of_128"))
def test_flex_far_path_matches_reference_and_counts_its_pairs(setting, heads, chunked, monkeypatch):
    check_flex_far_path(setting, heads, chunked, "by_block", monkeypatch)


@pytest.mark.parametrize("setting", FLEX_SETTINGS[:4], ids=lambda s: "band{}_k{}_B{}_s{}".format(*s))
def test_flex_far_path_by_query_matches_reference_and_counts_its_pairs(setting, monkeypatch):
    check_flex_far_path(setting, (4, 2), True, "by_query", monkeypatch)


@pytest.mark.parametrize("setting", FLEX_SETTINGS, ids=lambda s: "band{}_k{}_B{}_s{}".format(*s))
@pytest.mark.parametrize("merge, picks", (("reduce", "maxima"), ("by_slot", "sort")),
                         ids=("merged_by_reduction", "picked_by_sort"))
def test_flex_far_path_other_merge_and_picks_match_reference_and_count_their_pairs(setting, merge, picks,
                                                                                    monkeypatch):
    check_flex_far_path(setting, (4, 2), True, "by_block", monkeypatch, merge=merge, picks=picks)


@pytest.mark.parametrize("layout", ("by_block", "by_query"))
def test_flex_far_path_without_far_slots_reads_the_band_and_returns_the_models_layout(layout, monkeypatch):
    """far_top_k = 0 and far_sinks = 0: past the window each query reads its band alone (each chunk's
    band merged with nothing), as the reference does; and the output lies in memory as transformers'
    attention interface returns it, (batch, n, heads, d), so that its transpose there copies nothing."""
    check_flex_far_path((24, 0, 16, 0), (4, 2), True, layout, monkeypatch)


@pytest.mark.parametrize("name, value", (("MERGE", "byslot"), ("PICKS", "topk"), ("LAYOUT", "by_row")))
def test_flex_far_path_refuses_an_unknown_choice(name, value, monkeypatch):
    """A LAYOUT, MERGE or PICKS outside its values is an error naming it (MERGE's other values ran
    the slot-by-slot sum, unsaid)."""
    from hf_dilated.ops import sparse_far_flex, sparse_far_plain

    monkeypatch.setattr(sparse_far_flex, name, value)
    q = torch.randn(1, 2, 300, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match=f"sparse_far_flex.{name}: '{value}' is not one of"):
        sparse_far_plain.sparse_far_forward(q, q, q, q, q, 64, None, FarSelection(2, 16, 1), 0.3, far_kernel="flex")


def check_flex_far_path(setting, heads, chunked, layout, monkeypatch, merge="by_slot", picks="maxima"):
    from hf_dilated.ops import sparse_far_flex, sparse_far_plain

    monkeypatch.setattr(sparse_far_flex, "LAYOUT", layout)
    monkeypatch.setattr(sparse_far_flex, "MERGE", merge)
    monkeypatch.setattr(sparse_far_flex, "PICKS", picks)
    if chunked:
        monkeypatch.setattr(sparse_far_flex, "_BOUND_ELEMENTS", 1)  # 128 queries per call
    window = 64
    case = replace(BASE, layout="plain", kv_len=300, q_heads=heads[0], kv_heads=heads[1], batch=2)
    q, k, v, _, _, _ = make_inputs(case, torch.float64)
    q, k, v = q.detach(), k.detach(), v.detach()
    q_far, k_far = (t.detach() for t in far_inputs(q, k, 5))
    kernel, ref_kw = sparse(setting)
    scale = q.shape[-1] ** -0.5
    with pair_count.counting() as tally:
        out = sparse_far_plain.sparse_far_forward(q, k, v, q_far, k_far, window, setting[0], kernel["far_selection"],
                                                  scale, far_kernel="flex")
    ref = local_band_reference(q, k, v, [512], [1], window, q_far=q_far, k_far=k_far, **ref_kw)
    near, far_read = local_band_key_sets(q, k, [512], [1], window, q_far=q_far, k_far=k_far, **ref_kw)
    assert (out - ref).abs().max().item() < TOL
    assert tally.pairs == int((near | far_read).sum())
    assert out.transpose(1, 2).is_contiguous()


@pytest.mark.parametrize("layout", ("by_query", "by_block"))
@pytest.mark.parametrize("block_size", (16, 32, 64, 128, 48, 200))
def test_flex_block_mask_lists_every_tile_its_mask_reads(block_size, layout, monkeypatch):
    """FlexAttention computes only the tiles its BlockMask lists, and every pair of a full tile
    without its mask_mod (the eager form used above applies the mask_mod alone, so this is checked
    here): what the kernel reads (the mask_mod's pairs in the partial tiles, every pair of the full
    ones) is exactly the chosen pairs, and with small blocks most tiles are not listed (by block, a
    few: a tile of rows holds one block or neighbours). By block with blocks of 32, 64 or 128, a key
    tile is a block, and a tile of rows of one block that all read the whole of it is full. Leaving out the selected tiles fails this test, and so
    does a tile of rows of one block called full where a row stops inside it."""
    from torch.nn.attention.flex_attention import create_mask

    from hf_dilated.ops import far_selection, sparse_far_flex

    case = replace(BASE, layout="plain", kv_len=700, q_heads=4, kv_heads=2, batch=2)
    q, k, _, _, _, _ = make_inputs(case, torch.float64)
    q_far, k_far = (t.detach() for t in far_inputs(q, k, 6))
    n, selection, s, band = 700, FarSelection(2, block_size, 1), 300, 64
    operands = far_selection.bound_operands(*far_selection.plain_summaries(k_far, block_size, -(-768 // block_size)), 2)
    chosen = far_selection.plain_choice(q_far[:, :, s:], None, None, s, band, selection, operands)
    last = torch.arange(s, n) - band

    def tiles_of(block_mask, count, indices, rows):
        q_tile, k_tile = block_mask.BLOCK_SIZE
        dense = sparse_far_flex._flex.BlockMask.from_kv_blocks(count, indices, BLOCK_SIZE=(q_tile, k_tile)).to_dense()
        return dense.bool().repeat_interleave(q_tile, 2).repeat_interleave(k_tile, 3)[:, :, :rows, :n]

    def listed_and_read():
        if layout == "by_query":
            block_mask, heads = sparse_far_flex.by_query_mask(chosen, last, n, block_size), 4
        else:
            _, *plan, _, tied_lists = sparse_far_flex.by_block_plan(q_far[:, :, s:], *operands, last, 2, 1, block_size, n)
            assert not tied_lists[0].any()
            block_mask, heads = sparse_far_flex.by_block_mask(*plan, block_size, n), 2
        rows = block_mask.seq_lengths[0]
        allowed = create_mask(block_mask.mask_mod, 2, heads, rows, n, device="cpu")  # (b, h, rows, k)
        partial = tiles_of(block_mask, block_mask.kv_num_blocks, block_mask.kv_indices, rows)
        full = torch.zeros_like(partial)
        if block_mask.full_kv_num_blocks is not None:
            full = tiles_of(block_mask, block_mask.full_kv_num_blocks, block_mask.full_kv_indices, rows)
        assert not (partial & full).any()
        return partial, full, allowed

    partial, full, allowed = listed_and_read()
    assert allowed.any() and torch.equal((partial & allowed) | full, allowed)
    assert int(allowed.sum()) == sparse_far_flex.pairs_read(chosen, s, band, block_size)
    if block_size < 128:  # 3 blocks of 200 cover most of 700 keys
        assert (partial | full).float().mean() < (0.8 if layout == "by_query" else 0.3)
    if layout == "by_block" and block_size in (32, 64):
        assert full.any()
    if layout == "by_query":
        listed = sparse_far_flex.listed_tiles
        monkeypatch.setattr(sparse_far_flex, "listed_tiles", lambda *a: torch.zeros_like(listed(*a)))
        partial, full, allowed = listed_and_read()
        assert (allowed & ~(partial | full)).any()


def test_flex_kernel_tile_divides_the_block_masks_on_cuda():
    """A by-block BlockMask of blocks of 32, 64 or 128 has key tiles of that block; on CUDA the
    compiled kernel is told a key tile that divides them where they are under 128 (its own choice,
    128 for bfloat16 with head_dim 64 on an H100, does not divide 64: torch raises), never larger
    than its own. 128-key tiles, and every call off CUDA, keep the kernel's defaults."""
    from hf_dilated.ops import sparse_far_flex

    rows = torch.zeros(1, 1, 128, dtype=torch.long)
    count, indices = torch.zeros(1, 1, 1, dtype=torch.int32), torch.zeros(1, 1, 1, 8, dtype=torch.int32)
    masks = {size: sparse_far_flex.by_block_mask(rows, rows, count, indices, None if size == 16 else count, size, 512)
             for size in (16, 32, 64, 128)}
    assert [masks[size].BLOCK_SIZE for size in (16, 32, 64, 128)] == [(128, 128), (128, 32), (128, 64), (128, 128)]
    cuda, cpu = torch.device("cuda"), torch.device("cpu")

    def key_tile(dtype, head_dim, size, device=cuda):
        return sparse_far_flex.kernel_options(device, dtype, head_dim, masks[size]).get("kernel_options", {}).get("BLOCK_N")

    # never above torch's own default for H100/A100 (16-bit: 64-128 up to head_dim 128, 32-64 past it;
    # float32: 32-64 up to 128, 16-32 past it), and dividing the block
    assert [key_tile(torch.bfloat16, d, 64) for d in (64, 128, 256)] == [64, 64, 32]
    assert [key_tile(torch.float32, d, 64) for d in (64, 128, 256)] == [32, 32, 16]
    assert key_tile(torch.float64, 64, 64) == 32 and key_tile(torch.bfloat16, 64, 32) == 32
    assert key_tile(torch.bfloat16, 64, 16) is None and key_tile(torch.bfloat16, 64, 128) is None
    assert key_tile(torch.bfloat16, 64, 64, cpu) is None


def test_flex_falls_back_to_whole_key_tiles_before_blocks(monkeypatch):
    """Where FlexAttention fails to build with key tiles of a far block (32 keys here), the chunk is
    done again with tiles of 128 keys (warned once), and the path stays on FlexAttention: the
    results stay the reference's, and later calls take 128-key tiles from the start. The plan runs
    compiled (dynamo's graphs, eagerly) and lists its tiles in the mask's key tiles each time (the
    key tile is its argument: it compiles again)."""
    from hf_dilated.ops import sparse_far_flex

    key_tiles = []
    real = sparse_far_flex._flex_call

    def picky(q, k, v, block_mask, scale, kind="by_query"):
        key_tiles.append(block_mask.BLOCK_SIZE[1])
        assert block_mask.kv_indices.shape[-1] == -(-k.shape[2] // block_mask.BLOCK_SIZE[1])  # the plan's tiles
        if block_mask.BLOCK_SIZE[1] < sparse_far_flex.TILE:
            raise ValueError("Q and KV block size must be divisible by BLOCK_M and BLOCK_N")
        return real(q, k, v, block_mask, scale, kind)

    torch._dynamo.reset()
    sparse_far_flex.compiled_for_bucket.cache_clear()
    monkeypatch.setattr(sparse_far_flex, "COMPILED_ON", ("cuda", "cpu"))
    monkeypatch.setattr(sparse_far_flex, "BACKEND", "eager")
    monkeypatch.setattr(sparse_far_flex, "_FUSED_FAILED", None)
    monkeypatch.setattr(sparse_far_flex, "_kernel", lambda device, kind, bucket: sparse_far_flex._flex.flex_attention)
    monkeypatch.setattr(sparse_far_flex, "_flex_call", picky)
    monkeypatch.setattr(sparse_far_flex, "_FAILED", None)
    monkeypatch.setattr(sparse_far_flex, "_BLOCK_TILES_FAILED", None)
    with pytest.warns(RuntimeWarning, match="key tiles of 32"):
        flex_row_matches_reference(300, FarSelection(2, 32, 1))
    assert key_tiles[0] == 32 and set(key_tiles[1:]) == {128}
    assert sparse_far_flex._FAILED is None and sparse_far_flex._BLOCK_TILES_FAILED.startswith("ValueError")
    key_tiles.clear()
    flex_row_matches_reference(300, FarSelection(2, 32, 1))
    assert set(key_tiles) == {128}
    assert sparse_far_flex._FUSED_FAILED is None  # the plan and the merge ran compiled
    torch._dynamo.reset()
    sparse_far_flex.compiled_for_bucket.cache_clear()


def test_flex_failure_of_the_ties_call_is_not_the_key_tiles(monkeypatch):
    """A failure of the ties' call by query (128-key tiles already) gives FlexAttention up (warned,
    the block-by-block path, the reference's results), without blaming the far block's key tiles."""
    from hf_dilated.ops import sparse_far_flex

    real = sparse_far_flex._flex_call

    def broken_by_query(q, k, v, block_mask, scale, kind="by_query"):
        if kind == "by_query":
            raise RuntimeError("no kernel for this call")
        return real(q, k, v, block_mask, scale, kind)

    monkeypatch.setattr(sparse_far_flex, "_flex_call", broken_by_query)
    monkeypatch.setattr(sparse_far_flex, "_FAILED", None)
    monkeypatch.setattr(sparse_far_flex, "_BLOCK_TILES_FAILED", None)
    with pytest.warns(RuntimeWarning, match="FlexAttention failed here"):
        flex_row_matches_reference(300, FarSelection(2, 32, 1))
    assert sparse_far_flex._BLOCK_TILES_FAILED is None and sparse_far_flex._FAILED.startswith("RuntimeError")


@pytest.mark.parametrize("band", (16, 200, 400, 1000))
def test_flex_scores_two_block_counts_at_most_per_bucket(band):
    """Every length of a bucket (513 ... 1,024 keys) scores its blocks in one of two counts, each
    covering every block a query reaches (keys up to n - 1 - band): at most two shapes of the plan
    per bucket whatever the band (the blocks of the bucket of n - band were up to 4 shapes here,
    8 in a 16K bucket without far_band)."""
    from hf_dilated.ops.sparse_far_flex import scored_blocks

    counts = {}
    for n in range(513, 1025):
        blocks = scored_blocks(n, band, 16)
        assert blocks * 16 >= n - band
        counts.setdefault(blocks, n)
    assert len(counts) <= 2, counts


def test_flex_bounds_only_the_blocks_a_query_reaches(monkeypatch):
    """Bounds and picks cover the blocks up to the last query's last far key, their keys rounded up
    to a power of two (500 keys, band 300: 256 keys, 16 blocks of 16), not the blocks of the keys'
    own bucket (512 keys, 32 blocks: twice the bounds); the results stay the reference's."""
    from hf_dilated.ops import sparse_far_flex

    widths = []
    real = sparse_far_flex.by_block_plan
    monkeypatch.setattr(sparse_far_flex, "by_block_plan", lambda q, summary, *rest: widths.append(
        summary.shape[2]) or real(q, summary, *rest))
    flex_row_matches_reference(500, FarSelection(2, 16, 1), far_band=300, window=320)
    assert widths and set(widths) == {16}


def test_product_dtype_keeps_sixteen_bit_keys_dtype_on_cuda_only():
    """far_selection.product_dtype: the far keys' own dtype on CUDA for 16-bit floats (the tensor
    cores' products, summed in float32), bound_dtype elsewhere: the CPU's bounds and figures stay."""
    from hf_dilated.ops import far_selection

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    sums_in_float32 = "dtype" in torch.ops.aten.bmm.overloads()  # torch.bmm's out_dtype
    for dtype in (torch.bfloat16, torch.float16):
        assert far_selection.product_dtype(cuda, dtype) == (dtype if sums_in_float32 else torch.float32)
        assert far_selection.product_dtype(cpu, dtype) == torch.float32
    assert far_selection.product_dtype(cuda, torch.float32) == torch.float32
    assert far_selection.product_dtype(cuda, torch.float64) == torch.float64
    flag = torch.backends.cuda.matmul.allow_fp16_accumulation  # then torch refuses float16's float32 output
    try:
        torch.backends.cuda.matmul.allow_fp16_accumulation = True
        assert far_selection.product_dtype(cuda, torch.float16) == torch.float32
        bfloat16 = far_selection.product_dtype(cuda, torch.bfloat16)
        assert bfloat16 == (torch.bfloat16 if sums_in_float32 else torch.float32)
    finally:
        torch.backends.cuda.matmul.allow_fp16_accumulation = flag


def test_product_dtype_traces_in_a_compiled_plan_without_a_graph_break():
    """product_dtype inside a compiled call (bounds() in the by-block plan calls it): dynamo cannot
    trace the getter of allow_fp16_accumulation, so for float16 on CUDA the plan broke into three
    graphs, one of them bounds() alone, shared by every length and shape (a review, 2026-11-27).
    Traced with fullgraph (where a break is an error), for the CUDA device, it is one graph now; the
    flag is still read eagerly."""
    from hf_dilated.ops import far_selection

    cuda = torch.device("cuda")
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def plan(x):
        return x.to(far_selection.product_dtype(cuda, torch.float16)) + 1

    torch._dynamo.reset()
    try:
        out = torch.compile(plan, backend=counting, fullgraph=True)(torch.zeros(3))
    finally:
        torch._dynamo.reset()
    sums_in_float32 = "dtype" in torch.ops.aten.bmm.overloads()
    assert len(graphs) == 1 and out.dtype == (torch.float16 if sums_in_float32 else torch.float32)
    flag = torch.backends.cuda.matmul.allow_fp16_accumulation
    try:
        torch.backends.cuda.matmul.allow_fp16_accumulation = True
        assert far_selection.product_dtype(cuda, torch.float16) == torch.float32
    finally:
        torch.backends.cuda.matmul.allow_fp16_accumulation = flag


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sixteen_bit_bounds_branch_groups_heads_and_takes_slices(dtype, monkeypatch):
    """bounds()' branch for 16-bit operands (on CUDA: torch.bmm with a float32 output, which the CPU
    has no kernel for) run here with that product made in float32 from the same 16-bit values (what
    the GPU computes, up to the order of its sums): its grouping of query heads per kv head, a
    summary of batch one, and a slice of blocks (plain_slots' form) give the float32 path's bounds
    (to float32's rounding: another product sums in another order)."""
    from hf_dilated.ops import far_selection

    bmm = torch.bmm

    def bmm_in_float32(a, b, out_dtype=None):
        assert out_dtype == torch.float32 and a.dtype == b.dtype == dtype
        return bmm(a.float(), b.float())

    g = torch.Generator().manual_seed(6)
    k_far = torch.randn(1, 2, 320, 16, generator=g).to(dtype)
    q_far = torch.randn(3, 6, 40, 16, generator=g).to(dtype)
    full = far_selection.bound_operands(*far_selection.plain_summaries(k_far, 64, 5), 3)
    low = far_selection.bound_operands(*far_selection.plain_summaries(k_far, 64, 5, dtype), 3)
    expected = far_selection.bounds(q_far, None, None, (full[0][:, :, 1:4], None))
    monkeypatch.setattr(far_selection, "product_dtype", lambda device, dt: dt)
    monkeypatch.setattr(torch, "bmm", bmm_in_float32)
    got = far_selection.bounds(q_far, None, None, (low[0][:, :, 1:4], None))
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)  # the same sums, another order


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sixteen_bit_summaries_hold_the_float32_ones_and_products_of_them_are_exact(dtype):
    """Why bounds of 16-bit keys may take 16-bit products (far_selection.product_dtype): summaries
    kept in the keys' dtype hold exactly the float32 ones (a minimum or maximum is one of the
    values), every product of a query's and a summary's values is exact in float32 (the tensor
    cores sum those in float32), and bounds() given the 16-bit operands returns the float32 ones
    bit for bit where it multiplies in float32 (here: the CPU)."""
    from hf_dilated.ops import far_selection

    g = torch.Generator().manual_seed(3)
    k_far = (torch.randn(2, 2, 300, 16, generator=g) * torch.logspace(-2, 2, 16)).to(dtype)
    q_far = (torch.randn(2, 4, 50, 16, generator=g) * 3).to(dtype)
    low = far_selection.plain_summaries(k_far, 64, 5, dtype)
    full = far_selection.plain_summaries(k_far, 64, 5)
    for a, b in zip(low, full):
        assert a.dtype == dtype and torch.equal(a.float(), b)
    summary = far_selection.bound_operands(*low, 2)
    products = (q_far.float().reshape(-1, 1) * summary[0].float().reshape(1, -1)).double()
    assert torch.equal(products, q_far.double().reshape(-1, 1) * summary[0].double().reshape(1, -1))
    expected = far_selection.bounds(q_far, None, None, far_selection.bound_operands(*full, 2))
    got = far_selection.bounds(q_far, None, None, summary)
    assert got.dtype == torch.float32 and torch.equal(got, expected)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_bounds_of_sixteen_bit_keys_match_float64(dtype):
    """On CUDA, bounds of 16-bit far keys (product_dtype: their own, the tensor cores' products
    summed in float32) against the same bounds in float64: within float32's rounding of the sums."""
    from hf_dilated.ops import far_selection

    g = torch.Generator().manual_seed(4)
    k_far = torch.randn(2, 2, 4096, 128, generator=g).to(dtype)
    q_far = torch.randn(2, 8, 512, 128, generator=g).to(dtype)
    product = far_selection.product_dtype(torch.device("cuda"), dtype)
    summaries = far_selection.plain_summaries(k_far.cuda(), 64, 64, product)
    operands = far_selection.bound_operands(*summaries, 4)
    assert operands[0].dtype == product
    got = far_selection.bounds(q_far.cuda(), None, None, operands).cpu().double()
    mn, mx = (t.double() for t in far_selection.plain_summaries(k_far.double(), 64, 64))
    q = q_far.double().view(2, 2, 4 * 512, 128)
    exact = q.clamp(min=0) @ mx.transpose(-1, -2) + q.clamp(max=0) @ mn.transpose(-1, -2)
    magnitude = q.abs() @ torch.maximum(mx.abs(), mn.abs()).transpose(-1, -2)
    err = ((got.view_as(exact) - exact).abs() / magnitude).max().item()
    assert err < 1e-5, err


def test_flex_by_block_reads_tied_blocks_beyond_its_slots():
    """Ties at the k-th bound all count (docs/contract.md 4.2): where a query chose more blocks than
    the by-block layout has slots (top_k + sinks), the rest go to the by-query call, and the result
    and the pairs are the reference's (key blocks repeated exactly tie every bound)."""
    from hf_dilated.ops import far_selection, sparse_far_flex, sparse_far_plain

    g = torch.Generator().manual_seed(9)
    q = torch.randn(1, 2, 400, 4, generator=g, dtype=torch.float64)
    k = torch.randn(1, 1, 4, 4, generator=g, dtype=torch.float64).repeat(1, 1, 100, 1)  # 100 equal blocks of 4
    v = torch.randn(1, 1, 400, 4, generator=g, dtype=torch.float64)
    selection = FarSelection(2, 4, 0)
    operands = far_selection.bound_operands(*far_selection.plain_summaries(k, 4, 128), 2)
    chosen = far_selection.plain_choice(q[:, :, 200:], None, None, 200, 16, selection, operands)
    tied_lists = sparse_far_flex.by_block_plan(q[:, :, 200:], *operands, torch.arange(200, 400) - 16, 2, 0, 4, 512)[-1]
    tied = tied_lists[0][:, :, :200, :chosen.shape[-1]]
    assert not tied_lists[0][:, :, 200:].any() and not tied_lists[0][..., chosen.shape[-1]:].any()  # padding
    assert tied.any() and not (tied & ~chosen).any() and int((chosen & ~tied).sum(-1).max()) == 2
    with pair_count.counting() as tally:
        out = sparse_far_plain.sparse_far_forward(q, k, v, q, k, 32, 16, selection, 0.5, far_kernel="flex")
    ref_kw = dict(far_band=16, far_top_k=2, far_block_size=4, far_sinks=0)
    ref = local_band_reference(q, k, v, [512], [1], 32, scale=0.5, **ref_kw)
    near, far = local_band_key_sets(q, k, [512], [1], 32, **ref_kw)
    assert (out - ref).abs().max().item() < TOL
    assert tally.pairs == int((near | far).sum())


def test_flex_build_failure_falls_back_to_blocks_with_a_warning(monkeypatch):
    from hf_dilated.ops import sparse_far_flex

    def broken(*a):
        raise RuntimeError("no kernel for this device")

    monkeypatch.setattr(sparse_far_flex, "_flex_call", broken)
    monkeypatch.setattr(sparse_far_flex, "_FAILED", None)
    with pytest.warns(RuntimeWarning, match="no kernel for this device"), pair_count.counting() as tally:
        q, k, q_far, k_far, ref_kw = flex_row_matches_reference(300)
    near, far_read = local_band_key_sets(q, k, [512], [1], 64, q_far=q_far, k_far=k_far, **ref_kw)
    assert tally.pairs == int((near | far_read).sum())  # the failed chunk's pairs are not counted too
    assert sparse_far_flex._FAILED.startswith("RuntimeError")


def flex_row_matches_reference(n, selection=FarSelection(2, 16, 1), far_band=32, window=64):
    """The FlexAttention far path on one plain row of n keys against the float64 reference; returns
    (q, k, q_far, k_far, the reference's far settings) for the caller's own checks."""
    from hf_dilated.ops import sparse_far_plain

    case = replace(BASE, layout="plain", kv_len=n)
    q, k, v, _, _, _ = make_inputs(case, torch.float64)
    q, k, v = q.detach(), k.detach(), v.detach()
    q_far, k_far = (t.detach() for t in far_inputs(q, k, 5))
    out = sparse_far_plain.sparse_far_forward(q, k, v, q_far, k_far, window, far_band, selection,
                                              q.shape[-1] ** -0.5, far_kernel="flex")
    far = dict(far_band=far_band, far_top_k=selection.top_k, far_block_size=selection.block_size,
               far_sinks=selection.sinks)
    ref = local_band_reference(q, k, v, [512], [1], window, q_far=q_far, k_far=k_far, **far)
    assert (out - ref).abs().max().item() < TOL
    return q, k, q_far, k_far, far


def test_flex_calls_have_one_shape_per_power_of_two(monkeypatch):
    """Rows of 300 and 400 keys call FlexAttention with the same shapes (keys padded to 512, query
    rows to one chunk), so a compiled kernel serves both; the results stay the reference's."""
    from hf_dilated.ops import sparse_far_flex

    shapes = []
    real = sparse_far_flex._flex_call
    monkeypatch.setattr(sparse_far_flex, "_flex_call",
                        lambda q, k, v, bm, sc, *kind: shapes.append((q.shape, k.shape, bm.shape)) or real(
                            q, k, v, bm, sc, *kind))
    for n in (300, 400):
        flex_row_matches_reference(n)
    assert len(shapes) == 4 and shapes[:2] == shapes[2:], shapes  # by block, then the ties by query
    assert shapes[0][1][2] == 512


def test_flex_block_masks_skip_the_backward_lists(monkeypatch):
    """The far path runs without gradients, so its BlockMasks (by block, and the ties' by query) are
    built without the query-block lists only FlexAttention's backward reads (where torch can: each
    list was a sort and a few passes per chunk, about 30 of a chunk's 68 launches). The results stay
    the reference's."""
    import inspect

    from hf_dilated.ops import sparse_far_flex

    masks = []
    real = sparse_far_flex._flex_call
    monkeypatch.setattr(sparse_far_flex, "_flex_call", lambda q, k, v, bm, *rest: masks.append(bm) or real(q, k, v, bm, *rest))
    flex_row_matches_reference(300)
    assert len(masks) == 2
    if "compute_q_blocks" in inspect.signature(sparse_far_flex._flex.BlockMask.from_kv_blocks).parameters:
        assert all(m.q_num_blocks is None and m.q_indices is None for m in masks)


@pytest.mark.parametrize("size", [16, 64, 128, 256, 48, 200])
def test_listed_tiles_are_the_tiles_a_chosen_block_overlaps(size):
    """A query tile lists the key tiles holding a key of a block it chose: by a reshape where blocks
    tile a tile (16, 64, 128) or tiles tile a block (256), else by the overlap of every block and
    tile (48, 200); each against the tiles of every key of the chosen blocks, one by one."""
    from hf_dilated.ops.sparse_far_flex import TILE, listed_tiles

    n_tiles = 7
    n_blocks = (n_tiles * TILE - 1) // size + 1
    chosen = torch.rand(3, 5, n_blocks, generator=torch.Generator().manual_seed(size)) < 0.2
    expect = torch.zeros(3, 5, n_tiles, dtype=torch.bool)
    for i, j, c in chosen.nonzero().tolist():
        for key in range(c * size, min((c + 1) * size, n_tiles * TILE)):
            expect[i, j, key // TILE] = True
    assert torch.equal(listed_tiles(chosen, n_tiles, size), expect)


@pytest.fixture
def flex_graphs(monkeypatch):
    """sparse_far_flex compiled on the CPU too (COMPILED_ON widened, dynamic=False as on CUDA) by a
    backend that records each graph dynamo traces and runs it eagerly; calls of 128 queries; dynamo
    failing past its recompile limit (a test sets the limit). Yields the graphs' list."""
    from hf_dilated.ops import sparse_far_flex

    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    sparse_far_flex.compiled_for_bucket.cache_clear()
    monkeypatch.setattr(sparse_far_flex, "COMPILED_ON", ("cuda", "cpu"))
    monkeypatch.setattr(sparse_far_flex, "BACKEND", counting)
    monkeypatch.setattr(sparse_far_flex, "_FUSED_FAILED", None)
    monkeypatch.setattr(sparse_far_flex, "_BOUND_ELEMENTS", 1)  # 128 queries per call
    monkeypatch.setattr(torch._dynamo.config, "fail_on_recompile_limit_hit", True)
    yield graphs
    torch._dynamo.reset()
    sparse_far_flex.compiled_for_bucket.cache_clear()


def test_flex_compiles_one_or_two_shapes_per_bucket_each_bucket_its_own(flex_graphs, monkeypatch):
    """Compiled (dynamic=False, as on CUDA; here with dynamo's graphs run eagerly, which the CPU
    does), rows of 300, 400 and 500 keys (band 32) in calls of 128 queries trace one graph per
    compiled function (the plan, FlexAttention by block, the ties' FlexAttention by query, the
    merge): every operand has one shape and one set of strides per power of two (a slice of a longer
    row traced one graph per length). A band that keeps every far key in the bucket's first half
    scores fewer blocks: one more plan (its other shape). Each bucket compiles functions of its own,
    so with dynamo's limit at 2 graphs per function (failing past it) every call compiles: one
    function shared by the buckets met the limit, past which it ran eagerly (FlexAttention: its
    full scores)."""
    graphs = flex_graphs
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no compile failed, no fallback
        for n in (300, 400, 500):
            flex_row_matches_reference(n)
        assert len(graphs) == 4, len(graphs)
        flex_row_matches_reference(300, far_band=64)  # 236 far keys: in the first 256 of 512
        assert len(graphs) == 5, len(graphs)
        for n in (200, 150):  # bucket 256: 168 far keys (past 128), then 118
            flex_row_matches_reference(n)
        assert len(graphs) == 10, len(graphs)


@pytest.mark.parametrize("layout, selection", (("by_block", FarSelection(2, 16, 1)), ("by_query", FarSelection(2, 16, 1)),
                                               ("by_block", FarSelection(0, 16, 0))), ids=("by_block", "by_query", "band_only"))
def test_flex_merges_compile_once_per_bucket_with_flashs_band_layout(layout, selection, flash_band, flex_graphs,
                                                                     monkeypatch):
    """The merge of a chunk's band and far keys is compiled (dynamic=False) once per length bucket,
    every one of its operands with a contiguous tensor's strides, for one row in transformers'
    layout ((batch, n, heads, d) memory) whose band comes from flash: flash's out lies as its q does,
    so a batch of one had a stride that followed the row's length (a guard of dynamo's, size-1
    dimension or not) and each prompt length compiled the merge again. Here flash's band is the CPU's
    band written into the layout flash gives (the flash_band fixture); rows of 300 and 330 (bucket
    512) trace the graphs of the first alone, and the outputs are the float64 reference's."""
    from hf_dilated.ops import sparse_far_flex, sparse_far_plain

    graphs = flex_graphs
    monkeypatch.setattr(sparse_far_flex, "LAYOUT", layout)
    monkeypatch.setattr(sparse_far_flex, "_FAILED", None)
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 1)
    far = dict(far_band=32, far_top_k=selection.top_k, far_block_size=selection.block_size, far_sinks=selection.sinks)
    g = torch.Generator().manual_seed(31)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no compile failed, no fallback
        for n in (300, 330):
            q, q_far = (torch.randn(1, n, 4, 8, generator=g, dtype=torch.float64).transpose(1, 2) for _ in "qf")
            k, v, k_far = (torch.randn(1, n, 2, 8, generator=g, dtype=torch.float64).transpose(1, 2) for _ in "kvf")
            out = sparse_far_plain.sparse_far_forward(q, k, v, q_far, k_far, 64, 32, selection, 8 ** -0.5,
                                                      far_kernel="flex")
            ref = local_band_reference(q, k, v, [512], [1], 64, q_far=q_far, k_far=k_far, **far)
            assert (out - ref).abs().max().item() < TOL
            if n == 300:
                first = len(graphs)
        assert first > 0 and len(graphs) == first, (first, len(graphs))
        assert flash_band  # the band came from "flash"


def test_flex_path_without_far_blocks_reads_only_the_band(monkeypatch):
    """far_top_k 0 and far_sinks 0: no far key is read, and FlexAttention is not called (an empty
    call failed, which turned it off for the process)."""
    from hf_dilated.ops import sparse_far_flex

    monkeypatch.setattr(sparse_far_flex, "_FAILED", None)
    flex_row_matches_reference(300, FarSelection(0, 16, 0))
    assert sparse_far_flex._FAILED is None


def test_flex_chunk_holds_its_by_block_rows_under_the_budget():
    from hf_dilated.ops import sparse_far_flex

    for rows, blocks, slots, dim in ((32, 256, 9, 128), (128, 256, 9, 128), (8, 2048, 33, 64)):
        chunk = sparse_far_flex.query_chunk(rows, blocks, rows * slots * dim)
        assert chunk % sparse_far_flex.TILE == 0
        assert chunk == sparse_far_flex.TILE or chunk * rows * slots * dim <= sparse_far_flex._ENTRY_ELEMENTS
        assert chunk * rows * blocks <= sparse_far_flex._BOUND_ELEMENTS or chunk == sparse_far_flex.TILE


def test_far_kernel_is_checked():
    from hf_dilated.ops import sparse_far_plain

    q = torch.zeros(1, 2, 8, 4)
    with pytest.raises(ValueError, match="far_kernel"):
        sparse_far_plain.sparse_far_forward(q, q, q, q, q, 4, None, FarSelection(1, 2, 1), 0.5, far_kernel="dense")


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.parametrize("layout, chunked, dtype, merge, picks", [
    ("by_block", False, torch.bfloat16, "by_slot", "maxima"), ("by_block", True, torch.float32, "by_slot", "maxima"),
    ("by_query", False, torch.float32, "by_slot", "maxima"), ("by_query", True, torch.bfloat16, "by_slot", "maxima"),
    ("by_block", True, torch.bfloat16, "reduce", "maxima"), ("by_block", True, torch.bfloat16, "by_slot", "sort")],
    ids=("by_block-one_call-bfloat16", "by_block-calls_of_128-float32", "by_query-one_call-float32",
         "by_query-calls_of_128-bfloat16", "by_block-calls_of_128-bfloat16-merged_by_reduction",
         "by_block-calls_of_128-bfloat16-picked_by_sort"))
def test_cuda_inference_matches_reference(dtype, chunked, layout, merge, picks, monkeypatch):
    """The CUDA inference path of sparse far keys (the band on flash's sliding window, the far keys
    on compiled FlexAttention, both row layouts) against the float64 reference, on inputs rounded
    to `dtype` first (so both rank the same blocks): 1,000 keys, bands of 256 inside and 128 past
    the window. Each layout in one call and in calls of 128 queries, each in both dtypes: four
    cases, not all eight, since each by_block case compiles its plan anew (30-39 s on an H200, where
    all eight passed on 2026-11-27); and by block, merged by one reduction (MERGE) and picked by
    sort (PICKS)."""
    from hf_dilated.ops import sparse_far_flex

    monkeypatch.setattr(sparse_far_flex, "LAYOUT", layout)
    monkeypatch.setattr(sparse_far_flex, "MERGE", merge)
    monkeypatch.setattr(sparse_far_flex, "PICKS", picks)
    monkeypatch.setattr(sparse_far_flex, "_FUSED_FAILED", None)
    if chunked:
        monkeypatch.setattr(sparse_far_flex, "_BOUND_ELEMENTS", 1)
    calls = []
    real = sparse_far_flex.prefill
    monkeypatch.setattr(sparse_far_flex, "prefill", lambda *a: calls.append(real(*a)) or calls[-1])
    g = torch.Generator().manual_seed(21)
    shapes = [(2, 4, 1000, 64), (2, 2, 1000, 64), (2, 2, 1000, 64), (2, 4, 1000, 64), (2, 2, 1000, 64)]
    q, k, v, q_far, k_far = (torch.randn(s, generator=g, dtype=torch.float64).to(dtype) for s in shapes)
    kw = dict(local_window=256, far_band=128)
    with torch.no_grad():
        out = dilated_attention(*(t.cuda() for t in (q, k, v)), [1024], [1], q_far=q_far.cuda(), k_far=k_far.cuda(),
                                far_selection=FarSelection(4, 64, 1), **kw)
        torch.cuda.synchronize()
    ref = local_band_reference(*(t.double() for t in (q, k, v)), [1024], [1], 256, q_far=q_far.double(),
                               k_far=k_far.double(), far_band=128, far_top_k=4, far_block_size=64, far_sinks=1)
    err = (out.cpu().double() - ref).abs().max().item() / ref.abs().max().item()
    assert calls and all(c is not None for c in calls), sparse_far_flex._FAILED  # FlexAttention ran (no fallback)
    assert sparse_far_flex._FUSED_FAILED is None  # the plan and merge compiled (bounds in bfloat16 too)
    assert err < (1e-4 if dtype == torch.float32 else 2e-2), err


@pytest.mark.cuda
def test_cuda_heads_narrower_than_flex_takes_keep_the_block_path_and_flex_open(monkeypatch):
    """Heads of 8 on CUDA, which FlexAttention's CUDA kernel does not take, read their far keys
    block by block without trying it (trying fails, and would close FlexAttention to every later
    call of the process), and match the float64 reference; FlexAttention stays open."""
    from hf_dilated.ops import sparse_far_flex

    monkeypatch.setattr(sparse_far_flex, "_FAILED", None)
    g = torch.Generator().manual_seed(22)
    shapes = [(1, 4, 600, 8), (1, 2, 600, 8), (1, 2, 600, 8), (1, 4, 600, 8), (1, 2, 600, 8)]
    q, k, v, q_far, k_far = (torch.randn(s, generator=g, dtype=torch.float64).float() for s in shapes)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no "FlexAttention failed here"
        out = dilated_attention(*(t.cuda() for t in (q, k, v)), [1024], [1], q_far=q_far.cuda(), k_far=k_far.cuda(),
                                far_selection=FarSelection(4, 64, 1), local_window=256, far_band=128)
    ref = local_band_reference(*(t.double() for t in (q, k, v)), [1024], [1], 256, q_far=q_far.double(),
                               k_far=k_far.double(), far_band=128, far_top_k=4, far_block_size=64, far_sinks=1)
    assert (out.cpu().double() - ref).abs().max().item() < 1e-4
    assert sparse_far_flex._FAILED is None


def test_flex_far_path_takes_heads_its_cuda_kernel_takes(monkeypatch):
    """FlexAttention's CUDA kernel takes heads of 16 and wider (narrower ones failed its build on an
    H200, which closed it to the process): prefill on (fake) CUDA tensors with heads of 8
    returns None (the caller reads block by block) without trying or marking FlexAttention
    failed; on the CPU's eager FlexAttention every width runs."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from hf_dilated.ops import sparse_far_flex

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert sparse_far_flex.takes_head_dim(cuda, 16) and sparse_far_flex.takes_head_dim(cuda, 128)
    assert not sparse_far_flex.takes_head_dim(cuda, 8) and sparse_far_flex.takes_head_dim(cpu, 8)
    monkeypatch.setattr(sparse_far_flex, "_FAILED", None)
    with FakeTensorMode():
        q = torch.empty(1, 4, 600, 8, device="cuda")
        k = torch.empty(1, 2, 600, 8, device="cuda")
        assert sparse_far_flex.prefill(q, k, k, q, k, 256, 128, FarSelection(4, 64, 1), 1.0) is None
    assert sparse_far_flex._FAILED is None


def test_decode_copies_of_blocks_and_rows_agree_on_every_device_form():
    """A decode step copies the chosen blocks (or rows) per kv head on the CPU and with one index on
    a GPU (sparse_far_decode._blocks / _rows): both forms, run here on a cache that is a view with
    blocks starting past its first slot, equal the blocks and rows taken one by one."""
    from hf_dilated.ops import sparse_far_decode as decode

    g = torch.Generator().manual_seed(3)
    cache = torch.randn(100, 3, 8, generator=g, dtype=torch.float64).transpose(0, 1)  # (kv_heads, n, d), a view
    start, size, count = 5, 4, 20  # blocks of 4 rows from row 5: rows 5..84
    blocks = torch.randint(0, count, (3, 7), generator=g)
    rows = torch.randint(0, 100, (3, 11), generator=g)
    view = cache[:, start:start + count * size].unflatten(1, (count, size))
    expect_blocks = torch.stack([torch.stack([cache[h, start + c * size:start + (c + 1) * size]
                                              for c in blocks[h].tolist()]) for h in range(3)])
    expect_rows = torch.stack([torch.stack([cache[h, r] for r in rows[h].tolist()]) for h in range(3)])
    for form in (decode._blocks_at_once, decode._per_kv_head):
        assert torch.equal(form(view, blocks), expect_blocks), form.__name__
    assert torch.equal(decode._blocks(cache, blocks, start, size, count), expect_blocks)
    for form in (decode._rows_at_once, decode._per_kv_head):
        assert torch.equal(form(cache, rows), expect_rows), form.__name__
    assert torch.equal(decode._rows(cache, rows), expect_rows)


@pytest.mark.parametrize("window", (26, 27, 29))
def test_keys_the_window_hides_change_nothing(window):
    """Under a sliding window the block a query's window starts in is bounded by the keys the window
    shows (docs/contract.md 4.2): keys the window hides change no output, as under sdpa. (Those of
    that block used to enter its summary, so the same sequence chose other blocks against a
    sliding-window cache, which drops them.) The window starts inside a block of 4."""
    case = replace(BASE, layout="plain", seed=32, kv_len=60)
    q, k, v, mask, pos, _ = make_inputs(case, torch.float64)
    q_far, k_far = (t.detach() for t in far_inputs(q, k, 33))
    q, k, v = q.detach(), k.detach(), v.detach()
    kernel, _ = sparse((8, 1, 4, 1))
    hidden = k.shape[2] - window  # the last query's window shows keys hidden .. 59

    def last_query(k_far):
        return dilated_attention(q[:, :, -1:], k, v, [64], [1], local_window=WINDOW, q_far=q_far[:, :, -1:],
                                 k_far=k_far, sliding_window=window, **kernel)

    other = k_far.clone()
    other[:, :, :hidden] = torch.randn(other[:, :, :hidden].shape, generator=torch.Generator().manual_seed(34),
                                       dtype=torch.float64) * 10
    assert (last_query(other) - last_query(k_far)).abs().max().item() < TOL


@pytest.mark.parametrize("window", (47, 60, 200))
def test_a_window_that_hides_no_key_of_a_block_reads_none_of_its_empty_positions(window):
    """A row padded on the left whose positions start inside a block (5, blocks of 8): positions 0-4
    of the first block hold no key. Where the window hides nothing of that block, its summary is its
    real keys' (docs/contract.md 4.2), not the padded slot's k_far, which a first form of the
    window's edge read at an empty position (off by 1.0 from the reference)."""
    g = torch.Generator().manual_seed(0)
    n, d = 48, 8
    q, k, v, q_far, k_far = (torch.randn(1, 1, n, d, generator=g, dtype=torch.float64) for _ in range(5))
    mask = torch.ones(1, n, dtype=torch.long)
    mask[0, :3] = 0
    pos = torch.ones(1, n, dtype=torch.long)
    pos[0, 3:] = torch.arange(5, 5 + n - 3)
    k_far[0, 0, 0] = 50 * q_far[0, 0, -5:].mean(0).sign()  # the padded slot's: large
    out = dilated_attention(q, k, v, [64], [1], local_window=16, q_far=q_far, k_far=k_far, attention_mask=mask,
                            position_ids=pos, sliding_window=window, far_selection=FarSelection(1, 8, 0))
    ref = local_band_reference(q, k, v, [64], [1], 16, q_far=q_far, k_far=k_far, attention_mask=mask,
                               position_ids=pos, sliding_window=window, far_top_k=1, far_block_size=8, far_sinks=0)
    assert (out - ref)[:, :, 3:].abs().max().item() < TOL


def test_model_with_a_sliding_window_cache_decodes_as_its_forward(tmp_path):
    """A Mistral whose sliding window reaches past its local band, with sparse far keys, saved and
    loaded as safetensors: generate() against transformers' sliding-window cache (which keeps only
    the window's keys) gives the logits of a forward over the whole sequence (0.069 apart before the
    window's edge block was bounded by the keys it shows)."""
    from transformers import AutoModelForCausalLM, MistralConfig

    config = MistralConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, intermediate_size=37, max_position_embeddings=64, sliding_window=20)
    config.hf_dilated = dict(ENTRY, segment_lengths=[64], target_length=64)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # larger attention weights: peaked scores, so that a changed choice shows
        for name, p in model.named_parameters():
            if "self_attn" in name:
                p.mul_(4.0)
    model.save_pretrained(tmp_path, safe_serialization=True)
    ours = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="dilated", dtype=torch.float64).eval()
    assert ours.config.sliding_window == 20
    prompt = torch.randint(3, 99, (1, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = ours.generate(prompt, max_new_tokens=12, min_new_tokens=12, do_sample=False, output_logits=True,
                            return_dict_in_generate=True)
        assert "Sliding" in type(out.past_key_values.layers[0]).__name__  # the cache that drops hidden keys
        whole = ours(out.sequences).logits
    steps = torch.stack([whole[:, 30 + t - 1] for t in range(12)], 1)
    assert (torch.stack(out.logits, 1) - steps).abs().max().item() < 1e-6  # (generate's logits: float32)
