#!/usr/bin/env bash
# The MoE throughput benchmark on one H200, in one command (at most ~9 minutes of wall time):
#
#     bash scripts/bench_moe_gpu.sh            # from the repo root; logs to $OUT (default /tmp/bench_moe)
#
# 1. installs flash-linear-attention from the git-ignored .whl/ (no network on the GPU machine);
# 2. Kimi-Linear-48B-A3B cut to its first 4 layers (3 KDA + 1 MLA, layer 1 dense, 3 MoE) vs
#    transformers + fla on the same weights: decode at batch 1 16 64 256, context 512; then one MoE
#    block at 64 and 256 tokens and a prefill of 8192 tokens;
# 3. the full 27-layer 48B shape, hyla alone (transformers would need a second copy of the weights):
#    decode at batch 1 16 64 256, contexts 512 and 4096, and a prefill of 8192 tokens;
# 4. Qwen3-Next-80B-A3B cut to 8 layers (6 GDN + 2 attention; the full 80B, ~160 GB in bf16, does not
#    fit one H200) vs transformers: decode, then one MoE block and a prefill of 8192 tokens.
#
# Every piece is its own python process under its own timeout, so one failing piece does not stop
# the others; all output goes to $OUT/bench.log (and $OUT/<piece>.log), the tables again at the end.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/bench_moe}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/bench.log") 2>&1
export PYTHONUNBUFFERED=1
export TRITON_CACHE_AUTOTUNING=1  # later pieces reuse the autotuning of earlier ones (where triton supports it)
T0=$(date +%s)
DEADLINE=$((T0 + ${BENCH_BUDGET_S:-530}))

echo "=== install .whl/ ($(ls .whl 2>/dev/null | tr '\n' ' '))"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.max.sm --format=csv,noheader || true
python3 - <<'EOF' || true
import torch, transformers, triton
try:
    import fla
    import fla.ops.gated_delta_rule  # noqa: F401
    import fla.ops.kda  # noqa: F401
    fla_v = fla.__version__
except Exception as err:  # noqa: BLE001
    fla_v = f"NOT IMPORTABLE: {type(err).__name__}: {err}"
print(f"torch {torch.__version__}, triton {triton.__version__}, transformers {transformers.__version__}, "
      f"fla {fla_v}, {torch.cuda.get_device_name()}")
EOF

PIECES=()
piece() {  # piece NAME TIMEOUT_S ARGS... : one `python -m hyla.bench throughput` run
    local name=$1 limit=$2
    shift 2
    local left=$((DEADLINE - $(date +%s)))
    if ((left < 25)); then
        echo "=== $name: skipped (${left}s of the budget left)"
        return
    fi
    ((limit > left)) && limit=$left
    PIECES+=("$name")
    echo
    echo "=== $name (timeout ${limit}s): python -m hyla.bench throughput $*"
    local t=$(date +%s)
    timeout -k 10 "$limit" python3 -m hyla.bench throughput "$@" 2>&1 | tee "$OUT/$name.log"
    echo "=== $name: exit ${PIPESTATUS[0]} after $(($(date +%s) - t))s"
}

KIMI=(--random-config kimi-linear-48b-a3b)
QWEN=(--random-config qwen3-next-80b-a3b)
piece kimi4-decode 140 "${KIMI[@]}" --layers 4 --vs transformers --batch-sizes 1 16 64 256 --context-lens 512
piece kimi4-moe-prefill 80 "${KIMI[@]}" --layers 4 --vs transformers --moe-layer --moe-tokens 64 256 \
    --prefill-tokens 8192 --batch-sizes 1 --context-lens 16
piece kimi48b-full 150 "${KIMI[@]}" --mode decode --batch-sizes 1 16 64 256 --context-lens 512 4096 --steps 30 \
    --prefill-tokens 8192
piece qwen8-decode 100 "${QWEN[@]}" --layers 8 --vs transformers --batch-sizes 1 16 64 256 --context-lens 512
piece qwen8-moe-prefill 60 "${QWEN[@]}" --layers 8 --vs transformers --moe-layer --moe-tokens 64 256 \
    --prefill-tokens 8192 --batch-sizes 1 --context-lens 16

echo
echo "=================== tables ($(($(date +%s) - T0))s in all) ==================="
for name in "${PIECES[@]}"; do
    echo "--- $name"
    grep -E '^# (model|vs|MoE block|[0-9.]+ B params)|^ *(batch|tokens) |^ +[0-9]+ ' "$OUT/$name.log" ||
        echo "(no table)"
done
