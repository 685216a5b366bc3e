"""The one small interface every generation engine offers (vLLM, transformers).

Prompts are token ids with the image placeholders already expanded (one `<|image_pad|>` per merged
vision patch, exactly what the trainer will see) plus the images in order. An engine returns the
sampled ids as sampled, with the logprob of each under the distribution it sampled from:
log_softmax((logits with vision tokens forbidden) / temperature), temperature 1 when greedy.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np
import torch
from PIL import Image

if TYPE_CHECKING:
    from app.model.adapters import PackedTensors


@dataclass
class Prompt:
    token_ids: list[int]
    images: list[Image.Image] = field(default_factory=list)
    image_ids: list[str] | None = (
        None  # one content id an image (app.rollout.episodes.Pictures): vLLM skips hashing pixels
    )


@dataclass
class Generation:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (end of turn sampled) or "length" (max_new_tokens reached)


@dataclass(frozen=True)
class Sampling:
    max_new_tokens: int
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    seed: int | None = None  # makes one generate call reproducible

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def for_turn(self, turn: int) -> Sampling:
        """This sampling for one turn of an episode loop: its own seed, derived from the loop's and the turn."""
        if self.seed is None:
            return self
        return replace(self, seed=derive_seed(self.seed, turn))

    @property
    def logprob_temperature(self) -> float:
        return 1.0 if self.greedy else self.temperature


def derive_seed(*parts: int) -> int:
    """A seed for one draw, named by integers (run seed, step, round, actor, turn, request...): the same names give
    the same seed, different names unrelated ones (numpy's SeedSequence hashes them). Sums of multiples of constants
    repeat along diagonals (step s turn t+1 == step s+1 turn t); hashed names do not. In [0, 2**63)."""
    state = np.random.SeedSequence([p % 2**64 for p in parts]).generate_state(2, np.uint32)
    return (int(state[0]) << 31 | int(state[1]) >> 1) & (2**63 - 1)


def request_seed(seed: int, request: int) -> int:
    """The seed of request `request` of one generate call seeded with `seed` (engines that seed each request)."""
    return derive_seed(seed, request)


class Engine(abc.ABC):
    """Generation for a batch of prompts, with an in-memory LoRA that is swapped by version."""

    lora_version: int = -1  # -1: the base model, no adapter loaded yet

    @abc.abstractmethod
    def generate(self, prompts: list[Prompt], sampling: Sampling) -> list[Generation]: ...

    @abc.abstractmethod
    def load_lora(self, tensors: PackedTensors | dict[str, torch.Tensor], version: int) -> None:
        """Makes `tensors` (PEFT names, validated; a dict or app.model.adapters.pack's buffer) the adapter of every
        later generate call. The caller's tensors are never written."""

    def load_vision_tower(self, tensors: dict[str, torch.Tensor]) -> None:
        """Makes `tensors`, a whole vision tower under PEFT's names (`base_model.model.model.visual.*`), the tower of
        every later generate call, whatever adapter is loaded. Engines that hold no tower refuse."""
        from app.model.adapters import AdapterMismatch

        raise AdapterMismatch(f"{type(self).__name__} holds no vision tower to replace")

    @abc.abstractmethod
    def lora_state(self) -> dict[str, torch.Tensor] | None:
        """The adapter generation uses now, read back from where the engine keeps it, in
        app.model.adapters.held_form's layout (compare with held_form of the trainer's tensors); None before the
        first load."""

    def stream(
        self,
        first: dict[int, Prompt],
        sampling_for: Callable[[int], Sampling],
        on_reply: Callable[[int, Generation], Prompt | None],
    ) -> None:
        """Plays conversations to their end: `first` holds each one's opening prompt by key; `on_reply(key, reply)`
        is called with each reply and returns that conversation's next prompt, or None when it is over. Turn t of
        every conversation samples with `sampling_for(t)`.

        This default plays in lockstep: turn t of every open conversation is one `generate` call, its request i
        seeded as that call seeds it. Engines that can take requests while others run override it (VLLMEngine's
        continuous schedule)."""
        pending, turn = dict(first), 0
        while pending:
            keys = list(pending)
            replies = self.generate([pending[k] for k in keys], sampling_for(turn))
            pending = {}
            for key, reply in zip(keys, replies):
                following = on_reply(key, reply)
                if following is not None:
                    pending[key] = following
            turn += 1

    def sleep(self) -> None:
        """Frees what generation holds (KV cache, weights where the engine can offload) between phases."""

    def wake(self) -> None:
        """Restores what sleep freed."""

    @abc.abstractmethod
    def stats(self) -> dict: ...

    def shutdown(self) -> None:
        """Releases the engine's resources."""


def logprobs_of(
    logits: torch.Tensor, token_ids: torch.Tensor, temperature: float, forbidden: list[int]
) -> torch.Tensor:
    """log p(token) under softmax((logits, forbidden tokens at -inf) / temperature), computed in float32.

    The same function scores tokens in the transformers engine and in the trainer, so both agree with
    vLLM's processed logprobs by construction.
    """
    logits = logits.float()
    if forbidden:
        logits = logits.clone()
        logits[..., forbidden] = float("-inf")
    if temperature != 1.0:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)
