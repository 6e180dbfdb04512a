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
