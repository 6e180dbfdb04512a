"""The standalone API: DilatedMultiheadAttention against torch.nn.MultiheadAttention, and
create_attention's kinds against the independent float64 reference (tests/reference.py)."""
import pytest
import torch
from torch import nn

from hf_dilated import DilatedMultiheadAttention, create_attention
from hf_dilated.nn import AUTO_DENSE_MAX_LEN, KINDS
from reference import block_sparse_reference, dense_causal_reference, dilated_reference

E, H = 32, 4
COVERING = dict(attention="dilated", segment_lengths=[64, 128], dilation_rates=[1, 2])  # dense up to 64 tokens


def causal_mask(n):
    return torch.triu(torch.ones(n, n, dtype=torch.bool), 1)


def pair(seed=0, **kwargs):
    """(nn.MultiheadAttention, ours) with the same weights (loaded through the state_dict)."""
    torch.manual_seed(seed)
    ref = nn.MultiheadAttention(E, H, **kwargs)
    ours = DilatedMultiheadAttention(E, H, **kwargs, **COVERING)
    ours.load_state_dict(ref.state_dict())
    return ref.eval(), ours.eval()


@pytest.mark.parametrize("batch_first", [False, True])
def test_matches_nn_multihead_attention_causal(batch_first):
    ref, ours = pair(batch_first=batch_first)
    n, b = 40, 3
    x = torch.randn((b, n, E) if batch_first else (n, b, E))
    want, _ = ref(x, x, x, attn_mask=causal_mask(n), is_causal=True, need_weights=False)
    got, weights = ours(x, x, x, is_causal=True)
    assert weights is None
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # The causal mask itself is accepted too, as nn.MultiheadAttention users pass it.
    got2, _ = ours(x, x, x, attn_mask=causal_mask(n), is_causal=True)
    torch.testing.assert_close(got2, want, atol=1e-5, rtol=1e-5)


def test_gradients_match_nn_multihead_attention():
    ref, ours = pair(seed=1)
    x = torch.randn(24, 2, E)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref(xa, xa, xa, attn_mask=causal_mask(24), is_causal=True, need_weights=False)[0].square().sum().backward()
    ours(xb, xb, xb, is_causal=True)[0].square().sum().backward()
    torch.testing.assert_close(xb.grad, xa.grad, atol=1e-5, rtol=1e-5)
    grads_ref = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, grads_ref[name].grad, atol=1e-5, rtol=1e-5, msg=name)


def test_non_causal_unbatched_and_cross_attention_dims():
    torch.manual_seed(2)
    ref = nn.MultiheadAttention(E, H, kdim=12, vdim=20, bias=False).eval()
    ours = DilatedMultiheadAttention(E, H, kdim=12, vdim=20, bias=False, attention="dense").eval()
    assert set(ours.state_dict()) == set(ref.state_dict())
    ours.load_state_dict(ref.state_dict())
    q, k, v = torch.randn(10, E), torch.randn(16, 12), torch.randn(16, 20)  # unbatched, q_len < kv_len
    want, _ = ref(q, k, v, need_weights=False)
    got, _ = ours(q, k, v)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_inside_transformer_encoder_layer_eval_uses_our_attention():
    """nn.TransformerEncoderLayer's eval fast path would compute dense attention from the weights;
    ours must stay in use (the pattern here is not dense: 40 tokens, first segment 8)."""
    torch.manual_seed(7)
    layer = nn.TransformerEncoderLayer(E, H, dim_feedforward=64, dropout=0.0, batch_first=True)
    layer.self_attn = DilatedMultiheadAttention(E, H, batch_first=True, attention="dilated",
                                                segment_lengths=[8, 16, 64], dilation_rates=[1, 2, 4])
    x = torch.randn(2, 40, E)
    want = layer.train()(x, is_causal=True)  # training mode never takes the fast path
    with torch.no_grad():
        got = layer.eval()(x, is_causal=True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_state_dict_loads_both_ways():
    ours = DilatedMultiheadAttention(E, H, **COVERING)
    ref = nn.MultiheadAttention(E, H)
    assert list(ours.state_dict()) == list(ref.state_dict())
    ref.load_state_dict(ours.state_dict())  # strict
    for name, p in ref.state_dict().items():
        assert torch.equal(p, ours.state_dict()[name])


@pytest.mark.parametrize("float_mask", [False, True])
def test_key_padding_mask_honoured(float_mask):
    ref, ours = pair(seed=3, batch_first=True)
    n = 30
    x = torch.randn(2, n, E)
    pad = torch.zeros(2, n, dtype=torch.bool)
    pad[0, :7] = True  # left padding
    pad[1, 20:] = True  # right padding
    pad[1, 11] = True  # a hidden key in the middle: only that key disappears
    kpm = torch.zeros(2, n).masked_fill(pad, float("-inf")) if float_mask else pad
    causal = torch.zeros(n, n).masked_fill(causal_mask(n), float("-inf")) if float_mask else causal_mask(n)
    want, _ = ref(x, x, x, key_padding_mask=kpm, attn_mask=causal, is_causal=True, need_weights=False)
    got, _ = ours(x, x, x, key_padding_mask=kpm, is_causal=True)
    real = ~pad  # outputs at padded query positions are unspecified (docs/contract.md 3.1), as in transformers
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-5)
    assert torch.isfinite(got).all()
    # The mask matters: without it the real rows change.
    plain, _ = ours(x, x, x, is_causal=True)
    assert not torch.allclose(plain[real], got[real], atol=1e-3)


