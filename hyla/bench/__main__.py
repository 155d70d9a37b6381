"""`python -m hyla.bench SUBCOMMAND [args]` (same as `hyla bench SUBCOMMAND`)."""

import importlib
import sys

# Each benchmark lives in its own module with a `main(argv)`; imported only when asked for.
SUBCOMMANDS = {
    "ops": "hyla.bench.ops",
    "kernels": "hyla.bench.kernels",
    "throughput": "hyla.bench.throughput",
    "prefix-cache": "hyla.bench.prefix_cache",
    "spec": "hyla.bench.spec",
    "moe": "hyla.bench.moe",
    "fp8-gemm": "hyla.bench.fp8_gemm",
    "serve": "hyla.bench.serve",
    "shape": "hyla.bench.shape",
}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in SUBCOMMANDS:
        names = ", ".join(SUBCOMMANDS)
        raise SystemExit(f"usage: hyla bench {{{names}}} [args]")
    module = importlib.import_module(SUBCOMMANDS[argv[0]])
    module.main(argv[1:])


if __name__ == "__main__":
    main()
