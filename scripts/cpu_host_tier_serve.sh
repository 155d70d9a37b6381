#!/bin/bash
# The host tier end to end on the CPU, through `hyla serve` and `hyla bench serve --dataset agent`:
# the tiny Kimi-Linear shape (random weights) under a 6 MiB pool budget (16 state slots, 1032 KV
# pages: 8 sessions' checkpoints beside 8 running requests), 48 agent sessions x 4 turns, served
# with the host tier off and at 256 MiB. Prints each run's hit rate, TTFT of returning turns and
# throughput, and the tier counters of /metrics. About 3 minutes on two cores. AGENT_FLAGS: more
# `hyla bench serve` flags (e.g. "--agent-range-ratio 0.5").
set -u
cd "$(dirname "$0")/.."
. scripts/wait_ready.sh
PY=${PY:-python3}; PORT=${PORT:-8011}; OUT=${OUT:-/tmp/hyla-host-tier}; mkdir -p "$OUT"
[ -f "$OUT/tiny/config.json" ] || $PY -m hyla.bench shape "$OUT/tiny" --random-config tiny >/dev/null || exit 1
for HOST in 0 256MiB; do
  OMP_NUM_THREADS=1 $PY -m hyla serve "$OUT/tiny" --load-format dummy --port $PORT --max-num-seqs 8 \
      --max-model-len 4096 --memory-budget 6MiB --host-cache-bytes $HOST > "$OUT/serve-$HOST.log" 2>&1 &
  SP=$!
  wait_ready $SP "$OUT/serve-$HOST.log" $PORT || exit 1
  grep -E "pools:|host tier" "$OUT/serve-$HOST.log" | cut -c1-200
  OMP_NUM_THREADS=1 $PY -m hyla.bench serve --port $PORT --tokenizer "$OUT/tiny" --disable-tqdm \
      --label agent-host-$HOST --dataset-name agent --num-sessions 48 --turns 4 --tool-output-len 192 \
      --question-len 32 --output-len 32 --max-concurrency 8 --temperature 0 --ignore-eos ${AGENT_FLAGS:-} 2>&1 \
      | grep -E "Output token throughput|Mean TTFT|Failed|hit rate"
  echo "<- host tier $HOST; /metrics:"
  curl -s localhost:$PORT/metrics | grep -E "^hyla_prefix_cache_(host|device)_hit|^hyla_prefix_cache_bytes" | tr '\n' ' '; echo
  kill $SP; wait $SP 2>/dev/null
done
