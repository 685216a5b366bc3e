"""The processes of a running job's actors, read without the dashboard: their ids from Ray's control store, the
method each is in from its process title (Ray names a worker `ray::Class.method` while it runs a call). Every node of
a ray.cluster_utils cluster is on this machine, so /proc holds them all."""

from __future__ import annotations

from pathlib import Path


def actor_pids(prefix: str) -> dict[str, int]:
    """Alive actors whose name starts with prefix, by name."""
    from ray._private import state

    return {
        info["Name"]: info["Pid"]
        for info in state.actors().values()
        if info.get("Name", "").startswith(prefix) and info.get("State") == "ALIVE" and info.get("Pid")
    }


def title(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def in_method(pid: int, qualified: str) -> bool:
    """Whether the process runs `Class.method` now."""
    return title(pid).split()[:1] == [f"ray::{qualified}"]
