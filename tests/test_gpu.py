"""On a CUDA GPU with vLLM (skipped elsewhere): the rollout engine against the trainer, in bf16.

Run on the device machine: `python -m pytest -q tests/test_gpu.py` (after scripts/bench/install_gpu.sh).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from app.config import load_config

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]
SIZE, CELL, TURNS = 7, 32, 10


@pytest.fixture(scope="module")
def gpu_setup(tmp_path_factory):
    if not torch.cuda.is_available() or importlib.util.find_spec("vllm") is None:
        pytest.skip("needs a CUDA GPU and vLLM")
    from app.learning.sft import demonstrations
    from app.learning.training import PolicyTrainer
    from app.model.build import ensure_model
    from app.world.maze import generate_maze
    from app.world.rules import EpisodeSettings

    cfg = load_config(
        None,
        [
            "model.dtype=bfloat16",
            "lora.rank=16",
            "lora.alpha=32",
            f"maze.size={SIZE}",
            f"maze.cell_px={CELL}",
            f"rollout.max_turns={TURNS}",
            "rollout.engine=vllm",
            "placement.gpus_per_bundle=1",
        ],
        check_paths=False,
    )
    model_dir = str(ensure_model(cfg.model, tmp_path_factory.mktemp("models")))
    trainer = PolicyTrainer(cfg, model_dir, device="cuda")
    settings = EpisodeSettings(TURNS, SIZE, CELL, 0, 4096)
    for _ in range(30):  # supervised steps, so the synced adapter changes what the model does
        trainer.sft_step(demonstrations([generate_maze(s, SIZE) for s in range(8)], trainer.codec, settings), 3e-3)
    engine = gpu_engine(model_dir, cfg)
    engine.load_lora(trainer.trained_tensors(), 1)
    yield cfg, model_dir, trainer, engine, settings
    engine.shutdown()


def gpu_engine(model_dir: str, cfg, **options):
    """The bf16 vLLM engine these tests share settings for (eager unless asked: no graph capture to wait for)."""
    from app.rollout.engines.vllm import VLLMEngine

    options.setdefault("enforce_eager", True)
    return VLLMEngine(
        model_dir,
        cfg.lora,
        dtype="bfloat16",
        max_model_len=4096,
        max_images=TURNS,
        gpu_memory_utilization=0.3,
        sleep_level=1,
        **options,
    )


def requests(count: int, samples: int = 1):
    from app.rollout.episodes import EpisodeRequest
    from app.world.maze import generate_maze

    return [EpisodeRequest(generate_maze(1000 + i, SIZE), i, j) for i in range(count) for j in range(samples)]


def test_vllm_and_trainer_logprobs_agree_after_a_sync(gpu_setup):
    from app.rollout.engines.base import Sampling
    from app.rollout.episodes import play_episodes

    _, _, trainer, engine, settings = gpu_setup
    trajectories = play_episodes(engine, engine.codec, requests(8, 4), settings, Sampling(12, 1.0, seed=1))
    metrics = trainer.train_step(trajectories)  # measures trainer vs rollout logprobs before it updates
    print(
        f"bf16 logprob mismatch: mean {metrics['logprob_mismatch_mean']:.2e} max {metrics['logprob_mismatch_max']:.2e}"
    )
    assert metrics["logprob_mismatch_mean"] < 0.02  # bf16 kernels differ; measured 2.5e-3 on an H200
    assert metrics["logprob_mismatch_max"] < 1.0
    engine.load_lora(trainer.trained_tensors(), 2)  # the update, synced, for the next test


def test_exported_adapter_in_vllm_gives_the_trainer_models_greedy_actions(gpu_setup, tmp_path):
    from vllm.lora.request import LoRARequest

    from app.model.adapters import write_peft_folder
    from app.rollout.engines.base import Sampling
    from app.rollout.engines.hf import HFEngine
    from app.rollout.episodes import play_episodes

    cfg, model_dir, trainer, engine, settings = gpu_setup
    greedy, mazes = Sampling(12, 0.0), requests(8)
    folder = write_peft_folder(trainer.trained_tensors(), trainer.spec, tmp_path / "adapter")
    before = play_episodes(engine, engine.codec, mazes, settings, greedy)
    engine.sleep()
    engine.wake()
    after = play_episodes(engine, engine.codec, mazes, settings, greedy)
    assert [t.actions for t in before] == [t.actions for t in after], "sleep/wake changed the policy"
    in_memory = engine._lora_request
    engine._lora_request = LoRARequest("exported", 999, str(folder))
    try:
        from_folder = play_episodes(engine, engine.codec, mazes, settings, greedy)
    finally:
        engine._lora_request = in_memory
    hf = HFEngine(model_dir, cfg.lora, dtype="bfloat16", device="cuda")
    hf.load_lora(trainer.trained_tensors(), 3)
    by_trainer_model = play_episodes(hf, hf.codec, mazes, settings, greedy)
    same = sum(a.actions == b.actions for a, b in zip(from_folder, by_trainer_model))
    print(f"exported adapter in vLLM vs trainer model: {same}/{len(mazes)} episodes with identical actions")
    assert same >= len(mazes) - 1  # bf16 may flip one near-tie; measured 8/8 on an H200


def test_sync_from_gpu_through_one_pinned_buffer_is_exact(gpu_setup):
    """The trainer's GPU tensors -> pack (one device->host copy) -> the engine (one host->device copy)."""
    from actors.rollout import held_checksum, lora_checksum
    from app.model.adapters import pack, private_copies
    from app.rollout.engines.base import Sampling
    from app.rollout.episodes import play_episodes

    cfg, _, trainer, engine, settings = gpu_setup
    on_gpu = trainer.trained_tensors(on_device=True)
    assert {t.device.type for t in on_gpu.values()} == {"cuda"}
    host = trainer.trained_tensors()
    packed = pack(on_gpu)
    assert lora_checksum(packed) == lora_checksum(host)
    assert all(torch.equal(v.cpu(), host[k]) for k, v in private_copies(packed, "cuda").items())
    greedy, mazes = Sampling(12, 0.0), requests(8)
    engine.load_lora(host, 4)
    from_dict = play_episodes(engine, engine.codec, mazes, settings, greedy)
    engine.load_lora(packed, 5)
    assert lora_checksum(engine.lora_state()) == held_checksum(host, cfg.lora, "bfloat16")  # asked of the worker
    assert [t.actions for t in play_episodes(engine, engine.codec, mazes, settings, greedy)] == [
        t.actions for t in from_dict
    ]


