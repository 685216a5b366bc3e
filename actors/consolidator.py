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
from app.storage import checkpoint, open_store

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
        if ck.s3_uri:
            base = ck.s3_uri.rstrip("/")
            self.checkpoints.append(open_store(f"{base}/checkpoints", ck.s3_endpoint_url))
            self.exports.append(open_store(f"{base}/export", ck.s3_endpoint_url))

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def export_adapter(self, step: int, adapter: PackedTensors | dict[str, torch.Tensor]) -> dict:
        """A PEFT adapter folder global_step_N in the export dir (and under s3://.../export)."""
        start = time.perf_counter()
        adapter = unpack(adapter)
        locations = [
            checkpoint.export_adapter(store, step, adapter, self.spec.peft_config(self.cfg.model.path))
            for store in self.exports
        ]
        return {"export_s": time.perf_counter() - start, "locations": [str(x) for x in locations]}

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
        names = [
            checkpoint.save_checkpoint(store, ts, keep_last=self.cfg.checkpoint.keep_last) for store in self.checkpoints
        ]
        adapter_bytes = sum(t.numel() * t.element_size() for t in adapter.values())
        optimizer_bytes = sum(t.numel() * t.element_size() for t in optimizer.values())
        return {
            "checkpoint_s": time.perf_counter() - start,
            "name": names[0],
            "peak_rss_bytes": peak_rss_bytes(),
            "adapter_bytes": adapter_bytes,
            "optimizer_bytes": optimizer_bytes,
        }

    @ray.method(num_returns=2)
    def resume(self):
        """(summary, TrainingState or None) per checkpoint.resume_mode: local root first, then S3."""
        ck = self.cfg.checkpoint
        ts, location = None, None
        if ck.resume_mode == "path":
            ts, location = (
                checkpoint.resolve_resume("path", self.checkpoints[0], ck.resume_path, ck.s3_endpoint_url),
                ck.resume_path,
            )
        elif ck.resume_mode == "latest":
            for store in self.checkpoints:  # the shared directory first, then S3 (a replaced head node)
                info = checkpoint.find_latest(store)
                if info is not None:
                    ts, location = checkpoint.load_checkpoint(store, info.name), info.location
                    break
        if ts is None:
            return {"step": 0, "location": None}, None
        ts.adapter, ts.optimizer = pack(ts.adapter), pack(ts.optimizer)  # zero-copy for every trainer rank
        return {"step": ts.step, "state": ts.state, "location": location}, ts
