"""The data that crosses actors: one played episode, ready for the trainer.

A trajectory holds one or more sequences. With the whole image history in context it is one sequence:
the full token stream of the episode, loss mask 1 exactly on the ids the engine sampled, the engine's
logprob of each. With an image window (keep the last K images) the context is rebuilt when an image
falls out of the window, so every rebuilt context starts a new sequence; each sampled id is trained in
exactly one sequence. Images travel as PNG bytes (lossless, ~100x smaller than raw pixels).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Sequence:
    token_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # uint8 [T], 1 on sampled ids
    rollout_logprobs: np.ndarray  # float32 [T], the engine's logprob where loss_mask is 1, else 0
    image_indices: list[int]  # which of the trajectory's images appear, in order
    reply_starts: list[int] = field(default_factory=list)  # token offset of each trained reply, in turn order

    def __post_init__(self):
        if not (len(self.token_ids) == len(self.loss_mask) == len(self.rollout_logprobs)):
            raise ValueError("token_ids, loss_mask and rollout_logprobs must have the same length")

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())


@dataclass
class Trajectory:
    maze_seed: int
    maze_id: str
    group: int  # which maze of the step (GRPO groups samples by it)
    sample: int  # which of the group's samples
    images: list[bytes]  # PNG, one per turn's observation, in order
    sequences: list[Sequence]
    replies: list[str]  # decoded model replies, one per turn
    actions: list[str | None]  # the parsed action per turn (canonical text), None when invalid
    reward: float
    outcome: str  # solved | stopped_off_goal | out_of_turns
    turns: int
    moves: int
    invalid_actions: int
    optimal_moves: int  # BFS shortest path length of the maze
    solvable: bool  # solvable within the turn budget
    lora_version: int
    truncated_replies: int = 0  # replies cut at max_new_tokens
    advantage: float = 0.0  # set by the driver from the group's rewards
    states: list[str] = field(default_factory=list)  # the agent's cell ("row,col") as each turn's action was chosen
    extra: dict = field(default_factory=dict)

    @property
    def solved(self) -> bool:
        return self.outcome == "solved"

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.sequences)

    @property
    def num_generated_tokens(self) -> int:
        return sum(s.num_loss_tokens for s in self.sequences)


def build_sequence(segments, first_new: int, image_offsets: list[int]) -> Sequence:
    """Concatenates context segments; generated segments from index first_new on are trained (mask 1).

    Each reply is trained in exactly one sequence, in turn order: a trajectory's sequences' reply_starts,
    read in order, list its trained replies turn by turn (app.learning.training maps per-turn advantages with them)."""
    ids, mask, logps, image_indices, reply_starts = [], [], [], [], []
    image_iter = iter(image_offsets)
    for i, seg in enumerate(segments):
        trained = seg.generated and i >= first_new and seg.logprobs is not None
        if trained:
            reply_starts.append(len(ids))
        ids.extend(seg.token_ids)
        mask.extend([1 if trained else 0] * len(seg.token_ids))
        logps.extend(seg.logprobs if trained else [0.0] * len(seg.token_ids))
        for _ in seg.images:
            image_indices.append(next(image_iter))
    return Sequence(
        np.asarray(ids, dtype=np.int32),
        np.asarray(mask, dtype=np.uint8),
        np.asarray(logps, dtype=np.float32),
        image_indices,
        reply_starts,
    )


def summarize(trajectories: list[Trajectory]) -> dict[str, float]:
    """Rollout metrics of a batch of trajectories."""
    n = max(len(trajectories), 1)
    outcomes = [t.outcome for t in trajectories]
    turns = sum(t.turns for t in trajectories)
    return {
        "episodes": len(trajectories),
        "reward_mean": sum(t.reward for t in trajectories) / n,
        "solve_rate": outcomes.count("solved") / n,
        "stopped_off_goal_rate": outcomes.count("stopped_off_goal") / n,
        "out_of_turns_rate": outcomes.count("out_of_turns") / n,
        "context_full_rate": outcomes.count("context_full") / n,
        "turns_mean": turns / n,
        "invalid_action_rate": sum(t.invalid_actions for t in trajectories) / max(turns, 1),
        "truncated_reply_rate": sum(t.truncated_replies for t in trajectories) / max(turns, 1),
        "generated_tokens": float(sum(t.num_generated_tokens for t in trajectories)),
        "context_tokens_mean": sum(t.num_tokens for t in trajectories) / n,
        # the tokens and pictures an engine computed: each sequence's context once (prefix caching covers the rest)
        "context_tokens": float(sum(t.num_tokens for t in trajectories)),
        "images": float(sum(len(s.image_indices) for t in trajectories for s in t.sequences)),
        "lora_version": min((t.lora_version for t in trajectories), default=-1),
    }
