#!/usr/bin/env bash
# Issue 7's GPU measurement, on one CUDA device, with no downloads: a Llama-2-7B-shaped random model in bf16 (or
# BASE=<local model folder>), step cost against n = 1, 4, 16, 32, 64 for the eager, static and compiled engines,
# Hugging Face generate, our plain decoding, Medusa with random heads on trees of 16, 32 and 64 nodes, and the
# weight-read floor from a measured device-to-device copy. One JSON: OUT (default below).
#   bash studies/bench_gpu.sh                       # random 7B shape, about 14 GB of GPU memory
#   BASE=/models/llama-2-7b bash studies/bench_gpu.sh --engines eager compiled
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH" HF_HUB_OFFLINE=1
OUT=${OUT:-outputs/bench/gpu-llama2-7b-shape-bf16.json}
# onednn is a CPU engine (on a GPU it is static again): not in the default list here.
ARGS=(--device "${DEVICE:-cuda}" --dtype "${DTYPE:-bfloat16}" --out "$OUT" --engines eager static compiled)
[ -n "${BASE:-}" ] && ARGS+=(--base "$BASE")
python scripts/bench_gpu.py "${ARGS[@]}" "$@"
echo "wrote $OUT"
