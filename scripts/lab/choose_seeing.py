"""Picks the see stage's model among variants run side by side (scripts/lab/learn.sh, SEE_VARIANTS).

    python scripts/lab/choose_seeing.py --passed P OUT/see_NAME.jsonl   exit 0 when the variant's last p_exact > P
    python scripts/lab/choose_seeing.py WORK OUT/see_*.jsonl            print the best variant's NAME

Each variant logs one record per evaluation (scripts/lab/perception_probe.py) to OUT/see_NAME.jsonl and saves its model
to WORK/seeing_NAME when it stops. The model saved is the one at the log's last record, so that record is the
variant's score; only variants whose folder holds a model are candidates (a variant stopped because another passed
first has none). Exits 1 when there is no candidate.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def last_p_exact(log: Path) -> float | None:
    """The held-out p_exact of the log's last evaluation, or None when it has none yet."""
    records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()] if log.is_file() else []
    return records[-1]["p_exact"] if records else None


def variant_name(log: Path) -> str:
    return log.stem.removeprefix("see_")


def best_variant(work: Path, logs: list[Path]) -> str | None:
    scored = [
        (p, variant_name(log))
        for log in logs
        if (p := last_p_exact(log)) is not None and (work / f"seeing_{variant_name(log)}" / "config.json").is_file()
    ]
    return max(scored)[1] if scored else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("paths", type=Path, nargs="+", help="WORK then the variants' logs, or with --passed one log")
    ap.add_argument("--passed", type=float, help="only say (by the exit code) whether this log's last p_exact > P")
    args = ap.parse_args(argv)
    if args.passed is not None:
        p = last_p_exact(args.paths[0])
        return 0 if p is not None and p > args.passed else 1
    work, logs = args.paths[0], args.paths[1:]
    for log in logs:
        print(f"{variant_name(log)}: last p_exact {last_p_exact(log)}", file=sys.stderr)
    best = best_variant(work, logs)
    if best is None:
        print(f"no see variant saved a model under {work}", file=sys.stderr)
        return 1
    print(best)
    return 0


if __name__ == "__main__":
    sys.exit(main())
