"""Ring kernels on real gloo processes (2 and 4 ranks) against the dense float64 reference of
docs/contract.md (tests/reference.py): outputs and q/k/v gradients, with GQA, both layouts,
padding, packed documents and a length the layout cannot split evenly.

Process start-up is slow, so each launch runs a list of cases; the parent process builds the
inputs, the children shard them, run the kernel forward and backward, and gather the results.
"""
from __future__ import annotations

import pytest
import torch

import reference
from distributed_launch import launch

TOL = 1e-4  # docs/contract.md 8: float32 against the float64 reference
SINGLE_TOL = 1e-5  # float32 against the single-process kernel on the whole sequence
LOW_TOL = 2e-2  # bfloat16


def make_case(kernel, *, seed, batch=2, q_heads=4, kv_heads=2, seq_len=32, head_dim=8, layout="zigzag",
              padding=False, packed=False, holes=False, offset=0, dtype=torch.float32, logit_scale=1.0, **kwargs):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(batch, q_heads, seq_len, head_dim, generator=g) * logit_scale).to(dtype)
    k = (torch.randn(batch, kv_heads, seq_len, head_dim, generator=g) * logit_scale).to(dtype)
    v = torch.randn(batch, kv_heads, seq_len, head_dim, generator=g).to(dtype)
    dout = torch.randn(batch, q_heads, seq_len, head_dim, generator=g).to(dtype)
    far = {}
    if kwargs.pop("far", False):  # far projections of a local band (docs/contract.md 4.1)
        far = dict(q_far=torch.randn(batch, q_heads, seq_len, head_dim, generator=g).to(dtype),
                   k_far=torch.randn(batch, kv_heads, seq_len, head_dim, generator=g).to(dtype))
    mask = pos = None
    if padding:  # row 0 left-padded by 5, row 1 right-padded by 3
        mask = torch.ones(batch, seq_len, dtype=torch.long)
        mask[0, :5] = 0
        mask[-1, seq_len - 3:] = 0
    if packed:  # documents of lengths 7, 13, rest; positions restart at 0
        pos = torch.cat([torch.arange(7), torch.arange(13), torch.arange(seq_len - 20)]).expand(batch, seq_len)
        pos = pos.clone()
        pos[1] = torch.cat([torch.arange(11), torch.arange(seq_len - 11)])
    if holes:  # padding inside the sequence, so inside one rank's shard
        mask = torch.ones(batch, seq_len, dtype=torch.long) if mask is None else mask
        mask[:, 9] = 0
        mask[-1, 17:19] = 0
    if offset:  # positions that do not start at 0 (docs/contract.md 6: ring is dense whatever they are)
        pos = (torch.arange(seq_len).expand(batch, seq_len) if pos is None else pos) + offset
    return dict(kernel=kernel, q=q, k=k, v=v, dout=dout, attention_mask=mask, position_ids=pos,
                layout=layout, kwargs=kwargs, **far)


def _inputs(case):
    """The differentiated inputs of a case: q, k, v and, with a band's far projections, q_far, k_far."""
    return ("q", "k", "v") + (("q_far", "k_far") if "q_far" in case else ())


def reference_result(case):
    inputs = [case[n].double().requires_grad_() for n in _inputs(case)]
    q, k, v = inputs[:3]
    kw = dict(attention_mask=case["attention_mask"], position_ids=case["position_ids"],
              sliding_window=case["kwargs"].get("sliding_window"))
    if case["kernel"] == "ring":
        out = reference.dense_causal_reference(q, k, v, **kw)
    elif case["kwargs"].get("local_window") is not None:
        a = case["kwargs"]
        far = dict(zip(("q_far", "k_far"), inputs[3:]))
        out = reference.local_band_reference(q, k, v, a["segment_lengths"], a["dilation_rates"], a["local_window"],
                                             **far, **kw)
    elif case["kernel"] == "dilated_ring":
        a = case["kwargs"]
        out = reference.dilated_reference(q, k, v, a["segment_lengths"], a["dilation_rates"],
                                          a.get("mode", "union"), **kw)
    else:
        a = case["kwargs"]
        out = reference.block_sparse_reference(q, k, v, spec_layout(a["pattern"], 64), a["block_size"], **kw)
    real_q = query_weights(case)
    (out * case["dout"].double() * real_q.double()).sum().backward()
    return (out.detach(), *(t.grad for t in inputs))