def test_need_weights_and_unsupported_arguments_raise():
    ours = DilatedMultiheadAttention(E, H, **COVERING)
    x = torch.randn(8, 1, E)
    with pytest.raises(ValueError, match="need_weights"):
        ours(x, x, x, need_weights=True)
    with pytest.raises(ValueError, match="attn_mask"):
        ours(x, x, x, attn_mask=torch.zeros(8, 8, dtype=torch.bool), is_causal=True)
    with pytest.raises(ValueError, match="attn_mask"):
        ours(x, x, x, attn_mask=causal_mask(8))  # a causal mask without is_causal=True
    with pytest.raises(ValueError, match="key_padding_mask"):
        ours(x, x, x, key_padding_mask=torch.zeros(1, 7, dtype=torch.bool))
    with pytest.raises(ValueError, match="key_padding_mask"):
        ours(x, x, x, key_padding_mask=torch.full((1, 8), 0.5))
    with pytest.raises(ValueError, match="add_bias_kv"):
        DilatedMultiheadAttention(E, H, add_bias_kv=True)
    with pytest.raises(ValueError, match="divisible"):
        DilatedMultiheadAttention(E, 5)
    with pytest.raises(TypeError, match="unknown config"):
        DilatedMultiheadAttention(E, H, attention="dilated", segment_lengths=[8], dilation_rates=[1], window=3)


# --- create_attention -------------------------------------------------------------------------

SEG, DIL = [8, 16, 32], [1, 2, 4]
PATTERN = {"type": "local", "window": 2}
BLOCK = 4


def local_layout(n_blocks, window):
    bq = torch.arange(n_blocks)[:, None]
    bk = torch.arange(n_blocks)[None, :]
    return ((bq - bk >= 0) & (bq - bk < window))[None, None]


