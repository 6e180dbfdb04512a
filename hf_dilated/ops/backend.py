"""Fused attention calls that return the log-sum-exp, and their backward.

Every kernel of the package reduces its work to dense 4-D batches handed to `attention_forward`
and merges the partial results by log-sum-exp (see `merge.py`). The backward takes the *merged*
output and log-sum-exp (the standard flash / ring backward), so no probability matrix is kept.

Layout: q (batch, q_heads, q_len, head_dim); k, v (batch, kv_heads, kv_len, head_dim), with
q_heads a multiple of kv_heads (grouped-query attention handled by the kernel, K/V never
repeated on CPU). `is_causal` is aligned top-left (query t sees keys 0..t), as in PyTorch.
`attn_bias` is an additive float mask broadcastable to (batch, q_heads, q_len, kv_len).

Backends, picked per call by `choose_kernel` (a pure function of the call's description):
- CPU: PyTorch's fused flash kernel (`_scaled_dot_product_flash_attention_for_cpu`), unchanged.
- CUDA, no bias, fp16/bf16, head_dim a multiple of 8 up to 256, sm80+: PyTorch's flash kernel
  (`_flash_attention_forward` / `_flash_attention_backward`), which takes fewer K/V heads than
  query heads natively (K/V are never expanded) and returns the log-sum-exp. Its causal mask is
  aligned bottom-right, so it serves a causal call only when q_len <= kv_len (see `_flash_forward`).
- CUDA otherwise (a bias, float32, other head dims, causal with q_len > kv_len, older GPUs):
  PyTorch's memory-efficient kernel, with K/V expanded to the query heads (it has no GQA mode).
- CUDA where neither applies (float64, or both disabled by `torch.backends.cuda` flags): plain
  torch ops (`_math_forward`), exact but materialising the (q_len, kv_len) scores.
CUDA_FLASH is whichever FlashAttention torch's dispatcher holds: its own FlashAttention-2, or a
newer one (FA3, FA4) that `activate_flash` puts in its place where it is installed (for sdpa too:
torch swaps the kernels process-wide).
The log-sum-exp of every path is the natural-log one of the same rows, so a forward on one kernel
and a backward on another (flags changed, or `needs_grad` rules) agree.
A row whose keys are all masked comes back from the CPU kernel with log-sum-exp 0 and output 0;
callers that can produce such rows correct the log-sum-exp to -inf themselves.
"""
from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.attention  # its FlashAttention registry (activate_flash)

_aten = torch.ops.aten

CPU_FLASH = "cpu_flash"
CUDA_FLASH = "cuda_flash"
CUDA_EFFICIENT = "cuda_efficient"
CUDA_MATH = "cuda_math"
KERNELS = (CPU_FLASH, CUDA_FLASH, CUDA_EFFICIENT, CUDA_MATH)

_HALF = (torch.float16, torch.bfloat16)
# CUDA grids put the batch on a dimension limited to 65535 blocks (flash: gridDim.y; efficient:
# gridDim.z), so larger batches (many small segments folded into the batch) go in chunks.
_MAX_GRID_BATCH = 65535


