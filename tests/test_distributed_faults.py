"""Faults on real gloo processes: ranks that disagree get a clear error before any exchange; a
rank that dies, or raises and lingers, makes the others fail within the group timeout (no hang)."""
from __future__ import annotations

import os
import time

import pytest
import torch

from distributed_launch import launch

TIMEOUT_S = 4.0  # process-group timeout of these launches
LINGER_S = 3 * TIMEOUT_S  # how long the failed rank stays alive in the "lingers" case


def _qkv(n, heads=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, heads, n, 8, generator=g) for _ in range(3)]


def disagreeing_ranks(rank, world):
    import hf_dilated.distributed as hd

    group = hd.setup_sequence_parallel(world).sp_group
    errors = {}
    q, k, v = _qkv(8 if rank == 0 else 12)  # shapes differ
    try:
        hd.ring_attention(q, k, v, group=group)
    except ValueError as e:
        errors["shape"] = str(e)
    q, k, v = _qkv(8)
    try:  # configuration differs
        hd.dilated_ring_attention(q, k, v, [4, 8], [1, 2 if rank == 0 else 4], group=group)
    except ValueError as e:
        errors["config"] = str(e)
    try:  # layout differs
        hd.ring_attention(q, k, v, group=group, layout="zigzag" if rank == 0 else "contiguous")
    except ValueError as e:
        errors["layout"] = str(e)
    try:  # different kernels
        if rank == 0:
            hd.ring_attention(q, k, v, group=group)
        else:
            hd.block_sparse_ring_attention(q, k, v, {"type": "local", "window": 1}, block_size=2, group=group)
    except ValueError as e:
        errors["kernel"] = str(e)
    try:  # positions 0..n-1 on every rank: the model's default, not global positions
        hd.ring_attention(q, k, v, group=group, position_ids=torch.arange(8)[None])
    except ValueError as e:
        errors["positions"] = str(e)
    import warnings

    with warnings.catch_warnings(record=True) as caught:  # the same in the contiguous layout: said, not refused
        warnings.simplefilter("always")
        hd.ring_attention(q, k, v, group=group, layout="contiguous", position_ids=torch.arange(8)[None])
    errors["contiguous"] = [str(w.message) for w in caught]
    # The group is still usable after the errors: a correct call goes through.
    out = hd.ring_attention(q, k, v, group=group)
    errors["after"] = bool(torch.isfinite(out).all())
    return errors


def test_disagreeing_ranks_get_a_clear_error():
    for o in launch(disagreeing_ranks, 2):
        errs = o["result"]
        assert "disagree on 'q'" in errs["shape"], errs
        assert "disagree on 'dilation_rates'" in errs["config"], errs
        assert "disagree on 'layout'" in errs["layout"], errs
        assert "not all calling" in errs["kernel"], errs
        assert "global" in errs["positions"] and "shard_batch" in errs["positions"], errs
        assert any("one document per rank" in m and "shard_batch" in m for m in errs["contiguous"]), errs
        assert errs["after"] is True


def dying_rank(rank, world, how):
    import hf_dilated.distributed as hd

    group = hd.setup_sequence_parallel(world).sp_group
    q, k, v = (t.requires_grad_() for t in _qkv(64, seed=rank))
    out = hd.ring_attention(q, k, v, group=group)  # one good call: the ring works
    if rank == 1:
        if how == "killed":
            os._exit(17)  # dies without a word, sockets close
        time.sleep(LINGER_S)  # "raises" and lingers: alive but never joins the next exchange
        raise RuntimeError("rank 1 failed on purpose")
    start = time.monotonic()
    try:
        out = hd.ring_attention(q, k, v, group=group)
        out.sum().backward()
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}", "waited": time.monotonic() - start}
    return {"error": None, "waited": time.monotonic() - start}


@pytest.mark.parametrize("how", ["killed", "lingers"])
def test_a_failed_rank_makes_the_others_fail_within_the_timeout(how):
    outcomes = launch(dying_rank, 3, how, timeout_s=TIMEOUT_S, join_s=120, allow_failures=True)
    dead = outcomes[1]
    assert not dead["ok"] and (dead["exitcode"] == 17 if how == "killed" else "on purpose" in dead["error"])
    for o in (outcomes[0], outcomes[2]):
        assert o["ok"], o.get("traceback")  # the worker itself caught the survivor's error
        res = o["result"]
        assert res["error"] is not None, f"rank {o['rank']} completed a ring with a dead peer"
        # Bounded by the group timeout, not by the failed rank's lifetime (LINGER_S).
        assert res["waited"] < TIMEOUT_S + 0.4 * (LINGER_S - TIMEOUT_S), res


def _collective_devices(rank, world):
    """Child: where the signature check puts its tensor, for the gloo group it runs on, and for an
    NCCL group (the backend told, with a CUDA device: NCCL itself needs GPUs)."""
    import torch.distributed as dist

    from hf_dilated.distributed import faults

    out = {"gloo": str(faults.collective_device(dist.group.WORLD))}
    backend, available, current = dist.get_backend, torch.cuda.is_available, torch.cuda.current_device
    dist.get_backend = lambda group=None: "nccl"
    torch.cuda.is_available, torch.cuda.current_device = (lambda: True), (lambda: 1)
    try:
        out["nccl"] = str(faults.collective_device(dist.group.WORLD))
    finally:
        dist.get_backend, torch.cuda.is_available, torch.cuda.current_device = backend, available, current
    return out


def test_the_signature_check_takes_the_device_its_backend_needs():
    """The check every ring kernel runs before its first exchange all-gathered a CPU tensor: NCCL,
    which the fine-tuning example and accelerate choose on GPUs, takes CUDA tensors only, so no
    sequence-parallel call could have run on several GPUs (none was at hand to try)."""
    for outcome in launch(_collective_devices, 1):
        assert outcome["result"] == {"gloo": "cpu", "nccl": "cuda:1"}


def _nccl_signature_check(rank, world):
    import torch.distributed as dist

    from hf_dilated.distributed.faults import check_same_on_all_ranks

    group = dist.new_group([0], backend="nccl")
    return check_same_on_all_ranks(group, "a call", flags={"mask": True}, q=torch.zeros(2, 3), window=4)


@pytest.mark.cuda
def test_cuda_the_signature_check_runs_on_an_nccl_group():
    """(On a GPU) a one-process NCCL group: the check's all-gather failed there on a CPU tensor."""
    for outcome in launch(_nccl_signature_check, 1):
        assert outcome["result"] == {"mask": [True]}
