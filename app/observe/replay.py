"""Episode replays: a held-out episode re-simulated from its seed and actions, a GIF with a caption per turn."""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from app.observe.run_files import read_config, read_eval, setting
from app.world.dialogue import parse_action
from app.world.episode import MazeEpisode
from app.world.maze import DIRECTION_NAMES, generate_maze
from app.world.render import render

log = logging.getLogger("mazerl.report")

CAPTION_PX = 40  # height of the caption strip under each replay frame
MIN_REPLAY_WIDTH = 256  # small mazes are scaled up (nearest neighbour, whole multiples) to at least this width
FRAME_MS, LAST_FRAME_MS = 500, 2000
TRAIL_RGB = (150, 190, 255)


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

    try:
        return ImageFont.load_default(size=13)
    except (TypeError, OSError):  # Pillow without FreeType: the fixed bitmap font
        return ImageFont.load_default()


def _effect(action, before: tuple, after: tuple, outcome: str | None) -> str:

    if action is None:
        return "invalid action: nothing happens"
    if action.kind == "stop":
        return "stop on the goal" if outcome == "solved" else "stop off the goal"
    name = DIRECTION_NAMES[action.direction]
    return f"moved {name}" if after != before else f"wall: cannot move {name}"


def replay_frames(episode: dict, size: int, cell_px: int, max_turns: int):
    """(PIL frames, final outcome): the start, then one frame per action, each with a caption strip."""

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
            picture[top - r : top + r, left - r : left + r] = TRAIL_RGB
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
    frames[0].save(
        tmp,
        format="GIF",
        save_all=True,
        append_images=frames[1:],
        duration=durations,
        loop=0,
        optimize=False,
        disposal=1,
    )
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
    max_turns = int(setting(cfg, "rollout", "max_turns", fallback=report.get("max_turns")))
    frames, _ = replay_frames(
        episode, int(setting(cfg, "maze", "size")), int(setting(cfg, "maze", "cell_px")), max_turns
    )
    return save_gif(frames, replay_path(run_dir, step)), episode