def choose_kernel(device_type: str, dtype: torch.dtype, head_dim: int, *, has_bias: bool, is_causal: bool,
                  q_len: int, kv_len: int, q_heads: int = 1, kv_heads: int = 1, needs_grad: bool = False,
                  capability: tuple[int, int] | None = None, flash_enabled: bool | None = None,
                  efficient_enabled: bool | None = None, flash_available: bool | None = None,
                  flash_impl: str | None = ...) -> str:
    """The kernel for one dense call: CPU_FLASH, CUDA_FLASH, CUDA_EFFICIENT or CUDA_MATH.

    Pure (no tensors): the CUDA-only inputs (`capability`, the `torch.backends.cuda` flags, whether
    this build has the flash kernel, the FlashAttention the dispatcher holds: None for torch's own
    FlashAttention-2, else "FA3" / "FA4") are read from torch only when left unset on a CUDA call,
    so that a test can pass them. `needs_grad` is True when choosing for a backward.
    """
    if device_type != "cuda":
        return CPU_FLASH  # the CPU path (and any non-CUDA device) is the unchanged CPU kernel
    if q_heads % kv_heads:
        raise ValueError(f"q_heads ({q_heads}) must be a multiple of kv_heads ({kv_heads})")
    if capability is None:
        capability = torch.cuda.get_device_capability()
    capability = tuple(capability)
    if flash_enabled is None:
        flash_enabled = torch.backends.cuda.flash_sdp_enabled()
    if efficient_enabled is None:
        efficient_enabled = torch.backends.cuda.mem_efficient_sdp_enabled()
    if flash_available is None:
        flash_available = _flash_built()
    if flash_impl is ...:
        flash_impl = active_flash()
    empty = q_len == 0 or kv_len == 0
    if (flash_enabled and flash_available and not has_bias and not empty
            # FlashAttention-2 kernels exist for sm80 up to sm121 (sdpa's check_flash_attention_hardware_support);
            # a newer one activated in its place raises on other GPUs than its own (FLASH_IMPLS)
            and dtype in _HALF and (8, 0) <= capability <= (12, 1)
            and (flash_impl is None or capability[0] in FLASH_IMPLS.get(flash_impl, (capability[0],)))
            # FA4's Hopper backward asserts it is not asked for deterministic algorithms
            and not (needs_grad and flash_impl == "FA4" and capability[0] == 9
                     and torch.are_deterministic_algorithms_enabled())
            and head_dim % 8 == 0 and 0 < head_dim <= 256
            # flash's causal mask is bottom-right aligned; the contract is top-left. Equal for
            # q_len == kv_len; for q_len < kv_len no query sees a key past q_len (the call drops
            # them); for q_len > kv_len there is no exact flash form: fall back.
            and not (is_causal and q_len > kv_len)
            # as sdpa: on sm86/sm89 the flash backward for head_dim > 192 lacks shared memory.
            and not (needs_grad and head_dim > 192 and capability in ((8, 6), (8, 9)))):
        return CUDA_FLASH
    efficient_dtypes = (torch.float16, torch.float32) + ((torch.bfloat16,) if capability >= (8, 0) else ())
    # Its kernels load rows in 128-bit vectors: a head_dim off that grid (8 half / 4 float elements)
    # raises "query is not correctly aligned" (seen on an H100 at 20 and 300). sdpa pads such
    # heads; they are rare enough here to take the math path instead.
    aligned = head_dim % (8 if dtype in _HALF else 4) == 0
    if efficient_enabled and dtype in efficient_dtypes and capability >= (5, 0) and aligned:
        return CUDA_EFFICIENT
    return CUDA_MATH


# The FlashAttention versions torch.nn.attention can put in place of its own FlashAttention-2 (torch
# >= 2.10 registers them; each needs its package installed), with the major compute capabilities
# torch's adapter for each accepts (torch/nn/attention/_fa3.py, _fa4.py: it raises on any other GPU),
# in the order "auto" tries them: FA3 first where it runs (Hopper, where it is the mature one, and
# where FA4's backward refuses deterministic algorithms), FA4 on Blackwell.
FLASH_IMPLS = {"FA3": (9,), "FA4": (9, 10)}


def flash_impls_for(capability: tuple[int, int], registered) -> list[str]:
    """The FlashAttention versions, in order, that `activate_flash("auto")` tries on a GPU of this
    compute capability, given the names torch has registered."""
    return [name for name, majors in FLASH_IMPLS.items() if name in registered and capability[0] in majors]


