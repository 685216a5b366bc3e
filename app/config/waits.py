"""The bounds on every wait of the driver (`waits.*`): how long each may last before it is a stall or a failure."""

from __future__ import annotations

from dataclasses import dataclass

from app.config.knobs import knob


@dataclass
class WaitConfig:
    actor_start_s: float = knob(
        900.0,
        "how long the actors may take to be scheduled and ready (engines started, "
        "trainer ranks joined) before the start is a stall",
        gt=0.0,
    )
    collective_s: float = knob(
        600.0,
        "how long a trainer rank waits in a collective, or for the process group to "
        "form, before it fails: bounds how long surviving ranks wait for a lost one",
        gt=0.0,
    )
    phase_s: float = knob(
        3600.0,
        "the longest one phase of a step (rollout, train, sync, eval, checkpoint) may take "
        "before it is a stall, handled like a lost actor",
        gt=0.0,
    )
    stall_factor: float = knob(
        5.0,
        "a phase past this many times its median so far is a stall too (after 3 of them); 0 leaves only phase_s",
        ge=0.0,
    )
    stall_floor_s: float = knob(120.0, "the shortest bound stall_factor may set (short phases vary a lot)", gt=0.0)
    report_every_s: float = knob(10.0, "while the driver waits, a log line this often: what, on whom, how long", gt=0.0)
    lost_peer_s: float = knob(
        20.0,
        "when one actor's call fails, how long to look for a lost actor in the same wait (a collective fails on "
        "the surviving ranks before Ray reports the lost one): found, the run recovers; not, the error stands",
        ge=0.0,
    )
