"""One serving replica's logic, independent of Ray Serve: auth, the adapter cache and the engine thread.

`MazeService` owns one generation engine (app.rollout.engines: transformers or vLLM) on one thread of its own,
built there and used only there, so requests take turns on it; the engine holds one adapter at a time and
swaps it (an in-memory load of tensors from the replica's LRU cache, app.serve.adapters) when a request
names another model. The base model is the engine with an all-zero adapter, which changes nothing.
An adapter that carries a trained vision tower swaps the engine's tower too; the next adapter without one
gets the base model's tower back (read once from the model folder), so every adapter sees pictures through
the tower it was trained with. Tower swaps cost a copy of the tower (~0.6 B parameters at the 8B shape), so
the engine keeps the tower it holds while requests for LoRA-only adapters follow each other.
Request preparation (JSON, images, tokenizing) runs on worker threads with its own tokenizer, so a slow
upload or a bad image never holds the engine.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import torch
from transformers import AutoConfig

from app.config import LoraSettings
from app.model import adapters
from app.model.load import base_vision_tower, load_processor
from app.rollout.encoding import ChatCodec
from app.rollout.engines.base import Prompt, Sampling
from app.rollout.engines.hf import HFEngine
from app.rollout.engines.vllm import VLLMEngine
from app.serve.adapters import AdapterRegistry, check_name, complete_adapters, zero_adapter
from app.serve.api import (
    ApiError,
    ServeSettings,
    as_api_error,
    bad_request,
    encode_conversation,
    parse_chat_request,
    read_json,
    token_digest,
)
from app.storage import open_store
from app.storage.s3 import S3Store

log = logging.getLogger("mazerl.serve")


def open_adapter_store(settings: ServeSettings):
    if settings.adapters_root is None:
        return None
    if settings.adapters_root.startswith("s3://"):
        return S3Store(
            settings.adapters_root,
            endpoint_url=settings.s3_endpoint_url,
            max_attempts=settings.s3_max_attempts,
            connect_timeout=settings.s3_connect_timeout,
        )
    return open_store(settings.adapters_root)


def engine_lora_settings(settings: ServeSettings, store):
    """The engine's LoRA shape: the flags, else the newest adapter's at start, else LoraSettings' defaults."""

    found: dict = {}
    if store is not None and (
        settings.lora_rank is None or settings.lora_alpha is None or settings.lora_targets is None
    ):
        try:
            names = complete_adapters(store.list(""))
            if names:
                config = json.loads(store.get_bytes(f"{names[-1]}/adapter_config.json"))
                found = {
                    "rank": int(config["r"]),
                    "alpha": int(config["lora_alpha"]),
                    "target_modules": list(config["target_modules"]),
                }
        except Exception as e:  # noqa: BLE001 - storage down at start must not stop the server; log and go on
            log.warning("could not read an adapter's LoRA shape at start (%s); using defaults", e)
    defaults = LoraSettings()
    rank = settings.lora_rank or found.get("rank") or defaults.rank
    alpha = settings.lora_alpha or found.get("alpha") or (defaults.alpha * rank // defaults.rank)
    targets = list(settings.lora_targets or found.get("target_modules") or defaults.target_modules)
    return LoraSettings(rank=rank, alpha=alpha, target_modules=targets)


def make_engine(settings: ServeSettings, lora):

    if settings.engine == "vllm":
        return VLLMEngine(
            settings.model_path,
            lora,
            dtype=settings.dtype,
            max_model_len=settings.max_model_len,
            max_images=settings.max_images,
            gpu_memory_utilization=settings.gpu_memory_utilization,
            sleep_level=0,
            enforce_eager=True,
        )

    return HFEngine(
        settings.model_path, lora, dtype=settings.dtype, device="cuda" if torch.cuda.is_available() else "cpu"
    )


class MazeService:
    """Answers the API's routes for one replica; every failure becomes an HTTP answer, never a dead replica."""

    def __init__(self, settings: ServeSettings):

        self.settings = settings
        self.created = int(time.time())
        store = open_adapter_store(settings)
        self.lora = engine_lora_settings(settings, store)
        self._engine_thread = ThreadPoolExecutor(1, thread_name_prefix="mazerl-engine")
        self.engine = self._engine_thread.submit(make_engine, settings, self.lora).result()
        model_config = AutoConfig.from_pretrained(settings.model_path)
        self.registry = AdapterRegistry(
            store,
            model_config.text_config,
            self.engine.spec,
            settings.max_cached_adapters,
            vision_config=model_config.vision_config,
        )
        self._base_tensors = zero_adapter(self.engine.spec)
        self.loaded = settings.base_name  # a fresh engine has no adapter: it is the base model
        self.tower = settings.base_name  # whose vision tower the engine holds (None: unknown after a failed load)
        self._base_tower: dict[str, torch.Tensor] | None = None  # read when a tower first has to be given back
        self._lora_version = 0
        self._swaps = 0
        self._tower_swaps = 0
        self._prep_codec = ChatCodec(load_processor(settings.model_path))  # no tokenizer crosses threads
        self._prep_lock = threading.Lock()
        self._counts: dict[str, int] = {}
        log.info(
            "serving %s (engine %s, LoRA r%d alpha %d) with adapters from %s",
            settings.model_path,
            settings.engine,
            self.lora.rank,
            self.lora.alpha,
            store.describe() if store is not None else "nowhere (the model alone)",
        )

    # ------------------------------------------------------------ plumbing
    def authorize(self, headers) -> None:
        expected = self.settings.token_sha256
        if expected is None:
            return
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token_digest(token.strip()), expected):
            raise ApiError(
                401,
                "missing or invalid bearer token",
                kind="authentication_error",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    async def answer(self, request, handler, authorize: bool = True):
        """handler(request)'s answer, or the error it raised as an OpenAI error response."""
        try:
            if authorize:
                self.authorize(request.headers)
            response, status = await handler(request), 200
        except Exception as e:  # noqa: BLE001 - every failure is an HTTP answer; the replica lives on
            error = as_api_error(e)
            if error.status == 500:
                log.exception("request failed")
            response, status = error.response(), error.status
        self._counts[str(status)] = self._counts.get(str(status), 0) + 1
        return response

    def resolve_model(self, model: object) -> str:
        """The adapter name a request's model means (base_name for the base model); InvalidAdapterName else."""
        if not isinstance(model, str) or not model:
            raise bad_request("model is required (a string)")
        base = self.settings.base_name
        if model.startswith(base + ":"):  # ray.serve.llm's spelling of an adapter
            model = model[len(base) + 1 :]
        return model if model == base else check_name(model)

    # ------------------------------------------------------------ routes
    async def models(self, request) -> dict:
        names = await asyncio.to_thread(self.registry.available)
        base = self.settings.base_name
        entry = {"object": "model", "created": self.created, "owned_by": "mazerl", "root": base}
        return {
            "object": "list",
            "data": [{"id": base, **entry}] + [{"id": n, **entry, "parent": base} for n in names if n != base],
        }

    async def stats(self, request) -> dict:
        return self.stats_dict()

    def stats_dict(self) -> dict:
        return {
            "registry": self.registry.stats(),
            "engine": self.engine.stats(),
            "loaded_model": self.loaded,
            "adapter_swaps": self._swaps,
            "vision_tower": self.tower,
            "vision_tower_swaps": self._tower_swaps,
            "responses": dict(self._counts),
            "lora": {
                "rank": self.lora.rank,
                "alpha": self.lora.alpha,
                "target_modules": list(self.lora.target_modules),
            },
        }

    async def chat(self, request) -> dict:
        return await self.complete(await read_json(request, self.settings.max_body_bytes))

    async def complete(self, body: object) -> dict:
        """The chat completion for a parsed request body (ApiError for a bad one)."""
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object")
        name = self.resolve_model(body.get("model"))
        chat, prompt, sampling = await asyncio.to_thread(self._prepare, body)
        tensors = None if name == self.settings.base_name else await asyncio.to_thread(self.registry.get, name)
        loop = asyncio.get_running_loop()
        text, generation = await loop.run_in_executor(
            self._engine_thread, self._generate, name, tensors, prompt, sampling
        )
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": generation.finish_reason,
            "logprobs": None,
        }
        if chat.return_token_ids:  # vLLM's extension; send them back on the assistant message: exact context
            choice["token_ids"] = list(generation.token_ids)
        prompt_tokens, completion_tokens = len(prompt.token_ids), len(generation.token_ids)
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": chat.model,
            "choices": [choice],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        }

    def _prepare(self, body: object):
        """(ChatRequest, Prompt, Sampling): parsed, images decoded, tokenized, checked against the context."""

        chat = parse_chat_request(body, self.settings)
        try:
            with self._prep_lock:
                ids, images = encode_conversation(self._prep_codec, chat.messages)
        except ValueError as e:  # e.g. an image of an aspect ratio the image processor refuses
            raise bad_request(f"cannot encode the conversation: {e}", code="invalid_image") from None
        limit = self.settings.max_model_len
        max_tokens = chat.max_tokens or min(self.settings.default_max_tokens, limit - len(ids))
        if max_tokens < 1 or len(ids) + max_tokens > limit:
            raise bad_request(
                f"the prompt has {len(ids)} tokens and max_tokens is {max_tokens}: over the context length of {limit}",
                code="context_length_exceeded",
            )
        sampling = Sampling(max_new_tokens=max_tokens, temperature=chat.temperature, top_p=chat.top_p, seed=chat.seed)
        return chat, Prompt(ids, images), sampling

    def _generate(self, name: str, tensors, prompt, sampling):
        """On the engine thread: swap the adapter (and the vision tower, when the adapter carries one or the
        engine holds another adapter's) when another one is loaded, then generate one reply."""
        if name != self.loaded:
            self.loaded = None  # a failed load leaves no claim about what the engine holds
            tensors = self._base_tensors if tensors is None else tensors
            lora = {k: v for k, v in tensors.items() if adapters.is_lora(k)}
            tower = {k: v for k, v in tensors.items() if not adapters.is_lora(k)}
            self._swap_tower(name if tower else self.settings.base_name, tower)
            self._lora_version += 1
            self.engine.load_lora(lora, self._lora_version)
            self.loaded = name
            self._swaps += 1
        generation = self.engine.generate([prompt], sampling)[0]
        return self.engine.codec.decode(generation.token_ids), generation

    def _swap_tower(self, owner: str, tower: dict[str, torch.Tensor]) -> None:
        """Makes the engine hold `owner`'s vision tower (`tower`; the base model's when it is empty)."""
        if owner == self.tower:
            return
        self.tower = None
        if not tower:
            if self._base_tower is None:
                self._base_tower = base_vision_tower(self.settings.model_path)
            tower = self._base_tower
        self.engine.load_vision_tower(tower)
        self.tower = owner
        self._tower_swaps += 1

    def shutdown(self) -> None:
        self._engine_thread.submit(self.engine.shutdown).result()
        self._engine_thread.shutdown()
