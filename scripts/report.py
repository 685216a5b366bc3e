"""Build the run report: the solve-rate plot, the replay of the latest eval, and report.html.

    python scripts/report.py RUN_DIR          e.g. python scripts/report.py runs/tiny

Reads only the run folder (config.yaml, metrics.jsonl, eval/*.json); safe to run during training.
Prints the path of the HTML report.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

# Run as a plain script from anywhere: make the repository root importable.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.observe.report import build_report  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/report.py", description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", help="the run folder: <output_dir>/<run_name>")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        path = build_report(args.run_dir)
    except FileNotFoundError as e:
        print(f"report: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
