"""The two CUDA faults of issue 34, and the parts of their causes that show on the CPU.

1. `ops/dilated_decode._dense_step` flattened sdpa's (batch, kv_heads, group, dim) output with
   `.view`, which raises when the output is laid out sequence-major, as every CUDA kernel returns
   it ("view size is not compatible with input tensor's size and stride"). The CPU kernel returns
   it contiguous, so the CPU test hands the step an sdpa that answers in the CUDA layout.
2. An illegal memory access in the memory-efficient backward (fixed in ops/backend.py,
   `_efficient_out`). Every `as_strided` view the kernels
   build is checked here against its storage (forward and backward, every layout and pattern), and
   the arguments handed to the CUDA kernels are checked against what those kernels read: PyTorch's
   memory-efficient backward reads the output `out` at `b * out.stride(0) + h * out.stride(1) +
   m * (heads * head_dim)` (xformers' `o_strideM()`, not out.stride(2)), i.e. it assumes the
   (batch, seq, heads, dim) memory layout its own forward returns. A merged output sliced or
   segment-viewed from (batch, heads, seq, dim) memory is read at the wrong places, past the
   storage's end for the last heads: garbage gradients in bfloat16 / float16 (where the kernel
   computes delta = rowsum(dout * out) itself) and a fault where the read lands on unmapped memory.
"""
from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import hf_dilated.ops.backend as backend
import hf_dilated.ops.block_sparse as block_sparse_module
import hf_dilated.ops.dilated as dilated_module
import hf_dilated.ops.local_band as local_band_module
from hf_dilated.ops import block_sparse_attention, dilated_attention
from hf_dilated.ops.strided import as_strided_within, canonical, storage_elements, view_reach
from reference import block_sparse_reference, dilated_reference

_aten = torch.ops.aten


# ---------------------------------------------------------------------------------------------
# Fault 1: the dense decode step and sdpa's output layout


def _cuda_layout_sdpa(monkeypatch):
    """Make F.scaled_dot_product_attention answer as the CUDA kernels do: (batch, heads, seq, dim)
    shaped, (batch, seq, heads, dim) in memory."""
    sdpa = F.scaled_dot_product_attention
    seen = []

    def sequence_major(*args, **kwargs):
        out = sdpa(*args, **kwargs)
        seen.append(out.shape)
        return out.transpose(1, 2).contiguous().transpose(1, 2)

    monkeypatch.setattr(F, "scaled_dot_product_attention", sequence_major)
    return seen


@pytest.mark.parametrize("q_heads,kv_heads,batch", [(8, 2, 1), (8, 2, 3), (6, 3, 2), (4, 4, 2), (4, 1, 1)])
def test_dense_decode_step_takes_any_sdpa_output_layout(monkeypatch, q_heads, kv_heads, batch):
    seen = _cuda_layout_sdpa(monkeypatch)
    g = torch.Generator().manual_seed(0)
    n, d = 40, 16  # the cache lies within the first segment: the step is one dense call
    q = torch.randn(batch, 1, q_heads, d, generator=g, dtype=torch.float64).transpose(1, 2)  # as HF passes it
    k, v = (torch.randn(batch, n, kv_heads, d, generator=g, dtype=torch.float64).transpose(1, 2) for _ in range(2))
    out = dilated_attention(q, k, v, [64, 128], [1, 2])
    assert seen, "the dense step did not run"
    ref = torch.cat([torch.zeros(batch, q_heads, n - 1, d, dtype=torch.float64), q], 2)
    ref = dilated_reference(ref, k, v, [64, 128], [1, 2])[:, :, -1:]
    assert (out - ref).abs().max().item() < 1e-10


@pytest.mark.cuda
def test_cuda_dense_decode_step_matches_reference():
    g = torch.Generator().manual_seed(0)
    for q_heads, kv_heads in ((8, 2), (4, 4), (12, 4)):
        q = torch.randn(2, q_heads, 1, 64, generator=g)
        k, v = (torch.randn(2, kv_heads, 300, 64, generator=g) for _ in range(2))
        out = dilated_attention(q.cuda(), k.cuda(), v.cuda(), [512, 1024], [1, 2])
        full_q = torch.cat([torch.zeros(2, q_heads, 299, 64), q], 2).double()
        ref = dilated_reference(full_q, k.double(), v.double(), [512, 1024], [1, 2])[:, :, -1:]
        assert (out.cpu().double() - ref).abs().max().item() < 1e-4


# ---------------------------------------------------------------------------------------------
# Fault 2, candidate 1: as_strided views past their storage


