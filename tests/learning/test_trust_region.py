"""`app.learning.trust_region.bounded_step`: an optimizer step shrunk by halves until the policy's move fits a KL
bound."""

from __future__ import annotations

import pytest
import torch

from app.learning.trust_region import MAX_HALVINGS, bounded_step


def quadratic_setup(start: float, step_to: float):
    """One parameter moved by a 'step' from start to step_to; the 'KL' of a move d is d**2 (KL grows as the
    square of a small step, which is what the halvings count on)."""
    p = torch.nn.Parameter(torch.tensor([start, -start]))
    target = torch.tensor([step_to, -step_to])

    def step():
        with torch.no_grad():
            p.copy_(target)

    def measure():
        return float(((p.detach() - torch.tensor([start, -start])) ** 2).mean())

    return p, step, measure


def test_a_step_within_the_bound_is_kept_whole():
    p, step, measure = quadratic_setup(0.0, 0.1)
    out = bounded_step([p], step, measure, max_kl=0.05)
    assert (out.scale, out.halvings) == (1.0, 0)
    assert out.kl == pytest.approx(0.01)
    assert p.tolist() == pytest.approx([0.1, -0.1])


def test_a_step_past_the_bound_is_halved_until_it_fits():
    p, step, measure = quadratic_setup(1.0, 2.0)  # KL 1.0; half the step 0.25; a quarter 0.0625
    out = bounded_step([p], step, measure, max_kl=0.1)
    assert (out.scale, out.halvings) == (0.25, 2)
    assert out.kl == pytest.approx(0.0625) and out.kl <= 0.1
    assert p.tolist() == pytest.approx([1.25, -1.25])


def test_a_step_that_never_fits_is_dropped_and_the_parameters_restored():
    p, step, measure = quadratic_setup(1.0, 2.0)
    calls = []
    out = bounded_step([p], step, lambda: calls.append(1) or measure() + 1.0, max_kl=0.5)  # never below 1.0
    assert (out.scale, out.kl, out.halvings) == (0.0, 0.0, MAX_HALVINGS)
    assert p.tolist() == [1.0, -1.0]
    assert len(calls) == 1 + MAX_HALVINGS  # the whole step, then each halving: one measurement each


def test_several_parameters_shrink_together_and_keep_their_dtype():
    a = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    b = torch.nn.Parameter(torch.ones(2, 2))

    def step():
        with torch.no_grad():
            a.add_(1.0)
            b.add_(-2.0)

    def measure():
        return float(a.detach().float().abs().max()) + float((b.detach() - 1).abs().max())  # 3 at the whole step

    out = bounded_step([a, b], step, measure, max_kl=1.0)
    assert (out.scale, out.halvings) == (0.25, 2)
    assert a.dtype == torch.bfloat16 and a.tolist() == [0.25] * 3
    assert b.tolist() == [[0.5, 0.5], [0.5, 0.5]]


def test_a_dropped_later_step_reports_the_move_the_earlier_passes_kept():
    """Under several passes the reference is the policy before the training step: dropping the second pass's
    optimizer step leaves the first pass's move, whose KL the caller passes in."""
    p, step, measure = quadratic_setup(1.0, 2.0)
    out = bounded_step([p], step, lambda: measure() + 1.0, max_kl=0.5, kl_before=0.3)
    assert (out.scale, out.kl) == (0.0, 0.3)
    assert p.tolist() == [1.0, -1.0]
