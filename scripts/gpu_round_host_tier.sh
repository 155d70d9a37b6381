#!/bin/bash
# GPU round, host tier (the prefix cache's second tier): the 48B shape served with a small device
# budget for the pools (4 GiB: about 20 agent sessions' prefixes and checkpoints), then 128 agent
# sessions (about 5x what the device holds) of 6 turns, 16 in flight, greedy: once without the
# host tier and once with 64 GiB of it. Compare the hit rates, the mean TTFT of returning turns and
# the throughput (`hyla bench serve` prints them; the saved JSON has every request).
#   HOSTS: the host-tier sizes to run (default "0 64GiB")
#   TREE: a tree whose hyla/ serves instead of the working tree's (an A/B against .revs/NAME; read by
#         gpu_round_env.sh)
#   AGENT_FLAGS: more `hyla bench serve` flags for the trace (e.g. "--agent-range-ratio 0.5": turns of
#         varied lengths, so that sessions drift out of step as real ones do)
#   SERVE_FLAGS: more `hyla serve` flags
#   SWEEP=1: first sweep the bf16 fused-MoE table of this card for the 48B at the sizes of returning
#         turns' prefill steps (256-4,096 tokens; `hyla bench moe --sweep`), written in place so that
#         the servers use it, and brought back as $OUT/moe_tables.tar (on a card of >= 120 GB only:
#         an H100 serves the FP8 experts, whose table is another). The H200's shipped table held only
#         8,192 tokens: docs/perf-log/2026-12-07-host-tier-ttft-parts.md. Not with TREE (the sweep
#         writes the working tree's tables)
#   WARMUP=0: skip the warm-up server. By default a first server runs a short trace of other
#   sessions (another seed) unmeasured: a fresh machine's first server compiles Triton kernels
#   while it serves (90 s of its agent run on an H100: docs/perf-log/2026-12-06-h100-host-tier-
#   same-step.md), and the on-disk cache it fills serves the measured servers
. "$(dirname "$0")/gpu_round_env.sh"  # repo root, $OUT, wheels, PYTHONPATH
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m hyla.bench shape /tmp/k48 --random-config kimi-linear-48b-a3b >/dev/null || exit 1
TAG=$(basename "${TREE:-main}")
if [ "${SWEEP:-0}" = 1 ] && [ -z "$Q48" ]; then
  timeout 240 python3 -m hyla.bench moe --sweep --write-configs hyla/assets/kernel_configs/fused_moe \
      --shapes kimi-linear-48b-a3b --tokens ${SWEEP_TOKENS:-256 512 1024 2048 4096} --repeat 10 2>&1 \
      | grep -v "^# config" > $OUT/moe_sweep.log; grep -E "M=[0-9]+: sweep" $OUT/moe_sweep.log | sed 's/ sweep .* -> best/ best/'
  tar -cf $OUT/moe_tables.tar hyla/assets/kernel_configs/fused_moe/*.json
fi
serve() {  # serve() HOST LOG: the 48B server with a host tier of HOST bytes, ready on port 8000
  # a step log (hyla.engine.step_log) where the serving tree has one: a TREE from before it has no flag
  STEPS=""; [ -f "${TREE:-.}/hyla/engine/step_log.py" ] && STEPS="--step-log $OUT/steps-host-$1-$TAG.jsonl"
  python3 -m hyla serve /tmp/k48 --load-format dummy $Q48 --port 8000 \
      --max-num-seqs 16 --max-model-len 16384 --memory-budget 4GiB --host-cache-bytes $1 $STEPS $SERVE_FLAGS > $2 2>&1 &
  SP=$!
  wait_ready $SP $2 || exit 1
}
AGENT="--dataset-name agent --turns 6 --tool-output-len 1024 --question-len 32 --output-len 64 --max-concurrency 16 --temperature 0 --ignore-eos $AGENT_FLAGS"
if [ "${WARMUP:-1}" != 0 ]; then  # 16 other sessions (another seed), unmeasured
  serve 64GiB $OUT/serve-warmup.log
  timeout 200 python3 -m hyla.bench serve --port 8000 --tokenizer /tmp/k48 --disable-tqdm --seed 7 --num-sessions 16 \
      $AGENT 2>&1 | grep -E "Failed|Output token throughput" | tr '\n' ';'; echo " <- warm-up"
  kill $SP; wait $SP 2>/dev/null
fi
for HOST in ${HOSTS:-0 64GiB}; do
  serve $HOST $OUT/serve-host-$HOST-$TAG.log
  grep -E "pools:|host tier" $OUT/serve-host-$HOST-$TAG.log | cut -c1-300
  timeout 240 python3 -m hyla.bench serve --port 8000 --tokenizer /tmp/k48 --save-result --result-dir $OUT \
      --disable-tqdm --label agent-host-$HOST-$TAG --num-sessions 128 $AGENT --save-detailed 2>&1 \
      | grep -E "throughput|TTFT|Failed|hit|Engine step time|Model execute" | grep -v "Median\|P99 TTFT" | tr '\n' ';'; echo " <- host $HOST $TAG"
  curl -s localhost:8000/metrics | grep -E "^hyla_prefix_cache_(host|device|bytes|restore)" | tr '\n' ';'; echo
  kill $SP; wait $SP 2>/dev/null
  A=$(ls -t $OUT/agent-host-$HOST-$TAG-*.json 2>/dev/null | head -1)
  if [ -f $OUT/steps-host-$HOST-$TAG.jsonl ] && [ -n "$A" ]; then
    python3 scripts/step_log_summary.py $OUT/steps-host-$HOST-$TAG.jsonl --bench-result $A > $OUT/summary-host-$HOST-$TAG.txt
    grep "^prefill steps:" $OUT/summary-host-$HOST-$TAG.txt; tail -9 $OUT/summary-host-$HOST-$TAG.txt
  fi
done
