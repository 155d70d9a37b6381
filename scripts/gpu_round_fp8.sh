#!/bin/bash
# GPU round, quantisation: the FP8 / MXFP4 kernel tests (with their times), the tiny FP8
# checkpoints on CUDA, the FP8 fused-MoE (where this card has none) and dense GEMM tables swept; then the Qwen3-Next-80B-A3B shape in FP8
# as Qwen's release lays it out (`qwen3-next-80b-a3b-fp8`: in_proj_ba and the shared-expert gate in bf16)
# (decode vs its floor, one request through the engine at 1K and 8K prompts), Kimi-Linear-48B-A3B
# online FP8 vs bf16 decode, and the 80B's 8-layer prefill in FP8 vs bf16. Full shapes need the
# H200's memory; on a smaller card they run cut.
# STAGE=tune runs the tests (TESTS=0 skips them), the sweeps and the 80B's 8-layer prefill (it
# uses the tables just written); STAGE=models the other model runs (each stage fits one device
# call; BF16=0 skips the 48B's bf16 decode row when another call of the same run has it); unset, both.
. "$(dirname "$0")/gpu_round_env.sh"  # repo root, $OUT, wheels, PYTHONPATH
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
T="timeout 200 python3 -m hyla.bench throughput"
if [ "${STAGE:-tune}" = tune ]; then
if [ "${TESTS:-1}" = 1 ]; then
echo "== kernel tests"
timeout 200 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_fp8_kernels.py tests/gpu/test_fp8_model.py \
  tests/gpu/test_triton_kernels.py -k "fp8 or mxfp4" --tb=line 2>&1 | grep -E "ms|rel err|greedy|passed|failed|Error|^/" | tee $OUT/fp8_kernels.log
fi
DEV=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr ' ' _)
if ls hyla/assets/kernel_configs/fused_moe/*device=${DEV},dtype=fp8_w8a8.json >/dev/null 2>&1 && [ -z "$SWEEP" ]; then
  echo "== FP8 fused-MoE tables for $DEV shipped (SWEEP=1 sweeps again)"
else
  echo "== FP8 fused-MoE sweep (tables written in place, used by the runs below)"
  timeout 240 python3 -m hyla.bench moe --fp8 --sweep --write-configs hyla/assets/kernel_configs/fused_moe \
    --tokens ${MOE_TOKENS:-1 16 64 256 1024 8192} --repeat ${REPEAT:-20} 2>&1 | grep -v "^# config" | tail -14 | tee $OUT/fp8_moe.log
fi
echo "== FP8 GEMM sweep (tables written in place, used by the runs below)"
timeout 300 python3 -m hyla.bench fp8-gemm --write-configs hyla/assets/kernel_configs/fp8_gemm ${GEMM_TOKENS:+--tokens $GEMM_TOKENS} --repeat ${REPEAT:-20} 2>&1 \
  | grep -v "^# config\|^# N=" | tail -80 | tee $OUT/fp8_gemm.log
# the tables come back in a tar: names with = and , do not come back as files
tar -cf $OUT/fp8_tables.tar hyla/assets/kernel_configs/fused_moe/*fp8_w8a8*.json hyla/assets/kernel_configs/fp8_gemm/*.json
echo "== 80B 8 layers, prefill 8192: FP8 then bf16"
for R in qwen3-next-80b-a3b-fp8 qwen3-next-80b-a3b; do
  $T --random-config $R --layers 8 --mode prefill --prefill-tokens 8192 2>&1 | tail -1
done | tee $OUT/fp8_prefill80.log
fi
[ "${STAGE:-models}" = models ] || exit 0
CUT=""; [ "$MEM" -lt 120000 ] && CUT="--layers 24"
echo "== 80B FP8 decode ${CUT:-(48 layers)}"
$T --random-config qwen3-next-80b-a3b-fp8 $CUT --mode decode --batch-sizes 1 64 --context-lens 1024 --steps 30 2>&1 | tail -4 | tee $OUT/fp8_decode80.log
echo "== 80B one request through the engine, 1K and 8K prompts"
[ "$MEM" -lt 120000 ] && CUT="--layers 16"  # the 24-layer cut's pools ran out of memory on an H100
python3 -m hyla.bench shape /tmp/q80 --random-config qwen3-next-80b-a3b-fp8 $CUT >/dev/null || exit 1
timeout 150 python3 scripts/long_context.py /tmp/q80 --lengths 1024 8192 --decode 128 2>&1 | grep -v Warn | tail -3 | tee $OUT/fp8_single80.log
echo "== 48B decode: online FP8 then bf16"
[ "$MEM" -lt 120000 ] && CUT="--layers 12"
QS=("-q fp8"); [ "${BF16:-1}" = 1 ] && QS+=("")
for Q in "${QS[@]}"; do
  $T --random-config kimi-linear-48b-a3b $CUT $Q --mode decode --batch-sizes 1 64 --context-lens 512 --steps 30 2>&1 | tail -2
done | tee $OUT/fp8_decode48.log
