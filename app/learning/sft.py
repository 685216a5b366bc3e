"""Supervised warm start: BFS-solver demonstrations in exactly the RL episode format.

A demonstration is an episode played by the solver through the same dialogue, segments and trajectory
layout as a rollout: the loss mask covers the solver's replies (each `('move', d)` / `('stop', 'stop')`
and its `<|im_end|>`), so SFT and GRPO train the same tokens in the same contexts. Training mazes only:
demonstrations come from the same `MazeSampler` that never yields an eval maze.
"""

from __future__ import annotations

import numpy as np

from app.rollout.encoding import ChatCodec, as_image, image_to_png
from app.rollout.episodes import EpisodeRequest, RunningEpisode
from app.rollout.trajectory import Trajectory, build_sequence
from app.world import dialogue
from app.world.maze import Action, Maze
from app.world.render import render
from app.world.rules import EpisodeSettings


def demonstration(
    maze: Maze, codec: ChatCodec, settings: EpisodeSettings, group: int = 0, noise: float = 0.0, seed: int = 0
) -> Trajectory:
    """The solver's episode on `maze` (it stops on the goal, or runs out of turns if the maze needs more).

    noise: each turn, with this probability, a uniformly random move replaces the solver's; it stays in the
    context but is not trained, and the solver goes on from wherever it led. A learner's own mistakes take it
    off the shortest path, where plain demonstrations never go; these show the way back from there (DART,
    Laskey et al. 2017). The random moves come from `seed` and the maze's seed, so a demonstration replays.
    """
    rng = np.random.default_rng([seed, maze.seed]) if noise > 0 else None
    episode = RunningEpisode(EpisodeRequest(maze, group, 0), codec, settings)
    while not episode.env.done:
        trained = rng is None or rng.random() >= noise
        action = solver_action(maze, episode.env.position) if trained else Action.move(int(rng.integers(4)))
        reply = codec.reply_segment(dialogue.demo_reply(action))
        episode.advance(reply.token_ids, [0.0] * len(reply.token_ids), "stop", trained=trained)
    return episode.trajectory(lora_version=-1)


def solver_action(maze: Maze, position: tuple[int, int]) -> Action:
    """The BFS solver's action from `position`: the first move of a shortest path to the goal, or stop on it."""
    path = maze.path_from(position)
    return Action.move(path[0]) if path else Action.stop()


def demonstrations(mazes: list[Maze], codec: ChatCodec, settings: EpisodeSettings) -> list[Trajectory]:
    return [demonstration(m, codec, settings, group=i) for i, m in enumerate(mazes)]


def perception_example(maze: Maze, position: tuple[int, int], codec: ChatCodec, cell_px: int) -> Trajectory:
    """One question with a free label: the maze with the agent at `position`, and which moves are open there.

    A model built from random weights has to learn to see walls from somewhere; demonstrations label one
    decision per picture, this labels all four neighbours of the agent's cell, in the action grammar, so it
    teaches exactly the perception a move needs. A one-turn exchange, not an episode: it is never played.
    """
    image = as_image(render(maze, position, cell_px))
    reply_text = dialogue.open_moves_reply(maze, position)
    reply = codec.reply_segment(reply_text)
    reply.logprobs = [0.0] * len(reply.token_ids)
    sequence = build_sequence([codec.question(image, dialogue.OPEN_MOVES_QUESTION), reply], 0, [0])
    return Trajectory(
        maze_seed=maze.seed,
        maze_id=maze.identity,
        group=0,
        sample=0,
        images=[image_to_png(image)],
        sequences=[sequence],
        replies=[reply_text],
        actions=[None],
        reward=0.0,
        outcome="question",
        turns=1,
        moves=0,
        invalid_actions=0,
        optimal_moves=maze.shortest_path_length,
        solvable=True,
        lora_version=-1,
    )


class WarmStartData:
    """The examples of warm-start steps: per maze a solver demonstration (with sft.noise random moves; from a
    random open cell for a sft.random_starts share) and sft.perception questions on random cells.

    Each maze has sft.variants distinct example sets, made once and replayed in turn: making them (playing,
    rendering, tokenising) is host work that would otherwise bound a small model's step. Everything random
    comes from `seed`, the maze's seed and the variant, so a run's data replays.
    """

    def __init__(self, codec: ChatCodec, settings: EpisodeSettings, sft, seed: int):
        self.codec, self.settings, self.sft, self.seed = codec, settings, sft, seed
        self._made: dict[tuple[str, int], list[Trajectory]] = {}
        self._visits: dict[str, int] = {}

    def batch(self, mazes: list[Maze]) -> list[Trajectory]:
        return [example for maze in mazes for example in self._examples(maze)]

    def _examples(self, maze: Maze) -> list[Trajectory]:
        visits = self._visits.get(maze.identity, 0)
        self._visits[maze.identity] = visits + 1
        key = (maze.identity, visits % self.sft.variants)
        if key not in self._made:
            self._made[key] = self._make(maze, key[1])
        return self._made[key]

    def _make(self, maze: Maze, variant: int) -> list[Trajectory]:
        rng = np.random.default_rng([self.seed, maze.seed, variant])
        cells = maze.open_cells()
        played = maze
        if rng.random() < self.sft.random_starts:
            # The same walls and goal; the start is not drawn, so the pictures are the game's own.
            played = Maze(maze.walls, cells[rng.integers(len(cells))], maze.goal, maze.seed)
        examples = [
            demonstration(played, self.codec, self.settings, noise=self.sft.noise, seed=int(rng.integers(2**31)))
        ]
        for index in rng.choice(len(cells), size=min(self.sft.perception, len(cells)), replace=False):
            examples.append(perception_example(maze, cells[index], self.codec, self.settings.cell_px))
        return examples
