#!/usr/bin/env bash
# The runs behind docs/eagle.md, in order (2 CPU cores; each line's wall time is in the page). Needs the reference
# install (scripts/install.sh --reference), the prepared model and the distilled answers:
#   medusa prepare-model --out models/smollm2-135m-instruct
#   medusa distill --base models/smollm2-135m-instruct --data sharegpt --out-dir data/distill-all \
#       --max-conversations 6000 --max-new-tokens 192 --max-prompt-tokens 384 --batch-size 32
# (spread over the whole dataset, one turn drawn from all of each conversation's turns; resumable; stopped after the
# validation and held-out splits and 768 training answers).
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH" HF_HUB_OFFLINE=1
BASE=models/smollm2-135m-instruct
VAL=data/distill-all/distilled_validation.jsonl
HELD=data/distill-all/distilled_held_out.jsonl
mkdir -p data/eagle
cat data/distill-all/distilled_validation.jsonl data/distill-all/distilled_held_out.jsonl > data/eagle/all-768.jsonl
head -n 768 data/distill-all/distilled_train.jsonl >> data/eagle/all-768.jsonl

# 1. The three drafters on one store (the eagle store; the heads read its first 576 columns), equal steps.
medusa train --config configs/smollm2-135m-eagle.yaml
medusa train --config configs/eagle-comparison/hydra.yaml
medusa train --config configs/eagle-comparison/medusa.yaml
# 2. Training-time test: 1 and 5 unrolled steps (3 is run 1).
medusa train --config configs/smollm2-135m-eagle.yaml --ttt-steps 1 --output-dir outputs/eagle-ttt1
medusa train --config configs/smollm2-135m-eagle.yaml --ttt-steps 5 --output-dir outputs/eagle-ttt5
# 3. Another layer set: a later low layer (7, 15, 27), read without a store (the base runs every step).
medusa train --config configs/smollm2-135m-eagle.yaml --eagle-layers 7,15,27 --hidden-state-store null \
    --output-dir outputs/eagle-layers-7-15-27
# 4. Undistilled ShareGPT text, teacher loss, at about the data's CPU time of run 1.
medusa train --config configs/eagle-comparison/eagle-sharegpt-text.yaml
# 5. Calibrate every drafter on the same validation answers, then compare (tau needs no idle machine).
for RUN in smollm2-135m-eagle hydra-768 medusa-768 eagle-ttt1 eagle-ttt5 eagle-layers-7-15-27 eagle-sharegpt-text; do
    medusa calibrate --base "$BASE" --heads "outputs/$RUN/heads" --data "$VAL"
done
python studies/drafter_compare.py --base "$BASE" --held-out "$HELD" --out docs/results/drafter-compare.json \
    --drafter eagle=outputs/smollm2-135m-eagle/heads --drafter hydra=outputs/hydra-768/heads \
    --drafter medusa=outputs/medusa-768/heads
# 6. Speed on an idle machine, both frozen sets, against HF generate and plain decoding in one process.
HEADS=outputs/smollm2-135m-eagle/heads OUT_DIR=docs/results NAME=smollm2-135m-eagle-per-step-fp32-cpu \
    bash scripts/benchmark.sh
# 7. Data scaling at equal steps: the first 192 and 384 of the 768 answers (768 is run 1).
for N in 192 384; do
    cat data/distill-all/distilled_validation.jsonl data/distill-all/distilled_held_out.jsonl > "data/eagle/all-$N.jsonl"
    head -n "$N" data/distill-all/distilled_train.jsonl >> "data/eagle/all-$N.jsonl"
    medusa train --config configs/smollm2-135m-eagle.yaml --data "data/eagle/all-$N.jsonl" \
        --hidden-state-store "outputs/stores/eagle-$N" --output-dir "outputs/eagle-data-$N"
done
