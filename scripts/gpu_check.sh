#!/usr/bin/env bash
# Everything this project checks on a GPU, in one call under 8 minutes of one H100 (the rented
# machine is rare, held ~30 minutes, and has no network): every CUDA-marked test (not stopping at
# the first failure), then the measurements of ONE table (hf_dilated/bench/gpu_table.py), every
# measure beside sdpa's best kernel (the faster of its flash and cuDNN backends) in the same run:
# kernel pair rates, a Llama-shaped model's prefill, decode step and training step, block_sparse
# against FlexAttention with the same BlockMask, the million-token forward's memory, the tests'
# counts. The table is OUT_DIR/report.md, and is printed at the end.
#
#   scripts/gpu_check.sh [OUT_DIR]           # OUT_DIR, else $OUT, else gpu-check/
#   scripts/gpu_check.sh --smoke [OUT_DIR]   # tiny sizes on whatever device there is (checks this script)
#   scripts/gpu_check.sh --extra [OUT_DIR]   # then also the older per-benchmark reports (beyond the 8 minutes)
#
# Time: each step runs under a limit; a table step's limit is what is left of the 470 s after the
# base budgets of the steps after it (so time a step leaves unused goes to the next), and within
# a step every case runs in a process of its own under what is left of the step's budget. A case
# or step that does not fit is skipped and the table says so on its row. GPU base budgets (s):
# cuda-tests 110, table-kernels 80, table-model 80, table-train 55, table-block-sparse 35,
# table-million 20, table-static (StaticCache + torch.compile) 50, table-render 20 (reserved;
# limit 30): 450 in all, the other 20 s for the set-up before the tests. Beside the tests (8
# pytest-xdist workers where it is installed), the compiles of the table's first calls run ahead
# (gpu_table warm), so that the table's steps time what they measure, not a minute of compiling. (On an H200 the tests
# took 62-90 s, kernels 61, block-sparse 26-39; with kernels at 95 and block-sparse at 40 the
# tests were left 84 s and stopped at 98%.)
#
# OUT_DIR/summary.txt lists each step with its limit, exit status and seconds; each step's output
# is in OUT_DIR/<step>.log; the table's raw results are in OUT_DIR/table/ (<part>.json, table.md,
# table.json). Nothing is fetched: if hf_dilated is not importable, it is installed from this
# checkout without dependencies and without an index.
set -uo pipefail  # no -e: a failing step is recorded and the next one still runs
source "$(dirname "$0")/gpu_check_lib.sh"  # test_workers, archive_logs

smoke=0 extra=0
while [ $# -gt 0 ]; do
    case "$1" in
        --smoke) smoke=1; shift ;;
        --extra) extra=1; shift ;;
        *) break ;;
    esac
done
began=$(date +%s)
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
    echo "== $name at $(($(date +%s) - began)) s (limit ${limit} s): $*" | tee -a "$out/summary.txt"
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
for name in ("transformers", "flash_attn", "flash_attn_interface", "matplotlib"):  # flash_attn*: FA3 / FA4
    try:
        print(name, getattr(importlib.import_module(name), "__version__", "importable"))
    except Exception as e:  # report what is missing, never stop here
        print(name, "not importable:", type(e).__name__, e)
import torch.nn.attention as attention  # the FlashAttention versions torch can put in place of its own
print("flash versions torch registers:", getattr(attention, "list_flash_attention_impls", lambda: "none")())
EOF
} >"$out/env.txt" 2>&1

if ! python -c "import hf_dilated" >/dev/null 2>&1; then
    step install 120 python -m pip install --no-index --no-deps --no-build-isolation -e .
fi

table=(python -m hf_dilated.bench.gpu_table)
if [ $smoke = 1 ]; then
    device=()
    total=900 tests_limit=300 static_min=20
    parts=(kernels:150 model:120 train:90 block-sparse:120 million:60 static:0)
    kernels=(--smoke --variants union,block_sparse,flash_attn --no-search)
    block_sparse=(--smoke --lengths 512 --block-size 64) decode=(--smoke) e2e=(--smoke --e2e-impls sdpa,flash_attention_2,dilated)
    smoke_flag=(--smoke)
else
    python -c "import torch, sys; sys.exit(not torch.cuda.is_available())" \
        || { echo "no CUDA device: run with --smoke to check the script elsewhere" | tee -a "$out/summary.txt"; exit 2; }
    device=(--device cuda --warmup 2 --repeats 10 --case-timeout 90)
    total=470 tests_limit=110 static_min=45
    parts=(kernels:80 model:80 train:55 block-sparse:35 million:20 static:50)
    kernels=(--dtypes bfloat16 --lengths 8192,32768 --no-search --million
             --variants sdpa,flash_attn,flex,union,longnet,head_groups,flex_union,block_sparse,auto)
    block_sparse=(--dtypes bfloat16 --lengths 32768)
    decode=(--dtypes bfloat16 --contexts 8192,32768,131072,524288 --original 4096)
    e2e=(--dtypes bfloat16 --e2e-lengths 4096,16384 --e2e-impls sdpa,flash_attention_2,dilated,block_sparse)
    smoke_flag=()
