"""The training maze stream: seeded, resumable, and never an evaluation maze."""

from __future__ import annotations

import pytest

from app.config import ConfigError
from app.world.maze import generate_maze
from app.world.sampler import MazeSampler, eval_mazes


def test_never_yields_an_eval_maze_even_when_seeds_collide():
    # the eval set deliberately holds the layouts of training seeds 0..19
    held_out = {generate_maze(s, 7).identity for s in range(20)}
    sampler = MazeSampler(seed=1, dataset_size=100, maze_size=7, eval_identities=held_out)
    assert sampler.skipped_eval >= 20
    seen = [m.identity for m in sampler.next(300)]
    assert not held_out & set(seen)
    assert len(set(seen)) == 100  # three epochs over 100 distinct mazes


def test_real_eval_set_is_disjoint_from_training():
    ev = eval_mazes(1_000_000, 64, 7)
    ids = {m.identity for m in ev}
    sampler = MazeSampler(42, 400, 7, ids)
    assert not ids & {m.identity for m in sampler.next(800)}


def test_deterministic_and_resumable():
    a = MazeSampler(7, 50, 9, set())
    first = [m.seed for m in a.next(30)]
    state = a.state_dict()
    rest = [m.seed for m in a.next(45)]
    b = MazeSampler(7, 50, 9, set())
    assert [m.seed for m in b.next(30)] == first
    c = MazeSampler(7, 50, 9, set())
    c.load_state_dict(state)
    assert [m.seed for m in c.next(45)] == rest


def test_each_epoch_is_a_new_order_of_the_same_set():
    s = MazeSampler(3, 20, 9, set())
    e0, e1 = [m.seed for m in s.next(20)], [m.seed for m in s.next(20)]
    assert sorted(e0) == sorted(e1) and e0 != e1
    assert s.state_dict()["epoch"] == 1


def test_state_from_another_run_is_refused():
    state = MazeSampler(3, 20, 9, set()).state_dict()
    with pytest.raises(ValueError):
        MazeSampler(4, 20, 9, set()).load_state_dict(state)


def test_asking_for_more_mazes_than_exist_is_a_config_error():
    with pytest.raises(ConfigError) as err:
        MazeSampler(0, 2000, 7, set(), give_up_after=3000)
    assert err.value.field_path == "train.dataset_size"


def test_random_starts_keep_walls_and_goal_and_replay_on_resume():
    plain = MazeSampler(5, 60, 7, set())
    moved = MazeSampler(5, 60, 7, set(), random_starts=0.5)
    corner, mixed = plain.next(40), moved.next(40)
    starts_moved = 0
    for a, b in zip(corner, mixed):
        assert a.seed == b.seed and a.goal == b.goal and (a.walls == b.walls).all()
        assert b.start != b.goal and b.is_open(b.start)
        starts_moved += a.start != b.start
    assert 10 <= starts_moved <= 30  # about half, each drawn from (seed, epoch, position)
    state = moved.state_dict()
    rest = [(m.seed, m.start) for m in moved.next(30)]
    again = MazeSampler(5, 60, 7, set(), random_starts=0.5)
    again.load_state_dict(state)
    assert [(m.seed, m.start) for m in again.next(30)] == rest


def test_random_starts_never_make_a_held_out_maze():
    ids = {m.identity for m in eval_mazes(1_000_000, 64, 7)}
    sampler = MazeSampler(42, 704, 7, ids, random_starts=1.0)
    seen = sampler.next(1500)
    assert not ids & {m.identity for m in seen}
    assert sum(m.start not in {(1, 1), (5, 5), (1, 5), (5, 1)} for m in seen) > 1000
