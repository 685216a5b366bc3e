"""The reference run's trainer knobs do what they say: gradient checkpointing recomputes activations in the backward
pass, and the policy the trainer scores is the one the engines sample (no dropout, whatever the adapter says)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from tests.conftest import tiny_config


@pytest.fixture(scope="module")
def batch(hf_engine, codec):
    """Two groups of four sampled episodes, rewarded 1 and 0 alternately: every group carries signal."""
    from app.rollout.engines.base import Sampling
    from app.rollout.episodes import EpisodeRequest, play_episodes
    from app.world.maze import generate_maze
    from app.world.rules import EpisodeSettings

    requests = [EpisodeRequest(generate_maze(group, 7), group, s) for group in range(2) for s in range(4)]
    settings = EpisodeSettings(max_turns=3, maze_size=7, cell_px=32)
    trajectories = play_episodes(hf_engine, codec, requests, settings, Sampling(8, 1.0, seed=3))
    return [dataclasses.replace(t, reward=float(t.sample % 2)) for t in trajectories]


def items_of(batch):
    from app.learning import grpo
    from app.learning.batch import build_items

    return build_items(batch, grpo.AdvantageResult([1.0] * len(batch), [True] * len(batch), 2, 0))


def count_checkpointed_calls(model) -> list[int]:
    """Wraps every layer's checkpoint function (set by gradient_checkpointing_enable) with a counter."""
    calls = [0]
    for module in model.modules():
        if getattr(module, "gradient_checkpointing", False):
            real = module._gradient_checkpointing_func

            def counted(*args, _real=real, **kwargs):
                calls[0] += 1
                return _real(*args, **kwargs)

            module._gradient_checkpointing_func = counted
    return calls


def test_gradient_checkpointing_recomputes_the_decoder_layers_in_the_backward(tiny_model_dir, batch):
    from app.learning.training import PolicyTrainer

    trainer = PolicyTrainer(tiny_config("model.gradient_checkpointing=true", "train.micro_batch=8"), tiny_model_dir)
    calls = count_checkpointed_calls(trainer.model)
    metrics = trainer.train_step(batch)
    layers = trainer.model.config.text_config.num_hidden_layers
    assert calls[0] >= layers, f"{calls[0]} checkpointed calls in a step of a {layers}-layer model"
    assert metrics["grad_norm"] > 0


@pytest.mark.parametrize(("share", "recomputed"), [(1.0, [True, True]), (0.5, [True, False]), (0.0, [False, False])])
def test_a_share_of_the_layers_checkpointed_recomputes_only_those(tiny_model_dir, batch, share, recomputed):
    """model.checkpointed_layers on the 2-layer tiny model: the checkpointed decoder layers run their forward again
    in the backward pass, the others keep their activations (one forward, not two)."""
    from app.learning.training import PolicyTrainer

    overrides = ("model.gradient_checkpointing=true", f"model.checkpointed_layers={share}", "train.micro_batch=8")
    trainer = PolicyTrainer(tiny_config(*overrides), tiny_model_dir)
    layers = trainer.model.base_model.model.model.language_model.layers
    assert [layer.gradient_checkpointing for layer in layers] == recomputed
    forwards = [0] * len(layers)
    for i, layer in enumerate(layers):  # a pre-hook: torch stops a recomputation once it has what the backward needs
        layer.register_forward_pre_hook(lambda *_, i=i: forwards.__setitem__(i, forwards[i] + 1))
    logp, _, mask, _ = trainer.token_logprobs(items_of(batch), with_grad=True)
    counted_in_forward = list(forwards)
    (-(logp * mask).sum()).backward()
    assert counted_in_forward[0] == counted_in_forward[1] > 0
    assert forwards == [(1 + again) * once for again, once in zip(recomputed, counted_in_forward)], forwards


@pytest.mark.parametrize("share", [1.0, 0.5])
def test_checkpointing_changes_no_log_probability_or_gradient(tiny_model_dir, batch, share):
    from app.learning.training import PolicyTrainer

    items = items_of(batch)
    results = []
    for on in (False, True):
        overrides = [f"model.gradient_checkpointing={str(on).lower()}"] + [f"model.checkpointed_layers={share}"] * on
        trainer = PolicyTrainer(tiny_config(*overrides), tiny_model_dir)
        logp, _, mask, _ = trainer.token_logprobs(items, with_grad=True)
        (-(logp * mask).sum()).backward()
        grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
        results.append((logp.detach(), grads))
    (plain, plain_grads), (checkpointed, checkpointed_grads) = results
    assert torch.equal(plain, checkpointed)
    assert plain_grads.keys() == checkpointed_grads.keys()
    assert all(torch.allclose(plain_grads[n], checkpointed_grads[n], atol=1e-6) for n in plain_grads)


def test_an_adapter_saved_with_dropout_trains_without_it(tiny_model_dir, batch, tmp_path):
    """A warm-start adapter whose config says lora_dropout 0.5: the trainer scores the same tokens the same way
    twice (with dropout on, two forwards would differ), and as the engine does."""
    from app.learning.training import PolicyTrainer
    from app.model.load import apply_lora, load_model, lora_state_dict

    source = apply_lora(load_model(tiny_model_dir), tiny_config().lora)
    for name, p in source.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)  # a trained-looking adapter: lora_B is zero when made
    folder = Path(tmp_path) / "warm"
    source.save_pretrained(folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, "lora_dropout": 0.5}))
    trainer = PolicyTrainer(tiny_config(f"model.adapter_init={folder}"), tiny_model_dir)
    items = items_of(batch)
    first, _, mask, _ = trainer.token_logprobs(items, with_grad=False)
    second, _, _, _ = trainer.token_logprobs(items, with_grad=False)
    assert torch.equal(first, second)
    held = lora_state_dict(trainer.model)
    assert all(torch.equal(held[k], v) for k, v in lora_state_dict(source).items())
