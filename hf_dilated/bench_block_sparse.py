"""Block-sparse attention benchmark: useful-pair throughput against dense causal sdpa and compiled
FlexAttention with the same mask, measured in one run on one machine.

"Useful pairs" are the visible (query, key) pairs, counted exactly (bench_count.py): a sparse
kernel that computes 7% of the causal pairs in 10% of sdpa's time has 0.7x sdpa's useful-pair
throughput. FlexAttention (torch.compile on CPU) gets the identical token-level mask; on CPU in
torch 2.13 it has no backward, so it only appears in forward rows.

The variants are timed in interleaved rounds (each once per round), so a slow spell of a shared
machine falls on all of them. Ratios are given from the median runs and from each variant's
fastest run.

    python -m hf_dilated.bench_block_sparse                 # N=32768, 8 heads, head_dim 64
    python -m hf_dilated.bench_block_sparse --n 4096 --repeats 1 --backward
    python -m hf_dilated.bench_block_sparse --threads 1     # every variant on one thread (busy machine)

Functions for the `hf-dilated bench` driver: `run_block_sparse_bench(...)` returns result rows
(dicts), `markdown_table(rows)` renders them.
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from .bench_count import dense_pair_count, layout_pair_count
from .ops import block_sparse_attention
from .ops.block_patterns import GlobalLocalPattern


def kept_block_fraction(layout, num_blocks: int) -> float:
    """Allowed causal (query block, key block) pairs over all causal block pairs."""
    lay = layout[..., :num_blocks, :num_blocks].reshape(-1, num_blocks, num_blocks)[0]
    return float(lay.tril().sum()) / (num_blocks * (num_blocks + 1) / 2)


def _time_interleaved(fns, repeats: int, warmup: int = 1, log=print) -> list[list[float] | None]:
    """Times every function once per round, in turn, for `repeats` rounds after `warmup` calls each.

    Interleaving makes a slow spell of a busy machine fall on every variant alike, so the ratios
    between them stay meaningful; timing one variant after another lets it skew just one of them.
    A function that raises, in its warm-up or in any round, is reported and left out (None)."""
    times = [[] for _ in fns]
    for rnd in range(-warmup, repeats):  # negative rounds: warm-up, not timed
        for i, (name, fn) in enumerate(fns):
            if times[i] is None:
                continue
            try:
                start = time.perf_counter()
                fn()
                if rnd >= 0:
                    times[i].append(time.perf_counter() - start)
            except Exception as exc:
                log(f"{name} failed: {type(exc).__name__}: {exc}")
                times[i] = None
    return times


def _flex_forward(q, k, v, pattern: GlobalLocalPattern, block_size: int):
    """Compiled FlexAttention with the token-level mask of a causal global_local pattern."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    g, w = pattern.global_blocks, pattern.window

    def mask_mod(b, h, q_idx, kv_idx):
        qb, kb = q_idx // block_size, kv_idx // block_size
        return (kv_idx <= q_idx) & ((kb < g) | (qb - kb < w))

    n = q.shape[2]
    block_mask = create_block_mask(mask_mod, None, None, n, n, device=q.device.type, BLOCK_SIZE=block_size)
    compiled = torch.compile(flex_attention, dynamic=False)
    return lambda: compiled(q, k, v, block_mask=block_mask)


