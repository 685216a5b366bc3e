"""app.driver.waits on real Ray tasks: results in order, the first failure at once, a stall past the bound, a word
while waiting; and the placement checks that turn an impossible placement into an error instead of a wait."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from app.config import ConfigError, WaitConfig
from app.driver.waits import Stall, Waits
from placement import plan as placement
from tests.conftest import tiny_config


def sleeper():
    import ray

    @ray.remote(num_cpus=0)
    def sleep_then(seconds: float, value=None, fail: bool = False):
        time.sleep(seconds)
        if fail:
            raise RuntimeError("this rank is gone")
        return value

    return sleep_then


def test_results_come_back_in_order(ray_cluster):
    sleep_then = sleeper()
    waits = Waits(WaitConfig())
    refs = [sleep_then.remote(0.3, "slow"), sleep_then.remote(0.0, "fast")]
    assert waits.gather(refs, "train", ["trainer-0", "trainer-1"]) == ["slow", "fast"]
    assert len(waits.durations["train"]) == 1


def test_the_first_failure_raises_at_once_while_others_still_wait(ray_cluster):
    import ray

    sleep_then = sleeper()
    waits = Waits(WaitConfig(phase_s=120, lost_peer_s=2))
    survivor = sleep_then.remote(60)  # a rank waiting in a collective for the lost one
    lost = sleep_then.remote(0.2, fail=True)
    start = time.monotonic()
    with pytest.raises(ray.exceptions.RayTaskError, match="this rank is gone"):
        waits.gather([survivor, lost], "train", ["trainer-0", "trainer-1"])
    assert time.monotonic() - start < 15
    ray.cancel(survivor, force=True)


def test_a_rank_that_fails_because_its_peer_was_lost_raises_the_loss(ray_cluster):
    """A surviving rank's collective fails (connection reset) before Ray reports the rank that was lost: the wait
    raises the loss, which the driver recovers from, not the survivor's error, which would end the run."""
    import ray

    @ray.remote(num_cpus=0)
    class Rank:
        def step(self, fail_after: float | None):
            time.sleep(fail_after if fail_after is not None else 60)
            raise RuntimeError("Read error: Connection reset by peer")

    survivor, lost = Rank.remote(), Rank.remote()
    ray.get([survivor.__ray_ready__.remote(), lost.__ray_ready__.remote()])
    refs = [survivor.step.remote(0.3), lost.step.remote(None)]
    threading.Timer(2.0, ray.kill, args=(lost,)).start()  # Ray reports the loss after the survivor has failed
    waits = Waits(WaitConfig(phase_s=120, lost_peer_s=20))
    with pytest.raises(ray.exceptions.RayActorError):
        waits.gather(refs, "train", ["trainer-0", "trainer-1"])
    # no peer lost: the error is the actor's own, raised once the others were given waits.lost_peer_s
    refs = [survivor.step.remote(0.1), sleeper().remote(60)]
    start = time.monotonic()
    with pytest.raises(ray.exceptions.RayTaskError, match="Connection reset"):
        Waits(WaitConfig(phase_s=120, lost_peer_s=2)).gather(refs, "train", ["trainer-0", "trainer-1"])
    assert time.monotonic() - start < 15
    ray.cancel(refs[1], force=True)


def test_past_its_bound_a_wait_is_a_stall_that_names_who_did_not_answer(ray_cluster, caplog):
    import ray

    sleep_then = sleeper()
    seen = []
    waits = Waits(WaitConfig(phase_s=3, report_every_s=1), on_stall=seen.append)
    answered, stuck = sleep_then.remote(0.0, 1), sleep_then.remote(60)
    # the first report must find one answer in: on a busy machine a task's worker can take over a second to start
    assert ray.wait([answered], timeout=60)[0] == [answered]
    start = time.monotonic()
    with caplog.at_level(logging.INFO, logger="mazerl.waits"), pytest.raises(Stall) as caught:
        waits.gather([answered, stuck], "rollout", ["rollout-0 on node a", "rollout-1 on node b"])
    assert 3 <= time.monotonic() - start < 10
    assert caught.value.waiting_on == ["rollout-1 on node b"] and "rollout-1 on node b" in str(caught.value)
    assert isinstance(caught.value, TimeoutError)  # the driver loop answers it like a lost actor
    assert waits.stalls == 1 and seen == [caught.value]
    progress = [r.getMessage() for r in caplog.records if r.getMessage().startswith("waiting for rollout")]
    assert len(progress) >= 2 and "1 of 2 answered" in progress[0] and "rollout-1 on node b" in progress[0]
    ray.cancel(stuck, force=True)


