#!/usr/bin/env bash
# What a lent GPU session runs, as one call (the device tool allows 600 s a call; the phase limits add up to 570 s):
# versions, the GPU tests (tests/test_gpu.py: every engine's greedy tokens equal HF generate on the five tiny
# architectures, trained Hydra heads, bf16 ties, batched decoding, CUDA-graph compilation), the training tests on CUDA
# (Accelerate picks the GPU), the GPU's machine profile and --engine auto on it (scripts/gpu_profile_check.py: a
# random Llama-2-7B-shaped bf16 base; the profile, auto's choice, Medusa and plain decoding through the chosen engine
# against HF generate, in gpu-profile.json), the training check on the Llama-2-7B shape (scripts/gpu_train_check.py: a
# hidden-state store built by a random bf16 base from synthetic sequences, 300 steps of Medusa heads from it; the loss
# is finite and falls, the heads load back; store seconds, steps/s and peak memory in gpu-train-7b-shape.json), then
# issue 7's benchmark (scripts/bench_gpu.py) and the attention-kernel A/B (scripts/gpu_sdpa_ab.py) on the Llama-2-7B
# shape in bf16. Each phase has its own time limit (T_* below) and runs whatever the one before did. Nothing is
# downloaded and `datasets` is not needed. Everything lands in $OUT (default outputs/gpu).
# Without pytest on the machine, `pip install --target .gpu-pylib pytest pluggy iniconfig pygments` here and carry
# .gpu-pylib along (the device tool copies the working tree, not installed packages).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-outputs/gpu}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python -c "import pytest" 2>/dev/null || export PYTHONPATH="$PYTHONPATH:$PWD/.gpu-pylib"
phase() {  # phase NAME SECONDS COMMAND...: run with a limit, keep the output, print its tail
    local name=$1 limit=$2; shift 2
    local start=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
    echo "== $name: exit $? after $((SECONDS - start)) s (limit $limit)" | tee -a "$OUT/phases.txt"
    tail -n 15 "$OUT/$name.txt"
}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python -c "import sys, torch, transformers, accelerate; print(sys.version.split()[0], torch.__version__,
transformers.__version__, accelerate.__version__, torch.cuda.get_device_name())"
  python -c "import peft; print('peft', peft.__version__)"; python -c "import datasets; print('datasets', datasets.__version__)"
} > "$OUT/versions.txt" 2>&1
cat "$OUT/versions.txt"
phase test_gpu "${T_TESTS:-120}" python -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py
python -c "import datasets" 2>/dev/null || echo "no datasets package here: the training tests that read data fail"
phase test_train_cuda "${T_TRAIN:-50}" python -m pytest -q -p no:cacheprovider tests/test_train.py \
    tests/test_medusa2.py -k "not two_process and not sigkill and not launch"
phase profile "${T_PROFILE:-60}" python scripts/gpu_profile_check.py --out "$OUT/gpu-profile.json"
phase train_7b_store "${T_TRAIN7B:-120}" python scripts/gpu_train_check.py --steps 300 \
    --out "$OUT/gpu-train-7b-shape.json"
phase bench_eager_static "${T_BENCH:-90}" python scripts/bench_gpu.py --engines eager static \
    --sizes 1 4 16 32 64 --trees 16 32 64 --repeats 5 --new-tokens 32 --out "$OUT/gpu-llama2-7b-shape-bf16.json"
phase sdpa_ab "${T_AB:-50}" python scripts/gpu_sdpa_ab.py --out "$OUT/gpu-sdpa-ab.json"
phase bench_compiled "${T_COMPILED:-80}" python scripts/bench_gpu.py --engines compiled \
    --sizes 1 17 --trees 16 --repeats 5 --new-tokens 32 --out "$OUT/gpu-llama2-7b-shape-bf16-compiled.json"
ls -la "$OUT"
