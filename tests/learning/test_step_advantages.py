"""Step-level advantages from anchor states (app.learning.step_advantages): turns taken from the same cell of a group's
maze are compared by their discounted returns, mapped onto the right reply tokens, and trained."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from app.config import ConfigError
from app.learning.batch import build_items
from app.learning.sft import solver_action
from app.learning.step_advantages import StepAdvantages, advantages_for, discounted_returns, step_advantages
from app.rollout.episodes import EpisodeRequest, RunningEpisode
from app.world import dialogue
from app.world.maze import DIRECTION_OFFSETS, Action, generate_maze
from app.world.rules import EpisodeSettings
from tests.conftest import tiny_config

WINDOWED = EpisodeSettings(max_turns=25, maze_size=7, cell_px=32, image_history=1, turn_history=1)


def scripted(maze, codec, first: list[Action], group: int = 0, sample: int = 0):
    """An episode that plays `first`, then the solver to the goal; every reply is trained, as in a rollout."""
    episode = RunningEpisode(EpisodeRequest(maze, group, sample), codec, WINDOWED)
    queue = list(first)
    while not episode.env.done:
        action = queue.pop(0) if queue else solver_action(maze, episode.env.position)
        reply = codec.reply_segment(dialogue.demo_reply(action))
        episode.advance(reply.token_ids, [0.0] * len(reply.token_ids), "stop")
    return episode.trajectory(lora_version=0)


def wall_direction(maze) -> int:
    r, c = maze.start
    return next(d for d, (dr, dc) in DIRECTION_OFFSETS.items() if not maze.is_open((r + dr, c + dc)))


def test_discounted_returns_credit_the_last_turn_most():
    assert discounted_returns(1.0, 3, 0.5) == [0.25, 0.5, 1.0]
    assert discounted_returns(0.0, 2, 0.9) == [0.0, 0.0]


def test_turns_from_the_same_cell_are_compared_by_how_soon_they_reached_the_goal():
    g = 0.9
    direct = ["0,0", "0,1", "1,1"]  # solved in 3 turns
    detour = ["0,0", "1,0", "0,0", "0,1", "1,1"]  # solved in 5, back through the start
    lost = ["0,0", "1,0", "1,0"]  # out of turns
    other_group = ["0,0", "0,1"]  # the same cell key in another group's maze: never compared with group 0
    out = step_advantages([0, 0, 0, 1], [1.0, 1.0, 0.0, 1.0], [direct, detour, lost, other_group], g)
    start = [g**2, g**4, g**2, 0.0]  # direct t0, detour t0, detour t2, lost t0
    mean = sum(start) / 4
    std = (sum((v - mean) ** 2 for v in start) / 4) ** 0.5
    assert out.per_turn[0][0] == pytest.approx((g**2 - mean) / std, rel=1e-4)
    assert out.per_turn[1][0] == pytest.approx((g**4 - mean) / std, rel=1e-4)
    assert out.per_turn[2][0] == pytest.approx(-mean / std, rel=1e-4)
    assert out.per_turn[0][0] > out.per_turn[1][0] > 0 > out.per_turn[2][0]  # direct > detour > lost
    assert out.per_turn[1][1] > 0 and out.per_turn[2][1] < 0 and out.per_turn[2][2] < 0  # cell 1,0: detour beat lost
    # cells whose turns all had the same return ("0,1", "1,1": both runs went on the same way) carry nothing
    assert out.per_turn[0][1:] == [0.0, 0.0] and out.per_turn[1][3:] == [0.0, 0.0]
    assert out.per_turn[3] == [0.0, 0.0]  # alone in its group: nothing to compare
    assert (out.anchor_groups, out.informative_anchor_groups, out.anchored_turns) == (4, 2, 7)
    centred = step_advantages([0, 0], [1.0, 0.0], [["a", "b"], ["a"]], g, mode="drgrpo")
    assert centred.per_turn == [[pytest.approx((g - 0.0) / 2), 0.0], [pytest.approx(-g / 2)]]


def test_mismatched_inputs_are_refused():
    with pytest.raises(ValueError, match="same trajectories"):
        step_advantages([0, 0], [1.0], [["a"], ["a"]], 0.9)


def test_episodes_record_each_turns_cell_and_each_sequences_replies(codec):
    maze = generate_maze(11, 7)
    traj = scripted(maze, codec, [Action.move(wall_direction(maze))])
    assert len(traj.states) == traj.turns == len(traj.replies)
    path = [maze.start]
    for d in maze.shortest_path():
        r, c = path[-1]
        path.append((r + DIRECTION_OFFSETS[d][0], c + DIRECTION_OFFSETS[d][1]))
    assert traj.states == ["{},{}".format(*cell) for cell in [maze.start] + path]  # the bump stays in the start cell
    assert len(traj.sequences) > 1  # the turn window closes sequences
    assert sum(len(s.reply_starts) for s in traj.sequences) == traj.turns
    for seq in traj.sequences:
        for start in seq.reply_starts:
            assert seq.loss_mask[start] == 1 and seq.loss_mask[start - 1] == 0


def test_each_reply_is_trained_with_its_own_turns_advantage(codec):
    maze = generate_maze(12, 7)
    traj = scripted(maze, codec, [])
    turns = traj.turns
    steps = StepAdvantages([[float(t) for t in range(turns)]], 1, 1, turns)
    result = advantages_result([0.5])
    items = build_items([traj], result, steps, step_weight=2.0)
    seen = []
    for item, seq in zip(items, traj.sequences):
        values = item.advantages()
        bounds = list(seq.reply_starts) + [len(seq.token_ids)]
        for j, start in enumerate(seq.reply_starts):
            trained = item.loss_mask[start : bounds[j + 1]] > 0
            seen.append(set(values[start : bounds[j + 1]][trained].tolist()))
    assert seen == [{0.5 + 2.0 * t} for t in range(turns)]
    plain = build_items([traj], result)  # no step advantages: the episode's one number everywhere
    assert all(set(it.advantages().tolist()) == {0.5} for it in plain)
    short = StepAdvantages([[0.0, 1.0]], 1, 1, 2)  # fewer cells than replies: a broken trajectory
    with pytest.raises(ValueError, match="trained replies"):
        build_items([traj], result, short, step_weight=1.0)


def advantages_result(advantages):
    from app.learning.grpo import AdvantageResult

    return AdvantageResult(list(advantages), [True] * len(advantages), 1, 0)


@pytest.fixture(scope="module")
def all_solved_group(codec):
    """Two solved runs of one maze: straight to the goal, and with a bump into a wall first. Episode GRPO sees
    no difference (both earned 1.0); the start cell tells the first move apart from the bump."""
    maze = generate_maze(13, 7)
    bump = Action.move(wall_direction(maze))
    runs = [scripted(maze, codec, [], sample=0), scripted(maze, codec, [bump], sample=1)]
    assert all(t.solved for t in runs)
    return runs, bump, solver_action(maze, maze.start)


def test_a_group_that_all_solved_is_kept_only_when_its_turns_differ(all_solved_group):
    runs, _, _ = all_solved_group
    train = tiny_config("train.drop_zero_variance_groups=true").train
    plain, none = advantages_for(train, runs)
    assert none is None and plain.keep == [False, False] and plain.zero_variance_groups == 1
    stepped = dataclasses.replace(train, step_advantage_weight=1.0)
    result, steps = advantages_for(stepped, runs)
    assert result.keep == [True, True] and result.advantages == [0.0, 0.0]
    assert steps.per_turn[0][0] > 0 > steps.per_turn[1][0]  # the first move beats the bump from the start cell


def test_the_step_advantage_mode_decides_whether_a_one_turn_difference_weighs_as_much_as_solving(all_solved_group):
    """Two solved runs, one a bump longer: divided by their anchor group's spread, the one-turn difference becomes
    advantages of order 1, as large as a solved run's against a failed one (the tenth GPU attempt's large updates);
    centred only, it stays the size of the returns' difference."""
    runs, _, _ = all_solved_group
    train = dataclasses.replace(tiny_config().train, step_advantage_weight=1.0, step_discount=0.95)
    normalised = advantages_for(train, runs)[1].per_turn
    centred = advantages_for(dataclasses.replace(train, step_advantage_mode="drgrpo"), runs)[1].per_turn
    # the start cell's anchor group: the direct run's first turn, the bump, and the turn after it (still there)
    assert normalised[0][0] == pytest.approx(2**-0.5, rel=1e-3) and normalised[1][0] == pytest.approx(
        -(2**0.5), rel=1e-3
    )
    assert 0 < centred[0][0] < 0.05 and -0.05 < centred[1][0] < 0
    assert tiny_config("train.step_advantage_mode=drgrpo").train.step_advantage_mode == "drgrpo"
    with pytest.raises(ConfigError, match="step_advantage_mode"):
        tiny_config("train.step_advantage_mode=centred")


