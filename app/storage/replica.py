"""Copies of committed checkpoints and exports in a second store (S3), made in the background and retried.

A checkpoint is complete once it is committed to the shared directory; the S3 copy is a replica. It is made by one
thread, in commit order, with the same commit rule (every file, the manifest last, then `latest`), and retried
with a growing pause while the store is unreachable: an S3 outage slows nothing and loses nothing, and the copies
catch up when it ends. `pending` says how far behind they are; `flush` waits (bounded) for them to catch up.
"""

from __future__ import annotations

import logging
import queue
import shutil
import threading
import time
from dataclasses import dataclass

from app.storage import checkpoint, open_store
from app.storage.store import Store

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Copy:
    source: Store
    target: Store
    name: str
    keep_last: int | None = None


def replicate(source: Store | str, target: Store | str, name: str, keep_last: int | None = None) -> str:
    """Copies the committed folder `name` (a checkpoint or an exported adapter) from `source` into `target` with the
    same commit: every file, the manifest last, then `latest`. The source is checked against its manifest first,
    so a damaged folder is never copied; one that is gone (pruned by a newer one) raises FileNotFoundError."""
    source, target = open_store(source), open_store(target)
    if not source.list(f"{name}/"):
        raise FileNotFoundError(f"{source.uri(name)} is gone (a newer checkpoint pruned it)")
    manifest = checkpoint.read_manifest(source, name)
    with checkpoint.local_copies(source, name, manifest["files"]) as paths:
        checkpoint.check_files(manifest, lambda fname: open(paths[fname], "rb"))
        checkpoint.remove_leftovers(target)
        with target.staging(name) as staged:
            for fname, path in paths.items():
                shutil.copyfile(path, staged / fname)
            (staged / checkpoint.MANIFEST).write_bytes(source.get_bytes(f"{name}/{checkpoint.MANIFEST}"))
            target.commit_dir(staged, name, last=checkpoint.MANIFEST)
    target.put_bytes(checkpoint.LATEST, name.encode())
    if keep_last is not None:
        checkpoint.prune(target, keep_last, current=name)
    log.info("%s copied to %s", name, target.uri(name))
    return name


class Replicator:
    """One background thread copying committed folders from a source store to a target store, in order."""

    def __init__(self, first_pause_s: float = 1.0, max_pause_s: float = 60.0):
        self.first_pause_s, self.max_pause_s = first_pause_s, max_pause_s
        self._queue: queue.Queue[Copy] = queue.Queue()
        self._lock = threading.Lock()
        self._pending = 0
        self.copied = 0
        self.failures = 0
        self.last_error = ""
        self._thread = threading.Thread(target=self._run, name="replicator", daemon=True)
        self._thread.start()

    def submit(self, source: Store, target: Store, name: str, keep_last: int | None = None) -> None:
        with self._lock:
            self._pending += 1
        self._queue.put(Copy(source, target, name, keep_last))

    @property
    def pending(self) -> int:
        with self._lock:
            return self._pending

    def status(self) -> dict:
        return {
            "replica_pending": self.pending,
            "replica_copied": self.copied,
            "replica_failures": self.failures,
            "replica_last_error": self.last_error,
        }

    def flush(self, timeout_s: float) -> bool:
        """Waits until every submitted copy is made, at most timeout_s; True when none is left."""
        deadline = time.monotonic() + timeout_s
        while self.pending and time.monotonic() < deadline:
            time.sleep(0.1)
        return not self.pending

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            pause = self.first_pause_s
            while True:
                try:
                    replicate(job.source, job.target, job.name, job.keep_last)
                    self.copied += 1
                    break
                except FileNotFoundError as e:  # pruned by a newer one, whose copy is queued after this one
                    log.info("not copying %s: %s", job.name, e)
                    break
                except checkpoint.CheckpointCorrupt as e:  # no retry mends it; a damaged folder is never copied
                    self.failures += 1
                    self.last_error = f"{job.name} not copied: {e}"[:300]
                    log.error("%s", self.last_error)
                    break
                except Exception as e:  # noqa: BLE001 - any failure of the copy is retried; the source stays intact
                    self.failures += 1
                    self.last_error = f"{type(e).__name__}: {e}"[:300]
                    log.warning(
                        "copying %s to %s failed (%s); retrying in %.1f s",
                        job.name,
                        job.target.describe(),
                        self.last_error,
                        pause,
                    )
                    time.sleep(pause)
                    pause = min(pause * 2, self.max_pause_s)
            with self._lock:
                self._pending -= 1
