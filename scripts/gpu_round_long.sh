#!/bin/bash
# GPU round, long contexts: MLA decode splits at long contexts; 48B long prompts end to end
# (131072 on all 27 layers; 1048576 on the first 4 layers: 3 KDA + 1 MLA).
. "$(dirname "$0")/gpu_round_env.sh"  # repo root, $OUT, wheels, PYTHONPATH
nvidia-smi --query-gpu=name --format=csv,noheader
echo "== MLA splits"
timeout 100 python3 scripts/mla_splits.py 2>&1 | tail -12
echo "== long context, 27 layers"
python3 -m hyla.bench shape /tmp/k48 --random-config kimi-linear-48b-a3b >/dev/null || exit 1
timeout 240 python3 scripts/long_context.py /tmp/k48 --lengths 4096 131072 --decode 32 $Q48 2>&1 | grep -v Warn | tail -5
echo "== long context, 4 layers"
python3 -m hyla.bench shape /tmp/k48c --random-config kimi-linear-48b-a3b --layers 4 >/dev/null || exit 1
timeout 200 python3 scripts/long_context.py /tmp/k48c --lengths 4096 131072 1048576 --decode 32 2>&1 | grep -v Warn | tail -5
