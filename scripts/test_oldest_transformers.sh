#!/usr/bin/env bash
# Runs the Hugging Face integration tests against the OLDEST transformers this package supports
# (the lower bound declared in pyproject.toml), in a second virtual environment that reuses the
# torch of the current interpreter ($PYTHON, else `python`), so nothing pulls another torch build.
#
# The second environment reads the directory holding that torch through a .pth file, after its own
# site-packages (so its transformers wins), and gets this checkout installed editable without
# dependencies. `--system-site-packages` would not do: when `python` is itself a virtual
# environment (or conda env), the system site-packages of its base interpreter lacks its torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$(command -v python || command -v python3 || echo python)}
oldest=$("$PYTHON" - <<'PY'
import re
# A regex, not tomllib: tomllib is Python 3.11+, the package supports 3.10.
match = re.search(r'"transformers\s*>=\s*([0-9][0-9.]*)', open("pyproject.toml", encoding="utf-8").read())
if match is None:
    raise SystemExit("test_oldest_transformers.sh: pyproject.toml declares no transformers>= lower bound")
print(match.group(1))
PY
)
if ! torch_dir=$("$PYTHON" -c "import torch, os; print(os.path.dirname(os.path.dirname(torch.__file__)))"); then
    echo "test_oldest_transformers.sh: error: $PYTHON cannot import torch; install it first (bash scripts/test.sh)" >&2
    exit 1
fi
venv=.venv-oldest-transformers
# Reused only while it was made for this interpreter, this torch and this transformers.
made_for="$("$PYTHON" -c 'import sys; print(sys.executable, sys.version.split()[0])') $torch_dir transformers==$oldest"
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$venv/made-for" 2>/dev/null)" != "$made_for" ]; then
    rm -rf "$venv"
    "$PYTHON" -m venv "$venv"
    site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    echo "$torch_dir" > "$site/hf_dilated_first_environment.pth"
    "$venv/bin/python" -m pip install --quiet "transformers==$oldest"
    "$venv/bin/python" -m pip install --quiet --no-deps -e .
    echo "$made_for" > "$venv/made-for"  # last: an interrupted set-up is redone next time
fi
"$venv/bin/python" - "$oldest" "$torch_dir" <<'PY'
import os, sys
import torch, transformers, hf_dilated
oldest, torch_dir = sys.argv[1:]
assert transformers.__version__ == oldest, transformers.__version__
assert os.path.dirname(os.path.dirname(torch.__file__)) == torch_dir, torch.__file__  # the first interpreter's
assert os.path.samefile(os.path.dirname(os.path.dirname(hf_dilated.__file__)), "."), hf_dilated.__file__
print(f"oldest supported transformers {transformers.__version__} with torch {torch.__version__} from {torch_dir}")
PY
"$venv/bin/python" -m pytest -q -p no:cacheprovider tests/test_hf_models.py tests/test_convert.py "$@"