def single_process_result(case):
    """The single-process kernel on the whole sequence, float32: what the ranks must reproduce."""
    from hf_dilated.ops import dilated_attention
    from hf_dilated.ops.dense import dense_attention

    inputs = [case[n].clone().requires_grad_() for n in _inputs(case)]
    q, k, v = inputs[:3]
    kw = dict(attention_mask=case["attention_mask"], position_ids=case["position_ids"],
              sliding_window=case["kwargs"].get("sliding_window"))
    if case["kernel"] == "ring":
        out = dense_attention(q, k, v, **kw)
    elif case["kernel"] == "dilated_ring":
        a = case["kwargs"]
        out = dilated_attention(q, k, v, a["segment_lengths"], a["dilation_rates"], mode=a.get("mode", "union"),
                                local_window=a.get("local_window"), **dict(zip(("q_far", "k_far"), inputs[3:])),
                                **kw)
    else:
        from hf_dilated.ops.block_sparse import block_sparse_attention

        a = case["kwargs"]
        out = block_sparse_attention(q, k, v, a["pattern"], block_size=a["block_size"], **kw)
    (out * case["dout"] * query_weights(case)).sum().backward()
    return (out.detach(), *(t.grad for t in inputs))


def spec_layout(pattern, num_blocks):
    """docs/contract.md 5: the layout (1, heads or 1, bq, bk) of a pattern, from its formula."""
    bq = torch.arange(num_blocks)[:, None]
    bk = torch.arange(num_blocks)[None, :]
    d = bq - bk
    kind = pattern["type"]
    if kind == "local":
        allowed = (d >= 0) & (d < pattern["window"])
    elif kind == "dilated":
        allowed = ((d >= 0) & (d < pattern["window"])) | (d % pattern["stride"] == 0)
    elif kind == "global_local":
        allowed = (bk < pattern["global_blocks"]) | ((d >= 0) & (d < pattern["window"]))
    elif kind == "custom":
        return torch.as_tensor(pattern["layout"])[None]
    else:
        raise AssertionError(kind)
    return allowed[None, None]


def query_weights(case):
    # Outputs at padded query slots are unspecified (docs/contract.md 3.1): leave them out of the loss
    # and checks.
    mask = case["attention_mask"]
    if mask is None:
        return torch.ones(1, 1, case["q"].shape[2], 1)
    return mask[:, None, :, None].to(case["q"].dtype)


def run_cases(rank, world, runs):
    """Child: for each (sp_size, cases_by_dp_rank) of `runs`, sets up the DP x SP grid and runs its
    data-parallel replica's cases; returns (SP-group rank 0 only) the gathered outputs and gradients."""
    return [run_grid(sp_size, cases_by_dp) for sp_size, cases_by_dp in runs]


def run_grid(sp_size, cases_by_dp):
    import torch.distributed as dist

    import hf_dilated.distributed as hd
    from hf_dilated.distributed.layout import padded_length, shard, unshard

    sp = hd.setup_sequence_parallel(sp_size)
    group, p, r = sp.sp_group, sp.sp_size, sp.sp_rank
    results = []
    for case in cases_by_dp[sp.dp_rank]:
        layout, seq_len = case["layout"], case["q"].shape[2]
        total = padded_length(seq_len, p, layout)
        pad = total - seq_len

        def prep(t, dim, value=0.0):
            if t is None:
                return None
            if pad:
                if t.dim() == 2 and t.dtype == torch.long and value == "continue":
                    t = torch.cat([t, t[:, -1:] + torch.arange(1, pad + 1)], dim=1)
                else:
                    shape = list(t.shape)
                    shape[dim] = pad
                    t = torch.cat([t, torch.full(shape, value, dtype=t.dtype)], dim=dim)
            return shard(t, p, r, layout, dim=dim).contiguous()

        inputs = [prep(case[n], 2).requires_grad_() for n in _inputs(case)]
        q, k, v = inputs[:3]
        far = dict(zip(("q_far", "k_far"), inputs[3:]))
        dout = prep(case["dout"] * query_weights(case), 2)
        mask = prep(case["attention_mask"], 1, 0) if case["attention_mask"] is not None else None
        pos = prep(case["position_ids"], 1, "continue") if case["position_ids"] is not None else None
        fn = {"ring": hd.ring_attention, "dilated_ring": hd.dilated_ring_attention,
              "block_sparse_ring": hd.block_sparse_ring_attention}[case["kernel"]]
        out = fn(q, k, v, group=group, layout=layout, attention_mask=mask, position_ids=pos, **far, **case["kwargs"])
        (out * dout).sum().backward()
        gathered = []
        for t in (out.detach(), *(t.grad for t in inputs)):
            parts = [torch.empty_like(t) for _ in range(p)]
            dist.all_gather(parts, t.contiguous(), group=group)
            gathered.append(unshard(parts, layout, dim=2)[:, :, :seq_len])
        results.append(gathered)
    return results if r == 0 else None