def activate_flash(impl: str = "auto", device=None) -> str | None:
    """Put a newer FlashAttention in place of torch's own FlashAttention-2, for every flash call of
    the process: this package's kernels and `sdpa`'s alike (torch.nn.attention.activate_flash_attention_impl
    swaps the dispatcher's kernels; it is process-wide and torch leaves the choice to the user, so
    nothing here does it unasked). Returns the name now active, None for torch's own.

    impl: "auto" -- one already active stays; else the first of flash_impls_for() for this GPU
    (`device`, else the current one) whose package is installed (FA3: flash_attn_interface; FA4:
    flash_attn.cute) and loads (one that does not is skipped with a warning); torch's own where none
    is, or without a GPU. "FA3" / "FA4" -- that one, or an error that says why not. "FA2" -- torch's
    own again.
    """
    attention = torch.nn.attention
    if impl == "FA2":
        if active_flash() is not None:
            restore = getattr(attention, "restore_flash_attention_impl", None)
            if restore is None:
                raise RuntimeError(f"impl='FA2': this torch ({torch.__version__}) cannot put its own FlashAttention "
                                   f"back in place of {active_flash()}")
            restore()
        return None
    if impl != "auto" and impl not in FLASH_IMPLS:
        raise ValueError(f"impl must be 'auto', 'FA2' or one of {list(FLASH_IMPLS)}, got {impl!r}")
    if impl == "auto" and active_flash() is not None:
        return active_flash()  # the user's choice, made through torch
    registered = attention.list_flash_attention_impls() if hasattr(attention, "list_flash_attention_impls") else []
    if impl != "auto" and impl not in registered:
        raise RuntimeError(f"impl={impl!r}: this torch ({torch.__version__}) registers no such FlashAttention "
                           f"(it has {registered or 'none'})")
    if not torch.cuda.is_available() or not _flash_built():
        if impl == "auto":
            return None
        raise RuntimeError(f"impl={impl!r}: FlashAttention needs a CUDA build of torch and a GPU")
    capability = tuple(torch.cuda.get_device_capability(device))
    if impl != "auto" and capability[0] not in FLASH_IMPLS[impl]:
        raise RuntimeError(f"impl={impl!r} runs on compute capability {FLASH_IMPLS[impl]}.x, this GPU is "
                           f"{capability[0]}.{capability[1]}")
    for name in flash_impls_for(capability, registered) if impl == "auto" else [impl]:
        try:
            attention.activate_flash_attention_impl(name)  # imports its package, then swaps the kernels
        except Exception as exc:  # noqa: BLE001 - not installed, or installed and broken: said, never hidden
            now = active_flash() or "torch's own FlashAttention-2"  # (torch restores its own before trying)
            if impl != "auto":
                raise RuntimeError(f"impl={impl!r}: activating it failed ({type(exc).__name__}: {exc}); {now} "
                                   "is in use") from exc
            if not isinstance(exc, ImportError):  # installed but does not load: a user would want to know
                warnings.warn(f"hf_dilated.activate_flash: {name} did not load ({type(exc).__name__}: {exc}); "
                              f"{now} is in use", RuntimeWarning, stacklevel=2)
            continue
        return active_flash() or name
    return active_flash()


def active_flash() -> str | None:
    """The FlashAttention torch's dispatcher holds in place of its own FlashAttention-2 ("FA3",
    "FA4"), or None for its own (and on a torch without the registry)."""
    current = getattr(torch.nn.attention, "current_flash_attention_impl", None)
    return current() if current is not None else None


@functools.lru_cache(maxsize=None)
def _flash_built() -> bool:
    # ROCm builds implement the flash op differently (CK / AOTriton: other lse layouts and GQA
    # support); only the CUDA build's FlashAttention-2 semantics are relied on here.
    available = getattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)
    return torch.version.hip is None and bool(available())


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(index))


def _choose(q, k, *, is_causal, attn_bias, needs_grad):
    return choose_kernel(
        "cuda", q.dtype, q.shape[-1], has_bias=attn_bias is not None, is_causal=is_causal,
        q_len=q.shape[2], kv_len=k.shape[2], q_heads=q.shape[1], kv_heads=k.shape[1],
        needs_grad=needs_grad, capability=_capability(q.device.index if q.device.index is not None
                                                      else torch.cuda.current_device()),
    )


def attention_forward(q, k, v, *, is_causal: bool, scale: float, attn_bias=None):
    """Returns (out in q.dtype, lse in float32 or float64 shaped (batch, q_heads, q_len))."""
    if q.device.type == "cuda":
        kernel = _choose(q, k, is_causal=is_causal, attn_bias=attn_bias, needs_grad=False)
        return forward_with(kernel, q, k, v, is_causal=is_causal, scale=scale, attn_bias=attn_bias)
    out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, is_causal, attn_mask=attn_bias, scale=scale
    )
    return out, lse


def attention_backward(dout, q, k, v, out, lse, *, is_causal: bool, scale: float, attn_bias=None):
    """Gradients (dq, dk, dv) of one fused call, given the merged out and lse of its rows."""
    if q.device.type == "cuda":
        kernel = _choose(q, k, is_causal=is_causal, attn_bias=attn_bias, needs_grad=True)
        return backward_with(kernel, dout, q, k, v, out, lse, is_causal=is_causal, scale=scale,
                             attn_bias=attn_bias)
    return _aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, is_causal, attn_mask=attn_bias, scale=scale
    )


