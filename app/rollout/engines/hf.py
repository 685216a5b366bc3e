"""The transformers engine: batched `generate` behind the engine interface.

For machines without vLLM, and the reference the vLLM engine is tested against. The adapter lives in a
PEFT wrapper whose LoRA starts at B = 0, which is exactly the base model; `load_lora` copies new tensors
into it after checking them against the model's expected shapes.
"""

from __future__ import annotations

import time

import torch
from peft import get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict

from app.config import LoraSettings
from app.model import adapters
from app.model.load import copy_into_parameters, load_model, load_processor, lora_config
from app.rollout.encoding import ChatCodec
from app.rollout.engines.base import Engine, Generation, Prompt, Sampling, logprobs_of


class HFEngine(Engine):
    def __init__(
        self, model_path: str, lora: LoraSettings, dtype: str = "float32", device: str = "cpu", max_batch: int = 64
    ):

        self.device = torch.device(device)
        self.processor = load_processor(model_path)
        self.codec = ChatCodec(self.processor)
        base = load_model(model_path, dtype, self.device).eval()
        self.spec = adapters.AdapterSpec.for_model(base.config.text_config, lora, base.config.vision_config)
        self.model = get_peft_model(base, lora_config(lora)).eval()
        self.max_batch = max_batch
        self.forbidden = self.codec.forbidden_ids()
        self.lora_version = -1
        self._stats = {
            "generate_calls": 0,
            "prompts": 0,
            "generated_tokens": 0,
            "generate_s": 0.0,
            "lora_loads": 0,
            "tower_loads": 0,
            "sleeps": 0,
        }

    def load_lora(self, tensors: adapters.PackedTensors | dict[str, torch.Tensor], version: int) -> None:

        tensors = adapters.normalize_keys(adapters.unpack(tensors))
        adapters.validate(tensors, self.spec)
        dtype = next(self.model.parameters()).dtype
        private = adapters.private_copies(tensors, "cpu", dtype)
        tower = {k: private.pop(k) for k in list(private) if not adapters.is_lora(k)}
        result = set_peft_model_state_dict(self.model, private)
        copy_into_parameters(self.model, tower)  # the vision tower's weights, when the adapter carries them
        if getattr(result, "unexpected_keys", None):
            raise adapters.AdapterMismatch(f"PEFT did not place {result.unexpected_keys[:3]}")
        self.lora_version = version
        self._stats["lora_loads"] += 1

    def load_vision_tower(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copies a whole vision tower (PEFT names, `base_model.model.model.visual.*`) into the model."""
        dtype = next(self.model.parameters()).dtype
        tower = adapters.private_copies(adapters.normalize_keys(tensors), "cpu", dtype)
        adapters.check_tower(tower)
        adapters.check_finite(tower)
        copy_into_parameters(self.model, tower)
        self._stats["tower_loads"] += 1

    @torch.no_grad()
    def generate(self, prompts: list[Prompt], sampling: Sampling) -> list[Generation]:
        start = time.perf_counter()
        if sampling.seed is not None:
            torch.manual_seed(sampling.seed)
        out: list[Generation] = []
        for i in range(0, len(prompts), self.max_batch):
            out.extend(self._generate_batch(prompts[i : i + self.max_batch], sampling))
        self._stats["generate_calls"] += 1
        self._stats["prompts"] += len(prompts)
        self._stats["generated_tokens"] += sum(len(g.token_ids) for g in out)
        self._stats["generate_s"] += time.perf_counter() - start
        return out

    def _generate_batch(self, prompts: list[Prompt], sampling: Sampling) -> list[Generation]:
        codec = self.codec
        width = max(len(p.token_ids) for p in prompts)
        ids = torch.full((len(prompts), width), codec.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, p in enumerate(prompts):  # left padding: every prompt ends where generation starts
            ids[row, width - len(p.token_ids) :] = torch.tensor(p.token_ids)
            mask[row, width - len(p.token_ids) :] = 1
        inputs = {"input_ids": ids, "attention_mask": mask, "mm_token_type_ids": codec.mm_token_type_ids(ids)}
        inputs.update(codec.vision_inputs([img for p in prompts for img in p.images]))
        inputs = {k: v.to(self.device) for k, v in inputs.items()}
        sample_kwargs = (
            {"do_sample": False}
            if sampling.greedy
            else {"do_sample": True, "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": 0}
        )
        result = self.model.generate(
            **inputs,
            max_new_tokens=sampling.max_new_tokens,
            suppress_tokens=self.forbidden,
            eos_token_id=codec.im_end_id,
            pad_token_id=codec.pad_id,
            output_logits=True,
            return_dict_in_generate=True,
            **sample_kwargs,
        )
        new = result.sequences[:, width:].cpu()
        logits = torch.stack(result.logits, dim=1).cpu()  # [B, steps, V], before any processing
        logps = logprobs_of(logits, new, sampling.logprob_temperature, self.forbidden)
        gens = []
        for row in range(len(prompts)):
            tokens = new[row].tolist()
            finish = "length"
            if codec.im_end_id in tokens:
                tokens = tokens[: tokens.index(codec.im_end_id) + 1]
                finish = "stop"
            gens.append(Generation(tokens, logps[row, : len(tokens)].tolist(), finish))
        return gens

    def lora_state(self) -> dict[str, torch.Tensor] | None:

        if self.lora_version < 0:
            return None
        held = {k: v for k, v in get_peft_model_state_dict(self.model).items()}
        params = dict(self.model.named_parameters())
        held.update({name: params[name] for name in self.spec.shapes if not adapters.is_lora(name)})
        return adapters.held_form(held, self.spec.rank, self.spec.alpha, next(self.model.parameters()).dtype)

    def sleep(self) -> None:
        self._stats["sleeps"] += 1  # the model stays resident: nothing to free on a CPU

    def stats(self) -> dict:
        return {"engine": "hf", "lora_version": self.lora_version, **self._stats}
