"""The costliest functions of a sampling profile in collapsed-stack form (`py-spy record -f raw`:
one line per stack, frames joined by ';', then the sample count).

    python scripts/collapsed_top.py host.txt --within execute --top 30

--within keeps the stacks through a frame whose text contains it (e.g. the step's entry point) and
counts each function from there on. Prints each function's share of those samples: self (it was
the innermost frame) and inclusive (anywhere on the stack, once per stack).
"""
from __future__ import annotations

import argparse
import collections
import re


def frame_name(frame: str) -> str:
    """'fn (path/to/file.py:123)' -> 'fn (file.py)': a frame's line is where it was when sampled,
    which would split one function into many rows."""
    m = re.match(r"(.*) \((?:.*/)?([^/:]+)(?::\d+)?\)$", frame.strip())
    return f"{m.group(1)} ({m.group(2)})" if m else frame.strip()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("profile")
    p.add_argument("--within", default="", help="only stacks through a frame containing this text")
    p.add_argument("--top", type=int, default=30)
    args = p.parse_args()
    own: collections.Counter = collections.Counter()
    inclusive: collections.Counter = collections.Counter()
    total = 0
    with open(args.profile) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack or not count.isdigit():
                continue
            frames = stack.split(";")
            if args.within:
                at = next((i for i, fr in enumerate(frames) if args.within in fr), None)
                if at is None:
                    continue
                frames = frames[at:]
            n = int(count)
            total += n
            names = [frame_name(fr) for fr in frames]
            own[names[-1]] += n
            for name in set(names):
                inclusive[name] += n
    print(f"# {total} samples" + (f" through '{args.within}'" if args.within else ""))
    for title, counter in (("self", own), ("inclusive", inclusive)):
        print(f"| {title} % | function |\n|---|---|")
        for name, n in counter.most_common(args.top):
            print(f"| {100 * n / max(total, 1):.1f} | {name} |")


if __name__ == "__main__":
    main()
