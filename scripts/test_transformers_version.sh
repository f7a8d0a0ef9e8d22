#!/usr/bin/env bash
# Run the tests that touch transformers' cache, mask and forward APIs under another transformers release (the
# supported range is in pyproject.toml; 5.17.0 is its lower end). Makes a second virtual environment
# (build/venv-transformers-VERSION, made once) with the same torch and that transformers, installs the project there
# with --no-deps, and runs tests/test_kv_cache.py, test_engine.py and test_batch.py in it.
#
#   scripts/test_transformers_version.sh 5.17.0 [pytest arguments]
#
# Needs the package index (or a pip configured with a local one). TORCH_VERSION picks torch (default 2.13.0, a CPU
# wheel on a CPU machine); PYTHON the interpreter the environment is made from (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
version="${1:?usage: scripts/test_transformers_version.sh VERSION [pytest arguments]}"
shift
venv="build/venv-transformers-$version"
if [ ! -x "$venv/bin/python" ]; then
    "${PYTHON:-python3}" -m venv "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip
    "$venv/bin/python" -m pip install -q "torch==${TORCH_VERSION:-2.13.0}" "transformers==$version" \
        "accelerate>=1.0" "datasets>=3.0" "peft>=0.13" "safetensors>=0.4" "tqdm>=4.66" "pyyaml>=6.0" "pytest>=8"
    "$venv/bin/python" -m pip install -q --no-deps -e .
fi
# The marker `other_transformers` selects the check that this really is the release asked for.
MEDUSA_TRANSFORMERS_VERSION="$version" "$venv/bin/python" -m pytest -q -p no:cacheprovider \
    tests/test_kv_cache.py tests/test_engine.py tests/test_batch.py -m "not slow" "$@"
