"""dilated_ring with sparse far keys (docs/contract.md 4.2: far_band, far_selection) on real gloo
processes against the independent float64 reference (tests/reference.py: local_band_reference,
whose selection is written loop by loop from the contract): outputs and the gradients of q, k, v,
q_far and k_far on every rank, for 2, 3 and 4 ranks, both layouts, plain, left-padded, packed and
holed inputs, GQA, a sliding window, and settings with no sinks, top_k = 0 and more blocks asked
than there are. Inputs are float64 so that the ring's bounds and the reference's rank the blocks
alike (a block's summary is combined over the ranks that hold its keys; in float32 a near tie could
order apart). The cases run through test_distributed_kernels' launcher (run_cases).
"""
from __future__ import annotations

import pytest
import torch

import reference
from distributed_launch import launch
from hf_dilated.ops.far_selection import FarSelection
from test_distributed_kernels import _plan_tokens, make_case, query_weights, run_cases

TOL = 1e-9  # float64 throughout: only the order of the sums differs from the reference
WINDOW = 16
# (far_band, far_top_k, far_block_size, far_sinks) with a local_window of WINDOW; far_top_k None: far_band only
SETTINGS = [(None, 2, 4, 1), (8, 2, 4, 1), (8, 0, 4, 2), (12, 3, 8, 0), (6, 50, 4, 1), (8, None, 4, 1),
            (10, 1, 2, 0)]
NAMES = ("out", "dq", "dk", "dv", "dq_far", "dk_far")


def sparse_case(seed, setting, *, seq_len=64, far=True, segment_lengths=(128,), dilation_rates=(1,), **kw):
    """A dilated_ring case in float64 with the band and sparse far keys of `setting` (SETTINGS).
    The levels default to one of dilation 1 holding every document (the default conversion's)."""
    band, top_k, size, sinks = setting
    return make_case("dilated_ring", seed=seed, seq_len=seq_len, dtype=torch.float64, far=far,
                     local_window=WINDOW, far_band=band,
                     far_selection=None if top_k is None else FarSelection(top_k, size, sinks),
                     segment_lengths=list(segment_lengths), dilation_rates=list(dilation_rates), **kw)


def reference_result(case):
    names = ("q", "k", "v") + (("q_far", "k_far") if "q_far" in case else ())
    inputs = [case[n].detach().clone().requires_grad_() for n in names]
    a = case["kwargs"]
    sparse = dict(far_band=a["far_band"])
    if a["far_selection"] is not None:
        sel = a["far_selection"]
        sparse.update(far_top_k=sel.top_k, far_block_size=sel.block_size, far_sinks=sel.sinks)
    out = reference.local_band_reference(*inputs[:3], a["segment_lengths"], a["dilation_rates"], a["local_window"],
                                         **dict(zip(("q_far", "k_far"), inputs[3:])),
                                         attention_mask=case["attention_mask"], position_ids=case["position_ids"],
                                         sliding_window=a.get("sliding_window"), **sparse)
    (out * case["dout"] * query_weights(case)).sum().backward()
    return (out.detach(), *(t.grad for t in inputs))


