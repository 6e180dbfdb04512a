"""The work of the GPU's prefill path of sparse far keys (ops/sparse_far_flex.py), counted on the CPU.

    python scripts/far_prefill_work.py N BAND TOP_K [--launches] [--rows R]
    python scripts/far_prefill_work.py N BAND 0 --every-far   # reading every far key instead

One row of N keys (1 x 8/2 heads x 16, blocks of 64, 1 sink), far keys from query BAND on: the
bounds the plan scores and the pairs FlexAttention computes per row, in partial tiles (under the
mask_mod) and in full ones, read from the BlockMasks (FlexAttention itself is not run). With
--launches, also the launches and the bytes that one whole call of the GPU's path (the first BAND
queries' causal call, the band, the far keys, the output: sparse_far_plain.sparse_far_forward with
far_kernel "flex") dispatches outside its compiled calls (each compiled call, FlexAttention and flash's
band counted as one launch, their bytes not), and its reads back: on a GPU each launch is host time,
and each byte an eager pass moves (read and written) GPU time. --rows R: R queries per FlexAttention
call (chunks). --every-far: the launches and bytes of the default conversion that reads every far key
instead (local_band.plain_forward: a level of dilation 1 holding the row, the band BAND), in bfloat16.
"""
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from hf_dilated.ops import backend, local_band, sparse_far_flex, sparse_far_plain
from hf_dilated.ops.far_selection import FarSelection


def main(n: int, band: int, top_k: int, launches: bool, rows: int | None, every_far: bool = False) -> None:
    if rows:  # the entries' budget that makes calls of `rows` queries
        sparse_far_flex._ENTRY_ELEMENTS = 8 * (top_k + 1) * 16 * rows
    work = dict(bounds=0, rows=0, partial=0, full=0)
    plan, fused = sparse_far_flex.by_block_plan, sparse_far_flex._fused

    def counted_plan(q, summary, *rest):
        work["bounds"] += q.shape[0] * q.shape[1] * q.shape[2] * summary.shape[2]
        return plan(q, summary, *rest)

    def recorded_flex(q, k, v, block_mask, scale, kind="by_query"):
        if kind == "by_block":
            area = block_mask.BLOCK_SIZE[0] * block_mask.BLOCK_SIZE[1]
            work["rows"] += q.shape[1] * q.shape[2]
            work["partial"] += int(block_mask.kv_num_blocks.sum()) * area
            if block_mask.full_kv_num_blocks is not None:
                work["full"] += int(block_mask.full_kv_num_blocks.sum()) * area
        return torch.zeros_like(q), torch.full(q.shape[:3], float("-inf"))

    counter = Launches() if launches else None

    def opaque(name, fn):  # a compiled call: one launch, its insides not dispatched one by one
        def call(*args, **kwargs):
            if counter is not None and counter.on:
                counter.count += 1
            with _disable_current_modes():
                return fn(*args, **kwargs)
        return call

    def flash_band(q, k, v, *, window, scale):  # flash's sliding window on CUDA: its out lies as q does (not computed)
        return torch.zeros_like(q.transpose(1, 2)).transpose(1, 2), q.new_zeros(q.shape[:3], dtype=torch.float32)

    sparse_far_flex.by_block_plan = counted_plan
    sparse_far_flex._flex_call = opaque("flex", recorded_flex)
    sparse_far_flex._fused = lambda fn, bucket: opaque(fn.__name__, fused(fn, bucket))
    backend.band_forward = opaque("band", flash_band)
    g = torch.Generator().manual_seed(0)
    # (batch, heads, n, d) views of (batch, n, heads, d), as transformers' attention interface gives them
    q, k, v = (torch.randn(1, n, h, 16, generator=g).transpose(1, 2) for h in (8, 2, 2))
    call = lambda: sparse_far_plain.sparse_far_forward(q, k, v, q, k, band, band, FarSelection(top_k, 64, 1), 0.25,
                                                       far_kernel="flex")
    if every_far:  # in bfloat16, as on a GPU (flash takes no float32: there the accumulators' path runs)
        counter = Launches()
        q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
        call = lambda: local_band.plain_forward(q, k, v, q, k, [2 * n], [1], band, 0.25)
        with torch.no_grad():
            call()
            with counter:
                call()
        print(f"n {n}, band {band}, every far key: one call (the second): {counter.count} launches, "
              f"{counter.bytes / 2 ** 20:.1f} MiB moved by eager passes, {counter.reads} reads back")
        return
    with torch.no_grad():
        call()
        print(f"n {n}, band {band}, top_k {top_k}: bounds {work['bounds'] / 1e6:.1f} M; FlexAttention rows "
              f"{work['rows'] / 1e6:.2f} M, pairs per row {(work['partial'] + work['full']) / max(1, work['rows']):.1f}, "
              f"in partial tiles {work['partial'] / 1e6:.1f} M, in full tiles {work['full'] / 1e6:.1f} M")
        if counter is not None:
            with counter:
                call()
            print(f"one call (the second): {counter.count} launches, {counter.bytes / 2 ** 20:.1f} MiB moved by "
                  f"eager passes, {counter.reads} reads back")


class Launches(TorchDispatchMode):
    """Operations that are not views (launches on a GPU), the bytes they read and write (their tensor
    arguments and results), and reads of a device value on the host."""

    READS = {"aten._local_scalar_dense", "aten.nonzero", "aten.item"}

    def __init__(self):
        super().__init__()
        self.count = self.reads = self.bytes = 0
        self.on = False

    def __enter__(self):
        self.on = True
        return super().__enter__()

    def __exit__(self, *exc):
        self.on = False
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            self.count += 1
            tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
            self.bytes += sum(t.numel() * t.element_size() for t in tensors)
        if str(func.overloadpacket) in self.READS:
            self.reads += 1
        return out


if __name__ == "__main__":
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    args = sys.argv[1:]
    rows = int(args[args.index("--rows") + 1]) if "--rows" in args else None
    main(int(args[0]), int(args[1]), int(args[2]), "--launches" in args, rows, "--every-far" in args)
