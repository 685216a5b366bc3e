"""A turn's requests rendered in several processes at once, for a vLLM engine whose core runs in its own process.

vLLM renders each request (its multimodal processor: the picture's HF processing, the prompt's placeholder updates)
in the process that adds it, one request after another, while the engine core waits for them: with 64 requests a
turn that is most of the rollout's host time. Here a pool of spawned builder processes, each holding vLLM's renderer
built from the engine's own config, renders them in parallel; the rollout process only hands each rendered request to
the engine core (`LLMEngine.add_request`, which takes rendered inputs) in order, so the core starts on the first while
the rest are still being rendered.

Each builder renders with `skip_mm_cache=True`: every request then carries its pictures' processed tensors instead of
a key into the engine core's processor cache. That cache mirrors one sender's order of requests, and several builders'
requests arriving in any order would leave it missing keys (vLLM makes the same choice for several API servers). Each
builder keeps its own processor-only cache, so a picture repeated within a builder is processed once.
"""

from __future__ import annotations

import multiprocessing
import pickle
from collections.abc import Iterator

from app.rollout.engines.vllm_requests import EngineRequests

_renderer = None
_model_config = None


def _start_builder(config_bytes: bytes) -> None:
    """A builder's start: the renderer of the engine's config, with the front end's fixes this process needs too."""
    global _renderer, _model_config
    import torch

    torch.set_num_threads(1)  # the builders share the host's cores with the engine core and each other
    from vllm.renderers import renderer_from_config

    from app.rollout.engines import vllm_front_end

    vllm_front_end.install()
    config = pickle.loads(config_bytes)
    _renderer, _model_config = renderer_from_config(config), config.model_config


def _render(request: dict):
    """One request rendered as `LLM._preprocess_cmpl` renders it, with the processor-only cache (above)."""
    from vllm.renderers.inputs.preprocess import parse_model_prompt

    parsed = [parse_model_prompt(_model_config, request)]
    return _renderer.render_cmpl(parsed, _renderer.default_cmpl_tok_params, skip_mm_cache=True)[0]


class RequestBuilders:
    """`processes` spawned builders for one engine (spawned: the rollout process has touched CUDA)."""

    def __init__(self, vllm_config, processes: int):
        if processes < 1:
            raise ValueError(f"request builders: {processes}; at least 1")
        context = multiprocessing.get_context("spawn")
        self.pool = context.Pool(processes, initializer=_start_builder, initargs=(pickle.dumps(vllm_config),))
        self.processes = processes
        self._batches = 0

    def rendered(self, requests: list[dict]) -> Iterator:
        """The requests rendered, in their order, each as soon as it and those before it are ready."""
        return self.pool.imap(_render, requests, chunksize=1)

    def generate(self, engine, requests: list[dict], params: list, lora_request) -> list:
        """vLLM's final output for each request, in order: each request enters the engine core as soon as it is
        rendered, and the engine steps once all are in (the core runs meanwhile in its own process)."""
        self._batches += 1
        ids = [f"built{self._batches}-{i}" for i in range(len(requests))]
        with EngineRequests(engine) as in_flight:
            for request_id, rendered, p in zip(ids, self.rendered(requests), params):
                in_flight.add(request_id, rendered, p, lora_request)
            finished = {out.request_id: out for out in in_flight.finished()}
        return [finished[i] for i in ids]

    def close(self) -> None:
        self.pool.terminate()
        self.pool.join()
