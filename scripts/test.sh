#!/usr/bin/env bash
# The README's test command: install the package with its test extras, then run the suite.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet torch==2.13.0
python -m pip install --quiet -e ".[dev]"
python -m pytest -q -p no:cacheprovider "$@"
