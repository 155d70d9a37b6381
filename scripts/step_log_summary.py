"""What a served run's engine steps cost, from `hyla serve --step-log PATH`: steps by kind, the
prefill steps' wall time by how many prompts and tokens they carried (and a line through it: a
fixed part plus a cost per prompt token), the decode-only steps' by batch size, and the share of
the run each took.

    python scripts/step_log_summary.py steps.jsonl [--since-ms T] [--bench-result RESULT.json]

--since-ms drops the steps that began before T ms (a warm-up the bench ran first).
--bench-result (a `hyla bench serve --save-result --save-detailed` file of a run against the same
server) takes each request's time to first token apart, joined on the server's request id: the
span of the steps that computed its prompt (from the first one's start to the last one's end,
how many steps, how many of them carried other prompts too) and the rest of its TTFT. When the
bench ran on the server's machine (the result's clock_origin_s and the log's origin line on one
clock) the rest is split further: sent -> submitted to the engine (HTTP, the chat template,
tokenising), submitted -> its first step began (waiting for the steps in flight), and its last
step's end -> the first token at the client (delivery, detokenising, the stream).
"""

from __future__ import annotations

import argparse
import collections
import json
import signal
import statistics


def _bucket(n: int, edges: tuple[int, ...]) -> str:
    for lo, hi in zip(edges, edges[1:]):
        if lo <= n < hi:
            return f"{lo}-{hi - 1}"
    return f">={edges[-1]}"


def main() -> None:
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `| head` ends the table quietly, not with a traceback
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log")
    ap.add_argument("--since-ms", type=float, default=0.0)
    ap.add_argument("--bench-result", default=None, help="a saved detailed `hyla bench serve` result")
    args = ap.parse_args()
    with open(args.log, encoding="utf-8") as f:
        lines = [line for line in map(json.loads, f) if line.get("t_ms", 0.0) >= args.since_ms or not _is_step(line)]
    steps = [line for line in lines if _is_step(line)]
    if not steps:
        raise SystemExit("no steps in the log (after --since-ms)")
    span = steps[-1]["t_ms"] + steps[-1]["wall_ms"] - steps[0]["t_ms"]
    total = sum(s["wall_ms"] for s in steps)
    print(f"{len(steps)} steps over {span / 1e3:.2f} s, {total / span:.1%} of it inside steps")
    groups: dict[tuple, list[float]] = collections.defaultdict(list)
    for s in steps:
        if s["prefill"]:
            tokens = _prefill_tokens(s)
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
    fit = prefill_cost(steps)
    if fit is not None:
        print(f"prefill steps: {fit[0]:.1f} ms + {fit[1] * 1e3:.1f} us per prefill token (least squares over "
              f"{fit[2]} steps)")
    if args.bench_result:
        print(ttft_parts(lines, args.bench_result))


def prefill_cost(steps: list[dict]) -> tuple[float, float, int] | None:
    """The least-squares line through the steps that carried prompt tokens: (fixed ms, ms per
    prefill token, steps), or None without two distinct token counts."""
    points = [(_prefill_tokens(s), s["wall_ms"]) for s in steps if s["prefill"]]
    if len({n for n, _ in points}) < 2:
        return None
    slope, fixed = statistics.linear_regression([n for n, _ in points], [w for _, w in points])
    return fixed, slope, len(points)


def _prefill_tokens(step: dict) -> int:
    return sum(n for _, n, _ in step["prefill"])


def _response_id(engine_id: str) -> str:
    """The response id an engine request id answers: the server adds "@" and a suffix to a
    client's own id (hyla.server.prepare.request_ids)."""
    return engine_id.rpartition("@")[0] or engine_id


def _is_step(line: dict) -> bool:
    return line["kind"] not in ("origin", "arrival")


def ttft_parts(lines: list[dict], result_path: str) -> str:
    """Mean TTFT of the bench's requests found in the log (its lines), and its parts (see the
    docstring), by turn."""
    with open(result_path, encoding="utf-8") as f:
        result = json.load(f)
    ids = result.get("response_ids")
    if not ids:
        raise SystemExit(f"{result_path}: no response_ids (save it with --save-detailed)")
    prefill_steps: dict[str, list[dict]] = collections.defaultdict(list)
    for s in lines:
        for rid, _, _ in s.get("prefill", ()):
            prefill_steps[_response_id(rid)].append(s)
    submitted = {_response_id(line["request"]): line["t_ms"] for line in lines if line["kind"] == "arrival"}
    origins = [line["perf_counter_s"] for line in lines if line["kind"] == "origin"]
    # the bench's start times on the log's clock (ms), when both were kept on one clock
    shift = ((result["clock_origin_s"] - origins[0]) * 1e3
             if origins and result.get("clock_origin_s") is not None else None)
    rows: dict[int, list[tuple]] = collections.defaultdict(list)
    for k, (rid, ttft, turn) in enumerate(zip(ids, result["ttfts"], result.get("turns") or [0] * len(ids))):
        own = prefill_steps.get(rid)
        if not own or not ttft:
            continue
        began, ended = own[0]["t_ms"], own[-1]["t_ms"] + own[-1]["wall_ms"]
        shared = sum(1 for s in own if len(s["prefill"]) > 1)
        row = [ttft * 1e3, ended - began, len(own), shared]
        if shift is not None and rid in submitted:
            sent = shift + result["start_times"][k] * 1e3
            row += [submitted[rid] - sent, began - submitted[rid], sent + ttft * 1e3 - ended]
        rows[turn].append(tuple(row))
    if not rows:
        raise SystemExit("no request of the result appears in the log (another server, or --since-ms)")
    split = all(len(x) == 7 for r in rows.values() for x in r)
    rest = ("to the engine ms | waiting ms | to the client ms" if split else "waiting and the rest ms")
    out = [f"| turn | requests | mean TTFT ms | its prefill steps' span ms | {rest} | prefill steps | of them shared |",
           "|---|---|---|---|---|---|---|" + ("---|---|" if split else "")]
    for turn in sorted(rows):
        r = rows[turn]
        mean = [statistics.mean(x[i] for x in r) for i in range(7 if split else 4)]
        parts = (f"{mean[4]:.1f} | {mean[5]:.1f} | {mean[6]:.1f}" if split else f"{mean[0] - mean[1]:.1f}")
        out.append(f"| {turn} | {len(r)} | {mean[0]:.1f} | {mean[1]:.1f} | {parts} | {mean[2]:.2f} | {mean[3]:.2f} |")
    return "\n".join(out)


if __name__ == "__main__":
    main()
