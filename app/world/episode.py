"""One agent playing one maze: VisGym maze_2d's step semantics and feedback texts.

An episode moves one grid cell per ``move`` action. Only ``stop`` ends an episode early: stopping on the goal
solves it (reward 1.0), stopping anywhere else ends it with reward 0. Unparseable actions and moves into walls
do nothing but use up a turn. There is no step penalty.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from app.world.maze import DIRECTION_NAMES, DIRECTION_OFFSETS, Action, Cell, Maze, is_integer
from app.world.render import render

SOLVED = "solved"
STOPPED_OFF_GOAL = "stopped_off_goal"
OUT_OF_TURNS = "out_of_turns"
CONTEXT_FULL = "context_full"  # the conversation outgrew the model's context before the episode ended: reward 0

INVALID_ACTION_FEEDBACK = "That is not a valid action, so nothing happened."
SOLVED_FEEDBACK = "You stopped on the goal. The maze is solved."
STOPPED_OFF_GOAL_FEEDBACK = "You stopped, but not on the goal. The episode is over."
OUT_OF_TURNS_SUFFIX = " You have no turns left."


def moved_feedback(direction: int) -> str:
    return f"You moved {DIRECTION_NAMES[direction]}."


def wall_feedback(direction: int) -> str:
    return f"You cannot move {DIRECTION_NAMES[direction]}: a wall is in the way. You stay where you are."


@dataclass(frozen=True)
class StepResult:
    feedback: str
    reward: float
    done: bool
    outcome: str | None


class MazeEpisode:
    """One agent playing one maze for at most ``max_turns`` actions."""

    def __init__(self, maze: Maze, max_turns: int) -> None:
        if not is_integer(max_turns) or max_turns < 1:
            raise ValueError(f"max_turns must be an integer >= 1, got {max_turns!r}")
        self.maze = maze
        self.max_turns = int(max_turns)
        self.position: Cell = maze.start
        self.turns = 0
        self.moves = 0
        self.invalid_actions = 0
        self.done = False
        self.outcome: str | None = None
        self.reward = 0.0

    @property
    def turns_left(self) -> int:
        return self.max_turns - self.turns

    @property
    def on_goal(self) -> bool:
        return self.position == self.maze.goal

    def step(self, action: Action | None) -> StepResult:
        """Apply one action; ``None`` stands for model output that did not parse."""
        if self.done:
            raise RuntimeError("the episode is over; start a new MazeEpisode")
        self.turns += 1
        if action is None:
            self.invalid_actions += 1
            feedback = INVALID_ACTION_FEEDBACK
        elif action.kind == "stop":
            feedback = self._stop()
        else:
            feedback = self._move(action.direction)
        if not self.done and self.turns >= self.max_turns:
            self._finish(OUT_OF_TURNS, 0.0)
            feedback += OUT_OF_TURNS_SUFFIX
        reward = self.reward if self.done else 0.0
        return StepResult(feedback=feedback, reward=reward, done=self.done, outcome=self.outcome)

    def image(self, cell_px: int = 25) -> np.ndarray:
        return render(self.maze, self.position, cell_px)

    def _move(self, direction: int) -> str:
        d_row, d_col = DIRECTION_OFFSETS[direction]
        target = (self.position[0] + d_row, self.position[1] + d_col)
        if not self.maze.is_open(target):
            self.invalid_actions += 1
            return wall_feedback(direction)
        self.position = target
        self.moves += 1
        return moved_feedback(direction)

    def _stop(self) -> str:
        if self.on_goal:
            self._finish(SOLVED, 1.0)
            return SOLVED_FEEDBACK
        self._finish(STOPPED_OFF_GOAL, 0.0)
        return STOPPED_OFF_GOAL_FEEDBACK

    def cut_short(self, outcome: str = CONTEXT_FULL) -> None:
        """Ends the episode from outside the maze (the context is full): no reward, whatever the position."""
        if not self.done:
            self._finish(outcome, 0.0)

    def _finish(self, outcome: str, reward: float) -> None:
        self.done = True
        self.outcome = outcome
        self.reward = reward
