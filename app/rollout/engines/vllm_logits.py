"""Runs inside vLLM's engine core: the vision special tokens are never sampled, in one batched operation a step.

A reply must not contain an image placeholder (the trainer's forward would refuse it) or another vision token. vLLM's
per-request `bad_words` does the same masking with one device write per request and forbidden token at every decode
step, from the host; this processor, given to the engine as `logits_processors`, masks the whole batch at once
(VLLMEngine(forbid_with="logits_processor"); the default stays bad words, as the H200 rollout was no faster with it). It
acts where bad words act (before temperature and sampling), so the engine's processed logprobs are those of the
distribution with vision tokens forbidden, as app.rollout.engines.base.logprobs_of scores them.
This module imports vLLM at the top: only a vLLM engine core loads it, by its name.
"""

from __future__ import annotations

import torch
from transformers import AutoTokenizer
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor

from app.model.load import VISION_TOKENS


class ForbidVisionTokens(LogitsProcessor):
    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        tokenizer = AutoTokenizer.from_pretrained(vllm_config.model_config.tokenizer)
        ids = [tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS]
        if any(i is None or i == tokenizer.unk_token_id for i in ids):
            raise ValueError(f"the tokenizer lacks one of the vision tokens {VISION_TOKENS}: {ids}")
        self.ids = torch.tensor(sorted(set(ids)), dtype=torch.long, device=device)

    def is_argmax_invariant(self) -> bool:
        return False  # it changes what greedy decoding picks

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        pass  # the same tokens for every request

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.index_fill_(1, self.ids, float("-inf"))
