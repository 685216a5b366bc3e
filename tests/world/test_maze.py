"""Tests for app.world.maze: generation, identity, BFS, episode semantics and rendering."""

from __future__ import annotations

import pickle
from collections import deque

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.world.dialogue import format_action, parse_action, solver_actions
from app.world.episode import (
    INVALID_ACTION_FEEDBACK,
    OUT_OF_TURNS,
    OUT_OF_TURNS_SUFFIX,
    SOLVED,
    SOLVED_FEEDBACK,
    STOPPED_OFF_GOAL,
    STOPPED_OFF_GOAL_FEEDBACK,
    MazeEpisode,
    moved_feedback,
    wall_feedback,
)
from app.world.maze import (
    DIRECTION_OFFSETS,
    DOWN,
    RIGHT,
    UP,
    Action,
    Maze,
    generate_maze,
    is_room,
    solvable_count,
)
from app.world.render import AGENT_RGB, FLOOR_RGB, GOAL_RGB, WALL_RGB, render, render_image

SIZES = [5, 7, 9, 11, 13]
seeds = st.integers(min_value=0, max_value=2**63 - 1)
sizes = st.sampled_from(SIZES)
fast = settings(max_examples=40, deadline=None)

# Changes whenever the generator, the corner choice or the identity hash changes. Such a change
# reshuffles which training seeds collide with the eval set, so it must be deliberate.
SEED_0_SIZE_9_IDENTITY = "9b21f118e9fc5ae9e668ec1fbe0751978d8044ee13b7d5ace907ab29a17da694"


def room_cells(size: int) -> list[tuple[int, int]]:
    return [(r, c) for r in range(1, size - 1, 2) for c in range(1, size - 1, 2)]


def reachable_open_cells(maze: Maze, origin: tuple[int, int]) -> set[tuple[int, int]]:
    seen = {origin}
    frontier = deque([origin])
    while frontier:
        row, col = frontier.popleft()
        for d_row, d_col in DIRECTION_OFFSETS.values():
            nxt = (row + d_row, col + d_col)
            if nxt not in seen and maze.is_open(nxt):
                seen.add(nxt)
                frontier.append(nxt)
    return seen


def replay(maze: Maze, directions: list[int]) -> tuple[tuple[int, int], int]:
    """Final cell and number of wall bumps after walking ``directions`` from the start."""
    episode = MazeEpisode(maze, max_turns=len(directions) + 1)
    for direction in directions:
        episode.step(Action.move(direction))
    return episode.position, episode.invalid_actions


def corridor_maze() -> Maze:
    """A hand-made 5x5 maze: start (1,1), goal (3,3), path right-right-down-down."""
    walls = np.ones((5, 5), dtype=bool)
    for cell in [(1, 1), (1, 2), (1, 3), (2, 3), (3, 3), (3, 1)]:
        walls[cell] = False
    return Maze(walls=walls, start=(1, 1), goal=(3, 3), seed=-1)


# --- generation ------------------------------------------------------------------------------


@fast
@given(seed=seeds, size=sizes)
def test_same_seed_gives_same_maze(seed: int, size: int) -> None:
    first, second = generate_maze(seed, size), generate_maze(seed, size)
    assert np.array_equal(first.walls, second.walls)
    assert (first.start, first.goal, first.identity) == (second.start, second.goal, second.identity)
    assert first == second


def test_different_seeds_give_different_mazes() -> None:
    identities = {generate_maze(seed).identity for seed in range(200)}
    assert len(identities) == 200


@fast
@given(seed=seeds, size=sizes)
def test_maze_is_perfect(seed: int, size: int) -> None:
    maze = generate_maze(seed, size)
    rooms = room_cells(size)
    assert maze.walls.shape == (size, size)
    border = np.ones((size, size), dtype=bool)
    border[1:-1, 1:-1] = False
    assert maze.walls[border].all()
    assert maze.walls[::2, ::2].all(), "cells at even/even coordinates are always wall"
    assert not any(maze.walls[cell] for cell in rooms)
    # Connected, with exactly rooms-1 passages: a spanning tree, hence no cycles.
    assert reachable_open_cells(maze, rooms[0]) == set(zip(*np.nonzero(~maze.walls)))
    passages = int((~maze.walls).sum()) - len(rooms)
    assert passages == len(rooms) - 1


