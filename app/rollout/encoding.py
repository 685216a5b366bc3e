"""Token ids for the conversation's observation segments, tokenized once and never re-tokenized.

An episode's context is a concatenation of segments: the opening (system + first user turn with the
maze image, up to `<|im_start|>assistant\n`), then per turn the model's sampled ids and an observation
segment (`\n<|im_start|>user\n` + image + feedback + `<|im_end|>\n<|im_start|>assistant\n`). This module
turns dialogue text and images into those segments, in Qwen's ChatML as the model's chat template
writes it (a test checks that the concatenation equals the template's own rendering).

Image placeholders are expanded here, one `<|image_pad|>` per merged vision patch, so the trainer sees
exactly the ids the engine saw; the vLLM engine collapses them again because it expands them itself.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field

import numpy as np
import torch
from PIL import Image
from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

from app.world import dialogue

IMAGE_OMITTED_TEXT = "[earlier picture omitted]"


@dataclass
class Segment:
    """A run of context tokens. Observation segments carry their image(s) and a windowed variant."""

    token_ids: list[int]
    images: list[Image.Image] = field(default_factory=list)
    generated: bool = False
    logprobs: list[float] | None = None  # generated segments: the engine's logprob of each id
    without_images: list[int] | None = None  # observation segments: ids with the image replaced by text


class ChatCodec:
    """Builds segments for one processor (tokenizer + image processor) and turns images into model inputs."""

    def __init__(self, processor):
        self.processor = processor
        self.tokenizer = processor.tokenizer
        tok = self.tokenizer
        self.image_pad_id = tok.convert_tokens_to_ids("<|image_pad|>")
        self.im_end_id = tok.convert_tokens_to_ids("<|im_end|>")
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.convert_tokens_to_ids("<|endoftext|>")
        self.merge = processor.image_processor.merge_size
        self._encoded: dict[str, tuple[int, ...]] = {}
        self._vision_ids = {
            tok.convert_tokens_to_ids(t)
            for t in ("<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")
        }

    # ------------------------------------------------------------ text -> ids
    _ENCODED_MAX = 8192  # distinct texts kept: a rollout has a few hundred (feedback x turns left x hint)

    def _encode(self, text: str) -> list[int]:
        """The tokenizer's ids of `text`, from a cache: every turn of every run re-sends the same few texts, and
        tokenizing them was ~10% of a GPU rollout (py-spy) and most of the episode loop's host time.
        A plain dict, not functools.lru_cache, so the codec still pickles."""
        ids = self._encoded.get(text)
        if ids is None:
            if len(self._encoded) >= self._ENCODED_MAX:
                self._encoded.clear()
            ids = self._encoded[text] = tuple(self.tokenizer.encode(text, add_special_tokens=False))
        return list(ids)  # callers own their list

    def _with_image(self, before: str, image: Image.Image, after: str) -> tuple[list[int], list[int]]:
        """ids of before + image + after, with the image expanded, and with it replaced by a text note."""
        pads = self.image_tokens(image)
        head = self._encode(before + "<|vision_start|>")
        tail = self._encode("<|vision_end|>" + after)
        with_image = head + [self.image_pad_id] * pads + tail
        without = self._encode(before + IMAGE_OMITTED_TEXT + after)
        return with_image, without

    def opening(self, image: Image.Image, max_turns: int, maze_size: int, where: str | None = None) -> Segment:
        return self.question(image, dialogue.first_turn_text(max_turns, maze_size, where))

    def question(self, image: Image.Image, text: str) -> Segment:
        """The system prompt, then one user turn of the picture and `text`, up to the assistant's reply."""
        before = f"<|im_start|>system\n{dialogue.SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n"
        after = f"{text}<|im_end|>\n<|im_start|>assistant\n"
        ids, without = self._with_image(before, image, after)
        return Segment(ids, [image], without_images=without)

    def observation(
        self, image: Image.Image, feedback: str, turns_left: int, close_turn: bool, where: str | None = None
    ) -> Segment:
        """The user turn after an action; close_turn adds the `<|im_end|>` a reply cut at max_new_tokens lacks."""
        before = ("<|im_end|>" if close_turn else "") + "\n<|im_start|>user\n"
        after = f"{dialogue.observation_text(feedback, turns_left, where)}<|im_end|>\n<|im_start|>assistant\n"
        ids, without = self._with_image(before, image, after)
        return Segment(ids, [image], without_images=without)

    def reply_segment(self, text: str) -> Segment:
        """A scripted assistant reply (SFT demonstrations), ending the turn as the model would."""
        return Segment(self._encode(text) + [self.im_end_id], generated=True)

    # ------------------------------------------------------------ images -> model inputs
    def image_grid(self, image: Image.Image) -> tuple[int, int, int]:

        ip = self.processor.image_processor
        factor = ip.patch_size * ip.merge_size
        size = getattr(ip, "size", None) or {}
        min_px = size.get("shortest_edge", getattr(ip, "min_pixels", None))
        max_px = size.get("longest_edge", getattr(ip, "max_pixels", None))
        h, w = smart_resize(image.height, image.width, factor=factor, min_pixels=min_px, max_pixels=max_px)
        return 1, h // ip.patch_size, w // ip.patch_size

    def image_tokens(self, image: Image.Image) -> int:
        t, h, w = self.image_grid(image)
        return t * h * w // (self.merge**2)

    def vision_inputs(
        self, images: list[Image.Image], device: str | torch.device | None = None
    ) -> dict[str, torch.Tensor]:
        """pixel_values and image_grid_thw for the images, in order, as the model's forward expects.

        device: where the processor rescales and normalizes (a GPU trainer's own device: on the host this is
        the slowest part of a training step). Pictures whose sides are multiples of 32 px are not resized,
        so the result matches the host's up to float rounding.
        """
        if not images:
            return {}
        kwargs = {"device": str(device)} if device is not None else {}
        out = self.processor.image_processor(images=images, return_tensors="pt", **kwargs)
        return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}

    def mm_token_type_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return (ids == self.image_pad_id).long()

    # ------------------------------------------------------------ helpers
    def collapse_image_pads(self, ids: list[int]) -> list[int]:
        """One `<|image_pad|>` per image (vLLM expands placeholders itself)."""
        out: list[int] = []
        for i in ids:
            if i == self.image_pad_id and out and out[-1] == self.image_pad_id:
                continue
            out.append(i)
        return out

    def forbidden_ids(self) -> list[int]:
        return sorted(self._vision_ids)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def image_to_png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


def png_to_image(data: bytes) -> Image.Image:
    image = Image.open(io.BytesIO(data))
    image.load()
    return image.convert("RGB")


def as_image(array: np.ndarray) -> Image.Image:
    return Image.fromarray(array, mode="RGB")
