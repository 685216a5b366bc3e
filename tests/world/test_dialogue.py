"""Tests for app.world.dialogue: the action grammar, its parser, and the prompt and message shapes."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.world import dialogue
from app.world.dialogue import (
    PARSE_WINDOW_CHARS,
    SYSTEM_PROMPT,
    assistant_message,
    demo_reply,
    first_turn_text,
    first_user_message,
    format_action,
    observation_message,
    observation_text,
    parse_action,
    solver_actions,
    system_message,
)
from app.world.episode import MazeEpisode
from app.world.maze import DIRECTION_NAMES, Action, generate_maze

ALL_ACTIONS = [Action.move(direction) for direction in range(4)] + [Action.stop()]
actions = st.sampled_from(ALL_ACTIONS)
# Every code point, lone surrogates and control characters included (hypothesis omits surrogates
# unless told otherwise).
any_text = st.text(alphabet=st.characters(exclude_categories=()))
fast = settings(max_examples=200, deadline=None)
NEAR_MISS_TOKENS = ["(", ")", "'", '"', ",", " ", "\t", "move", "stop", "0", "3", "4", "x"]


# --- format and parse ------------------------------------------------------------------------


@pytest.mark.parametrize("action", ALL_ACTIONS)
def test_round_trip(action: Action) -> None:
    assert parse_action(format_action(action)) == action


def test_canonical_formats() -> None:
    assert format_action(Action.move(0)) == "('move', 0)"
    assert format_action(Action.move(3)) == "('move', 3)"
    assert format_action(Action.stop()) == "('stop', 'stop')"
    assert demo_reply(Action.move(2)) == "('move', 2)"


def test_last_well_formed_action_wins() -> None:
    text = "First ('move', 0), no wait: ('move', 3). Actually ('stop', 'stop') then ('move', 9)."
    assert parse_action(text) == Action.stop()
    assert parse_action("('stop', 'stop') is wrong, so ('move', 1)") == Action.move(1)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("('move',2)", Action.move(2)),
        ("(  'move' ,\t1 )", Action.move(1)),
        ('("move", 3)', Action.move(3)),
        ("('move', '2')", Action.move(2)),
        ('("move", "0")', Action.move(0)),
        ("(\n'move',\n0\n)", Action.move(0)),
        ('("stop", "stop")', Action.stop()),
        ("('stop','stop')", Action.stop()),
        ("Answer: `('move', 1)`.", Action.move(1)),
        ("I think... ('move', 3)<|im_end|>", Action.move(3)),
    ],
)
def test_tolerated_variants(text: str, expected: Action) -> None:
    assert parse_action(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "",
        "('move', 4)",
        "('move', -1)",
        "('move', 12)",
        "'move', 1",
        "move 1",
        "('move' 1)",
        "('jump', 1)",
        "('stop')",
        "('stop', 'go')",
        "('move', '1\")",
        "('move\", 1)",
        "('Move', 1)",
        "right",
    ],
)
def test_rejected_variants(text: str) -> None:
    assert parse_action(text) is None


def test_non_string_input_is_not_an_action() -> None:
    assert parse_action(None) is None  # type: ignore[arg-type]
    assert parse_action(b"('move', 1)") is None  # type: ignore[arg-type]


def test_only_the_tail_of_a_long_reply_is_read() -> None:
    early = format_action(Action.move(1)) + " " * PARSE_WINDOW_CHARS
    assert parse_action(early) is None
    assert parse_action(early + format_action(Action.move(2))) == Action.move(2)


@pytest.mark.parametrize(
    "hostile",
    [
        "(" * 1_000_000,
        "( " * 500_000,
        "(" + " " * 1_000_000,
        "('move', " * 100_000,
        "('move', '" * 100_000,
        "(\t'stop' ,  " * 100_000,
        "\ud800\x00\u202e" * 100_000,
    ],
)
def test_hostile_inputs_are_fast_and_harmless(hostile: str) -> None:
    started = time.perf_counter()
    assert parse_action(hostile) is None
    assert time.perf_counter() - started < 0.5


@fast
@given(text=any_text)
def test_any_text_parses_to_none_or_an_action(text: str) -> None:
    assert parse_action(text) in [None, *ALL_ACTIONS]


@fast
@given(text=any_text, action=actions)
def test_appended_action_is_what_parses(text: str, action: Action) -> None:
    assert parse_action(text + format_action(action)) == action


@fast
@given(text=st.text(alphabet=st.characters(exclude_categories=(), exclude_characters="(")))
def test_junk_without_an_opening_paren_is_none(text: str) -> None:
    assert parse_action(text) is None


@fast
@given(parts=st.lists(st.sampled_from(NEAR_MISS_TOKENS), max_size=40))
def test_near_miss_token_soup_never_raises(parts: list[str]) -> None:
    assert parse_action("".join(parts)) in [None, *ALL_ACTIONS]


# --- prompts and messages --------------------------------------------------------------------


@pytest.mark.parametrize(("max_turns", "maze_size"), [(15, 9), (40, 11)])
def test_first_turn_text_states_the_rules(max_turns: int, maze_size: int) -> None:
    text = first_turn_text(max_turns, maze_size)
    assert f"{max_turns} turns" in text
    assert f"{maze_size}x{maze_size}" in text
    for number, name in DIRECTION_NAMES.items():
        assert f"{number} {name}" in text
    for word in ["grey", "white", "blue circle", "red square", "stop", "goal", "one action"]:
        assert word in text
    assert format_action(Action.stop()) in text
    assert len(text.split()) <= 90, "the prompt is tokenized for every episode; keep it short"


def test_the_prompt_itself_holds_no_parseable_action() -> None:
    # A model echoing the rules must not thereby issue a move.
    text = first_turn_text(15, 9).replace("('stop', 'stop')", "")
    assert parse_action(text) is None


@pytest.mark.parametrize(("turns_left", "phrase"), [(5, "5 turns left"), (1, "1 turn left"), (0, "no turns left")])
def test_observation_text_reports_turns_left(turns_left: int, phrase: str) -> None:
    text = observation_text("You moved up.", turns_left)
    assert text.startswith("You moved up.")
    assert phrase in text
    assert text.endswith("Your next action?")


def test_message_shapes() -> None:
    assert system_message() == {"role": "system", "content": [{"type": "text", "text": SYSTEM_PROMPT}]}
    first = first_user_message(15, 9)
    assert first == {
        "role": "user",
        "content": [{"type": "image"}, {"type": "text", "text": first_turn_text(15, 9)}],
    }
    observation = observation_message("You moved left.", 3)
    assert observation["role"] == "user"
    text = observation_text("You moved left.", 3)
    assert observation["content"] == [{"type": "image"}, {"type": "text", "text": text}]
    reply = "('move', 0)"
    assert assistant_message(reply) == {"role": "assistant", "content": [{"type": "text", "text": reply}]}


def test_system_prompt_is_one_short_sentence() -> None:
    assert SYSTEM_PROMPT.count(".") == 1 and len(SYSTEM_PROMPT.split()) <= 25


# --- the solver as demonstrations ------------------------------------------------------------


@pytest.mark.parametrize("seed", range(8))
def test_solver_actions_solve_the_maze(seed: int) -> None:
    maze = generate_maze(seed, 11)
    plan = solver_actions(maze)
    assert plan[-1] == Action.stop()
    assert len(plan) == maze.shortest_path_length + 1
    episode = MazeEpisode(maze, max_turns=len(plan))
    for action in plan:
        episode.step(parse_action(demo_reply(action)))
    assert episode.outcome == "solved"


@pytest.mark.parametrize("seed", range(12))
def test_route_hint_names_the_first_move_of_a_shortest_path_from_every_cell(seed: int) -> None:
    from app.world.maze import DIRECTION_NAMES, DIRECTION_OFFSETS, generate_maze

    maze = generate_maze(seed, 7)
    assert dialogue.where_text("route", maze, maze.goal) == "You are on the goal."
    assert dialogue.where_text("visgym", maze, maze.start) is None
    for cell in [(r, c) for r in range(7) for c in range(7) if maze.is_open((r, c)) and (r, c) != maze.goal]:
        hint = dialogue.where_text("route", maze, cell)
        direction = next(d for d, name in DIRECTION_NAMES.items() if hint == f"The way to the goal starts {name}.")
        step = (cell[0] + DIRECTION_OFFSETS[direction][0], cell[1] + DIRECTION_OFFSETS[direction][1])
        # following the hint shortens the remaining shortest path by exactly one move
        assert maze.is_open(step) and len(maze.path_from(step)) == len(maze.path_from(cell)) - 1
