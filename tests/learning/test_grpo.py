"""GRPO advantages and the clipped loss, against values computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from app.learning.grpo import compute_advantages, group_advantages, kl_k3, policy_loss


def test_group_advantages_by_hand():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    adv = group_advantages(rewards, "grpo", eps=0.0)
    # group 1: mean 0.25, population std sqrt(0.1875) = 0.4330
    assert adv[0].tolist() == pytest.approx(
        [0.75 / 0.4330127, -0.25 / 0.4330127, -0.25 / 0.4330127, -0.25 / 0.4330127], rel=1e-5
    )
    assert adv[1].tolist() == pytest.approx([1.0, 1.0, -1.0, -1.0])
    assert group_advantages(rewards, "drgrpo")[0].tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25])


def test_groups_are_formed_by_maze_not_by_position():
    groups = [7, 3, 7, 3, 7, 3]
    rewards = [1.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    r = compute_advantages(groups, rewards, "drgrpo")
    third = 1 / 3
    assert r.advantages == pytest.approx([1 - third, -third, -third, -third, -third, 1 - third])
    assert r.groups == 2 and r.zero_variance_groups == 0


def test_zero_variance_groups_are_counted_and_optionally_dropped():
    groups = [0, 0, 1, 1, 2, 2]
    rewards = [1.0, 1.0, 0.0, 0.0, 1.0, 0.0]
    kept = compute_advantages(groups, rewards, "grpo")
    assert kept.zero_variance_groups == 2 and all(kept.keep)
    assert kept.advantages[:4] == [0.0, 0.0, 0.0, 0.0]
    dropped = compute_advantages(groups, rewards, "grpo", drop_zero_variance=True)
    assert dropped.keep == [False, False, False, False, True, True]
    assert dropped.advantages[4] == pytest.approx(1.0, rel=1e-5) and dropped.advantages[5] == pytest.approx(
        -1.0, rel=1e-5
    )


def test_unknown_mode_is_an_error():
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(1, 2), "ppo")


def test_clipped_loss_by_hand():
    # four tokens: ratio e^0.5 with A>0 clips at 1.2; ratio e^-0.5 with A>0 does not clip (min takes unclipped);
    # ratio e^0.5 with A<0 does not clip; ratio e^-0.5 with A<0 clips at 0.8.
    logp = torch.tensor([[0.5, -0.5, 0.5, -0.5, 3.0]])
    old = torch.zeros_like(logp)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, 5.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    terms = policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2, total_tokens=4)
    e = math.exp
    expected = -(1.2 * 1 + e(-0.5) * 1 + e(0.5) * -1 + 0.8 * -1)
    assert terms.pg_loss.item() == pytest.approx(expected, rel=1e-6)
    assert terms.loss.item() == pytest.approx(expected / 4, rel=1e-6)
    assert terms.clipped.item() == 2 and terms.tokens == 4


def test_on_policy_gradient_is_advantage_weighted_logprob_gradient():
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    adv = torch.tensor([[2.0, 2.0, -1.0]])
    terms = policy_loss(logp, logp.detach(), adv, torch.ones(1, 3), 0.2, 0.2, total_tokens=3)
    terms.loss.backward()
    assert logp.grad[0].tolist() == pytest.approx([-2 / 3, -2 / 3, 1 / 3])


def test_asymmetric_clip_high():
    logp, old = torch.tensor([[0.3]]), torch.zeros(1, 1)
    adv, mask = torch.ones(1, 1), torch.ones(1, 1)
    assert policy_loss(logp, old, adv, mask, 0.2, 0.28, 1).pg_loss.item() == pytest.approx(-1.28)
    assert policy_loss(logp, old, adv, mask, 0.2, 0.5, 1).pg_loss.item() == pytest.approx(-math.exp(0.3))


def test_kl_term_by_hand():
    logp, ref = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]])
    k3 = [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1]
    assert kl_k3(logp, ref)[0].tolist() == pytest.approx(k3)
    terms = policy_loss(logp, logp, torch.zeros(1, 2), torch.ones(1, 2), 0.2, 0.2, 2, ref_logp=ref, kl_coef=0.1)
    assert terms.kl.item() == pytest.approx(sum(k3))
    assert terms.loss.item() == pytest.approx(0.1 * sum(k3) / 2)
    assert kl_k3(logp, logp).abs().max().item() == 0.0


def test_a_rank_without_sequences_still_runs_aligned_padding_passes():
    """Fewer sequences than ranks: the rank that owns none borrows one for zero-weight passes."""
    import torch

    from app.learning.batch import TrainItem, micro_batches, shard

    def item(n):
        return TrainItem(torch.ones(n, dtype=torch.long), torch.ones(n), torch.zeros(n), 1.0, [])

    everything = [item(5)]
    owned = [shard(everything, rank, 2) for rank in range(2)]
    assert [len(o) for o in owned] == [1, 0]
    idle = micro_batches(owned[1], everything, 4)
    assert idle.real == 0
    batch, weight = idle.get(0)
    assert batch == everything[:1] and weight == 0.0
    busy = micro_batches(owned[0], everything, 4)
    assert busy.real == 1 and busy.get(0) == (everything, 1.0) and busy.get(1)[1] == 0.0


def test_entropy_bonus_by_hand_and_its_gradient_spreads_the_distribution():
    logits = torch.tensor([[[3.0, 0.0, -1.0], [0.5, 0.4, 0.3]]], requires_grad=True)
    logp_all = torch.log_softmax(logits, dim=-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    logp = logp_all[..., 0]
    mask = torch.tensor([[1.0, 0.0]])  # the second position is not trained: its entropy must not count
    zero = torch.zeros_like(logp)
    terms = policy_loss(logp, logp.detach(), zero, mask, 0.2, 0.2, total_tokens=1.0, entropy=entropy, entropy_coef=0.5)
    assert terms.loss.item() == pytest.approx(-0.5 * entropy[0, 0].item())
    terms.loss.backward()
    grad = logits.grad[0]
    assert grad[0, 0] > 0 > grad[0, 2]  # descending the loss lowers the top logit and raises the lowest: more spread
    assert torch.all(grad[1] == 0)
    without = policy_loss(logp.detach(), logp.detach(), zero, mask, 0.2, 0.2, 1.0, entropy=entropy.detach())
    assert without.loss.item() == 0.0  # coefficient 0 (the default): no bonus


def test_the_rollout_ratio_weights_each_tokens_surrogate_and_its_gradient():
    """Decoupled PPO: the surrogate (clipped around the policy before the update) times the truncated ratio of that
    policy to the one that played the token, a constant of the graph."""
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    adv = torch.tensor([[2.0, 2.0, -1.0]])
    weight = torch.tensor([[1.0, 2.0, 0.5]])
    terms = policy_loss(logp, logp.detach(), adv, torch.ones(1, 3), 0.2, 0.2, 3, behaviour_weight=weight)
    assert terms.pg_loss.item() == pytest.approx(-(2.0 * 1.0 + 2.0 * 2.0 - 1.0 * 0.5))
    terms.loss.backward()
    assert logp.grad[0].tolist() == pytest.approx([-2 / 3, -4 / 3, 0.5 / 3])
