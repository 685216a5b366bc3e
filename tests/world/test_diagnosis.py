"""app.world.diagnosis: every turn of an episode classed from the maze and the actions, checked against the game."""

from __future__ import annotations

import numpy as np
import pytest

from app.world.diagnosis import TURN_CLASSES, diagnose_episode, diagnose_report, diagnosis_metrics, distances_to_goal
from app.world.dialogue import format_action, parse_action
from app.world.episode import MazeEpisode
from app.world.maze import DIRECTION_OFFSETS, Action, generate_maze, is_room


def move(direction: int) -> str:
    return format_action(Action.move(direction))


STOP = format_action(Action.stop())


def walled(maze, cell) -> list[int]:
    return [d for d, (dr, dc) in DIRECTION_OFFSETS.items() if not maze.is_open((cell[0] + dr, cell[1] + dc))]


def test_distances_match_the_solver():
    for seed in range(20):
        maze = generate_maze(seed, 7)
        dist = distances_to_goal(maze)
        assert set(dist) == set(maze.open_cells())
        for cell in maze.open_cells():
            assert dist[cell] == len(maze.path_from(cell))


def test_the_solver_path_is_all_toward_then_solved():
    maze = generate_maze(3, 7)
    found = diagnose_episode(maze, [move(d) for d in maze.shortest_path()] + [STOP])
    assert found.turns == ("toward",) * maze.shortest_path_length + ("stop_goal",)
    assert found.solved and not found.looped


def test_bumps_repeats_loops_invalid_and_stops():
    maze = generate_maze(5, 7)
    blocked = walled(maze, maze.start)
    assert len(blocked) >= 2  # a corner start has the border on two sides
    same = diagnose_episode(maze, [move(blocked[0])] * 4)
    assert same.turns == ("bump", "repeat_bump", "repeat_bump", "repeat_bump") and same.looped
    alternating = diagnose_episode(maze, [move(blocked[0]), move(blocked[1])] * 3)
    assert alternating.turns == ("bump",) * 6 and not alternating.looped  # different walls: not a repeat
    mixed = diagnose_episode(maze, [None, move(blocked[0]), None, move(blocked[0]), STOP, move(blocked[0])])
    assert mixed.turns == ("invalid", "bump", "invalid", "bump", "stop_off_goal")  # nothing counts after a stop
    assert not mixed.solved


def test_an_open_move_off_the_shortest_path_is_away():
    for seed in range(200):
        maze = generate_maze(seed, 7)
        dist = distances_to_goal(maze)
        row, col = maze.start
        away = [
            d
            for d, (dr, dc) in DIRECTION_OFFSETS.items()
            if maze.is_open((row + dr, col + dc)) and dist[(row + dr, col + dc)] > dist[maze.start]
        ]
        if away:
            back = (away[0] + 2) % 4  # right<->left, up<->down
            found = diagnose_episode(maze, [move(away[0]), move(back)])
            assert found.turns == ("away", "toward")
            return
    pytest.fail("no maze with a dead end at its start in 200 seeds")


def test_classes_agree_with_the_game_on_random_play():
    rng = np.random.default_rng(0)
    report, room_tries, room_moves = {"mazes": []}, [], []
    for seed in range(30):
        maze = generate_maze(seed, 7)
        episode, actions = MazeEpisode(maze, 25), []
        while not episode.done:
            pick = rng.integers(6)
            action = (
                None if pick == 5 else Action.stop() if pick == 4 and rng.random() < 0.2 else Action.move(int(pick % 4))
            )
            actions.append(None if action is None else format_action(action))
            episode.step(action)
        found = diagnose_episode(maze, actions)
        assert len(found.turns) == len(found.in_room) == episode.turns
        replay, rooms = MazeEpisode(maze, 25), []  # where the game had the agent when it acted
        for text in actions:
            rooms.append(is_room(replay.position))
            replay.step(parse_action(text) if text is not None else None)
        assert found.in_room == tuple(rooms)
        room_attempts = [c for c, room in zip(found.turns, found.in_room) if room and c in ("toward", "away", "bump")]
        room_tries.append(sum(c != "bump" for c in room_attempts))
        room_moves.append(len(room_attempts))
        assert sum(c in ("bump", "repeat_bump", "invalid") for c in found.turns) == episode.invalid_actions
        assert sum(c in ("toward", "away") for c in found.turns) == episode.moves
        assert found.solved == (episode.outcome == "solved")
        report["mazes"].append({"seed": seed, "maze_id": maze.identity, "actions": actions})
    summary = diagnose_report(report, 7)
    assert summary["mazes"] == 30 and summary["turns"] > 30
    assert sum(summary[f"share_{c}"] for c in TURN_CLASSES) == pytest.approx(1.0)
    assert 0 < summary["first_try_toward"] < summary["first_try_open"] < 1
    assert summary["first_try_open_room"] == pytest.approx(sum(room_tries) / sum(room_moves))
    metrics = diagnosis_metrics(report, 7)
    assert metrics["why_first_try_open"] == summary["first_try_open"] and all(k.startswith("why_") for k in metrics)
    assert metrics["why_first_try_open_room"] == summary["first_try_open_room"]


def test_a_policy_that_knows_passages_but_not_rooms_sees_no_walls_in_rooms():
    """From a passage it moves on along it; in a room it bumps first: open attempts are high overall, nil in rooms."""
    maze = generate_maze(6, 7)
    dist = distances_to_goal(maze)
    position, actions = maze.start, []
    while position != maze.goal:
        if is_room(position):
            actions.append(move(walled(maze, position)[0]))  # every room on this path has a wall
        onward = next(
            d
            for d, (dr, dc) in DIRECTION_OFFSETS.items()
            if maze.is_open((position[0] + dr, position[1] + dc))
            and dist[(position[0] + dr, position[1] + dc)] < dist[position]
        )
        actions.append(move(onward))
        position = (position[0] + DIRECTION_OFFSETS[onward][0], position[1] + DIRECTION_OFFSETS[onward][1])
    summary = diagnose_report({"mazes": [{"seed": 6, "maze_id": maze.identity, "actions": actions + [STOP]}]}, 7)
    rooms_visited = maze.shortest_path_length // 2  # the path alternates room, passage, room, ...
    assert summary["first_try_open_room"] == pytest.approx(rooms_visited / (2 * rooms_visited))
    assert summary["first_try_open"] > summary["first_try_open_room"] and summary["solved"] == 1


def test_a_report_of_another_maze_size_is_refused():
    maze = generate_maze(4, 7)
    with pytest.raises(ValueError, match="maze.size"):
        diagnose_report({"mazes": [{"seed": 4, "maze_id": maze.identity, "actions": [STOP]}]}, 9)