def band_forward(q, k, v, *, window: int, scale: float):
    """(out, lse) of a band in one call, or None where no kernel has one (the CPU): queries are the
    last q_len of the kv_len keys (bottom-right aligned, q_len <= kv_len) and query i reads the keys
    j with i - window < j <= i. On CUDA flash's sliding window (window_size_left = window - 1, and
    is_causal, which sets window_size_right to 0)."""
    if q.shape[2] > k.shape[2] or not band_on_flash(q, k, needs_grad=False):
        return None
    n, m = q.shape[2], k.shape[2]
    qt, kt, vt = (_flash_operand(t.transpose(1, 2)) for t in (q, k, v))
    out, lse = _aten._flash_attention_forward(
        qt, kt, vt, None, None, n, m, 0.0, True, False, scale=scale, window_size_left=window - 1, window_size_right=0
    )[:2]
    return out.transpose(1, 2), lse


def band_on_flash(q, k, *, needs_grad: bool) -> bool:
    """Whether flash's sliding window serves a band of q over k here (a CUDA device, half precision,
    a head size flash takes, the flags: choose_kernel)."""
    return (q.device.type == "cuda" and q.shape[2] > 0
            and _choose(q, k, is_causal=False, attn_bias=None, needs_grad=needs_grad) == CUDA_FLASH)


def band_backward(dout, q, k, v, out, lse, *, window: int, scale: float):
    """Gradients (dq, dk, dv) of band_forward's rows, given their merged out and lse: flash's
    sliding-window backward on CUDA where flash serves the call (band_on_flash); elsewhere one call
    with the band as a dense bias (queries x keys: the CPU, where only tests take it; training there
    takes local_band's calls, as on a GPU where flash does not serve the band). dk and dv come back
    with k's heads."""
    n, m = q.shape[2], k.shape[2]
    if n > m:
        raise ValueError(f"band_backward: the queries are the last of the keys (q_len {n} > kv_len {m})")
    if band_on_flash(q, k, needs_grad=True):
        b, h = q.shape[:2]
        qt, kt, vt = (_flash_operand(t.transpose(1, 2)) for t in (q, k, v))
        dot, ot = (_flash_operand(t.to(q.dtype).transpose(1, 2)) for t in (dout, out))
        lse = lse.to(torch.float32).reshape(b, h, n).contiguous()  # (as _flash_backward)
        rng, unused = _flash_rng(q.device)
        grads = _aten._flash_attention_backward(dot, qt, kt, vt, ot, lse, None, None, n, m, 0.0, True, rng, unused,
                                                scale=scale, window_size_left=window - 1, window_size_right=0)
        return tuple(g.transpose(1, 2) for g in grads)
    i = torch.arange(m - n, m, device=q.device)[:, None]
    j = torch.arange(m, device=q.device)[None, :]
    bias = torch.zeros(n, m, dtype=q.dtype, device=q.device).masked_fill_((j > i) | (j <= i - window), float("-inf"))
    dq, dk, dv = attention_backward(dout.to(q.dtype), q, k, v, out.to(q.dtype), lse, is_causal=False, scale=scale,
                                    attn_bias=bias[None, None])
    return dq, kv_head_grads(dk, k.shape[1]), kv_head_grads(dv, k.shape[1])


