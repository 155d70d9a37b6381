#!/bin/bash
# The prefix cache end to end on the CPU, through `hyla serve` and `hyla bench serve --dataset agent`:
# the tiny Kimi-Linear shape (random weights), a 256 MiB pool budget, 16 agent sessions x 6 turns
# (512-token tool outputs, 64-token greedy replies), all sessions at once; the cache on, then off.
# Prints each run's hit rate, TTFT (all and returning turns) and throughput, then how many
# greedy replies are equal between the two runs. About 6 minutes on two cores.
# CACHES="on" runs one side; SERVE_FLAGS adds server flags (e.g. SERVE_FLAGS="--admission-wait-ms 0");
# SESSIONS sets the number of agent sessions (default 16).
set -u
cd "$(dirname "$0")/.."
. scripts/wait_ready.sh
PY=${PY:-python3}; PORT=${PORT:-8012}; OUT=${OUT:-/tmp/hyla-prefix-cache}; mkdir -p "$OUT"
[ -f "$OUT/tiny/config.json" ] || $PY -m hyla.bench shape "$OUT/tiny" --random-config tiny >/dev/null || exit 1
for CACHE in ${CACHES:-on off}; do
  FLAG=""; [ $CACHE = off ] && FLAG="--no-enable-prefix-caching"
  OMP_NUM_THREADS=1 $PY -m hyla serve "$OUT/tiny" --load-format dummy --port $PORT --max-num-seqs 16 \
      --max-model-len 4096 --memory-budget 256MiB $FLAG ${SERVE_FLAGS:-} > "$OUT/serve-$CACHE.log" 2>&1 &
  SP=$!
  wait_ready $SP "$OUT/serve-$CACHE.log" $PORT || exit 1
  grep -E "pools:" "$OUT/serve-$CACHE.log" | cut -c1-200
  OMP_NUM_THREADS=1 $PY -m hyla.bench serve --port $PORT --tokenizer "$OUT/tiny" --disable-tqdm \
      --label agent-cache-$CACHE --dataset-name agent --num-sessions ${SESSIONS:-16} --turns 6 --tool-output-len 512 \
      --question-len 32 --output-len 64 --temperature 0 --ignore-eos --save-result --save-detailed \
      --result-dir "$OUT" --result-filename agent-$CACHE.json 2>&1 \
      | grep -E "Output token throughput|Mean TTFT|Failed|hit rate"
  echo "<- prefix cache $CACHE"
  kill $SP; wait $SP 2>/dev/null
done
[ "${CACHES:-on off}" = "on off" ] || exit 0
$PY - "$OUT" <<'PY'
import json, sys
on, off = (json.load(open(f"{sys.argv[1]}/agent-{c}.json"))["generated_texts"] for c in ("on", "off"))
print(f"greedy replies equal with the cache on and off: {sum(a == b for a, b in zip(on, off))} of {len(on)}")
PY
