#!/bin/bash
# GPU round, prefill graphs (hyla.engine.prefill_graphs): their CUDA tests, then one prefill step's
# wall and kernel time eager against the spans replayed as graphs, the 48B shape's first 12 layers
# (block FP8 on a card under 120 GB, else bf16): fresh prompts, and returning turns after 3,072
# cached tokens, one and 16 prompts a step.
. "$(dirname "$0")/gpu_round_env.sh"  # repo root, $OUT, wheels, PYTHONPATH
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
echo "== tests"
timeout 240 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_prefill_graphs_cuda.py \
  tests/models/test_prefill_program.py tests/engine/test_prefill_graphs.py --tb=short 2>&1 \
  | grep -E "rel err|passed|failed|Error|^FAILED|^E " | head -30 | tee $OUT/pw_tests.log
Q=""; [ "$MEM" -lt 120000 ] && Q="-q fp8"
echo "== 12 layers ${Q:-bf16}: eager vs graphed spans"
timeout 300 python3 scripts/prefill_wall.py --layers 12 $Q --lengths 256 1024 2048 --prefill-graphs off on 2>&1 \
  | grep -E "^\||^#" | tee $OUT/pw_fresh.log
timeout 240 python3 scripts/prefill_wall.py --layers 12 $Q --lengths 549 2048 --rows 1 4 --context 3072 \
  --prefill-graphs off on 2>&1 | grep -E "^\||^#" | tee $OUT/pw_context.log
