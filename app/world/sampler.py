"""Which mazes train: a seeded, resumable stream over a fixed training set that never holds an eval maze.

The training set is the first `dataset_size` distinct mazes from seeds 0, 1, 2, ... whose identity
(layout + start + goal) is not in the held-out set. Each epoch visits it in a fresh order drawn from
(seed, epoch), so the stream depends only on the config and the position, which a checkpoint saves.

With `random_starts`, that share of the stream's mazes keep their walls and goal but start on a random open
cell other than the goal, also drawn from (seed, epoch, position). Such a maze is never a held-out one either:
a goal fixes its corner pair, so only the training maze's own start could make the identity of a held-out
maze of the same walls, and that maze is not held out. The check is made anyway.
"""

from __future__ import annotations

import numpy as np

from app.config import ConfigError
from app.world.maze import Maze, generate_maze


def eval_mazes(first_seed: int, count: int, size: int) -> list[Maze]:
    return [generate_maze(first_seed + i, size) for i in range(count)]


class MazeSampler:
    def __init__(
        self,
        seed: int,
        dataset_size: int,
        maze_size: int,
        eval_identities: set[str],
        give_up_after: int = 20_000,
        random_starts: float = 0.0,
    ):
        self.seed, self.maze_size, self.random_starts = seed, maze_size, random_starts
        self.eval_identities = eval_identities
        self.seeds: list[int] = []
        seen: set[str] = set()
        candidate = last_new = 0
        while len(self.seeds) < dataset_size:
            if candidate - last_new > give_up_after:  # small sizes have few mazes (768 at 7x7)
                raise ConfigError(
                    "train.dataset_size",
                    f"only {len(self.seeds)} distinct {maze_size}x{maze_size} mazes exist outside the eval set",
                    f"set train.dataset_size <= {len(self.seeds)} or raise maze.size",
                )
            identity = generate_maze(candidate, maze_size).identity
            if identity not in eval_identities and identity not in seen:
                seen.add(identity)
                self.seeds.append(candidate)
                last_new = candidate
            candidate += 1
        self.skipped_eval = candidate - len(self.seeds)
        self.epoch, self.position = 0, 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> list[int]:
        rng = np.random.default_rng([self.seed, epoch])
        return [self.seeds[i] for i in rng.permutation(len(self.seeds))]

    def next(self, count: int) -> list[Maze]:
        """The next `count` training mazes, moving into the next epoch when this one runs out."""
        out = []
        while len(out) < count:
            if self.position == len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._epoch_order(self.epoch)
            out.append(self._start_of(generate_maze(self._order[self.position], self.maze_size)))
            self.position += 1
        return out

    def _start_of(self, maze: Maze) -> Maze:
        """The maze as the stream yields it at the current position: from its corner, or from a random cell."""
        if not self.random_starts:
            return maze
        rng = np.random.default_rng([self.seed, self.epoch, self.position, 1])
        if rng.random() >= self.random_starts:
            return maze
        cells = [cell for cell in maze.open_cells() if cell != maze.goal]
        moved = Maze(maze.walls, cells[int(rng.integers(len(cells)))], maze.goal, maze.seed)
        return maze if moved.identity in self.eval_identities else moved

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "dataset_size": len(self.seeds), "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if state["dataset_size"] != len(self.seeds) or state["seed"] != self.seed:
            raise ValueError("the checkpoint's maze sampler was built from another seed or dataset_size")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._epoch_order(self.epoch)
