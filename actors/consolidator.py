"""ConsolidatorActor: pinned to the head node; writes adapters and full checkpoints, locally and to S3.

It outlives worker nodes (a lost trainer node does not take the checkpoint writer with it), and it is
the only writer of the checkpoint root, which app.storage.checkpoint assumes.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import ray
import torch

from app.config import Config
from app.model.adapters import AdapterSpec, PackedTensors, pack, unpack
from app.storage import StorageUnavailable, checkpoint, open_store
from app.storage.replica import Replicator

log = logging.getLogger(__name__)


def peak_rss_reset() -> None:
    """Resets the kernel's high-water mark of this process's memory (Linux), so a phase's peak can be read."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def peak_rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


@ray.remote
class ConsolidatorActor:
    def __init__(self, cfg: Config, adapter_spec: AdapterSpec):
        self.cfg, self.spec = cfg, adapter_spec
        ck = cfg.checkpoint
        self.checkpoints = [open_store(ck.ckpt_path)]
        self.exports = [open_store(ck.export_dir)]
        self.replicas = Replicator()  # the S3 copies, made in the background: an S3 outage never holds a step
        if ck.s3_uri:
            base = ck.s3_uri.rstrip("/")
            self.checkpoints.append(open_store(f"{base}/checkpoints", ck.s3_endpoint_url))
            self.exports.append(open_store(f"{base}/export", ck.s3_endpoint_url))
            for local, remote, keep in ((*self.checkpoints, ck.keep_last), (*self.exports, None)):
                self._catch_up(local, remote, keep)

    def _catch_up(self, local, remote, keep_last) -> None:
        """A consolidator that died with copies pending left them undone: the newest local folder goes again."""
        try:
            mine, theirs = checkpoint.find_latest(local), checkpoint.find_latest(remote)
        except StorageUnavailable:
            theirs = None
            mine = checkpoint.find_latest(local)
        if mine is not None and (theirs is None or theirs.step < mine.step):
            self.replicas.submit(local, remote, mine.name, keep_last)

    def replica_status(self) -> dict:
        """How far the S3 copies trail the shared directory (replica_pending folders), and their failures."""
        return self.replicas.status()

    def flush(self, timeout_s: float) -> dict:
        """Waits, at most timeout_s, until every S3 copy is made; returns replica_status."""
        self.replicas.flush(timeout_s)
        return self.replicas.status()

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def export_adapter(self, step: int, adapter: PackedTensors | dict[str, torch.Tensor]) -> dict:
        """A PEFT adapter folder global_step_N in the export dir (and under s3://.../export)."""
        start = time.perf_counter()
        adapter = unpack(adapter)
        local, *remote = self.exports
        name = checkpoint.export_adapter(local, step, adapter, self.spec.peft_config(self.cfg.model.path))
        for store in remote:
            self.replicas.submit(local, store, name)
        return {"export_s": time.perf_counter() - start, "locations": [local.uri(name)] + [s.uri(name) for s in remote]}

    def save_checkpoint(
        self, step: int, adapter: PackedTensors, optimizer: PackedTensors, rng: dict[str, torch.Tensor], state: dict
    ) -> dict:
        """The full training state, committed atomically to every checkpoint store.

        The packed tensors are zero-copy views of Ray's shared memory, written to disk one tensor at a
        time, so this process adds little beyond them (peak_rss_bytes reports it)."""
        peak_rss_reset()
        start = time.perf_counter()
        adapter, optimizer = unpack(adapter), unpack(optimizer)
        ts = checkpoint.TrainingState(
            step=step,
            adapter=adapter,
            adapter_config=self.spec.peft_config(self.cfg.model.path),
            optimizer=optimizer,
            rng_tensors=rng,
            state=state,
        )
        local, *remote = self.checkpoints
        name = checkpoint.save_checkpoint(local, ts, keep_last=self.cfg.checkpoint.keep_last)
        for store in remote:
            self.replicas.submit(local, store, name, self.cfg.checkpoint.keep_last)
        adapter_bytes = sum(t.numel() * t.element_size() for t in adapter.values())
        optimizer_bytes = sum(t.numel() * t.element_size() for t in optimizer.values())
        return {
            "checkpoint_s": time.perf_counter() - start,
            "name": name,
            "replica_pending": self.replicas.pending,
            "peak_rss_bytes": peak_rss_bytes(),
            "adapter_bytes": adapter_bytes,
            "optimizer_bytes": optimizer_bytes,
        }

    @ray.method(num_returns=2)
    def resume(self, this_run: list[int] = ()):
        """(summary, TrainingState or None): the newest complete checkpoint of `this_run` (the steps this run
        committed, on a recovery), else the run's start per checkpoint.resume_mode; local root first, then S3."""
        ts, location = self._newest_of(this_run) if this_run else (None, None)
        if ts is None:
            if this_run:
                log.warning("none of this run's checkpoints %s loads: starting over as at the run's start", this_run)
            ts, location = self._start()
        if ts is None:
            return {"step": 0, "location": None}, None
        ts.adapter, ts.optimizer = pack(ts.adapter), pack(ts.optimizer)  # zero-copy for every trainer rank
        return {"step": ts.step, "state": ts.state, "location": location}, ts

    def _newest_of(self, steps: list[int]):
        for step in sorted(set(steps), reverse=True):
            name = checkpoint.folder_name(step)
            for store in self.checkpoints:  # the shared directory first, then S3 (a replaced head node)
                try:
                    return checkpoint.load_checkpoint(store, name), store.uri(name)
                except (checkpoint.CheckpointCorrupt, FileNotFoundError, StorageUnavailable) as e:
                    log.warning("checkpoint %s does not load (%s); trying the next", store.uri(name), e)
        return None, None

    def _start(self):
        ck = self.cfg.checkpoint
        if ck.resume_mode == "path":
            ts = checkpoint.resolve_resume("path", self.checkpoints[0], ck.resume_path, ck.s3_endpoint_url)
            return ts, ck.resume_path
        if ck.resume_mode == "latest":
            for store in self.checkpoints:
                info = checkpoint.find_latest(store)
                if info is not None:
                    return checkpoint.load_checkpoint(store, info.name), info.location
        return None, None
