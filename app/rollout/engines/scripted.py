"""An engine without a model: each reply drawn at once from a fixed list.

For what tests or times the episode loop's own work (the tests, scripts/bench/episode_host.py): no weights and
no sampling cost, and replies that cover what the loop must handle (moves, stops, text around an action,
garbage, an empty reply, a reply cut before its end-of-turn token).
"""

from __future__ import annotations

import random

from app.rollout.engines.base import Engine, Generation, Prompt, Sampling

# Valid moves, a stop, an action inside prose, garbage, a direction out of range, two actions, and nothing.
MIXED_REPLIES = [
    "('move', 0)",
    "('move', 3)",
    "I think ('move', 1)",
    "('stop', 'stop')",
    "zz%% nonsense",
    "('move', 9)",
    "('move', 2) wait ('move', 3)",
    "",
]
# Only valid moves: an episode lasts its whole turn budget.
MOVES = [f"('move', {d})" for d in range(4)]
# The token an empty reply cut short still yields (an engine always returns at least one token).
FILLER_TOKEN = 33


class ScriptedEngine(Engine):
    """Replies drawn from `replies` with a seeded RNG; `cut_share` of them cut at max_new_tokens before their
    end-of-turn token; random logprobs. With `record`, `log` keeps (first picture's hash + prompt ids, reply ids)
    of every request."""

    def __init__(
        self, codec, replies: list[str] = MIXED_REPLIES, cut_share: float = 0.2, seed: int = 0, record: bool = True
    ):
        self.codec, self.rng, self.lora_version = codec, random.Random(seed), 0
        self.replies = [codec.tokenizer.encode(text, add_special_tokens=False) for text in replies]
        self.cut_share = cut_share
        self.log: list[tuple[tuple[int, ...], list[int]]] | None = [] if record else None

    def generate(self, prompts: list[Prompt], sampling: Sampling) -> list[Generation]:
        out = []
        for p in prompts:
            ids = list(self.rng.choice(self.replies))
            cut = bool(self.cut_share) and self.rng.random() < self.cut_share
            if cut:
                ids = ids[: sampling.max_new_tokens] or ids[:1] or [FILLER_TOKEN]
            else:
                ids = ids + [self.codec.im_end_id]
            logprobs = [-self.rng.random() for _ in ids]
            if self.log is not None:
                first_image = hash(p.images[0].tobytes()) if p.images else 0  # ids alone do not tell mazes apart
                self.log.append(((first_image, *p.token_ids), ids))
            out.append(Generation(ids, logprobs, "length" if cut else "stop"))
        return out

    def load_lora(self, tensors, version: int) -> None:
        self.lora_version = version

    def lora_state(self):
        return None

    def stats(self) -> dict:
        return {}
