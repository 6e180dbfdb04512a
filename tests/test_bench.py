"""The benchmark's pair counts against a brute-force evaluation of docs/contract.md's sets, its
worker and timing rules, smoke runs of every `hf-dilated bench` subcommand that check the files they
write, and the `hf-dilated` command's wiring."""
import contextlib
import inspect
import json
import os
import random
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from hf_dilated.bench.counts import (
    dense_pair_count, dilated_pair_count, head_groups_sizes, layout_pair_count,
)


def brute_force_counts(n, heads, seg, dil):
    """Per mode, the total over heads and queries of |K(h, i)|, straight from docs/contract.md 4."""
    i = np.arange(n)[:, None]
    j = np.arange(n)[None, :]
    causal = j <= i
    groups = head_groups_sizes(heads, len(seg))
    group_of_head = [g for g, size in enumerate(groups) for _ in range(size)]
    union = longnet = head_groups = 0
    for h in range(heads):
        levels = []
        for w, r in zip(seg, dil):
            o = h % r
            sel_i = (i % w) % r == o
            sel_j = (j % w) % r == o
            levels.append(causal & (i // w == j // w) & sel_i & sel_j)
        union += int(np.logical_or.reduce(levels).sum())
        longnet += int(sum(v.sum() for v in levels))
        head_groups += int(levels[group_of_head[h]].sum())
    return {"union": union, "longnet": longnet, "head_groups": head_groups}


def random_nested_config(rng):
    levels = rng.randint(1, 4)
    seg, dil = [], []
    w, r = rng.choice([2, 3, 4, 6, 8]), rng.choice([1, 1, 2])
    while w % r:
        r = 1
    for _ in range(levels):
        seg.append(w)
        dil.append(r)
        grow_r = rng.choice([1, 2, 3])
        r *= grow_r
        w *= rng.choice([1, 2, 3]) * grow_r
    return seg, dil


@pytest.mark.parametrize("seed", range(40))
def test_dilated_counts_match_brute_force(seed):
    rng = random.Random(seed)
    seg, dil = random_nested_config(rng)
    n = rng.randint(1, 70)
    heads = rng.randint(1, 7)
    expected = brute_force_counts(n, heads, seg, dil)
    for mode, want in expected.items():
        assert dilated_pair_count(n, heads, seg, dil, mode) == want, (mode, n, heads, seg, dil)


def test_longnet_counts_non_nested_config():
    seg, dil = [4, 6], [2, 3]  # valid for longnet/head_groups, not nested
    for n in (1, 5, 13, 24, 31):
        expected = brute_force_counts(n, 5, seg, dil)
        assert dilated_pair_count(n, 5, seg, dil, "longnet") == expected["longnet"]
        assert dilated_pair_count(n, 5, seg, dil, "head_groups") == expected["head_groups"]


def test_dense_count_and_union_covering_segment_is_dense():
    assert dense_pair_count(7, 3) == 3 * 28
    assert dilated_pair_count(100, 4, [128, 256], [1, 2], "union") == dense_pair_count(100, 4)


def test_layout_count_matches_dense_mask():
    rng = np.random.default_rng(0)
    n, bs = 23, 4
    blocks = -(-n // bs)
    layout = rng.random((3, blocks, blocks)) < 0.5
    i = np.arange(n)[:, None]
    j = np.arange(n)[None, :]
    want = sum(int(((j <= i) & layout[h][i // bs, j // bs]).sum()) for h in range(3))
    assert layout_pair_count(n, bs, layout) == want


def test_counts_match_the_float64_reference_counts():
    from reference import dilated_key_counts

    for seg, dil in (([8, 16, 32], [1, 2, 4]), ([4, 12], [2, 6])):
        for mode in ("union", "longnet", "head_groups"):
            if mode == "union" and seg == [4, 12]:
                continue  # not nested
            want = int(dilated_key_counts(seg, dil, mode, 5, 1, 61, 61).sum())
            assert dilated_pair_count(61, 5, seg, dil, mode) == want


def test_flex_union_mask_is_the_union_pattern():
    """The FlexAttention comparator computes the "union" set of docs/contract.md 4 (checked on the mask
    itself; running the compiled kernel takes ~30 s, so the bench does that)."""
    import torch
    from reference import dilated_key_counts

    from hf_dilated.bench.variants import union_mask_mod

    seg, dil, heads, n = [8, 16, 32], [1, 2, 4], 5, 70
    mask_mod = union_mask_mod(seg, dil)
    h = torch.arange(heads)[:, None, None]
    i = torch.arange(n)[None, :, None]
    j = torch.arange(n)[None, None, :]
    want = dilated_key_counts(seg, dil, "union", heads, 1, n, n)[0] > 0
    assert torch.equal(mask_mod(0, h, i, j), want)


# --- the worker: every kernel variant runs, and reports the pairs its pattern makes visible ---

KERNEL_SPEC = dict(kind="kernel", n=48, dtype="float32", device="cpu", batch=2, heads=4, kv_heads=2, head_dim=8,
                   segment_lengths=[8, 16, 32], dilation_rates=[1, 2, 4], block_size=8,
                   block_pattern={"type": "local", "window": 2}, passes=["forward", "backward"], warmup=0,
                   repeats=2, threads=None)


def expected_pairs(variant, spec):
    import torch
    from reference import base_visible, block_sparse_key_counts, dilated_key_counts

    b, h, n = spec["batch"], spec["heads"], spec["n"]
    if variant in ("sdpa", "flex", "ring", "auto"):  # auto: dense up to its first segment (>= 4096)
        return int(base_visible(None, None, b, n, n).sum()) * h
    if variant in ("union", "longnet", "head_groups", "dilated_ring"):
        mode = "union" if variant == "dilated_ring" else variant
        return int(dilated_key_counts(spec["segment_lengths"], spec["dilation_rates"], mode, h, b, n, n).sum())
    blocks = -(-n // spec["block_size"])
    bq, bk = torch.arange(blocks)[:, None], torch.arange(blocks)[None, :]
    layout = ((bq - bk >= 0) & (bq - bk < spec["block_pattern"]["window"]))[None, None]
    return int(block_sparse_key_counts(layout, spec["block_size"], h, b, n, n).sum())


# flex is left out here: compiling it takes ~30 s on CPU (the bench covers it with --variants flex).
@pytest.mark.parametrize("variant", ["sdpa", "union", "longnet", "head_groups", "block_sparse", "ring",
                                     "dilated_ring", "auto"])
def test_worker_runs_variant_and_counts_its_pairs(variant):
    from hf_dilated.bench.worker import run_case

    result = run_case(dict(KERNEL_SPEC, variant=variant))
    assert "error" not in result and "unavailable" not in result, result
    assert result["pairs"] == expected_pairs(variant, KERNEL_SPEC)
    for name in ("forward", "backward"):
        p = result["passes"][name]
        assert len(p["times_s"]) == 2 and all(t > 0 for t in p["times_s"]), p
        assert p["peak_extra_bytes"] >= 0 and p["inputs_bytes"] > 0


def test_worker_reports_flash_attn_unavailable_on_cpu():
    from hf_dilated.bench.worker import run_case

    result = run_case(dict(KERNEL_SPEC, variant="flash_attn"))
    assert "CUDA" in result["unavailable"] and result["passes"] == {}


def test_worker_times_every_pass_before_tightening_the_allocator(monkeypatch):
    """The memory measurement's allocator settings cannot be undone, so every timed call of a case
    (forward and backward) comes before them; run_case in a caller's process never sets them."""
    from hf_dilated import measure
    from hf_dilated.bench.worker import run_case

    events = []
    time_calls = measure.time_calls
    monkeypatch.setattr(measure, "strict_allocator", lambda: events.append("strict") or True)
    monkeypatch.setattr(measure, "time_calls", lambda *a, **k: events.append("timed") or time_calls(*a, **k))
    spec = dict(KERNEL_SPEC, variant="union")
    result = run_case(spec, own_process=True)
    assert events == ["timed", "timed", "strict"], events
    assert all(result["passes"][name]["peak_extra_bytes"] >= 0 for name in ("forward", "backward"))
    assert not any("memory_note" in p for p in result["passes"].values())
    events.clear()
    run_case(spec)
    assert events == ["timed", "timed"], events
    # Where the settings cannot be made (not glibc), each memory figure says it is over-stated.
    monkeypatch.setattr(measure, "strict_allocator", lambda: False)
    result = run_case(spec, own_process=True)
    assert all("over-stated" in result["passes"][name]["memory_note"] for name in ("forward", "backward"))


SMOKE_ALL = ["bench", "all", "--smoke", "--threads", "1", "--variants", "union",
             "--e2e-impls", "sdpa,dilated,not_an_implementation"]


@pytest.fixture(scope="module")
def smoke_all(tmp_path_factory):
    """`hf-dilated bench all --smoke` through the command's entry point (tiny shapes; each case
    still runs in its own process): its output directory."""
    from hf_dilated.cli import main

    out = tmp_path_factory.mktemp("bench") / "all"
    assert main(SMOKE_ALL + ["--out", str(out)]) == 0
    return out


@pytest.mark.slow
def test_bench_all_smoke_writes_report_json_and_plots(smoke_all):
    out = smoke_all
    report = json.loads((out / "results.json").read_text())
    md = (out / "report.md").read_text()
    for png in ("time_vs_length.png", "memory_vs_length.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # sdpa is always measured: every ratio is to it, in the same run.
    rows = {(r["variant"], r["n"], r["pass"]): r for r in report["kernels"]["rows"]}
    for variant in ("sdpa", "union"):
        for n in (128, 256):
            for pass_name in ("forward", "backward"):
                row = rows[(variant, n, pass_name)]
                assert row["median_s"] > 0 and row["pairs"] > 0, row
                assert row["pairs_per_s"] == pytest.approx(row["pairs"] / row["median_s"])
                want = row["pairs_per_s"] / rows[("sdpa", n, pass_name)]["pairs_per_s"]
                assert row["ratio_to_sdpa"] == pytest.approx(want)
    assert rows[("sdpa", 256, "forward")]["pairs"] == dense_pair_count(256, 8)
    assert rows[("union", 256, "forward")]["pairs"] == dilated_pair_count(256, 8, [32, 64, 128], [1, 2, 4])
    assert {e["variant"] for e in report["kernels"]["exponents"]} == {"sdpa", "union"}
    # The length search ran for each variant and pass; within a 6 MiB budget something fails.
    assert len(report["search"]) == 4
    assert any(s["first_failure"] for s in report["search"])
    for s in report["search"]:
        if s["longest"] and s["first_failure"]:
            assert s["longest"] < s["first_failure"] and s["limited_by"] == "memory"
    e2e = {r["spec"]["attn_implementation"]: r for r in report["e2e"]["rows"]}
    assert e2e["sdpa"]["passes"]["backward"]["median_s"] > 0
    assert e2e["dilated"]["passes"]["backward"]["median_s"] > 0
    assert "not_an_implementation" in report["e2e"]["unavailable"]
    # --smoke leaves out the multi-process rows, and --variants without block_sparse its comparison.
    assert "distributed" not in report and "block_sparse" not in report
    for section in ("## Kernels", "## Growth with sequence length", "## Longest sequence", "## End to end",
                    "not_an_implementation", report["machine"]["torch"], "Plots: time_vs_length.png"):
        assert section in md


@pytest.mark.slow
def test_report_is_written_without_matplotlib(smoke_all, tmp_path):
    """Where matplotlib does not import, the report says so in one line and everything else is
    written: a run never fails at its end for want of a plotting library."""
    out = tmp_path / "no-plots"
    script = (
        "import json, sys\n"
        "sys.modules['matplotlib'] = None  # `import matplotlib` now raises ImportError\n"
        "from pathlib import Path\n"
        "from hf_dilated.bench.cli import _sections\n"
        "from hf_dilated.bench.report import write_report\n"
        f"report = json.loads(Path({str(smoke_all / 'results.json')!r}).read_text())\n"
        "sections = [(key, md) for key, (_, md) in _sections().items()]\n"
        f"text, files = write_report(report, Path({str(out)!r}), sections)\n"
        "print(json.dumps([str(f) for f in files]))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    files = json.loads(done.stdout.strip().splitlines()[-1])
    assert sorted(os.path.basename(f) for f in files) == ["report.md", "results.json"]
    assert not list(out.glob("*.png"))
    md = (out / "report.md").read_text()
    notes = [line for line in md.splitlines() if "matplotlib" in line]
    assert len(notes) == 1 and notes[0].startswith("No plots: matplotlib is not installed"), notes
    assert md.replace(notes[0], "") == (smoke_all / "report.md").read_text().replace(
        "Plots: time_vs_length.png, memory_vs_length.png", "")
    assert json.loads((out / "results.json").read_text()) == json.loads((smoke_all / "results.json").read_text())


def test_a_report_stopped_while_written_keeps_the_last_complete_one(tmp_path, monkeypatch):
    """The report is rewritten after every section: a run stopped in the middle of a write (Ctrl-C,
    a full disk) left half a results.json where the previous sections' complete one had been."""
    import pathlib

    from hf_dilated.bench.report import machine_info, write_report

    report = {"command": "bench kernels", "settings": {"device": "cpu", "profile": "quick", "dtypes": ["float32"]},
              "machine": machine_info("cpu", 1), "kernels": {"rows": [1]}}
    write_report(report, tmp_path, [], plots=False)
    before = {name: (tmp_path / name).read_text() for name in ("results.json", "report.md")}
    real = pathlib.Path.write_text

    def stopped(self, text, *args, **kwargs):  # half of it written, then the run is stopped
        real(self, text[:len(text) // 2], *args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(pathlib.Path, "write_text", stopped)
    with pytest.raises(KeyboardInterrupt):
        write_report(dict(report, kernels={"rows": [1, 2, 3]}), tmp_path, [], plots=False)
    monkeypatch.undo()
    assert {name: (tmp_path / name).read_text() for name in before} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.md", "results.json"]  # no file left aside


def test_block_sparse_bench_interleaves_variants_and_reports_failures():
    """Each round times every variant once, in turn (a slow spell of the machine then falls on all
    of them), after one warm-up call each; a variant that raises is reported, not timed."""
    from hf_dilated.measure import time_interleaved

    calls, logged = [], []

    def broken():
        calls.append("broken")
        raise RuntimeError("no kernel")

    def fails_when_timed():  # warms up, then runs out of memory in the first timed round
        calls.append("late")
        if calls.count("late") == 2:
            raise MemoryError("out of memory")

    fns = [("a", lambda: calls.append("a")), ("broken", broken), ("late", fails_when_timed),
           ("b", lambda: calls.append("b"))]
    times = time_interleaved(fns, repeats=2, log=logged.append)
    assert calls == ["a", "broken", "late", "b", "a", "late", "b", "a", "b"]
    assert times[1] is None and times[2] is None and len(times[0]) == len(times[3]) == 2
    assert all(t >= 0 for t in times[0] + times[3])
    assert logged == ["broken failed: RuntimeError: no kernel", "late failed: MemoryError: out of memory"]


def test_block_sparse_bench_rows_count_pairs_and_compare_to_sdpa():
    """A small run of the block-sparse benchmark: the useful pairs are the layout's exact count,
    every ratio is to sdpa measured in the same run, and each row has its memory figure."""
    from hf_dilated.bench.block_sparse import compare_block_sparse

    rows = compare_block_sparse(n=1024, heads=2, head_dim=16, block_size=64, global_blocks=1, window=2,
                                repeats=2, flex=False, log=lambda *_: None)
    by = {(r["variant"], r["mode"]): r for r in rows}
    assert set(by) == {(v, m) for v in ("sdpa (dense causal)", "block_sparse") for m in ("forward", "forward+backward")}
    assert by[("sdpa (dense causal)", "forward")]["useful_pairs"] == dense_pair_count(1024, 2)
    sparse = by[("block_sparse", "forward")]
    from hf_dilated.ops.block_patterns import GlobalLocalPattern
    layout = GlobalLocalPattern(1, 2).block_layout(torch.arange(16), 16)
    assert sparse["useful_pairs"] == layout_pair_count(1024, 64, layout[0]) * 2 < dense_pair_count(1024, 2)
    for (variant, mode), row in by.items():
        assert row["runs"] == 2 and row["min"] <= row["seconds"] <= row["max"]
        assert row["peak_extra_bytes"] >= 0 and row["memory_note"] is None
        base = by[("sdpa (dense causal)", mode)]
        assert row["vs_sdpa"] == pytest.approx(row["pairs_per_s"] / base["pairs_per_s"])
        best_rate = lambda r: r["useful_pairs"] / r["min"]  # noqa: E731
        assert row["vs_sdpa_best"] == pytest.approx(best_rate(row) / best_rate(base))


# --- the `hf-dilated` command: every bench subcommand, parsed and run for real in smoke mode ---

def _run_bench(tmp_path, *argv):
    from hf_dilated.cli import main

    out = tmp_path / "out"
    assert main(["bench", *argv, "--smoke", "--threads", "1", "--out", str(out)]) == 0
    report = json.loads((out / "results.json").read_text())
    assert report["command"] == f"bench {argv[0]}" and report["settings"]["profile"] == "smoke"
    return report, (out / "report.md").read_text()


def _sections_in(report):
    return {key for key in ("kernels", "search", "million", "block_sparse", "decode", "window", "e2e",
                                "distributed")
            if key in report}


@pytest.mark.slow
def test_cli_bench_kernels(tmp_path):
    report, md = _run_bench(tmp_path, "kernels", "--variants", "union", "--lengths", "128", "--no-search")
    assert _sections_in(report) == {"kernels"}
    rows = {(r["variant"], r["pass"]): r for r in report["kernels"]["rows"]}
    assert set(rows) == {(v, p) for v in ("sdpa", "union") for p in ("forward", "backward")}
    assert all(r["median_s"] > 0 for r in rows.values())
    assert "## Kernels" in md and "## End to end" not in md


@pytest.mark.slow
def test_cli_bench_block_sparse(tmp_path):
    report, md = _run_bench(tmp_path, "block-sparse", "--lengths", "512", "--heads", "2", "--head-dim", "16",
                            "--block-size", "64", "--block-pattern",
                            '{"type": "global_local", "global_blocks": 1, "window": 2}')
    assert _sections_in(report) == {"block_sparse"}
    rows = {(r["variant"], r["mode"]): r for r in report["block_sparse"]["rows"]}
    assert set(rows) == {(v, m) for v in ("sdpa (dense causal)", "block_sparse") for m in ("forward", "forward+backward")}
    sparse = rows[("block_sparse", "forward")]
    assert sparse["n"] == 512 and sparse["useful_pairs"] < rows[("sdpa (dense causal)", "forward")]["useful_pairs"]
    assert all(r["runs"] == 2 and r["peak_extra_bytes"] >= 0 for r in rows.values())
    assert "FlexAttention left out" in md  # --smoke leaves compiled FlexAttention out, and says so


@pytest.mark.slow
def test_cli_bench_decode(tmp_path):
    report, md = _run_bench(tmp_path, "decode", "--heads", "4", "--kv-heads", "2", "--head-dim", "16")
    assert _sections_in(report) == {"decode"}
    results = report["decode"]["results"]
    assert [r["spec"]["n"] for r in results] == [256, 1024]  # the smoke profile's contexts
    for r in results:
        assert r["spec"]["heads"] == 4 and r["spec"]["original"] == 64
        assert r["segment_lengths"][0] == 64 and r["segment_lengths"][-1] >= r["spec"]["n"]
        for name in ("sdpa", "dilated"):
            p = r["passes"][name]
            assert len(p["times_s"]) == 2 and p["median_s"] > 0 and p["peak_extra_bytes"] >= 0, p
    assert "## Decode" in md


@pytest.mark.slow
def test_cli_bench_decode_on_a_cache_filled_at_random(tmp_path):
    """--gen-fill random: generate() rows without a prefill (the cache filled with random keys and
    values), decode steps timed one model call each, for both caches and both names."""
    report, md = _run_bench(tmp_path, "decode", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
                            "--contexts", "256", "--gen-fill", "random", "--gen-caches", "reserved,dynamic",
                            "--gen-new", "4")
    rows = {(r["spec"]["cache"], r["spec"]["attn_implementation"]): r for r in report["decode"]["generate"]}
    assert set(rows) == {(c, n) for c in ("reserved", "dynamic") for n in ("sdpa", "dilated")}
    for r in rows.values():
        assert r["prefill_s"] is None and r["decode_tokens_per_s"] > 0 and len(r["tokens"]) == 4, r
    assert "filled with random keys and values" in md
    # the report says which conversion `dilated` ran: the default for prompt + new tokens
    from hf_dilated.config import default_band

    spec = report["decode"]["generate"][0]["spec"]
    total = spec["prompt"] + spec["new"]
    assert total > spec["original"]
    band = default_band(spec["original"], total)
    assert (f"from {spec['original']} to {total} tokens (prompt + new)" in md
            and f"G = {band['far_group']}, the first block and {band['far_top_k']} blocks of" in md), md


@pytest.mark.slow
def test_cli_bench_distributed(tmp_path):
    report, md = _run_bench(tmp_path, "distributed", "--heads", "2", "--head-dim", "16")
    assert _sections_in(report) == {"distributed"}
    rows = {(r["kernel"], r["processes"]): r for r in report["distributed"]["rows"]}
    kernels = ("ring", "dilated_ring", "block_sparse_ring")
    assert set(rows) == {(k, p) for k in kernels for p in (1, 2)}
    for (kernel, processes), r in rows.items():
        assert "error" not in r, r
        assert r["time_s"] > 0
        for step in ("forward", "backward", "overhead"):
            assert r[f"{step}_peak_bytes"] >= 0
            assert (r[f"{step}_sent_bytes"] > 0) == (processes > 1), r  # one process exchanges nothing
        # forward + backward sends the forward's K/V again plus the gradients
        assert r["backward_sent_bytes"] >= r["forward_sent_bytes"]
        assert r["target_ratio"] == 1.25 / processes
    for kernel in kernels:  # the ratios are against the one-process row (where it measured anything)
        assert rows[(kernel, 1)].get("backward_ratio", 1.0) == 1.0
    assert report["distributed"]["config"]["n"] == 256
    assert "## Multi-process" in md and "| block_sparse_ring | 2 |" in md


@pytest.mark.slow
def test_cli_bench_e2e(tmp_path):
    report, md = _run_bench(tmp_path, "e2e", "--e2e-impls", "sdpa")
    assert _sections_in(report) == {"e2e"}
    (row,) = report["e2e"]["rows"]
    assert row["spec"]["attn_implementation"] == "sdpa" and row["spec"]["n"] == 128
    assert row["passes"]["backward"]["median_s"] > 0
    assert "## End to end" in md


def test_cli_bench_refuses_unknown_settings(capsys):
    from hf_dilated.cli import main

    assert main(["bench", "kernels", "--variants", "union,not_a_variant"]) == 2
    assert "not_a_variant" in capsys.readouterr().err
    assert main(["bench", "decode", "--threads", "0"]) == 2
    assert "--threads must be >= 1, got 0" in capsys.readouterr().err
    # values that gave empty reports, an error naming other options, or a default in their place
    (tmp := Path(tempfile.mkdtemp()) / "a_file").write_text("")
    for argv, message in ((["window", "--repeats", "0"], "--repeats must be >= 1, got 0"),
                          (["window", "--heads", "0"], "--heads must be >= 1, got 0"),
                          (["window", "--kv-heads", "3"], "--kv-heads (3) must divide --heads (8)"),
                          (["window", "--kv-heads", "0"], "--kv-heads must be >= 1, got 0"),
                          (["kernels", "--lengths", ""], "--lengths: an empty list"),
                          (["kernels", "--variants", ""], "--variants: an empty list"),
                          (["kernels", "--no-flex", "--variants", "flex,union"], "--no-flex: --variants names flex"),
                          (["decode", "--gen-layers", "0"], "--gen-layers must be >= 1, got 0"),
                          (["distributed", "--fsdp-processes", "0"], "--fsdp-processes must be >= 1, got 0"),
                          (["window", "--warmup", "-1"], "--warmup must be >= 0, got -1"),
                          (["window", "--out", str(tmp)], "--out: " + str(tmp) + " is (or lies under) a file"),
                          (["window", "--out", str(tmp / "sub")], "is (or lies under) a file"),
                          # the length search's options where it does not run, or cannot
                          (["kernels", "--no-search", "--search-max", "9000", "--budget-gib", "1"],
                           "--budget-gib, --search-max: the length search does not run (--no-search)"),
                          (["kernels", "--quick", "--search-start", "512"],
                           "--search-start: the length search does not run (off with --quick)"),
                          (["kernels", "--search-start", "8192", "--search-max", "4096"],
                           "--search-start (8192) must be at most --search-max (4096)"),
                          (["kernels", "--search-max", "100"],  # the start it names is the profile's
                           "--search-start (4096, the default) must be at most --search-max (100)"),
                          (["kernels", "--search-timeout", "0"], "--search-timeout must be > 0 seconds, got 0"),
                          (["kernels", "--budget-gib", "-1"], "--budget-gib must be > 0, got -1"),
                          (["kernels", "--bisect-steps", "-1"], "--bisect-steps must be >= 0, got -1"),
                          (["kernels", "--search-start", "0"], "--search-start must be >= 1, got 0"),
                          # options a subcommand took and did not read (its report said otherwise)
                          (["e2e", "--heads", "2", "--head-dim", "32"], "--heads, --head-dim: `bench e2e` does not read"),
                          (["e2e", "--dtypes", "float32,bfloat16"], "--dtypes: `bench e2e` runs one dtype"),
                          (["block-sparse", "--kv-heads", "1", "--warmup", "0"],
                           "--kv-heads, --warmup: `bench block-sparse` does not read them"),
                          (["distributed", "--dilation-rates", "1,1,1"], "--dilation-rates: `bench distributed` does"),
                          (["distributed", "--dtypes", "bfloat16"], "--dtypes: `bench distributed` does not read it")):
        assert main(["bench", *argv]) == 2, argv
        assert message in capsys.readouterr().err, argv
    assert main(["bench", "decode", "--gen-fill", "random"]) == 2  # the static cache is in the default caches
    assert "--gen-caches" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["bench", "kernels", "--no-such-option"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit):  # a benchmark must be named
        main(["bench"])


def test_cli_eval_is_imported_when_run(monkeypatch, capsys):
    """`hf-dilated eval` hands its arguments to hf_dilated.eval's own parser, and says clearly when
    that package is missing."""
    import hf_dilated
    from hf_dilated.cli import main

    monkeypatch.setitem(sys.modules, "hf_dilated.eval", None)  # `import hf_dilated.eval` now fails
    monkeypatch.delattr(hf_dilated, "eval", raising=False)
    assert main(["eval", "--help"]) == 2
    assert "hf_dilated.eval is not available" in capsys.readouterr().err

    seen = []
    stand_in = types.ModuleType("hf_dilated.eval", "stand-in for the evaluation package")
    stand_in.add_arguments = lambda parser: parser.add_argument("--samples", type=int, required=True)
    stand_in.main = lambda args: seen.append(args.samples) or 7
    monkeypatch.setitem(sys.modules, "hf_dilated.eval", stand_in)
    monkeypatch.setattr(hf_dilated, "eval", stand_in, raising=False)
    assert main(["eval", "--samples", "3"]) == 7 and seen == [3]
    with pytest.raises(SystemExit):
        main(["eval"])  # --samples is required by eval's own parser


def test_cli_imports_no_benchmark_code_to_parse():
    """Building and using the parser (here for `info`) imports the bench argument definitions only:
    no measurement module, and not hf_dilated.eval."""
    script = ("import sys\n"
              "from hf_dilated.cli import build_parser\n"
              "args = build_parser().parse_args(['info', 'some/dir'])\n"
              "assert args.dir == 'some/dir'\n"
              "print(sorted(m for m in sys.modules if m.startswith(('hf_dilated.bench', 'hf_dilated.eval'))))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "['hf_dilated.bench', 'hf_dilated.bench.cli']"


@pytest.mark.slow
def test_cli_bench_window(tmp_path):
    report, md = _run_bench(tmp_path, "window", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
                            "--window", "48")
    results = report["window"]["results"]
    assert [r["spec"]["n"] for r in results] == [128, 256] and all(r["spec"]["window"] == 48 for r in results)
    for r in results:
        for name in ("forward", "forward+backward"):
            for variant in ("sdpa", "ring", "dilated"):
                p = r["passes"][name][variant]
                assert len(p["times_s"]) == 2 and p["median_s"] > 0 and p["peak_extra_bytes"] >= 0, p
    assert "## Sliding window" in md and "ring / sdpa" in md


def test_cli_bench_window_rejects_a_bad_window(capsys):
    from hf_dilated.cli import main

    assert main(["bench", "window", "--window", "0"]) == 2
    assert "--window must be positive" in capsys.readouterr().err


def test_operation_counts_per_pass():
    """`hf-dilated bench kernels` counts the aten ops of a forward, a backward and a decode step
    (bench/ops.py); a dilated forward is a handful of fused calls and merges, not per-token work."""
    from hf_dilated.bench.ops import kernel_op_counts, markdown_ops
    from hf_dilated.ops import dilated_attention

    q, k, v = (torch.randn(1, 4, 256, 16) for _ in range(3))
    counts = kernel_op_counts(lambda q, k, v: dilated_attention(q, k, v, [64, 128, 256], [1, 2, 4]), q, k, v)
    assert set(counts) == {"forward", "backward", "decode"}
    for c in counts.values():
        assert 0 < c["launches"] <= c["ops"] < 400
    text = "\n".join(markdown_ops([{"variant": "union", "n": 256, "dtype": "float32", "ops": counts},
                                   {"variant": "flex", "n": 256, "dtype": "float32", "ops": {"error": "E"}}]))
    assert "## Operations per call" in text
    f, b, d = (counts[p] for p in ("forward", "backward", "decode"))
    assert f"| float32 | 256 | union | {f['ops']} / {f['launches']} | {b['ops']} / {b['launches']} | " \
           f"{d['ops']} / {d['launches']} |" in text
    assert "| flex | E |" in text


@pytest.mark.slow
def test_cli_bench_kernels_reports_operation_counts(tmp_path):
    report, md = _run_bench(tmp_path, "kernels", "--variants", "union", "--lengths", "128", "--no-search")
    ops = {r["variant"]: r["ops"] for r in report["kernels"]["ops"]}
    assert set(ops) == {"sdpa", "union"}
    assert all(ops["union"][p]["ops"] > 0 for p in ("forward", "backward", "decode"))
    assert "## Operations per call" in md
    report, md = _run_bench(tmp_path, "kernels", "--variants", "union", "--lengths", "128", "--no-search", "--no-ops")
    assert not report["kernels"]["ops"] and "## Operations per call" not in md


# --- scripts/gpu_check.sh's one table (hf_dilated/bench/gpu_table.py) ---

def _expected_table_rows(s):
    """The measure column of every row the settings define, with its count."""
    from collections import Counter

    from hf_dilated.bench import gpu_table

    rows = Counter()
    for label in ("fwd", "fwd+bwd"):
        rows[f"kernel pair rate, {label}"] = len(s["kernel_shapes"]) * len(s["kernel_lengths"]) * len(s["kernel_modes"])
        rows[f"block_sparse vs FlexAttention (same BlockMask), {label}"] = 1
        rows[f"block_sparse vs sdpa, {label}"] = 1
    for label in ("prefill (DynamicCache)", "decode step, DynamicCache", "decode step, ReservedCache"):
        # the default conversion and union levels at every length; every far key at the first
        rows[label] = 2 * len(s["prefill_lengths"]) + 1
    rows["decode step, StaticCache + torch.compile"] = 2
    # union levels at each length; the default conversion at the shortest past the original context
    rows["training step (fwd+bwd)"] = len(s["train_lengths"]) + (gpu_table.default_train_length(s) is not None)
    rows["union forward: extra memory / (q, k, v, out)"] = 1
    rows["CUDA tests (pytest -m cuda, every one)"] = 1
    return rows


def _table_rows(text):
    from collections import Counter

    lines = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| measure ")]
    return Counter(line.split(" | ")[0][2:] for line in lines), lines


def test_gpu_table_lists_every_row_and_says_why_one_is_missing(tmp_path):
    """With nothing measured, the table still has every row, each saying why it has no figure."""
    from hf_dilated.bench import gpu_table

    s = gpu_table.settings(smoke=False)
    (tmp_path / "kernels.json").write_text(json.dumps(
        {"part": "kernels", "device": "cuda", "budget_s": 95, "results": {}, "done": False,
         "skipped": {"sdpa|8/8x64|8192": "skipped: the step's 95 s were spent"}}))
    text = gpu_table.render(s, tmp_path)
    counts, lines = _table_rows(text)
    assert counts == _expected_table_rows(s)
    assert all("| - | - | - |" in line or "not run" in line or "skipped" in line for line in lines)
    assert "skipped: the step's 95 s were spent" in text  # the part's own reason
    assert "step table-kernels stopped (time limit) before this case" in text
    assert "step table-model wrote no results" in text
    assert (tmp_path / "table.md").read_text() == text


def test_worker_runs_a_case_kind_named_by_module_and_function():
    from hf_dilated.bench import gpu_table
    from hf_dilated.bench.worker import case_function

    assert case_function("hf_dilated.bench.gpu_table:model_case") is gpu_table.model_case
    with pytest.raises(KeyError):
        case_function("no_such_kind")


def test_gpu_table_ratios_pick_sdpas_faster_backend():
    from hf_dilated.bench import gpu_table

    sdpa = {"backends": {"flash": {"forward": {"median_s": 2.0}},
                         "cudnn": {"forward": {"median_s": 1.0, "form": "K/V expanded"}}}}
    t, name, err = gpu_table._best(sdpa, "forward", ["flash", "cudnn"])
    assert (t, name, err) == (1.0, "sdpa cudnn (K/V expanded)", None)
    assert gpu_table._best({"backends": {"flash": {"forward": {"error": "No available kernel"}}}},
                           "forward", ["flash", "cudnn"])[2] == "flash: No available kernel"
    row = gpu_table._row("m", "c", 8, "union", 0.5, name, t, pairs=25, dense=100, check=lambda sp, pr: pr >= 0.5)
    assert row["speed"] == 2.0 and row["pair_rate"] == pytest.approx(0.5) and row["verdict"] == "meets"


def test_gpu_table_flex_block_mask_is_the_block_layout():
    """FlexAttention's BlockMask comes from the blocks (never an N x N mask): full blocks below the
    diagonal, the diagonal ones partial; as a dense block mask it is the causal layout."""
    from hf_dilated.bench.gpu_table import flex_block_mask
    from hf_dilated.ops.block_patterns import make_pattern

    nb, bs = 8, 16
    layout = make_pattern({"type": "global_local", "global_blocks": 1, "window": 2}).block_layout(torch.arange(nb), nb)[0, 0]
    mask = flex_block_mask(layout, nb * bs, bs, "cpu")
    assert torch.equal(mask.to_dense()[0, 0].bool(), layout.bool().tril())
    assert torch.equal(mask.full_kv_num_blocks[0, 0], (layout.bool().tril().sum(-1) - 1).int())


def test_block_sparse_compiled_mask_is_the_baselines():
    """block_sparse's FlexAttention path builds for the benchmark's layout (global_local, blocks of
    256) the BlockMask its baseline builds: the same tiles, the same lists, and a mask_mod that agrees
    with the baseline's causal one on every partial tile (the pairs a compiled call evaluates it on;
    ours reads the layout, for an eager call reads every pair); the row against FlexAttention then
    compares the same work."""
    from hf_dilated.bench.gpu_table import flex_block_mask
    from hf_dilated.ops import block_sparse_flex
    from hf_dilated.ops.block_patterns import make_pattern

    n, bs = 4096, 256
    layout = make_pattern({"type": "global_local", "global_blocks": 1, "window": 5}).block_layout(
        torch.arange(n // bs), n // bs)
    ours = block_sparse_flex.block_mask(layout, n, bs)
    base = flex_block_mask(layout[0, 0], n, bs, "cpu")
    assert ours.BLOCK_SIZE == base.BLOCK_SIZE == (bs, bs)
    for name in ("kv_num_blocks", "full_kv_num_blocks"):
        assert torch.equal(getattr(ours, name), getattr(base, name)), name
    for count, indices in (("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices")):
        for row, k in enumerate(getattr(base, count)[0, 0].tolist()):  # (listed first; the rest unread)
            assert torch.equal(getattr(ours, indices)[0, 0, row, :k].sort().values,
                               getattr(base, indices)[0, 0, row, :k].sort().values), (indices, row)
    i = torch.arange(n)
    partial = torch.zeros(n, n, dtype=torch.bool)  # the pairs of the listed (partial) tiles
    for row, k in enumerate(base.kv_num_blocks[0, 0].tolist()):
        for col in base.kv_indices[0, 0, row, :k].tolist():
            partial[row * bs:(row + 1) * bs, col * bs:(col + 1) * bs] = True
    assert partial.any()
    ours_mod, base_mod = (m.mask_mod(0, 0, i[:, None], i[None, :]) for m in (ours, base))
    assert torch.equal(ours_mod[partial], base_mod[partial])


def test_gpu_table_counts_the_cuda_tests_from_the_xml_or_a_stopped_log(tmp_path):
    from hf_dilated.bench.gpu_table import cuda_tests

    xml = tmp_path / "t.xml"
    xml.write_text('<testsuites><testsuite tests="5" failures="1" errors="1" skipped="1">'
                   '<testcase classname="tests.a" name="ok"/><testcase classname="tests.a" name="bad"><failure/></testcase>'
                   '</testsuite></testsuites>')
    assert {k: v for k, v in cuda_tests(xml, None).items() if k in ("passed", "failed", "errors", "skipped")} == \
        dict(passed=2, failed=1, errors=1, skipped=1)
    log = tmp_path / "t.log"
    log.write_text("tests/a.py::x[1 2] PASSED   [ 10%]\ntests/a.py::y FAILED  [ 20%]\ntests/b.py::z PASSED [ 30%]\n")
    counts = cuda_tests(tmp_path / "missing.xml", log)
    assert (counts["passed"], counts["failed"], counts["errors"]) == (2, 1, 0) and "partial" in counts["source"]
    # pytest-xdist's workers (gpu_check.sh runs them where it is installed), and its summary line
    log.write_text("[gw0] [ 33%] PASSED tests/a.py::x[1] \n[gw1] [ 66%] PASSED tests/a.py::y \n"
                   "[gw1] [100%] FAILED tests/a.py::x[2] \nFAILED tests/a.py::x[2] - assert 2 == 1\n")
    counts = cuda_tests(tmp_path / "missing.xml", log)
    assert (counts["passed"], counts["failed"], counts["errors"]) == (2, 1, 0)


@pytest.mark.slow
def test_gpu_table_measures_every_row_on_cpu_at_tiny_sizes(tmp_path):
    """Every part of the table at tiny sizes on the CPU: every row present, each with our time and
    sdpa's (FlexAttention's backward has no CPU version: that row says so)."""
    from hf_dilated.bench import gpu_table

    s = dict(gpu_table.settings(smoke=True), kernel_lengths=[128], prefill_lengths=[128], train_lengths=[128],
             million=dict(n=1024, heads=2, head_dim=16))
    for part in gpu_table.PARTS:
        data = gpu_table.run_part(part, s, tmp_path, budget_s=300, log=lambda *_: None)
        assert data["done"] and not data["skipped"], data
    text = gpu_table.render(s, tmp_path)
    counts, lines = _table_rows(text)
    assert counts == _expected_table_rows(s)
    assert any(line.startswith("| training step (fwd+bwd) |") and "default conversion from 64" in line for line in lines)
    rows = json.loads((tmp_path / "table.json").read_text())["rows"]
    for row in rows:
        if row.get("kind") == "memory":
            assert row["verdict"] in ("meets", "misses") and row["ours_t"] > 0, row
        elif row["measure"] == "block_sparse vs FlexAttention (same BlockMask), fwd+bwd":
            assert "no CPU backward" in row["why"], row
        else:
            assert row["ours_t"] > 0 and row["base_t"] > 0 and row["speed"] > 0 and not row["why"], row
        if (row["measure"] in ("decode step, DynamicCache", "decode step, ReservedCache")
                and "default conversion" in row["config"] and "every far key" not in row["config"]):
            # the CPU's sparse-far step is the eager one (reading every far key has none)
            assert "layer steps: " in row["note"] and " eager" in row["note"], row
        if row["measure"] in ("decode step, DynamicCache", "decode step, ReservedCache"):  # ours and sdpa in turn
            assert row["base"] == "sdpa default (in turn)" and "apart: ours " in row["note"], row
        assert "fell back" not in (row.get("note") or ""), row
        if row["measure"] == "prefill (DynamicCache)" and "every far key" in row["config"]:
            assert row["pair_rate"] == pytest.approx(row["speed"]), row  # it reads dense attention's pairs
    assert not [line for line in lines if "not run" in line and not line.startswith("| CUDA tests")]
    # which FlashAttention the cases ran (ops/backend.activate_flash("auto"), recorded by each case)
    assert "- FlashAttention in every flash call, ours and sdpa's: none (no flash kernel off CUDA)\n" in text
    assert {r["flash"] for r in json.loads((tmp_path / "model.json").read_text())["results"].values()} == {"FA2"}


def test_gpu_table_decode_diagnostics_that_fail_keep_the_case_figures(monkeypatch):
    """model_case's diagnostics of a decode step (its synchronizing calls, its timing in turn with
    sdpa's) report their own failure and keep the case's figures (a review: raising out of the case,
    they lost its prefill and decode timings). sdpa's step in turn gets copies of ours' cache, not a
    prefill of its own (most of a second at 128K)."""
    from hf_dilated import measure
    from hf_dilated.bench import gpu_table

    def fails(*args, **kwargs):
        raise ValueError("boom")

    prefills = []
    real_prefill = gpu_table._prefill
    monkeypatch.setattr(gpu_table, "_prefill", lambda model, *a: prefills.append(model) or real_prefill(model, *a))
    s = gpu_table.settings(smoke=True)
    (key, spec), = [(k, v) for k, v in gpu_table.plan("model", dict(s, prefill_lengths=[128]), "cpu")
                    if k == "union|128"]
    ours = gpu_table.model_case(spec)["backends"]["ours"]
    assert ours["dynamic"]["in_turn"]["ours_s"] > 0 and ours["reserved"]["in_turn"]["sdpa_s"] > 0
    assert len({id(m) for m in prefills}) == 1  # ours' model alone prefilled
    monkeypatch.setattr(measure, "synchronizing_calls", fails)
    monkeypatch.setattr(gpu_table, "_decode_in_turn", fails)
    ours = gpu_table.model_case(spec)["backends"]["ours"]
    for entry in ("dynamic", "reserved"):
        assert ours[entry]["median_s"] > 0 and ours["prefill"]["median_s"] > 0
        assert ours[entry]["in_turn"] == {"error": "ValueError: boom"}
        assert ours[entry]["waits_error"] == "ValueError: boom" and "waits" not in ours[entry]
        ours[entry]["split"] = {"host_s": 1e-3, "device_s": 1e-3, "waited": 0, "calls": 2}
        assert gpu_table._split_note({"backends": {"ours": ours}}, None, entry, "sdpa") == (
            "ours: host 1.00 ms, GPU 1.00 ms; synchronizing calls not found (ValueError: boom)")


def test_gpu_table_says_how_decode_steps_ran_and_what_fell_back(monkeypatch):
    """step_paths counts each layer's sparse-far decode step by the form that served it, in kinds.py's
    order (the CUDA graph, the compiled call, else the eager step): a slow row says which it was.
    fallbacks() names a fast form the process gave up, with why."""
    from hf_dilated.bench import gpu_table
    from hf_dilated.ops import sparse_far_concatenated, sparse_far_reserved

    # served: a form's step returns a result; None hands the step on to the next form
    monkeypatch.setattr(sparse_far_reserved, "reserved_step", lambda *a, **kw: None)
    monkeypatch.setattr(sparse_far_concatenated, "concatenated_step", lambda *a, **kw: "out")
    counts = {}
    with gpu_table.step_paths(counts):
        for _ in range(3):
            assert sparse_far_reserved.reserved_step() is None
            assert sparse_far_concatenated.concatenated_step() == "out"
    assert counts == {"compiled": 3}
    assert sparse_far_concatenated.concatenated_step.__name__ == "<lambda>"  # restored
    monkeypatch.setattr(sparse_far_reserved, "_GRAPH_FAILED", "RuntimeError: capture failed")
    assert gpu_table.fallbacks() == {"sparse_far_reserved._GRAPH_FAILED": "RuntimeError: capture failed"}
    case = {"backends": {"ours": {"dynamic": {"median_s": 1.0, "paths": counts}}}, "fallbacks": gpu_table.fallbacks()}
    assert gpu_table._path_note(case, "dynamic") == ("layer steps: 3 compiled; fell back "
                                                     "(sparse_far_reserved._GRAPH_FAILED): RuntimeError: capture failed")
    assert gpu_table._path_note({"backends": {}}, "dynamic") is None


def test_gpu_table_static_rows_time_sdpa_kernels_that_take_a_mask():
    """A StaticCache step gives sdpa a mask (the slots not written yet), which flash refuses: the
    static part times sdpa's own choice first, then ours, then cuDNN forced (on CUDA, half precision),
    never flash (on an H200, 2026-11-27, its flash case compiled 16.7 s, failed, and the step ran out
    before sdpa's own choice); the row's ratio is against the faster of the two sdpa kernels."""
    from hf_dilated.bench import gpu_table

    s, smoke = gpu_table.settings(), gpu_table.settings(smoke=True)
    n, m = s["static_length"], smoke["static_length"]
    assert [key for key, _ in gpu_table.plan("static", s, "cuda")] == [
        f"sdpa default|{n}", f"union|{n}", f"default|{n}", f"sdpa cudnn|{n}"]
    assert [key for key, _ in gpu_table.plan("static", smoke, "cpu")] == [f"sdpa default|{m}", f"union|{m}",
                                                                          f"default|{m}"]
    assert gpu_table.static_sdpa_backends(gpu_table.sdpa_backends("cuda", s)) == ["default", "cudnn"]
    sdpa = {"backends": {"default": {"static": {"median_s": 3e-3}}, "cudnn": {"static": {"median_s": 2e-3}}}}
    assert gpu_table._best(sdpa, "static", ["default", "cudnn"])[:2] == (2e-3, "sdpa cudnn")


def test_gpu_table_decode_rows_say_host_and_gpu_time_apart():
    """A decode row's note gives ours' and the ratio's sdpa kernel's host and GPU time apart
    (measure.host_and_device), or that a step waited for the GPU; none where nothing was split
    (the CPU: measure.host_and_device returns None there)."""
    from hf_dilated import measure
    from hf_dilated.bench import gpu_table

    assert measure.host_and_device(lambda: None, torch.device("cpu"), busy_s=0.2) is None
    ours = {"backends": {"ours": {"dynamic": {"median_s": 7e-3, "split": {
        "host_s": 5.1e-3, "device_s": 1.9e-3, "waited": 0, "calls": 3}}}}}
    sdpa = {"backends": {"flash": {"dynamic": {"median_s": 2e-3, "split": {
        "host_s": None, "device_s": None, "waited": 3, "calls": 3}}}}}
    assert gpu_table._split_note(ours, sdpa, "dynamic", "sdpa flash") == (
        "ours: host 5.10 ms, GPU 1.90 ms; sdpa flash: waits for the GPU (3 of 3 calls)")
    ours["backends"]["ours"]["dynamic"]["split"]["waited"] = 1
    assert gpu_table._split_note(ours, None, "dynamic", "sdpa") == (
        "ours: host 5.10 ms, GPU 1.90 ms (waited in 1 of 3 calls)")
    # and where a step waits (measure.synchronizing_calls: "file:line: message" each), where it was asked
    ours["backends"]["ours"]["dynamic"]["waits"] = [
        "/x/hf_dilated/ops/sparse_far_static.py:240: called a synchronizing CUDA operation"] * 2
    sdpa["backends"]["flash"]["dynamic"]["waits"] = []
    assert gpu_table._split_note(ours, sdpa, "dynamic", "sdpa flash") == (
        "ours: host 5.10 ms, GPU 1.90 ms (waited in 1 of 3 calls); 2 synchronizing calls a step, first at "
        "sparse_far_static.py:240; sdpa flash: waits for the GPU (3 of 3 calls); no synchronizing call")
    assert gpu_table._split_note({"backends": {"ours": {"dynamic": {"median_s": 1.0}}}}, sdpa, "reserved",
                                 "sdpa flash") is None


def test_host_profile_lists_where_a_step_spends_its_host_time():
    """measure.host_profile: per call of the step, the functions by their own time, the one that
    spends it first, with its calls per step; the step's other functions after it."""
    from hf_dilated import measure

    def slow_part():  # its own time: a loop of Python (no call the profiler would charge instead)
        total = 0
        for i in range(300_000):
            total += i
        return total

    def fast_part():
        return sum(range(10))

    def step():
        slow_part()
        fast_part()
        fast_part()

    table = measure.host_profile(step, calls=2, top=3).splitlines()
    assert table[0].split()[:3] == ["own", "ms", "cum"] and len(table) == 4
    own, cumulative, calls, where = table[1].split()
    assert where.endswith("(slow_part)") and "test_bench.py:" in where and calls == "1"
    assert 0 < float(own) <= float(cumulative) < 1000
    assert any(line.split()[2] == "2" and line.endswith("(fast_part)") for line in table[2:])


@pytest.mark.cuda
def test_cuda_synchronizing_calls_names_the_line_that_waits():
    """measure.synchronizing_calls on a GPU: a step that reads a value back is reported at its line;
    one of queued kernels has none; the sync debug mode is restored after (a raising step too)."""
    from hf_dilated import measure

    device = torch.device("cuda")
    x = torch.randn(512, 512, device=device)
    line = inspect.currentframe().f_lineno + 1
    waits = measure.synchronizing_calls(lambda: (x @ x).sum().item(), device)
    assert len(waits) == 1 and f"test_bench.py:{line}:" in waits[0], waits
    assert measure.synchronizing_calls(lambda: x @ x, device) == []
    assert measure.synchronizing_calls(lambda: x.cpu(), device)  # a blocking copy to the host
    with pytest.raises(ZeroDivisionError):
        measure.synchronizing_calls(lambda: 1 / 0, device)
    assert torch.cuda.get_sync_debug_mode() == 0


@pytest.mark.slow
def test_profile_model_times_everything_before_its_first_profile():
    """scripts/profile_model.py prints every timing, at every length, before any torch.profiler
    session: once it has traced CUDA the process may stay slower (pytorch/pytorch#144455); on
    2026-11-27 its decode timings, taken after the prefill's profile, put sdpa's step at 5.2 ms where
    gpu_table's own processes measured 2.3. Each deferred profile runs its own length's prompt (read
    off the embedding's input shape): a review found them all running the last length's."""
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, str(root / "scripts" / "profile_model.py"), "--smoke", "--lengths",
                           "128,256", "--steps", "prefill,decode", "--layouts", "by_block", "--top", "200"],
                          capture_output=True, text=True, timeout=600, cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    timings = [i for i, line in enumerate(lines) if "speed" in line and "of sdpa's best" in line]
    profiles = [i for i, line in enumerate(lines) if "aten ops:" in line]
    assert len(timings) == 6 and len(profiles) == 10  # per length: prefill, two caches; ours' 3 profiles, sdpa's 2
    # per length and cache, ours' and sdpa's first kernel's host time by function (measure.host_profile)
    hosts = [line for line in lines if "host time by function" in line]
    assert len(hosts) == 8 and sum(line.lstrip().startswith("DynamicCache default:") for line in hosts) == 2, hosts
    assert max(timings) < min(profiles), done.stdout[-3000:]
    sections = "\n".join(lines).split("\n== profile: ")[1:]
    prompts = {section.splitlines()[0]: [line for line in section.splitlines() if "aten::embedding [[" in line]
               for section in sections}
    for n in (128, 256):
        title = next(t for t in prompts if t.startswith(f"prefill, N {n}:"))
        assert prompts[title] and f"[1, {n}]" in prompts[title][0], (title, prompts[title])


def test_profile_model_times_a_training_step_and_refuses_an_unknown_step():
    """--steps train: one forward and backward beside sdpa's, timed before its profile; a step
    outside prefill, decode and train is refused by name."""
    root = Path(__file__).resolve().parent.parent
    script = [sys.executable, str(root / "scripts" / "profile_model.py"), "--smoke", "--lengths", "128"]
    done = subprocess.run(script + ["--steps", "train", "--top", "5"], capture_output=True, text=True, timeout=600,
                          cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    timing = next(i for i, line in enumerate(lines) if line.startswith("== training step, N 128: sdpa"))
    assert "of sdpa's best" in lines[timing]
    assert timing < next(i for i, line in enumerate(lines) if line.startswith("== profile: training step, N 128"))
    refused = subprocess.run(script + ["--steps", "prefill,backward"], capture_output=True, text=True, timeout=600,
                             cwd=root)
    assert refused.returncode != 0 and "--steps: 'prefill,backward'" in refused.stderr


@pytest.mark.cuda
def test_cuda_host_and_device_tells_a_step_that_waits_for_the_gpu():
    """measure.host_and_device on a GPU: a step that reads a value back waits for the GPU's spin in
    every call; a step of queued kernels does not, and its host time stays under the spin while its
    GPU time is that of its kernels (a second, heavier step takes longer on the GPU, not the host)."""
    from hf_dilated import measure

    device = torch.device("cuda")
    x = torch.randn(2048, 2048, device=device)
    waits = measure.host_and_device(lambda: (x @ x).sum().item(), device, busy_s=0.2)
    assert waits["waited"] == waits["calls"] == 3 and waits["host_s"] is None
    light = measure.host_and_device(lambda: x @ x, device, busy_s=0.2)
    heavy = measure.host_and_device(lambda: [x @ x for _ in range(40)], device, busy_s=0.2)
    assert light["waited"] == heavy["waited"] == 0
    assert light["host_s"] < 0.1 and heavy["host_s"] < 0.1
    # (40 products against 1; gpu_check.sh runs the CUDA tests on 8 workers sharing the GPU, whose
    # time slices may lengthen the light step's interval: a margin well below 40)
    assert heavy["device_s"] > 4 * light["device_s"] > 0


@pytest.mark.slow
def test_gpu_table_compiles_ahead_the_cases_whose_first_call_compiles(tmp_path):
    """gpu_check.sh warms, beside the tests, the cases whose first call compiles on a GPU (the default
    conversion's prefill per length, the StaticCache steps), each in a process of its own: at tiny
    sizes here every one runs and reports its first call; a part with nothing to compile is refused."""
    from hf_dilated.bench import gpu_table

    s = gpu_table.settings(smoke=True)
    keys = [key for key, _ in gpu_table.warm_plan(["model", "static"], s, "cpu")]
    shortest, *middle, longest = sorted(s["prefill_lengths"])  # the model part's order: shortest, longest, the rest
    assert keys == [f"model|default|{n}" for n in (shortest, longest, *middle)] + [
        f"static|{key}" for key, _ in gpu_table.plan("static", s, "cpu")]
    assert [key for key, _ in gpu_table.warm_plan(["block-sparse"], s, "cpu")] == [
        "block-sparse|flex", "block-sparse|block_sparse"]  # the 1.0x target row first
    data = gpu_table.warm(["model"], s, tmp_path, budget_s=300, log=lambda m: None)
    assert list(data["cases"]) == keys[:len(s["prefill_lengths"])]
    for case in data["cases"].values():  # the prefill's first call, then its first decode step's
        assert case["rc"] == 0 and case["first_s"] > 0 and case["step_s"] > 0, case
    assert json.loads((tmp_path / "warm.json").read_text())["cases"] == data["cases"]
    # the table names what was compiled ahead, and each prefill row its first call there
    text = gpu_table.render(s, tmp_path)
    assert f"- compiled ahead, beside the tests: model|default|{s['prefill_lengths'][0]} first call" in text
    # cases start in the plan's order, `at_once` at a time (all at once, beside the tests, none finished
    # on an H200); one still running at the end of the budget is stopped, its process group killed,
    # and one not started says so
    slow = gpu_table.warm(["model"], dict(s, prefill_lengths=[4096, 8192]), tmp_path / "slow", budget_s=1.5,
                          log=lambda m: None, at_once=1)
    assert [c.get("error") for c in slow["cases"].values()] == ["still compiling after the 2 s: stopped",
                                                                "not started: the 2 s were spent"]
    with pytest.raises(ValueError, match="part"):
        gpu_table.warm_plan(["kernels"], s, "cpu")


def _command_line(pid: int) -> str:
    """Process `pid`'s command line, its arguments joined by spaces ("" once it has ended)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _children(pid: int) -> list[int]:
    """The pids of the processes whose parent is `pid` (Linux /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry))
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc (Linux)")
def test_gpu_table_warm_stops_its_cases_when_terminated(tmp_path):
    """gpu_check.sh runs `gpu_table warm` under a time limit, which sends it a SIGTERM: its cases
    (processes in sessions of their own, so that a kill takes their compile workers) stop with it.
    They outlived it once, and compiled for another minute beside the table's timed steps."""
    import signal
    import time

    cmd = [sys.executable, "-m", "hf_dilated.bench.gpu_table", "warm", "model", "--smoke", "--out", str(tmp_path),
           "--budget", "300"]
    parent = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 60
        cases = []
        while not cases and time.time() < deadline and parent.poll() is None:
            time.sleep(0.2)
            # its cases by their command line: another child (a compile worker pool) may start before
            # warm's handler is in place, and a SIGTERM then killed it outright (a CI run, 2026-11-28)
            cases = [pid for pid in _children(parent.pid) if "warm-case" in _command_line(pid)]
        assert cases, "no case started"
        parent.send_signal(signal.SIGTERM)
        parent.wait(timeout=30)
        assert not [pid for pid in cases if _alive(pid)]
        assert parent.returncode == 128 + signal.SIGTERM  # its own exit, having stopped them
        data = json.loads((tmp_path / "warm.json").read_text())  # and said so
        assert [c["error"] for c in data["cases"].values() if c["rc"] is None][0] in (
            "terminated: stopped", "not started: terminated"), data
        assert "terminated: stopped" in [c.get("error") for c in data["cases"].values()], data
    finally:
        parent.kill()
        for pid in _children(parent.pid) + locals().get("cases", []):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)


def test_gpu_table_deadline_counts_the_start_up(tmp_path, capsys):
    """`--deadline` (a Unix time) caps a part's budget from the moment its process is ready: a caller's
    time limit counts the imports before it (10 s and more beside compiles), which a budget alone
    did not, and every table step of a GPU run overran its limit (2026-11-27)."""
    import time

    from hf_dilated.bench import gpu_table

    def budget(*limits):
        gpu_table.main(["run", "kernels", "--smoke", "--out", str(tmp_path), *limits])
        data = json.loads((tmp_path / "kernels.json").read_text())
        assert not data["results"] and data["skipped"]  # under 3 s: no case starts
        return data["budget_s"]

    assert 0 < budget("--budget", "100", "--deadline", str(time.time() + 2.5)) <= 2.5
    assert budget("--budget", "2", "--deadline", str(time.time() + 100)) == 2
    assert budget("--budget", "100", "--deadline", str(time.time() - 5)) == 0  # past: nothing runs
    with pytest.raises(SystemExit):  # argparse's error
        gpu_table.main(["run", "kernels", "--smoke", "--out", str(tmp_path), "--budget", "9", "--deadline", "nan"])
    assert "--deadline: a Unix time in seconds, got nan" in capsys.readouterr().err


def _gpu_check_lib(command: str, env=None) -> subprocess.CompletedProcess:
    """`command` in bash under gpu_check.sh's own options, with scripts/gpu_check_lib.sh sourced."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    lib = os.path.join(root, "scripts", "gpu_check_lib.sh")
    return subprocess.run(["bash", "-c", f"set -uo pipefail; source {lib}; {command}"], capture_output=True,
                          text=True, timeout=120, env=env)


def test_gpu_check_runs_the_cuda_tests_on_8_workers_one_test_at_a_time_where_xdist_can():
    """gpu_check.sh's pytest worker arguments: 8 workers, and tests handed out one at a time (two
    to start) where this pytest-xdist has --maxschedchunk; none without pytest-xdist or with
    --smoke. (By default xdist hands a worker a run of consecutive tests: with the slow tests first,
    one worker would take them all.)"""
    import importlib.util
    import inspect

    expected = []
    if importlib.util.find_spec("xdist") is not None:
        import xdist.scheduler.load

        expected = ["-n", "8"]
        if "maxschedchunk" in inspect.getsource(xdist.scheduler.load):
            expected += ["--dist", "load", "--maxschedchunk", "1"]
    run = _gpu_check_lib("test_workers 0")
    assert run.returncode == 0 and run.stdout.split() == expected, (run.stdout, run.stderr)
    run = _gpu_check_lib("test_workers 1")
    assert run.returncode == 0 and run.stdout == ""


def test_gpu_check_collects_the_slow_tests_first():
    """With HF_DILATED_SLOW_FIRST=1 (gpu_check.sh's CUDA step) every test marked slow is collected
    before the others, each group in its own order; without it the files' order stands. On an H200
    the slow CUDA tests (10-61 s each) ran last and the step stopped at 98%."""
    root = Path(__file__).resolve().parent.parent
    files = ["tests/test_block_sparse.py", "tests/test_sparse_far.py"]

    def collected(marks="cuda", **env):
        done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                               "-m", marks, *files], capture_output=True, text=True, timeout=300, cwd=root,
                              env={**os.environ, **env})
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        return [line for line in done.stdout.splitlines() if "::" in line]

    plain, ordered = collected(HF_DILATED_SLOW_FIRST="0"), collected(HF_DILATED_SLOW_FIRST="1")
    slow = collected("cuda and slow", HF_DILATED_SLOW_FIRST="0")  # the marked ones, in the files' order
    slow_first = slow + [t for t in plain if t not in slow]
    assert len(slow) >= 9 and set(slow) < set(plain) and plain[0].startswith(files[0])
    assert plain != slow_first  # the files' order: not so
    assert ordered == slow_first


def test_gpu_check_archives_every_log_from_outside_the_folder(tmp_path):
    """archive_logs DIR: every file of DIR (not an older all-logs.tgz) in DIR/all-logs.tgz, with
    the real tar, which a wrapper on PATH lets run only when its archive lies outside the folder it
    reads: in the folder tar may exit 1 ("file changed as we read it": the first form's command
    did in 4 of 5, 6 of 10 and 1 of 10 runs on a folder of 30 random 20 KB files here), leaving
    only a .part file. Where tar fails, nothing half-written is left in the folder and summary.txt
    says so."""
    import shutil
    import tarfile

    out = tmp_path / "out"
    (out / "table").mkdir(parents=True)
    for name in ("summary.txt", "cuda-tests.log", "table/table.json"):
        (out / name).write_text(name)
    (out / "all-logs.tgz").write_text("an older archive")
    shims = tmp_path / "bin"
    shims.mkdir()
    (shims / "tar").write_text(f"""#!/usr/bin/env bash
archive=$2 dir=$4  # tar czf ARCHIVE -C DIR ...
case "$(realpath -m "$archive")/" in "$(realpath "$dir")"/*) echo "archive inside the folder" >&2; exit 3 ;; esac
exec {shutil.which("tar")} "$@"
""")
    (shims / "tar").chmod(0o755)
    env = dict(os.environ, PATH=f"{shims}:{os.environ['PATH']}")
    run = _gpu_check_lib(f"archive_logs {out}", env)
    assert run.returncode == 0, run.stderr
    with tarfile.open(out / "all-logs.tgz") as archive:
        names = {name.lstrip("./") for name in archive.getnames() if archive.getmember(name).isfile()}
    assert names == {"summary.txt", "cuda-tests.log", "table/table.json"}
    assert sorted(p.name for p in out.iterdir()) == ["all-logs.tgz", "cuda-tests.log", "summary.txt", "table"]
    # a tar that fails: the archive already there stays whole, nothing else is left, the summary says so
    (shims / "tar").write_text("#!/usr/bin/env bash\nexit 2\n")
    run = _gpu_check_lib(f"archive_logs {out}", env)
    assert run.returncode == 1 and "tar failed" in (out / "summary.txt").read_text()
    assert sorted(p.name for p in out.iterdir()) == ["all-logs.tgz", "cuda-tests.log", "summary.txt", "table"]
    with tarfile.open(out / "all-logs.tgz"):
        pass


@pytest.mark.slow
def test_gpu_check_script_runs_every_step_and_archives_every_log(tmp_path):
    """scripts/gpu_check.sh --smoke (tiny sizes on the CPU; the real run happens on a rare, rented
    GPU, where a broken script wastes it): exit 0, the table, and every log in all-logs.tgz, the
    one file sure to come back from the device tool (test_gpu_check_archives_every_log_from_outside_
    the_folder checks the archiving itself)."""
    import tarfile

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "check"
    run = subprocess.run(["bash", os.path.join(root, "scripts", "gpu_check.sh"), "--smoke", str(out)],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert (out / "report.md").read_text().startswith("# GPU check")
    with tarfile.open(out / "all-logs.tgz") as archive:
        names = {name.lstrip("./") for name in archive.getnames()}
    assert {"summary.txt", "report.md", "cuda-tests.log", "table-model.log", "warm.log", "table/table.json"} <= names
    assert not list(out.glob("*.part")) and "tar failed" not in (out / "summary.txt").read_text()


def test_time_calls_stops_at_its_budget_after_three_calls():
    import time

    from hf_dilated import measure

    calls = []

    def step():  # the first call is slow (it would compile on a GPU): first_s reports it
        time.sleep(0.25 if not calls else 0.05)
        calls.append(1)

    timed = measure.time_calls(step, torch.device("cpu"), warmup=1, repeats=10, budget_s=0.12)
    assert len(timed["times_s"]) == 3 and len(calls) == 4
    assert timed["first_s"] >= 0.25 > max(timed["times_s"])
    calls.clear()
    assert len(measure.time_calls(step, torch.device("cpu"), warmup=0, repeats=5)["times_s"]) == 5 == len(calls)


def test_far_prefill_work_script_counts_the_gpu_paths_work():
    """scripts/far_prefill_work.py (docs/benchmarks.md's counts of the GPU prefill of sparse far keys)
    runs on the CPU and prints what it counts: key tiles of a block (64 pairs a row at most), full
    tiles, a second call's launches, the bytes its eager passes move (at least the output's, written
    once) and no read back; and with --every-far those of the conversion reading every far key."""
    import re

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = os.path.join(root, "scripts", "far_prefill_work.py")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, script, "2048", "1024", "8", "--launches", "--rows", "256"],
                         capture_output=True, text=True, timeout=600, env=env)  # this checkout's hf_dilated
    assert out.returncode == 0, out.stderr[-2000:]
    work = re.search(r"pairs per row ([\d.]+), in partial tiles ([\d.]+) M, in full tiles ([\d.]+) M", out.stdout)
    launches = re.search(r"(\d+) launches, ([\d.]+) MiB moved by eager passes, (\d+) reads back", out.stdout)
    assert work and launches, out.stdout
    assert 0 < float(work[1]) <= 64 and float(work[3]) > 0
    assert int(launches[1]) > 0 and float(launches[2]) >= 2048 * 8 * 16 * 4 / 2 ** 20 and int(launches[3]) == 0
    every = subprocess.run([sys.executable, script, "2048", "1024", "0", "--every-far"], capture_output=True, text=True,
                           timeout=600, env=env)
    assert every.returncode == 0, every.stderr[-2000:]
    launches = re.search(r"every far key: one call \(the second\): (\d+) launches, ([\d.]+) MiB moved by eager "
                         r"passes, (\d+) reads back", every.stdout)
    # (the float32 accumulators of the whole row took 25 launches at 16K, 12 now: the path taken)
    assert launches and 0 < int(launches[1]) <= 12 and int(launches[3]) == 0, every.stdout
