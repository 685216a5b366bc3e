"""See the run: the solve-rate plot, episode replays and a one-page HTML report, from the run folder alone.

Everything here is rebuilt from files the run already writes, so it works during a run, after it, and
on a copy of the run folder:

    <run dir>/config.yaml                  the validated config (maze.size, maze.cell_px, rollout.max_turns)
    <run dir>/metrics.jsonl                one object per recorded step (app/observe/metrics.py)
    <run dir>/eval/eval_step_NNNNNN.json   the evaluator's summary + per-maze seed, actions and outcome

and it writes, next to them:

    <run dir>/eval/solve_rate.png          eval solve rate vs step, the solvable bound dashed, rollout solve rate
    <run dir>/eval/replay_step_NNNNNN.gif  one held-out episode of that eval (a solved one where there is one),
                                           re-simulated from its seed and actions, a caption strip per frame
    <run dir>/report.html                  `build_report`: config summary, best/final solve rate vs the bound,
                                           the plot, the latest replay, the eval history and the step anatomy

`after_eval(run_dir, step)` is the hook the evaluator calls after writing an eval: it never raises, because
a report that cannot be drawn must not stop training. `python scripts/report.py RUN_DIR` builds it all.
"""

from __future__ import annotations

import html
import logging
import math
import os
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import (
    Figure,  # no pyplot: no global state, no GUI backend (Agg canvas below)
)
from matplotlib.ticker import PercentFormatter

from app.observe.replay import replay_eval
from app.observe.run_files import eval_files, eval_history, metrics_by_step, read_config

log = logging.getLogger("mazerl.report")

PLOT_NAME = "solve_rate.png"
REPORT_NAME = "report.html"
PHASES = ("rollout", "train", "sync", "eval", "checkpoint")


