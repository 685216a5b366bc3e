"""The page a person reads when a run ends: what it learned, where the time went, where its files are, what next.

Made from the run folder alone (metrics.jsonl, the eval and export folders), printed by the driver at the end and
kept as <run dir>/summary.txt.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

from app.observe.metrics import format_duration, read_log
from app.observe.run_files import metrics_by_step

PHASES = ("rollout", "train", "sync", "eval", "checkpoint")


def _pct(value) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def where_the_time_went(records: list[dict], started_at: float, ended_at: float) -> list[tuple[str, float]]:
    """(part, seconds): start-up (Ray, actors, engines, the model), the warm start, each step phase, the rest."""
    total = ended_at - started_at
    sft = [r for r in records if "sft_step" in r]
    parts: list[tuple[str, float]] = []
    first = min((r["time"] for r in records), default=ended_at)
    if sft:
        warm_begin = sft[0]["time"] - sft[0].get("sft_step_s", 0.0)
        parts.append(("start-up: Ray, the actors, the engines, the model", warm_begin - started_at))
        parts.append(("warm start (SFT and its validation)", sft[-1]["time"] - warm_begin))
    else:
        parts.append(("start-up: Ray, the actors, the engines, the model", first - started_at))
    steps = [r for r in records if "time_step_s" in r]
    for phase in PHASES:
        parts.append((f"steps: {phase}", sum(r.get(f"time_{phase}_s", 0.0) for r in steps)))
    evals_at_start = [r for r in records if r.get("step") == 0 and "eval_solve_rate" in r and "sft_step" not in r]
    if evals_at_start and sft:
        parts.append(("evaluation before the first step", evals_at_start[0]["time"] - sft[-1]["time"]))
    parts.append(("the rest (reports, shutdown)", total - sum(s for _, s in parts)))
    return [(name, max(0.0, s)) for name, s in parts]


def build_summary(
    run_dir: str | Path,
    started_at: float,
    ended_at: float,
    config: str,
    overrides: list[str],
    model_path: str,
    ray_address: str | None = None,
) -> str:
    run_dir = Path(run_dir)
    records = read_log(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").exists() else []
    evals = [r for r in records if "eval_solve_rate" in r and "sft_step" not in r]
    first, last = (evals[0], evals[-1]) if evals else ({}, {})
    steps = sorted({s for s, m in metrics_by_step(run_dir).items() if "train_loss" in m})
    lines = [
        f"mazerl run '{run_dir.name}' finished: {len(steps)} GRPO steps in {format_duration(ended_at - started_at)}"
    ]
    if evals:
        before, after = first.get("eval_solve_rate"), last.get("eval_solve_rate")
        gain = "" if before is None or after is None else f" ({100 * (after - before):+.1f} points)"
        lines += [
            "",
            f"held-out solve rate (greedy, {int(last.get('eval_num_mazes', 0))} mazes never trained on):",
            f"  before GRPO (step {first['step']}): {_pct(before)}",
            f"  after GRPO (step {last['step']}):  {_pct(after)}{gain}",
            f"  the bound (mazes solvable within the turn budget): {_pct(last.get('eval_solvable_bound'))}",
        ]
    lines += ["", "where the time went:"]
    total = max(ended_at - started_at, 1e-9)
    for name, seconds in where_the_time_went(records, started_at, ended_at):
        if seconds >= 0.5:
            lines.append(f"  {name:<52} {format_duration(seconds):>12}  {100 * seconds / total:4.0f}%")
    exports = sorted((run_dir / "export").glob("global_step_*")) if (run_dir / "export").is_dir() else []
    replays = sorted((run_dir / "eval").glob("replay_step_*.gif")) if (run_dir / "eval").is_dir() else []
    files = [
        ("report", run_dir / "report.html"),
        ("solve-rate plot", run_dir / "eval" / "solve_rate.png"),
        ("latest replay", replays[-1] if replays else None),
        ("exported adapter", exports[-1] if exports else None),
        ("checkpoints", run_dir / "checkpoints"),
        ("metrics, every step", run_dir / "metrics.jsonl"),
    ]
    lines += ["", "files:"]
    lines += [f"  {what:<20} {path}" for what, path in files if path is not None and path.exists()]
    rerun = " ".join(shlex.quote(x) for x in [config, *overrides])
    # the interpreter running this job by its full path: the commands work from any shell, venv active or not,
    # and a Ray job on this machine runs them with this environment's packages
    python = shlex.quote(sys.executable)
    ray = Path(sys.executable).with_name("ray")
    ray = shlex.quote(str(ray)) if ray.exists() else "ray"
    adapter = exports[-1].name if exports else "base"
    serve = ["  serve the adapter and play held-out mazes through it (two shells):"]
    if exports and _whole_model(exports[-1]):  # every weight trained: a whole model, served as the model
        merged = shlex.quote(str(run_dir / f"model_{adapter}"))
        serve = [
            "  merge the exported policy (every weight trained) into a model folder, serve it as the model and play",
            "  held-out mazes through it (two shells):",
            f"    {python} scripts/merge_adapter.py {shlex.quote(str(exports[-1]))} {merged}",
        ]
        model_path, adapter = merged, "base"
    serve_cmd = f"    {python} -m app.serve --model {shlex.quote(model_path)}"
    if adapter != "base":
        serve_cmd += f" --adapters {shlex.quote(str(run_dir / 'export'))}"
    lines += [
        "",
        "next:",
        *serve,
        serve_cmd,
        f"    {python} scripts/play.py --model {adapter} --config {shlex.quote(str(run_dir / 'config.yaml'))}",
        "  the same job on a Ray cluster (ray start --head there, or see docs/OPERATING.md for KubeRay):",
        f"    {ray} job submit --address {ray_address or 'http://HEAD:8265'} --working-dir . -- "
        f"{python} -m app.main {rerun}",
        "  go on training from the newest checkpoint (more steps):",
        f"    {python} -m app.main {rerun} train.max_steps={max(steps, default=0) * 2 or 20}",
    ]
    return "\n".join(lines)


def _whole_model(export: Path) -> bool:
    """Whether an exported folder carries the language model's every weight (lora.modules_to_save [language_model])."""
    try:
        config = json.loads((export / "adapter_config.json").read_text())
    except (OSError, ValueError):
        return False
    return "language_model" in (config.get("modules_to_save") or [])


def write_summary(run_dir: str | Path, text: str) -> Path:
    path = Path(run_dir) / "summary.txt"
    path.write_text(text + "\n")
    return path
