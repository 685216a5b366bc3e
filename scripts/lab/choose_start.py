"""Picks the SFT checkpoint that GRPO starts from (scripts/lab/learn.sh's sft stage), and prints the SFT table.

    python scripts/lab/choose_start.py WORK [--by rate|seeing] [--most 0.5]

Reads every WORK/sft_*/sft_log.jsonl (scripts/sft.py's logs, one record per evaluation with the held-out greedy
solve rate and the why_* turn classes of app.world.diagnosis). Only checkpoints whose solve rate is <= --most and whose
folder exists are candidates (issue #7: GRPO starts from a checkpoint that solves at most half the mazes).

--by rate: the highest solve rate. --by seeing: the highest `eval_why_first_try_open` (the share of move attempts
into an open cell), ties broken by solve rate. GRPO trains a LoRA on the language model only, and in the fourth
H200 attempt (docs/journal/) it cut repeated bumps but did not improve seeing (first_try_open 0.72 -> 0.61
in 24 steps) while continued full-model SFT took it to 0.91: so the start that sees best leaves GRPO the errors it
can fix. --seeing-at-least S keeps only checkpoints that see at least that well: in the sixth attempt every SFT
checkpoint from a model that saw (probe p 0.97) had first_try_open 0.91-0.99, and --by seeing picked one that solved
16%, where most GRPO groups had no solve to learn from; `--by rate --seeing-at-least 0.95` takes the best solver
among the ones that see.

Writes WORK/choice.env (START relative to WORK, OVERRIDES from the run's overrides.txt, SFT_STEP, SFT_ELAPSED_S,
START_RATE, START_SEEING), which the grpo stage reads. Exits 1 when no checkpoint qualifies.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def evaluations(log: Path) -> list[dict]:
    return [e for e in map(json.loads, log.read_text().splitlines()) if "eval_solve_rate" in e]


def choose(work: Path, by: str = "rate", most: float = 0.5, seeing_at_least: float = 0.0) -> tuple[Path, dict] | None:
    """(checkpoint folder, its evaluation record) of the best candidate, or None."""

    def score(e: dict) -> tuple:
        rate = e["eval_solve_rate"]
        return (e.get("eval_why_first_try_open", 0.0), rate) if by == "seeing" else (rate,)

    best = None
    for log in sorted(work.glob("sft_*/sft_log.jsonl")):
        for e in evaluations(log):
            folder = log.parent / f"step_{e['sft_step']}"
            sees = e.get("eval_why_first_try_open", 0.0) >= seeing_at_least
            if (
                e["eval_solve_rate"] <= most
                and sees
                and folder.is_dir()
                and (best is None or score(e) > score(best[1]))
            ):
                best = (folder, e)
    return best


def table(work: Path) -> str:
    lines = ["=== SFT: held-out greedy solve rate / first_try_open (seeing) by step (64 mazes) ==="]
    for log in sorted(work.glob("sft_*/sft_log.jsonl")):
        lines.append(
            log.parent.name
            + " "
            + " ".join(
                f"{e['sft_step']}:{e['eval_solve_rate']:.2f}/{e.get('eval_why_first_try_open', 0):.2f}"
                for e in evaluations(log)
            )
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("work", type=Path)
    ap.add_argument("--by", choices=("rate", "seeing"), default="rate")
    ap.add_argument("--most", type=float, default=0.5, help="the highest solve rate a start may have")
    ap.add_argument(
        "--seeing-at-least",
        type=float,
        default=0.0,
        help="only checkpoints whose first_try_open is at least this (then --by rate: the best of those)",
    )
    args = ap.parse_args(argv)
    print(table(args.work))
    best = choose(args.work, args.by, args.most, args.seeing_at_least)
    if best is None:
        print(
            f"no checkpoint with a solve rate <= {args.most} and first_try_open >= {args.seeing_at_least} to start "
            "GRPO from",
            file=sys.stderr,
        )
        return 1
    folder, e = best
    overrides_file = folder.parent / "overrides.txt"
    overrides = overrides_file.read_text().strip() if overrides_file.exists() else ""
    seeing = e.get("eval_why_first_try_open", 0.0)
    (args.work / "choice.env").write_text(
        f'START="{folder.relative_to(args.work)}"\nOVERRIDES="{overrides}"\nSFT_STEP={e["sft_step"]}\n'
        f"SFT_ELAPSED_S={e['elapsed_s']}\nSTART_RATE={e['eval_solve_rate']}\nSTART_SEEING={seeing}\n"
    )
    print(
        f"chosen by {args.by}: {folder} (held-out solve rate {e['eval_solve_rate']:.3f}, first_try_open "
        f"{seeing:.2f}, after {e['sft_step']} steps, {e['elapsed_s']:.0f} s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
