"""Why a policy fails: every turn of a played episode put in one class, from the maze and the actions alone.

The evaluator says how many held-out mazes a policy solves; this says what went wrong in the others. A
turn is one of:

    toward        an open move that brings the agent one step closer to the goal (along a shortest path)
    away          an open move that does not (a planning error: the agent saw an opening, the wrong one)
    bump          a move into a wall after any other action (a perception error: it did not see the wall)
    repeat_bump   the same move into the same wall as the turn before (a loop: the feedback went unheeded)
    invalid       a reply that does not parse
    stop_goal     stop on the goal (solved)
    stop_off_goal stop anywhere else

Moves tried are also counted by where the agent stood: in a passage between two rooms the open moves follow from
the position alone, in a room they take seeing which passages are carved (`first_try_open_room`), so a policy can
know positions and still not see walls.

It works on what the evaluator already writes (per maze: seed and parsed actions, `app.observe.evaluation`), so it
runs on any past eval report as well as on a fresh greedy play (`scripts/diagnose.py`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from app.world.dialogue import parse_action
from app.world.maze import DIRECTION_OFFSETS, Maze, generate_maze, is_room

TURN_CLASSES = ("toward", "away", "bump", "repeat_bump", "invalid", "stop_goal", "stop_off_goal")


@dataclass(frozen=True)
class EpisodeDiagnosis:
    turns: tuple[str, ...]  # one class per turn (TURN_CLASSES)
    in_room: tuple[bool, ...]  # per turn: the agent stood in a room (not a passage) when it acted
    solved: bool
    looped: bool  # ended with at least 3 turns bumping the same wall in a row


def distances_to_goal(maze: Maze) -> dict[tuple[int, int], int]:
    """Moves from every open cell to the goal (BFS from the goal; walls block both ways)."""
    dist, frontier = {maze.goal: 0}, [maze.goal]
    while frontier:
        nxt = []
        for row, col in frontier:
            for d_row, d_col in DIRECTION_OFFSETS.values():
                cell = (row + d_row, col + d_col)
                if cell not in dist and maze.is_open(cell):
                    dist[cell] = dist[(row, col)] + 1
                    nxt.append(cell)
        frontier = nxt
    return dist


def diagnose_episode(maze: Maze, actions: list[str | None]) -> EpisodeDiagnosis:
    """Replays `actions` (canonical action texts, None for a reply that did not parse) from the maze's start."""
    dist = distances_to_goal(maze)
    position, previous, classes, rooms, repeats = maze.start, None, [], [], 0
    solved = False
    for text in actions:
        rooms.append(is_room(position))
        action = parse_action(text) if text is not None else None
        if action is None:
            cls = "invalid"
        elif action.kind == "stop":
            solved = position == maze.goal
            cls = "stop_goal" if solved else "stop_off_goal"
        else:
            d_row, d_col = DIRECTION_OFFSETS[action.direction]
            target = (position[0] + d_row, position[1] + d_col)
            if not maze.is_open(target):
                cls = "repeat_bump" if previous == (position, action.direction) else "bump"
                previous = (position, action.direction)
            else:
                cls = "toward" if dist[target] < dist[position] else "away"
                position, previous = target, None
        if cls not in ("bump", "repeat_bump"):
            previous = None
        repeats = repeats + 1 if cls == "repeat_bump" else 0  # the current run of the same bump
        classes.append(cls)
        if cls.startswith("stop"):
            break
    return EpisodeDiagnosis(tuple(classes), tuple(rooms), solved, looped=repeats >= 2)


def diagnose_report(report: dict, maze_size: int) -> dict:
    """Turn classes and loops over an eval report's mazes (`app.observe.evaluation.eval_report` or its JSON)."""

    counts: Counter[str] = Counter()
    in_rooms: Counter[str] = Counter()  # the same classes, counting only turns taken in a room
    episodes = []
    for played in report["mazes"]:
        maze = generate_maze(played["seed"], maze_size)
        if played.get("maze_id", maze.identity) != maze.identity:
            raise ValueError(
                f"maze seed {played['seed']} at size {maze_size} is not the maze the report played: "
                "pass the run's maze.size"
            )
        episodes.append(diagnose_episode(maze, played["actions"]))
    for episode in episodes:
        counts.update(episode.turns)
        in_rooms.update(c for c, room in zip(episode.turns, episode.in_room) if room)
    turns = max(sum(counts.values()), 1)
    moves_seen = counts["toward"] + counts["away"] + counts["bump"]
    room_moves = in_rooms["toward"] + in_rooms["away"] + in_rooms["bump"]
    unsolved = [e for e in episodes if not e.solved]
    return {
        "mazes": len(episodes),
        "solved": sum(e.solved for e in episodes),
        "turns": sum(counts.values()),
        **{f"share_{c}": counts[c] / turns for c in TURN_CLASSES},
        # Of the first-time decisions to move, how often the chosen way was open / was the right way:
        "first_try_open": (counts["toward"] + counts["away"]) / max(moves_seen, 1),
        "first_try_toward": counts["toward"] / max(moves_seen, 1),
        "first_try_open_room": (in_rooms["toward"] + in_rooms["away"]) / max(room_moves, 1),
        "unsolved_looping": sum(e.looped for e in unsolved),
        "unsolved": len(unsolved),
    }


def diagnosis_metrics(report: dict, maze_size: int) -> dict:
    """The evaluator's extra metrics: the turn-class shares and the rates that say perception (open, open from rooms)
    or planning (toward)."""
    found = diagnose_report(report, maze_size)
    keep = [f"share_{c}" for c in TURN_CLASSES] + [
        "first_try_open",
        "first_try_toward",
        "first_try_open_room",
        "unsolved_looping",
    ]
    return {f"why_{k}": found[k] for k in keep}
