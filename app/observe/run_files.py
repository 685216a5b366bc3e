"""Reading a run folder: its config, its metrics log and its evaluations, as the report and replays need them.

<run dir>/config.yaml                  the validated config (maze.size, maze.cell_px, rollout.max_turns)
<run dir>/metrics.jsonl                one object per recorded step (app/observe/metrics.py)
<run dir>/eval/eval_step_NNNNNN.json   the evaluator's summary + per-maze seed, actions and outcome
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import yaml

from app.config import Config

log = logging.getLogger("mazerl.report")


EVAL_PATTERN = re.compile(r"eval_step_(\d+)\.json$")


def read_config(run_dir: str | Path) -> dict:
    """config.yaml as a plain dict ({} when it is missing or unreadable)."""

    path = Path(run_dir) / "config.yaml"
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        log.warning("cannot read %s: %s", path, e)
        return {}
    return data if isinstance(data, dict) else {}


def setting(cfg: dict, section: str, key: str, fallback=None):
    """cfg[section][key], else `fallback`, else the default of app.config."""
    value = cfg[section].get(key) if isinstance(cfg.get(section), dict) else None
    if value is not None:
        return value
    if fallback is not None:
        return fallback

    return getattr(getattr(Config(), section), key)


def metrics_by_step(run_dir: str | Path) -> dict[int, dict]:
    """{step: metrics}, merged in log order; a full step record seen again (a step re-run after a
    recovery) replaces the earlier one, partial records (SFT, eval at start, recovery marks) add keys."""
    path = Path(run_dir) / "metrics.jsonl"
    steps: dict[int, dict] = {}
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return steps
    for line in lines:
        try:
            entry = json.loads(line)
            step = int(entry["step"])
        except (ValueError, KeyError, TypeError):
            continue  # a torn last line while the driver writes, or a foreign line
        if not isinstance(entry, dict):
            continue
        current = steps.get(step)
        if current is None or ("time_step_s" in entry and "time_step_s" in current):
            steps[step] = dict(entry)
        else:
            current.update(entry)
    return dict(sorted(steps.items()))


def eval_files(run_dir: str | Path) -> dict[int, Path]:
    """{step: eval JSON path}, by step."""
    folder = Path(run_dir) / "eval"
    found = {}
    if folder.is_dir():
        for path in folder.iterdir():
            match = EVAL_PATTERN.search(path.name)
            if match:
                found[int(match.group(1))] = path
    return dict(sorted(found.items()))


def read_eval(path: Path) -> dict:
    return json.loads(path.read_text())


def eval_history(run_dir: str | Path, metrics: dict[int, dict] | None = None) -> list[dict]:
    """One summary per eval step: from the eval JSONs (written first, by the evaluator), completed by
    the eval_* metrics the driver logged (which survive where the JSONs were not kept)."""
    metrics = metrics_by_step(run_dir) if metrics is None else metrics
    rows: dict[int, dict] = {}
    for step, entry in metrics.items():
        if isinstance(entry.get("eval_solve_rate"), (int, float)):
            rows[step] = {k[5:]: v for k, v in entry.items() if k.startswith("eval_")} | {"step": step}
    for step, path in eval_files(run_dir).items():
        try:
            report = read_eval(path)
        except (OSError, ValueError) as e:
            log.warning("skipping unreadable %s: %s", path, e)
            continue
        rows[step] = rows.get(step, {}) | {k: v for k, v in report.items() if k != "mazes"} | {"step": step}
    return [rows[s] for s in sorted(rows)]
