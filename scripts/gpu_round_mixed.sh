#!/bin/bash
# GPU round, where a served prefill's TTFT goes: a 1,024-token prompt's step alone and with 8 / 24
# running requests' decode rows mixed in (eager and with prefill graphs, the costliest kernels),
# then the agent trace with turns spread by a 500 ms mean tool latency, cache on and off.
. "$(dirname "$0")/gpu_round_env.sh"  # repo root, $OUT, wheels, PYTHONPATH
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
Q=""; [ "$MEM" -lt 120000 ] && Q="-q fp8"
echo "== 12 layers ${Q:-bf16}: a prompt's step with decode rows"
timeout 200 python3 scripts/prefill_wall.py --layers 12 $Q --lengths 1024 --decode-rows 0 8 24 --decode-context 1280 \
  --prefill-graphs off on --top 10 2>&1 | grep -E "^\||^#" | tee $OUT/mixed.log | grep -E "^\|"
echo "== agent, tool latency 500 ms (exponential), cache on / off"
AGENT_FLAGS="--tool-latency-ms 500 --tool-latency-dist exponential" PART=cached CACHED=agent WARMUP=0 \
  SERVE_FLAGS="--max-num-seqs 64" timeout 380 bash scripts/gpu_round_serve.sh 2>&1 | grep -E "<- agent|turn|^\| [0-9]" | head -24