fi
render_reserve=20
deadline=$((began + total))

# Base budgets of the table steps after the i-th (and the rendering): what the i-th must leave.
reserve_after() {
    local i=$1 sum=$render_reserve j
    for ((j = i + 1; j < ${#parts[@]}; j++)); do sum=$((sum + ${parts[j]#*:})); done
    echo $sum
}

# Every CUDA test, verbose (a stopped run is still counted from its log), never stopping at a failure;
# the model paths, the sparse far keys and the decode steps first (files in that order), so that
# a step that runs out of time has run those (on 2026-11-26 it stopped at 92%, before them).
limit=$((deadline - $(date +%s) - $(reserve_after -1)))
[ $limit -gt $tests_limit ] && limit=$tests_limit
first_tests=(tests/test_cuda_models.py tests/test_sparse_far.py tests/test_decode.py)
other_tests=($(ls tests/test_*.py | grep -v -x -F "$(printf '%s\n' "${first_tests[@]}")"))
# Beside the tests, each in a process of its own (two at a time), the compiles the table's first calls
# would make (both block-sparse cases, the default conversion's plan per length, the StaticCache
# steps): a first call that compiles
# took 64 s at 16K on an H200 (2026-11-27), most of the model step's budget; the table's processes
# then find the kernels in inductor's and Triton's caches on disk. And the tests on 8 workers where
# pytest-xdist is installed (the GPU image has it): in one process, 30 of them filled the step's
# 109 s that day (the sparse far keys' compiled CUDA tests take 30-39 s each).
timeout --kill-after=10 $((limit + 5)) "${table[@]}" warm block-sparse model static "${smoke_flag[@]}" --out "$out/table" \
    --budget "$limit" --deadline $(($(date +%s) + limit)) >"$out/warm.log" 2>&1 &
warm_pid=$!
mapfile -t workers < <(test_workers $smoke)
# the slow tests first (tests/conftest.py), handed out one at a time (test_workers)
HF_DILATED_SLOW_FIRST=1 step cuda-tests "$limit" python -m pytest -v -p no:cacheprovider -m cuda "${workers[@]}" "${first_tests[@]}" \
    "${other_tests[@]}" --durations=25 --junitxml="$out/cuda-tests.xml"
wait $warm_pid
echo "   compiled ahead (warm.log): $(grep -c 'first call' "$out/warm.log") cases" | tee -a "$out/summary.txt"

mkdir -p "$out/table"
for ((i = 0; i < ${#parts[@]}; i++)); do
    part=${parts[i]%%:*} base=${parts[i]#*:}
    limit=$((deadline - $(date +%s) - $(reserve_after $i)))
    if [ "$base" -gt 0 ] && [ $limit -gt $((2 * base)) ]; then limit=$((2 * base)); fi
    least=$([ "$part" = static ] && echo $static_min || echo 10)  # static compiles: it needs more to start
    if [ $limit -lt $least ]; then
        echo "== table-$part skipped: ${limit} s left of the ${total} s, under the ${least} s it needs" \
            | tee -a "$out/summary.txt" "$out/table-$part.log"
        continue
    fi
    # --deadline: the budget counts the process's start-up too (imports took 10 s and more beside
    # compiles, and every step overran its limit on 2026-11-27, losing its last case)
    step "table-$part" "$limit" "${table[@]}" run "$part" "${smoke_flag[@]}" --out "$out/table" --budget $((limit - 10)) \
        --deadline $(($(date +%s) + limit - 10))
done

step table-render 30 "${table[@]}" table "${smoke_flag[@]}" --out "$out/table" \
    --tests-xml "$out/cuda-tests.xml" --tests-log "$out/cuda-tests.log"
if [ -f "$out/table/table.md" ]; then cp "$out/table/table.md" "$out/report.md"; else
    echo "# GPU check: no table (see table-render.log)" >"$out/report.md"; fi
echo "   total $(($(date +%s) - began)) s of the ${total} s" | tee -a "$out/summary.txt"

if [ $extra = 1 ]; then  # the older per-benchmark reports, beyond the 8 minutes
    step kernels 200 python -m hf_dilated.bench kernels "${device[@]}" "${kernels[@]}" --out "$out/kernels"
    step block-sparse 90 python -m hf_dilated.bench block-sparse "${device[@]}" "${block_sparse[@]}" --out "$out/block-sparse"
    step decode 90 python -m hf_dilated.bench decode "${device[@]}" "${decode[@]}" --out "$out/decode"
    step e2e 90 python -m hf_dilated.bench e2e "${device[@]}" "${e2e[@]}" --out "$out/e2e"
    for name in kernels block-sparse decode e2e; do
        echo
        if [ -f "$out/$name/report.md" ]; then cat "$out/$name/report.md"; else echo "# $name: no report (see $name.log)"; fi
    done >>"$out/report.md"
fi

archive_logs "$out"  # every log and raw result in one file as well (gpu_check_lib.sh)

echo
cat "$out/report.md"
echo "table: $out/report.md; steps: $out/summary.txt; everything: $out/all-logs.tgz" | tee -a "$out/summary.txt"
exit $failed
