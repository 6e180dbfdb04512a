"""The `hf-dilated` command. Each subcommand lives in its own module, which exposes
`add_arguments(parser)` and `main(args) -> int`; they are imported only when used."""
from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = {
    # name: (module, one-line help)
    "bench": ("hf_dilated.bench", "measure every attention variant against sdpa and print a report"),
    "convert": ("hf_dilated.convert", "write a long-context copy of a checkpoint"),
    "info": ("hf_dilated.convert", "print what a checkpoint is configured to do"),
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="hf-dilated", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        p.set_defaults(_module=module_name)
        p.set_defaults(_name=name)
    argv = sys.argv[1:] if argv is None else list(argv)
    # Parse the command name first, then let its module define the rest of the arguments.
    known, _ = parser.parse_known_args(argv[:1] if argv and not argv[0].startswith("-") else argv)
    module = importlib.import_module(known._module)
    p = argparse.ArgumentParser(prog=f"hf-dilated {known._name}", description=SUBCOMMANDS[known._name][1])
    getattr(module, f"add_{known._name}_arguments", getattr(module, "add_arguments", lambda _p: None))(p)
    args = p.parse_args(argv[1:])
    entry = getattr(module, f"{known._name}_main", None) or getattr(module, "main")
    return int(entry(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
