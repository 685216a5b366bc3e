"""A bound on how far one training step moves the policy: backtracking along the optimizer's step.

The PPO clip bounds the ratio of tokens still inside it, not how far one Adam step can carry the policy: single
steps can move it 0.16-0.28 nats a token where the median step moves it 0.016, and a GPU run's solve rate fell
from 54.7% to 31.2% over such steps. With `train.max_update_kl` set, the trainer measures
k3 KL(policy before the step || after it) on the step's own batch after every optimizer step; past the bound, the
parameters go back along the step, keeping half of it, then a quarter..., until it fits. The Adam moments keep the
gradient they saw; only the parameter move shrinks. This is TRPO's backtracking line search applied to an Adam step
(PPO's `target_kl` only stops further passes, and cannot undo the step that overshot); neither torch nor PEFT
offers it, so it is written here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

# 1/64 of a step: KL grows about as the square of the step, so six halvings cut it ~4000-fold; a step still too
# large after them is one whose direction is wrong for this batch, and is dropped
MAX_HALVINGS = 6


@dataclass(frozen=True)
class BoundedStep:
    kl: float  # k3 KL(reference || after) once the step is kept (kl_before when it was dropped)
    scale: float  # share of the optimizer's step kept: 1.0, 0.5, 0.25 ... or 0.0 when dropped
    halvings: int  # how many times the step was halved


def bounded_step(
    params: Sequence[torch.Tensor],
    step: Callable[[], None],
    measure: Callable[[], float],
    max_kl: float,
    kl_before: float = 0.0,
) -> BoundedStep:
    """Runs `step` (the optimizer's), then shrinks its move of `params` until `measure()` (the KL of the
    policy now to a reference: the policy before the training step, whose earlier passes may have moved it
    already, by `kl_before`) is at most `max_kl`.

    `measure` must give every rank the same number (all-reduced), so that ranks halve in lockstep; FSDP2's
    sharded parameters (DTensors) are moved shard by shard, which needs no collective.
    """
    with torch.no_grad():
        before = [p.detach().clone() for p in params]
    step()
    kl = measure()
    if kl <= max_kl:
        return BoundedStep(kl, 1.0, 0)
    with torch.no_grad():
        after = [p.detach().clone() for p in params]
    scale, halvings = 1.0, 0
    while kl > max_kl and halvings < MAX_HALVINGS:
        scale, halvings = scale / 2, halvings + 1
        _place(params, before, after, scale)
        kl = measure()
    if kl > max_kl:
        _place(params, before, after, 0.0)
        return BoundedStep(kl_before, 0.0, halvings)
    return BoundedStep(kl, scale, halvings)


def _place(
    params: Sequence[torch.Tensor], before: Sequence[torch.Tensor], after: Sequence[torch.Tensor], scale: float
) -> None:
    """params = before + scale * (after - before)."""
    with torch.no_grad():
        for p, b, a in zip(params, before, after):
            p.copy_(torch.lerp(b, a, scale))
