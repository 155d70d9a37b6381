#!/bin/bash
# A released shape's decode step (CONFIG, default kimi-linear-48b-a3b) for the working tree and
# each tree in .revs/ (scripts/rev_trees.sh, or a branch's hyla/, tests/ and scripts/ from `git
# archive`), interleaved over ROUNDS rounds on one device: which decode lever moves the step, and
# by how much against the run-to-run spread.
# Each run: `hyla bench throughput --random-config CONFIG --layers LAYERS --mode decode
# --batch-sizes 1 64 --context-lens 512 --steps 50` (CUDA-graph replays; QUANT="-q fp8" for block
# FP8). A tree's ENV file (KEY=VALUE lines) is exported for its runs (a branch's knob for its A/B).
# Prints one line per tree and round: graph ms at batch 1 and 64, then eager ms at batch 1 and 64.
. "$(dirname "$0")/gpu_round_env.sh"  # repo root, $OUT, wheels, PYTHONPATH
nvidia-smi --query-gpu=name --format=csv,noheader
T="python3 -m hyla.bench throughput --random-config ${CONFIG:-kimi-linear-48b-a3b} --layers ${LAYERS:-4} --mode decode
   --batch-sizes 1 64 --context-lens 512 --steps 50 ${QUANT:-}"
echo "== ${CONFIG:-kimi-linear-48b-a3b} decode, ${LAYERS:-4} layers ${QUANT:-bf16}: graph ms b1 b64, eager ms b1 b64"
for round in $(seq "${ROUNDS:-2}"); do
  for tree in . $(ls -d .revs/*/ 2>/dev/null); do
    name=$(basename "$(cd "$tree" && pwd)"); [ "$tree" = . ] && name="working tree"
    row=$(cd "$tree" && { [ -f ENV ] && set -a && . ./ENV && set +a; PYTHONPATH=$PWD:/tmp/site timeout 150 $T 2>&1; } \
          | tee "$OUT/decode-$name-$round.log" | awk '$2 == 512 {g = g $3 " "; e = e $4 " "} END {print g "| " e}')
    echo "round $round  $name: $row"
  done
done