def run_block_sparse_bench(n=32768, heads=8, head_dim=64, block_size=256, global_blocks=1, window=5,
                           dtype=torch.float32, repeats=3, flex=True, backward=False, device="cpu", log=print):
    """Returns result rows: variant, mode, seconds (median), spread, useful pairs, pairs/s, ratio."""
    torch.manual_seed(0)
    q = torch.randn(1, heads, n, head_dim, dtype=dtype, device=device)
    k = torch.randn(1, heads, n, head_dim, dtype=dtype, device=device)
    v = torch.randn(1, heads, n, head_dim, dtype=dtype, device=device)
    pattern = GlobalLocalPattern(global_blocks, window)
    num_blocks = -(-n // block_size)
    layout = pattern.block_layout(torch.arange(num_blocks), num_blocks)
    sparse_pairs = layout_pair_count(n, block_size, layout[0]) * heads
    dense_pairs = dense_pair_count(n, heads)
    kept = kept_block_fraction(layout, num_blocks)
    label = f"global_local(g={global_blocks}, w={window}), block {block_size}, {kept:.1%} of causal blocks kept"

    cases = [
        ("sdpa (dense causal)", "forward", dense_pairs,
         lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
        ("block_sparse", "forward", sparse_pairs,
         lambda: block_sparse_attention(q, k, v, pattern, block_size=block_size)),
    ]
    if flex:
        try:
            cases.append(("flex_attention (compiled)", "forward", sparse_pairs,
                          _flex_forward(q, k, v, pattern, block_size)))
        except Exception as exc:  # report, never hide: FlexAttention support varies by build
            log(f"flex_attention unavailable: {type(exc).__name__}: {exc}")
    if backward:
        qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))

        def fwd_bwd(fn):
            def step():
                fn(qg, kg, vg).sum().backward()
                qg.grad = kg.grad = vg.grad = None
            return step

        cases += [
            ("sdpa (dense causal)", "forward+backward", dense_pairs,
             fwd_bwd(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True))),
            ("block_sparse", "forward+backward", sparse_pairs,
             fwd_bwd(lambda a, b, c: block_sparse_attention(a, b, c, pattern, block_size=block_size))),
        ]

    rows = []
    all_times = _time_interleaved([(f"{variant} {mode}", fn) for variant, mode, _, fn in cases], repeats, log=log)
    for (variant, mode, pairs, _), times in zip(cases, all_times):
        if times is None:
            continue
        median = statistics.median(times)
        rows.append({
            "variant": variant, "mode": mode, "n": n, "heads": heads, "head_dim": head_dim,
            "dtype": str(dtype).replace("torch.", ""), "pattern": label if variant != "sdpa (dense causal)" else "causal",
            "seconds": median, "min": min(times), "max": max(times), "runs": len(times),
            "useful_pairs": pairs, "pairs_per_s": pairs / median,
        })
        log(f"{variant:28s} {mode:17s} {median:9.3f} s  {pairs / median / 1e6:10.1f} Mpairs/s")
    for row in rows:
        base = next((r for r in rows if r["variant"].startswith("sdpa") and r["mode"] == row["mode"]), None)
        row["vs_sdpa"] = row["pairs_per_s"] / base["pairs_per_s"] if base else None
        flex_row = next((r for r in rows if r["variant"].startswith("flex") and r["mode"] == row["mode"]), None)
        row["vs_flex"] = row["pairs_per_s"] / flex_row["pairs_per_s"] if flex_row else None
        # The same ratio from each variant's fastest run: interference from other processes only
        # ever slows a run down, so the best runs are the least disturbed comparison.
        best = lambda r: r["useful_pairs"] / r["min"]  # noqa: E731
        row["vs_sdpa_best"] = best(row) / best(base) if base else None
    return rows


def markdown_table(rows) -> str:
    lines = [
        "| variant | mode | pattern | time (s, median [min-max], runs) | useful pairs | Mpairs/s | vs sdpa | vs sdpa, best runs | vs flex |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = lambda x: "-" if x is None else f"{x:.2f}x"  # noqa: E731
        lines.append(
            f"| {r['variant']} | {r['mode']} | {r['pattern']} | {r['seconds']:.3f} [{r['min']:.3f}-{r['max']:.3f}], "
            f"{r['runs']} | {r['useful_pairs']:.3e} | {r['pairs_per_s'] / 1e6:.1f} | {ratio(r['vs_sdpa'])} | "
            f"{ratio(r['vs_sdpa_best'])} | {ratio(r['vs_flex'])} |"
        )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=32768)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--global-blocks", type=int, default=1)
    parser.add_argument("--window", type=int, default=5)
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved timed rounds")
    parser.add_argument("--no-flex", action="store_true", help="skip compiled FlexAttention")
    parser.add_argument("--backward", action="store_true", help="also time forward+backward")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads for every variant (default: torch's default)")
    args = parser.parse_args(argv)
    if args.threads is not None:
        if args.threads < 1:
            parser.error(f"--threads must be positive, got {args.threads}")
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {platform.machine()}, {torch.get_num_threads()} threads, "
          f"batch 1, {args.heads} heads, head_dim {args.head_dim}, N={args.n}, {args.dtype}")
    rows = run_block_sparse_bench(
        n=args.n, heads=args.heads, head_dim=args.head_dim, block_size=args.block_size,
        global_blocks=args.global_blocks, window=args.window, dtype=getattr(torch, args.dtype),
        repeats=args.repeats, flex=not args.no_flex, backward=args.backward,
    )
    print()
    print(markdown_table(rows))


if __name__ == "__main__":
    main()
