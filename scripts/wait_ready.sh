# Sourced by the scripts that start `hyla serve` and then measure it.
# wait_ready PID LOG [PORT]: until the server of process PID answers /health on PORT (default
# 8000); when the process ends first (a failed import, out of memory) or 300 s pass, print LOG's
# tail and fail at once rather than running the bench against nothing.
wait_ready() {
  local port=${3:-8000}
  for _ in $(seq 1 150); do
    curl -sf "localhost:$port/health" >/dev/null && return 0
    kill -0 "$1" 2>/dev/null || { echo "server exited:"; tail -5 "$2"; return 1; }
    sleep 2
  done
  echo "server not ready after 300 s:"; tail -5 "$2"; kill "$1"; return 1
}
