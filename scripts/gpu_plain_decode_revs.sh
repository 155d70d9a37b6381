#!/bin/bash
# Plain decoding of the bundled MTP model (the MTP table's baseline) at each revision in .revs/
# (scripts/rev_trees.sh) and at the working tree, one after another on the same device: where the
# plain decode rate changed. Prints each revision's "off" rows of `hyla bench spec` (tok/s, decode
# tok/s per request alone and for the batch of three). DEVICE=cpu TOKENS=8: a check of the script.
. "$(dirname "$0")/gpu_round_env.sh"  # repo root, $OUT, wheels, PYTHONPATH
ROOT=$PWD
for tree in $(ls -d .revs/*/ 2>/dev/null) .; do
  rev=$(basename "$(cd "$tree" && pwd)"); [ "$tree" = . ] && rev="working tree"
  for m in default_model mtp_model; do
    [ -e "$tree/hyla/assets/$m" ] || ln -s "$ROOT/hyla/assets/$m" "$tree/hyla/assets/$m"
  done
  echo "== $rev"
  (cd "$tree" && PYTHONPATH=$PWD:/tmp/site timeout 120 python3 -m hyla.bench spec --model qwen3.5-mtp --device ${DEVICE:-cuda} \
      --method ngram --k 1 --rollback slots --max-tokens ${TOKENS:-128} 2>&1 | grep -E " off |Error|error" | cut -c1-160)
done
