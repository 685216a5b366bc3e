"""The maze environment: VisGym maze_2d semantics in pure numpy.

A maze is a square grid of odd ``size`` that includes a wall border. Room cells sit at odd
(row, col) coordinates; the cells between two rooms are either walls or carved passages. The
interior is a perfect maze (a uniform spanning tree over the rooms, built with Wilson's
loop-erased random walks), and the start and goal sit in opposite interior corners. Everything
random comes from ``np.random.default_rng(seed)``, so a seed always gives the same maze.

How an agent plays one is app/world/episode.py; how it looks, app/world/render.py.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

RIGHT, UP, LEFT, DOWN = 0, 1, 2, 3
DIRECTION_NAMES = {RIGHT: "right", UP: "up", LEFT: "left", DOWN: "down"}
# (row, col) offset of one move in each direction; rows grow downwards, as in the image.
DIRECTION_OFFSETS = {RIGHT: (0, 1), UP: (-1, 0), LEFT: (0, -1), DOWN: (1, 0)}

Cell = tuple[int, int]


def is_integer(value: object) -> bool:
    """True for Python and numpy integers, but not for bools (True is an int to Python)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


@dataclass(frozen=True)
class Action:
    """One agent action: a move in a direction, or stop."""

    kind: str
    direction: int | None = None

    def __post_init__(self) -> None:
        # Validated here rather than only in the constructors so no malformed Action can exist.
        if self.kind == "move":
            direction = self.direction
            if not is_integer(direction) or direction not in DIRECTION_NAMES:
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
    if not is_integer(size) or size < 5 or size % 2 == 0:
        raise ValueError(f"maze size must be an odd integer >= 5 (it includes the wall border), got {size!r}")


@functools.cache
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
        ((near, near), (far, far)),
        ((far, far), (near, near)),
        ((far, near), (near, far)),
        ((near, far), (far, near)),
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