def reference_for(kind, q, k, v, mask):
    n = k.shape[2]
    if kind in ("dense", "ring"):
        return dense_causal_reference(q, k, v, attention_mask=mask)
    if kind in ("dilated", "dilated_ring"):
        return dilated_reference(q, k, v, SEG, DIL, "union", attention_mask=mask)
    return block_sparse_reference(q, k, v, local_layout(-(-n // BLOCK), 2), BLOCK, attention_mask=mask)


CONFIGS = {
    "dense": {},
    "dilated": dict(segment_lengths=SEG, dilation_rates=DIL),
    "block_sparse": dict(pattern=PATTERN, block_size=BLOCK),
    "ring": {},
    "dilated_ring": dict(segment_lengths=SEG, dilation_rates=DIL),
    "block_sparse_ring": dict(pattern=PATTERN, block_size=BLOCK),
}


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "auto"])
def test_factory_builds_every_kind_and_matches_reference(kind):
    attn = create_attention(kind, **CONFIGS[kind])
    assert attn.kind == kind
    torch.manual_seed(4)
    b, h, hk, n, d = 2, 4, 2, 45, 8
    q, k, v = torch.randn(b, h, n, d), torch.randn(b, hk, n, d), torch.randn(b, hk, n, d)
    mask = torch.ones(b, n, dtype=torch.long)
    mask[1, :5] = 0
    for m in (None, mask):
        got = attn(q, k, v, attention_mask=m)
        want = reference_for(kind, q.double(), k.double(), v.double(), m)
        real = torch.ones(b, n, dtype=torch.bool) if m is None else m.bool()
        err = (got.double() - want).abs().permute(0, 2, 1, 3)[real].max()
        assert err < 1e-4, (kind, m is not None, float(err))


def test_auto_rule():
    cpu = torch.device("cpu")
    limit = AUTO_DENSE_MAX_LEN["cpu"]
    auto = create_attention("auto")
    assert auto.choose(limit, cpu) == ("dense", {})
    kind, cfg = auto.choose(limit + 1, cpu)
    assert kind == "dilated" and cfg["segment_lengths"] == [limit, 2 * limit] and cfg["dilation_rates"] == [1, 2]
    kind, cfg = auto.choose(5 * limit, cpu)
    assert cfg["segment_lengths"] == [limit * 2**g for g in range(4)] and cfg["dilation_rates"] == [1, 2, 4, 8]
    kind, cfg = auto.choose(limit, torch.device("cuda"))  # a device type only: nothing runs on it
    assert kind == "dense"
    assert AUTO_DENSE_MAX_LEN["cuda"] > limit
    # Explicit pattern: dense only while it is dense.
    auto = create_attention("auto", segment_lengths=[16, 32], dilation_rates=[1, 2])
    assert auto.choose(16, cpu)[0] == "dense" and auto.choose(17, cpu)[0] == "dilated"
    assert create_attention("auto", segment_lengths=[16, 32], dilation_rates=[2, 4]).choose(8, cpu)[0] == "dilated"
    # With position ids it is the positions that must fit in the first segment.
    assert auto.choose(8, cpu, position_ids=torch.arange(8)[None])[0] == "dense"
    assert auto.choose(8, cpu, position_ids=torch.arange(8)[None] + 10)[0] == "dilated"
    assert auto.choose(40, cpu, position_ids=(torch.arange(40) % 10)[None])[0] == "dense"  # packed documents


def test_auto_computes_what_it_chooses():
    auto = create_attention("auto", dense_max_len=16)
    torch.manual_seed(5)
    for n in (16, 50):
        q, k, v = (torch.randn(1, 4, n, 8) for _ in range(3))
        kind, cfg = auto.choose(n, q.device)
        want = (dense_causal_reference(q.double(), k.double(), v.double()) if kind == "dense"
                else dilated_reference(q.double(), k.double(), v.double(), cfg["segment_lengths"],
                                       cfg["dilation_rates"]))
        assert (auto(q, k, v).double() - want).abs().max() < 1e-4
    # Packed documents (positions restart): dense within each document, never across.
    pos = (torch.arange(40) % 10)[None]
    q, k, v = (torch.randn(1, 4, 40, 8) for _ in range(3))
    assert auto.choose(40, q.device, position_ids=pos)[0] == "dense"
    want = dense_causal_reference(q.double(), k.double(), v.double(), position_ids=pos)
    assert (auto(q, k, v, position_ids=pos).double() - want).abs().max() < 1e-4


def test_auto_module_default():
    torch.manual_seed(6)
    ref = nn.MultiheadAttention(E, H).eval()
    ours = DilatedMultiheadAttention(E, H).eval()  # attention="auto"
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(20, 2, E)
    want, _ = ref(x, x, x, attn_mask=causal_mask(20), is_causal=True, need_weights=False)
    torch.testing.assert_close(ours(x, x, x, is_causal=True)[0], want, atol=1e-5, rtol=1e-5)


def test_factory_errors():
    with pytest.raises(ValueError, match="kind"):
        create_attention("sparse")
    with pytest.raises(TypeError, match="needs"):
        create_attention("dilated", segment_lengths=[8])
    with pytest.raises(TypeError, match="unknown config"):
        create_attention("ring", segment_lengths=[8], dilation_rates=[1])
    with pytest.raises(ValueError, match="dilation_rates"):
        create_attention("dilated", segment_lengths=[8, 16], dilation_rates=[3, 6])
    with pytest.raises(ValueError, match="pattern"):
        create_attention("block_sparse", pattern={"type": "nope"})
    with pytest.raises(ValueError, match="neither"):
        create_attention("auto", segment_lengths=[8])
    with pytest.raises(ValueError, match="dense_max_len"):
        create_attention("auto", dense_max_len=0)
    with pytest.raises(ValueError, match="is_causal"):
        create_attention("ring")(*(torch.randn(1, 2, 4, 8) for _ in range(3)), is_causal=False)


def auto_under_sequence_parallel(rank, world):
    """Child of a 2-rank gloo group: "auto" on this rank's zigzag shards."""
    import hf_dilated.distributed as hd
    from hf_dilated.distributed.layout import shard

    hd.setup_sequence_parallel(world, layout="zigzag")
    auto = create_attention("auto", dense_max_len=16)
    results = {}
    for n in (16, 64):
        g = torch.Generator().manual_seed(n)  # the same global tensors on every rank
        q, k, v = (torch.randn(1, 4, n, 8, generator=g) for _ in range(3))
        local = [shard(t, world, rank, "zigzag", dim=2) for t in (q, k, v)]
        kind, cfg = auto.choose(local[1].shape[2], q.device)
        results[n] = dict(kind=kind, segment_lengths=cfg.get("segment_lengths"), out=auto(*local), q=q, k=k, v=v)
    return results


def test_auto_under_a_sequence_parallel_group_runs_the_ring_kernels():
    """Real 2-process gloo group: auto picks ring / dilated_ring by the *global* length, and the
    gathered result is the single-process pattern's (float64 reference)."""
    from distributed_launch import launch
    from hf_dilated.distributed.layout import unshard

    outcomes = launch(auto_under_sequence_parallel, 2)
    for n, (kind, seg) in {16: ("ring", None), 64: ("dilated_ring", [16, 32, 64])}.items():
        per_rank = [o["result"][n] for o in outcomes]
        assert all(r["kind"] == kind and r["segment_lengths"] == seg for r in per_rank), per_rank
        out = unshard([r["out"] for r in per_rank], "zigzag", dim=2)
        q, k, v = (per_rank[0][name].double() for name in "qkv")
        want = dense_causal_reference(q, k, v) if kind == "ring" else dilated_reference(q, k, v, seg, [1, 2, 4])
        assert (out.double() - want).abs().max() < 1e-4, kind


def test_empty_heads_or_head_dim_are_clear_errors():
    """head_dim 0 used to surface as a ZeroDivisionError from the default scale."""
    from hf_dilated.ops import dilated_attention

    for shape in ((1, 2, 4, 0), (1, 0, 4, 8)):
        q = torch.randn(*shape)
        for kind in ("dense", "dilated", "ring", "block_sparse"):
            config = {"dilated": {"segment_lengths": [4], "dilation_rates": [1]},
                      "block_sparse": {"pattern": {"type": "local", "window": 2}}}.get(kind, {})
            with pytest.raises(ValueError, match="head_dim >= 1"):
                create_attention(kind, **config)(q, q, q)
        with pytest.raises(ValueError, match="head_dim >= 1"):
            dilated_attention(q, q, q, [4], [1])


def test_the_kinds_and_their_settings_are_documented_from_the_table():
    """nn.py's docstring and docs/api.md list each kind's configuration as the kinds' table has it
    (issue 33, item 4: a hand copy had drifted and omitted local_window)."""
    from pathlib import Path

    import hf_dilated.nn as nn_module
    from hf_dilated.kinds import KINDS as TABLE

    table = nn_module._kinds_table()
    for kind, row in TABLE.items():
        line = next(line for line in table.splitlines() if line.strip().startswith(repr(kind)))
        for setting in row.settings:
            assert setting in table, (kind, setting)
        assert line.strip().startswith(repr(kind))
    assert "local_window=None" in table and "far_group=1" in table and "far_window=None" in table
    assert table in nn_module.__doc__
    assert table in (Path(__file__).parent.parent / "docs" / "api.md").read_text()


def test_far_keys_through_the_table_need_the_rope_frequencies_and_match_the_kernel():
    """Issue 33, item 1: far_group / far_window reach the kernels as settings like every other field;
    the call brings the RoPE's frequencies, and the result is the kernel's with the far projections
    it would be given (each checked against the float64 reference in test_local_band.py)."""
    from hf_dilated.ops import dilated_attention
    from hf_dilated.ops.rope import far_projections

    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 48, 8), torch.randn(1, 2, 48, 8), torch.randn(1, 2, 48, 8)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
    attn = create_attention("dilated", segment_lengths=[16, 48], dilation_rates=[1, 3], local_window=8, far_group=4,
                            far_window=4)
    with pytest.raises(ValueError, match="rope_frequencies"):
        attn(q, k, v)
    q_far, k_far = far_projections(q, k, torch.arange(48)[None], 4, 4, inv_freq)
    expected = dilated_attention(q, k, v, [16, 48], [1, 3], local_window=8, q_far=q_far, k_far=k_far)
    torch.testing.assert_close(attn(q, k, v, rope_frequencies=inv_freq), expected, atol=0, rtol=0)
    with pytest.raises(ValueError, match="far_group"):
        create_attention("dilated", segment_lengths=[16], dilation_rates=[1], far_group=4)
    with pytest.raises(ValueError, match="far_window"):
        create_attention("dilated", segment_lengths=[16], dilation_rates=[1], local_window=4, far_group=2, far_window=8)