@fast
@given(seed=seeds, size=sizes)
def test_start_and_goal_are_opposite_corners(seed: int, size: int) -> None:
    maze = generate_maze(seed, size)
    far = size - 2
    assert maze.start in {(1, 1), (1, far), (far, 1), (far, far)}
    assert maze.goal == (far + 1 - maze.start[0], far + 1 - maze.start[1])


def test_all_four_corner_pairs_occur() -> None:
    pairs = {(generate_maze(seed).start, generate_maze(seed).goal) for seed in range(100)}
    assert len(pairs) == 4


@pytest.mark.parametrize("bad_size", [4, 3, 1, 8, -9, 9.0, True, "9"])
def test_bad_size_is_rejected(bad_size) -> None:
    with pytest.raises(ValueError, match="odd integer >= 5"):
        generate_maze(0, bad_size)


def test_walls_are_read_only() -> None:
    maze = generate_maze(0)
    with pytest.raises(ValueError):
        maze.walls[0, 0] = False


def test_maze_survives_pickling_with_read_only_walls() -> None:
    # Mazes cross Ray actors by pickle.
    maze = generate_maze(5, 11)
    copy = pickle.loads(pickle.dumps(maze))
    assert copy == maze and copy.identity == maze.identity
    assert not copy.walls.flags.writeable


# --- identity --------------------------------------------------------------------------------


def test_identity_is_pinned() -> None:
    assert generate_maze(0, 9).identity == SEED_0_SIZE_9_IDENTITY


def test_identity_ignores_the_seed_but_not_the_layout() -> None:
    maze = generate_maze(3)
    twin = Maze(walls=maze.walls.copy(), start=maze.start, goal=maze.goal, seed=999)
    assert twin.identity == maze.identity
    assert twin != maze  # still different Maze values: the seed differs

    swapped = Maze(walls=maze.walls, start=maze.goal, goal=maze.start, seed=maze.seed)
    assert swapped.identity != maze.identity

    walls = maze.walls.copy()
    walls[1, 2] = not walls[1, 2]
    altered = Maze(walls=walls, start=maze.start, goal=maze.goal, seed=maze.seed)
    assert altered.identity != maze.identity


def test_identity_differs_between_sizes() -> None:
    assert generate_maze(0, 7).identity != generate_maze(0, 9).identity


# --- shortest path ---------------------------------------------------------------------------


@fast
@given(seed=seeds, size=sizes)
def test_shortest_path_is_even_and_reaches_the_goal(seed: int, size: int) -> None:
    maze = generate_maze(seed, size)
    path = maze.shortest_path()
    assert len(path) == maze.shortest_path_length
    assert len(path) % 2 == 0
    assert len(path) >= 2 * (size - 3), "at least the Manhattan distance between opposite corners"
    position, bumps = replay(maze, path)
    assert position == maze.goal
    assert bumps == 0


def test_nine_by_nine_paths_are_at_least_twelve_moves() -> None:
    lengths = {generate_maze(seed).shortest_path_length for seed in range(64)}
    assert min(lengths) == 12
    assert all(length % 2 == 0 for length in lengths)


def test_solvable_within_counts_the_final_stop() -> None:
    maze = corridor_maze()
    assert maze.shortest_path() == [RIGHT, RIGHT, DOWN, DOWN]
    assert maze.solvable_within(5)
    assert not maze.solvable_within(4)
    assert solvable_count([maze, maze], 5) == 2
    assert solvable_count([maze, maze], 4) == 0


# --- actions and episodes --------------------------------------------------------------------


@pytest.mark.parametrize("bad", [-1, 4, None, 1.0, True, "1"])
def test_action_move_rejects_bad_directions(bad) -> None:
    with pytest.raises(ValueError):
        Action.move(bad)


def test_action_rejects_unknown_kinds() -> None:
    with pytest.raises(ValueError):
        Action("jump", 1)
    with pytest.raises(ValueError):
        Action("stop", 1)


