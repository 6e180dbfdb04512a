"""hf_dilated.ops.backend: the kernel choice, the CPU path, the argument layouts handed to the CUDA
kernels (checked on the CPU with meta tensors and recording stand-ins), and every CUDA path
against a float64 reference (marked `cuda`: skipped without a GPU)."""
from __future__ import annotations

import math

import pytest
import torch

from hf_dilated.ops import backend
from hf_dilated.ops.backend import (CPU_FLASH, CUDA_EFFICIENT, CUDA_FLASH, CUDA_MATH, attention_backward,
                                    attention_forward, backward_with, choose_kernel, forward_with)

BF16, FP16, FP32, FP64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
H100 = dict(capability=(9, 0), flash_enabled=True, efficient_enabled=True, flash_available=True, flash_impl=None)


# --------------------------------------------------------------------------------------------
# float64 reference: softmax(q k^T * scale + mask) v with plain torch ops; GQA expanded here only.
# --------------------------------------------------------------------------------------------


def reference(q, k, v, *, is_causal, scale, bias=None, dout=None):
    """(out, lse, dq, dk, dv) in float64 from the given (possibly low-precision) values."""
    q64, k64, v64 = (t.detach().to(FP64).requires_grad_(dout is not None) for t in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    ke, ve = k64.repeat_interleave(groups, dim=1), v64.repeat_interleave(groups, dim=1)
    s = torch.matmul(q64, ke.transpose(-1, -2)) * scale
    if bias is not None:
        s = s + bias.to(FP64)
    if is_causal:  # top-left: query t sees keys 0..t
        n, m = s.shape[-2:]
        s = s.masked_fill(~torch.ones(n, m, dtype=torch.bool, device=s.device).tril(), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    out = torch.matmul(torch.softmax(s, dim=-1), ve)
    if dout is None:
        return out.detach(), lse.detach(), None, None, None
    dq, dk, dv = torch.autograd.grad(out, (q64, k64, v64), dout.to(FP64))
    return out.detach(), lse.detach(), dq, dk, dv


def rel_err(x, ref, floor=1e-6):
    """Largest error relative to the reference's largest magnitude (at least `floor`: a gradient
    that is structurally 0, e.g. dQ with one key, is judged against the other gradients' scale)."""
    return ((x.to(FP64) - ref).abs().max() / ref.abs().max().clamp_min(floor)).item()


def grad_errs(grads, refs):
    floor = 1e-2 * max(r.abs().max().item() for r in refs)
    return [rel_err(g, r, floor) for g, r in zip(grads, refs)]


def make_inputs(batch, q_heads, kv_heads, q_len, kv_len, head_dim, dtype, device="cpu", bias=False, seed=0,
                causal=False):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(batch, q_heads, q_len, head_dim, generator=g).to(device=device, dtype=dtype)
    k = torch.randn(batch, kv_heads, kv_len, head_dim, generator=g).to(device=device, dtype=dtype)
    v = torch.randn(batch, kv_heads, kv_len, head_dim, generator=g).to(device=device, dtype=dtype)
    dout = torch.randn(batch, q_heads, q_len, head_dim, generator=g).to(device=device, dtype=dtype)
    attn_bias = None
    if bias:  # a float mask with holes; key 0 always visible so that no row is empty
        b = torch.randn(batch, 1, q_len, kv_len, generator=g)
        holes = torch.rand(batch, 1, q_len, kv_len, generator=g) < 0.2
        holes[..., 0] = False
        attn_bias = b.masked_fill(holes, float("-inf")).to(device=device, dtype=dtype)
    return q, k, v, dout, attn_bias


# --------------------------------------------------------------------------------------------
# The choice (pure; CPU)
# --------------------------------------------------------------------------------------------


def _pick(dtype=BF16, head_dim=64, *, bias=False, causal=False, q_len=128, kv_len=128, q_heads=8, kv_heads=8,
          needs_grad=False, **over):
    kw = dict(H100)
    kw.update(over)
    return choose_kernel("cuda", dtype, head_dim, has_bias=bias, is_causal=causal, q_len=q_len, kv_len=kv_len,
                         q_heads=q_heads, kv_heads=kv_heads, needs_grad=needs_grad, **kw)


@pytest.mark.parametrize("dtype", [BF16, FP16])
@pytest.mark.parametrize("head_dim", [8, 64, 96, 128, 256])
@pytest.mark.parametrize("needs_grad", [False, True])
def test_choice_flash_for_half_without_bias(dtype, head_dim, needs_grad):
    assert _pick(dtype, head_dim, needs_grad=needs_grad) == CUDA_FLASH


@pytest.mark.parametrize("dtype", [BF16, FP16])
@pytest.mark.parametrize("head_dim,expected", [(264, CUDA_EFFICIENT), (20, CUDA_MATH), (100, CUDA_MATH),
                                               (300, CUDA_MATH)])
def test_choice_head_dims_flash_cannot_take(dtype, head_dim, expected):
    # above 256: the efficient kernel; off the 8-element grid it raises too (H100, 2026-11-26:
    # "query is not correctly aligned (strideM)" at 20 and 300): the math path
    assert _pick(dtype, head_dim) == expected
    assert _pick(dtype, head_dim, bias=True) == expected


@pytest.mark.parametrize("dtype", [BF16, FP16, FP32])
@pytest.mark.parametrize("head_dim", [64, 128, 256, 96, 304])
@pytest.mark.parametrize("gqa", [False, True])
def test_choice_bias_goes_to_efficient(dtype, head_dim, gqa):
    assert _pick(dtype, head_dim, bias=True, kv_heads=2 if gqa else 8) == CUDA_EFFICIENT


@pytest.mark.parametrize("head_dim", [64, 128, 256, 96, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_choice_float32_efficient_float64_math(head_dim, bias):
    assert _pick(FP32, head_dim, bias=bias) == CUDA_EFFICIENT
    assert _pick(FP64, head_dim, bias=bias) == CUDA_MATH


@pytest.mark.parametrize("q_heads,kv_heads", [(8, 8), (8, 2), (32, 8), (8, 1)])
def test_choice_gqa_stays_on_flash(q_heads, kv_heads):
    assert _pick(BF16, 128, q_heads=q_heads, kv_heads=kv_heads) == CUDA_FLASH
    assert _pick(BF16, 128, q_heads=q_heads, kv_heads=kv_heads, causal=True) == CUDA_FLASH


@pytest.mark.parametrize("q_len,kv_len,expected", [
    (128, 128, CUDA_FLASH), (1, 1, CUDA_FLASH), (17, 100, CUDA_FLASH), (1, 1000, CUDA_FLASH),
    (100, 17, CUDA_EFFICIENT), (2, 1, CUDA_EFFICIENT),
])
def test_choice_causal_alignment(q_len, kv_len, expected):
    # flash is bottom-right aligned: exact for top-left only when q_len <= kv_len (keys cut to q_len)
    assert _pick(BF16, 64, causal=True, q_len=q_len, kv_len=kv_len) == expected
    # without causality any lengths go to flash
    assert _pick(BF16, 64, causal=False, q_len=q_len, kv_len=kv_len) == CUDA_FLASH


@pytest.mark.parametrize("q_len,kv_len", [(0, 5), (5, 0), (0, 0)])
def test_choice_empty_calls_avoid_flash(q_len, kv_len):
    assert _pick(BF16, 64, q_len=q_len, kv_len=kv_len) == CUDA_EFFICIENT


def test_choice_capability():
    assert _pick(FP16, 64, capability=(8, 0)) == CUDA_FLASH
    assert _pick(BF16, 64, capability=(12, 0)) == CUDA_FLASH
    assert _pick(BF16, 64, capability=(12, 1)) == CUDA_FLASH
    assert _pick(BF16, 64, capability=(13, 0)) == CUDA_EFFICIENT  # beyond the built flash kernels
    assert _pick(FP16, 64, capability=(7, 5)) == CUDA_EFFICIENT  # flash needs sm80
    assert _pick(BF16, 64, capability=(7, 5)) == CUDA_MATH  # and so does bf16 on the efficient kernel
    assert _pick(FP32, 64, capability=(7, 0)) == CUDA_EFFICIENT
    assert _pick(FP16, 64, capability=(3, 7)) == CUDA_MATH


@pytest.mark.parametrize("cap", [(8, 6), (8, 9)])
def test_choice_sm86_sm89_large_head_backward(cap):
    # as sdpa: the flash backward for head_dim > 192 lacks shared memory there
    assert _pick(BF16, 256, capability=cap, needs_grad=False) == CUDA_FLASH
    assert _pick(BF16, 256, capability=cap, needs_grad=True) == CUDA_EFFICIENT
    assert _pick(BF16, 192, capability=cap, needs_grad=True) == CUDA_FLASH
    assert _pick(BF16, 256, capability=(9, 0), needs_grad=True) == CUDA_FLASH


def test_choice_flags_and_build():
    assert _pick(BF16, flash_enabled=False) == CUDA_EFFICIENT
    assert _pick(BF16, flash_available=False) == CUDA_EFFICIENT
    assert _pick(BF16, flash_enabled=False, efficient_enabled=False) == CUDA_MATH
    assert _pick(FP32, efficient_enabled=False) == CUDA_MATH
    assert _pick(BF16, bias=True, efficient_enabled=False) == CUDA_MATH


def test_choice_reads_the_torch_flags_when_not_given():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    kw = dict(has_bias=False, is_causal=False, q_len=64, kv_len=64, capability=(9, 0), flash_available=True)
    assert choose_kernel("cuda", BF16, 64, **kw) == CUDA_FLASH
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        assert choose_kernel("cuda", BF16, 64, **kw) == CUDA_EFFICIENT
    with sdpa_kernel([SDPBackend.MATH]):
        assert choose_kernel("cuda", BF16, 64, **kw) == CUDA_MATH
    assert choose_kernel("cuda", BF16, 64, **kw) == CUDA_FLASH


def test_choice_follows_the_flash_torch_holds():
    """A newer FlashAttention activated in place of torch's own (backend.activate_flash, or torch's
    activate_flash_attention_impl) raises on any GPU but its own: flash is chosen only there."""
    assert _pick(BF16, flash_impl=None, capability=(8, 0)) == CUDA_FLASH  # torch's own FlashAttention-2
    assert _pick(BF16, flash_impl="FA3", capability=(9, 0)) == CUDA_FLASH
    assert _pick(BF16, flash_impl="FA3", capability=(8, 0)) == CUDA_EFFICIENT
    assert _pick(BF16, flash_impl="FA3", capability=(10, 0)) == CUDA_EFFICIENT
    assert _pick(BF16, flash_impl="FA4", capability=(10, 0)) == CUDA_FLASH
    assert _pick(BF16, flash_impl="FA4", capability=(12, 0)) == CUDA_EFFICIENT
    assert _pick(BF16, 64, bias=True, flash_impl="FA3") == CUDA_EFFICIENT  # a bias never goes to flash
    # FA4's Hopper backward asserts that deterministic algorithms are off
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        assert _pick(BF16, flash_impl="FA4", capability=(9, 0), needs_grad=True) == CUDA_EFFICIENT
        assert _pick(BF16, flash_impl="FA4", capability=(9, 0), needs_grad=False) == CUDA_FLASH
        assert _pick(BF16, flash_impl="FA4", capability=(10, 0), needs_grad=True) == CUDA_FLASH
        assert _pick(BF16, flash_impl="FA3", capability=(9, 0), needs_grad=True) == CUDA_FLASH
    finally:
        torch.use_deterministic_algorithms(False)
    assert _pick(BF16, flash_impl="FA4", capability=(9, 0), needs_grad=True) == CUDA_FLASH


def test_flash_versions_tried_where_the_gpu_runs_them_fa3_first_on_hopper():
    assert backend.flash_impls_for((9, 0), ["FA3", "FA4"]) == ["FA3", "FA4"]
    assert backend.flash_impls_for((9, 0), ["FA4"]) == ["FA4"]
    assert backend.flash_impls_for((9, 0), ["FA3"]) == ["FA3"]
    assert backend.flash_impls_for((10, 0), ["FA3", "FA4"]) == ["FA4"]
    assert backend.flash_impls_for((8, 0), ["FA3", "FA4"]) == []
    assert backend.flash_impls_for((9, 0), []) == []


def _installed(package: str) -> bool:
    import importlib.util
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # a parent package missing or broken
        return False


def test_activate_flash_refuses_what_it_cannot_do_and_names_the_argument():
    before = backend.active_flash()
    with pytest.raises(ValueError, match="impl"):
        backend.activate_flash("FA5")
    for impl, package in (("FA3", "flash_attn_interface"), ("FA4", "flash_attn.cute")):
        if torch.cuda.is_available() and _installed(package):
            continue  # it can be activated here: the CUDA test runs it
        with pytest.raises(RuntimeError, match=f"impl='{impl}'"):
            backend.activate_flash(impl)
        assert backend.active_flash() == before  # nothing half done
    if not torch.cuda.is_available():
        assert backend.activate_flash("auto") is None and backend.active_flash() is None  # torch's own stays
    assert backend.activate_flash("FA2") is None and backend.active_flash() is None


@pytest.mark.parametrize("device_type", ["cpu", "meta", "mps"])
@pytest.mark.parametrize("dtype", [BF16, FP16, FP32, FP64])
@pytest.mark.parametrize("bias", [False, True])
def test_choice_non_cuda_is_the_cpu_kernel(device_type, dtype, bias):
    # no CUDA query at all on this branch (capability etc. left None on a CUDA-less machine)
    assert choose_kernel(device_type, dtype, 300, has_bias=bias, is_causal=True, q_len=5, kv_len=3,
                         q_heads=4, kv_heads=2) == CPU_FLASH


def test_choice_rejects_bad_head_ratio():
    with pytest.raises(ValueError):
        _pick(q_heads=6, kv_heads=4)


# --------------------------------------------------------------------------------------------
# The CPU path: unchanged, and right against the reference
# --------------------------------------------------------------------------------------------

CPU_SHAPES = [  # (q_heads, kv_heads, q_len, kv_len)
    (4, 4, 17, 17), (4, 2, 17, 17), (4, 2, 1, 100), (4, 1, 17, 100), (2, 2, 100, 17), (4, 2, 33, 1),
]


@pytest.mark.parametrize("dtype", [FP32, FP64])
@pytest.mark.parametrize("shape", CPU_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_cpu_path_matches_reference(dtype, shape, causal, bias):
    hq, hk, n, m = shape
    q, k, v, dout, attn_bias = make_inputs(2, hq, hk, n, m, 16, dtype, bias=bias, causal=causal)
    scale = 16 ** -0.5
    out, lse = attention_forward(q, k, v, is_causal=causal, scale=scale, attn_bias=attn_bias)
    dq, dk, dv = attention_backward(dout, q, k, v, out, lse, is_causal=causal, scale=scale, attn_bias=attn_bias)
    r_out, r_lse, r_dq, r_dk, r_dv = reference(q, k, v, is_causal=causal, scale=scale, bias=attn_bias, dout=dout)
    tol = 1e-10 if dtype == FP64 else 1e-4
    assert out.dtype == dtype and lse.shape == (2, hq, n)
    assert dk.shape == k.shape and dv.shape == v.shape and dq.shape == q.shape
    assert rel_err(out, r_out) < tol and max(grad_errs((dq, dk, dv), (r_dq, r_dk, r_dv))) < tol
    assert (lse.to(FP64) - r_lse).abs().max().item() < tol * 10


def test_cpu_path_is_the_cpu_kernel_bit_for_bit(monkeypatch):
    # the CPU branch does not consult the choice and calls the same op with the same arguments
    def boom(*a, **k):
        raise AssertionError("the CPU path consulted the CUDA choice")
    monkeypatch.setattr(backend, "_choose", boom)
    monkeypatch.setattr(backend, "choose_kernel", boom)
    q, k, v, dout, attn_bias = make_inputs(1, 4, 2, 33, 40, 16, FP32, bias=True)
    out, lse = attention_forward(q, k, v, is_causal=True, scale=0.3, attn_bias=attn_bias)
    r_out, r_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, True, attn_mask=attn_bias, scale=0.3)
    assert torch.equal(out, r_out) and torch.equal(lse, r_lse)
    grads = attention_backward(dout, q, k, v, out, lse, is_causal=True, scale=0.3, attn_bias=attn_bias)
    r_grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, True, attn_mask=attn_bias, scale=0.3)
    assert all(torch.equal(a, b) for a, b in zip(grads, r_grads))


def test_cpu_bf16_path_close_to_reference():
    q, k, v, dout, _ = make_inputs(1, 4, 2, 64, 64, 32, BF16)
    out, lse = attention_forward(q, k, v, is_causal=True, scale=32 ** -0.5)
    r_out, r_lse, *_ = reference(q, k, v, is_causal=True, scale=32 ** -0.5)
    assert out.dtype == BF16 and lse.dtype == FP32
    assert rel_err(out, r_out) < 2e-2 and (lse.to(FP64) - r_lse).abs().max() < 1e-2


# --------------------------------------------------------------------------------------------
# The math path (device-agnostic plain torch ops; runs here on the CPU)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [FP32, FP64])
@pytest.mark.parametrize("shape", CPU_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_math_path_matches_reference(dtype, shape, causal, bias):
    hq, hk, n, m = shape
    q, k, v, dout, attn_bias = make_inputs(2, hq, hk, n, m, 16, dtype, bias=bias)
    scale = 0.25
    out, lse = forward_with(CUDA_MATH, q, k, v, is_causal=causal, scale=scale, attn_bias=attn_bias)
    dq, dk, dv = backward_with(CUDA_MATH, dout, q, k, v, out, lse, is_causal=causal, scale=scale,
                               attn_bias=attn_bias)
    r_out, r_lse, r_dq, r_dk, r_dv = reference(q, k, v, is_causal=causal, scale=scale, bias=attn_bias, dout=dout)
    tol = 1e-10 if dtype == FP64 else 1e-5
    assert lse.shape == (2, hq, n) and dk.shape == k.shape
    assert rel_err(out, r_out) < tol and max(grad_errs((dq, dk, dv), (r_dq, r_dk, r_dv))) < tol
    assert (lse.to(FP64) - r_lse).abs().max().item() < tol * 10


def test_math_path_empty_rows():
    q, k, v, dout, _ = make_inputs(1, 2, 1, 3, 4, 8, FP32)
    bias = torch.zeros(3, 4)
    bias[1] = float("-inf")  # row 1 sees nothing
    out, lse = forward_with(CUDA_MATH, q, k, v, is_causal=False, scale=1.0, attn_bias=bias)
    assert torch.isneginf(lse[:, :, 1]).all() and (out[:, :, 1] == 0).all()
    dq, dk, dv = backward_with(CUDA_MATH, dout, q, k, v, out, lse, is_causal=False, scale=1.0, attn_bias=bias)
    assert all(torch.isfinite(t).all() for t in (dq, dk, dv))
    assert (dq[:, :, 1] == 0).all()


# --------------------------------------------------------------------------------------------
# Layouts handed to the CUDA kernels, checked on the CPU (meta tensors and recording stand-ins)
# --------------------------------------------------------------------------------------------


class Recorder:
    """Stands in for torch.ops.aten inside backend: records each call, runs the real op (meta
    tensors run its meta function) or a given fake."""

    def __init__(self, fakes=None):
        self.calls = []
        self.fakes = fakes or {}

    def __getattr__(self, name):
        real = getattr(torch.ops.aten, name)

        def call(*args, **kwargs):
            self.calls.append((name, args, kwargs))
            if name in self.fakes:
                return self.fakes[name](*args, **kwargs)
            return real(*args, **kwargs)
        return call


def meta_inputs(b, hq, hk, n, m, d, dtype=BF16):
    q = torch.empty(b, hq, n, d, device="meta", dtype=dtype)
    k = torch.empty(b, hk, m, d, device="meta", dtype=dtype)
    v = torch.empty(b, hk, m, d, device="meta", dtype=dtype)
    return q, k, v


def test_flash_forward_arguments(monkeypatch):
    rec = Recorder()
    monkeypatch.setattr(backend, "_aten", rec)
    q, k, v = meta_inputs(2, 8, 2, 17, 33, 64)
    out, lse = forward_with(CUDA_FLASH, q, k, v, is_causal=False, scale=0.125)
    (name, args, kwargs), = rec.calls
    assert name == "_flash_attention_forward"
    qt, kt, vt, cq, ck, max_q, max_k, p, causal, debug = args
    # (batch, seq, heads, d); K/V keep their 2 heads (no expansion)
    assert qt.shape == (2, 17, 8, 64) and kt.shape == (2, 33, 2, 64) and vt.shape == (2, 33, 2, 64)
    assert all(t.stride(-1) == 1 for t in (qt, kt, vt))
    assert cq is None and ck is None and (max_q, max_k) == (17, 33) and p == 0.0
    assert causal is False and debug is False and kwargs == {"scale": 0.125}
    assert out.shape == q.shape and out.dtype == BF16
    assert lse.shape == (2, 8, 17) and lse.dtype == FP32


def test_flash_causal_short_queries_drop_unseen_keys(monkeypatch):
    rec = Recorder()
    monkeypatch.setattr(backend, "_aten", rec)
    q, k, v = meta_inputs(1, 4, 2, 17, 100, 64)
    forward_with(CUDA_FLASH, q, k, v, is_causal=True, scale=0.1)
    _, args, _ = rec.calls[0]
    assert args[1].shape == (1, 17, 2, 64) and args[5:7] == (17, 17) and args[8] is True
    with pytest.raises(ValueError):
        forward_with(CUDA_FLASH, *meta_inputs(1, 4, 2, 100, 17, 64), is_causal=True, scale=0.1)
    with pytest.raises(ValueError):
        forward_with(CUDA_FLASH, q, k, v, is_causal=False, scale=0.1, attn_bias=torch.zeros(17, 100))


def test_flash_backward_arguments_and_key_padding(monkeypatch):
    # a fake backward on CPU tensors: gradients of ones, to see the dropped keys padded with zeros
    def fake_bwd(dout, q, k, v, out, lse, cq, ck, max_q, max_k, p, causal, rng, unused, *, scale):
        return torch.ones_like(q), torch.ones_like(k), torch.ones_like(v)
    rec = Recorder({"_flash_attention_backward": fake_bwd})
    monkeypatch.setattr(backend, "_aten", rec)
    q, k, v, dout, _ = make_inputs(2, 4, 2, 17, 100, 64, BF16)
    out = torch.randn(2, 4, 17, 64, dtype=FP32)  # merged out in another dtype
    lse = torch.randn(2, 4, 40, dtype=FP64)[:, :, 3:20]  # a float64 strided view
    dq, dk, dv = backward_with(CUDA_FLASH, dout, q, k, v, out, lse, is_causal=True, scale=0.2)
    (name, args, kwargs), = rec.calls
    d_t, qt, kt, vt, o_t, lse_t, cq, ck, max_q, max_k, p, causal, rng, unused = args
    assert name == "_flash_attention_backward" and kwargs == {"scale": 0.2}
    assert qt.shape == (2, 17, 4, 64) and kt.shape == (2, 17, 2, 64)  # keys cut to q_len
    assert d_t.dtype == BF16 and o_t.dtype == BF16 and d_t.shape == o_t.shape == (2, 17, 4, 64)
    assert lse_t.dtype == FP32 and lse_t.shape == (2, 4, 17) and lse_t.is_contiguous()
    assert torch.equal(lse_t, lse.float())
    assert cq is None and ck is None and (max_q, max_k) == (17, 17) and causal is True and p == 0.0
    assert rng.dtype == torch.uint64 and rng.shape == (2,)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    assert (dk[:, :, :17] == 1).all() and (dk[:, :, 17:] == 0).all() and (dv[:, :, 17:] == 0).all()


def test_flash_operands_copied_only_when_needed():
    base = torch.randn(2, 8, 64, 64, dtype=BF16)
    view = base.transpose(1, 2)
    assert backend._flash_operand(view) is view  # the usual layout: no copy
    seg = base.unflatten(2, (4, 16)).transpose(1, 2).flatten(0, 1).transpose(1, 2)  # a segment view
    assert backend._flash_operand(seg) is seg
    odd = torch.randn(2 * 8 * 64 * 64 + 3, dtype=BF16)[3:].view(2, 64, 8, 64)  # start off the grid
    assert backend._flash_operand(odd) is not odd and backend._flash_operand(odd).storage_offset() == 0
    strided = torch.randn(2, 64, 8, 128, dtype=BF16)[..., ::2]  # last dim strided
    assert backend._flash_operand(strided).stride(-1) == 1
    odd_dim = torch.randn(2, 8, 64, 12)  # contiguous, head_dim off the grid: a copy would not help
    assert backend._efficient_operand(odd_dim) is odd_dim
    odd_dim_view = odd_dim.transpose(1, 2)
    assert backend._efficient_operand(odd_dim_view).is_contiguous()


@pytest.mark.parametrize("out_layout", ["bhnd", "segment_view", "bnhd"])
@pytest.mark.parametrize("hq,hk", [(4, 2), (4, 4), (1, 1)])
def test_efficient_backward_out_layout(monkeypatch, out_layout, hq, hk):
    """Issue 34's fault: the efficient backward walks `out` rows with the hard-coded stride
    heads * head_dim (for fp16/bf16), so `out` must be (batch, q_len, heads, d)-contiguous."""
    rec = Recorder()
    monkeypatch.setattr(backend, "_aten", rec)
    b, n, m, d = 2, 50, 33, 64
    q, k, v = meta_inputs(b, hq, hk, n, m, d)
    if out_layout == "bhnd":  # what the dilated backward passes: the merged out, contiguous
        out = torch.empty(b, hq, n, d, device="meta", dtype=BF16)
    elif out_layout == "segment_view":  # a strided view, as _segment_view(out, w)
        out = torch.empty(1, hq, b * n, d, device="meta", dtype=BF16).unflatten(2, (b, n)).transpose(1, 2).flatten(0, 1)
    else:  # sdpa's own layout: passed through
        out = torch.empty(b, n, hq, d, device="meta", dtype=BF16).transpose(1, 2)
    lse = torch.empty(b, hq, n, device="meta", dtype=FP32)
    dout = torch.empty(b, hq, n, d, device="meta", dtype=BF16)
    dq, dk, dv = backward_with(CUDA_EFFICIENT, dout, q, k, v, out, lse, is_causal=True, scale=0.1)
    (name, args, kwargs), = rec.calls
    assert name == "_scaled_dot_product_efficient_attention_backward"
    d_a, q_a, k_a, v_a, bias_a, out_a, lse_a, seed, offset, p, mask, causal = args
    assert out_a.shape == (b, hq, n, d) and out_a.transpose(1, 2).is_contiguous()
    assert out_a.stride(2) == hq * d  # the kernel's o_strideM()
    if out_layout == "bnhd":
        assert out_a is out
    # lse: float32, padded to 32 queries, contiguous (strides B and H only are read)
    assert lse_a.dtype == FP32 and lse_a.shape == (b, hq, 64) and lse_a.is_contiguous()
    assert k_a.shape == (b, hq, m, d) and all(t.stride(-1) == 1 for t in (q_a, k_a, v_a))
    assert bias_a is None and p == 0.0 and tuple(mask) == (True, True, True, False) and causal is True
    assert kwargs == {"scale": 0.1}
    assert dk.shape == (b, hk, m, d) and dv.shape == (b, hk, m, d) and dq.shape == q.shape


def test_efficient_forward_arguments(monkeypatch):
    rec = Recorder()
    monkeypatch.setattr(backend, "_aten", rec)
    q, k, v = meta_inputs(2, 8, 2, 17, 33, 64)
    out, lse = forward_with(CUDA_EFFICIENT, q, k, v, is_causal=True, scale=0.1,
                            attn_bias=torch.zeros(17, 33, device="meta", dtype=BF16))
    (name, args, kwargs), = rec.calls
    assert name == "_scaled_dot_product_efficient_attention"
    q_a, k_a, v_a, bias_a, lse_flag, p, causal = args
    assert k_a.shape == (2, 8, 33, 64) and lse_flag is True and p == 0.0 and causal is True
    assert bias_a.shape == (2, 8, 17, 33) and bias_a.stride(-1) == 1 and bias_a.stride(2) % 16 == 0
    assert out.shape == q.shape and lse.shape == (2, 8, 17) and lse.dtype == FP32


@pytest.mark.parametrize("bias_shape", [(17, 33), (2, 1, 17, 33), (2, 8, 17, 33), (1, 8, 1, 33), (2, 1, 17, 1)])
def test_cuda_bias_layout(bias_shape):
    q, k, _, _, _ = make_inputs(2, 8, 8, 17, 33, 16, FP16)
    bias = torch.randn(bias_shape)
    got = backend._cuda_bias(bias, q, k)
    assert got.shape == (2, 8, 17, 33) and got.dtype == FP16
    assert got.stride(-1) == 1 and got.stride(2) % 16 == 0 and got.storage_offset() % 16 == 0
    # each row's storage extends to its end rounded up to 16 elements (the kernel's vector reads)
    last = sum((s - 1) * st for s, st in zip(got.shape, got.stride()))
    assert got.untyped_storage().nbytes() >= (last - last % 16 + 16) * got.element_size()
    assert torch.equal(got, bias.to(FP16).expand(2, 8, 17, 33))
    # broadcast dims stay broadcast: the buffer holds only what the bias has
    assert got.untyped_storage().nbytes() <= math.prod(bias_shape[:-1] or (1,)) * 48 * got.element_size()


def test_cuda_bias_aligned_and_typed_is_not_copied():
    q, k, _, _, _ = make_inputs(1, 4, 4, 10, 32, 16, FP16)
    bias = torch.randn(1, 1, 10, 32, dtype=FP16)
    got = backend._cuda_bias(bias, q, k)
    assert got.data_ptr() == bias.data_ptr() and got.stride(1) == 0
    odd = torch.randn(10, 40, dtype=FP16)[:, :32]  # rows 40 apart: not a multiple of 16 -> copied
    assert backend._cuda_bias(odd, q, k).stride(2) % 16 == 0
    assert backend._cuda_bias(None, q, k) is None


def test_pad_lse():
    lse = torch.randn(2, 3, 40, dtype=FP64)[..., 2:35]
    padded = backend._pad_lse(lse)
    assert padded.shape == (2, 3, 64) and padded.dtype == FP32 and padded.is_contiguous()
    assert torch.equal(padded[..., :33], lse.float())


def test_large_batches_go_in_chunks(monkeypatch):
    calls = []

    def fake_fwd(q, k, v, cq, ck, max_q, max_k, p, causal, debug, *, scale):
        calls.append(q.shape[0])
        b, n, h, d = q.shape
        return q * 2, torch.full((b, h, n), float(len(calls))), None, None, None
    monkeypatch.setattr(backend, "_aten", Recorder({"_flash_attention_forward": fake_fwd}))
    monkeypatch.setattr(backend, "_MAX_GRID_BATCH", 2)
    q, k, v, _, _ = make_inputs(5, 2, 1, 3, 3, 8, BF16)
    out, lse = forward_with(CUDA_FLASH, q, k, v, is_causal=False, scale=1.0)
    assert calls == [2, 2, 1] and torch.equal(out, q * 2)
    assert lse[:, 0, 0].tolist() == [1, 1, 2, 2, 3]


# --------------------------------------------------------------------------------------------
# CUDA: every kernel path against the float64 reference (skipped without a GPU)
# --------------------------------------------------------------------------------------------

# relative to the reference's largest magnitude (forward), and to each gradient's
TOL = {BF16: (2e-2, 5e-2, 1e-2), FP16: (4e-3, 1e-2, 2e-3), FP32: (1e-4, 5e-4, 1e-4), FP64: (1e-10, 1e-9, 1e-10)}
LENGTHS = [(17, 17), (100, 100), (1, 1), (1, 17), (1, 1000), (17, 100), (100, 17), (1000, 1000)]
KERNEL_DTYPES = [(CUDA_FLASH, BF16), (CUDA_FLASH, FP16), (CUDA_EFFICIENT, BF16), (CUDA_EFFICIENT, FP16),
                 (CUDA_EFFICIENT, FP32), (CUDA_MATH, BF16), (CUDA_MATH, FP32), (CUDA_MATH, FP64)]


def _cuda_supports(kernel, dtype, causal, bias, n, m, head_dim=64):
    if kernel == CUDA_FLASH:
        return (not bias and not (causal and n > m) and torch.cuda.get_device_capability() >= (8, 0)
                and backend._flash_built() and head_dim % 8 == 0 and head_dim <= 256)
    if kernel == CUDA_EFFICIENT:  # 128-bit row loads: head_dim on the vector grid (choose_kernel)
        return (head_dim % (8 if dtype in (BF16, FP16) else 4) == 0
                and (dtype != BF16 or torch.cuda.get_device_capability() >= (8, 0)))
    return True


def check_cuda_path(kernel, dtype, hq, hk, n, m, causal, bias, head_dim=64, batch=2, seed=0):
    if not _cuda_supports(kernel, dtype, causal, bias, n, m, head_dim):
        pytest.skip(f"{kernel} does not serve this case")
    q, k, v, dout, attn_bias = make_inputs(batch, hq, hk, n, m, head_dim, dtype, device="cuda", bias=bias,
                                           seed=seed)
    scale = head_dim ** -0.5
    out, lse = forward_with(kernel, q, k, v, is_causal=causal, scale=scale, attn_bias=attn_bias)
    dq, dk, dv = backward_with(kernel, dout, q, k, v, out, lse, is_causal=causal, scale=scale, attn_bias=attn_bias)
    torch.cuda.synchronize()  # surface an asynchronous fault here, in this test
    r_out, r_lse, r_dq, r_dk, r_dv = reference(q, k, v, is_causal=causal, scale=scale, bias=attn_bias, dout=dout)
    t_out, t_grad, t_lse = TOL[dtype]
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == (batch, hq, n) and lse.dtype in (FP32, FP64)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    g_errs = grad_errs((dq, dk, dv), (r_dq, r_dk, r_dv))
    errs = {"out": rel_err(out, r_out), "dq": g_errs[0], "dk": g_errs[1], "dv": g_errs[2],
            "lse": (lse.to(FP64) - r_lse).abs().max().item()}
    assert errs["out"] < t_out and errs["lse"] < t_lse, errs
    assert max(errs["dq"], errs["dk"], errs["dv"]) < t_grad, errs
    return out, lse, (dq, dk, dv)


@pytest.mark.cuda
@pytest.mark.parametrize("kernel,dtype", KERNEL_DTYPES, ids=lambda x: str(x).replace("torch.", ""))
@pytest.mark.parametrize("hq,hk", [(4, 2), (4, 4)], ids=["gqa", "mha"])
@pytest.mark.parametrize("n,m", LENGTHS, ids=[f"q{n}k{m}" for n, m in LENGTHS])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_cuda_path_matches_reference(kernel, dtype, hq, hk, n, m, causal, bias):
    check_cuda_path(kernel, dtype, hq, hk, n, m, causal, bias)


@pytest.mark.cuda
def test_cuda_newest_flash_keeps_every_flash_call_exact():
    """activate_flash("auto") puts the newest FlashAttention installed for this GPU in place of torch's
    own (or keeps torch's own where none is): the flash path's forward and backward, with GQA and
    causal, and the band's sliding window, against the float64 reference; then torch's own again."""
    name = backend.activate_flash("auto")
    try:
        assert name == backend.active_flash() and name in (None, *backend.FLASH_IMPLS)
        if name is None:  # torch's own kernels: test_cuda_path_matches_reference and the band's tests run them
            pytest.skip("no newer FlashAttention (FA3, FA4) is installed for this GPU")
        check_cuda_path(CUDA_FLASH, BF16, 8, 2, 256, 256, True, False, head_dim=128, batch=2)
        check_cuda_path(CUDA_FLASH, FP16, 4, 4, 64, 192, False, False, head_dim=64, batch=1)
        n, m, window = 96, 256, 40  # the queries are the last n of the m keys; query i reads i - window < j <= i
        q, k, v, _, _ = make_inputs(1, 8, 2, n, m, 64, BF16, device="cuda")
        out, lse = backend.band_forward(q, k, v, window=window, scale=0.125)
        pos_q = torch.arange(m - n, m, device="cuda")[:, None]
        pos_k = torch.arange(m, device="cuda")[None, :]
        bias = torch.zeros(n, m, device="cuda").masked_fill((pos_k > pos_q) | (pos_k <= pos_q - window), float("-inf"))
        r_out, r_lse, *_ = reference(q, k, v, is_causal=False, scale=0.125, bias=bias)
        assert rel_err(out, r_out) < TOL[BF16][0] and (lse.to(FP64) - r_lse).abs().max().item() < TOL[BF16][2]
    finally:
        backend.activate_flash("FA2")
    assert backend.active_flash() is None


@pytest.mark.cuda
@pytest.mark.parametrize("kernel", [CUDA_FLASH, CUDA_EFFICIENT])
@pytest.mark.parametrize("head_dim", [8, 96, 128, 256, 300, 20])
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_head_dims(kernel, head_dim, causal):
    check_cuda_path(kernel, BF16, 8, 2, 100, 100, causal, False, head_dim=head_dim, batch=1)


@pytest.mark.cuda
@pytest.mark.parametrize("hq,hk,n,m", [(8, 2, 1, 4096), (32, 8, 1, 1000), (8, 8, 1, 1)])
def test_cuda_decode_shapes(hq, hk, n, m):
    # q_len 1 with GQA takes flash's heads-into-sequence swap; its lse must come back (b, h, 1)
    check_cuda_path(CUDA_FLASH, BF16, hq, hk, n, m, False, False, batch=3)


@pytest.mark.cuda
@pytest.mark.parametrize("kernel,dtype", [(CUDA_EFFICIENT, BF16), (CUDA_EFFICIENT, FP16), (CUDA_FLASH, BF16)])
def test_cuda_backward_with_merged_out_layout_no_fault(kernel, dtype):
    """Issue 34's fault, on the GPU: 8 heads, 4096 queries, out (batch, heads, n, d)-contiguous as
    the dilated backward passes it (before the fix the efficient kernel read up to 7 * 4096 * 64
    elements past it and its bf16 gradients were wrong), and as a strided segment view."""
    if not _cuda_supports(kernel, dtype, True, False, 4096, 4096):
        pytest.skip("kernel not served here")
    b, h, n, d = 1, 8, 4096, 64
    q, k, v, dout, _ = make_inputs(b, h, h, n, n, d, dtype, device="cuda", seed=3)
    scale = d ** -0.5
    out, lse = forward_with(kernel, q, k, v, is_causal=True, scale=scale)
    r_out, r_lse, r_dq, r_dk, r_dv = reference(q, k, v, is_causal=True, scale=scale, dout=dout)
    t_grad = TOL[dtype][1]
    for out_given in (out.contiguous(), torch.empty(b, n, h, d, dtype=dtype, device="cuda").transpose(1, 2)
                      .copy_(out)):
        dq, dk, dv = backward_with(kernel, dout, q, k, v, out_given, lse.contiguous(), is_causal=True, scale=scale)
        torch.cuda.synchronize()
        assert max(grad_errs((dq, dk, dv), (r_dq, r_dk, r_dv))) < t_grad
    # strided views in, as the dilated kernels build them: segments of 512 folded into the batch
    w = 512
    seg = lambda t: t.unflatten(2, (n // w, w)).transpose(1, 2).flatten(0, 1)  # noqa: E731
    qs, ks, vs, ds, os_ = (seg(t) for t in (q, k, v, dout, out))
    o2, l2 = forward_with(kernel, qs, ks, vs, is_causal=True, scale=scale)
    g2 = backward_with(kernel, ds, qs, ks, vs, o2, l2, is_causal=True, scale=scale)
    torch.cuda.synchronize()
    rs = reference(qs, ks, vs, is_causal=True, scale=scale, dout=ds)
    assert rel_err(o2, rs[0]) < TOL[dtype][0]
    assert max(grad_errs(g2, rs[2:])) < t_grad


@pytest.mark.cuda
@pytest.mark.parametrize("kernel", [CUDA_FLASH, CUDA_EFFICIENT, CUDA_MATH])
def test_cuda_non_contiguous_inputs(kernel):
    # q/k/v with a strided last dim, and a merged lse handed in as a float64 view
    if not _cuda_supports(kernel, BF16, False, False, 64, 80):
        pytest.skip("kernel not served here")
    g = torch.Generator(device="cpu").manual_seed(5)
    big = [torch.randn(2, 4 if i == 0 else 2, 64 if i == 0 else 80, 128, generator=g).to("cuda", BF16)
           for i in range(3)]
    q, k, v = (t[..., ::2] for t in big)
    dout = torch.randn(2, 4, 64, 64, generator=g).to("cuda", BF16)
    out, lse = forward_with(kernel, q, k, v, is_causal=False, scale=0.125)
    lse_view = torch.full((2, 4, 70), float("nan"), dtype=FP64, device="cuda")[..., 3:67]
    lse_view.copy_(lse)
    grads = backward_with(kernel, dout, q, k, v, out, lse_view, is_causal=False, scale=0.125)
    torch.cuda.synchronize()
    r = reference(q, k, v, is_causal=False, scale=0.125, dout=dout)
    assert rel_err(out, r[0]) < TOL[BF16][0]
    assert max(grad_errs(grads, r[2:])) < TOL[BF16][1]


@pytest.mark.cuda
def test_cuda_public_entry_points_use_the_choice():
    cap = torch.cuda.get_device_capability()
    cases = [(BF16, False, 64), (FP16, False, 128), (BF16, True, 64), (FP32, False, 64), (FP64, False, 16)]
    for dtype, bias, d in cases:
        q, k, v, dout, attn_bias = make_inputs(1, 4, 2, 33, 33, d, dtype, device="cuda", bias=bias)
        kernel = choose_kernel("cuda", dtype, d, has_bias=bias, is_causal=True, q_len=33, kv_len=33,
                               q_heads=4, kv_heads=2)
        if dtype in (BF16, FP16) and not bias and cap >= (8, 0) and backend._flash_built() \
                and torch.backends.cuda.flash_sdp_enabled():
            assert kernel == CUDA_FLASH
        out, lse = attention_forward(q, k, v, is_causal=True, scale=0.2, attn_bias=attn_bias)
        r_out, r_lse = forward_with(kernel, q, k, v, is_causal=True, scale=0.2, attn_bias=attn_bias)
        assert torch.equal(out, r_out) and torch.equal(lse, r_lse)
        grads = attention_backward(dout, q, k, v, out, lse, is_causal=True, scale=0.2, attn_bias=attn_bias)
        kernel_b = choose_kernel("cuda", dtype, d, has_bias=bias, is_causal=True, q_len=33, kv_len=33,
                                 q_heads=4, kv_heads=2, needs_grad=True)
        r_grads = backward_with(kernel_b, dout, q, k, v, out, lse, is_causal=True, scale=0.2, attn_bias=attn_bias)
        for a, b in zip(grads, r_grads):  # the same kernel; its gradient accumulation may be unordered
            assert rel_err(a, b.to(FP64)) < 1e-2


@pytest.mark.cuda
def test_cuda_flash_and_efficient_lse_interchangeable():
    # a forward on one kernel and a backward on another (flags flipped in between) agree
    if not _cuda_supports(CUDA_FLASH, BF16, True, False, 128, 128):
        pytest.skip("no flash here")
    q, k, v, dout, _ = make_inputs(2, 8, 2, 128, 128, 64, BF16, device="cuda", seed=7)
    out, lse = forward_with(CUDA_FLASH, q, k, v, is_causal=True, scale=0.125)
    g_eff = backward_with(CUDA_EFFICIENT, dout, q, k, v, out, lse, is_causal=True, scale=0.125)
    g_fl = backward_with(CUDA_FLASH, dout, q, k, v, out, lse, is_causal=True, scale=0.125)
    r = reference(q, k, v, is_causal=True, scale=0.125, dout=dout)
    for grads in (g_eff, g_fl):
        assert max(grad_errs(grads, r[2:])) < TOL[BF16][1]
