# Sourced by the scripts/gpu_round_*.sh: the repo root as the working directory, $OUT (what comes
# back from the device), the server's packages from the wheels in .whl/ where the device has no
# index, and PYTHONPATH for both.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-/tmp/hyla-out}; mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
# TREE: serve / measure that tree's hyla/ instead of the working tree's (e.g. .revs/NAME).
# PYTHONSAFEPATH=1: `python3 -m hyla ...` run from the repository root would otherwise import the
# working tree's hyla/ ahead of PYTHONPATH. (pytest still puts its rootdir first: a tree's tests
# run from inside the tree.)
export PYTHONPATH=$(realpath "${TREE:-$PWD}"):/tmp/site PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1
# The 48B shape's bf16 weights (91.5 GiB) need a card of >= 120 GB; on a smaller one (an H100) the
# rounds serve it with block-FP8 weights (about 48 GB) and say so.
MEM=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
Q48=""; [ "${MEM:-0}" -lt 120000 ] && Q48="--quantization fp8"
echo "card memory ${MEM:-?} MiB; 48B weights: ${Q48:-bf16}"
. "$(dirname "${BASH_SOURCE[0]}")/wait_ready.sh"  # wait_ready PID LOG [PORT]
