#!/usr/bin/env bash
# The README's benchmark: the shipped heads and tree against Hugging Face greedy generate, fp32, 128 new tokens, on
# both frozen held-out prompt sets (benchmarks/prompts: 20 ShareGPT prompts, 80 MT-bench-style prompts in 8
# categories), --engine auto (chosen from this machine's profile, `medusa profile`). Each set gets a JSON, a picture
# (.png, with the per-prompt speedups) and a table (.txt). Extra flags go to both benches (e.g. --engine static,
# --limit 16). About 6 + 23 minutes on 2 idle cores. Run scripts/quickstart.sh (or install.sh --reference +
# prepare-model) first.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH" HF_HUB_OFFLINE=1
BASE=${BASE:-models/smollm2-135m-instruct}
HEADS=${HEADS:-checkpoints/smollm2-135m-instruct-hydra}
OUT_DIR=${OUT_DIR:-outputs/bench}
NAME=${NAME:-smollm2-135m-hydra-cpu}
# The frozen sets benched; a base model's meaningful one is documents-held-out (SETS="documents-held-out ...").
SETS=${SETS:-sharegpt-held-out mt-bench-style}
# DRAFT=DIR benches a separate draft model instead of the heads (classic speculative decoding; extra flags such as
# --draft-tokens 3 go after the script's name).
if [ -n "${DRAFT:-}" ]; then DRAFTER=(--draft-model "$DRAFT"); else DRAFTER=(--heads "$HEADS"); fi
mkdir -p "$OUT_DIR"
settle() {  # wait (3 min at most) until the 1-minute load average, which lags, has let go of the last job
    for _ in $(seq 36); do
        awk '{exit !($1 < 0.5)}' /proc/loadavg 2>/dev/null && return
        sleep 5
    done
}
for SET in $SETS; do
    settle
    medusa bench --base "$BASE" "${DRAFTER[@]}" --prompts "benchmarks/prompts/$SET.jsonl" \
        --max-new-tokens 128 --out "$OUT_DIR/bench-$NAME-$SET.json" --plot "$@" | tee "$OUT_DIR/bench-$NAME-$SET.txt"
done
