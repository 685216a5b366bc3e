"""The rules of one episode, shared by everything that plays one: rollouts, evaluation, SFT data, the client.

A played conversation is the same token for token wherever it is played, so its shape comes from one place:
`EpisodeSettings.from_config(cfg)` reads it from a run's config.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EpisodeSettings:
    max_turns: int  # actions per episode, the final stop included
    maze_size: int  # grid side including the wall border
    cell_px: int  # pixels per maze cell in the picture
    image_history: int = 0  # keep the last K images in context; 0 keeps all
    max_model_len: int = 4096  # longest context (prompt + replies) the engine accepts
    feedback: str = "visgym"  # "compass"/"route": the observation text also says where the goal lies / which way
    turn_history: int = 0  # keep the last K turns after the task statement; 0 keeps all (dialogue.dropped_turns)
    max_new_tokens: int = 32  # token budget of one reply

    @classmethod
    def from_config(cls, cfg) -> EpisodeSettings:
        """The episode rules of a run's config (app.config.Config)."""
        return cls(
            max_turns=cfg.rollout.max_turns,
            maze_size=cfg.maze.size,
            cell_px=cfg.maze.cell_px,
            image_history=cfg.rollout.image_history,
            max_model_len=cfg.rollout.max_model_len,
            feedback=cfg.maze.feedback,
            turn_history=cfg.rollout.turn_history,
            max_new_tokens=cfg.rollout.max_new_tokens,
        )
