#!/bin/bash
# GPU round, checks: the GPU tests, then the MTP (k = 2) and 48B decode tables of BENCHMARKS.md.
. "$(dirname "$0")/gpu_round_env.sh"  # repo root, $OUT, wheels, PYTHONPATH
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
echo "rev $(git rev-parse --short HEAD 2>/dev/null || cat REV)"
# STAGE=tests: the GPU tests and the engine check; STAGE=perf: the MTP table, plain decode's host
# stages, a kernel profile of the 48B cut (prefill 8192, decode batch 1) and the 48B decode table;
# unset: both (over 600 s on some cards: split it)
if [ "${STAGE:-tests}" = tests ]; then
echo "== tests"
# in parallel every test whose engines take a 2 GiB pool (tests/conftest.py), then alone the ones
# that measure the whole device (marked real_gpu_memory)
GPU_TESTS="tests/gpu tests/engine/test_cuda_graph.py tests/engine/test_memory_profile.py \
  tests/engine/test_mtp_overlap.py tests/engine/test_mtp_fused.py tests/engine/test_mtp_graph.py tests/engine/test_mtp_chain.py \
  tests/engine/test_spec_device_accept.py tests/ops/test_fused_decode.py tests/layers/test_fused_layers.py \
  tests/engine/test_kv_cache_fp8.py tests/ops/test_kv_fp8.py tests/ops/test_fp8_gemm.py tests/engine/test_host_tier.py tests/engine/test_decode_overlap.py"
timeout 420 python3 -m pytest -q -n 8 -m "not real_gpu_memory" --tb=short -rfE -p no:cacheprovider -p no:benchmark $GPU_TESTS > $OUT/tests.log 2>&1
timeout 60 python3 -m pytest -q -p no:xdist -m real_gpu_memory --tb=short -rfE -p no:cacheprovider -p no:benchmark $GPU_TESTS > $OUT/tests_real_memory.log 2>&1
grep -hE "^(FAILED|ERROR) |passed|failed" $OUT/tests.log $OUT/tests_real_memory.log | cut -c1-200
echo "== engine check"
timeout 60 python3 scripts/gpu_engine_check.py 2>&1 | tail -8
fi
[ "${STAGE:-perf}" = perf ] || exit 0
echo "== MTP k=2"
timeout 150 python3 -m hyla.bench spec --model qwen3.5-mtp --device cuda --method ngram mtp --k 2 --rollback slots --max-tokens 128 --repeats 3 2>&1 | tail -25 | tee $OUT/mtp.log
echo "== plain decode's host stages (overlapped, sync) beside MTP k=2"
timeout 200 python3 scripts/profile_engine_host.py --k 2 --tokens 128 --sections --replay > $OUT/host_stages.log 2>&1
grep -E "^## .*(graphs at startup|launched|per replay)" $OUT/host_stages.log; tail -8 $OUT/host_stages.log
echo "== where a 48B step goes: 4-layer cut, prefill of 8192 and decode at batch 1 (kernels in order: k1.txt)"
timeout 150 python3 scripts/profile_step.py --layers 4 --prefill 8192 --decode-batch 1 --kernel-list $OUT/k1.txt \
  > $OUT/profile_step.log 2>&1; grep -A12 -E "^# (kimi|decode batch)" $OUT/profile_step.log | cut -c1-160
echo "== 48B decode"
[ "$MEM" -lt 120000 ] && { echo "skip: ${MEM} MiB"; exit 0; }
timeout 200 python3 -m hyla.bench throughput --random-config kimi-linear-48b-a3b --mode decode --batch-sizes 1 64 256 --context-lens 512 --steps 30 2>&1 | tail -25 | tee $OUT/decode48.log