@pytest.mark.parametrize("keep_weights", [False, True])
def test_an_engine_in_its_own_process_takes_the_adapter_by_cuda_ipc_and_sleeps(gpu_setup, keep_weights):
    """The engine core in its own process: the packed adapter crosses by CUDA IPC and the worker holds it bit for
    bit; greedy episodes play the same after a sleep and wake (keep_weights: only the KV cache is freed) and after
    the same adapter is pushed again as a new version."""
    from app.model import adapters
    from app.rollout.engines.base import Sampling
    from app.rollout.episodes import play_episodes

    cfg, model_dir, trainer, shared, settings = gpu_setup
    shared.sleep()  # the module's engine gives the GPU memory back while this one runs
    engine = gpu_engine(model_dir, cfg, engine_process=True, keep_weights=keep_weights)
    try:
        tensors = trainer.trained_tensors()
        engine.load_lora(adapters.pack(tensors), 1)
        held, sent = engine.lora_state(), adapters.held_form(tensors, cfg.lora.rank, cfg.lora.alpha, torch.bfloat16)
        assert set(held) == set(sent) and all(torch.equal(held[k], sent[k].cpu()) for k in sent)
        greedy = Sampling(12, 0.0)
        before = [t.replies for t in play_episodes(engine, engine.codec, requests(4), settings, greedy)]
        engine.sleep()
        engine.load_lora(adapters.pack(tensors), 2)
        engine.wake()
        assert [t.replies for t in play_episodes(engine, engine.codec, requests(4), settings, greedy)] == before
    finally:
        engine.shutdown()
        shared.wake()


def test_the_dense_lora_under_cuda_graphs_plays_as_vllms_kernels(gpu_setup):
    """rollout.dense_lora as the GPU configs would run it (engine core in its own process, CUDA graphs, keep_weights):
    the slots hold the adapter bit for bit; greedy episodes play as the eager engine with vLLM's LoRA kernels plays
    them, with the adapter and without it (the slot loaded, the requests naming none: the graphs read the token map
    each replay), and the same after a sleep and wake."""
    from app.model import adapters
    from app.rollout.engines.base import Sampling
    from app.rollout.episodes import play_episodes

    cfg, model_dir, trainer, shared, settings = gpu_setup
    engine = gpu_engine(model_dir, cfg, engine_process=True, keep_weights=True, enforce_eager=False, dense_lora=True)
    try:
        assert engine.stats()["dense_lora_layers"] == 4 * cfg.model.tiny.num_layers
        tensors = trainer.trained_tensors()
        engine.load_lora(adapters.pack(tensors), 1)
        shared.load_lora(tensors, 7)
        held, sent = engine.lora_state(), adapters.held_form(tensors, cfg.lora.rank, cfg.lora.alpha, torch.bfloat16)
        assert set(held) == set(sent) and all(torch.equal(held[k], sent[k].cpu()) for k in sent)
        greedy, mazes = Sampling(12, 0.0), requests(8)
        actions = {}
        for name, e in (("dense", engine), ("kernels", shared)):
            actions[name] = [t.actions for t in play_episodes(e, e.codec, mazes, settings, greedy)]
            playing, e._lora_request = e._lora_request, None
            actions[name + " base"] = [t.actions for t in play_episodes(e, e.codec, mazes, settings, greedy)]
            e._lora_request = playing
        for kind in ("", " base"):
            same = sum(a == b for a, b in zip(actions["dense" + kind], actions["kernels" + kind]))
            print(f"dense LoRA with graphs vs vLLM's kernels eager{kind}: {same}/{len(mazes)} identical episodes")
            assert same >= len(mazes) - 1  # bf16 kernels may flip one near-tie
        assert actions["dense"] != actions["dense base"]  # the adapter changes what the policy does
        engine.sleep()
        engine.wake()
        assert [t.actions for t in play_episodes(engine, engine.codec, mazes, settings, greedy)] == actions["dense"]
    finally:
        engine.shutdown()


