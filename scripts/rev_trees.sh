#!/bin/bash
# Earlier revisions of the hyla package beside the working tree, for a same-machine A / B on the
# device: `bash scripts/rev_trees.sh REV...` writes .revs/REV/hyla (the bundled models left out:
# scripts/gpu_plain_decode_revs.sh links the working tree's, unchanged since these revisions).
# .revs/ is ignored by git: name it in the device run's carry (about 1.4 MB a revision).
set -euo pipefail
cd "$(dirname "$0")/.."
for rev in "$@"; do
  short=$(git rev-parse --short "$rev")
  rm -rf ".revs/$short" && mkdir -p ".revs/$short"
  git archive "$short" -- hyla ':!hyla/assets/default_model' ':!hyla/assets/mtp_model' | tar -x -C ".revs/$short"
  echo ".revs/$short: $(git log -1 --format=%s "$short" | cut -c1-80)"
done