def kv_head_grads(g, kv_heads: int):
    """A key or value gradient with k's heads: one with a head per query head (from a kernel that
    repeats K/V) summed per kv head."""
    if g.shape[1] == kv_heads:
        return g
    return g.unflatten(1, (kv_heads, g.shape[1] // kv_heads)).sum(2)


def forward_with(kernel: str, q, k, v, *, is_causal: bool, scale: float, attn_bias=None):
    """attention_forward on a named kernel (tests force each path with it)."""
    if kernel == CUDA_FLASH:
        if attn_bias is not None:
            raise ValueError("the flash kernel takes no bias")
        return _batch_chunked(_flash_forward, (q, k, v), is_causal=is_causal, scale=scale)
    if kernel == CUDA_EFFICIENT:
        return _efficient_forward(q, k, v, is_causal=is_causal, scale=scale, attn_bias=attn_bias)
    if kernel == CUDA_MATH:
        return _math_forward(q, k, v, is_causal=is_causal, scale=scale, attn_bias=attn_bias)
    if kernel == CPU_FLASH:
        return tuple(_aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, is_causal, attn_mask=attn_bias, scale=scale)[:2])
    raise ValueError(f"unknown kernel {kernel!r}")


def backward_with(kernel: str, dout, q, k, v, out, lse, *, is_causal: bool, scale: float, attn_bias=None):
    """attention_backward on a named kernel (tests force each path with it)."""
    if kernel == CUDA_FLASH:
        if attn_bias is not None:
            raise ValueError("the flash kernel takes no bias")
        return _batch_chunked(_flash_backward, (dout, q, k, v, out, lse), is_causal=is_causal, scale=scale)
    if kernel == CUDA_EFFICIENT:
        return _efficient_backward(dout, q, k, v, out, lse, is_causal=is_causal, scale=scale,
                                   attn_bias=attn_bias)
    if kernel == CUDA_MATH:
        return _math_backward(dout, q, k, v, out, lse, is_causal=is_causal, scale=scale, attn_bias=attn_bias)
    if kernel == CPU_FLASH:
        return _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, is_causal, attn_mask=attn_bias, scale=scale)
    raise ValueError(f"unknown kernel {kernel!r}")


def _batch_chunked(fn, tensors, **kw):
    batch = tensors[0].shape[0]
    if batch <= _MAX_GRID_BATCH:
        return fn(*tensors, **kw)
    parts = [fn(*(t[s:s + _MAX_GRID_BATCH] for t in tensors), **kw) for s in range(0, batch, _MAX_GRID_BATCH)]
    return tuple(torch.cat(p, 0) for p in zip(*parts))


# ---------------------------------------------------------------------------------------------
# Flash (FlashAttention-2 as built into PyTorch). Schemas relied on (torch 2.11-2.13):
#   _flash_attention_forward(Tensor query, Tensor key, Tensor value, Tensor? cum_seq_q,
#       Tensor? cum_seq_k, SymInt max_q, SymInt max_k, float dropout_p, bool is_causal,
#       bool return_debug_mask, *, float? scale=None, SymInt? window_size_left=None,
#       SymInt? window_size_right=None, Tensor? seqused_k=None, Tensor? alibi_slopes=None, ...)
#       -> (Tensor output, Tensor softmax_logsumexp, Tensor rng_state, Tensor unused,
#           Tensor debug_attn_mask)
#   _flash_attention_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor out,
#       Tensor logsumexp, Tensor cum_seq_q, Tensor cum_seq_k, SymInt max_q, SymInt max_k,
#       float dropout_p, bool is_causal, Tensor rng_state, Tensor unused, *, float? scale=None,
#       SymInt? window_size_left=None, SymInt? window_size_right=None) -> (Tensor, Tensor, Tensor)
# Dense form (cum_seq_* None): q (batch, q_len, heads, d), k/v (batch, kv_len, kv_heads, d), i.e.
# our tensors transposed (a view); output like q; logsumexp (batch, heads, q_len) float32
# (meta__flash_attention_forward; mha_fwd allocates it contiguous, also for q_len == 1 with GQA
# where it swaps heads into the sequence and reshapes back). Only keyword arguments present since
# torch 2.4 (scale) are passed, so newer schema additions do not matter.
# ---------------------------------------------------------------------------------------------


def _flash_operand(t):
    """t (batch, seq, heads, d) made acceptable to the flash kernel, copied only when needed.

    mha_fwd/mha_bwd check only stride(-1) == 1 ("must have contiguous last dimension"); the
    kernels load rows with 128-bit vectors (8 fp16/bf16 elements), so every other stride and the
    start must also be multiples of 8 elements (the allocator's blocks are 512-byte aligned, so
    the storage offset decides the start's alignment). Our (batch, heads, seq, d) tensors viewed
    (batch, seq, heads, d) keep their strides: no copy for the usual layouts.
    """
    return _aligned(t)