# --- the solve-rate plot -------------------------------------------------------------------------


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def plot_solve_rate(
    run_dir: str | Path,
    out: str | Path | None = None,
    metrics: dict[int, dict] | None = None,
    history: list[dict] | None = None,
) -> Path:
    """Eval solve rate vs step (markers), the solvable bound (dashed), the rollout solve rate (thin)."""

    run_dir = Path(run_dir)
    out = Path(out) if out else run_dir / "eval" / PLOT_NAME
    metrics = metrics_by_step(run_dir) if metrics is None else metrics
    history = eval_history(run_dir, metrics) if history is None else history

    fig = Figure(figsize=(8, 4.5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    rollout = [(s, m["rollout_solve_rate"]) for s, m in metrics.items() if _finite(m.get("rollout_solve_rate"))]
    if rollout:
        ax.plot(*zip(*rollout), color="tab:orange", lw=1, alpha=0.6, label="rollout solve rate (sampled)")
        if len(rollout) >= 8:
            window = max(3, len(rollout) // 10)
            steps, values = zip(*rollout)
            smooth = np.convolve(values, np.ones(window) / window, mode="valid")
            ax.plot(steps[window - 1 :], smooth, color="tab:orange", lw=2, label=f"rollout, mean of {window}")
    evals = [(h["step"], h["solve_rate"]) for h in history if _finite(h.get("solve_rate"))]
    if evals:
        ax.plot(*zip(*evals), color="tab:blue", lw=2, marker="o", ms=4, label="eval solve rate (greedy, held out)")
    bound = [(h["step"], h["solvable_bound"]) for h in history if _finite(h.get("solvable_bound"))]
    if bound:
        steps, values = zip(*bound)
        if len(bound) == 1:  # a single eval: draw the bound across the whole plot
            ax.axhline(values[0], color="black", ls="--", lw=1.2, label="solvable bound")
        else:
            ax.plot(steps, values, color="black", ls="--", lw=1.2, label="solvable bound")
    ax.set_ylim(-0.02, 1.02)
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.set_xlabel("step")
    ax.set_ylabel("solve rate")
    ax.grid(alpha=0.3)
    name = read_config(run_dir).get("run_name") or run_dir.name
    ax.set_title(f"{name}: solve rate")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper left", fontsize=8)
    else:
        ax.text(0.5, 0.5, "no solve rates recorded yet", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    fig.savefig(tmp, format="png")
    os.replace(tmp, out)
    return out


# --- hooks ---------------------------------------------------------------------------------------


def after_eval(run_dir: str | Path, step: int) -> dict[str, Path]:
    """Rebuilds the solve-rate plot and draws the replay of the eval at `step`. Never raises: a report
    that cannot be drawn is logged, and training goes on. Returns what it wrote."""
    written: dict[str, Path] = {}
    try:
        if not Path(run_dir).is_dir():
            log.warning("no run folder at %s: no report for the step-%s eval", run_dir, step)
            return written
    except Exception:  # e.g. run_dir is not a path at all
        log.warning("no report for the step-%s eval: bad run folder %r", step, run_dir, exc_info=True)
        return written
    try:
        written["plot"] = plot_solve_rate(run_dir)
    except Exception:
        log.warning("solve-rate plot for %s failed", run_dir, exc_info=True)
    try:
        written["replay"] = replay_eval(run_dir, step)[0]
    except Exception:
        log.warning("replay of the step-%s eval in %s failed", step, run_dir, exc_info=True)
    return written


def build_report(run_dir: str | Path) -> Path:
    """The plot, the replay of the latest eval and `<run dir>/report.html`; returns the HTML's path."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"no run folder at {run_dir}")
    cfg = read_config(run_dir)
    metrics = metrics_by_step(run_dir)
    history = eval_history(run_dir, metrics)
    plot = plot_solve_rate(run_dir, metrics=metrics, history=history)
    replay, episode, replay_step = None, None, None
    files = eval_files(run_dir)
    for step in reversed(files):  # the latest eval that can be replayed
        try:
            replay, episode = replay_eval(run_dir, step, cfg)
            replay_step = step
            break
        except Exception:
            log.warning("replay of the step-%s eval failed", step, exc_info=True)
    out = run_dir / REPORT_NAME
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(_html(run_dir, cfg, metrics, history, plot, replay, episode, replay_step))
    os.replace(tmp, out)
    return out


# --- the HTML page -------------------------------------------------------------------------------

CONFIG_SUMMARY = (
    ("model", "path"),
    ("model", "adapter_init"),
    ("lora", "rank"),
    ("lora", "alpha"),
    ("maze", "size"),
    ("maze", "cell_px"),
    ("rollout", "engine"),
    ("rollout", "max_turns"),
    ("rollout", "n_samples_per_prompt"),
    ("rollout", "temperature"),
    ("train", "lr"),
    ("train", "mazes_per_step"),
    ("train", "max_steps"),
    ("train", "epochs"),
    ("eval", "num_mazes"),
    ("eval", "eval_interval"),
    ("placement", "num_bundles"),
    ("placement", "gpus_per_bundle"),
    ("checkpoint", "ckpt_interval"),
)


def total_steps(cfg: dict) -> int | None:
    """The run's step count as app.config.Config.total_steps computes it, from the YAML dump."""
    train = cfg.get("train")
    try:
        per_epoch = -(-int(train["dataset_size"]) // int(train["mazes_per_step"]))
        steps = int(train["epochs"]) * per_epoch
        return min(steps, int(train["max_steps"])) if train.get("max_steps") else steps
    except (TypeError, KeyError, ValueError, ZeroDivisionError, AttributeError):
        return None


def _pct(value) -> str:
    return f"{100 * value:.1f}%" if _finite(value) else "n/a"


def _num(value, digits: int = 3) -> str:
    if isinstance(value, bool) or value is None:
        return "" if value is None else str(value)
    if isinstance(value, int):
        return str(value)
    if _finite(value):
        return f"{value:.{digits}g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return html.escape(str(value))


def step_anatomy(metrics: dict[int, dict]) -> list[tuple[str, float, float]]:
    """(phase, mean seconds, share of the mean step) over the training steps."""
    steps = [m for s, m in metrics.items() if s > 0 and _finite(m.get("time_step_s"))]
    if not steps:
        return []
    total = sum(m["time_step_s"] for m in steps) / len(steps)
    rows = []
    for phase in PHASES:
        values = [m.get(f"time_{phase}_s", 0.0) for m in steps]
        mean = sum(v for v in values if _finite(v)) / len(steps)
        rows.append((phase, mean, mean / total if total > 0 else 0.0))
    rows.append(("step", total, 1.0))
    return rows


def _phase_mean(steps: list[dict], key: str) -> float | None:
    values = [m[key] for m in steps if _finite(m.get(key))]
    return sum(values) / len(values) if values else None


def _html(
    run_dir: Path,
    cfg: dict,
    metrics: dict[int, dict],
    history: list[dict],
    plot: Path,
    replay: Path | None,
    episode: dict | None,
    replay_step: int | None,
) -> str:
    esc = html.escape
    name = cfg.get("run_name") or run_dir.name
    rel = lambda p: esc(os.path.relpath(p, run_dir).replace(os.sep, "/"))  # noqa: E731
    parts = [
        f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>mazerl report: {esc(str(name))}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em auto; max-width: 980px; color: #222; }}
table {{ border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 0.9em; }}
th, td {{ border: 1px solid #ccc; padding: 3px 8px; text-align: right; }}
th {{ background: #f0f0f0; }} td.k, th.k {{ text-align: left; }}
.big {{ font-size: 1.3em; }} .media {{ display: flex; gap: 1.5em; align-items: flex-start; flex-wrap: wrap; }}
</style></head><body>
<h1>mazerl run <code>{esc(str(name))}</code></h1>
<p>Run folder: <code>{esc(str(run_dir.resolve()))}</code></p>"""
    ]

    steps = [s for s, m in metrics.items() if s > 0]
    last = steps[-1] if steps else 0
    total = total_steps(cfg)
    parts.append(f"<p>Steps recorded: {last}{f' of {total}' if total else ''}.</p>")

    parts.append("<h2>Solve rate</h2>")
    if history:
        final = history[-1]
        best = max(history, key=lambda h: h.get("solve_rate", -1) if _finite(h.get("solve_rate")) else -1)
        parts.append(f"""<p class="big">final (step {final["step"]}): <b>{_pct(final.get("solve_rate"))}</b> &nbsp;
best (step {best["step"]}): <b>{_pct(best.get("solve_rate"))}</b> &nbsp;
solvable bound: <b>{_pct(final.get("solvable_bound"))}</b></p>
<p>The bound is the share of held-out mazes a perfect player solves within max_turns; a solve rate counts only
stopping on the goal within the turn budget.</p>""")
    else:
        parts.append("<p>No evaluation yet.</p>")
    parts.append('<div class="media">')
    parts.append(f'<img src="{rel(plot)}" alt="solve rate vs step" width="640">')
    if replay is not None and episode is not None:
        parts.append(f"""<figure style="margin:0"><img src="{rel(replay)}" alt="replay">
<figcaption>eval step {replay_step}: maze seed {esc(str(episode.get("seed")))}, {esc(str(episode.get("outcome")))}
in {esc(str(episode.get("turns")))} turns
(shortest path {esc(str(episode.get("optimal_moves")))} moves)</figcaption></figure>""")
    parts.append("</div>")

    if history:
        cols = (
            ("step", "step"),
            ("solve rate", "solve_rate"),
            ("solvable bound", "solvable_bound"),
            ("solved", "solved"),
            ("solvable", "solvable"),
            ("of solvable", "solve_rate_of_solvable"),
            ("mean turns", "mean_turns"),
            ("invalid actions", "invalid_action_rate"),
            ("stopped off goal", "stopped_off_goal"),
            ("out of turns", "out_of_turns"),
            ("LoRA version", "lora_version"),
        )
        parts.append("<h2>Eval history</h2><table><tr>" + "".join(f"<th>{c}</th>" for c, _ in cols) + "</tr>")
        for h in history:
            cells = []
            for _, key in cols:
                value = h.get(key)
                pct = key in ("solve_rate", "solvable_bound", "solve_rate_of_solvable", "invalid_action_rate")
                cells.append(f"<td>{_pct(value) if pct else _num(value)}</td>")
            parts.append("<tr>" + "".join(cells) + "</tr>")
        parts.append("</table>")

    anatomy = step_anatomy(metrics)
    if anatomy:
        timed = sum(_finite(metrics[s].get("time_step_s")) for s in steps)
        parts.append(
            f"<h2>Step anatomy</h2><p>Mean over {timed} training steps.</p>"
            "<table><tr><th class=k>phase</th><th>mean seconds</th><th>share</th><th>MFU</th>"
            "<th>floor seconds (at the GPUs' peak)</th></tr>"
        )
        timed_steps = [metrics[s] for s in steps if _finite(metrics[s].get("time_step_s"))]
        for phase, mean, share in anatomy:
            mfu, floor = (_phase_mean(timed_steps, f"{phase}_{k}") for k in ("mfu", "floor_s"))
            parts.append(
                f"<tr><td class=k>{phase}</td><td>{mean:.2f}</td><td>{_pct(share)}</td>"
                f"<td>{_pct(mfu) if mfu is not None else '-'}</td>"
                f"<td>{_num(floor) if floor is not None else '-'}</td></tr>"
            )
        parts.append("</table>")
        last_m = metrics[steps[-1]] if steps else {}
        extra = [
            (k, last_m.get(k))
            for k in ("rollout_generated_tokens_per_s", "lora_version", "recoveries", "checkpoint_age_steps")
            if k in last_m
        ]
        if extra:
            parts.append("<p>" + ", ".join(f"{esc(k)} {_num(v)}" for k, v in extra) + f" (step {steps[-1]})</p>")

    if cfg:
        parts.append("<h2>Config</h2><table><tr><th class=k>setting</th><th class=k>value</th></tr>")
        for section, key in CONFIG_SUMMARY:
            sec = cfg.get(section)
            if isinstance(sec, dict) and key in sec:
                parts.append(f"<tr><td class=k>{section}.{key}</td><td class=k>{esc(str(sec[key]))}</td></tr>")
        parts.append("</table><p>Full config: <code>config.yaml</code> in the run folder.</p>")
    parts.append("</body></html>\n")
    return "\n".join(parts)
