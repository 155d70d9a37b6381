#!/bin/bash
# GPU round, long contexts. STAGE=steps: MLA decode splits at long contexts, then the 48B decode
# step at 4K and 128K context, batch 1 and 16 (random caches: the step alone, issue's "128K <= 1.2x
# 4K"). STAGE=prompts: 48B long prompts end to end (131072 on all 27 layers; 1048576 on the first 4
# layers: 3 KDA + 1 MLA). Unset: both (over 600 s: split it).
. "$(dirname "$0")/gpu_round_env.sh"  # repo root, $OUT, wheels, PYTHONPATH
nvidia-smi --query-gpu=name --format=csv,noheader
if [ "${STAGE:-steps}" = steps ]; then
echo "== MLA splits"
timeout 100 python3 scripts/mla_splits.py 2>&1 | tail -12
echo "== 48B decode step vs context (random caches)"
CUT=""; [ "$MEM" -lt 120000 ] && CUT="--layers 12"
timeout 240 python3 -m hyla.bench throughput --random-config kimi-linear-48b-a3b $CUT --mode decode \
  --batch-sizes 1 16 --context-lens 4096 131072 --steps 30 2>&1 | tail -7 | tee $OUT/decode_long48.log
fi
[ "${STAGE:-prompts}" = prompts ] || exit 0
echo "== long context, 27 layers"
python3 -m hyla.bench shape /tmp/k48 --random-config kimi-linear-48b-a3b >/dev/null || exit 1
timeout 240 python3 scripts/long_context.py /tmp/k48 --lengths 4096 131072 --decode 32 $Q48 2>&1 | grep -v Warn | tail -5
echo "== long context, 4 layers"
python3 -m hyla.bench shape /tmp/k48c --random-config kimi-linear-48b-a3b --layers 4 >/dev/null || exit 1
timeout 200 python3 scripts/long_context.py /tmp/k48c --lengths 4096 131072 1048576 --decode 32 2>&1 | grep -v Warn | tail -6