def check(outcomes, runs):
    checked = 0
    for i, (sp_size, cases_by_dp) in enumerate(runs):
        for o in outcomes:
            if o["result"][i] is None:
                continue
            dp_rank = o["rank"] // sp_size
            checked += check_group(o["result"][i], cases_by_dp[dp_rank], dp_rank)
    assert checked == sum(len(c) for _, by_dp in runs for c in by_dp)


def check_group(results, cases, dp_rank):
    assert len(results) == len(cases)
    for case, got in zip(cases, results):
        w = query_weights(case)
        low = case["q"].dtype != torch.float32  # docs/contract.md 8: bfloat16 / float16 within 2e-2
        for what, want, tol in (("reference", reference_result(case), LOW_TOL if low else TOL),
                                ("single process", single_process_result(case),
                                 LOW_TOL if low else case.get("single_tol", SINGLE_TOL))):
            assert len(got) == len(want)
            for name, a, b in zip(("out", "dq", "dk", "dv", "dq_far", "dk_far"), got, want):
                if name == "out":
                    a, b = a * w, b * w
                err = (a.double() - b.double()).abs().max().item()
                assert err < tol, (f"{case['kernel']} {case['layout']} {case['kwargs']} group {dp_rank}: "
                                   f"{name} differs from the {what} by {err}")
    return len(cases)


RING_CASES = [
    make_case("ring", seed=0),
    make_case("ring", seed=1, layout="contiguous", q_heads=2, kv_heads=2),
    make_case("ring", seed=2, padding=True),
    make_case("ring", seed=3, packed=True, layout="contiguous"),
    make_case("ring", seed=4, packed=True, padding=True),
    make_case("ring", seed=5, seq_len=30),  # not a multiple of 2P: padded at the end
    make_case("ring", seed=6, packed=True, dtype=torch.bfloat16),
    make_case("ring", seed=7, offset=100),
    make_case("ring", seed=8, offset=45, packed=True, holes=True, layout="contiguous"),
    make_case("ring", seed=9, holes=True, padding=True),
]
# ring.py cuts each shard into tiles of at least 16 tokens and calls of at least 64 rows: at 32
# tokens a tile is a whole chunk; these are long enough for several tiles per chunk, rows of several
# tiles per call, and causal tiles with a diagonal (with padding, documents, GQA, both layouts, an
# uneven length and a sliding window that cuts through tiles), for the dense ring and for the sparse
# kernels that stream on it (every mode, a pattern per head, only the needed entries travelling).
# Against the single-process kernel in float32 the sums over ~1000 keys (dK/dV: queries) add up in
# another order, so they differ by a few 1e-5; the float64 reference check keeps TOL.
LONG_RING_CASES = [dict(case, single_tol=5e-5) for case in (
    make_case("ring", seed=50, seq_len=1040, head_dim=4),
    make_case("ring", seed=51, seq_len=1030, head_dim=4, packed=True, padding=True, holes=True),
    make_case("ring", seed=52, seq_len=1024, head_dim=4, layout="contiguous", q_heads=4, kv_heads=1, packed=True),
    make_case("ring", seed=53, seq_len=1024, head_dim=4, sliding_window=37, padding=True),
    make_case("dilated_ring", seed=54, seq_len=1040, head_dim=4, segment_lengths=[64, 256, 1024],
              dilation_rates=[1, 2, 4], packed=True, padding=True),
    make_case("dilated_ring", seed=55, seq_len=1024, head_dim=4, mode="longnet", segment_lengths=[96, 512],
              dilation_rates=[2, 4], layout="contiguous", holes=True),
    # a band of 150 positions with far projections: plain (near, far and straddling calls), and with
    # padding and packed documents
    make_case("dilated_ring", seed=60, seq_len=1040, head_dim=4, local_window=150, far=True,
              segment_lengths=[64, 256, 1024], dilation_rates=[1, 2, 4]),
    make_case("dilated_ring", seed=61, seq_len=1030, head_dim=4, local_window=150, far=True, packed=True,
              padding=True, holes=True, segment_lengths=[2048], dilation_rates=[1]),
    # plain tokens: far calls compacted with no mask at all (heads of one kv head read different keys)
    make_case("dilated_ring", seed=59, seq_len=1024, head_dim=4, q_heads=4, kv_heads=2, segment_lengths=[64, 256, 1024],
              dilation_rates=[1, 2, 4]),
    make_case("dilated_ring", seed=56, seq_len=1024, head_dim=4, q_heads=4, kv_heads=4, mode="head_groups",
              segment_lengths=[128, 1024], dilation_rates=[1, 4], sliding_window=300),
    make_case("block_sparse_ring", seed=57, seq_len=1024, head_dim=4, block_size=64, padding=True, packed=True,
              pattern={"type": "global_local", "global_blocks": 1, "window": 2}),
    make_case("block_sparse_ring", seed=58, seq_len=1024, head_dim=4, block_size=32, layout="contiguous",
              pattern={"type": "custom", "layout": (torch.rand(4, 34, 34, generator=torch.Generator().manual_seed(9))
                                                    < 0.3).tolist()}),
)]


