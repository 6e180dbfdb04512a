"""One compiled StaticCache decode step on this machine's CPU (inductor), `sdpa` or the default
conversion: python scripts/static_step_cpu.py N sdpa|default. A 2-layer Llama of 8/2 heads x 64,
float32, 2 threads; a StaticCache of N + 64 slots filled with random keys and values, one eager step
(which keeps the far keys' block summaries), then torch.compile(model, fullgraph=True) and the
median of 8 steps. OLD=1 switches the kept summaries off (the step then scores every slot).
docs/benchmarks.md has its figures."""
import os
import sys
import time

import torch
from transformers import StaticCache

from hf_dilated.bench.gpu_table import ROOM, _build_model, _cache_arg

torch.set_num_threads(2)
if os.environ.get("OLD"):
    from hf_dilated.ops import sparse_far_static

    sparse_far_static.KeptSummaries.fits = lambda *a: False
n, conversion = int(sys.argv[1]), sys.argv[2]
spec = dict(model=dict(heads=8, kv_heads=2, head_dim=64, layers=2, intermediate=512, vocab=256), n=n,
            conversion=conversion, original=4096, device="cpu", dtype="float32")
model, config, ids = _build_model(spec)
model.eval()
arg = _cache_arg(model)
g = torch.Generator().manual_seed(0)
with torch.no_grad():
    cache = StaticCache(config=config, max_cache_len=n + ROOM)
    model(input_ids=ids[:, :16], **{arg: cache}, use_cache=True, cache_position=torch.arange(16))
    for layer in cache.layers:  # slots 16 .. n - 1 as a prefill leaves them (random: the timing is the same)
        for t in (layer.keys, layer.values):
            t[:, :, 16:n].copy_(torch.randn(t[:, :, 16:n].shape, generator=g))
    token = ids[:, -1:]
    start = time.perf_counter()
    model(input_ids=token, **{arg: cache}, use_cache=True, cache_position=torch.tensor([n]))
    eager_s = time.perf_counter() - start
    compiled = torch.compile(model, fullgraph=True)
    position = [n + 1]

    def step():
        compiled(input_ids=token, **{arg: cache}, use_cache=True, cache_position=torch.tensor([position[0]]))
        position[0] += 1

    start = time.perf_counter()
    step()
    first_s = time.perf_counter() - start
    step(), step()
    times = []
    for _ in range(8):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
times.sort()
print(f"{conversion} n={n}: eager step {eager_s * 1e3:.1f} ms, first compiled call {first_s:.1f} s, "
      f"compiled step median {times[4] * 1e3:.2f} ms (min {times[0] * 1e3:.2f})")