def test_solved_when_stopping_on_the_goal() -> None:
    episode = MazeEpisode(corridor_maze(), max_turns=10)
    for direction in [RIGHT, RIGHT, DOWN]:
        result = episode.step(Action.move(direction))
        assert result.feedback == moved_feedback(direction)
        assert (result.reward, result.done, result.outcome) == (0.0, False, None)
    result = episode.step(Action.move(DOWN))
    assert episode.position == (3, 3)
    assert not result.done, "reaching the goal does not end the episode"
    result = episode.step(Action.stop())
    assert (result.feedback, result.reward, result.done) == (SOLVED_FEEDBACK, 1.0, True)
    assert result.outcome == episode.outcome == SOLVED
    assert (episode.turns, episode.moves, episode.invalid_actions, episode.reward) == (5, 4, 0, 1.0)


def test_walking_over_the_goal_then_stopping_elsewhere_fails() -> None:
    episode = MazeEpisode(corridor_maze(), max_turns=10)
    for direction in [RIGHT, RIGHT, DOWN, DOWN, UP]:
        episode.step(Action.move(direction))
    result = episode.step(Action.stop())
    assert (result.feedback, result.reward, result.done, result.outcome) == (
        STOPPED_OFF_GOAL_FEEDBACK,
        0.0,
        True,
        STOPPED_OFF_GOAL,
    )


def test_wall_bump_and_invalid_action_only_use_a_turn() -> None:
    episode = MazeEpisode(corridor_maze(), max_turns=10)
    result = episode.step(Action.move(UP))
    assert result.feedback == wall_feedback(UP)
    assert "wall" in result.feedback and "up" in result.feedback
    result = episode.step(None)
    assert result.feedback == INVALID_ACTION_FEEDBACK
    assert episode.position == (1, 1)
    assert (episode.turns, episode.moves, episode.invalid_actions, episode.done) == (2, 0, 2, False)
    assert episode.turns_left == 8


def test_out_of_turns_ends_the_episode() -> None:
    episode = MazeEpisode(corridor_maze(), max_turns=4)
    for direction in [RIGHT, RIGHT, DOWN]:
        assert not episode.step(Action.move(direction)).done
    result = episode.step(Action.move(DOWN))  # lands on the goal with the last turn, but never stops
    assert result.feedback == moved_feedback(DOWN) + OUT_OF_TURNS_SUFFIX
    assert (result.reward, result.done, result.outcome) == (0.0, True, OUT_OF_TURNS)
    assert episode.position == episode.maze.goal


def test_last_turn_stop_on_goal_still_solves() -> None:
    episode = MazeEpisode(corridor_maze(), max_turns=5)
    for direction in [RIGHT, RIGHT, DOWN, DOWN]:
        episode.step(Action.move(direction))
    result = episode.step(Action.stop())
    assert episode.turns_left == 0
    assert (result.feedback, result.outcome, result.reward) == (SOLVED_FEEDBACK, SOLVED, 1.0)


def test_stepping_a_finished_episode_raises() -> None:
    episode = MazeEpisode(corridor_maze(), max_turns=3)
    episode.step(Action.stop())
    with pytest.raises(RuntimeError):
        episode.step(Action.move(RIGHT))


def test_bad_max_turns_is_rejected() -> None:
    with pytest.raises(ValueError):
        MazeEpisode(corridor_maze(), max_turns=0)


# --- rendering -------------------------------------------------------------------------------


