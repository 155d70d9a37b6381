#!/bin/bash
# GPU round, the bf16 fused-MoE tables of this card at every size a server meets: the tables shipped
# for an H200 hold only 8,192 tokens, so decode steps and the ~1K-token prefill steps of returning
# agent turns run the built-in heuristic there. Sweeps both released shapes (`hyla bench moe
# --sweep --write-configs`, tables written in place and brought back in a tar: names with = and ,
# do not come back as files), then times through the new tables, in the same call: the 48B's decode
# at batch 1 / 64 and its prefill of 1,024 and 8,192 tokens (bf16 on a card of >= 120 GB, else its
# first 12 layers in FP8, whose MoE tables are the FP8 ones: then only the sweep is new).
#   TOKENS: the sweep's token counts (default "1 16 64 256 1024 2048 4096 8192")
#   SHAPES: the shapes swept (default both: kimi-linear-48b-a3b qwen3-next-80b-a3b)
#   BASELINE=1: time the 48B through the shipped tables first, in the same call (the A/B on one card)
. "$(dirname "$0")/gpu_round_env.sh"  # repo root, $OUT, wheels, PYTHONPATH
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
echo "rev $(git rev-parse --short HEAD 2>/dev/null || cat REV)"
CUT="--layers 12 -q fp8"; [ "$MEM" -ge 120000 ] && CUT=""
time48() {  # time48 LOG: the 48B's decode at batch 1 / 64 and prefill of 1,024 and 8,192 tokens
  timeout 200 python3 -m hyla.bench throughput --random-config kimi-linear-48b-a3b $CUT --mode decode prefill \
    --batch-sizes 1 64 --context-lens 512 --steps 30 --prefill-tokens 1024 8192 --prefill-chunk 8192 \
    > $1 2>&1; grep -v Warn $1 | tail -9
}
if [ "${BASELINE:-0}" = 1 ]; then
  echo "== 48B ${CUT:-bf16, 27 layers} through the shipped tables"; time48 $OUT/tables_48b_shipped.log
fi
echo "== bf16 fused-MoE sweep"
timeout 330 python3 -m hyla.bench moe --sweep --write-configs hyla/assets/kernel_configs/fused_moe ${SHAPES:+--shapes $SHAPES} \
  --tokens ${TOKENS:-1 16 64 256 1024 2048 4096 8192} --repeat ${REPEAT:-20} 2>&1 | grep -v "^# config" | tail -20 | tee $OUT/moe_sweep.log
tar -cf $OUT/moe_tables.tar hyla/assets/kernel_configs/fused_moe/*.json
echo "== 48B ${CUT:-bf16, 27 layers} through the new tables: decode, then prefill of 1,024 and 8,192 tokens"
time48 $OUT/tables_48b.log
