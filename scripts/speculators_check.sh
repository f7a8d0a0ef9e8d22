#!/usr/bin/env bash
# Load the eagle drafter's speculators eagle3 export in speculators 0.9.0 itself and compare its logits with ours
# (scripts/speculators_check.py says what is compared; docs/formats.md has the figures). speculators is no dependency
# of ours, so this makes a second virtual environment (SPECULATORS_VENV, default .venv-speculators, made once) and
# runs the check there. Arguments go to the check:
#
#   scripts/speculators_check.sh                                       # random drafters on tiny random bases
#   scripts/speculators_check.sh --base models/smollm2-135m-instruct   # a random drafter on the real base
#
# What goes in, and why:
# - torch==2.13.0, pinned: an unpinned torch pulls a multi-GB CUDA build; 2.13.0 is a CPU wheel on a CPU machine.
# - transformers==5.19.0: speculators 0.9.0 requires transformers <= 5.19.0.
# - speculators==0.9.0 with --no-deps: it declares torchvision and torchaudio, which nothing on this path imports
#   (PyPI's torchvision does not import beside torch 2.13.0 on the machine this was written on). Of its other
#   dependencies only what the import and the load need: openai and datasets (speculators/__init__ reaches
#   speculators/train/data.py, which imports both), hs-connectors (imported the same way) and loguru (the verifier
#   loader, speculators/utils/loading.py). pydantic, typer, rich and the rest come with these and transformers.
# - the project with --no-deps: the check imports nothing of ours beyond torch, transformers and safetensors.
#
# Needs the package index; no model hub (the verifier is read from a local folder). PYTHON picks the interpreter the
# environment is made from (default python3; speculators needs 3.11 or newer).
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${SPECULATORS_VENV:-.venv-speculators}"
if [ ! -x "$venv/bin/python" ]; then
    start=$SECONDS
    "${PYTHON:-python3}" -m venv "$venv"
    pip=("$venv/bin/python" -m pip install -q)
    "${pip[@]}" --upgrade pip
    "${pip[@]}" "torch==2.13.0" "transformers==5.19.0"
    "${pip[@]}" --no-deps "speculators==0.9.0"
    "${pip[@]}" "openai>=2.0.0" "datasets>=4.0.0,<=5.1.0" "hs-connectors==0.9.0" "loguru>=0.7.2,<=0.7.3"
    "${pip[@]}" --no-deps -e .
    echo "made $venv in $((SECONDS - start)) s"
fi
"$venv/bin/python" scripts/speculators_check.py "$@"
