"""examples/sequence_parallel_demo.py under `accelerate launch` with 4 processes (2 data-parallel
x 2 sequence-parallel, DDP over gloo) trains exactly like one process: same losses, same weights."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "examples", "sequence_parallel_demo.py")


@pytest.mark.slow
def test_accelerate_dp2_x_sp2_trains_like_one_process(tmp_path):
    common = ["--steps", "2", "--attn", "dilated_ring", "--timeout", "120"]
    single = [sys.executable, DEMO, *common, "--out", str(tmp_path / "single")]
    grid = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "4",
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
            "0", DEMO, *common, "--sp", "2", "--out", str(tmp_path / "grid")]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for cmd in (single, grid)]
    for p in procs:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out[-4000:]
    a = json.load(open(tmp_path / "single.json"))
    b = json.load(open(tmp_path / "grid.json"))
    assert (a["processes"], b["processes"], b["sp"]) == (1, 4, 2)
    assert len(a["losses"]) == len(b["losses"]) == 2
    for la, lb in zip(a["losses"], b["losses"]):
        assert abs(la - lb) < 1e-5, (a["losses"], b["losses"])
    wa, wb = load_file(tmp_path / "single.safetensors"), load_file(tmp_path / "grid.safetensors")
    assert wa.keys() == wb.keys()
    for name in wa:
        assert torch.allclose(wa[name], wb[name], atol=1e-5, rtol=0), name
    # The weights did move: the comparison is not between two untouched initialisations.
    sys.path.insert(0, os.path.dirname(DEMO))
    try:
        from sequence_parallel_demo import build_model
    finally:
        sys.path.pop(0)
    initial = build_model("dilated_ring").state_dict()
    assert max((initial[n] - wa[n]).abs().max().item() for n in wa) > 1e-3
