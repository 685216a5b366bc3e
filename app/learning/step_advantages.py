"""Step-level advantages from anchor states (GiGPO, Feng et al. 2025), added to GRPO's episode advantage.

GRPO gives every turn of an episode the episode's one advantage: a solved run's detours and bumps are
reinforced with its good moves, and a group whose 8 runs all solved (or all failed) teaches nothing. But
the 8 runs of a group play the same maze, so they stand in the same cells again and again (a 7x7 maze has at
most 25 open cells, a run takes up to 25 turns). Every turn taken from one cell of one group's maze is an
anchor group; the turn's discounted return, gamma^(turns after it) * the episode's reward, says how soon the
move made there led to the goal. Compared within the anchor group (as GRPO compares episodes), it credits
the move that went the right way and debits the bump or the detour, even inside an all-solved group.

The reward is still the task's: 1.0 for stopping on the goal within the turn limit, no critic, no shaping.
The state key is the agent's cell (the environment's state): the return from a cell depends on the maze,
the cell and the policy, not on the feedback text the model also sees. No library computes this over our
trajectories (verl-agent's GiGPO works on its own rollout format), hence this module.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from app.learning import grpo
from app.learning.grpo import group_advantages


@dataclass
class StepAdvantages:
    per_turn: list[list[float]]  # per trajectory, one per turn, in input order
    anchor_groups: int  # (group, cell) pairs where at least two turns were taken
    informative_anchor_groups: int  # of them, those whose turns' returns differ
    anchored_turns: int  # turns that belong to an informative anchor group

    def has_signal(self, trajectory: int) -> bool:
        return any(a != 0.0 for a in self.per_turn[trajectory])


def discounted_returns(reward: float, turns: int, gamma: float) -> list[float]:
    """The return of each turn when the only reward comes after the last one: reward * gamma^(turns after it)."""
    return [reward * gamma ** (turns - 1 - t) for t in range(turns)]


def step_advantages(
    group_ids: list[int],
    rewards: list[float],
    states: list[list[str]],
    gamma: float,
    mode: str = "grpo",
    eps: float = 1e-6,
) -> StepAdvantages:
    """states[i][t]: the key of the cell trajectory i stood in when it chose turn t's action."""
    if not (len(group_ids) == len(rewards) == len(states)):
        raise ValueError("group_ids, rewards and states must describe the same trajectories")
    returns = [discounted_returns(r, len(s), gamma) for r, s in zip(rewards, states)]
    anchors: dict[tuple[int, str], list[tuple[int, int]]] = defaultdict(list)
    for i, (group, cells) in enumerate(zip(group_ids, states)):
        for t, cell in enumerate(cells):
            anchors[(group, cell)].append((i, t))
    per_turn = [[0.0] * len(s) for s in states]
    crowded = informative = anchored = 0
    for members in anchors.values():
        if len(members) < 2:
            continue  # a cell only one turn stood in has nothing to be compared with
        crowded += 1
        values = torch.tensor([returns[i][t] for i, t in members], dtype=torch.float64).unsqueeze(0)
        if bool((values == values[0, 0]).all()):
            continue
        informative += 1
        anchored += len(members)
        for (i, t), a in zip(members, group_advantages(values, mode, eps).squeeze(0).tolist()):
            per_turn[i][t] = float(a)
    return StepAdvantages(per_turn, crowded, informative, anchored)


def advantages_for(train, trajectories) -> tuple[grpo.AdvantageResult, StepAdvantages | None]:
    """GRPO's episode advantages and, when train.step_advantage_weight > 0 (app.config.TrainConfig), the
    anchor-state ones. A group whose episodes all earned the same reward is kept when its turns still differ."""
    groups, rewards = [t.group for t in trajectories], [t.reward for t in trajectories]
    result = grpo.compute_advantages(groups, rewards, train.advantage, train.drop_zero_variance_groups)
    if not train.step_advantage_weight:
        return result, None
    steps = step_advantages(
        groups, rewards, [t.states for t in trajectories], train.step_discount, train.step_advantage_mode
    )
    keep = [k or steps.has_signal(i) for i, k in enumerate(result.keep)]
    return grpo.AdvantageResult(result.advantages, keep, result.groups, result.zero_variance_groups), steps
