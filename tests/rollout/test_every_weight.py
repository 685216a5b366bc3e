"""Every weight trained (lora.modules_to_save [visual, language_model]): the trainer trains the language model and
its head beside the LoRA and the tower, the engines take all of it from memory, hold it bit for bit (vLLM's fused
q/k/v and gate/up projections and its padded vocabulary included) and play what the trainer's model plays; a
checkpoint, a warm start and the exported folder carry it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from actors.rollout import held_checksum, lora_checksum
from app.config import ConfigError, LoraSettings, load_config
from app.model import adapters
from app.rollout.engines.base import Sampling
from app.rollout.episodes import EpisodeRequest, play_episodes
from app.world.maze import generate_maze
from app.world.rules import EpisodeSettings
from tests.rollout.test_engines import assert_same_generations, opening_prompts
from tests.rollout.test_vision_tower import vllm_engine_for

EVERY = LoraSettings(rank=8, alpha=16, modules_to_save=["visual", "language_model"])
SETTINGS = EpisodeSettings(10, 7, 32, 0, 2048)
GREEDY = Sampling(max_new_tokens=12, temperature=0.0)
OVERRIDES = [
    "lora.rank=8",
    "lora.alpha=16",
    "lora.modules_to_save=[visual,language_model]",
    "lora.tower_lr_scale=0.5",
    "maze.size=7",
    "maze.cell_px=32",
    "rollout.max_turns=10",
    "train.lr=1e-3",
    "train.micro_batch=8",
]


def language_of(tensors: dict) -> dict:
    return {k: v for k, v in tensors.items() if adapters.is_language_weight(k)}


def played(engine, seeds, sample_seed):
    requests = [EpisodeRequest(generate_maze(s, 7), s, j) for s in seeds for j in range(4)]
    trajectories = play_episodes(engine, engine.codec, requests, SETTINGS, Sampling(12, 1.0, seed=sample_seed))
    for i, t in enumerate(trajectories):  # rewards that differ within a group, so the step has advantages
        t.reward = float(i % 2)
    return trajectories


@pytest.fixture(scope="module")
def trainer(tiny_model_dir):
    from app.learning.training import PolicyTrainer

    return PolicyTrainer(load_config(None, OVERRIDES, check_paths=False), tiny_model_dir)


@pytest.fixture(scope="module")
def hf_every_engine(tiny_model_dir):
    from app.rollout.engines.hf import HFEngine

    return HFEngine(tiny_model_dir, EVERY)


@pytest.fixture(scope="module", params=["in_process", "own_process"])
def vllm_every_engine(request, tiny_model_dir):
    yield from vllm_engine_for(request, tiny_model_dir, EVERY)


def test_the_spec_names_every_weight_of_the_model(trainer):
    names = {adapters.normalize_keys({n: None}).popitem()[0] for n, _ in trainer.model.named_parameters()}
    assert set(trainer.spec.shapes) == names  # nothing of the model is left out, nothing invented
    assert adapters.HEAD in trainer.spec.shapes
    assert any(".q_proj.base_layer.weight" in k for k in trainer.spec.shapes)
    assert all(p.requires_grad and p.dtype == torch.float32 for p in trainer.model.parameters())


def test_a_kl_to_the_adapterless_model_is_refused_when_the_language_model_trains():
    with pytest.raises(ConfigError, match=r"train\.kl_coef.*language_model"):
        load_config(None, [*OVERRIDES, "train.kl_coef=0.01"], check_paths=False)
    with pytest.raises(ConfigError, match=r"lora\.modules_to_save.*every weight"):
        load_config(None, ["lora.modules_to_save=[lm_head]"], check_paths=False)


def test_the_trainer_trains_the_language_model_at_the_whole_modules_rate(trainer, hf_every_engine):
    before = trainer.trained_tensors()
    assert set(before) == set(trainer.spec.shapes)
    hf_every_engine.load_lora(before, 0)
    trainer.train_step(played(hf_every_engine, range(2), 3))
    after = trainer.trained_tensors()
    moved = {k: float((v - before[k]).abs().max()) for k, v in after.items()}
    language = language_of(after)
    assert sum(moved[k] > 0 for k in language) > len(language) // 2, "the language model's weights did not train"
    assert max(moved[k] for k in language) < 0.5e-3 * 1.1  # Adam's first step: about the rate, 0.5 x train.lr
    assert max(v for k, v in moved.items() if adapters.is_lora(k)) > 0.9e-3


def test_an_engine_holds_every_weight_bit_for_bit_and_plays_as_the_trainers_model(
    trainer, hf_every_engine, vllm_every_engine
):
    tensors = trainer.trained_tensors()
    vllm_every_engine.load_lora(adapters.pack(tensors), 5)
    held = vllm_every_engine.lora_state()
    assert set(held) == set(adapters.held_form(tensors, 8, 16, torch.float32))
    assert lora_checksum(held) == held_checksum(tensors, EVERY)
    hf_every_engine.load_lora(tensors, 5)
    assert lora_checksum(hf_every_engine.lora_state()) == held_checksum(tensors, EVERY)
    prompts = opening_prompts(vllm_every_engine.codec, n=4)
    assert_same_generations(hf_every_engine.generate(prompts, GREEDY), vllm_every_engine.generate(prompts, GREEDY))
    metrics = trainer.train_step(played(vllm_every_engine, range(10, 12), 4))  # logprobs compared before the update
    assert metrics["trained_tokens"] > 0 and metrics["logprob_mismatch_mean"] < 1e-4
    # a second load replaces what the first placed, the fused projections included
    changed = trainer.trained_tensors()
    vllm_every_engine.load_lora(changed, 6)
    assert lora_checksum(vllm_every_engine.lora_state()) == held_checksum(changed, EVERY)


def test_a_checkpoint_and_a_warm_start_carry_every_weight(trainer, tiny_model_dir, tmp_path):
    from app.config.adapter_init import check_adapter_init
    from app.learning.training import PolicyTrainer

    tensors = trainer.trained_tensors()
    optimizer, state = trainer.optimizer_state()
    fresh = PolicyTrainer(trainer.cfg, tiny_model_dir)
    fresh.load_state(tensors, optimizer, state)
    assert all(torch.equal(v, tensors[k]) for k, v in fresh.trained_tensors().items())
    folder = adapters.write_peft_folder(tensors, trainer.spec, tmp_path / "every")
    saved, config = adapters.read_peft_folder(folder)
    assert config["modules_to_save"] == ["visual", "language_model"] and set(saved) == set(tensors)
    with pytest.raises(ConfigError, match=r"lora\.modules_to_save"):
        check_adapter_init(folder, LoraSettings(rank=8, alpha=16, modules_to_save=["visual"]))
    assert check_adapter_init(folder, EVERY).modules_to_save == ("visual", "language_model")
    cfg = dataclasses.replace(trainer.cfg, model=dataclasses.replace(trainer.cfg.model, adapter_init=str(folder)))
    started = PolicyTrainer(cfg, tiny_model_dir).trained_tensors()
    assert all(torch.equal(started[k], v) for k, v in tensors.items())


def test_the_export_merges_into_a_model_folder_that_plays_as_the_policy(trainer, hf_every_engine, tmp_path):
    """The serving app refuses a whole model in adapter form, naming the way to serve it: merged into a model folder
    (scripts/merge_adapter.py), which plays as the engine holding the adapter does."""
    import subprocess
    import sys

    from app.rollout.engines.hf import HFEngine
    from app.serve.adapters import AdapterUnusable, parse_adapter

    tensors = trainer.trained_tensors()
    folder = adapters.write_peft_folder(tensors, trainer.spec, tmp_path / "export", base_model=trainer.model_dir)
    files = [(folder / name).read_bytes() for name in (adapters.ADAPTER_CONFIG, adapters.ADAPTER_WEIGHTS)]
    text_config = trainer.model.base_model.model.config.text_config
    with pytest.raises(AdapterUnusable, match="merge_adapter"):
        parse_adapter(*files, text_config, adapters.AdapterSpec.for_model(text_config, LoraSettings(rank=8, alpha=16)))
    done = subprocess.run(
        [sys.executable, "scripts/merge_adapter.py", str(folder), str(tmp_path / "merged"), "--dtype", "float32"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    merged = HFEngine(str(tmp_path / "merged"), LoraSettings(rank=8, alpha=16))  # its own LoRA starts at zero
    hf_every_engine.load_lora(tensors, 30)
    prompts = opening_prompts(merged.codec, n=4)
    assert_same_generations(hf_every_engine.generate(prompts, GREEDY), merged.generate(prompts, GREEDY))
    refused = subprocess.run(
        [sys.executable, "scripts/merge_adapter.py", str(folder), str(tmp_path / "x"), "--base", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert refused.returncode == 2 and "base model" in refused.stderr
    served_alone_as_the_model_and_left_out_of_a_listing(trainer, folder, tmp_path / "merged", merged)


def served_alone_as_the_model_and_left_out_of_a_listing(trainer, export, merged_dir, merged_engine):
    """The merged folder served with no adapters root answers `base` as the engine holding it does; an adapters root
    holding the export beside a LoRA-only adapter lists the LoRA-only one alone."""
    import asyncio
    import shutil

    from app.rollout.engines.base import Prompt
    from app.serve.adapters import AdapterRegistry
    from app.serve.api import ServeSettings, encode_conversation, parse_chat_request
    from app.serve.client import ServedEpisode
    from app.serve.service import MazeService
    from app.storage import open_store

    service = MazeService(ServeSettings(model_path=str(merged_dir), max_model_len=2048, max_tokens_cap=64))
    assert [m["id"] for m in asyncio.run(service.models(None))["data"]] == ["base"]
    assert service.stats_dict()["registry"]["root"] is None
    for seed in range(3):  # a maze's opening turn as the API takes it: the served answer is the merged engine's
        messages = ServedEpisode(generate_maze(seed, SETTINGS.maze_size), SETTINGS).messages()
        body = {"model": "base", "messages": messages, "temperature": 0, "max_tokens": 12, "return_token_ids": True}
        served = asyncio.run(service.complete(body))["choices"][0]["token_ids"]
        ids, images = encode_conversation(service._prep_codec, parse_chat_request(body, service.settings).messages)
        assert served == merged_engine.generate([Prompt(ids, images)], GREEDY)[0].token_ids
    root = merged_dir.parent / "root"
    shutil.copytree(export, root / "whole")
    lora_only = {k: v for k, v in trainer.trained_tensors().items() if adapters.is_lora(k)}
    spec = adapters.AdapterSpec.for_model(trainer.model.base_model.model.config.text_config, LoraSettings(8, 16))
    adapters.write_peft_folder(lora_only, spec, root / "plain")
    text_config = trainer.model.base_model.model.config.text_config
    registry = AdapterRegistry(open_store(str(root)), text_config, spec)
    assert registry.available() == ["plain"]
    assert registry.available() == ["plain"] and registry.stats()["storage_reads"] == 2  # read once