def _aligned(t):
    """t itself when its last dim is contiguous and its start and other strides lie on an
    8-element grid; else a fresh contiguous copy (clone, not contiguous(): a contiguous tensor
    that starts off the grid is copied too). A contiguous tensor whose head_dim is off the grid
    is returned as is: a copy would be no better aligned."""
    if t.storage_offset() % 8 == 0 and (t.is_contiguous() or (t.stride(-1) == 1 and all(
            s % 8 == 0 for s, n in zip(t.stride()[:-1], t.shape[:-1]) if n > 1))):
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _flash_rng(device: torch.device):
    # rng_state / unused: read by the flash backward only with dropout (`if (is_dropout)`), which
    # is always 0 here; shaped and typed as mha_fwd returns them (uint64 (2,) and ()). Uninitialised
    # (no fill kernel) and not cached (a cached tensor would outlive a CUDA-graph pool or a trace).
    return (torch.empty((2,), dtype=torch.uint64, device=device),
            torch.empty((), dtype=torch.uint64, device=device))


def _flash_keys(q, k, v, is_causal):
    """Top-left causal with q_len < kv_len: query t sees keys 0..t, so no query sees a key at or
    past q_len; dropping them makes q_len == kv_len, where flash's bottom-right causal mask is the
    top-left one. choose_kernel never picks flash for causal q_len > kv_len."""
    n, m = q.shape[2], k.shape[2]
    if is_causal and m > n:
        return k[:, :, :n], v[:, :, :n]
    if is_causal and m < n:
        raise ValueError("flash cannot align a causal mask top-left with q_len > kv_len")
    return k, v


def _flash_forward(q, k, v, *, is_causal, scale):
    k, v = _flash_keys(q, k, v, is_causal)
    n, m = q.shape[2], k.shape[2]
    qt, kt, vt = (_flash_operand(t.transpose(1, 2)) for t in (q, k, v))
    out, lse = _aten._flash_attention_forward(
        qt, kt, vt, None, None, n, m, 0.0, is_causal, False, scale=scale
    )[:2]
    return out.transpose(1, 2), lse


def _flash_backward(dout, q, k, v, out, lse, *, is_causal, scale):
    m_full = k.shape[2]
    k, v = _flash_keys(q, k, v, is_causal)
    n, m = q.shape[2], k.shape[2]
    b, h = q.shape[:2]
    qt, kt, vt = (_flash_operand(t.transpose(1, 2)) for t in (q, k, v))
    # dout and out: same dtype as q (mha_bwd checks it); the op makes both contiguous itself.
    dot = _flash_operand(dout.to(q.dtype).transpose(1, 2))
    ot = _flash_operand(out.to(q.dtype).transpose(1, 2))
    # logsumexp: the kernel indexes it as a contiguous (batch, heads, q_len) float32 array with no
    # shape check (mha_bwd), so it must be exactly that; the merged lse callers pass may be a view
    # or float64.
    lse = lse.to(torch.float32).reshape(b, h, n).contiguous()
    rng, unused = _flash_rng(q.device)
    dq, dk, dv = _aten._flash_attention_backward(
        dot, qt, kt, vt, ot, lse, None, None, n, m, 0.0, is_causal, rng, unused, scale=scale
    )
    dq, dk, dv = dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
    if m < m_full:  # the keys dropped by _flash_keys get no gradient
        pad = (0, 0, 0, m_full - m)
        dk, dv = torch.nn.functional.pad(dk, pad), torch.nn.functional.pad(dv, pad)
    return dq, dk, dv


# ---------------------------------------------------------------------------------------------
# Memory-efficient (cutlass, xformers-derived). Schemas relied on:
#   _scaled_dot_product_efficient_attention(Tensor query, Tensor key, Tensor value,
#       Tensor? attn_bias, bool compute_log_sumexp, float dropout_p=0., bool is_causal=False, *,
#       float? scale=None) -> (Tensor output, Tensor log_sumexp, Tensor philox_seed,
#       Tensor philox_offset)
#   _scaled_dot_product_efficient_attention_backward(Tensor grad_out_, Tensor query, Tensor key,
#       Tensor value, Tensor attn_bias, Tensor out, Tensor logsumexp, Tensor philox_seed,
#       Tensor philox_offset, float dropout_p, bool[4] grad_input_mask, bool is_causal=False, *,
#       float? scale=None) -> (Tensor, Tensor, Tensor, Tensor)
# (batch, heads, seq, d) layout; log_sumexp (batch, heads, ceil(q_len / 32) * 32) float32
# (meta__scaled_dot_product_efficient_attention); is_causal is CausalFromTopLeft (our contract).
# ---------------------------------------------------------------------------------------------