class StridedViews(TorchDispatchMode):
    """Every aten.as_strided* call: records (size, stride, offset, storage elements) and counts
    the views that reach past their storage."""

    def __init__(self):
        super().__init__()
        self.views, self.past_end = 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.name().startswith("aten::as_strided"):
            x, size, stride = args[0], args[1], args[2]
            offset = args[3] if len(args) > 3 else kwargs.get("storage_offset")
            offset = x.storage_offset() if offset is None else offset
            self.views += 1
            if view_reach(size, stride, offset) > storage_elements(x):
                self.past_end.append((func.name(), tuple(size), tuple(stride), offset, storage_elements(x)))
        return func(*args, **kwargs)


def _dilated_cases():
    mask = torch.ones(2, 64, dtype=torch.long)
    mask[0, :9] = 0
    packed = torch.cat([torch.arange(30), torch.arange(34)]).expand(2, 64)
    for mode in ("union", "longnet", "head_groups"):
        for heads in ((4, 4), (8, 2), (6, 3)):
            yield mode, heads, dict()
        yield mode, (8, 2), dict(attention_mask=mask)
        yield mode, (8, 2), dict(position_ids=packed)
        yield mode, (8, 2), dict(q_len=5)
        yield mode, (8, 2), dict(q_len=1)
        yield mode, (8, 2), dict(sliding_window=20)
    yield "union", (8, 2), dict(local_window=12)
    yield "union", (8, 2), dict(local_window=12, far=True)


def _run_dilated(mode, heads, kw, dtype=torch.float32, device="cpu", seg=(8, 16, 32, 64), dil=(1, 2, 4, 8)):
    kw = dict(kw)
    q_len, far = kw.pop("q_len", 64), kw.pop("far", False)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, heads[0], q_len, 16, generator=g).to(device, dtype).requires_grad_()
    k, v = (torch.randn(2, heads[1], 64, 16, generator=g).to(device, dtype).requires_grad_() for _ in range(2))
    if far:
        kw["q_far"], kw["k_far"] = q * 0.5, k * 0.5
    out = dilated_attention(q, k, v, list(seg), list(dil), mode=mode, **kw)
    out.backward(torch.randn(out.shape, generator=g).to(device, dtype))
    return out


BLOCK_PATTERNS = [{"type": "local", "window": 3}, {"type": "dilated", "window": 2, "stride": 3},
                  {"type": "global_local", "global_blocks": 1, "window": 2},
                  {"type": "hierarchical", "levels": [[1, 2], [2, 5]]}, {"type": "adaptive", "top_k": 2, "window": 2}]


def _run_block_sparse(pattern, scenario, dtype=torch.float32):
    g = torch.Generator().manual_seed(2)
    q_len = {"decode": 1, "chunk": 9}.get(scenario, 70)
    q = torch.randn(2, 8, q_len, 16, generator=g, dtype=dtype).requires_grad_()
    k, v = (torch.randn(2, 2, 70, 16, generator=g, dtype=dtype).requires_grad_() for _ in range(2))
    kw = {}
    if scenario == "padded":
        kw["attention_mask"] = torch.ones(2, 70, dtype=torch.long)
        kw["attention_mask"][1, 60:] = 0
    elif scenario == "packed":
        kw["position_ids"] = torch.cat([torch.arange(33), torch.arange(37)]).expand(2, 70)
    out = block_sparse_attention(q, k, v, pattern, block_size=8, **kw)
    out.backward(torch.randn(out.shape, generator=g, dtype=dtype))


def test_no_as_strided_view_reaches_past_its_storage():
    spy = StridedViews()
    with spy:
        for mode, heads, kw in _dilated_cases():
            _run_dilated(mode, heads, kw)
        _run_dilated("union", (8, 2), {}, seg=(16, 32, 64), dil=(1, 2, 4))  # the plain strided path
        for pattern in BLOCK_PATTERNS:
            for scenario in ("plain", "padded", "packed", "chunk", "decode"):
                _run_block_sparse(pattern, scenario)
    assert spy.views > 0, "no as_strided view was seen: the check checks nothing"
    assert not spy.past_end, spy.past_end[:5]


def test_canonical_gives_a_contiguous_tensors_strides_copying_only_what_is_not_contiguous():
    """strided.canonical (the compiled calls' operands): a batch of one sliced from a longer row is
    contiguous but keeps the row's batch stride (which a compiled call guards, and .contiguous()
    keeps): the same data with a contiguous tensor's strides, no copy, within its storage; a tensor
    that is not contiguous is copied; a canonical one is returned as it is."""
    row = torch.arange(2 * 10 * 3, dtype=torch.float32).view(1, 10, 2, 3)  # (batch, n, heads, d)
    part = row[:, 4:7]
    assert part.is_contiguous() and part.stride() == (60, 6, 3, 1)
    same = canonical(part)
    assert same.stride() == (18, 6, 3, 1) and same.data_ptr() == part.data_ptr() and torch.equal(same, part)
    assert part.contiguous().stride() == (60, 6, 3, 1)  # (what .contiguous() leaves)
    apart = row.transpose(1, 2)
    copied = canonical(apart)
    assert copied.stride() == (60, 30, 3, 1) and torch.equal(copied, apart)
    assert copied.data_ptr() != apart.data_ptr()
    assert canonical(copied) is copied


