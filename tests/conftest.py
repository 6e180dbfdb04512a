import os
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

# tests/ is not a package: make `import reference` work under every pytest import mode.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def pytest_collection_modifyitems(config, items):
    if os.environ.get("HF_DILATED_SLOW_FIRST") == "1":
        # scripts/gpu_check.sh: the slow tests first (each group in its own order), so that its
        # workers start them at once rather than finish on them: on an H200 (2026-11-27) the CUDA
        # step stopped at 98%, its last tests the slow ones (10-61 s each, compiling)
        items.sort(key=lambda item: item.get_closest_marker("slow") is None)
    if torch.cuda.is_available():
        return
    skip_cuda = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip_cuda)


@pytest.fixture
def flash_band(monkeypatch):
    """backend.band_forward as it is on a GPU, here on the CPU: flash's sliding window (what
    local_band.near_plain's blocks compute, in float32 or float64 accumulators), its out in q's dtype
    laid out as its q is (flash's empty_like), its lse in float32 (float64 for float64 inputs; flash
    takes half precision alone, where it is float32). Yields the calls' lengths."""
    from hf_dilated.ops import backend
    from hf_dilated.ops.local_band import near_plain
    from hf_dilated.ops.merge import merge_dtype

    real, inside, calls = backend.band_forward, [], []

    def band_forward(q, k, v, *, window, scale):
        if inside:  # near_plain's own try of band_forward, below: the CPU's blocks
            return real(q, k, v, window=window, scale=scale)
        calls.append(q.shape[2])
        lo = k.shape[2] - q.shape[2]  # the queries are the last of the keys
        queries = torch.cat([q.new_zeros(q.shape[0], q.shape[1], lo, q.shape[3]), q], 2)
        acc = merge_dtype(q.dtype)
        out = torch.zeros(queries.shape, dtype=acc)
        lse = torch.full(queries.shape[:3], float("-inf"), dtype=acc)
        inside.append(1)
        try:
            near_plain(queries, k, v, out, lse, window, lo, scale)
        finally:
            inside.clear()
        laid = torch.empty_like(q.transpose(1, 2))  # flash's out: q's strides (empty_like keeps them)
        return laid.copy_(out[:, :, lo:].transpose(1, 2)).transpose(1, 2), lse[:, :, lo:]

    monkeypatch.setattr(backend, "band_forward", band_forward)
    yield calls


def tiny_default_llama(n: int, original: int, layers: int = 2, batch: int = 1):
    """(model, config, ids): a tiny LlamaForCausalLM (4 query / 2 kv heads of 16) under `dilated`,
    converted by the default conversion from `original` tokens to n + 8, and `batch` rows of n
    token ids: the model tests of the GPU's decode paths (run on the CPU with those paths widened)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_dilated.bench.gpu_table import _model_entry
    from hf_dilated.config import CONFIG_KEY

    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         num_hidden_layers=layers, intermediate_size=64, vocab_size=64, max_position_embeddings=n + 8)
    setattr(config, CONFIG_KEY, _model_entry("default", original, n + 8))
    torch.manual_seed(0)
    model = LlamaForCausalLM._from_config(config, attn_implementation="dilated").eval()
    ids = torch.randint(0, 64, (batch, n), generator=torch.Generator().manual_seed(1))
    return model, config, ids


# --- FlexAttention by its definition (tests of ops/sparse_far_train.py on the CPU) ---------------


def _listed(count, indices, q_tiles, k_tiles):
    """bool (batch, heads, q_tiles, k_tiles) of a BlockMask's (count, indices) lists."""
    taken = torch.arange(indices.shape[-1], device=indices.device) < count[..., None]
    index = torch.where(taken, indices.long(), k_tiles)[..., :k_tiles]
    dense = torch.zeros((*indices.shape[:-1], k_tiles + 1), dtype=torch.bool, device=indices.device)
    return dense.scatter_(-1, index, True)[..., :k_tiles][:, :, :q_tiles]


def flex_definition(q, k, v, block_mask, scale, kind="by_query"):
    """(out, lse) of a FlexAttention call by its definition, differentiable (float64 inside): every
    pair of a listed full tile, and the pairs of a listed partial tile that its mask_mod keeps."""
    batch, heads, rows, _ = q.shape
    n = k.shape[2]
    q_tile, k_tile = block_mask.BLOCK_SIZE
    q_tiles, k_tiles = -(-rows // q_tile), -(-n // k_tile)
    b = torch.arange(batch)[:, None, None, None]
    h = torch.arange(heads)[None, :, None, None]
    i = torch.arange(rows)[None, None, :, None]
    j = torch.arange(n)[None, None, None, :]
    mask_heads = block_mask.kv_num_blocks.shape[1]  # 1 or the query heads
    tiles = (b, h % mask_heads, i // q_tile, j // k_tile)
    partial = _listed(block_mask.kv_num_blocks, block_mask.kv_indices, q_tiles, k_tiles)[tiles]
    read = partial & block_mask.mask_mod(b, h, i, j)
    if block_mask.full_kv_num_blocks is not None:
        read = read | _listed(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, q_tiles, k_tiles)[tiles]
    group = heads // k.shape[1]
    keys, values = (t.to(torch.float64).repeat_interleave(group, 1) for t in (k, v))
    scores = scale * q.to(torch.float64) @ keys.transpose(-1, -2)
    empty = ~read.any(-1)
    top = torch.where(read, scores, float("-inf")).amax(-1, keepdim=True).detach()
    top = torch.where(empty[..., None], 0.0, top)
    weights = torch.where(read, torch.exp(scores - top), 0.0)
    total = weights.sum(-1)
    total = torch.where(empty, 1.0, total)
    out = (weights / total[..., None]) @ values
    lse = torch.where(empty, float("-inf"), torch.log(total) + top[..., 0])
    return out.to(q.dtype), lse.to(torch.float64 if q.dtype == torch.float64 else torch.float32)


@pytest.fixture
def gpu_training_path(monkeypatch):
    """ops/sparse_far_train taken on the CPU, where FlexAttention has no backward: flex_definition
    stands in for FlexAttention's calls that autograd differentiates (the others run torch's eager
    FlexAttention). Each call runs outside any dispatch mode (tests/test_host_sync.py's counter: on
    CUDA it is one compiled kernel); what autograd then does with the definition's operations is
    counted."""
    from torch.utils._python_dispatch import _disable_current_modes

    from hf_dilated.ops import sparse_far_flex, sparse_far_train

    real = sparse_far_flex._flex_call

    def flex_call(q, k, v, block_mask, scale, kind="by_query"):
        with _disable_current_modes():
            if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
                return flex_definition(q, k, v, block_mask, scale, kind)
            return real(q, k, v, block_mask, scale, kind)

    monkeypatch.setattr(sparse_far_flex, "_flex_call", flex_call)
    monkeypatch.setattr(sparse_far_train, "DEVICES", ("cuda", "cpu"))


@pytest.fixture
def training_calls(monkeypatch):
    """The row lengths of the calls ops/sparse_far_train serves (a list, filled as they come)."""
    from hf_dilated.ops import sparse_far_train

    calls, real = [], sparse_far_train.sparse_far_attention

    def counted(*args):
        calls.append(args[0].shape[2])
        return real(*args)

    monkeypatch.setattr(sparse_far_train, "sparse_far_attention", counted)
    return calls


class LargestTensor(TorchDispatchMode):
    """The most entries of a tensor any operation made."""

    def __init__(self):
        super().__init__()
        self.entries = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.entries = max(self.entries, t.numel())
        return out
