#!/usr/bin/env bash
# The separate draft model's benches (issue 21, docs/draft-model.md): the distilled draft (configs/smollm2-135m-draft.yaml)
# on a K = 2 chain, alone and beside a 4-token prompt-lookup chain, the undistilled layer-skip draft of the same shape
# (make-draft --layers 6) and an int8 quantized copy of the base (K = 3), on both frozen held-out sets, fp32, greedy,
# against HF generate and plain decoding in the same process. THREADS / LIMIT / TOKENS / PIN (a taskset core list)
# set the conditions; the JSONs and tables go to OUT_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH" HF_HUB_OFFLINE=1
BASE=${BASE:-models/smollm2-135m-instruct}
DISTILLED=${DISTILLED:-outputs/smollm2-draft-distilled/draft}
UNDISTILLED=${UNDISTILLED:-outputs/smollm2-draft-L6}
OUT_DIR=${OUT_DIR:-docs/results}
THREADS=${THREADS:-2} LIMIT=${LIMIT:-8} TOKENS=${TOKENS:-128}
RUN=(); [ -n "${PIN:-}" ] && RUN=(taskset -c "$PIN")
[ -f "$UNDISTILLED/config.json" ] || medusa make-draft --base "$BASE" --layers 6 --out "$UNDISTILLED"
bench() {  # NAME SET FLAGS...
    local name=$1 set=$2; shift 2
    "${RUN[@]}" medusa bench --base "$BASE" --prompts "benchmarks/prompts/$set.jsonl" --limit "$LIMIT" \
        --max-new-tokens "$TOKENS" --threads "$THREADS" --out "$OUT_DIR/bench-smollm2-$name-$set.json" "$@" \
        > "$OUT_DIR/bench-smollm2-$name-$set.txt" 2>&1
}
for SET in sharegpt-held-out mt-bench-style; do
    bench draft-distilled-k2 "$SET" --draft-model "$DISTILLED" --draft-tokens 2
    bench draft-distilled-k2-lookup4 "$SET" --draft-model "$DISTILLED" --draft-tokens 2 --lookup 4
    bench draft-undistilled-L6-k2 "$SET" --draft-model "$UNDISTILLED" --draft-tokens 2
    bench draft-int8-copy-k3 "$SET" --draft-model "$BASE" --draft-quantize int8 --draft-tokens 3
done