def test_as_strided_within_refuses_views_past_the_storage():
    x = torch.arange(24.0).view(2, 3, 4)[1]  # storage of 24 elements, offset 12
    assert torch.equal(as_strided_within(x, (3, 4), (4, 1), 12), x)
    assert as_strided_within(x, (0, 4), (100, 1), 24).numel() == 0
    with pytest.raises(IndexError, match="reaches element 24 of a storage of 24"):
        as_strided_within(x, (3, 4), (4, 1), 13)
    with pytest.raises(IndexError):
        as_strided_within(x, (2, 2), (13, 1), 10)  # its last element is 24


def test_strided_slots_refuse_slots_outside_their_segment():
    x = torch.zeros(1, 4, 32, 2)
    view = dilated_module._strided_slots(x, 1, 2, 2, 1, 0, 1, 3, 8, 2)  # heads 1, 3; class 1; slots 1..3
    assert view.shape == (1, 4, 2, 3, 2)
    with pytest.raises(IndexError):  # slot 4 of class 1 is position 9: the next segment
        dilated_module._strided_slots(x, 1, 2, 2, 1, 0, 1, 4, 8, 2)
    with pytest.raises(IndexError):  # head 5 of 4
        dilated_module._strided_slots(x, 1, 2, 3, 1, 0, 0, 2, 8, 2)


# ---------------------------------------------------------------------------------------------
# Fault 2, candidate 2: the layouts handed to the CUDA memory-efficient kernel, checked on the CPU


class EfficientKernelOnCpu:
    """Stands in for torch.ops.aten in ops/backend.py: the memory-efficient forward / backward
    computed by the CPU flash kernel, after checking every argument against what the CUDA kernel
    reads (PyTorch's mem_eff_attention/kernel_backward.h). Records each violation."""

    def __init__(self):
        self.violations, self.forward_calls, self.backward_calls = [], 0, 0

    def __getattr__(self, name):
        return getattr(_aten, name)

    def _operands(self, **tensors):
        for name, t in tensors.items():
            if t is not None and t.stride(-1) != 1:
                self.violations.append(f"{name}: last dim not contiguous, strides {t.stride()}")

    def _scaled_dot_product_efficient_attention(self, q, k, v, bias, compute_lse, dropout_p, is_causal, scale=None):
        self.forward_calls += 1
        self._operands(q=q, k=k, v=v, bias=bias)
        if bias is not None and tuple(bias.shape) != (q.shape[0], q.shape[1], q.shape[2], k.shape[2]):
            self.violations.append(f"bias shape {tuple(bias.shape)} for q {tuple(q.shape)}, k {tuple(k.shape)}")
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, attn_mask=bias,
                                                                     scale=scale)[:2]
        out = out.transpose(1, 2).contiguous().transpose(1, 2)  # the kernel writes (batch, seq, heads, dim)
        lse = F.pad(lse, (0, (-lse.shape[-1]) % 32))  # and pads the log-sum-exp to 32 queries
        return out, lse, torch.zeros((), dtype=torch.long), torch.zeros((), dtype=torch.long)

    def _scaled_dot_product_efficient_attention_backward(self, dout, q, k, v, bias, out, lse, seed, offset,
                                                         dropout_p, grad_mask, is_causal, scale=None):
        self.backward_calls += 1
        self._operands(q=q, k=k, v=v, bias=bias, out=out)
        batch, heads, m, dv = out.shape
        # The kernel reads out[b, h, i, :] at b * stride(0) + h * stride(1) + i * heads * dv (o_strideM()).
        reach = out.storage_offset() + (batch - 1) * out.stride(0) + (heads - 1) * out.stride(1) + (m - 1) * heads * dv + dv
        if reach > storage_elements(out):
            self.violations.append(f"out {tuple(out.shape)} strides {out.stride()}: the kernel reads element "
                                   f"{reach - 1} of a storage of {storage_elements(out)}")
        elif m > 1 and out.stride(2) != heads * dv:
            self.violations.append(f"out {tuple(out.shape)} strides {out.stride()}: the kernel reads rows "
                                   f"{heads * dv} apart, not {out.stride(2)}")
        if lse.shape[-1] < -(-m // 32) * 32 or not lse.is_contiguous():
            self.violations.append(f"lse {tuple(lse.shape)} for {m} queries: not padded to 32 / not contiguous")
        dq, dk, dv_ = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse[..., :m].contiguous(), 0.0, is_causal, attn_mask=bias, scale=scale)
        return dq, dk, dv_, None


