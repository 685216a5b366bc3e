"""Processed pictures kept on the trainer's device, keyed by their PNG bytes.

A maze has a few dozen distinct pictures (one per agent cell), and a GRPO step plays each maze n times,
so most pictures a training step feeds the vision tower were processed before: by the 8 samples of the
same maze, by earlier epochs, or by SFT's repeated demonstrations. The image processor (rescale,
normalize, patchify) runs on the host and was the slowest part of a small model's training step; this
cache skips it for a picture already seen. The result is the same tensor the processor returned (kept in
the model's dtype, which is what the vision tower casts it to first), so training is unchanged.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import torch

from app.rollout.encoding import png_to_image


class PictureCache:
    def __init__(self, codec, device: torch.device, dtype: torch.dtype, max_bytes: int):
        self.codec, self.device, self.dtype, self.max_bytes = codec, device, dtype, max_bytes
        self._entries: OrderedDict[bytes, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self.bytes = 0
        self.hits = 0
        self.misses = 0

    @staticmethod
    def key(png: bytes) -> bytes:
        # The episode renders and encodes deterministically, so equal pictures have equal PNG bytes.
        return hashlib.blake2b(png, digest_size=16).digest()

    def vision_inputs(self, pngs: list[bytes]) -> dict[str, torch.Tensor]:
        """pixel_values and image_grid_thw for the pictures, in order, as ChatCodec.vision_inputs gives them."""
        if not pngs:
            return {}
        keys = [self.key(png) for png in pngs]
        missing = list(dict.fromkeys(k for k in keys if k not in self._entries))
        self.hits += len(keys) - len(missing)
        self.misses += len(missing)
        if missing:
            first = {k: png for k, png in zip(keys, pngs)}
            fresh = self.codec.vision_inputs([png_to_image(first[k]) for k in missing], device=self.device)
            rows = fresh["image_grid_thw"].prod(dim=1).tolist()
            for k, pixels, grid in zip(missing, fresh["pixel_values"].split(rows), fresh["image_grid_thw"]):
                # the grid stays on the host: the trainer reads it there (app.learning.speedups.rope_positions)
                # without a device sync
                self._store(k, pixels.to(self.device, self.dtype), grid.to("cpu"))
        entries = [self._entries[k] for k in keys]
        for k in keys:
            self._entries.move_to_end(k)
        self._evict(keep=set(keys))
        return {
            "pixel_values": torch.cat([e[0] for e in entries]),
            "image_grid_thw": torch.stack([e[1] for e in entries]),
        }

    def _store(self, key: bytes, pixels: torch.Tensor, grid: torch.Tensor) -> None:
        self._entries[key] = (pixels, grid)
        self.bytes += pixels.numel() * pixels.element_size()

    def _evict(self, keep: set[bytes]) -> None:
        while self.bytes > self.max_bytes and self._entries:
            key = next(iter(self._entries))
            if key in keep:  # everything left is in use by this batch
                break
            pixels, _ = self._entries.pop(key)
            self.bytes -= pixels.numel() * pixels.element_size()
