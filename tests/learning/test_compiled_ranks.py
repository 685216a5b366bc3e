"""model.compile_layers with several trainer ranks: the layers are compiled before FSDP2 shards them, and two ranks
train the eager ranks' steps (gloo on a CPU, one process a rank, no Ray)."""

from __future__ import annotations

import dataclasses
import queue

import pytest
import torch
import torch.multiprocessing as mp

from tests.s3_server import free_port

pytestmark = pytest.mark.timeout(600)


def two_steps(rank: int, port: int, compiled: bool, model_dir: str, out) -> None:
    import os

    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    try:
        from app.config import LoraSettings
        from app.learning.training import PolicyTrainer
        from app.rollout.engines.base import Sampling
        from app.rollout.engines.hf import HFEngine
        from app.rollout.episodes import EpisodeRequest, play_episodes
        from app.world.maze import generate_maze
        from app.world.rules import EpisodeSettings
        from tests.conftest import tiny_config

        engine = HFEngine(model_dir, LoraSettings(rank=8, alpha=16))
        requests = [EpisodeRequest(generate_maze(group, 7), group, s) for group in range(2) for s in range(4)]
        settings = EpisodeSettings(max_turns=2, maze_size=7, cell_px=32, image_history=0, max_model_len=4096)
        played = play_episodes(engine, engine.codec, requests, settings, Sampling(8, 1.0, seed=3))
        played = [dataclasses.replace(t, reward=float(t.sample % 2)) for t in played]
        cfg = tiny_config(
            "train.micro_batch=4", "train.lr=1e-3", "placement.num_bundles=2", f"model.compile_layers={compiled}"
        )
        trainer = PolicyTrainer(cfg, model_dir, rank=rank, world=2)
        layers = trainer.model.base_model.model.model.language_model.layers
        is_compiled = all(layer._compiled_call_impl is not None for layer in layers)
        steps = [trainer.train_step(played) for _ in range(2)]
        tensors = trainer.trained_tensors()  # a collective: every rank takes part
        if rank == 0:
            arrays = {k: v.detach().float().numpy() for k, v in tensors.items()}  # pickled, not shared memory
            out.put((is_compiled, [(m["loss"], m["grad_norm"]) for m in steps], arrays))
    finally:
        dist.destroy_process_group()


def run_two_ranks(model_dir: str, compiled: bool):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    ranks = [ctx.Process(target=two_steps, args=(r, port, compiled, model_dir, out)) for r in range(2)]
    for p in ranks:
        p.start()
    while True:  # read before joining: rank 0 cannot exit until its result is read
        try:
            is_compiled, steps, arrays = out.get(timeout=5)
            break
        except queue.Empty:
            assert all(p.exitcode in (None, 0) for p in ranks), [p.exitcode for p in ranks]
    for p in ranks:
        p.join(60)
    assert [p.exitcode for p in ranks] == [0, 0]
    return is_compiled, steps, {k: torch.from_numpy(v) for k, v in arrays.items()}


def test_two_fsdp2_ranks_with_compiled_layers_train_the_eager_ranks_steps(tiny_model_dir):
    eager_compiled, eager, eager_lora = run_two_ranks(tiny_model_dir, False)
    is_compiled, compiled, compiled_lora = run_two_ranks(tiny_model_dir, True)
    assert is_compiled and not eager_compiled
    for (loss, norm), (eager_loss, eager_norm) in zip(compiled, eager):
        assert loss == pytest.approx(eager_loss, rel=1e-4, abs=1e-6)
        assert norm == pytest.approx(eager_norm, rel=1e-3)
    for name, value in eager_lora.items():  # Adam's steps are near lr x sign(g): a near-zero gradient may flip
        assert ((compiled_lora[name] - value).abs() > 1e-6).float().mean() < 0.01, name
