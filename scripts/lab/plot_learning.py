"""The learning run's curve (docs/RESULTS.md): held-out greedy solve rate against wall time, GRPO vs continued SFT.

    python scripts/lab/plot_learning.py GRPO_METRICS.jsonl SFT_CONTROL.jsonl OUT.png [--sft NAME=SFT_LOG.jsonl ...]
        [--fair FAIR_CONTROL.jsonl] [--machine "one H100"]

GRPO_METRICS is app.main's metrics log (a resumed run repeats steps after its checkpoint: the last record of a
step wins); its time axis is the sum of the kept steps' time_step_s. SFT_CONTROL is scripts/sft.py's log of the
continued-SFT control, one or more rounds appended (sft_step restarts at each round; elapsed_s adds up).
--sft adds the warm-start SFT runs that led to the GRPO start, on the same axes shifted left of zero; --start-step
cuts the last of them at the checkpoint GRPO started from (choice.env's SFT_STEP), so that zero is that checkpoint.
--earlier adds an earlier run from the same checkpoint (a GRPO metrics log or an SFT control log), drawn faintly.
--fair adds the fair control (learn.sh CONTROL_TRAINS=same: SFT of GRPO's own trainable set) beside the full-model one.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def grpo_curve(path: Path) -> list[tuple[float, float]]:
    steps: dict[int, dict] = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        # a resumed run's record replaces the one its restart lost; a recovery's own record (recoveries, no
        # readings) under the step it goes back to leaves that step's readings standing
        steps[record["step"]] = {**steps.get(record["step"], {}), **record}
    clock, curve = 0.0, []
    for step in sorted(steps):
        clock += steps[step].get("time_step_s", 0.0)
        if "eval_solve_rate" in steps[step]:
            curve.append((clock, steps[step]["eval_solve_rate"]))
    return curve


def sft_curve(path: Path, until_step: int | None = None) -> list[tuple[float, float]]:
    """(seconds, solve rate) per evaluation; with until_step, none past that step (a warm start's log is one round)."""
    offset, last_elapsed, last_step, curve = 0.0, 0.0, 0, []
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if record["sft_step"] <= last_step:  # a new round continues the clock
            offset += last_elapsed
        last_step, last_elapsed = record["sft_step"], record["elapsed_s"]
        if until_step is not None and record["sft_step"] > until_step:
            continue
        if "eval_solve_rate" in record:
            curve.append((offset + record["elapsed_s"], record["eval_solve_rate"]))
    return curve


def any_curve(path: Path) -> tuple[str, list[tuple[float, float]]]:
    """("GRPO" or "SFT", its curve): an earlier run's log, told apart by its first record."""
    first = json.loads(path.read_text().splitlines()[0])
    return ("SFT", sft_curve(path)) if "sft_step" in first else ("GRPO", grpo_curve(path))


def main(argv: list[str] | None = None) -> int:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import PercentFormatter

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("grpo", type=Path)
    ap.add_argument("control", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--sft", action="append", default=[], help="NAME=PATH of a warm-start SFT log, before zero")
    ap.add_argument(
        "--start-step",
        type=int,
        help="the GRPO start's step in the last --sft log: its curve ends there, "
        "at zero (by default it ends with the log)",
    )
    ap.add_argument(
        "--earlier",
        action="append",
        default=[],
        help="NAME=PATH of an earlier run from the same checkpoint (GRPO metrics or SFT log), drawn faintly",
    )
    ap.add_argument(
        "--grpo-label", default="GRPO (LoRA r32, 16 mazes x 8 samples a step)", help="the GRPO curve's name"
    )
    ap.add_argument("--fair", type=Path, help="the fair control's SFT log (the GRPO run's trainable set)")
    ap.add_argument("--machine", default="one H200", help="the GPU the runs shared, for the time axis")
    ap.add_argument("--target", type=float, default=0.95, help="the target line (share of solvable mazes)")
    args = ap.parse_args(argv)
    fig = Figure(figsize=(9, 4.8))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    grpo, control = grpo_curve(args.grpo), sft_curve(args.control)
    fair = sft_curve(args.fair) if args.fair else []
    ax.plot(*zip(*grpo), "o-", label=args.grpo_label)
    trains = ", every weight" if args.fair else ""
    ax.plot(*zip(*control), ".-", alpha=0.7, label=f"control: the same checkpoint's SFT continued{trains}")
    if fair:
        ax.plot(*zip(*fair), "s-", ms=3, alpha=0.8, label="fair control: SFT of GRPO's trainable set")
    for spec in args.earlier:
        name, path = spec.split("=", 1)
        kind, curve = any_curve(Path(path))
        ax.plot(*zip(*curve), "x--" if kind == "GRPO" else ",--", alpha=0.45, label=f"earlier {kind}: {name}")
    shift = 0.0
    for i, spec in enumerate(reversed(args.sft)):
        name, path = spec.split("=", 1)
        curve = sft_curve(Path(path), args.start_step if i == 0 else None)
        shift += curve[-1][0]
        ax.plot([t - shift for t, _ in curve], [r for _, r in curve], ":", label=f"warm-start SFT: {name}")
    ax.axhline(args.target, color="grey", lw=0.8, ls="--", label=f"target {args.target:.0%} of solvable")
    ax.axvline(0, color="black", lw=0.6)
    ax.set_xlabel(f"wall seconds from the GRPO start checkpoint (training + evaluation, {args.machine})")
    ax.set_ylabel("held-out greedy solve rate (64 mazes)")
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.set_ylim(0, 1)
    ax.legend(loc="best", fontsize=8)  # clear of the curves: runs near the target fill the top
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"GRPO {[(round(t), r) for t, r in grpo]}\ncontrol {[(round(t), r) for t, r in control]}")
    if fair:
        print(f"fair control {[(round(t), r) for t, r in fair]}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
