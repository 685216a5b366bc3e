"""The batch a trainer rank trains on: sequences with their advantages, this rank's share, its micro-batches.

A trajectory's sequences become `TrainItem`s with the trajectory's episode advantage, or, with step advantages
(app.learning.step_advantages), each trained reply's own. Every rank builds the same items from the same trajectories
and takes its share (`shard`); ranks run the same number of passes (`MicroBatches` pads with zero-weight ones).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from app.learning import grpo
from app.learning.step_advantages import StepAdvantages
from app.rollout.trajectory import Trajectory


@dataclass
class TrainItem:
    """One sequence to train on, with its trajectory's advantage (and, with step advantages, each token's)."""

    token_ids: torch.Tensor
    loss_mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    advantage: float
    images: list[bytes]  # PNG bytes of its pictures, in order of appearance (decoded only when processed)
    token_advantages: torch.Tensor | None = None  # float32 [T]: each trained reply's own advantage

    @property
    def tokens(self) -> int:
        return int(self.loss_mask.sum())

    def advantages(self) -> torch.Tensor:
        if self.token_advantages is not None:
            return self.token_advantages
        return torch.full((len(self.token_ids),), float(self.advantage))


def reply_advantages(seq, turn_advantages: list[float]) -> torch.Tensor:
    """[T] advantages of one sequence: each trained reply's tokens take that reply's turn advantage."""
    if len(turn_advantages) != len(seq.reply_starts):
        raise ValueError(
            f"a sequence trains {len(seq.reply_starts)} replies but {len(turn_advantages)} turn advantages were given"
        )
    values = torch.zeros(len(seq.token_ids))
    bounds = list(seq.reply_starts) + [len(seq.token_ids)]
    for j, a in enumerate(turn_advantages):
        values[bounds[j] : bounds[j + 1]] = a  # the observation after a reply is masked out: its value is unused
    return values


def build_items(
    trajectories: list[Trajectory],
    result: grpo.AdvantageResult,
    steps: StepAdvantages | None = None,
    step_weight: float = 0.0,
) -> list[TrainItem]:
    """steps: each turn's anchor-state advantage (app.learning.step_advantages), added times step_weight to the
    episode's."""
    items = []
    for index, (traj, adv, keep) in enumerate(zip(trajectories, result.advantages, result.keep)):
        if not keep:
            continue
        per_turn = None
        if steps is not None and step_weight and steps.has_signal(index):
            per_turn = [adv + step_weight * a for a in steps.per_turn[index]]
            replies = sum(len(seq.reply_starts) for seq in traj.sequences)
            if replies != len(per_turn):
                raise ValueError(
                    f"trajectory of maze {traj.maze_id} sample {traj.sample}: {replies} trained replies "
                    f"but {len(per_turn)} recorded cells"
                )
        pictures, turn = traj.images, 0
        for seq in traj.sequences:
            token_adv = None
            if per_turn is not None:
                token_adv = reply_advantages(seq, per_turn[turn : turn + len(seq.reply_starts)])
                turn += len(seq.reply_starts)
            items.append(
                TrainItem(
                    torch.tensor(seq.token_ids, dtype=torch.long),  # copies: Ray's arrays are read-only
                    torch.tensor(seq.loss_mask, dtype=torch.float32),
                    torch.tensor(seq.rollout_logprobs, dtype=torch.float32),
                    adv,
                    [pictures[i] for i in seq.image_indices],
                    token_adv,
                )
            )
    return items


def advantage_table(batch: list[TrainItem]) -> torch.Tensor:
    """[B, width] each position's advantage, padded like the batch's inputs."""
    table = torch.zeros(len(batch), max(len(it.token_ids) for it in batch))
    for row, it in enumerate(batch):
        table[row, : len(it.token_ids)] = it.advantages()
    return table


def rollout_logprob_table(batch: list[TrainItem]) -> torch.Tensor:
    """[B, width] the engine's log-probability of each position's token (0 where it sampled none), padded like the
    batch's inputs."""
    table = torch.zeros(len(batch), max(len(it.token_ids) for it in batch))
    for row, it in enumerate(batch):
        table[row, : len(it.token_ids)] = it.rollout_logprobs
    return table


def shard(items: list[TrainItem], rank: int, world: int) -> list[TrainItem]:
    """This rank's share: longest first, each to the rank with the fewest tokens so far (deterministic)."""
    loads = [0] * world
    mine = []
    for index in sorted(range(len(items)), key=lambda i: (-len(items[i].token_ids), i)):
        target = min(range(world), key=lambda r: (loads[r], r))
        loads[target] += len(items[index].token_ids)
        if target == rank:
            mine.append(items[index])
    return mine


@dataclass
class MicroBatches:
    """This rank's micro-batches; pass i beyond them is a zero-weight padding pass (FSDP's collectives must
    line up across ranks), run on a borrowed sequence: a rank can own none when sequences are fewer than ranks."""

    batches: list[list[TrainItem]]
    spare: list[TrainItem]

    @property
    def real(self) -> int:
        return len(self.batches)

    def get(self, i: int) -> tuple[list[TrainItem], float]:
        if i < len(self.batches):
            return self.batches[i], 1.0
        return (self.batches[0] if self.batches else self.spare)[:1], 0.0


def micro_batches(items: list[TrainItem], everything: list[TrainItem], size: int) -> MicroBatches:
    return MicroBatches([items[i : i + size] for i in range(0, len(items), size)], everything[:1])