def _expand_kv(q, k, v):
    # The CUDA efficient kernel has no grouped-query mode: expand to the query heads (reshape of
    # the expanded view copies, so the result is contiguous).
    groups = q.shape[1] // k.shape[1]
    if groups == 1:
        return k, v, 1
    b, hk, n, d = k.shape
    k = k[:, :, None].expand(b, hk, groups, n, d).reshape(b, hk * groups, n, d)
    v = v[:, :, None].expand(b, hk, groups, n, d).reshape(b, hk * groups, n, d)
    return k, v, groups


def _efficient_operand(t):
    # CHECK_NOSPARSE_LASTCONTIGUOUS_CUDA on q/k/v (a raise), and check_supported wants strides and
    # the start aligned to the kernel's vector (8 half / 4 float elements; a raise, or the slower
    # unaligned kernel): copy when the last dim is strided or anything is off an 8-element grid.
    return _aligned(t)


def _cuda_bias(attn_bias, q, k):
    """The bias as the efficient kernel reads it: a 4-D (batch, heads, q_len, kv_len) tensor of
    q's dtype (checked) whose last dim is contiguous (checked), whose rows start on 16-element
    boundaries, and whose storage extends to the end of each row rounded up to 16 elements.

    The kernel loads bias rows with 128-bit vectors and only predicates whole vectors, so the
    last vector of a row may read past kv_len: sdpa pads its mask rows to 16 for this kernel
    (`preprocess_mask`), and so do we. Broadcast dimensions stay broadcast (stride 0, no copy of
    the bias per head); only the dimensions the bias really has are materialised.
    """
    if attn_bias is None:
        return None
    shape = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    bias = attn_bias
    while bias.dim() < 4:
        bias = bias.unsqueeze(0)
    n, aligned = shape[3], -(-shape[3] // 16) * 16
    own = tuple(s if bs != 1 else 1 for s, bs in zip(shape[:3], bias.shape[:3]))
    if (n == aligned and bias.shape[-1] == n and bias.dtype == q.dtype and bias.stride(-1) == 1
            and bias.storage_offset() % 16 == 0
            and all(st % 16 == 0 for st, sz in zip(bias.stride()[:3], bias.shape[:3]) if sz > 1)):
        return bias.expand(shape)
    buf = torch.empty(own + (aligned,), dtype=q.dtype, device=q.device)
    buf[..., :n] = bias
    return buf[..., :n].expand(shape)


def _efficient_forward(q, k, v, *, is_causal, scale, attn_bias):
    n = q.shape[2]
    k, v, _ = _expand_kv(q, k, v)
    bias = _cuda_bias(attn_bias, q, k)
    q, k, v = (_efficient_operand(t) for t in (q, k, v))
    out, lse, _, _ = _aten._scaled_dot_product_efficient_attention(
        q, k, v, bias, True, 0.0, is_causal, scale=scale
    )
    return out, lse[..., :n].float()


def _pad_lse(lse):
    # The forward returns its log-sum-exp padded to a multiple of 32 queries; the backward reads it
    # through strides B and H only (the query stride is assumed 1), so hand it back in that form:
    # float32, (batch, heads, ceil(q_len / 32) * 32), contiguous.
    pad = (-lse.shape[-1]) % 32
    return torch.nn.functional.pad(lse.float(), (0, pad)).contiguous()


def _efficient_out(out):
    """`out` as the efficient backward must receive it: (batch, heads, q_len, d) whose memory is
    (batch, q_len, heads, d)-contiguous.

    THE FAULT (issue 34): for fp16/bf16 the backward kernel computes delta = rowsum(dO * O) itself
    (kKernelComputesDelta) and walks O's rows with a hard-coded row stride
    `o_strideM() = head_dim_value * num_heads` -- only O's batch and head strides are taken from
    the tensor. sdpa's own forward output has exactly that layout, but the merged `out` callers
    pass is (batch, heads, q_len, d)-contiguous (or a strided view): with heads > 1 the kernel
    read rows up to (heads - 1) * q_len * d elements past the tensor (an illegal address when
    that lands on unmapped memory) and used wrong rows for delta (wrong fp16/bf16 gradients).
    float32 computes delta with torch ops from the real strides, which is why float32 passed.
    """
    t = out.transpose(1, 2)
    if t.is_contiguous() and t.storage_offset() % 8 == 0:
        return out
    return t.clone(memory_format=torch.contiguous_format).transpose(1, 2)


def _efficient_backward(dout, q, k, v, out, lse, *, is_causal, scale, attn_bias):
    kv_heads = k.shape[1]
    k, v, groups = _expand_kv(q, k, v)
    bias = _cuda_bias(attn_bias, q, k)
    q, k, v = (_efficient_operand(t) for t in (q, k, v))
    # grad_out is made contiguous by the op itself (`grad_out_.contiguous()`); same dtype as q.
    dout = dout.to(q.dtype)
    out = _efficient_out(out.to(q.dtype))
    # seed / offset: read only with dropout (`if (use_dropout)`), never here.
    seed = torch.empty((), dtype=torch.int64, device=q.device)
    offset = torch.empty((), dtype=torch.int64, device=q.device)
    dq, dk, dv, _ = _aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, bias, out, _pad_lse(lse), seed, offset, 0.0, (True, True, True, False),
        is_causal, scale=scale,
    )
    if groups > 1:
        b, _, n, d = dk.shape
        dk = dk.view(b, kv_heads, groups, n, d).sum(2)
        dv = dv.view(b, kv_heads, groups, n, d).sum(2)
    return dq, dk, dv


