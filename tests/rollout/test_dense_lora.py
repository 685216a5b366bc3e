"""rollout.dense_lora: the engine's adapter as two dense matrix products a projection group (vllm_dense_lora), against
vLLM's own LoRA kernels on the real vLLM CPU engine."""

from __future__ import annotations

import pytest
import torch

from app.config import load_config
from app.config.knobs import ConfigError
from app.rollout.engines.base import Sampling
from tests.conftest import tiny_config
from tests.rollout.test_engines import assert_same_generations, opening_prompts, random_adapter

pytestmark = pytest.mark.vllm
GREEDY = Sampling(max_new_tokens=12, temperature=0.0)


@pytest.fixture(scope="session")  # shut down with the session's vllm_engine: vLLM's teardown of an in-process engine
def dense_engine(vllm_engine, tiny_model_dir, tiny_lora):  # resets the process's parallel state that both use
    from app.rollout.engines.vllm import VLLMEngine

    engine = VLLMEngine(tiny_model_dir, tiny_lora, max_model_len=4096, max_images=16, dense_lora=True)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def prompts(codec):
    return opening_prompts(codec)


def zeros(engine):
    return {k: torch.zeros(s) for k, s in engine.spec.shapes.items()}


def test_every_projection_group_of_the_language_model_is_dense(dense_engine, vllm_engine):
    layers = dense_engine.llm.collective_rpc("mazerl_dense_lora_layers")[0]
    groups = {name.rsplit(".", 1)[1] for name in layers}
    assert groups == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    assert len(layers) == 4 * 2  # the tiny model's two decoder layers
    assert all("visual" not in name for name in layers)
    assert dense_engine.stats()["dense_lora_layers"] == len(layers)
    assert vllm_engine.stats()["dense_lora_layers"] == 0  # an engine that did not ask keeps vLLM's kernels
    # every layer of the language model is dense, so its wrapper prepares no metadata for vLLM's kernels
    assert dense_engine.llm.collective_rpc(metadata_update)[0] == "token_slots_only"
    assert vllm_engine.llm.collective_rpc(metadata_update)[0] == "update_metadata"


def metadata_update(worker) -> str:
    """Run in vLLM's worker: the name of the function that updates the language model's punica metadata."""
    from vllm.lora.model_manager import DEFAULT_LANGUAGE_WRAPPER_KEY

    wrapper = worker.model_runner.lora_manager._adapter_manager.punica_wrapper_mapping[DEFAULT_LANGUAGE_WRAPPER_KEY]
    return wrapper.update_metadata.__func__.__name__


def test_greedy_generations_match_vllms_lora_kernels(dense_engine, vllm_engine, prompts):
    tensors = random_adapter(vllm_engine.spec, seed=7)
    dense_engine.load_lora(tensors, 1)
    vllm_engine.load_lora(tensors, 1)
    dense = dense_engine.generate(prompts, GREEDY)
    assert_same_generations(vllm_engine.generate(prompts, GREEDY), dense)
    dense_engine.load_lora(zeros(dense_engine), 2)  # the adapter matters: the comparison is not base against base
    assert [g.token_ids for g in dense_engine.generate(prompts, GREEDY)] != [g.token_ids for g in dense]


def test_the_slots_hold_the_adapter_as_vllms_do(dense_engine, vllm_engine):
    """vLLM's own loading fills the stacked and block-diagonal matrices through the slot views: what the engine
    holds reads back bit for bit as the undensified engine's (the rollout actor's LoRA check reads it so)."""
    tensors = random_adapter(vllm_engine.spec, seed=8)
    dense_engine.load_lora(tensors, 3)
    vllm_engine.load_lora(tensors, 3)
    dense, plain = dense_engine.lora_state(), vllm_engine.lora_state()
    assert dense.keys() == plain.keys() and dense
    for name in plain:
        assert torch.equal(dense[name], plain[name]), name


def test_requests_without_the_adapter_get_none_of_it_in_a_mixed_batch(dense_engine, vllm_engine, prompts, monkeypatch):
    """The slot holds an adapter, half the batch's requests play it: the others' tokens map to no slot and must
    come out as the base model's."""
    tensors = random_adapter(vllm_engine.spec, seed=9)
    dense_engine.load_lora(tensors, 4)
    vllm_engine.load_lora(tensors, 4)
    with_adapter = vllm_engine.generate(prompts, GREEDY)
    vllm_engine.load_lora(zeros(vllm_engine), 5)
    base = vllm_engine.generate(prompts, GREEDY)
    plays = [i % 2 == 0 for i in range(len(prompts))]
    generate = dense_engine.llm.generate

    def mixed(inputs, params, lora_request, use_tqdm):
        return generate(inputs, params, lora_request=[lora_request if p else None for p in plays], use_tqdm=use_tqdm)

    monkeypatch.setattr(dense_engine.llm, "generate", mixed)
    got = dense_engine.generate(prompts, GREEDY)
    assert_same_generations([w if p else b for w, b, p in zip(with_adapter, base, plays)], got)


def test_an_engine_core_in_its_own_process_makes_its_layers_dense_and_plays_as_in_process(
    dense_engine, tiny_model_dir, tiny_lora, prompts
):
    """In its own process the engine core's worker installs the dense layers itself, when vLLM imports vllm_worker."""
    from app.model import adapters
    from app.rollout.engines.vllm import VLLMEngine

    engine = VLLMEngine(
        tiny_model_dir, tiny_lora, max_model_len=4096, max_images=16, engine_process=True, dense_lora=True
    )
    try:
        assert not engine.in_process and engine.stats()["dense_lora_layers"] == 4 * 2
        tensors = random_adapter(engine.spec, seed=10)
        engine.load_lora(adapters.pack(tensors), 6)
        dense_engine.load_lora(tensors, 6)
        assert_same_generations(dense_engine.generate(prompts, GREEDY), engine.generate(prompts, GREEDY))
    finally:
        engine.shutdown()


def test_the_knob_reaches_the_engine_and_only_vllm_offers_it():
    assert load_config(None, ["rollout.engine=vllm", "rollout.dense_lora=true"]).rollout.dense_lora
    with pytest.raises(ConfigError) as e:
        tiny_config("rollout.engine=hf", "rollout.dense_lora=true")
    assert e.value.field_path == "rollout.dense_lora" and "rollout.engine=vllm" in e.value.fix
