#!/bin/bash
# A tree per kernel change waiting in docs/perf-log/pending/ (a patch each): .revs/NAME = HEAD's
# hyla/, tests/ and pyproject.toml with NAME.patch applied, beside the working tree for a same-
# machine A / B on the device (scripts/gpu_decode_revs.sh times every tree in .revs/;
# scripts/gpu_tree_tests.sh NAME runs a tree's tests). .revs/ is ignored by git: name it in the
# device run's carry. With arguments, only those patches (names without .patch).
set -euo pipefail
cd "$(dirname "$0")/.."
names=("$@")
shopt -s nullglob
[ ${#names[@]} -gt 0 ] || for p in docs/perf-log/pending/*.patch; do names+=("$(basename "$p" .patch)"); done
[ ${#names[@]} -gt 0 ] || { echo "no patch waits in docs/perf-log/pending/"; exit 0; }
for n in "${names[@]}"; do
  rm -rf ".revs/$n" && mkdir -p ".revs/$n"
  git archive HEAD -- hyla tests pyproject.toml ':!hyla/assets/default_model' ':!hyla/assets/mtp_model' | tar -x -C ".revs/$n"
  # patch(1), not git apply: git apply skips paths under an ignored directory of the repository
  (cd ".revs/$n" && patch -p1 -s --no-backup-if-mismatch < "../../docs/perf-log/pending/$n.patch")
  echo ".revs/$n: $(sed -n 's/^Subject: \[PATCH\] //p' "docs/perf-log/pending/$n.patch" | cut -c1-90)"
done
