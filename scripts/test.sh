#!/usr/bin/env bash
# Install into .venv and run the default test suite: tiny random models, CPU, in parallel (pytest-xdist, one worker
# per core, each test file on one worker; tests/conftest.py gives each worker its share of the cores as torch
# threads; docs/testing.md). Extra arguments go to pytest (e.g. tests/test_tree.py, -m "not slow", or -n 0 to run
# serially); WORKERS sets the worker count (default: auto, one per core).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
.venv/bin/python -m pytest -q -n "${WORKERS:-auto}" --dist loadfile "$@"
