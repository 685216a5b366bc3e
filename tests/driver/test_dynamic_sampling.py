"""Dynamic sampling (train.min_informative_groups): a step plays more fresh mazes while too few groups carry signal."""

from __future__ import annotations

from app.config import load_config
from app.driver.phases import sampling_phase
from app.learning.grpo import compute_advantages, informative_groups, uninformative_groups
from app.world.sampler import MazeSampler


def summary(triples):
    return {"rewards": triples}


def test_informative_groups_counts_groups_whose_rewards_differ_across_summaries():
    # group 0: 1 and 0 (split over two actors' summaries), group 1: all 0, group 2: all 1, group 3: 0.95^k returns
    summaries = [
        summary([(0, 0, 1.0), (1, 0, 0.0), (2, 0, 1.0), (3, 0, 0.9)]),
        summary([(0, 1, 0.0), (1, 1, 0.0), (2, 1, 1.0), (3, 1, 0.9025)]),
    ]
    assert informative_groups(summaries) == 2
    # the same groups are the ones GRPO gives non-zero advantages
    triples = [t for s in summaries for t in s["rewards"]]
    result = compute_advantages([g for g, _, _ in triples], [r for _, _, r in triples])
    assert result.groups - result.zero_variance_groups == 2
    assert informative_groups([]) == 0


def test_groups_without_signal_are_told_apart_by_whether_every_run_or_none_solved():
    # group 0 splits, group 1 none solved (split over two summaries), groups 2 and 4 all solved, group 3 returns differ
    summaries = [
        summary([(0, 0, 1.0), (1, 0, 0.0), (2, 0, 1.0), (3, 0, 0.9), (4, 0, 1.0)]),
        summary([(0, 1, 0.0), (1, 1, 0.0), (2, 1, 1.0), (3, 1, 0.9025), (4, 1, 1.0)]),
    ]
    counts = uninformative_groups(summaries)
    assert counts == {"rollout_groups_all_solved": 2, "rollout_groups_none_solved": 1}
    assert informative_groups(summaries) + sum(counts.values()) == 5  # every group is one of the three
    assert uninformative_groups([]) == {"rollout_groups_all_solved": 0, "rollout_groups_none_solved": 0}


class ScriptedRounds:
    """A play_round that gives round k's groups the rewards scripted for it: `signal[k]` of its mazes split 1/0."""

    def __init__(self, signal):
        self.signal, self.rounds = signal, []

    def __call__(self, mazes, round_):
        self.rounds.append((round_, [m.seed for m in mazes]))
        first = round_ * len(mazes)
        triples = [
            (first + i, s, float(s % 2) if i < self.signal[round_] else 0.0)
            for i in range(len(mazes))
            for s in range(2)
        ]
        return [summary(triples)], [f"ref-{round_}"]


def train_config(*overrides):
    return load_config(None, ["train.mazes_per_step=4", *overrides]).train


def test_off_by_default_one_round_whatever_the_signal():
    play, sampler = ScriptedRounds([0, 4, 4]), MazeSampler(1, 64, 7, set())
    summaries, refs, info = sampling_phase(play, sampler, train_config())
    assert refs == ["ref-0"] and info == {
        "rollout_rounds": 1,
        "rollout_informative_groups": 0,
        "rollout_groups_all_solved": 0,
        "rollout_groups_none_solved": 4,
    }


def test_refills_with_fresh_mazes_until_enough_groups_carry_signal():
    play, sampler = ScriptedRounds([1, 2, 3, 4]), MazeSampler(1, 64, 7, set())
    summaries, refs, info = sampling_phase(
        play, sampler, train_config("train.min_informative_groups=3", "train.refill_rounds=5")
    )
    assert info["rollout_rounds"] == 2 and info["rollout_informative_groups"] == 3  # 1, then 1 + 2: enough
    assert info["rollout_groups_none_solved"] == 5 and info["rollout_groups_all_solved"] == 0
    assert refs == ["ref-0", "ref-1"] and [r for r, _ in play.rounds] == [0, 1]
    seeds = [s for _, round_seeds in play.rounds for s in round_seeds]
    assert len(set(seeds)) == 8  # every round plays fresh mazes: the sampler moved on
    assert sampler.next(4)[0].seed not in seeds


def test_refill_rounds_bound_the_step():
    play = ScriptedRounds([0, 0, 0, 0, 0])
    summaries, refs, info = sampling_phase(
        play, MazeSampler(1, 64, 7, set()), train_config("train.min_informative_groups=1", "train.refill_rounds=2")
    )
    assert info["rollout_rounds"] == 3 and info["rollout_informative_groups"] == 0
    assert info["rollout_groups_none_solved"] == 12
    assert len(refs) == 3 and len(summaries) == 3
    # groups are numbered across rounds, never reused: they would merge in the advantage otherwise
    groups = [g for s in summaries for g, _, _ in s["rewards"]]
    assert sorted(set(groups)) == list(range(12))
