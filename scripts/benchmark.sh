#!/usr/bin/env bash
# The README's benchmark: shipped heads and tree vs Hugging Face greedy generate, fp32, 20 held-out ShareGPT
# prompts, 128 new tokens; the picture goes next to the JSON (.png). Run scripts/quickstart.sh (or install.sh
# --reference + prepare-model) first.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH" HF_HUB_OFFLINE=1
BASE=${BASE:-models/smollm2-135m-instruct}
HEADS=${HEADS:-checkpoints/smollm2-135m-instruct-hydra}
OUT=${OUT:-outputs/bench/smollm2-135m-cpu.json}
[ -f data/held_out_prompts.jsonl ] || medusa held-out-prompts --n 20 --out data/held_out_prompts.jsonl
medusa bench --base "$BASE" --heads "$HEADS" --prompts data/held_out_prompts.jsonl --limit 20 \
    --max-new-tokens 128 --out "$OUT" --plot "$@"
