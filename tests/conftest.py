import os
import sys

import pytest
import torch

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
