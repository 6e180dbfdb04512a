"""Decode-step latency: one new token against a KV cache of N tokens, hf_dilated vs sdpa.

A decode step of dilated attention gathers, per level, only the w_g / r_g keys of the query's
segment that its head selects, so its cost follows sum_g w_g / r_g, not N. The configuration is
the documented default for a checkpoint pretrained at --original tokens and extended to N
(segments original * 2^g, dilations 2^g). Prints one row per context length; ratios compare
the two in the same run.

    python scripts/bench_decode.py [--contexts 8192,32768,131072] [--original 4096]
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from hf_dilated.integrations.config import DilatedConfig
from hf_dilated.ops import dilated_attention


def timed(fn, repeats):
    fn()  # warm-up (plans, allocator)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", default="8192,32768,131072")
    p.add_argument("--original", type=int, default=4096)
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype)
    groups = args.q_heads // args.kv_heads
    print(f"device={device} dtype={args.dtype} q_heads={args.q_heads} kv_heads={args.kv_heads} "
          f"head_dim={args.head_dim} original={args.original}; best of {args.repeats}")
    print(f"{'context':>8} {'levels':>6} {'keys/query<=':>12} {'sdpa ms':>9} {'dilated ms':>10} {'dilated/sdpa':>12}")
    for n in (int(x) for x in args.contexts.split(",")):
        cfg = DilatedConfig.default(args.original, n)
        g = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(1, args.q_heads, 1, args.head_dim, generator=g, device=device, dtype=dtype)
        k = torch.randn(1, args.kv_heads, n, args.head_dim, generator=g, device=device, dtype=dtype)
        v = torch.randn(1, args.kv_heads, n, args.head_dim, generator=g, device=device, dtype=dtype)

        def sdpa():
            # what transformers' sdpa does for one query with grouped heads: no mask, enable_gqa
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=groups > 1)

        def dilated():
            return dilated_attention(q, k, v, cfg.segment_lengths, cfg.dilation_rates, mode=cfg.mode)

        with torch.no_grad():
            t_sdpa, t_dil = timed(sdpa, args.repeats), timed(dilated, args.repeats)
        keys = sum(w // r for w, r in zip(cfg.segment_lengths, cfg.dilation_rates))
        print(f"{n:>8} {len(cfg.segment_lengths):>6} {min(keys, n):>12} {t_sdpa * 1e3:>9.2f} {t_dil * 1e3:>10.2f} "
              f"{t_dil / t_sdpa:>12.2f}")


if __name__ == "__main__":
    main()
