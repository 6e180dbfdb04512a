"""`hf-dilated bench SUBCOMMAND` (or `python -m hf_dilated.bench SUBCOMMAND`): the argument
definitions, the settings they resolve to, and the driver that runs the chosen sections and writes
the report. This module imports nothing heavy at load time; the measurement modules are imported
when a benchmark runs.

    hf-dilated bench kernels        every attention variant against sdpa (+ --search, --million)
    hf-dilated bench block-sparse   block-sparse against sdpa and FlexAttention with the same mask
    hf-dilated bench decode         one token against a KV cache of N tokens, each kernel vs sdpa; generate()
    hf-dilated bench window         a sliding window (Mistral) over N tokens, ring / dilated vs sdpa
    hf-dilated bench distributed    ring / dilated_ring over 1, 2, ... gloo processes
    hf-dilated bench e2e            a tiny Llama's training step with each attn_implementation
    hf-dilated bench all            kernels, length search, block-sparse, e2e and distributed in one report
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from ..checks import file_in_the_way

FLEX = ("flex", "flex_union")
FLEX_SKIP_REASON = "FlexAttention compiles for ~30 s per shape on CPU; --flex (or naming it in --variants) includes it"
# Values the options take unless given, per profile. "quick" stays within a few minutes on 2 CPU
# cores; "smoke" is for the test suite (tiny everything, every section exercised).
PROFILES = {
    "full": dict(
        lengths=[4096, 8192, 16384, 32768], dtypes=["float32", "bfloat16"], warmup=1, repeats=3,
        segment_lengths=[2048, 4096, 8192, 16384, 32768], dilation_rates=[1, 2, 4, 8, 16], search=True,
        budget_gib=4.0, search_start=4096, search_max=1 << 21, search_timeout=120.0, bisect_steps=3,
        e2e_lengths=[4096, 16384], case_timeout=1800.0, flex=True, distributed=True, processes=[1, 2],
        contexts=[8192, 32768, 131072, 524288, 1048576], original=4096, gen_prompt=32768,
    ),
    "quick": dict(
        lengths=[1024, 4096], dtypes=["float32"], warmup=1, repeats=3,
        segment_lengths=[256, 512, 1024, 2048, 4096], dilation_rates=[1, 2, 4, 8, 16], search=False,
        budget_gib=0.25, search_start=2048, search_max=1 << 16, search_timeout=20.0, bisect_steps=0,
        e2e_lengths=[1024], case_timeout=120.0, flex=False, distributed=False, processes=[1, 2],
        contexts=[4096, 16384], original=1024, gen_prompt=2048,
    ),
    "smoke": dict(
        lengths=[128, 256], dtypes=["float32"], warmup=0, repeats=2,
        segment_lengths=[32, 64, 128], dilation_rates=[1, 2, 4], search=True, budget_gib=6 / 1024,
        search_start=256, search_max=1024, search_timeout=30.0, bisect_steps=1,
        e2e_lengths=[128], case_timeout=120.0, flex=False, distributed=False, processes=[1, 2],
        contexts=[256, 1024], original=64, gen_prompt=128, fsdp_length=128,
    ),
}
# Values no profile changes.
DEFAULTS = dict(out="bench-results", device=None, threads=None, batch=1, heads=8, kv_heads=None, head_dim=64,
                block_size=256, block_pattern=None, variants=None, million=False, e2e=True, e2e_impls=None,
                distributed_length=None, distributed_kernels=None, window=None, gen_new=64, gen_layers=2,
                gen_intermediate=1024, gen_vocab=32000, gen_caches=["dynamic", "static", "reserved"],
                gen_fill="prompt",
                fsdp=True, fsdp_processes=4, fsdp_sp=2, fsdp_length=2048, ops=True)
DTYPE_NAMES = ("float32", "bfloat16", "float16")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.replace(" ", "").split(",") if x]


def _names(text: str) -> list[str]:
    return [x for x in text.replace(" ", "").split(",") if x]


def _group(build) -> argparse.ArgumentParser:
    """A parent parser whose options are absent from the namespace unless given, so that one place
    (PROFILES, DEFAULTS, a subcommand's set_defaults) gives every default."""
    p = argparse.ArgumentParser(add_help=False, argument_default=argparse.SUPPRESS)
    build(p)
    return p


def _common(p):
    profile = p.add_mutually_exclusive_group()
    profile.add_argument("--quick", action="store_true", help="small sizes, float32, no length search")
    profile.add_argument("--smoke", action="store_true", help="tiny sizes through every section (for the tests)")
    p.add_argument("--out", help=f"output directory (default: {DEFAULTS['out']})")
    p.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    p.add_argument("--threads", type=int, help="torch threads per case (default: torch's)")
    p.add_argument("--dtypes", type=_names, help="float32, bfloat16, float16 (comma separated)")
    p.add_argument("--warmup", type=int)
    p.add_argument("--repeats", type=int, help="timed runs (rounds, where variants are interleaved)")
    p.add_argument("--case-timeout", type=float, help="seconds before a case is abandoned")


def _shape(p):
    p.add_argument("--lengths", type=_ints, help="sequence lengths, comma separated")
    p.add_argument("--heads", type=int, help=f"query heads (default: {DEFAULTS['heads']})")
    p.add_argument("--kv-heads", type=int, help="default: --heads")
    p.add_argument("--head-dim", type=int, help=f"default: {DEFAULTS['head_dim']}")


def _pattern(p):
    p.add_argument("--segment-lengths", type=_ints)
    p.add_argument("--dilation-rates", type=_ints)
    p.add_argument("--block-size", type=int, help=f"default: {DEFAULTS['block_size']}")
    p.add_argument("--block-pattern", type=json.loads,
                   help='block-sparse pattern as JSON (default: {"type": "global_local", "global_blocks": 1, "window": 5})')
    p.add_argument("--flex", action=argparse.BooleanOptionalAction,
                   help="include compiled FlexAttention (default: on, off with --quick/--smoke)")


def _kernels(p):
    p.add_argument("--variants", type=_names, help="kernel variants, comma separated (default: all; sdpa always runs)")
    p.add_argument("--batch", type=int, help=f"default: {DEFAULTS['batch']}")
    p.add_argument("--search", action=argparse.BooleanOptionalAction,
                   help="find the longest sequence within --budget-gib (default: on, off with --quick)")
    p.add_argument("--budget-gib", type=float, help="memory budget of the length search (inputs included)")
    p.add_argument("--search-start", type=int)
    p.add_argument("--search-max", type=int)
    p.add_argument("--search-timeout", type=float, help="seconds per attempt of the length search")
    p.add_argument("--bisect-steps", type=int)
    p.add_argument("--ops", action=argparse.BooleanOptionalAction,
                   help="count the aten operations of a forward, backward and decode step per kernel (default: on)")
    p.add_argument("--million", action="store_true",
                   help="also run issue 2's memory check: a float32 forward at 1,048,576 tokens per dilated mode")


def _distributed(p):
    p.add_argument("--processes", type=_ints, help="process counts (default: 1,2)")
    p.add_argument("--distributed-length", type=int,
                   help="global sequence length (default: the longest of --lengths up to 8192)")
    p.add_argument("--distributed-kernels", type=_distributed_kernels,
                   help="sequence-parallel kernels, comma separated (default: ring,dilated_ring,block_sparse_ring)")


def _fsdp(p):
    p.add_argument("--fsdp", action=argparse.BooleanOptionalAction,
                   help="also one training step of a tiny Llama: plain DP x SP vs FSDP2 x SP (default: on)")
    p.add_argument("--fsdp-processes", type=int, help=f"processes of the FSDP2 rows (default: {DEFAULTS['fsdp_processes']})")
    p.add_argument("--fsdp-sp", type=int, help=f"their sequence-parallel size (default: {DEFAULTS['fsdp_sp']})")
    p.add_argument("--fsdp-length", type=int, help=f"their tokens per row (default: {DEFAULTS['fsdp_length']})")


def _distributed_kernels(text: str) -> list[str]:
    from .distributed import KERNELS

    names = _names(text)
    unknown = sorted(set(names) - set(KERNELS))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown {unknown}; choose among {', '.join(KERNELS)}")
    return names


def _e2e(p):
    p.add_argument("--e2e-lengths", type=_ints)
    p.add_argument("--e2e-impls", type=_names, help="attn_implementations (default: sdpa + all hf_dilated registers)")


def _decode(p):
    p.add_argument("--contexts", type=_ints, help="KV cache lengths N, comma separated")
    p.add_argument("--original", type=int, help="pretrained context of the DilatedConfig.default")
    p.add_argument("--heads", type=int, help="query heads (default: 32)")
    p.add_argument("--kv-heads", type=int, help="default: 8")
    p.add_argument("--head-dim", type=int, help="default: 128")
    p.add_argument("--block-size", type=int, help=f"block-sparse rows: block size (default: {DEFAULTS['block_size']})")
    p.add_argument("--block-pattern", type=json.loads, help="block-sparse rows: pattern as JSON")
    p.add_argument("--gen-prompt", type=int, help="generate() rows: prompt tokens (0: no generate rows)")
    p.add_argument("--gen-new", type=int, help=f"generate() rows: new tokens (default: {DEFAULTS['gen_new']})")
    p.add_argument("--gen-layers", type=int, help=f"generate() model: layers (default: {DEFAULTS['gen_layers']})")
    p.add_argument("--gen-intermediate", type=int,
                   help=f"generate() model: MLP width (default: {DEFAULTS['gen_intermediate']})")
    p.add_argument("--gen-vocab", type=int, help=f"generate() model: vocabulary (default: {DEFAULTS['gen_vocab']})")
    p.add_argument("--gen-caches", type=_names, help="generate() rows: dynamic,static,reserved (default: all)")
    p.add_argument("--gen-fill", choices=("prompt", "random"),
                   help="generate() rows: prefill the prompt (default), or fill the cache with random keys and "
                        "values and time the decode steps only (dynamic and reserved caches)")


def _window(p):
    p.add_argument("--window", type=int, help="sliding window W in tokens (default: a quarter of the shortest length)")


def _all(p):
    p.add_argument("--e2e", action=argparse.BooleanOptionalAction, help="tiny-Llama rows (default: on)")
    p.add_argument("--distributed", action=argparse.BooleanOptionalAction,
                   help="multi-process rows (default: on, off with --quick/--smoke)")


def _kernel_sections(s):
    return ["kernels"] + ["search"] * s["search"] + ["million"] * s["million"]


def _all_sections(s):
    return (_kernel_sections(s) + ["block_sparse"] * ("block_sparse" in s["variants"]) + ["e2e"] * s["e2e"]
            + ["distributed"] * s["distributed"])


# name: (help, option groups, sections to run, subcommand defaults)
SUBCOMMANDS = {
    "kernels": ("every attention variant against sdpa: time, useful pairs/s, memory",
                (_common, _shape, _pattern, _kernels), _kernel_sections, {}),
    "block-sparse": ("block-sparse against sdpa and FlexAttention with the same mask, interleaved rounds",
                     (_common, _shape, _pattern), lambda s: ["block_sparse"], {}),
    "decode": ("one new token against a KV cache of N tokens, each kernel vs sdpa; generate() at a long prompt",
               (_common, _decode), lambda s: ["decode"], dict(heads=32, kv_heads=8, head_dim=128)),
    "window": ("a sliding window over N tokens: ring / dilated with the window vs sdpa with its mask",
               (_common, _shape, _window), lambda s: ["window"], {}),
    "distributed": ("ring / dilated_ring over gloo processes: time, memory, bytes sent per rank",
                    (_common, _shape, _pattern, _distributed, _fsdp), lambda s: ["distributed"] + ["fsdp"] * s["fsdp"],
                    {}),
    "e2e": ("a tiny Llama's forward + backward with each attn_implementation",
            (_common, _shape, _pattern, _e2e), lambda s: ["e2e"], {}),
    "all": ("the full report: kernels, length search, block-sparse, end to end, distributed",
            (_common, _shape, _pattern, _kernels, _distributed, _e2e, _all), _all_sections, {}),
}


def add_subcommands(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")
    for name, (help_text, groups, sections, defaults) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text,
                           parents=[_group(build) for build in groups])
        p.set_defaults(func=run, sections=sections, **defaults)


def resolve_settings(args) -> dict:
    """Every setting of the run: the profile's values and the defaults, overridden by the options
    given. Raises ValueError for a value no benchmark can use."""
    import torch

    from ..ops.validate import check_dilated_config
    from .variants import KERNEL_VARIANTS

    given = {k: v for k, v in vars(args).items() if k in DEFAULTS or k in PROFILES["full"]}
    profile = "smoke" if getattr(args, "smoke", False) else "quick" if getattr(args, "quick", False) else "full"
    s = {**DEFAULTS, **PROFILES[profile], **given, "profile": profile}
    _check_given(given, s)
    _check_read(getattr(args, "bench_command", None), given)
    s["device"] = s["device"] or ("cuda" if torch.cuda.is_available() else "cpu")
    s["kv_heads"] = s["kv_heads"] or s["heads"]
    s["block_pattern"] = s["block_pattern"] or {"type": "global_local", "global_blocks": 1, "window": 5}
    named = s["variants"] or []
    unknown = sorted(set(named) - set(KERNEL_VARIANTS))
    if unknown:
        raise ValueError(f"--variants: unknown {unknown}; choose among {', '.join(KERNEL_VARIANTS)}")
    if given.get("flex") is False and "flex" in named:
        raise ValueError("--no-flex: --variants names flex")
    s["skipped_variants"] = [] if named or s["flex"] else list(FLEX)
    s["flex"] = s["flex"] or "flex" in named
    s["skip_reason"] = FLEX_SKIP_REASON
    s["variants"] = named or [v for v in KERNEL_VARIANTS if v not in s["skipped_variants"]]
    if "sdpa" not in s["variants"]:
        s["variants"] = ["sdpa"] + s["variants"]  # every ratio is to sdpa measured in this run
    bad = sorted(set(s["dtypes"]) - set(DTYPE_NAMES))
    if bad:
        raise ValueError(f"--dtypes: unknown {bad}; choose among {', '.join(DTYPE_NAMES)}")
    counts = (s["lengths"] + s["contexts"] + s["processes"] + [s["gen_new"], s["gen_layers"], s["gen_intermediate"],
              s["gen_vocab"], s["fsdp_processes"], s["fsdp_sp"], s["fsdp_length"]]
              + ([] if s["threads"] is None else [s["threads"]]))
    if any(n <= 0 for n in counts):
        raise ValueError("--lengths, --contexts, --processes and --threads must be positive")
    check_dilated_config(s["segment_lengths"], s["dilation_rates"], "union")
    if s["fsdp_processes"] % s["fsdp_sp"] or s["fsdp_length"] % (2 * s["fsdp_sp"]):
        raise ValueError(f"--fsdp-sp ({s['fsdp_sp']}) must divide --fsdp-processes ({s['fsdp_processes']}), and "
                         f"2 x it --fsdp-length ({s['fsdp_length']})")
    if s["gen_prompt"] < 0:
        raise ValueError(f"--gen-prompt must be 0 (no generate rows) or positive, got {s['gen_prompt']}")
    bad = sorted(set(s["gen_caches"]) - {"dynamic", "static", "reserved"})
    if bad:
        raise ValueError(f"--gen-caches: unknown {bad}; choose among dynamic, static, reserved")
    if s["gen_fill"] == "random" and "static" in s["gen_caches"]:
        raise ValueError("--gen-caches: --gen-fill random fills dynamic and reserved caches only; drop static")
    unread = [name for name in _SEARCH_OPTIONS if given.get(name) is not None]
    if unread and not s["search"]:
        raise ValueError(f"{', '.join('--' + n.replace('_', '-') for n in unread)}: the length search does not run "
                         f"({'--no-search' if given.get('search') is False else f'off with --{profile}'}); "
                         "add --search or drop them")
    if s["search_start"] > s["search_max"]:
        def named(name):
            return f"--{name.replace('_', '-')} ({s[name]}{'' if name in given else ', the default'})"
        raise ValueError(f"{named('search_start')} must be at most {named('search_max')}")
    if s.get("window") is None:
        s["window"] = max(1, min(s["lengths"]) // 4)
    if s["window"] <= 0:
        raise ValueError(f"--window must be positive, got {s['window']}")
    return s


# Options that must be at least 1 (0 or less gave empty reports, an error naming others, or a
# default in its place), and those that may be 0.
_AT_LEAST_ONE = ("repeats", "batch", "heads", "kv_heads", "head_dim", "block_size", "gen_new", "gen_layers",
                 "gen_intermediate", "gen_vocab", "fsdp_processes", "fsdp_sp", "fsdp_length", "threads",
                 "distributed_length", "original", "search_start", "search_max")
_AT_LEAST_ZERO = ("warmup", "bisect_steps")
_SEARCH_OPTIONS = ("budget_gib", "search_start", "search_max", "search_timeout", "bisect_steps")  # --search's
_LISTS = ("lengths", "contexts", "processes", "e2e_lengths", "dtypes", "variants", "distributed_kernels")


# Options of the shared groups that a subcommand does not read (they were taken and ignored, the
# report saying otherwise): e2e's model is its own preset's (heads, head size) at --e2e-lengths;
# block-sparse draws every head alike with one warm-up; distributed's levels double from the
# segments, in float32. And the subcommands that run one dtype.
_NOT_READ = {"e2e": ("lengths", "heads", "kv_heads", "head_dim"), "block-sparse": ("kv_heads", "warmup"),
             "distributed": ("dilation_rates", "dtypes")}
_ONE_DTYPE = ("e2e", "block-sparse")


def _check_read(command, given: dict) -> None:
    unread = [f"--{name.replace('_', '-')}" for name in _NOT_READ.get(command, ()) if given.get(name) is not None]
    if unread:
        raise ValueError(f"{', '.join(unread)}: `bench {command}` does not read {'it' if len(unread) == 1 else 'them'}")
    if command in _ONE_DTYPE and len(given.get("dtypes") or []) > 1:
        raise ValueError(f"--dtypes: `bench {command}` runs one dtype, got {given['dtypes']}")


def _check_given(given: dict, s: dict) -> None:
    """A ValueError naming the option given with a value no benchmark can use."""
    def option(name):
        return "--" + name.replace("_", "-")

    for name, value in given.items():
        if value is None:
            continue
        if name in _AT_LEAST_ONE and value < 1 or name in _AT_LEAST_ZERO and value < 0:
            raise ValueError(f"{option(name)} must be >= {1 if name in _AT_LEAST_ONE else 0}, got {value}")
        if name in _LISTS and not value:
            raise ValueError(f"{option(name)}: an empty list")
        if name in _LISTS and name not in ("dtypes", "variants", "distributed_kernels") and min(value) < 1:
            raise ValueError(f"{option(name)} must be positive, got {value}")
        if name in ("case_timeout", "search_timeout", "budget_gib") and value <= 0:
            raise ValueError(f"{option(name)} must be > 0{' seconds' if 'timeout' in name else ''}, got {value}")
    heads, kv_heads = s["heads"], s["kv_heads"] or s["heads"]
    if heads % kv_heads:
        raise ValueError(f"--kv-heads ({kv_heads}) must divide --heads ({heads})")
    if file_in_the_way(s["out"]):
        raise ValueError(f"--out: {s['out']} is (or lies under) a file, not a directory")


def _sections():
    """Report key -> (run(settings, runner, report so far), markdown(section, settings)), in report order."""
    from . import block_sparse, decode, distributed, e2e, fsdp, kernels, search, window

    return {
        "kernels": (kernels.run_section, kernels.markdown_section),
        "search": (search.run_section, search.markdown_section),
        "million": (kernels.run_million, kernels.markdown_million),
        "block_sparse": (block_sparse.run_section, block_sparse.markdown_section),
        "decode": (decode.run_section, decode.markdown_section),
        "window": (window.run_section, window.markdown_section),
        "e2e": (e2e.run_section, e2e.markdown_section),
        "distributed": (distributed.run_section, distributed.markdown_section),
        "fsdp": (fsdp.run_section, fsdp.markdown_section),
    }


def run(args) -> int:
    """Runs the subcommand's sections and writes the report; 2 for settings no benchmark can use."""
    start = time.perf_counter()
    try:
        s = resolve_settings(args)
    except (TypeError, ValueError) as e:
        print(f"hf-dilated bench {args.bench_command}: error: {e}", file=sys.stderr)
        return 2
    from .report import machine_info, say, write_report
    from .worker import CaseRunner

    sections, runner = _sections(), CaseRunner()
    report = {"command": f"bench {args.bench_command}", "settings": s, "machine": machine_info(s["device"], s["threads"])}
    m = report["machine"]
    say(f"hf-dilated bench {args.bench_command} ({s['profile']}): {m['cpu']}, torch {m['torch']}, "
        f"{m['torch_threads']} threads, device {s['device']}, dtypes {s['dtypes']}")
    markdown = [(key, md) for key, (_, md) in sections.items()]
    for key in args.sections(s):
        say(f"{key}:")
        report[key] = sections[key][0](s, runner, report)
        # Written after every section, so that a run stopped later keeps what it measured.
        write_report(report, Path(s["out"]), markdown, plots=False)
    report["elapsed_s"] = time.perf_counter() - start
    text, files = write_report(report, Path(s["out"]), markdown)
    print(text)
    say(f"wrote {', '.join(map(str, files))} in {report['elapsed_s']:.0f} s")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hf_dilated.bench", description=__doc__.splitlines()[0])
    add_subcommands(parser)
    args = parser.parse_args(argv)
    return args.func(args)
