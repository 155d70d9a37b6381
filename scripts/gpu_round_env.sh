# Sourced by the scripts/gpu_round_*.sh: the repo root as the working directory, $OUT (what comes
# back from the device), the server's packages from the wheels in .whl/ where the device has no
# index, and PYTHONPATH for both.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-/tmp/hyla-out}; mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