# --- found by a review of the plain-PyTorch API (each failed before its fix) --------------------

def test_cross_attention_with_more_queries_than_keys_matches_nn_multihead_attention():
    """nn.MultiheadAttention attends 7 queries over 3 keys (a decoder's target over a shorter
    memory); ours refused q_len > kv_len under every kind, and so nn.TransformerDecoderLayer with it
    failed whenever the target was the longer. Non-causal, it is plain cross-attention now (the
    dense kind), with a padding mask too; a causal call keeps its rule, named."""
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(8, 2, dtype=torch.float64).eval()
    q, kv = torch.randn(7, 2, 8, dtype=torch.float64), torch.randn(3, 2, 8, dtype=torch.float64)
    pad = torch.tensor([[False, False, True], [True, True, True]])  # the second row has no real key
    for kind in ("auto", "dense"):
        ours = DilatedMultiheadAttention(8, 2, dtype=torch.float64, attention=kind).eval()
        ours.load_state_dict(ref.state_dict())
        torch.testing.assert_close(ours(q, kv, kv)[0], ref(q, kv, kv, need_weights=False)[0], atol=1e-12, rtol=0)
        got = ours(q, kv, kv, key_padding_mask=pad)[0]
        torch.testing.assert_close(got[:, 0], ref(q[:, :1], kv[:, :1], kv[:, :1], key_padding_mask=pad[:1],
                                                  need_weights=False)[0][:, 0], atol=1e-12, rtol=0)
        assert torch.isfinite(got).all()
    with pytest.raises(ValueError, match=r"q_len \(7\) must not exceed kv_len \(3\)"):
        create_attention("dense")(q.view(7, 2, 2, 4).permute(1, 2, 0, 3), *[kv.view(3, 2, 2, 4).permute(1, 2, 0, 3)] * 2)
    layer = nn.TransformerDecoderLayer(8, 2, 16, dropout=0.0).eval()
    want = layer(torch.randn(12, 2, 8, generator=torch.Generator().manual_seed(1)),
                 torch.randn(9, 2, 8, generator=torch.Generator().manual_seed(2)))
    ours = DilatedMultiheadAttention(8, 2)
    ours.load_state_dict(layer.multihead_attn.state_dict())
    layer.multihead_attn = ours
    got = layer(torch.randn(12, 2, 8, generator=torch.Generator().manual_seed(1)),
                torch.randn(9, 2, 8, generator=torch.Generator().manual_seed(2)))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_settings_the_module_cannot_run_are_refused_at_construction():
    """far_group > 1 moves keys a model rotated by RoPE, which this module applies none of: it was
    accepted, and every forward then asked for rope_frequencies, which forward cannot take. A kind
    without attention dropout given dropout failed only at the first training forward."""
    with pytest.raises(ValueError, match="far_group=2: .*this module applies none"):
        DilatedMultiheadAttention(8, 2, attention="dilated", segment_lengths=[4, 16], dilation_rates=[1, 4],
                                  local_window=4, far_group=2)
    with pytest.raises(ValueError, match="dropout_p: 'block_sparse' attention does not implement attention dropout"):
        DilatedMultiheadAttention(8, 2, dropout=0.1, attention="block_sparse", pattern={"type": "local", "window": 2})
    DilatedMultiheadAttention(8, 2, dropout=0.1)  # "auto" chooses among kinds with dropout


