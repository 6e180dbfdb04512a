"""`hf-dilated eval`: perplexity by position and by context, passkey retrieval and forward cost of
checkpoints under attention implementations (see runner.py for the command, core.py for what is
measured, passkey.py for the retrieval format).

The CLI registers the subcommand with `add_arguments(parser)` and runs it with `main(args) -> int`;
`python -m hf_dilated.eval` does the same on its own.
"""
from .runner import EvalError, add_arguments, main

__all__ = ["EvalError", "add_arguments", "main"]
