#!/usr/bin/env bash
# Runs the Hugging Face integration tests against the OLDEST transformers this package supports
# (the lower bound declared in pyproject.toml), in a second virtual environment that reuses the
# installed torch (--system-site-packages), so nothing pulls another torch build.
set -euo pipefail
cd "$(dirname "$0")/.."
oldest=$(python - <<'PY'
import re, tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
spec = next(d for d in deps if re.match(r"transformers\b", d))
print(re.search(r">=\s*([0-9][0-9.]*)", spec).group(1))
PY
)
venv=.venv-oldest-transformers
[ -x "$venv/bin/python" ] || python -m venv --system-site-packages "$venv"
"$venv/bin/python" -m pip install --quiet "transformers==$oldest"
"$venv/bin/python" - <<PY
import torch, transformers
assert transformers.__version__ == "$oldest", transformers.__version__
assert torch.__version__.startswith("2.13.0"), torch.__version__
print(f"oldest supported transformers {transformers.__version__} with torch {torch.__version__}")
PY
"$venv/bin/python" -m pytest -q -p no:cacheprovider tests/test_hf_models.py tests/test_convert.py "$@"
