"""Playing mazes through the serving API: a training episode, as OpenAI chat messages.

`ServedEpisode` is app.rollout.episodes.RunningEpisode seen from a client: the same maze (app.world.maze), the same
messages (app.world.dialogue), the same image window (older pictures replaced by app.rollout.encoding's note), and the
same parsing of each reply into an action, so the server sees the context a rollout had, token for token
(app/serve/api.py renders it). `play` plays a set of mazes with any `reply(messages) -> Reply` function;
scripts/play.py gives it one that calls the server with the `openai` client.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from app.rollout.encoding import IMAGE_OMITTED_TEXT, as_image, image_to_png
from app.world import dialogue
from app.world.episode import MazeEpisode
from app.world.maze import Maze
from app.world.rules import EpisodeSettings


@dataclass
class Reply:
    text: str
    token_ids: list[int] | None = None  # the sampled ids, when the server returns them (return_token_ids)


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


class ServedEpisode:
    """One maze episode as a growing list of chat messages."""

    def __init__(self, maze: Maze, settings: EpisodeSettings):
        self.maze, self.settings = maze, settings
        self.env = MazeEpisode(maze, settings.max_turns)
        self.pngs = [self._picture()]
        self.history = [
            dialogue.system_message(),
            dialogue.first_user_message(settings.max_turns, settings.maze_size, self._where()),
        ]
        self.replies: list[str] = []
        self.actions: list[str | None] = []

    def _picture(self) -> bytes:
        return image_to_png(as_image(self.env.image(self.settings.cell_px)))

    def _where(self) -> str | None:
        return dialogue.where_text(self.settings.feedback, self.maze, self.env.position)

    def messages(self) -> list[dict]:
        """The conversation so far, pictures as data URLs; those outside the window as app.rollout.encoding's note."""
        k = self.settings.image_history
        oldest_kept = len(self.pngs) - k if k else 0
        # history = [system, task + first picture, reply, observation, reply, observation, ...]
        dropped = 2 * dialogue.dropped_turns(len(self.pngs) - 1, self.settings.turn_history)
        out, index = [], 0
        for position, message in enumerate(self.history):
            if 2 <= position < 2 + dropped:
                index += sum(part.get("type") == "image" for part in message["content"])
                continue
            content = []
            for part in message["content"]:
                if part.get("type") != "image":
                    content.append(part)
                    continue
                if index >= oldest_kept:
                    content.append({"type": "image_url", "image_url": {"url": data_url(self.pngs[index])}})
                else:
                    content.append({"type": "text", "text": IMAGE_OMITTED_TEXT})
                index += 1
            out.append({**message, "content": content})
        return out

    def advance(self, reply: Reply) -> None:
        """The model's reply becomes the action; the maze steps; the next observation is appended."""
        message = dialogue.assistant_message(reply.text)
        if reply.token_ids is not None:
            message["token_ids"] = list(reply.token_ids)
        self.history.append(message)
        action = dialogue.parse_action(reply.text)
        self.replies.append(reply.text)
        self.actions.append(dialogue.format_action(action) if action is not None else None)
        result = self.env.step(action)
        if result.done:
            return
        self.pngs.append(self._picture())
        self.history.append(dialogue.observation_message(result.feedback, self.env.turns_left, self._where()))

    def record(self) -> dict:
        """The episode as the evaluator reports one (app.observe.evaluation), plus the replies."""
        return {
            "seed": self.maze.seed,
            "maze_id": self.maze.identity,
            "outcome": self.env.outcome,
            "turns": self.env.turns,
            "moves": self.env.moves,
            "optimal_moves": self.maze.shortest_path_length,
            "solvable": self.maze.solvable_within(self.settings.max_turns),
            "invalid_actions": self.env.invalid_actions,
            "actions": self.actions,
            "replies": self.replies,
        }


def play_one(maze: Maze, settings: EpisodeSettings, reply: Callable[[list[dict]], Reply]) -> dict:
    episode = ServedEpisode(maze, settings)
    while not episode.env.done:
        episode.advance(reply(episode.messages()))
    return episode.record()


def play(
    mazes: list[Maze], settings: EpisodeSettings, reply: Callable[[list[dict]], Reply], concurrency: int = 1
) -> dict:
    """Plays every maze to its end (`concurrency` episodes at a time); a summary like app.observe.evaluation's."""
    with ThreadPoolExecutor(max(1, concurrency)) as pool:
        records = list(pool.map(lambda m: play_one(m, settings, reply), mazes))
    n = max(len(records), 1)
    solved = sum(r["outcome"] == "solved" for r in records)
    solvable = sum(r["solvable"] for r in records)
    return {
        "num_mazes": len(records),
        "solve_rate": solved / n,
        "solved": solved,
        "solvable": solvable,
        "solvable_bound": solvable / n,
        "mean_turns": sum(r["turns"] for r in records) / n,
        "max_turns": settings.max_turns,
        "mazes": records,
    }
