"""Where a sampled process spent its time: py-spy's collapsed stacks (`--format raw`) as two short tables.

    python scripts/bench/profile_summary.py profile_RolloutActor.txt [--top 25] [--under play_episodes]

Inclusive share: the samples whose stack passes through a function at least once (recursion counted once).
Self share: the samples whose innermost frame is that function. `--under NAME` keeps only the stacks that pass
through a function whose name contains NAME, and gives shares of those (e.g. the rollout alone, not the
actor's idle loop). py-spy's own flamegraph needs a browser; this prints what a note in docs/BENCHMARKS.md needs.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

_LINE = re.compile(r"^(?P<stack>.*)\s(?P<count>\d+)$")
_FRAME = re.compile(r"^(?P<name>.*?) \((?P<file>[^():]*)(?::\d+)?\)$")


def frame_key(frame: str) -> str:
    """`function (path/to/module.py:123)` -> `function (module.py)`: lines of one function count together."""
    m = _FRAME.match(frame.strip())
    if not m:
        return frame.strip()
    return f"{m['name']} ({Path(m['file']).name})"


def read_stacks(text: str) -> list[tuple[list[str], int]]:
    """(frames outermost first, samples) per line; lines that are not `stack count` are skipped."""
    stacks = []
    for line in text.splitlines():
        m = _LINE.match(line.rstrip())
        if m and m["stack"]:
            stacks.append(([frame_key(f) for f in m["stack"].split(";") if f], int(m["count"])))
    return stacks


def summarize(stacks: list[tuple[list[str], int]], under: str | None = None) -> dict:
    """Total samples and Counters of inclusive and self samples by function."""
    if under:
        stacks = [(frames, n) for frames, n in stacks if any(under in f for f in frames)]
    inclusive, own = Counter(), Counter()
    for frames, n in stacks:
        for f in set(frames):
            inclusive[f] += n
        if frames:
            own[frames[-1]] += n
    return {"samples": sum(n for _, n in stacks), "inclusive": inclusive, "self": own}


def table(counter: Counter, total: int, top: int) -> str:
    return "\n".join(f"{100 * n / max(total, 1):6.1f}%  {name}" for name, n in counter.most_common(top))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("profile", help="py-spy record --format raw output")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--under", help="only stacks through a function whose name contains this")
    args = ap.parse_args()
    s = summarize(read_stacks(Path(args.profile).read_text()), args.under)
    print(f"{s['samples']} samples{' under ' + args.under if args.under else ''}\n\ninclusive:")
    print(table(s["inclusive"], s["samples"], args.top))
    print("\nself:")
    print(table(s["self"], s["samples"], args.top))


if __name__ == "__main__":
    main()
