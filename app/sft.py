"""Supervised warm start: BFS-solver demonstrations in exactly the RL episode format.

A demonstration is an episode played by the solver through the same dialogue, segments and trajectory
layout as a rollout: the loss mask covers the solver's replies (each `('move', d)` / `('stop', 'stop')`
and its `<|im_end|>`), so SFT and GRPO train the same tokens in the same contexts. Training mazes only:
demonstrations come from the same `MazeSampler` that never yields an eval maze.
"""

from __future__ import annotations

from app import dialogue
from app.encoding import ChatCodec
from app.episodes import EpisodeRequest, EpisodeSettings, RunningEpisode
from app.maze import Maze
from app.trajectory import Trajectory


def demonstration(maze: Maze, codec: ChatCodec, settings: EpisodeSettings, group: int = 0) -> Trajectory:
    """The solver's episode on `maze` (it stops on the goal, or runs out of turns if the maze needs more)."""
    episode = RunningEpisode(EpisodeRequest(maze, group, 0), codec, settings)
    for action in dialogue.solver_actions(maze):
        if episode.env.done:
            break
        reply = codec.reply_segment(dialogue.demo_reply(action))
        episode.advance(reply.token_ids, [0.0] * len(reply.token_ids), "stop")
    return episode.trajectory(lora_version=-1)


def demonstrations(mazes: list[Maze], codec: ChatCodec, settings: EpisodeSettings) -> list[Trajectory]:
    return [demonstration(m, codec, settings, group=i) for i, m in enumerate(mazes)]
