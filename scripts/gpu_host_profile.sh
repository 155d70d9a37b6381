#!/bin/bash
# The host's share of one prefill step in steady state: scripts/prefill_wall.py runs the step (its
# table first: warm-up, compiles, timings), then loops it; py-spy attaches only once the loop runs,
# so the profile holds no first calls. Prints the costliest functions within ModelRunner.execute.
#   ARGS: prefill_wall.py's step (default: one returning turn of 549 tokens after 3,072 cached)
#   SECONDS_: how long to sample (default 6)
. "$(dirname "$0")/gpu_round_env.sh"  # repo root, $OUT, wheels (py-spy at /tmp/site/bin), PYTHONPATH
ARGS=${ARGS:---layers 12 -q fp8 --lengths 549 --rows 1 --context 3072}
python3 scripts/prefill_wall.py $ARGS --loop $(( ${SECONDS_:-6} + 30 )) > $OUT/host-step.log 2>&1 &
PID=$!
for _ in $(seq 300); do grep -q '^| *[0-9]' $OUT/host-step.log && break; sleep 1; done
grep '^| *[0-9]' $OUT/host-step.log
sleep 2  # the loop has begun
/tmp/site/bin/py-spy record --pid $PID --duration ${SECONDS_:-6} -r 400 -f raw -o $OUT/host-step.txt >/dev/null 2>&1
kill $PID 2>/dev/null; wait $PID 2>/dev/null
python3 scripts/collapsed_top.py $OUT/host-step.txt --within "execute (" --top ${TOP:-30}
