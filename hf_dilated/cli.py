"""The `hf-dilated` command: `bench`, `convert`, `from-gguf`, `info` and `eval` subcommands.

Each subcommand's parser calls `set_defaults(func=...)` with the function that runs it. The
benchmarks' measurement code is imported only when a benchmark runs, and `hf_dilated.eval` only
when `eval` runs (so the command works while that package is absent)."""
from __future__ import annotations

import argparse
import sys


def _run_eval(args, eval_argv: list[str]) -> int:
    """Parses `eval`'s own arguments with the parser hf_dilated.eval defines, then runs it."""
    try:
        import hf_dilated.eval as evaluation
    except ImportError as e:
        print(f"hf-dilated eval: error: the evaluation package hf_dilated.eval is not available in this "
              f"installation ({type(e).__name__}: {e})", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(prog="hf-dilated eval", description=evaluation.__doc__)
    evaluation.add_arguments(parser)
    return int(evaluation.main(parser.parse_args(eval_argv)) or 0)


def build_parser() -> argparse.ArgumentParser:
    from . import from_gguf as gguf
    from .bench.cli import add_subcommands as add_bench_subcommands
    from .convert import add_convert_arguments, add_info_arguments, convert_main, info_main

    parser = argparse.ArgumentParser(prog="hf-dilated", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    bench = sub.add_parser("bench", help="measure the attention kernels against sdpa and write a report",
                           description="Benchmarks; each writes report.md and results.json to --out.")
    add_bench_subcommands(bench)
    convert = sub.add_parser("convert", help="write a long-context copy of a checkpoint")
    add_convert_arguments(convert)
    convert.set_defaults(func=convert_main)
    from_gguf = sub.add_parser("from-gguf", help="write a GGUF checkpoint as a safetensors checkpoint",
                               description=gguf.__doc__.splitlines()[0])
    gguf.add_arguments(from_gguf)
    from_gguf.set_defaults(func=gguf.main)
    info = sub.add_parser("info", help="print what a checkpoint is configured to do")
    add_info_arguments(info)
    info.set_defaults(func=info_main)
    # eval's arguments belong to hf_dilated.eval, imported only when it runs: its parser takes
    # every argument after `eval` (help included), so this one must not answer --help itself.
    evaluate = sub.add_parser("eval", help="evaluate a model (hf_dilated.eval)", add_help=False)
    evaluate.set_defaults(func=_run_eval, takes_unparsed=True)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args, unparsed = parser.parse_known_args(sys.argv[1:] if argv is None else list(argv))
    if getattr(args, "takes_unparsed", False):
        return args.func(args, unparsed)
    if unparsed:
        parser.error(f"unrecognized arguments: {' '.join(unparsed)}")
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
