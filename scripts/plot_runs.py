"""Several runs' held-out solve rate on one plot, against the minutes since each run's first record.

    python scripts/plot_runs.py OUT.png RUN_DIR [RUN_DIR ...] [--label-key train.seed] [--title TEXT]

Each RUN_DIR is a run folder (metrics.jsonl, config.yaml). The warm start's validation checks are drawn faintly
(training mazes set aside), the held-out evaluations as lines with a marker; the solvable bound is dashed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a plain script from anywhere

from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from app.observe.run_files import read_config, setting  # noqa: E402


def curves(run_dir: Path) -> tuple[list, list, float | None]:
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    t0 = records[0]["time"] - records[0].get("sft_step_s", 0.0)
    held_out = [((r["time"] - t0) / 60, r["eval_solve_rate"]) for r in records if "eval_solve_rate" in r]
    warm = [
        ((r["time"] - t0) / 60, r["sft_validation_solve_rate"]) for r in records if "sft_validation_solve_rate" in r
    ]
    bound = next((r["eval_solvable_bound"] for r in reversed(records) if "eval_solvable_bound" in r), None)
    return held_out, warm, bound


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--label-key", default="train.seed", help="the config value that names each run")
    ap.add_argument("--title", default="held-out greedy solve rate")
    args = ap.parse_args(argv)
    fig = Figure(figsize=(8, 4.5), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    bound = None
    section, key = args.label_key.split(".", 1)
    for i, run in enumerate(map(Path, args.runs)):
        held_out, warm, bound = curves(run)
        label = f"{key} {setting(read_config(run), section, key)}"
        color = f"C{i}"
        if warm:
            ax.plot(*zip(*warm), color=color, alpha=0.3, linestyle=":", marker=".")
        ax.plot(*zip(*held_out), color=color, marker="o", label=label)
    if bound is not None:
        ax.axhline(bound, color="grey", linestyle="--", linewidth=1, label=f"solvable bound {100 * bound:.1f}%")
    ax.set_xlabel("minutes since the run's first record (dotted: the warm start's validation checks)")
    ax.set_ylabel("solve rate")
    ax.set_ylim(0, 1.02)
    ax.set_title(args.title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(args.out)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