DILATED = dict(segment_lengths=[8, 16], dilation_rates=[1, 2])
DILATED_CASES = [
    make_case("dilated_ring", seed=10, **DILATED),
    make_case("dilated_ring", seed=11, q_heads=4, kv_heads=4, segment_lengths=[4, 16, 32], dilation_rates=[1, 2, 4]),
    make_case("dilated_ring", seed=12, mode="longnet", segment_lengths=[6, 16], dilation_rates=[2, 4]),
    make_case("dilated_ring", seed=13, mode="head_groups", segment_lengths=[4, 8, 32], dilation_rates=[1, 2, 4],
              layout="contiguous"),
    make_case("dilated_ring", seed=14, padding=True, packed=True, segment_lengths=[4, 32], dilation_rates=[1, 4]),
    make_case("dilated_ring", seed=15, seq_len=29, **DILATED),
    make_case("dilated_ring", seed=16, dtype=torch.bfloat16, **DILATED),
    # a local band (docs/contract.md 4.1), its far keys with far projections or with q, k
    make_case("dilated_ring", seed=17, local_window=6, far=True, segment_lengths=[8, 32], dilation_rates=[1, 2]),
    make_case("dilated_ring", seed=18, local_window=5, padding=True, packed=True, segment_lengths=[4, 32],
              dilation_rates=[1, 4]),
    make_case("dilated_ring", seed=19, local_window=7, far=True, holes=True, layout="contiguous", q_heads=4,
              kv_heads=1, segment_lengths=[4, 16], dilation_rates=[2, 4]),
]


CUSTOM = (torch.rand(4, 8, 8, generator=torch.Generator().manual_seed(7)) < 0.4).tolist()  # per-head layout
BLOCK_CASES = [
    make_case("block_sparse_ring", seed=20, pattern={"type": "local", "window": 2}, block_size=4),
    make_case("block_sparse_ring", seed=21, pattern={"type": "global_local", "global_blocks": 1, "window": 1},
              block_size=4, padding=True),
    make_case("block_sparse_ring", seed=22, pattern={"type": "dilated", "window": 1, "stride": 3}, block_size=2,
              packed=True, layout="contiguous"),
    make_case("block_sparse_ring", seed=23, pattern={"type": "custom", "layout": CUSTOM}, block_size=4, seq_len=31),
]


# Sliding window (docs/contract.md 3.3): by global index, whatever rank holds the key.
WINDOW_CASES = [
    make_case("ring", seed=40, sliding_window=5),
    make_case("ring", seed=41, sliding_window=11, padding=True, holes=True, layout="contiguous"),
    make_case("ring", seed=42, sliding_window=9, packed=True, seq_len=30),
    make_case("dilated_ring", seed=43, sliding_window=6, **DILATED),
    make_case("dilated_ring", seed=44, sliding_window=10, mode="longnet", padding=True, segment_lengths=[6, 16],
              dilation_rates=[2, 4]),
    make_case("dilated_ring", seed=45, sliding_window=3, mode="head_groups", packed=True, layout="contiguous",
              segment_lengths=[4, 8, 32], dilation_rates=[1, 2, 4]),
    make_case("dilated_ring", seed=48, sliding_window=9, local_window=4, far=True, padding=True,
              segment_lengths=[8, 32], dilation_rates=[1, 2]),
    make_case("block_sparse_ring", seed=46, sliding_window=7, pattern={"type": "global_local", "global_blocks": 1,
                                                                        "window": 3}, block_size=4, padding=True),
    make_case("block_sparse_ring", seed=47, sliding_window=12, pattern={"type": "custom", "layout": CUSTOM},
              block_size=4, holes=True),
]


def test_kernels_with_a_sliding_window_two_and_four_ranks():
    # Two data-parallel groups of 2 ranks share the cases, then one ring of four ranks.
    runs = [(2, [WINDOW_CASES[:4], WINDOW_CASES[4:]]), (4, [WINDOW_CASES[:1] + WINDOW_CASES[3:5] + WINDOW_CASES[6:8]])]
    check(launch(run_cases, 4, runs), runs)


