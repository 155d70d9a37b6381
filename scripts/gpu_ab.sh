#!/bin/bash
# One command for the working tree and every tree in .revs/ (scripts/rev_trees.sh REV..., or a
# branch's hyla/ from `git archive BRANCH -- hyla`), ROUNDS rounds interleaved on one device: a
# same-machine A / B of any measurement, each run's output filtered by GREP (a regex; default all)
# and tagged with its tree. Host-bound timings vary between processes (BENCHMARKS "Prefill steps"):
# use 2+ rounds for them.
#
#   bash scripts/gpu_ab.sh 'python3 scripts/prefill_wall.py --layers 12 -q fp8 --lengths 8192 --rows 16 --context 3072'
#   GREP='^\| 8' bash scripts/gpu_ab.sh 'python3 -m hyla.bench moe --shapes kimi-linear-48b-a3b --fp8 --tokens 1 64 1160 8192'
#
# A tree's scripts/ and tests/ are the working tree's: only hyla/ differs (PYTHONPATH, with
# PYTHONSAFEPATH=1 so that `python3 -m ...` run from the repository root does not put the working
# tree's hyla/ first). Not for pytest: its rootdir goes first on sys.path whatever PYTHONPATH says;
# a branch's tests run from inside its tree (`git archive BRANCH -- hyla tests`, then `cd` there).
. "$(dirname "$0")/gpu_round_env.sh"  # repo root, $OUT, wheels, PYTHONPATH
[ $# -eq 1 ] || { echo "usage: bash scripts/gpu_ab.sh 'COMMAND'" >&2; exit 2; }
nvidia-smi --query-gpu=name --format=csv,noheader
for round in $(seq "${ROUNDS:-1}"); do
  for tree in . $(ls -d .revs/*/ 2>/dev/null); do
    name=$(basename "$(cd "$tree" && pwd)"); [ "$tree" = . ] && name="working-tree"
    echo "== round $round, $name"
    PYTHONSAFEPATH=1 PYTHONPATH=$(cd "$tree" && pwd):/tmp/site timeout "${TIMEOUT:-240}" bash -c "$1" 2>&1 \
      | tee "$OUT/ab-$name-$round.log" | grep -E "${GREP:-.}" | grep -v "Warn\|_warn"
  done
done
