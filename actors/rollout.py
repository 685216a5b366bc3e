"""RolloutActor `rollout-{i}`: one generation engine, playing its share of each step's episodes."""

from __future__ import annotations

import hashlib
import os

import ray
import torch

from actors.heap import freeze_heap
from app.config import Config, LoraSettings
from app.model.adapters import PackedTensors, held_form, unpack
from app.model.build import ensure_model
from app.rollout.engines import Sampling, make_engine
from app.rollout.episodes import EpisodeRequest, play_episodes
from app.rollout.trajectory import Trajectory, summarize
from app.world.maze import Maze
from app.world.rules import EpisodeSettings


@ray.remote
class RolloutActor:
    def __init__(self, cfg: Config, index: int, model_cache: str):
        self.cfg, self.index = cfg, index
        device = "cuda" if torch.cuda.is_available() else "cpu"
        self.model_dir = str(ensure_model(cfg.model, model_cache))
        self.engine = make_engine(cfg, self.model_dir, device, index)
        self.settings = EpisodeSettings.from_config(cfg)
        self.frozen_objects = freeze_heap()  # what lives as long as the process: no full collection mid-rollout

    def ready(self) -> dict:
        return {
            "index": self.index,
            "node": ray.get_runtime_context().get_node_id(),
            "pid": os.getpid(),
            "frozen_objects": self.frozen_objects,
            **self.engine.stats(),
        }

    @ray.method(num_returns=2)
    def play(self, groups: list[tuple[Maze, int]], n_samples: int, sampling: Sampling) -> tuple[dict, list[Trajectory]]:
        """Plays each (maze, group) n_samples times; returns (summary, trajectories)."""
        requests = [EpisodeRequest(maze, group, s) for maze, group in groups for s in range(n_samples)]
        trajectories = play_episodes(self.engine, self.engine.codec, requests, self.settings, sampling)
        summary = summarize(trajectories)
        summary["rewards"] = [(t.group, t.sample, t.reward) for t in trajectories]
        return summary, trajectories

    def load_lora(self, adapter: PackedTensors | dict[str, torch.Tensor], version: int) -> dict:
        """Loads the adapter (a zero-copy view of the object store; the engine copies it) as `version`."""
        self.engine.load_lora(adapter, version)
        return {"index": self.index, "version": version}

    def lora_checksum(self) -> str:
        """Checksum of the adapter the engine generates with, read back from the engine ("" before the first sync);
        `held_checksum` of the trainer's tensors is what it must equal."""
        state = self.engine.lora_state()
        return lora_checksum(state) if state is not None else ""

    def sleep(self) -> None:
        self.engine.sleep()

    def wake(self) -> None:
        self.engine.wake()

    def stats(self) -> dict:
        return self.engine.stats()


def lora_checksum(tensors: PackedTensors | dict[str, torch.Tensor]) -> str:
    """sha256 over names and raw bytes: equal exactly when the adapters are equal bit for bit."""
    tensors = unpack(tensors)
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def held_checksum(tensors: PackedTensors | dict[str, torch.Tensor], lora: LoraSettings, dtype: str = "float32") -> str:
    """The checksum a rollout actor reports (`RolloutActor.lora_checksum`) once its engine holds `tensors`, the
    trainer's adapter: equal exactly when the engine holds it bit for bit."""
    return lora_checksum(held_form(unpack(tensors), lora.rank, lora.alpha, getattr(torch, dtype)))
