#!/bin/bash
# A branch's tests on the device, run from inside its tree so that they import its code: pytest
# puts its rootdir first on sys.path whatever PYTHONPATH says, so tests run from the repository
# root always test the working tree. Make the tree with its tests:
#   mkdir -p .revs/NAME && git archive BRANCH -- hyla tests pyproject.toml ':!hyla/assets/mtp_model' | tar -x -C .revs/NAME
#   bash scripts/gpu_tree_tests.sh NAME tests/gpu/test_prefix_attention_cuda.py tests/ops/test_conv_prefill.py
. "$(dirname "$0")/gpu_round_env.sh"  # repo root, $OUT, wheels
[ $# -ge 2 ] || { echo "usage: bash scripts/gpu_tree_tests.sh NAME TEST..." >&2; exit 2; }
tree=.revs/$1; shift
[ -d "$tree/hyla" ] && [ -d "$tree/tests" ] || { echo "$tree needs hyla/ and tests/ (git archive BRANCH -- hyla tests pyproject.toml)" >&2; exit 2; }
cd "$tree" && PYTHONPATH=$PWD:/tmp/site python3 -c "import hyla, sys; print('testing', hyla.__file__)" \
  && PYTHONPATH=$PWD:/tmp/site python3 -m pytest -q -p no:cacheprovider --tb=short -rfE "$@"