def test_a_trained_vision_tower_reaches_an_engine_in_its_own_process_bit_for_bit(gpu_setup):
    """lora.modules_to_save [visual] in bf16 on a GPU: the tower crosses by CUDA IPC with the LoRA (after a sleep
    that sent the weights to the host), the worker holds it bit for bit, and the engine's logprobs match the
    trainer's on the episodes it played; the base model's tower, loaded back as the serving app does, is held
    exactly."""
    import dataclasses

    from actors.rollout import held_checksum, lora_checksum
    from app.learning.training import PolicyTrainer
    from app.model import adapters
    from app.model.load import base_vision_tower
    from app.rollout.engines.base import Sampling
    from app.rollout.episodes import play_episodes

    cfg, model_dir, _, shared, settings = gpu_setup
    cfg = dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, modules_to_save=["visual"]))
    shared.sleep()
    trainer = PolicyTrainer(cfg, model_dir, device="cuda")
    engine = gpu_engine(model_dir, cfg, engine_process=True)
    try:
        engine.sleep()
        tensors = trainer.trained_tensors(on_device=True)
        engine.load_lora(adapters.pack(tensors), 1)
        engine.wake()
        assert lora_checksum(engine.lora_state()) == held_checksum(tensors, cfg.lora, "bfloat16")
        trajectories = play_episodes(engine, engine.codec, requests(4, 4), settings, Sampling(12, 1.0, seed=2))
        for i, t in enumerate(trajectories):
            t.reward = float(i % 2)
        metrics = trainer.train_step(trajectories)
        print(f"tower run: logprob mismatch {metrics['logprob_mismatch_mean']:.2e}")
        assert metrics["logprob_mismatch_mean"] < 0.02  # the bound of the LoRA-only test above
        base = base_vision_tower(model_dir)
        engine.load_vision_tower(base)  # the serving app's swap back to the base model's tower
        held = engine.lora_state()
        assert all(torch.equal(held[adapters.held_name(k)].cpu(), v.to(torch.bfloat16)) for k, v in base.items())
    finally:
        engine.shutdown()
        del trainer
        torch.cuda.empty_cache()
        shared.wake()


def test_compiled_layers_train_the_eager_step_in_bf16(gpu_setup, monkeypatch):
    """model.compile_layers on the GPU: inductor's fused kernels give the eager trainer's step (bf16 rounding apart),
    and their log-probabilities stay within the engine-mismatch bound above."""
    import dataclasses
    import os

    import torch._inductor.config

    # `import vllm` sets TORCHINDUCTOR_COMPILE_THREADS=1 for this whole process; a trainer actor has no vLLM and
    # compiles on every core, as this test then does (one thread took over two minutes here)
    monkeypatch.setattr(torch._inductor.config, "compile_threads", min(os.cpu_count() or 1, 32))

    from app.learning.training import PolicyTrainer
    from app.rollout.engines.base import Sampling
    from app.rollout.episodes import play_episodes

    cfg, model_dir, _, engine, settings = gpu_setup
    engine.load_lora(PolicyTrainer(cfg, model_dir, device="cuda").trained_tensors(), 3)  # a fresh trainer's LoRA
    played = play_episodes(engine, engine.codec, requests(4, 4), settings, Sampling(12, 1.0, seed=2))
    played = [dataclasses.replace(t, reward=float(t.sample % 2)) for t in played]
    compiled_cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, compile_layers=True))
    eager = PolicyTrainer(cfg, model_dir, device="cuda").train_step(played)
    compiled = PolicyTrainer(compiled_cfg, model_dir, device="cuda").train_step(played)
    print(
        f"compiled layers: loss {compiled['loss']:.4e} (eager {eager['loss']:.4e}), mismatch "
        f"{compiled['logprob_mismatch_mean']:.2e} (eager {eager['logprob_mismatch_mean']:.2e})"
    )
    assert compiled["loss"] == pytest.approx(eager["loss"], rel=0.05, abs=1e-4)
    assert compiled["grad_norm"] == pytest.approx(eager["grad_norm"], rel=0.05)
    assert compiled["logprob_mismatch_mean"] < 0.02