def test_a_phase_is_bounded_by_its_median_once_it_has_one():
    waits = Waits(WaitConfig(phase_s=3600, stall_factor=5, stall_floor_s=30))
    assert waits.bound("train") == 3600
    waits.durations["train"] += [20.0, 22.0, 21.0]
    assert waits.bound("train") == 5 * 21.0
    waits.durations["sync"] += [0.5, 0.4, 0.6]
    assert waits.bound("sync") == 30  # never under the floor: short phases vary a lot
    assert Waits(WaitConfig(phase_s=60, stall_factor=0)).bound("train") == 60


def test_an_impossible_placement_is_an_error_that_names_what_is_missing():
    plan = placement.make_plan(tiny_config("placement.cpus_per_bundle=2"))
    head, worker = {"CPU": 1.0, "head": 1.0}, {"CPU": 1.0}
    with pytest.raises(ConfigError) as caught:
        placement.check_nodes(plan, [head, worker])
    assert caught.value.field_path == "placement.cpus_per_bundle" and "CPU': 2" in caught.value.problem
    small = placement.make_plan(tiny_config("placement.consolidator_cpus=0.8", "placement.evaluator_cpus=0.5"))
    with pytest.raises(ConfigError) as caught:
        placement.check_nodes(small, [head, {"CPU": 4.0}])
    assert caught.value.field_path == "placement.consolidator_cpus"
    placement.check_nodes(placement.make_plan(tiny_config()), [head, {"CPU": 2.0}])  # fits: no error


def test_the_plan_reserves_the_heads_share_for_its_actors_first():
    plan = placement.make_plan(tiny_config("placement.cpus_per_bundle=1"))
    nodes = placement.parse_cluster("head:CPU=1,head=1;2x worker:CPU=1")
    assert placement.simulate(plan, nodes) == ["worker-0", "worker-1"]
    text = placement.describe(plan, {"head": 1})
    assert "evaluator: CPU 0.1, pinned to the head node" in text and "consolidator: CPU 0.1, pinned" in text


@pytest.mark.parametrize("phase", ["rollout", "train", "checkpoint", "restore"])
def test_a_failed_phase_leaves_no_unhandled_error_for_its_other_return_values(ray_cluster, capfd, caplog, phase):
    """A rollout returns (summary, trajectories), a train step (metrics, adapter), a checkpoint's state four values,
    a restore (summary, saved state); when the call fails, the driver reports the error of the one it waits on, and
    the others' copies of it must not follow as Ray's "Unhandled error" traceback when the driver drops their refs."""
    import gc
    from types import SimpleNamespace

    import ray

    from app.driver.cluster import Actors
    from app.driver.phases import rollout_phase, train_phase, write_checkpoint
    from app.main import restore

    @ray.remote(num_cpus=0)
    class FailingRank:
        @ray.method(num_returns=2)
        def play(self, share, n_samples, sampling):
            raise ValueError("out of memory, say")

        @ray.method(num_returns=2)
        def resume(self, saved_steps):
            raise ValueError("out of memory, say")

        @ray.method(num_returns=2)
        def step(self, trajectory_refs, step):
            raise ValueError("out of memory, say")

        @ray.method(num_returns=4)
        def checkpoint_state(self):
            raise ValueError("out of memory, say")

    rank = FailingRank.remote()
    actors = Actors(pg=None, rollouts=[rank], trainers=[rank], evaluator=None, consolidator=rank)
    cfg = tiny_config()

    def failed_phase() -> str:  # the call's refs live in the phase's frame, which the traceback holds until here
        try:
            if phase == "rollout":
                rollout_phase(actors, ["a maze"], cfg, 1, 0, Waits(WaitConfig()))
            elif phase == "train":
                train_phase(actors, [], 1, Waits(WaitConfig()))
            elif phase == "checkpoint":
                write_checkpoint(actors, 1, dict, Waits(WaitConfig()))
            else:
                restore(SimpleNamespace(cfg=cfg, waits=Waits(WaitConfig()), saved_steps=[]), actors)
        except ValueError as e:
            return str(e)
        return "no error"

    assert "out of memory, say" in failed_phase()
    gc.collect()
    time.sleep(3)  # Ray reports an unhandled error from a background check
    printed = capfd.readouterr()
    assert "Unhandled error" not in printed.err + caplog.text
    ray.kill(rank)