def pixel_at(image: np.ndarray, cell: tuple[int, int], cell_px: int, offset: tuple[int, int]) -> tuple:
    return tuple(int(v) for v in image[cell[0] * cell_px + offset[0], cell[1] * cell_px + offset[1]])


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("cell_px", [25, 16])
def test_render_colours(size: int, cell_px: int) -> None:
    maze = generate_maze(7, size)
    agent = (maze.start[0], maze.start[1])
    image = render(maze, agent, cell_px)
    assert image.shape == (size * cell_px, size * cell_px, 3)
    assert image.dtype == np.uint8
    centre, corner = (cell_px // 2, cell_px // 2), (0, 0)
    open_cells = sorted(reachable_open_cells(maze, maze.start) - {maze.start, maze.goal})
    floor_cell = open_cells[0]
    assert pixel_at(image, (0, 0), cell_px, centre) == WALL_RGB
    assert pixel_at(image, floor_cell, cell_px, centre) == FLOOR_RGB
    assert pixel_at(image, maze.goal, cell_px, centre) == GOAL_RGB
    assert pixel_at(image, maze.goal, cell_px, corner) == FLOOR_RGB, "the goal square leaves a margin"
    assert pixel_at(image, agent, cell_px, centre) == AGENT_RGB
    assert pixel_at(image, agent, cell_px, corner) == FLOOR_RGB
    blue = np.all(image == AGENT_RGB, axis=-1)
    radius = np.sqrt(blue.sum() / np.pi)
    assert abs(radius - cell_px / 4) < 1.0


def test_agent_is_drawn_over_the_goal() -> None:
    maze = corridor_maze()
    image = render(maze, maze.goal, 25)
    assert pixel_at(image, maze.goal, 25, (12, 12)) == AGENT_RGB
    assert pixel_at(image, maze.goal, 25, (4, 4)) == GOAL_RGB


def test_render_does_not_leak_state_between_calls() -> None:
    maze = generate_maze(1)
    first = render(maze, maze.start).copy()
    render(maze, maze.goal)
    assert np.array_equal(render(maze, maze.start), first)


def test_render_image_and_episode_image_agree() -> None:
    maze = generate_maze(2)
    episode = MazeEpisode(maze, max_turns=5)
    picture = render_image(maze, maze.start)
    assert picture.size == (225, 225) and picture.mode == "RGB"
    assert np.array_equal(np.asarray(picture), episode.image(25))


def test_render_rejects_an_agent_in_a_wall() -> None:
    with pytest.raises(ValueError):
        render(generate_maze(0), (0, 0))


# --- the solver, speaking through the dialogue -----------------------------------------------


def play_through_dialogue(maze: Maze, max_turns: int) -> MazeEpisode:
    episode = MazeEpisode(maze, max_turns)
    for action in solver_actions(maze):
        if episode.done:
            break
        reply = f"I will go this way. {format_action(action)}"
        episode.step(parse_action(reply))
    return episode


def test_bfs_policy_solves_exactly_the_solvable_mazes() -> None:
    mazes = [generate_maze(seed, 9) for seed in range(10_000, 10_064)]
    bound = solvable_count(mazes, max_turns=15)
    assert 0 < bound < 64
    episodes = [play_through_dialogue(maze, max_turns=15) for maze in mazes]
    assert sum(episode.outcome == SOLVED for episode in episodes) == bound
    assert all(episode.done for episode in episodes)
    assert {episode.outcome for episode in episodes} == {SOLVED, OUT_OF_TURNS}
    assert all(episode.invalid_actions == 0 for episode in episodes)


def test_open_cells_are_the_floor_start_and_goal_included() -> None:
    maze = generate_maze(3, 7)
    cells = maze.open_cells()
    assert len(cells) == int((~maze.walls).sum()) == 17  # 9 rooms + the 8 passages of a spanning tree
    assert maze.start in cells and maze.goal in cells and all(maze.is_open(c) for c in cells)


@pytest.mark.parametrize("size", [7, 9])
def test_a_passage_is_open_along_its_two_rooms_and_walled_across_them(size: int) -> None:
    """Why the perception probe scores rooms and passages apart: in a passage the open moves follow from the position
    alone, in a room they depend on which passages were carved."""
    for seed in range(20):
        maze = generate_maze(seed, size)
        rooms = [cell for cell in maze.open_cells() if is_room(cell)]
        assert len(rooms) == ((size - 1) // 2) ** 2  # every room is open
        for row, col in maze.open_cells():
            if is_room((row, col)):
                continue
            along = [(0, 1), (0, -1)] if row % 2 == 1 else [(1, 0), (-1, 0)]
            across = [(1, 0), (-1, 0)] if row % 2 == 1 else [(0, 1), (0, -1)]
            assert all(maze.is_open((row + dr, col + dc)) and is_room((row + dr, col + dc)) for dr, dc in along)
            assert not any(maze.is_open((row + dr, col + dc)) for dr, dc in across)