@pytest.mark.parametrize("offset", (0, 17, 100, 1000))
def test_ring_on_one_process_is_dense_whatever_the_positions(offset):
    """With no group, ring_attention is exact dense causal attention: it used to cut segments at
    multiples of kv_len in position space, so positions 100..131 split the sequence at 128."""
    from hf_dilated.distributed import ring_attention

    for case in (make_case("ring", seed=30, offset=offset), make_case("ring", seed=31, offset=offset, holes=True,
                                                                        packed=True)):
        q, k, v = (case[n].clone().requires_grad_() for n in ("q", "k", "v"))
        out = ring_attention(q, k, v, attention_mask=case["attention_mask"], position_ids=case["position_ids"])
        w = query_weights(case)
        (out * case["dout"] * w).sum().backward()
        want_out, *want_grads = reference_result(case)
        for a, b in zip((out.detach() * w, q.grad, k.grad, v.grad), (want_out * w, *want_grads)):
            assert (a.double() - b).abs().max() < TOL


def test_kernels_two_ranks():
    runs = [(2, [RING_CASES + DILATED_CASES + BLOCK_CASES])]
    check(launch(run_cases, 2, runs), runs)


def test_kernels_with_tiles_of_several_tokens_two_three_and_four_ranks():
    for world in (2, 3, 4):
        runs = [(world, [LONG_RING_CASES])]
        check(launch(run_cases, world, runs, join_s=300.0), runs)


def test_kernels_four_ranks_and_dp_sp_grid():
    # One ring of four ranks, then 2 data-parallel x 2 sequence-parallel groups with different data.
    four = [RING_CASES[0], RING_CASES[4], RING_CASES[5], RING_CASES[7], RING_CASES[8], DILATED_CASES[1], DILATED_CASES[4], BLOCK_CASES[1],
            BLOCK_CASES[3]]
    runs = [(4, [four]), (2, [[RING_CASES[2], DILATED_CASES[0]], [RING_CASES[3], DILATED_CASES[2]]])]
    check(launch(run_cases, 4, runs), runs)


def grid_and_batch_helpers(rank, world):
    """Child: the DP x SP grid, shard_batch, gather_sequence (and its gradient), reduce_loss."""
    import torch.distributed as dist

    import hf_dilated.distributed as hd

    sp = hd.setup_sequence_parallel(2, layout="zigzag")
    assert hd.get_sequence_parallel_group() is sp.sp_group
    ranks_sp = dist.get_process_group_ranks(sp.sp_group)
    ranks_dp = dist.get_process_group_ranks(sp.dp_group)
    ids = torch.arange(100, 130).view(1, 30) + 1000 * sp.dp_rank  # 30 tokens: padded to 32 (4 chunks)
    batch = hd.shard_batch(ids, labels=ids)
    # Labels already shifted (transformers' shift_labels) are sharded as they are: the last one kept.
    preshifted = hd.shard_batch(ids, shift_labels=ids)
    # gather_sequence rebuilds the sequence; its backward hands every rank the gradient of its slice
    x = batch["input_ids"].double().requires_grad_()
    full = hd.gather_sequence(x, seq_len=30)
    weights = torch.arange(30, dtype=torch.double)
    (full * weights).sum().backward()
    gathered_pos = hd.gather_sequence(batch["position_ids"])
    gathered_labels = hd.gather_sequence(batch["labels"])
    loss = hd.reduce_loss(torch.tensor(float(sp.sp_rank + 1), requires_grad=True), grad_reduction="mean")
    return dict(ranks_sp=ranks_sp, ranks_dp=ranks_dp, sp_rank=sp.sp_rank, dp_rank=sp.dp_rank,
                full=full.detach(), grad=x.grad, input_ids=batch["input_ids"], pos=gathered_pos,
                labels=gathered_labels, items=int(batch["num_items_in_batch"]), loss=loss.item(),
                preshifted=hd.gather_sequence(preshifted["labels"]),
                preshifted_items=int(preshifted["num_items_in_batch"]),
                state=(hd.get_sequence_parallel_layout(), sp.sp_size, sp.dp_size))


