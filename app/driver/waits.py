"""Every wait of the driver, bounded and spoken: what it waits for, on which actor, since when and until when.

`Waits.gather` is the driver's `ray.get`: the first result that fails raises at once (a lost rank must not hide
behind a surviving one that waits in a collective for it), a line is logged every `waits.report_every_s` while
results are outstanding (naming the actors not done yet and their nodes), and past the phase's bound the wait is a
`Stall`: logged with what waits on what, counted, and answered by the driver loop like a lost actor (release
everything, recover from the newest checkpoint). A call that fails with its own error while a peer in the same wait
is lost (a surviving rank's collective reset by the lost rank) raises the loss, not the consequence.
A phase's bound is `waits.phase_s`, or, once the run has finished that phase a few times, `waits.stall_factor`
times its median (never under `waits.stall_floor_s`).
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import time
from collections import defaultdict
from collections.abc import Sequence

import ray
import ray.exceptions as rex

from app.config import WaitConfig

log = logging.getLogger("mazerl.waits")

# What a lost actor or node raises; anything else is the actor's own error.
LOST = (
    rex.RayActorError,
    rex.ActorUnavailableError,
    rex.NodeDiedError,
    rex.WorkerCrashedError,
    rex.OwnerDiedError,
    rex.ActorPlacementGroupRemoved,
)

# Phases whose first occurrences are not typical (engine warm-up, compilation): the median needs a few.
MEDIAN_AFTER = 3


class Stall(TimeoutError):
    """A wait that ran past its bound. `waiting_on` names the actors that had not answered."""

    def __init__(self, what: str, bound_s: float, waiting_on: list[str]):
        self.what, self.bound_s, self.waiting_on = what, bound_s, waiting_on
        super().__init__(f"{what}: no answer from {', '.join(waiting_on) or 'nobody'} after {bound_s:.0f} s")


class Waits:
    """The bounds of one run's waits, learning each phase's typical duration as the run goes."""

    def __init__(self, cfg: WaitConfig, on_stall=None):
        self.cfg = cfg
        self.durations: dict[str, list[float]] = defaultdict(list)
        self.stalls = 0
        self.on_stall = on_stall  # called with the Stall before it is raised (the metrics sink counts it)

    def bound(self, phase: str) -> float:
        seen = self.durations.get(phase, [])
        if self.cfg.stall_factor > 0 and len(seen) >= MEDIAN_AFTER:
            typical = self.cfg.stall_factor * statistics.median(seen[-20:])
            return min(self.cfg.phase_s, max(typical, self.cfg.stall_floor_s))
        return self.cfg.phase_s

    def gather(self, refs: Sequence, phase: str, holders: Sequence[str], bound_s: float | None = None) -> list:
        """ray.get(refs) in order, failing fast and bounded. holders[i] names the actor that answers refs[i]."""
        refs, holders = list(refs), list(holders)
        if len(refs) != len(holders):
            raise ValueError(f"{len(refs)} refs but {len(holders)} holders for {phase}")
        bound = self.bound(phase) if bound_s is None else bound_s
        start = time.monotonic()
        pending = dict(zip(refs, holders))
        next_report = start + self.cfg.report_every_s
        while pending:
            now = time.monotonic()
            if now - start > bound:
                self._stall(Stall(phase, bound, list(pending.values())))
            timeout = max(0.0, min(next_report, start + bound) - now)
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=timeout)
            for ref in ready:
                try:
                    ray.get(ref)  # raises now if this actor failed, whatever the others are doing
                except LOST:
                    raise
                except rex.RayTaskError as error:
                    self._raise_a_lost_peer(pending, ref, error)
                    raise
                pending.pop(ref)
            if pending and time.monotonic() >= next_report:
                log.info(
                    "waiting for %s: %d of %d answered; still waiting on %s (%.0f s of at most %.0f s)",
                    phase,
                    len(refs) - len(pending),
                    len(refs),
                    ", ".join(pending.values()),
                    time.monotonic() - start,
                    bound,
                )
                next_report += self.cfg.report_every_s
        if bound_s is None:
            self.durations[phase].append(time.monotonic() - start)
        return ray.get(refs)

    def one(self, ref, phase: str, holder: str, bound_s: float | None = None):
        return self.gather([ref], phase, [holder], bound_s)[0]

    def _raise_a_lost_peer(self, pending: dict, failed, error: BaseException) -> None:
        """Raises the loss of another actor of this wait if one is found within waits.lost_peer_s."""
        others = [r for r in pending if r != failed]
        deadline = time.monotonic() + self.cfg.lost_peer_s
        while others and time.monotonic() < deadline:
            ready, others = ray.wait(others, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            for ref in ready:
                try:
                    ray.get(ref)
                except LOST as lost:
                    log.warning("%s failed after %s was lost: %s", pending[failed], pending[ref], error.cause)
                    raise lost from error
                except Exception:  # noqa: BLE001 - another consequence; keep looking for the cause
                    continue

    def _stall(self, stall: Stall) -> None:
        self.stalls += 1
        log.error("stall: %s; treating it as a lost actor (stalls so far: %d)", stall, self.stalls)
        if self.on_stall is not None:
            self.on_stall(stall)
        raise stall


def fetch_failed_returns(calls: Sequence[Sequence]) -> None:
    """For each call of several return values (its refs, the one waited on first) that has failed, fetches its other
    return values: they hold the same error, and Ray prints a dropped ref's error that nothing fetched as an
    "Unhandled error" traceback, after the error the driver already reports. Calls still running or that succeeded
    are left as they are (a successful adapter or trajectory batch stays in the object store)."""
    for first, *others in calls:
        if not ray.wait([first], timeout=0)[0]:
            continue
        try:
            ray.get(first)
            continue
        except Exception:
            pass
        for ref in others:
            with contextlib.suppress(Exception):
                ray.get(ref, timeout=0)
