#!/usr/bin/env bash
# Everything this project checks on a GPU, in one call sized for about 8 minutes of one H100 (the
# rented machine is rare, held ~30 minutes, and has no network): the CUDA-marked tests, then the
# GPU benchmarks (kernels against sdpa and flash-attn where installed plus the million-token
# memory check, block-sparse against sdpa and FlexAttention, decode, a tiny Llama's training step
# per attn_implementation). Every table and log goes into one folder:
#
#   scripts/gpu_check.sh [OUT_DIR]           # OUT_DIR, else $OUT, else gpu-check/
#   scripts/gpu_check.sh --smoke [OUT_DIR]   # tiny sizes on whatever device there is (checks this script)
#
# OUT_DIR/summary.txt lists each step with its exit status and seconds; OUT_DIR/report.md joins
# the benchmark reports; each step's output is in OUT_DIR/<step>.log, each benchmark's tables
# and results.json in OUT_DIR/<step>/. Nothing is fetched: if hf_dilated is not importable, it is
# installed from this checkout without dependencies and without an index.
set -uo pipefail  # no -e: a failing step is recorded and the next one still runs

smoke=0
if [ "${1:-}" = "--smoke" ]; then smoke=1; shift; fi
cd "$(dirname "$0")/.."
out="${1:-${OUT:-gpu-check}}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
export PIP_NO_INDEX=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
failed=0

# step NAME SECONDS COMMAND...: run COMMAND under a time limit, output to OUT_DIR/NAME.log.
step() {
    local name=$1 limit=$2 start rc
    shift 2
    echo "== $name (limit ${limit} s): $*" | tee -a "$out/summary.txt"
    start=$(date +%s)
    timeout --kill-after=15 "$limit" "$@" >"$out/$name.log" 2>&1
    rc=$?
    echo "   exit $rc after $(($(date +%s) - start)) s$([ $rc -eq 124 ] && echo ' (time limit)')" \
        | tee -a "$out/summary.txt"
    [ $rc -eq 0 ] || failed=1
}

: >"$out/summary.txt"
{
    date -u +"date (UTC): %F %T"
    git rev-parse --short HEAD 2>/dev/null | sed 's/^/commit: /'
    if command -v nvidia-smi >/dev/null; then nvidia-smi; else echo "nvidia-smi: not available"; fi
    python - <<'EOF'
import importlib, platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0))
for name in ("transformers", "flash_attn", "matplotlib"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as e:  # report what is missing, never stop here
        print(name, "not importable:", type(e).__name__, e)
EOF
} >"$out/env.txt" 2>&1

if ! python -c "import hf_dilated" >/dev/null 2>&1; then
    step install 120 python -m pip install --no-index --no-deps --no-build-isolation -e .
fi

if [ $smoke = 1 ]; then
    device=()
    tests_limit=300
    kernels=(--smoke --variants union,block_sparse,flash_attn --no-search)
    block_sparse=(--smoke --lengths 512 --block-size 64) decode=(--smoke) e2e=(--smoke --e2e-impls sdpa,flash_attention_2,dilated)
else
    python -c "import torch, sys; sys.exit(not torch.cuda.is_available())" \
        || { echo "no CUDA device: run with --smoke to check the script elsewhere" | tee -a "$out/summary.txt"; exit 2; }
    device=(--device cuda --warmup 2 --repeats 10 --case-timeout 90)
    tests_limit=120
    kernels=(--dtypes bfloat16 --lengths 8192,32768 --no-search --million
             --variants sdpa,flash_attn,flex,union,longnet,head_groups,flex_union,block_sparse,auto)
    block_sparse=(--dtypes bfloat16 --lengths 32768)
    decode=(--dtypes bfloat16 --contexts 8192,32768,131072,524288 --original 4096)
    e2e=(--dtypes bfloat16 --e2e-lengths 4096,16384 --e2e-impls sdpa,flash_attention_2,dilated,block_sparse)
fi

step cuda-tests "$tests_limit" python -m pytest -q -p no:cacheprovider -m cuda tests --junitxml="$out/cuda-tests.xml"
step kernels 200 python -m hf_dilated.bench kernels "${device[@]}" "${kernels[@]}" --out "$out/kernels"
step block-sparse 90 python -m hf_dilated.bench block-sparse "${device[@]}" "${block_sparse[@]}" --out "$out/block-sparse"
step decode 45 python -m hf_dilated.bench decode "${device[@]}" "${decode[@]}" --out "$out/decode"
step e2e 90 python -m hf_dilated.bench e2e "${device[@]}" "${e2e[@]}" --out "$out/e2e"

for name in kernels block-sparse decode e2e; do
    if [ -f "$out/$name/report.md" ]; then cat "$out/$name/report.md"; else echo "# $name: no report (see $name.log)"; fi
    echo
done >"$out/report.md"
echo "tables: $out/report.md; steps: $out/summary.txt" | tee -a "$out/summary.txt"
exit $failed
