#!/bin/bash
# GPU round, the H200-only rows of the engine-at-scale issue in one call: the whole 48B shape in
# bf16 (91.5 GiB of weights) decoding at batch 1 / 64 / 256 against its memory floor and
# prefilling 8,192 tokens against its compute floor (one process), the MoE block at 8,192 tokens
# (Triton against grouped_mm), then where a 4-layer cut's prefill and batch-1 decode spend time.
. "$(dirname "$0")/gpu_round_env.sh"  # repo root, $OUT, wheels, PYTHONPATH
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
[ "$MEM" -lt 120000 ] && { echo "skip: ${MEM} MiB, the 48B bf16 weights need an H200"; exit 0; }
echo "== 48B bf16: decode (context 512) and one 8,192-token prefill"
timeout 300 python3 -m hyla.bench throughput --random-config kimi-linear-48b-a3b --mode decode prefill \
  --batch-sizes 1 64 256 --context-lens 512 --steps 30 --prefill-tokens 8192 --prefill-chunk 8192 \
  > $OUT/h200_48b.log 2>&1; grep -v Warn $OUT/h200_48b.log | tail -14
echo "== MoE block, 8,192 tokens"
timeout 90 python3 -m hyla.bench moe --tokens 1 8192 --repeat 10 2>&1 | tail -6 | tee $OUT/moe8192.log
echo "== where a 4-layer cut's 8,192-token prefill and batch-1 decode go"
timeout 150 python3 scripts/profile_step.py --layers 4 --prefill 8192 --decode-batch 1 --kernel-list $OUT/k1.txt \
  > $OUT/profile_step.log 2>&1; grep -A14 -E "^# (kimi|decode batch)" $OUT/profile_step.log | cut -c1-160
