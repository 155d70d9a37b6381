#!/bin/bash
# GPU round, the first call on a fresh machine when device time is short (one call, under 600 s):
# the FP8 accuracy tests (the tiny released-layout checkpoints on CUDA against the CPU's W8A8
# definition, and the GEMM kernel against its reference), then the rows the open issues miss on
# this card: on an H200 the whole 48B shape in bf16 (decode at batch 1 / 64 / 256 against its
# memory floor, one 8,192-token prefill against its compute floor) and the whole 80B shape in FP8,
# laid out as Qwen's release (`qwen3-next-80b-a3b-fp8`): decode at batch 1 / 64 against its floor,
# one request's tokens/s through the engine; on a smaller card the 48B
# shape's first 12 layers in FP8 (decode at batch 1 / 64) and where the 80B shape's 4-layer cut's
# batch-1 FP8 decode step goes (kernels in launch order: $OUT/k1fp8.txt).
. "$(dirname "$0")/gpu_round_env.sh"  # repo root, $OUT, wheels, PYTHONPATH
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
echo "rev $(git rev-parse --short HEAD 2>/dev/null || cat REV)"
echo "== FP8 accuracy"
timeout 120 python3 -m pytest -q -n 4 -p no:cacheprovider -p no:benchmark tests/gpu/test_fp8_model.py \
  tests/ops/test_fp8_gemm.py -k "checkpoint_on_cuda or gemm_kernel_matches" -rfE --tb=line > $OUT/fp8tests.log 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" $OUT/fp8tests.log | cut -c1-200
if [ "$MEM" -ge 120000 ]; then
  echo "== 48B bf16: decode (context 512) and one 8,192-token prefill"
  timeout 260 python3 -m hyla.bench throughput --random-config kimi-linear-48b-a3b --mode decode prefill \
    --batch-sizes 1 64 256 --context-lens 512 --steps 30 --prefill-tokens 8192 --prefill-chunk 8192 \
    > $OUT/h200_48b.log 2>&1; grep -v Warn $OUT/h200_48b.log | tail -14
  echo "== 80B FP8, all 48 layers: decode (context 1024), then one request through the engine (1K prompt)"
  timeout 150 python3 -m hyla.bench throughput --random-config qwen3-next-80b-a3b-fp8 --mode decode \
    --batch-sizes 1 64 --context-lens 1024 --steps 30 > $OUT/h200_80b_fp8.log 2>&1; grep -v Warn $OUT/h200_80b_fp8.log | tail -3
  python3 -m hyla.bench shape /tmp/q80 --random-config qwen3-next-80b-a3b-fp8 >/dev/null && timeout 150 python3 \
    scripts/long_context.py /tmp/q80 --lengths 1024 --decode 128 2>&1 | grep -v Warn | tail -3
else
  echo "== 48B, 12 layers, FP8: decode (context 512)"
  timeout 130 python3 -m hyla.bench throughput --random-config kimi-linear-48b-a3b --layers 12 -q fp8 --mode decode \
    --batch-sizes 1 64 --context-lens 512 --steps 30 > $OUT/fp8_12l.log 2>&1; grep -v Warn $OUT/fp8_12l.log | tail -8
  echo "== where a 4-layer 80B FP8 cut's batch-1 decode step goes (3 GDN layers, 1 attention)"
  timeout 110 python3 scripts/profile_step.py --random-config qwen3-next-80b-a3b-fp8 --layers 4 --prefill 1024 --decode-batch 1 \
    --kernel-list $OUT/k1fp8.txt > $OUT/profile_fp8.log 2>&1; grep -A16 -E "^# (qwen|kimi|decode batch)" $OUT/profile_fp8.log | cut -c1-160
fi
