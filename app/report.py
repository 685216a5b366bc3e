"""See the run: the solve-rate plot, episode replays and a one-page HTML report, from the run folder alone.

Everything here is rebuilt from files the run already writes, so it works during a run, after it, and
on a copy of the run folder:

    <run dir>/config.yaml                  the validated config (maze.size, maze.cell_px, rollout.max_turns)
    <run dir>/metrics.jsonl                one object per recorded step (app/metrics.py)
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
import json
import logging
import math
import os
import re
from pathlib import Path

import numpy as np

log = logging.getLogger("mazerl.report")

PLOT_NAME = "solve_rate.png"
REPORT_NAME = "report.html"
EVAL_PATTERN = re.compile(r"eval_step_(\d+)\.json$")
PHASES = ("rollout", "train", "sync", "eval", "checkpoint")

CAPTION_PX = 40           # height of the caption strip under each replay frame
MIN_REPLAY_WIDTH = 256    # small mazes are scaled up (nearest neighbour, whole multiples) to at least this width
FRAME_MS, LAST_FRAME_MS = 500, 2000
TRAIL_RGB = (150, 190, 255)


# --- reading the run folder ----------------------------------------------------------------------

def read_config(run_dir: str | Path) -> dict:
    """config.yaml as a plain dict ({} when it is missing or unreadable)."""
    import yaml

    path = Path(run_dir) / "config.yaml"
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        log.warning("cannot read %s: %s", path, e)
        return {}
    return data if isinstance(data, dict) else {}


def _setting(cfg: dict, section: str, key: str, fallback=None):
    """cfg[section][key], else `fallback`, else the default of app.config."""
    value = cfg[section].get(key) if isinstance(cfg.get(section), dict) else None
    if value is not None:
        return value
    if fallback is not None:
        return fallback
    from app.config import Config

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


# --- the solve-rate plot -------------------------------------------------------------------------

def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def plot_solve_rate(run_dir: str | Path, out: str | Path | None = None, metrics: dict[int, dict] | None = None,
                    history: list[dict] | None = None) -> Path:
    """Eval solve rate vs step (markers), the solvable bound (dashed), the rollout solve rate (thin)."""
    from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend (Agg canvas below)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.ticker import PercentFormatter

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
            ax.plot(steps[window - 1:], smooth, color="tab:orange", lw=2, label=f"rollout, mean of {window}")
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


# --- episode replays -----------------------------------------------------------------------------

def pick_episode(mazes: list[dict]) -> dict:
    """The episode to replay: the first solved one, else the first."""
    if not mazes:
        raise ValueError("the eval has no episodes")
    return next((m for m in mazes if m.get("outcome") == "solved"), mazes[0])


def replay_scale(maze_px: int) -> int:
    return max(1, math.ceil(MIN_REPLAY_WIDTH / maze_px))


def replay_frame_size(size: int, cell_px: int) -> tuple[int, int]:
    """(width, height) of a replay frame: the scaled maze picture plus the caption strip."""
    side = size * cell_px * replay_scale(size * cell_px)
    return side, side + CAPTION_PX


def _font():
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=13)
    except (TypeError, OSError):  # Pillow without FreeType: the fixed bitmap font
        return ImageFont.load_default()


def _effect(action, before: tuple, after: tuple, outcome: str | None) -> str:
    from app.maze import DIRECTION_NAMES

    if action is None:
        return "invalid action: nothing happens"
    if action.kind == "stop":
        return "stop on the goal" if outcome == "solved" else "stop off the goal"
    name = DIRECTION_NAMES[action.direction]
    return f"moved {name}" if after != before else f"wall: cannot move {name}"


def replay_frames(episode: dict, size: int, cell_px: int, max_turns: int):
    """(PIL frames, final outcome): the start, then one frame per action, each with a caption strip."""
    from PIL import Image, ImageDraw

    from app.dialogue import parse_action
    from app.maze import MazeEpisode, generate_maze, render

    maze = generate_maze(int(episode["seed"]), int(size))
    env = MazeEpisode(maze, int(max_turns))
    scale = replay_scale(size * cell_px)
    width, height = replay_frame_size(size, cell_px)
    font = _font()
    trail: list[tuple[int, int]] = []

    def frame(line1: str, line2: str):
        picture = render(maze, env.position, cell_px).copy()
        for row, col in trail:  # a small dot on each cell walked through, but not under the agent
            if (row, col) == env.position:
                continue
            top, left, r = row * cell_px + cell_px // 2, col * cell_px + cell_px // 2, max(1, cell_px // 10)
            picture[top - r:top + r, left - r:left + r] = TRAIL_RGB
        if scale > 1:
            picture = np.repeat(np.repeat(picture, scale, axis=0), scale, axis=1)
        image = Image.new("RGB", (width, height), (255, 255, 255))
        image.paste(Image.fromarray(picture), (0, 0))
        draw = ImageDraw.Draw(image)
        draw.rectangle([0, height - CAPTION_PX, width, height], fill=(32, 32, 32))
        draw.text((4, height - CAPTION_PX + 3), line1, fill=(255, 255, 255), font=font)
        draw.text((4, height - CAPTION_PX + 21), line2, fill=(255, 220, 120), font=font)
        return image

    frames = [frame(f"turn 0/{max_turns}  seed {episode['seed']}", "start")]
    for text in episode.get("actions") or []:
        if env.done:
            log.warning("seed %s: actions go on after the episode ended; the rest are ignored", episode["seed"])
            break
        action = parse_action(text) if isinstance(text, str) else None
        before = env.position
        if env.position not in trail:
            trail.append(env.position)
        result = env.step(action)
        shown = text if isinstance(text, str) else "(unparsed reply)"
        line2 = _effect(action, before, env.position, result.outcome)
        if result.done:
            line2 += f"  |  outcome: {result.outcome.replace('_', ' ')}"
        frames.append(frame(f"turn {env.turns}/{max_turns}  {shown}", line2))
    recorded = episode.get("outcome")
    if recorded and env.outcome != recorded:
        log.warning("seed %s: the replay ends %s but the eval recorded %s", episode["seed"], env.outcome, recorded)
    return frames, env.outcome


def save_gif(frames, out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    durations = [FRAME_MS] * (len(frames) - 1) + [LAST_FRAME_MS]
    tmp = out.with_name(out.name + ".tmp")
    frames[0].save(tmp, format="GIF", save_all=True, append_images=frames[1:], duration=durations, loop=0,
                   optimize=False, disposal=1)
    os.replace(tmp, out)
    return out


def replay_path(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / "eval" / f"replay_step_{step:06d}.gif"


def replay_eval(run_dir: str | Path, step: int, cfg: dict | None = None) -> tuple[Path, dict]:
    """The replay GIF of one episode of the eval at `step`; returns (path, the episode's record)."""
    run_dir = Path(run_dir)
    cfg = read_config(run_dir) if cfg is None else cfg
    report = read_eval(run_dir / "eval" / f"eval_step_{step:06d}.json")
    episode = pick_episode(report.get("mazes") or [])
    max_turns = int(_setting(cfg, "rollout", "max_turns", fallback=report.get("max_turns")))
    frames, _ = replay_frames(episode, int(_setting(cfg, "maze", "size")), int(_setting(cfg, "maze", "cell_px")), max_turns)
    return save_gif(frames, replay_path(run_dir, step)), episode


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
    ("model", "path"), ("model", "adapter_init"), ("lora", "rank"), ("lora", "alpha"),
    ("maze", "size"), ("maze", "cell_px"), ("rollout", "engine"), ("rollout", "max_turns"),
    ("rollout", "n_samples_per_prompt"), ("rollout", "temperature"), ("train", "lr"), ("train", "mazes_per_step"),
    ("train", "max_steps"), ("train", "epochs"), ("eval", "num_mazes"), ("eval", "eval_interval"),
    ("placement", "num_bundles"), ("placement", "gpus_per_bundle"), ("checkpoint", "ckpt_interval"),
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


def _html(run_dir: Path, cfg: dict, metrics: dict[int, dict], history: list[dict], plot: Path,
          replay: Path | None, episode: dict | None, replay_step: int | None) -> str:
    esc = html.escape
    name = cfg.get("run_name") or run_dir.name
    rel = lambda p: esc(os.path.relpath(p, run_dir).replace(os.sep, "/"))  # noqa: E731
    parts = [f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>mazerl report: {esc(str(name))}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em auto; max-width: 980px; color: #222; }}
table {{ border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 0.9em; }}
th, td {{ border: 1px solid #ccc; padding: 3px 8px; text-align: right; }}
th {{ background: #f0f0f0; }} td.k, th.k {{ text-align: left; }}
.big {{ font-size: 1.3em; }} .media {{ display: flex; gap: 1.5em; align-items: flex-start; flex-wrap: wrap; }}
</style></head><body>
<h1>mazerl run <code>{esc(str(name))}</code></h1>
<p>Run folder: <code>{esc(str(run_dir.resolve()))}</code></p>"""]

    steps = [s for s, m in metrics.items() if s > 0]
    last = steps[-1] if steps else 0
    total = total_steps(cfg)
    parts.append(f"<p>Steps recorded: {last}{f' of {total}' if total else ''}.</p>")

    parts.append("<h2>Solve rate</h2>")
    if history:
        final = history[-1]
        best = max(history, key=lambda h: h.get("solve_rate", -1) if _finite(h.get("solve_rate")) else -1)
        parts.append(f"""<p class="big">final (step {final['step']}): <b>{_pct(final.get('solve_rate'))}</b> &nbsp;
best (step {best['step']}): <b>{_pct(best.get('solve_rate'))}</b> &nbsp; solvable bound: <b>{_pct(final.get('solvable_bound'))}</b></p>
<p>The bound is the share of held-out mazes a perfect player solves within max_turns; a solve rate counts only
stopping on the goal within the turn budget.</p>""")
    else:
        parts.append("<p>No evaluation yet.</p>")
    parts.append('<div class="media">')
    parts.append(f'<img src="{rel(plot)}" alt="solve rate vs step" width="640">')
    if replay is not None and episode is not None:
        parts.append(f"""<figure style="margin:0"><img src="{rel(replay)}" alt="replay">
<figcaption>eval step {replay_step}: maze seed {esc(str(episode.get('seed')))}, {esc(str(episode.get('outcome')))}
in {esc(str(episode.get('turns')))} turns (shortest path {esc(str(episode.get('optimal_moves')))} moves)</figcaption></figure>""")
    parts.append("</div>")

    if history:
        cols = (("step", "step"), ("solve rate", "solve_rate"), ("solvable bound", "solvable_bound"),
                ("solved", "solved"), ("solvable", "solvable"), ("of solvable", "solve_rate_of_solvable"),
                ("mean turns", "mean_turns"), ("invalid actions", "invalid_action_rate"),
                ("stopped off goal", "stopped_off_goal"), ("out of turns", "out_of_turns"), ("LoRA version", "lora_version"))
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
        parts.append(f"<h2>Step anatomy</h2><p>Mean over {timed} training steps.</p>"
                     "<table><tr><th class=k>phase</th><th>mean seconds</th><th>share</th></tr>")
        for phase, mean, share in anatomy:
            parts.append(f"<tr><td class=k>{phase}</td><td>{mean:.2f}</td><td>{_pct(share)}</td></tr>")
        parts.append("</table>")
        last_m = metrics[steps[-1]] if steps else {}
        extra = [(k, last_m.get(k)) for k in ("rollout_generated_tokens_per_s", "lora_version", "recoveries",
                                                "checkpoint_age_steps") if k in last_m]
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
