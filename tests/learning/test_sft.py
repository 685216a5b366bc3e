"""app.learning.sft: solver demonstrations in the rollout format (with injected random moves, from random starts) and
perception questions, mixed and replayed by WarmStartData."""

from __future__ import annotations

import pytest

from app.config import SftConfig
from app.learning.sft import WarmStartData, demonstration, perception_example, solver_action
from app.rollout.encoding import as_image, image_to_png, png_to_image
from app.world import dialogue
from app.world.episode import MazeEpisode
from app.world.maze import DIRECTION_OFFSETS, generate_maze
from app.world.render import render
from app.world.rules import EpisodeSettings


def settings(turn_history=1, max_turns=40):
    return EpisodeSettings(max_turns=max_turns, maze_size=7, cell_px=32, image_history=1, turn_history=turn_history)


def positions_by_turn(maze, actions, max_turns):
    """Where the agent stood before each turn, replaying the demonstration's actions."""
    env, where = MazeEpisode(maze, max_turns), []
    for text in actions:
        where.append(env.position)
        env.step(dialogue.parse_action(text))
    return where, env


def trained_turns(trajectory, codec):
    """{turn: decoded trained reply}. With one picture and one turn in the window every turn is its own
    sequence, whose last picture is the one that turn saw."""
    out = {}
    for s in trajectory.sequences:
        mask = s.loss_mask.tolist()
        first = mask.index(1)
        assert all(mask[first:]), "a sequence trains its last reply only"
        out[s.image_indices[-1]] = codec.decode(s.token_ids[first:].tolist())
    return out


def test_a_plain_demonstration_is_the_shortest_path_every_turn_trained(codec):
    maze = generate_maze(11, 7)
    t = demonstration(maze, codec, settings(turn_history=0))
    assert t.solved and t.turns == maze.shortest_path_length + 1
    assert t.actions == [dialogue.format_action(a) for a in dialogue.solver_actions(maze)]
    assert sum(s.num_loss_tokens for s in t.sequences) == sum(len(codec.tokenizer.encode(a)) + 1 for a in t.actions)


@pytest.mark.parametrize("noise", [0.3, 0.6])
def test_noisy_demonstrations_train_only_the_solvers_replies_from_wherever_the_noise_led(codec, noise):
    off_path = untrained = 0
    for seed in range(12):
        maze = generate_maze(seed, 7)
        t = demonstration(maze, codec, settings(), noise=noise, seed=3)
        where, env = positions_by_turn(maze, t.actions, 40)
        assert env.outcome == t.outcome and len(where) == t.turns
        trained = trained_turns(t, codec)
        path = set()
        cell = maze.start
        for d in maze.shortest_path():
            path.add(cell)
            cell = (cell[0] + (d == 3) - (d == 1), cell[1] + (d == 0) - (d == 2))
        for turn, reply in trained.items():
            assert dialogue.parse_action(reply) == solver_action(maze, where[turn]), (seed, turn)
            off_path += where[turn] not in path and where[turn] != maze.goal
        for turn in set(range(t.turns)) - set(trained):
            untrained += 1
            assert dialogue.parse_action(t.actions[turn]).kind == "move"  # noise is a move, never a stop
        assert t.solved or t.turns == 40  # the solver always finishes what the noise started, given turns
    assert untrained >= 12 * noise  # the noise happened...
    assert off_path >= 2  # ...and the solver was shown the way back from cells off the shortest path


def test_noisy_demonstrations_replay(codec):
    maze = generate_maze(4, 7)
    a = demonstration(maze, codec, settings(), noise=0.5, seed=7)
    assert a.actions == demonstration(maze, codec, settings(), noise=0.5, seed=7).actions
    others = [demonstration(maze, codec, settings(), noise=0.5, seed=s).actions for s in range(8, 12)]
    assert any(o != a.actions for o in others)


def test_a_perception_question_trains_the_open_moves_of_the_agents_cell(codec):
    maze = generate_maze(6, 7)
    for cell in [maze.start, maze.goal, (3, 3)] if maze.is_open((3, 3)) else [maze.start, maze.goal]:
        example = perception_example(maze, cell, codec, 32)
        [s] = example.sequences
        first = s.loss_mask.tolist().index(1)
        assert all(s.loss_mask[first:])  # the reply only, to its <|im_end|>
        reply = codec.decode(s.token_ids[first:].tolist())
        moves = [m.group(0) for m in __import__("re").finditer(r"\('move', \d\)", reply)]
        expected = [d for d, (dr, dc) in DIRECTION_OFFSETS.items() if maze.is_open((cell[0] + dr, cell[1] + dc))]
        assert [dialogue.parse_action(m).direction for m in moves] == expected and expected
        assert dialogue.OPEN_MOVES_QUESTION in codec.decode(s.token_ids[:first].tolist())
        assert example.images[0] == image_to_png(as_image(render(maze, cell, 32)))  # the agent drawn where asked
        assert (s.token_ids == codec.image_pad_id).sum() == codec.image_tokens(png_to_image(example.images[0]))


def test_warm_start_data_mixes_demonstrations_random_starts_and_questions_and_replays(codec):
    sft = SftConfig(noise=0.2, variants=2, random_starts=1.0, perception=3)
    data = WarmStartData(codec, settings(), sft, seed=5)
    mazes = [generate_maze(s, 7) for s in range(6)]
    first, second, third = data.batch(mazes), data.batch(mazes), data.batch(mazes)
    assert len(first) == len(mazes) * 4
    assert [t.outcome == "question" for t in first] == [False, True, True, True] * len(mazes)
    assert all(a is b for a, b in zip(first, third)) and any(a is not b for a, b in zip(first, second))
    demos = [t for t in first + second if t.outcome != "question"]
    starts = {png_to_image(t.images[0]).tobytes() for t in demos}
    corner_starts = sum(t.images[0] == image_to_png(as_image(render(m, m.start, 32))) for t, m in zip(demos, mazes * 2))
    assert len(starts) == len(demos) and corner_starts < len(demos)  # started from other cells than the corner
    assert all(t.solved or t.turns == 40 for t in demos)
    plain = WarmStartData(codec, settings(), SftConfig(), seed=5).batch(mazes[:2])
    assert [t.actions for t in plain] == [demonstration(m, codec, settings()).actions for m in mazes[:2]]