def check(outcomes, runs):
    checked = 0
    for i, (sp_size, cases_by_dp) in enumerate(runs):
        for o in outcomes:
            results = o["result"][i]
            if results is None:  # only rank 0 of each sequence-parallel group gathers
                continue
            cases = cases_by_dp[o["rank"] // sp_size]
            assert len(results) == len(cases)
            for case, got in zip(cases, results):
                want = reference_result(case)
                assert len(got) == len(want)
                w = query_weights(case)
                for name, a, b in zip(NAMES, got, want):
                    if name == "out":  # outputs at padded query slots are unspecified (docs/contract.md 3.1)
                        a, b = a * w, b * w
                    err = (a - b).abs().max().item()
                    assert err < TOL, (f"{sp_size} ranks, {case['layout']}, {case['kwargs']}: {name} differs from "
                                       f"the reference by {err}")
                checked += 1
    assert checked == sum(len(cases) for _, by_dp in runs for cases in by_dp)


# Each setting in both layouts, with plain tokens, left (and right) padding, packed documents and
# holes; 128 tokens cut each rank's chunks into several tiles (ring.py's tiles are 16 tokens at least).
TWO_RANK_CASES = [
    sparse_case(70, SETTINGS[0]),
    sparse_case(71, SETTINGS[1], layout="contiguous", padding=True),
    sparse_case(72, SETTINGS[2], packed=True),
    sparse_case(73, SETTINGS[3], layout="contiguous", packed=True, padding=True),
    sparse_case(74, SETTINGS[4], holes=True, q_heads=2, kv_heads=1),
    sparse_case(75, SETTINGS[5], layout="contiguous", packed=True),
    sparse_case(76, SETTINGS[6], padding=True, holes=True),
    # no far projections: q and k score the far keys and the bounds
    sparse_case(77, SETTINGS[1], far=False, padding=True, layout="contiguous"),
    # several tiles per chunk; an uneven length (padded at the end by the launcher)
    sparse_case(78, SETTINGS[1], seq_len=128, q_heads=4, kv_heads=1, head_dim=4),
    sparse_case(79, SETTINGS[3], seq_len=126, layout="contiguous", padding=True, packed=True, head_dim=4),
    # a sliding window (by index, docs/contract.md 3.3) through the blocks; positions that do not start at 0
    sparse_case(80, SETTINGS[0], sliding_window=27, padding=True),
    sparse_case(81, SETTINGS[1], offset=37, layout="contiguous", segment_lengths=(8, 256), dilation_rates=(1, 1)),
    # positions that count the padded slots: the hole at index 9 (position 12) empties the first
    # position of block 3, so a query whose far keys end at position 12 has no far key there
    sparse_case(84, SETTINGS[0], holes=True, offset=3),
    # a window that hides nothing of the first block, whose first positions hold no key (positions from 1)
    sparse_case(95, SETTINGS[3], sliding_window=63, padding=True, offset=1),
]


def test_sparse_far_keys_two_ranks():
    runs = [(2, [TWO_RANK_CASES])]
    check(launch(run_cases, 2, runs, join_s=300.0), runs)


def test_sparse_far_keys_three_and_four_ranks():
    # Four ranks: one ring of four, then two data-parallel groups of two with other cases.
    four = [TWO_RANK_CASES[i] for i in (0, 3, 6, 8)]
    runs = [(4, [four]), (2, [[TWO_RANK_CASES[1]], [TWO_RANK_CASES[9]]])]
    check(launch(run_cases, 4, runs, join_s=300.0), runs)
    three = [sparse_case(82, SETTINGS[1], seq_len=60, packed=True, padding=True),
             sparse_case(83, SETTINGS[3], seq_len=66, layout="contiguous", holes=True),
             # windows whose edge blocks straddle ranks (their shown keys come from another rank's shard)
             sparse_case(85, SETTINGS[1], seq_len=66, sliding_window=30, padding=True)]
    runs = [(3, [three])]
    check(launch(run_cases, 3, runs, join_s=300.0), runs)


def run_kind(rank, world, settings, q, k, v, mask, layout, inv_freq):
    """Child: the "dilated_ring" kind (kinds.py) on this rank's shards; rank 0 returns the gathered output."""
    import torch.distributed as dist

    import hf_dilated.distributed as hd
    from hf_dilated.distributed.layout import shard, unshard
    from hf_dilated.kinds import KINDS

    group = hd.setup_sequence_parallel(world).sp_group
    local = [shard(t, world, rank, layout, dim=2).contiguous() for t in (q, k, v)]
    out = KINDS["dilated_ring"].run(*local, settings, is_causal=True, attention_mask=shard(mask, world, rank, layout),
                                    position_ids=None, scale=None, dropout_p=0.0, group=group, layout=layout,
                                    rope_frequencies=inv_freq)
    parts = [torch.empty_like(out) for _ in range(world)]
    dist.all_gather(parts, out.contiguous(), group=group)
    return unshard(parts, layout, dim=2) if rank == 0 else None


def _kind_settings(**over):
    from hf_dilated.config import field_defaults
    from hf_dilated.kinds import KINDS

    return {**field_defaults(*KINDS["dilated_ring"].settings), "segment_lengths": [64], "dilation_rates": [1],
            "local_window": WINDOW, "far_group": 2, "far_window": 4, "far_band": 8, "far_top_k": 2,
            "far_block_size": 4, "far_sinks": 1, **over}


def _kind_inputs(n=64, dim=8):
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(2, h, n, dim, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    mask = torch.ones(2, n, dtype=torch.long)
    mask[1, :7] = 0  # left padding: a rank's shard of the mask does not tell its tokens' positions
    inv_freq = 1.0 / (100.0 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    return q, k, v, mask, inv_freq


def test_the_ring_kind_reads_sparse_far_keys_as_the_dilated_kind_does():
    """kinds.py passes far_band and far_top_k on to dilated_ring (far keys at grouped positions
    too): under a group of two it computes what "dilated" computes on the whole sequence, and with
    no group it is "dilated" itself."""
    from hf_dilated.kinds import KINDS

    settings = _kind_settings()
    q, k, v, mask, inv_freq = _kind_inputs()
    kw = dict(is_causal=True, attention_mask=mask, position_ids=None, scale=None, dropout_p=0.0,
              rope_frequencies=inv_freq)
    want = KINDS["dilated"].run(q, k, v, settings, group=None, layout=None, **kw)
    alone = KINDS["dilated_ring"].run(q, k, v, settings, group=None, layout="zigzag", **kw)
    assert torch.equal(alone, want)
    for layout in ("zigzag", "contiguous"):
        (got,) = [o["result"] for o in launch(run_kind, 2, settings, q, k, v, mask, layout, inv_freq)
                  if o["result"] is not None]
        err = ((got - want) * mask[:, None, :, None]).abs().max().item()
        assert err < TOL, f"{layout}: {err}"


@pytest.mark.parametrize("levels, position_ids", [
    (([16, 64], [1, 2]), None),  # no level of dilation 1 holds the sequence
    (([8, 32], [2, 4]), None),  # no level of dilation 1 at all
    (([64], [1]), torch.arange(40, 104)[None]),  # positions 40..103 cross the segment boundary at 64
], ids=("dilated_top_level", "no_dilation_one", "segment_crossed"))
def test_ring_refuses_a_selection_where_the_levels_do_not_hold_every_earlier_key(levels, position_ids):
    """The candidate rule needs the blocks holding a far key of each (head, query); dilated_ring
    computes it only where every earlier key is one (dilated_ring.DilatedPattern), and says so."""
    from hf_dilated.distributed.dilated_ring import dilated_ring_plan

    tokens = _plan_tokens(64, 2, 0, "zigzag", position_ids=position_ids)
    with pytest.raises(ValueError, match="far_selection: dilated_ring reads sparse far keys .*far_top_k"):
        dilated_ring_plan(tokens, 2, 2, *levels, "union", local_window=WINDOW, far=True, far_band=8,
                          far_selection=FarSelection(2, 4, 1))
    # far_band alone needs no selection: any levels
    dilated_ring_plan(tokens, 2, 2, *levels, "union", local_window=WINDOW, far=True, far_band=8)
