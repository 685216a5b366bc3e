"""The maze environment: VisGym maze_2d semantics in pure numpy.

A maze is a square grid of odd ``size`` that includes a wall border. Room cells sit at odd
(row, col) coordinates; the cells between two rooms are either walls or carved passages. The
interior is a perfect maze (a uniform spanning tree over the rooms, built with Wilson's
loop-erased random walks), and the start and goal sit in opposite interior corners. Everything
random comes from ``np.random.default_rng(seed)``, so a seed always gives the same maze.

An episode moves one grid cell per ``move`` action. Only ``stop`` ends an episode early: stopping
on the goal solves it (reward 1.0), stopping anywhere else ends it with reward 0. Unparseable
actions and moves into walls do nothing but use up a turn. There is no step penalty.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
from PIL import Image

RIGHT, UP, LEFT, DOWN = 0, 1, 2, 3
DIRECTION_NAMES = {RIGHT: "right", UP: "up", LEFT: "left", DOWN: "down"}
# (row, col) offset of one move in each direction; rows grow downwards, as in the image.
DIRECTION_OFFSETS = {RIGHT: (0, 1), UP: (-1, 0), LEFT: (0, -1), DOWN: (1, 0)}

SOLVED = "solved"
STOPPED_OFF_GOAL = "stopped_off_goal"
OUT_OF_TURNS = "out_of_turns"

FLOOR_RGB = (255, 255, 255)
WALL_RGB = (169, 169, 169)
GOAL_RGB = (255, 0, 0)
AGENT_RGB = (0, 0, 255)

INVALID_ACTION_FEEDBACK = "That is not a valid action, so nothing happened."
SOLVED_FEEDBACK = "You stopped on the goal. The maze is solved."
STOPPED_OFF_GOAL_FEEDBACK = "You stopped, but not on the goal. The episode is over."
OUT_OF_TURNS_SUFFIX = " You have no turns left."

Cell = tuple[int, int]


def _is_integer(value: object) -> bool:
    """True for Python and numpy integers, but not for bools (True is an int to Python)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def moved_feedback(direction: int) -> str:
    return f"You moved {DIRECTION_NAMES[direction]}."


def wall_feedback(direction: int) -> str:
    return f"You cannot move {DIRECTION_NAMES[direction]}: a wall is in the way. You stay where you are."


@dataclass(frozen=True)
class Action:
    """One agent action: a move in a direction, or stop."""

    kind: str
    direction: int | None = None

    def __post_init__(self) -> None:
        # Validated here rather than only in the constructors so no malformed Action can exist.
        if self.kind == "move":
            direction = self.direction
            if not _is_integer(direction) or direction not in DIRECTION_NAMES:
                raise ValueError(f"a move needs a direction in 0..3, got {direction!r}")
            object.__setattr__(self, "direction", int(direction))  # numpy ints compare and hash like ints
        elif self.kind == "stop":
            if self.direction is not None:
                raise ValueError(f"stop takes no direction, got {self.direction!r}")
        else:
            raise ValueError(f"action kind must be 'move' or 'stop', got {self.kind!r}")

    @classmethod
    def move(cls, direction: int) -> Action:
        return cls("move", direction)

    @classmethod
    def stop(cls) -> Action:
        return cls("stop")


@dataclass(frozen=True, eq=False)
class Maze:
    """A generated maze: wall layout (True = wall), start and goal cells, and the seed that made it.

    Equality and hashing follow ``identity`` plus ``seed``; arrays cannot be compared field-wise.
    """

    walls: np.ndarray
    start: Cell
    goal: Cell
    seed: int

    def __post_init__(self) -> None:
        walls = np.array(self.walls, dtype=bool)  # a private copy, so freezing it cannot surprise a caller
        if walls.ndim != 2 or walls.shape[0] != walls.shape[1]:
            raise ValueError(f"walls must be a square 2-D grid, got shape {walls.shape}")
        walls.flags.writeable = False
        object.__setattr__(self, "walls", walls)
        object.__setattr__(self, "start", _as_cell(self.start))
        object.__setattr__(self, "goal", _as_cell(self.goal))
        for name, cell in (("start", self.start), ("goal", self.goal)):
            if not self.is_open(cell):
                raise ValueError(f"{name} {cell} is not an open cell of the maze")

    @property
    def size(self) -> int:
        return int(self.walls.shape[0])

    @functools.cached_property
    def identity(self) -> str:
        """Hex sha256 of the layout, start and goal; the seed is left out on purpose.

        Built from explicit little-endian bytes so the value is the same in every process and version.
        """
        digest = hashlib.sha256(b"mazerl.maze.v1")
        digest.update(struct.pack("<I", self.size))
        digest.update(self.walls.astype(np.uint8).tobytes(order="C"))
        digest.update(struct.pack("<4I", *self.start, *self.goal))
        return digest.hexdigest()

    def is_open(self, cell: Cell) -> bool:
        row, col = cell
        return 0 <= row < self.size and 0 <= col < self.size and not self.walls[row, col]

    def shortest_path(self) -> list[int]:
        """Directions of a shortest start→goal path (BFS; neighbours tried in direction order 0..3)."""
        return list(self._shortest_path)

    @functools.cached_property
    def _shortest_path(self) -> tuple[int, ...]:
        return _bfs_directions(self.walls, self.start, self.goal)

    def open_cells(self) -> list[Cell]:
        """Every cell an agent can stand on, row by row."""
        return [(int(row), int(col)) for row, col in np.argwhere(~self.walls)]

    def path_from(self, cell: Cell) -> list[int]:
        """Directions of a shortest path from ``cell`` (an open cell) to the goal."""
        return list(_bfs_directions(self.walls, _as_cell(cell), self.goal))

    @property
    def shortest_path_length(self) -> int:
        return len(self._shortest_path)

    def solvable_within(self, max_turns: int) -> bool:
        # The final stop costs a turn too.
        return self.shortest_path_length + 1 <= max_turns

    def __reduce__(self) -> tuple:
        # Rebuild through the constructor so a copy sent to another actor keeps read-only walls.
        return (Maze, (self.walls, self.start, self.goal, self.seed))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Maze):
            return NotImplemented
        return self.seed == other.seed and self.identity == other.identity

    def __hash__(self) -> int:
        return hash((self.seed, self.identity))


