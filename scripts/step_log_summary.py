"""What a served run's engine steps cost, from `hyla serve --step-log PATH`: steps by kind, the
prefill steps' wall time by how many prompts and tokens they carried, the decode-only steps' by
batch size, and the share of the run each took.

    python scripts/step_log_summary.py steps.jsonl [--since-ms T]

--since-ms drops the steps that began before T ms (a warm-up the bench ran first).
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics


def _bucket(n: int, edges: tuple[int, ...]) -> str:
    for lo, hi in zip(edges, edges[1:]):
        if lo <= n < hi:
            return f"{lo}-{hi - 1}"
    return f">={edges[-1]}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log")
    ap.add_argument("--since-ms", type=float, default=0.0)
    args = ap.parse_args()
    with open(args.log, encoding="utf-8") as f:
        steps = [s for s in map(json.loads, f) if s["t_ms"] >= args.since_ms]
    if not steps:
        raise SystemExit("no steps in the log (after --since-ms)")
    span = steps[-1]["t_ms"] + steps[-1]["wall_ms"] - steps[0]["t_ms"]
    total = sum(s["wall_ms"] for s in steps)
    print(f"{len(steps)} steps over {span / 1e3:.2f} s, {total / span:.1%} of it inside steps")
    groups: dict[tuple, list[float]] = collections.defaultdict(list)
    for s in steps:
        if s["prefill"]:
            tokens = sum(n for _, n, _ in s["prefill"])
            key = ("prefill", f"prompts {_bucket(len(s['prefill']), (1, 2, 5, 17))}",
                   f"tokens {_bucket(tokens, (1, 257, 1025, 4097, 8193))}")
        else:
            key = (s["kind"], f"rows {_bucket(s['rows'], (1, 2, 9, 33, 129))}", "")
        groups[key].append(s["wall_ms"])
    print("| step | prompts / rows | tokens | count | mean ms | p90 ms | share of the run |")
    print("|---|---|---|---|---|---|---|")
    for key in sorted(groups, key=lambda k: -sum(groups[k])):
        walls = sorted(groups[key])
        p90 = walls[min(len(walls) - 1, int(0.9 * len(walls)))]
        print(f"| {key[0]} | {key[1]} | {key[2]} | {len(walls)} | {statistics.mean(walls):.1f} | {p90:.1f} | "
              f"{sum(walls) / span:.1%} |")


if __name__ == "__main__":
    main()
