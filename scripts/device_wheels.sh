#!/bin/bash
# The server's packages as wheels in .whl/ for the device machine, which has no package index
# (scripts/gpu_round_env.sh installs them there into /tmp/site). .whl/ is ignored by git: run
# this in a fresh checkout before a device round and name .whl in the run's carry.
#   DEVICE_PY: the device's Python (default 3.12)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${DEVICE_PY:-3.12}
mkdir -p .whl
# the server's packages with every dependency resolved for the device's Python (a new release may
# add one: fastapi 0.165 needs opentelemetry-api, which a --no-deps list missed)
python3 -m pip download -q --only-binary=:all: --python-version "$PY" \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform any -d .whl \
  fastapi uvicorn pydantic
# the ones the device image already holds (/work/.library/device/KINDS.md) stay its own: httpx and
# httpcore there were built against those versions (typing_extensions comes along: pydantic needs
# a newer one than the image's)
rm -f .whl/anyio-*.whl .whl/click-*.whl .whl/h11-*.whl .whl/idna-*.whl
ls .whl