def is_room(cell: Cell) -> bool:
    """Rooms sit at odd (row, col); every other open cell is a passage carved between two rooms."""
    return cell[0] % 2 == 1 and cell[1] % 2 == 1


def _as_cell(cell: Iterable[int]) -> Cell:
    row, col = (int(value) for value in cell)
    return (row, col)


def _bfs_directions(walls: np.ndarray, start: Cell, goal: Cell) -> tuple[int, ...]:
    size = walls.shape[0]
    came_from: dict[Cell, tuple[Cell, int]] = {}
    seen = {start}
    frontier = deque([start])
    while frontier:
        cell = frontier.popleft()
        if cell == goal:
            break
        for direction, (d_row, d_col) in DIRECTION_OFFSETS.items():
            nxt = (cell[0] + d_row, cell[1] + d_col)
            if nxt in seen or not (0 <= nxt[0] < size and 0 <= nxt[1] < size) or walls[nxt]:
                continue
            seen.add(nxt)
            came_from[nxt] = (cell, direction)
            frontier.append(nxt)
    if goal not in seen:
        raise ValueError(f"goal {goal} is not reachable from start {start}")
    directions: list[int] = []
    cell = goal
    while cell != start:
        cell, direction = came_from[cell]
        directions.append(direction)
    return tuple(reversed(directions))


# --- generation ----------------------------------------------------------------------------------

def validate_size(size: int) -> None:
    if not _is_integer(size) or size < 5 or size % 2 == 0:
        raise ValueError(f"maze size must be an odd integer >= 5 (it includes the wall border), got {size!r}")


@functools.lru_cache(maxsize=None)
def _room_neighbours(rooms_per_side: int) -> tuple[tuple[int, ...], ...]:
    """Neighbouring room indices of each room (rooms numbered row-major), for a side of that many rooms."""
    neighbours = []
    for room in range(rooms_per_side * rooms_per_side):
        row, col = divmod(room, rooms_per_side)
        adjacent = []
        for d_row, d_col in DIRECTION_OFFSETS.values():
            r, c = row + d_row, col + d_col
            if 0 <= r < rooms_per_side and 0 <= c < rooms_per_side:
                adjacent.append(r * rooms_per_side + c)
        neighbours.append(tuple(adjacent))
    return tuple(neighbours)


class _UniformStream:
    """Uniform [0, 1) floats drawn from a Generator in blocks.

    One Generator call per random-walk step costs more than the walk itself; blocks keep generation
    fast while staying a pure function of the Generator's state.
    """

    BLOCK = 64

    def __init__(self, rng: np.random.Generator) -> None:
        self._rng = rng
        self._values: list[float] = []
        self._next = 0

    def below(self, bound: int) -> int:
        """A uniform integer in [0, bound)."""
        if self._next == len(self._values):
            self._values = self._rng.random(self.BLOCK).tolist()
            self._next = 0
        value = self._values[self._next]
        self._next += 1
        return int(value * bound)


def _wilson_tree(rooms_per_side: int, rng: np.random.Generator) -> list[tuple[int, int]]:
    """Edges (room, room) of a uniform spanning tree over the room grid, by Wilson's algorithm."""
    neighbours = _room_neighbours(rooms_per_side)
    room_count = rooms_per_side * rooms_per_side
    # Walks may start from the rooms in any order without biasing the tree; a random order
    # also picks the random root.
    order = rng.permutation(room_count).tolist()
    uniforms = _UniformStream(rng)
    in_tree = [False] * room_count
    in_tree[order[0]] = True
    exit_to = [-1] * room_count
    edges: list[tuple[int, int]] = []
    for first in order[1:]:
        if in_tree[first]:
            continue
        # Random walk until the tree is hit. Remembering only the last exit from each room erases
        # the walk's loops implicitly.
        room = first
        while not in_tree[room]:
            options = neighbours[room]
            exit_to[room] = options[uniforms.below(len(options))]
            room = exit_to[room]
        room = first
        while not in_tree[room]:
            in_tree[room] = True
            edges.append((room, exit_to[room]))
            room = exit_to[room]
    return edges


