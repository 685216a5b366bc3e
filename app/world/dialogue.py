"""The conversation with the model: prompt text, chat messages per turn, and the action grammar.

This is the one place that says what the model reads and how its replies become actions. Rollouts,
evaluation, SFT data and the serving client all go through it, so a change here changes all of them
together.

The action grammar is VisGym's: Python-tuple strings ``('move', d)`` with d = 0 right, 1 up,
2 left, 3 down, and ``('stop', 'stop')``. Messages use the HF/OpenAI content-list style with
``{"type": "image"}`` placeholders where the caller attaches the rendered maze.
"""

from __future__ import annotations

import re

from app.world.maze import DIRECTION_NAMES, DIRECTION_OFFSETS, Action, Maze

SYSTEM_PROMPT = "You are an agent that walks through a maze shown in pictures, one action per reply."

# Only the tail of a reply is parsed: the action the model commits to comes last, and a cap keeps
# the work per reply bounded however long the model rambles.
PARSE_WINDOW_CHARS = 4096

# Every repetition in these patterns is separated by fixed literals and no match can contain a "(",
# so matches tried from different "(" never re-scan the same characters: the scan is linear.
_QUOTED = r"""(?P<{name}>['"]){word}(?P={name})"""
_MOVE = (
    r"\(\s*" + _QUOTED.format(name="q1", word="move") + r"\s*,\s*"
    r"""(?:(?P<q2>['"])(?P<quoted_direction>[0-3])(?P=q2)|(?P<direction>[0-3]))\s*\)"""
)
_STOP = r"\(\s*{first}\s*,\s*{second}\s*\)".format(
    first=_QUOTED.format(name="q3", word="stop"), second=_QUOTED.format(name="q4", word="stop")
)
_ACTION_PATTERN = re.compile(f"(?P<move>{_MOVE})|(?P<stop>{_STOP})")


def format_action(action: Action) -> str:
    """The canonical text of an action: ``('move', 0)`` or ``('stop', 'stop')``."""
    if action.kind == "stop":
        return "('stop', 'stop')"
    return f"('move', {action.direction})"


def parse_action(text: str) -> Action | None:
    """The last well-formed action in ``text``, or None when there is none.

    Accepts any input and never raises: a reply that does not parse is an invalid action in the
    environment, not an error. Whitespace, either quote style and a quoted direction are tolerated.
    """
    if not isinstance(text, str):
        return None
    last = None
    for last in _ACTION_PATTERN.finditer(text[-PARSE_WINDOW_CHARS:]):
        pass
    if last is None:
        return None
    if last.group("stop") is not None:
        return Action.stop()
    direction = last.group("direction") or last.group("quoted_direction")
    return Action.move(int(direction))


def dropped_turns(observations: int, turn_history: int) -> int:
    """How many of the oldest (reply, observation) turns leave the context, when only the last `turn_history`
    observations (each with the reply that led to it) stay after the opening; 0 keeps every turn.

    The task statement and the current picture carry everything a maze policy needs (the task is Markov in
    the picture), so a short window keeps contexts, rollouts and training sequences short and the same
    length at every turn. Rollouts, SFT and the serving client all drop turns by this one rule.
    """
    return max(0, observations - turn_history) if turn_history else 0


OPEN_MOVES_QUESTION = (
    "Which moves can you make from where you stand without bumping into a wall? Reply with each of them."
)


def open_moves_reply(maze: Maze, position: tuple[int, int]) -> str:
    """The answer to OPEN_MOVES_QUESTION, in the action grammar: every move that would not hit a wall."""
    row, col = position
    return " ".join(
        format_action(Action.move(d)) for d, (dr, dc) in DIRECTION_OFFSETS.items() if maze.is_open((row + dr, col + dc))
    )


def demo_reply(action: Action) -> str:
    """The supervised target text for ``action`` (SFT from the BFS solver)."""
    return format_action(action)


def solver_actions(maze: Maze) -> list[Action]:
    """A shortest solution: the BFS moves, then stop on the goal."""
    return [Action.move(direction) for direction in maze.shortest_path()] + [Action.stop()]


def _direction_legend() -> str:
    return ", ".join(f"{number} {name}" for number, name in DIRECTION_NAMES.items())


ON_GOAL_TEXT = "You are on the goal."


def compass_text(position: tuple[int, int], goal: tuple[int, int]) -> str:
    """Where the goal lies from the agent (the `compass` observation variant; VisGym gives no such hint)."""
    rows, cols = goal[0] - position[0], goal[1] - position[1]
    if rows == 0 and cols == 0:
        return ON_GOAL_TEXT
    parts = []
    if rows:
        parts.append(f"{abs(rows)} {'row' if abs(rows) == 1 else 'rows'} {'down' if rows > 0 else 'up'}")
    if cols:
        parts.append(f"{abs(cols)} {'column' if abs(cols) == 1 else 'columns'} {'right' if cols > 0 else 'left'}")
    return "The goal is " + " and ".join(parts) + "."


def route_text(maze: Maze, position: tuple[int, int]) -> str:
    """Which way a shortest path to the goal starts (the `route` observation variant: a blind agent can win)."""
    path = maze.path_from(position)
    if not path:
        return ON_GOAL_TEXT
    return route_hint(path[0])


def route_hint(direction: int) -> str:
    return f"The way to the goal starts {DIRECTION_NAMES[direction]}."


def where_text(feedback: str, maze: Maze, position: tuple[int, int]) -> str | None:
    """The hint the observation variant adds after VisGym's text: none, the compass, or the route."""
    if feedback == "compass":
        return compass_text(position, maze.goal)
    if feedback == "route":
        return route_text(maze, position)
    return None


def first_turn_text(max_turns: int, maze_size: int, where: str | None = None) -> str:
    """The task statement that goes with the first picture (plus coordinates when given)."""
    return _with_where(
        (
            f"This picture is a {maze_size}x{maze_size} maze: grey cells are walls, white cells are floor, "
            "the blue circle is you and the red square is the goal. "
            f"Reply with exactly one action per turn: ('move', d) with d = {_direction_legend()}; "
            "or ('stop', 'stop'). Each move goes one cell; walls block moves. "
            "You win only by saying stop while standing on the goal. "
            f"You have {max_turns} turns."
        ),
        where,
    )


def _with_where(text: str, where: str | None) -> str:
    return f"{text} {where}" if where else text


def _turns_left_text(turns_left: int) -> str:
    if turns_left <= 0:
        return "You have no turns left."
    if turns_left == 1:
        return "You have 1 turn left."
    return f"You have {turns_left} turns left."


def observation_text(feedback: str, turns_left: int, where: str | None = None) -> str:
    """What follows each action: the environment's feedback (and coordinates) and the turn budget."""
    middle = f" {where}" if where else ""
    return f"{feedback}{middle} {_turns_left_text(turns_left)} Your next action?"


def _image_part() -> dict:
    # A placeholder: the caller attaches the rendered maze for this turn.
    return {"type": "image"}


def _text_part(text: str) -> dict:
    return {"type": "text", "text": text}


def system_message() -> dict:
    return {"role": "system", "content": [_text_part(SYSTEM_PROMPT)]}


def first_user_message(max_turns: int, maze_size: int, where: str | None = None) -> dict:
    return {"role": "user", "content": [_image_part(), _text_part(first_turn_text(max_turns, maze_size, where))]}


def observation_message(feedback: str, turns_left: int, where: str | None = None) -> dict:
    return {"role": "user", "content": [_image_part(), _text_part(observation_text(feedback, turns_left, where))]}


def assistant_message(text: str) -> dict:
    return {"role": "assistant", "content": [_text_part(text)]}