def test_grid_shard_batch_gather_and_loss_helpers():
    from hf_dilated.distributed.layout import shard

    outcomes = launch(grid_and_batch_helpers, 4)
    for o in outcomes:
        r, res = o["rank"], o["result"]
        assert res["ranks_sp"] == [r - r % 2, r - r % 2 + 1] and res["ranks_dp"] == [r % 2, r % 2 + 2]
        assert (res["sp_rank"], res["dp_rank"], res["state"]) == (r % 2, r // 2, ("zigzag", 2, 2))
        ids = torch.arange(100, 130).view(1, 30) + 1000 * (r // 2)
        padded = torch.cat([ids, torch.zeros(1, 2, dtype=ids.dtype)], dim=1)
        assert torch.equal(res["input_ids"], shard(padded, 2, r % 2, "zigzag"))
        assert torch.equal(res["full"], ids.double())
        # zigzag: rank 0 holds tokens 0-7 and 24-31, rank 1 tokens 8-23; the padding gets no gradient.
        # Both ranks of the group backpropagate the same sum: a shard's gradient is the sum over ranks.
        weights = torch.cat([torch.arange(30, dtype=torch.double), torch.zeros(2, dtype=torch.double)])
        assert torch.equal(res["grad"][0], 2 * shard(weights[None], 2, r % 2, "zigzag")[0])
        assert torch.equal(res["pos"][0], torch.arange(32))  # global positions, continuing into the padding
        want_labels = torch.cat([ids[0, 1:], torch.full((3,), -100)])  # shifted before sharding
        assert torch.equal(res["labels"][0], want_labels)
        assert torch.equal(res["preshifted"][0], torch.cat([ids[0], torch.full((2,), -100)]))
        assert res["preshifted_items"] == 30
        assert res["items"] == 29
        assert res["loss"] == 3.0  # 1 + 2 over the SP group


def shard_batch_against_setup(rank, world):
    """Child: shard_batch given a group or layout other than setup_sequence_parallel's."""
    import warnings

    import torch.distributed as dist

    import hf_dilated.distributed as hd

    ids = torch.arange(100, 130).view(1, 30)
    out = {}
    # No grid set: a group is for the kernels called with it; said once (the ring names ignore it).
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["no_setup"] = hd.shard_batch(ids, labels=ids, group=dist.group.WORLD)["input_ids"]
        hd.shard_batch(ids, labels=ids, group=dist.group.WORLD)
    out["no_setup_warnings"] = [str(w.message) for w in caught]
    errors = {}
    # (sp_size 1: each rank its own group, the two-process group is another one)
    for name, sp_size, kwargs in (("layout", world, dict(layout="contiguous")), ("group", 1, dict(group=dist.group.WORLD))):
        hd.setup_sequence_parallel(sp_size, layout="zigzag")
        try:
            hd.shard_batch(ids, labels=ids, **kwargs)
        except ValueError as e:
            errors[name] = str(e)
    out["errors"] = errors
    # The grid's own group and layout, given explicitly (the same ranks in another group object too): fine.
    hd.setup_sequence_parallel(world, layout="zigzag")
    out["same"] = [hd.shard_batch(ids, labels=ids, **kwargs)["input_ids"]
                   for kwargs in ({}, dict(layout="zigzag"), dict(group=dist.group.WORLD))]
    hd.destroy_sequence_parallel()
    return out


def test_shard_batch_refuses_a_group_or_layout_the_model_does_not_read():
    """(review) The `*_ring` names read only setup_sequence_parallel's group and layout: shard_batch
    with another layout (zigzag set, contiguous given) or with a group and no setup gave a wrong
    loss without a word (4.149783 and 4.152371 against 4.151953 and 4.151654)."""
    from hf_dilated.distributed.layout import shard

    for o in launch(shard_batch_against_setup, 2):
        r, res = o["rank"], o["result"]
        ids = torch.cat([torch.arange(100, 130).view(1, 30), torch.zeros(1, 2, dtype=torch.long)], dim=1)
        assert torch.equal(res["no_setup"], shard(ids, 2, r, "zigzag"))
        assert len(res["no_setup_warnings"]) == 1, res["no_setup_warnings"]
        assert "read only the group of setup_sequence_parallel" in res["no_setup_warnings"][0]
        assert res["errors"]["layout"].startswith("layout='contiguous' differs from the layout set by "
                                                  "setup_sequence_parallel ('zigzag')"), res["errors"]
        assert res["errors"]["group"].startswith(f"group (ranks [0, 1]) is not the sequence-parallel group set by "
                                                 f"setup_sequence_parallel (ranks [{r}])"), res["errors"]
        assert "`*_ring` attention reads" in res["errors"]["layout"] and "`*_ring` attention reads" in res["errors"]["group"]
        for got in res["same"]:
            assert torch.equal(got, shard(ids, 2, r, "zigzag"))


def traffic(rank, world):
    """Child: bytes sent per rank by one forward + backward of each kernel on 32 tokens."""
    import hf_dilated.distributed as hd

    group = hd.setup_sequence_parallel(world).sp_group
    g = torch.Generator().manual_seed(0)
    heads, n = 4, 32 // world
    q, k, v = (torch.randn(1, heads, n, 8, generator=g).requires_grad_() for _ in range(3))
    calls = {
        "ring": lambda: hd.ring_attention(q, k, v, group=group),
        # 2 ranks, zigzag: chunks of 8 tokens, so 8-token segments never cross a rank boundary
        "within_chunks": lambda: hd.dilated_ring_attention(q, k, v, [8], [1], group=group),
        "dense_as_dilated": lambda: hd.dilated_ring_attention(q, k, v, [32], [1], group=group),
        "windowed": lambda: hd.dilated_ring_attention(q, k, v, [32], [1], group=group, sliding_window=4),
        "rate_4": lambda: hd.dilated_ring_attention(q, k, v, [32], [4], group=group),
        "local_blocks": lambda: hd.block_sparse_ring_attention(q, k, v, {"type": "local", "window": 1},
                                                               block_size=8, group=group),
    }
    sent = {}
    for name, call in calls.items():
        hd.reset_bytes_sent()
        call().sum().backward()
        sent[name] = sum(hd.bytes_sent().values())
    return sent


def test_sparse_kernels_send_only_what_is_visible():
    for o in launch(traffic, 2):
        sent = o["result"]
        assert sent["ring"] > 0
        assert sent["within_chunks"] == 0 and sent["local_blocks"] == 0  # nothing crosses a rank
        assert sent["dense_as_dilated"] > 0
        assert 0 < sent["windowed"] < sent["dense_as_dilated"] / 2, sent  # only keys within 3 of a query travel
        # one query head per kv head, dilation 4: each head needs a quarter of the remote keys
        assert sent["rate_4"] * 4 == sent["dense_as_dilated"], sent


def gathered_tokens(rank, world, cases):
    """Child: global_tokens from this rank's shards of each case's global mask and positions (a
    shard with no padding passes no mask, as transformers does)."""
    import torch.distributed as dist

    from hf_dilated.distributed.layout import shard
    from hf_dilated.distributed.tokens import global_tokens

    out = []
    for seq_len, mask, pos, layout in cases:
        local_mask = None if mask is None else shard(mask, world, rank, layout)
        if local_mask is not None and bool(local_mask.all()):
            local_mask = None
        local_pos = None if pos is None else shard(pos, world, rank, layout)
        any_mask = torch.tensor([local_mask is not None], dtype=torch.long)
        dist.all_reduce(any_mask, op=dist.ReduceOp.MAX)
        t = global_tokens(2, seq_len // world, attention_mask=local_mask, position_ids=local_pos,
                          group=dist.group.WORLD, layout=layout, device=torch.device("cpu"),
                          any_mask=bool(any_mask.item()), any_positions=pos is not None)
        out.append((t.positions, t.real, t.doc, t.plain, t.local_index))
    return out


def test_global_tokens_are_the_kernels_rule_on_the_gathered_sequence():
    """The ring kernels' view of the tokens is ops.token_layout.token_layout applied to the whole
    sequence (docs/contract.md 3.1), whatever the layout and whichever ranks hold padding."""
    from hf_dilated.distributed.layout import shard_indices
    from hf_dilated.ops.token_layout import token_layout

    n = 16
    holes = torch.ones(2, n, dtype=torch.long)
    holes[0, :3] = 0
    holes[0, 9] = 0
    holes[1, 13:] = 0
    first_rank_only = torch.ones(2, n, dtype=torch.long)  # padding in tokens 0-1: rank 0's shard in both layouts
    first_rank_only[:, :2] = 0
    packed = torch.cat([torch.arange(5), torch.arange(7), torch.arange(4)]).expand(2, n).clone()
    packed[1] = torch.arange(n) + 40
    counting_padding = torch.arange(n).expand(2, n)  # positions that also count the padded slots
    globals_ = [(None, None), (holes, None), (first_rank_only, None), (None, packed), (holes, counting_padding),
                (holes, packed)]
    cases = [(n, mask, pos, layout) for layout in ("zigzag", "contiguous") for mask, pos in globals_]
    for o in launch(gathered_tokens, 2, cases):
        for (seq_len, mask, pos, layout), (positions, real, doc, plain, local_index) in zip(cases, o["result"]):
            want = token_layout(2, seq_len, "cpu", mask, pos)
            assert torch.equal(positions, want.positions) and torch.equal(real, want.real)
            assert torch.equal(doc, want.doc) and plain == want.plain
            assert torch.equal(local_index, shard_indices(seq_len, 2, o["rank"], layout))


def _plan_tokens(seq_len, world, rank, layout, attention_mask=None, position_ids=None):
    """GlobalTokens of rank `rank` as global_tokens would build them (no process group needed)."""
    from dataclasses import fields

    from hf_dilated.distributed.layout import shard_indices
    from hf_dilated.distributed.tokens import GlobalTokens
    from hf_dilated.ops.token_layout import TokenLayout, token_layout

    rule = token_layout(1, seq_len, torch.device("cpu"), attention_mask=attention_mask, position_ids=position_ids)
    return GlobalTokens(**{f.name: getattr(rule, f.name) for f in fields(TokenLayout)},
                        local_index=shard_indices(seq_len, world, rank, layout), world=world, rank=rank, layout=layout)


def test_dilated_ring_calls_are_compacted_to_the_pattern():
    """dilated_ring's work falls with the pattern's density: each call takes, per head, only the rows
    and keys of its offset class, and a call whose pairs are all visible needs no mask. Before, every
    (rows, tile) call was dense under a mask: 8 heads x 256 rows x 128 keys whatever the dilation."""
    from hf_dilated.distributed.dilated_ring import dilated_ring_plan

    n, world, heads = 4096, 2, 8
    seg, dil = [256, 1024, 4096], [1, 2, 4]
    tokens = _plan_tokens(n, world, 1, "contiguous")
    plan = dilated_ring_plan(tokens, heads, heads, seg, dil, "union")
    # Rank 1 holds tokens 2048..4095; at hop 1 it holds rank 0's tiles (tokens 0..2047): every pair
    # of those shares only the top level (4096 tokens, one key in 4 for each head), so each head
    # reads a quarter of the tile at a quarter of the rows, and nothing needs a mask.
    tile = plan.tiles[0][1] - plan.tiles[0][0]
    for hops in plan.steps:
        (piece,) = hops[1]  # one call per (tile, hop), cut by size
        grids = list(piece.compact(torch.float32))
        for rows, keys, valid, calls in grids:
            assert keys.shape[-1] == tile // 4 and calls == [(False, None, None)] and bool(valid.all())
            assert torch.equal(tokens.local_index[rows] % 4, torch.arange(heads)[None, :, None].expand_as(rows) % 4)
        assert sum(rows.shape[-1] for rows, *_ in grids) == (n // world) // 4
    # With a band of 1024 positions and far projections: rows within it of every key of a tile read it
    # densely with (q, k), rows beyond it of every key with (q_far, k_far) and the levels' quarter;
    # the rows the band's edge cuts through get masks, near and far.
    plan = dilated_ring_plan(tokens, heads, heads, seg, dil, "union", local_window=1024, far=True)
    kinds = set()
    for hops in plan.steps:
        for rows, keys, valid, calls in hops[1][0].compact(torch.float32):
            gap = tokens.local_index[rows].amin() - (keys.amax() + hops[1][0].k_index.amin())
            kinds.add(tuple((far, bias is None) for far, bias, _ in calls))
            if calls == [(False, None, None)]:
                assert keys.shape[-1] == tile
            if calls == [(True, None, None)]:
                assert keys.shape[-1] == tile // 4 and gap >= 1024
    assert {((False, True),), ((True, True),), ((False, False), (True, False))} <= kinds, kinds


def test_dilated_ring_backward_with_large_logits_is_finite_and_exact():
    """Logits in the hundreds, plain tokens: a compacted grid with no mask pads a head with rows of
    the other offset class, whose probabilities against its keys overflowed exp() in the backward
    (inf * 0 = NaN in dK, dV and dQ) before padding rows got the empty row's log-sum-exp."""
    case = make_case("dilated_ring", seed=62, seq_len=1004, head_dim=4, q_heads=2, kv_heads=2, logit_scale=12.0,
                     segment_lengths=[8, 1024], dilation_rates=[1, 2])
    runs = [(2, [[case]])]
    (got,) = [o["result"][0] for o in launch(run_cases, 2, runs) if o["result"][0] is not None]
    want = reference_result(case)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got[0], want):
        assert bool(torch.isfinite(a).all()), f"{name} is not finite"
        err = ((a.double() - b).abs().max() / b.abs().max()).item()
        assert err < 1e-4, f"{name} differs from the reference by {err} (relative to its largest entry)"



def shard_batch_of_other_rows(rank, world):
    """Child: shard_batch given other rows on each rank (what a DataLoader prepared for data
    parallelism hands each process), then other labels, then the same batch."""
    import hf_dilated.distributed as hd

    hd.setup_sequence_parallel(world)
    same = torch.arange(100, 132).view(1, 32)
    errors = []
    for ids, labels in ((same + rank, same + rank), (same, same + rank)):
        try:
            hd.shard_batch(ids, labels=labels)
        except ValueError as e:
            errors.append(str(e))
    out = {"errors": errors, "same": hd.shard_batch(same, labels=same)["input_ids"]}
    hd.destroy_sequence_parallel()
    return out


def test_shard_batch_refuses_other_rows_on_the_ranks_of_a_group():
    """(review) Each rank keeps its shard of the batch it is given: ranks given other rows trained
    on pieces of different sequences, a plausible loss with nothing said (4.161833)."""
    from hf_dilated.distributed.layout import shard

    for o in launch(shard_batch_of_other_rows, 2):
        errors = o["result"]["errors"]
        assert len(errors) == 2, errors
        assert "disagree on 'input_ids values'" in errors[0] and "disagree on 'labels values'" in errors[1]
        assert all("the same on every rank of the sequence-parallel group" in e for e in errors)
        assert torch.equal(o["result"]["same"], shard(torch.arange(100, 132).view(1, 32), 2, o["rank"], "zigzag"))