def _carve(size: int, edges: list[tuple[int, int]]) -> np.ndarray:
    rooms_per_side = (size - 1) // 2
    walls = np.ones((size, size), dtype=bool)
    walls[1:-1:2, 1:-1:2] = False
    for a, b in edges:
        (row_a, col_a), (row_b, col_b) = divmod(a, rooms_per_side), divmod(b, rooms_per_side)
        # The passage cell sits halfway between the two rooms' grid cells.
        walls[row_a + row_b + 1, col_a + col_b + 1] = False
    return walls


def _corner_pairs(size: int) -> tuple[tuple[Cell, Cell], ...]:
    """The four (start, goal) choices: opposite interior corners, either way round."""
    near, far = 1, size - 2
    return (
        ((near, near), (far, far)), ((far, far), (near, near)),
        ((far, near), (near, far)), ((near, far), (far, near)),
    )


def generate_maze(seed: int, size: int = 9) -> Maze:
    """The maze for ``seed``: a perfect maze of ``size``×``size`` grid cells (border included)."""
    validate_size(size)
    rng = np.random.default_rng(seed)
    edges = _wilson_tree((size - 1) // 2, rng)
    start, goal = _corner_pairs(size)[int(rng.integers(4))]
    return Maze(walls=_carve(size, edges), start=start, goal=goal, seed=int(seed))


def solvable_count(mazes: Iterable[Maze], max_turns: int) -> int:
    """How many of ``mazes`` a perfect player can solve within ``max_turns`` (the solve-rate bound)."""
    return sum(1 for maze in mazes if maze.solvable_within(max_turns))


# --- rendering -----------------------------------------------------------------------------------

_PALETTE = np.array([FLOOR_RGB, WALL_RGB], dtype=np.uint8)


@functools.lru_cache(maxsize=16)
def _cell_masks(cell_px: int) -> tuple[np.ndarray, np.ndarray]:
    """(goal square, agent circle) pixel masks of one cell; read-only because they are shared."""
    margin = max(1, round(cell_px * 0.08))
    goal = np.zeros((cell_px, cell_px), dtype=bool)
    goal[margin : cell_px - margin, margin : cell_px - margin] = True
    # Pixel centres inside a circle of radius cell_px/4 around the cell centre (VisGym: 6.25 px at 25 px).
    centres = np.arange(cell_px) + 0.5 - cell_px / 2
    agent = centres[:, None] ** 2 + centres[None, :] ** 2 <= (cell_px / 4) ** 2
    goal.flags.writeable = False
    agent.flags.writeable = False
    return goal, agent


def render(maze: Maze, agent: Cell, cell_px: int = 25) -> np.ndarray:
    """The picture the model sees: uint8 RGB of shape [size*cell_px, size*cell_px, 3]."""
    if not _is_integer(cell_px) or cell_px < 4:
        raise ValueError(f"cell_px must be an integer >= 4, got {cell_px!r}")
    if not maze.is_open(tuple(agent)):
        raise ValueError(f"agent {tuple(agent)} is not an open cell of the maze")
    # Widen each grid row into one pixel row, then repeat whole rows: both copies move contiguous
    # runs, about 20x faster than one broadcast copy whose innermost axis is the 3 colour channels.
    pixel_rows = np.repeat(_PALETTE[maze.walls.view(np.uint8)], cell_px, axis=1)
    image = np.repeat(pixel_rows, cell_px, axis=0)
    goal_mask, agent_mask = _cell_masks(cell_px)
    _paint(image, maze.goal, goal_mask, GOAL_RGB, cell_px)
    _paint(image, agent, agent_mask, AGENT_RGB, cell_px)
    return image


def _paint(image: np.ndarray, cell: Cell, mask: np.ndarray, rgb: tuple[int, int, int], cell_px: int) -> None:
    row, col = cell
    block = image[row * cell_px : (row + 1) * cell_px, col * cell_px : (col + 1) * cell_px]
    block[mask] = rgb


def render_image(maze: Maze, agent: Cell, cell_px: int = 25) -> Image.Image:
    return Image.fromarray(render(maze, agent, cell_px))  # uint8 [H, W, 3] is read as RGB


# --- episodes ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class StepResult:
    feedback: str
    reward: float
    done: bool
    outcome: str | None


class MazeEpisode:
    """One agent playing one maze for at most ``max_turns`` actions."""

    def __init__(self, maze: Maze, max_turns: int) -> None:
        if not _is_integer(max_turns) or max_turns < 1:
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

    def _finish(self, outcome: str, reward: float) -> None:
        self.done = True
        self.outcome = outcome
        self.reward = reward