# ---------------------------------------------------------------------------------------------
# Math: plain torch ops, any device and dtype (float64 on CUDA, or fused kernels disabled).
# Scores in float32 (float64 for float64 inputs); GQA by grouping the query heads of each kv head
# into the rows (no K/V copy).
# ---------------------------------------------------------------------------------------------


def _math_scores(q, k, *, is_causal, scale, attn_bias, acc):
    b, h, n, d = q.shape
    hk, m = k.shape[1], k.shape[2]
    g = h // hk
    qg = q.to(acc).reshape(b, hk, g * n, d)
    s = torch.matmul(qg, k.to(acc).transpose(-1, -2)).mul_(scale).view(b, hk, g, n, m)
    if attn_bias is not None:
        s = s + attn_bias.to(acc).expand(b, h, n, m).reshape(b, hk, g, n, m)
    if is_causal:
        keep = torch.ones(n, m, dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    return s  # (b, hk, g, n, m)


def _math_forward(q, k, v, *, is_causal, scale, attn_bias):
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    b, h, n, d = q.shape
    hk, m = k.shape[1], k.shape[2]
    g = h // hk
    s = _math_scores(q, k, is_causal=is_causal, scale=scale, attn_bias=attn_bias, acc=acc)
    lse = torch.logsumexp(s, dim=-1)
    # a row with no visible key: probabilities 0 (output 0), lse -inf
    p = torch.exp(s - lse.masked_fill(lse == float("-inf"), float("inf"))[..., None])
    out = torch.matmul(p.reshape(b, hk, g * n, m), v.to(acc)).reshape(b, h, n, d)
    return out.to(q.dtype), lse.reshape(b, h, n)


def _math_backward(dout, q, k, v, out, lse, *, is_causal, scale, attn_bias):
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    b, h, n, d = q.shape
    hk, m = k.shape[1], k.shape[2]
    g = h // hk
    s = _math_scores(q, k, is_causal=is_causal, scale=scale, attn_bias=attn_bias, acc=acc)
    lse = lse.to(acc).reshape(b, hk, g, n)
    p = torch.exp(s - lse.masked_fill(lse == float("-inf"), float("inf"))[..., None]).reshape(b, hk, g * n, m)
    do = dout.to(acc).reshape(b, hk, g * n, d)
    dv = torch.matmul(p.transpose(-1, -2), do)
    dp = torch.matmul(do, v.to(acc).transpose(-1, -2))
    delta = (do * out.to(acc).reshape(b, hk, g * n, d)).sum(-1, keepdim=True)
    ds = p * (dp - delta) * scale
    dq = torch.matmul(ds, k.to(acc)).view(b, h, n, d)
    dk = torch.matmul(ds.transpose(-1, -2), q.to(acc).reshape(b, hk, g * n, d))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