def test_a_training_step_moves_the_first_move_up_and_the_bump_down(tiny_model_dir, codec, all_solved_group):
    from app.learning.training import PolicyTrainer

    runs, bump, first = all_solved_group
    opening = runs[0].sequences[0]

    def reply_logprob(trainer, action):
        """logprob of `action`'s reply right after the opening (the context both runs' first turn shares)."""
        reply = codec.reply_segment(dialogue.demo_reply(action)).token_ids
        n = opening.reply_starts[0]
        probe = dataclasses.replace(
            runs[0],
            sequences=[
                dataclasses.replace(
                    opening,
                    token_ids=torch.tensor(list(opening.token_ids[:n]) + list(reply)).numpy(),
                    loss_mask=torch.tensor([0] * n + [1] * len(reply), dtype=torch.uint8).numpy(),
                    rollout_logprobs=torch.zeros(n + len(reply)).numpy(),
                    reply_starts=[n],
                )
            ],
        )
        items = build_items([probe], advantages_result([0.0]))
        logp, _, mask, _ = trainer.token_logprobs(items, with_grad=False)
        return float((logp * mask).sum())

    moved = {}
    for weight in (0.0, 1.0):
        trainer = PolicyTrainer(
            tiny_config(
                "train.drop_zero_variance_groups=true",
                "train.lr=0.01",
                f"train.step_advantage_weight={weight}",
                "train.micro_batch=64",
            ),
            tiny_model_dir,
        )
        actions = {"first": first, "bump": bump}
        before = {k: reply_logprob(trainer, a) for k, a in actions.items()}
        metrics = trainer.train_step(runs)
        moved[weight] = ({k: reply_logprob(trainer, a) - before[k] for k, a in actions.items()}, metrics)
    (_plain, plain_metrics), (stepped, stepped_metrics) = moved[0.0], moved[1.0]
    assert plain_metrics["trained_tokens"] == 0 and "step_anchor_groups" not in plain_metrics
    assert stepped_metrics["trained_tokens"] > 0 and stepped_metrics["step_informative_anchor_groups"] >= 1
    assert stepped["first"] > 0 > stepped["bump"]
