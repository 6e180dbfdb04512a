#!/usr/bin/env bash
# The README's main job: install, then run the embedded default end to end. Nothing is downloaded.
#   1. pretrain_tiny.py  a tiny Llama (model_configs/tiny-llama-passkey.json) with a byte-level
#                        tokenizer, pre-trained at 512 tokens with sdpa on the standard library's sources
#                        alternating with short passkey documents (retrieval within the original context)
#   2. hf-dilated convert  to 2048 tokens: dilated levels [512, 1024, 2048] x [1, 2, 4], YaRN RoPE
#   3. finetune_long_context.py  LoRA (+ embeddings and norms) with dilated_ring on passkey data
#   4. eval_passkey.py   accuracy by length and depth, dilated_ring vs sdpa: table + plot
# Sizes can be overridden from the environment (e.g. FINETUNE_STEPS=50 bash scripts/main.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${SKIP_INSTALL:-}" ]; then  # SKIP_INSTALL=1: already installed
    python -m pip install --quiet torch==2.13.0
    python -m pip install --quiet -e ".[dev]"
fi

OUT=${OUT:-runs/default}
PRETRAIN_STEPS=${PRETRAIN_STEPS:-800}
FINETUNE_STEPS=${FINETUNE_STEPS:-600}
CONTEXT=2048  # the preset's context length
EVAL_SAMPLES=${EVAL_SAMPLES:-4}
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
rm -rf "$OUT/pretrain" "$OUT/long" "$OUT/finetune" "$OUT/eval"  # a fresh run every time

echo "== 1/4 pre-train a tiny Llama at 512 tokens (sdpa, standard-library sources)"
python examples/pretrain_tiny.py --output-dir "$OUT/pretrain" --max-steps "$PRETRAIN_STEPS" \
    --log-file "$OUT/pretrain/log.jsonl"

echo "== 2/4 convert to $CONTEXT tokens"
hf-dilated convert "$OUT/pretrain/model" "$OUT/long" --preset tiny-llama-passkey --force

echo "== 3/4 LoRA fine-tune with dilated_ring on passkey retrieval"
python examples/finetune_long_context.py --model "$OUT/long" --output-dir "$OUT/finetune" --attn dilated_ring \
    --seq-len "$CONTEXT" --data passkey --passkey-recalls 2 --max-steps "$FINETUNE_STEPS" --lora-rank 32 --lora-alpha 64 --lr 2e-3 \
    --warmup-steps 10 --no-gradient-checkpointing --save-every 200 --log-file "$OUT/finetune/log.jsonl"

echo "== 4/4 passkey evaluation"
python examples/eval_passkey.py --model "$OUT/finetune/model" --attn dilated_ring sdpa \
    --lengths 512 1024 "$CONTEXT" --depths 0 0.25 0.5 0.75 1 --samples "$EVAL_SAMPLES" --output-dir "$OUT/eval"
