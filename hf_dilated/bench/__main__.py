"""`python -m hf_dilated.bench SUBCOMMAND`: the same as `hf-dilated bench SUBCOMMAND`."""
import sys

from .cli import main

if __name__ == "__main__":  # a process that imports this module to run a case must not start a run
    sys.exit(main())
