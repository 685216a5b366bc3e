"""TrainerActor `trainer-{r}`: rank r of the FSDP2 group that updates the LoRA (gloo on CPU, NCCL on GPU)."""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import ray
import torch
import torch.distributed as dist

from actors.heap import freeze_heap
from app.config import Config
from app.learning.out_of_memory import explained_out_of_memory
from app.learning.sft import WarmStartData
from app.learning.training import PolicyTrainer
from app.model.adapters import pack, unpack
from app.model.build import ensure_model
from app.storage.rng import capture_rng, restore_rng
from app.world.maze import generate_maze
from app.world.rules import EpisodeSettings


@ray.remote
class TrainerActor:
    def __init__(self, cfg: Config, rank: int, world: int, model_cache: str):
        self.cfg, self.rank, self.world = cfg, rank, world
        self.model_dir = str(ensure_model(cfg.model, model_cache))
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.trainer = None
        self.warm_start_data = None  # app.learning.sft.WarmStartData, made at the first warm-start step

    def rendezvous_address(self) -> tuple[str, int]:
        """This node's IP and a free port, for rank 0 to host the process group."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def setup(self, master_addr: str, master_port: int) -> dict:

        os.environ.update(
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(master_port),
            RANK=str(self.rank),
            WORLD_SIZE=str(self.world),
            LOCAL_RANK="0",
        )
        if self.world > 1:
            backend = "nccl" if self.device == "cuda" else "gloo"
            dist.init_process_group(
                backend,
                init_method=f"tcp://{master_addr}:{master_port}",
                rank=self.rank,
                world_size=self.world,
                timeout=timedelta(seconds=self.cfg.waits.collective_s),  # how long survivors wait for a lost rank
            )
        self.trainer = PolicyTrainer(self.cfg, self.model_dir, self.rank, self.world, self.device)
        name = torch.cuda.get_device_name() if self.device == "cuda" else "cpu"
        frozen = freeze_heap()  # the model and the libraries live as long as the process: no full pass mid-step
        return {
            "rank": self.rank,
            "node": ray.get_runtime_context().get_node_id(),
            "device": self.device,
            "device_name": name,
            "frozen_objects": frozen,
        }

    @ray.method(num_returns=2)
    def step(self, trajectory_refs: list, step: int):
        """One GRPO update on the step's trajectories; rank 0 also returns the new LoRA tensors."""
        trajectories = [t for batch in ray.get(trajectory_refs) for t in batch]
        with explained_out_of_memory(self.cfg, self.device, "train step"):
            metrics = self.trainer.train_step(trajectories)
        metrics["step"] = step
        lora = self.trainer.trained_tensors(on_device=True)  # a collective: every rank takes part
        packed = pack(lora) if self.rank == 0 else None
        del lora
        self.trainer.release_cached_memory()  # the colocated engine wakes next and needs that memory back
        return metrics, packed

    def sft_step(self, maze_seeds: list[int], lr: float) -> dict:
        """One supervised warm-start step on these mazes (app.learning.sft.WarmStartData: demonstrations, questions)."""

        mazes = [generate_maze(s, self.cfg.maze.size) for s in maze_seeds]
        if self.warm_start_data is None:
            self.warm_start_data = WarmStartData(
                self.trainer.codec, EpisodeSettings.from_config(self.cfg), self.cfg.sft, seed=self.cfg.train.seed
            )
        with explained_out_of_memory(self.cfg, self.device, "warm-start step"):
            metrics = self.trainer.sft_step(self.warm_start_data.batch(mazes), lr)
        self.trainer.release_cached_memory()
        return metrics

    @ray.method(num_returns=4)
    def checkpoint_state(self):
        """(adapter, optimizer tensors, rng tensors, JSON) for a checkpoint; rank 0 returns them, others None."""

        adapter = self.trainer.trained_tensors()
        optimizer, state = self.trainer.optimizer_state()
        rng, rng_json = capture_rng()
        if self.rank != 0:
            return None, None, None, None
        return pack(adapter), pack(optimizer), rng, {**state, "rng": rng_json}

    def load_state(self, saved) -> int:
        """Restores a checkpoint's TrainingState (None: keep the fresh state); returns its step."""

        if saved is None:
            return 0
        trainer_state = saved.state["trainer"]
        self.trainer.load_state(unpack(saved.adapter), unpack(saved.optimizer), trainer_state)
        if self.rank == 0 and saved.rng_tensors:
            restore_rng(saved.rng_tensors, trainer_state["rng"])
        return saved.step

    def lora(self):
        """The current adapter (rank 0 returns it, the others None); every rank must be called."""
        tensors = self.trainer.trained_tensors(on_device=True)
        return pack(tensors) if self.rank == 0 else None

    def shutdown(self) -> None:

        if dist.is_initialized():
            dist.destroy_process_group()