@pytest.fixture
def cuda_backend_on_cpu(monkeypatch):
    """Route the kernels' fused calls through ops/backend.py's memory-efficient CUDA path, with the
    kernel itself emulated on the CPU."""
    kernel = EfficientKernelOnCpu()
    monkeypatch.setattr(backend, "_aten", kernel)

    def forward(q, k, v, *, is_causal, scale, attn_bias=None):
        return backend.forward_with(backend.CUDA_EFFICIENT, q, k, v, is_causal=is_causal, scale=scale,
                                    attn_bias=attn_bias)

    def backward(dout, q, k, v, out, lse, *, is_causal, scale, attn_bias=None):
        return backend.backward_with(backend.CUDA_EFFICIENT, dout, q, k, v, out, lse, is_causal=is_causal,
                                     scale=scale, attn_bias=attn_bias)

    for module in (dilated_module, block_sparse_module, local_band_module):
        monkeypatch.setattr(module, "attention_forward", forward)
        monkeypatch.setattr(module, "attention_backward", backward)
    return kernel


def _run_every_kernel():
    for mode, heads, kw in _dilated_cases():
        _run_dilated(mode, heads, kw)
    for pattern in BLOCK_PATTERNS:
        for scenario in ("plain", "padded"):
            _run_block_sparse(pattern, scenario)


def test_emulated_cuda_backend_is_exact(cuda_backend_on_cpu):
    """Guards the emulation: through it the kernels still match the float64 reference (float32,
    as the CUDA kernel computes)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 64, 16, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    ours = [t.float().requires_grad_() for t in (q, k, v)]
    refs = [t.clone().requires_grad_() for t in (q, k, v)]
    out = dilated_attention(*ours, [16, 32, 64], [1, 2, 4])
    ref = dilated_reference(*refs, [16, 32, 64], [1, 2, 4])
    assert (out.double() - ref).abs().max().item() < 1e-4
    grad = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    out.backward(grad.float())
    ref.backward(grad)
    assert max((a.grad.double() - b.grad).abs().max().item() for a, b in zip(ours, refs)) < 1e-4
    assert cuda_backend_on_cpu.forward_calls and cuda_backend_on_cpu.backward_calls


def test_cuda_backend_arguments_fit_the_memory_efficient_kernel(cuda_backend_on_cpu):
    kernel = cuda_backend_on_cpu
    _run_every_kernel()
    assert kernel.backward_calls > 0
    assert not kernel.violations, f"{len(kernel.violations)} violations, e.g. {kernel.violations[:3]}"


def test_the_check_sees_the_fault_2_layout(cuda_backend_on_cpu, monkeypatch):
    """Before the fix (backend._efficient_out), the merged output went to the kernel as it was: the
    check above finds the reads past the storage it caused."""
    monkeypatch.setattr(backend, "_efficient_out", lambda out: out)
    _run_every_kernel()
    assert any("of a storage of" in v for v in cuda_backend_on_cpu.violations)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", ["union", "head_groups"])
def test_cuda_low_precision_gradients_match_reference(mode, dtype):
    """The gradients the faulting backward computed from the wrongly read output (before the fix
    these are garbage, or the run faults)."""
    seg, dil = [64, 128, 256, 512], [1, 2, 4, 8]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 8, 512, 64, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, 2, 512, 64, generator=g, dtype=torch.float64) for _ in range(2))
    grad = torch.randn(q.shape, generator=g, dtype=torch.float64)
    leaves = [t.to("cuda", dtype).requires_grad_() for t in (q, k, v)]
    dilated_attention(*leaves, seg, dil, mode=mode).backward(grad.to("cuda", dtype))
    refs = [t.clone().requires_grad_() for t in (q, k, v)]
    dilated_reference(*refs, seg, dil, mode).backward(grad)
    torch.cuda.synchronize()
    for name, ours, ref in zip("qkv", leaves, refs):
        err = (ours.grad.double().cpu() - ref.grad).abs().max().item()
        assert err < 2e-2 * max(1.0, ref.grad.abs().max().item()), (name, err)
    g_bs = [t.to("cuda", dtype).requires_grad_() for t in (q, k, v)]
    out, layout = block_sparse_attention(*g_bs, {"type": "global_local", "global_blocks": 1, "window": 2},
                                         block_size=64, return_layout=True)
    out.backward(grad.to("cuda", dtype))
    refs = [t.clone().requires_grad_() for t in (q, k, v)]
    block_sparse_reference(*refs, layout.cpu(), 64).backward(grad)
    for name, ours, ref in zip("qkv", g_bs, refs):
        err = (ours.grad.double().cpu() - ref.grad).abs().max().item()
        assert err < 2e-2 * max(1.0, ref.grad.abs().max().item()), ("block_sparse", name, err)
