#!/usr/bin/env bash
# Install into .venv and run the default test suite (tiny random models, CPU, about 8-9 minutes on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
.venv/bin/python -m pytest -q "$@"