def test_dense_kind_traces_with_torch_jit():
    """Under torch.jit.trace shapes are tensors: `enable_gqa=q.shape[1] != k.shape[1]` was a tensor,
    and sdpa raised (nn.MultiheadAttention traces)."""
    dense = create_attention("dense")
    q, k, v = (torch.randn(1, 4, 6, 8) for _ in range(3))
    traced = torch.jit.trace(lambda a, b, c: dense(a, b, c), (q, k, v), check_trace=False)
    torch.testing.assert_close(traced(q, k, v), dense(q, k, v))


def test_masks_scales_and_positions_of_the_wrong_kind_are_refused():
    """A float attention_mask in torch's additive form (0 keep, -inf drop) was read as 0/1 marks:
    the kept keys hidden, the rest read, nothing said (a float mask of 0/1 marks is one). An infinite scale gave NaN, True passed as a
    scale, and bool position_ids were taken as integers."""
    from hf_dilated import dilated_attention

    q, k, v = (torch.randn(1, 2, 6, 4) for _ in range(3))
    additive = torch.zeros(1, 6).masked_fill(torch.arange(6) >= 4, float("-inf"))
    for kind in ("dense", "dilated"):
        attention = create_attention(kind, **({} if kind == "dense" else dict(segment_lengths=[4], dilation_rates=[1])))
        with pytest.raises(ValueError, match="attention_mask: a float mask must hold only 1 .* pass attention_mask == 0"):
            attention(q, k, v, attention_mask=additive)
    real = additive == 0
    for marks in (real.long(), real.double()):  # (1 marks a real token, whatever its dtype)
        torch.testing.assert_close(dilated_attention(q, k, v, [4], [1], attention_mask=marks),
                                   dilated_attention(q, k, v, [4], [1], attention_mask=real))
    for scale in (float("inf"), float("nan"), True, 0.0):
        with pytest.raises(ValueError, match="scale must be a positive finite number"):
            dilated_attention(q, k, v, [4], [1], scale=scale)
    with pytest.raises(TypeError, match="position_ids must be an integer tensor, got torch.bool"):
        dilated_attention(q, k, v, [4], [1], position_ids=torch.ones(1, 6, dtype=torch.bool))


def test_auto_with_negative_positions_computes_its_own_pattern():
    """"auto" chose dense when the largest position fit in the first segment; negative positions lie
    before it (segment -1), where its pattern is not dense: 1.57 off its own pattern's reference."""
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 2, 8, 4, generator=g, dtype=torch.float64) for _ in range(2))
    positions = torch.arange(8)[None] - 3
    auto = create_attention("auto", dense_max_len=8)
    assert auto.choose(8, "cpu", position_ids=positions)[0] == "dilated"
    want = dilated_reference(q, k, k, [8], [1], position_ids=positions)
    assert (auto(q, k, k, position_ids=positions) - want).abs().max().item() < 1e-12
