#!/bin/bash
# The server's packages as wheels in .whl/ for the device machine, which has no package index
# (scripts/gpu_round_env.sh installs them there into /tmp/site). .whl/ is ignored by git: run
# this in a fresh checkout before a device round and name .whl in the run's carry.
#   DEVICE_PY: the device's Python (default 3.12)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${DEVICE_PY:-3.12}
mkdir -p .whl
# the packages the device image lacks (and typing_extensions, which this pydantic needs at >= 4.16);
# their other dependencies (anyio, h11, click) it has
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY" \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform any -d .whl \
  fastapi starlette pydantic pydantic_core annotated-types typing-inspection uvicorn annotated-doc typing_extensions
ls .whl
