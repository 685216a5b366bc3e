"""GRPO: advantages per maze group and the clipped policy loss, as pure tensor functions.

Advantages compare the samples of the SAME maze: A = (r - mean) / (std + eps) over the group's n
samples (`grpo`), or r - mean (`drgrpo`, Dr. GRPO's unbiased variant). A group whose samples all earned
the same reward carries no signal; it is counted, and dropped when asked. The loss is PPO's clipped
surrogate on the sampled tokens, averaged over every trained token of the whole batch (token-mean),
plus an optional k3 KL to the reference policy (the same model with the adapter disabled), minus an optional
entropy bonus.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch


@dataclass
class AdvantageResult:
    advantages: list[float]  # one per trajectory, in input order
    keep: list[bool]  # False for trajectories of dropped zero-variance groups
    groups: int
    zero_variance_groups: int


def group_advantages(rewards: torch.Tensor, mode: str = "grpo", eps: float = 1e-6) -> torch.Tensor:
    """rewards [groups, n] -> advantages [groups, n]. Uses the population std (unbiased=False)."""
    mean = rewards.mean(dim=1, keepdim=True)
    centered = rewards - mean
    if mode == "drgrpo":
        return centered
    if mode != "grpo":
        raise ValueError(f"unknown advantage mode {mode!r}")
    return centered / (rewards.std(dim=1, unbiased=False, keepdim=True) + eps)


def compute_advantages(
    group_ids: list[int], rewards: list[float], mode: str = "grpo", drop_zero_variance: bool = False, eps: float = 1e-6
) -> AdvantageResult:
    """Advantages for trajectories identified by their group; groups may have different sizes."""
    members: dict[int, list[int]] = defaultdict(list)
    for i, g in enumerate(group_ids):
        members[g].append(i)
    advantages = [0.0] * len(rewards)
    keep = [True] * len(rewards)
    zero_var = 0
    for idx in members.values():
        r = torch.tensor([rewards[i] for i in idx], dtype=torch.float64).unsqueeze(0)
        flat = bool((r == r[0, 0]).all())
        zero_var += flat
        adv = group_advantages(r, mode, eps).squeeze(0).tolist()
        for i, a in zip(idx, adv):
            advantages[i] = float(a)
            keep[i] = not (flat and drop_zero_variance)
    return AdvantageResult(advantages, keep, len(members), zero_var)


def _rewards_by_group(summaries: list[dict]) -> dict[int, set[float]]:
    """The distinct rewards each group's runs earned, across rollout summaries ("rewards": (group, sample, reward))."""
    rewards: dict[int, set[float]] = defaultdict(set)
    for summary in summaries:
        for group, _, reward in summary["rewards"]:
            rewards[group].add(reward)
    return rewards


def informative_groups(summaries: list[dict]) -> int:
    """How many groups in rollout summaries earned differing rewards: the groups whose GRPO advantages are not all
    zero."""
    return sum(len(seen) > 1 for seen in _rewards_by_group(summaries).values())


def uninformative_groups(summaries: list[dict]) -> dict[str, int]:
    """The groups whose runs all earned the same reward, split by that reward: above 0 (every run solved its maze) or
    0 (none did). Which of the two grows says why dynamic sampling refills: a policy that has mastered most of its
    mazes, or one that cannot solve them."""
    same = [next(iter(seen)) for seen in _rewards_by_group(summaries).values() if len(seen) == 1]
    return {
        "rollout_groups_all_solved": sum(r > 0 for r in same),
        "rollout_groups_none_solved": sum(r <= 0 for r in same),
    }


@dataclass
class LossTerms:
    loss: torch.Tensor  # what to backpropagate (already divided by the batch's token count)
    pg_loss: torch.Tensor  # sums over this micro-batch's tokens, for metrics
    kl: torch.Tensor
    clipped: torch.Tensor
    tokens: int


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(policy || reference): exp(ref - p) - (ref - p) - 1, always >= 0."""
    delta = ref_logp - logp
    return torch.exp(delta) - delta - 1.0


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    total_tokens: float,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    behaviour_weight: torch.Tensor | None = None,
) -> LossTerms:
    """PPO clipped surrogate, token-mean over `total_tokens` (the whole batch, across ranks).

    All tensors have the same shape; `advantages` is the trajectory's advantage broadcast to its
    tokens; `mask` is 1 on trained tokens. The sum over a micro-batch divided by the batch's token
    count makes micro-batches add up to the token-mean of the batch. `entropy` (with its graph) is the policy's
    entropy at each position; `entropy_coef` > 0 rewards keeping it. `behaviour_weight` (no graph), where the batch
    was played by another policy than `old_logp`'s (an older adapter, an engine's numerics), weights each token's
    surrogate by that policy's truncated ratio, min(pi_old / pi_played, cap): decoupled PPO's correction, with the
    clip still taken around the policy before the update.
    """
    mask = mask.to(logp.dtype)
    ratio = torch.exp(logp - old_logp)
    unclipped = ratio * advantages
    clipped_ratio = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    surrogate = torch.minimum(unclipped, clipped_ratio * advantages)
    if behaviour_weight is not None:
        surrogate = surrogate * behaviour_weight
    pg = -(surrogate * mask).sum()
    was_clipped = ((clipped_ratio * advantages < unclipped) & (mask > 0)).sum()
    kl = torch.zeros((), dtype=logp.dtype)
    loss = pg
    if ref_logp is not None and kl_coef > 0:
        kl = (kl_k3(logp, ref_logp) * mask).sum()
        loss = loss + kl_coef * kl
    if entropy is not None and entropy_coef > 0:
        loss = loss - entropy_coef * (entropy * mask).sum()
    return LossTerms(loss / total_tokens, pg.detach(), kl.detach(), was_clipped.detach(), int(mask.sum().item()))
