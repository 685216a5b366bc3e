"""The frozen vision tower's outputs per distinct picture, kept on the trainer's device.

GRPO's LoRA sits on the language model only (DESIGN rule 4), so the vision tower is a fixed function of the
picture for the whole run. A training step feeds it the same few hundred pictures (the ~25 cells of a maze, seen by
its 8 runs, turn after turn) in every forward pass: the pre-update pass, each epoch's pass, and the trust region's
measuring passes. On the H200 the tower was 21% of the trainer's forward and transformers' per-picture position
loop inside it another 10% (py-spy, docs/BENCHMARKS.md). This cache runs the tower once per distinct
picture and serves its outputs (the merged embeddings and the deepstack features) to every later forward.

How: the model's `get_image_features` (what its forward calls on `pixel_values`) is shadowed on the instance by
`VisionCache._serve`, which reads which pictures the batch holds from `serving(keys)`. transformers 5.19 also takes
precomputed `mm_encoder_outputs`, but the GPU image has 5.17, which does not; the shadow works with both.

Exactness: a picture's outputs are computed in a smaller batch than before, which may change float rounding in the
last bits (batched attention and GEMM tiling); nothing else. The cache serves only while no vision weight trains
(full-model SFT trains them: it falls through) and only in one process: under FSDP2 every rank must run the same
collectives, and ranks would miss the cache on different pictures.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from types import SimpleNamespace

import torch


def _per_picture(value, sizes: list[int]) -> list[torch.Tensor]:
    return list(value) if isinstance(value, (tuple, list)) else list(torch.split(value, sizes))


class VisionCache:
    def __init__(self, vl_model, max_bytes: int):
        """vl_model: the transformers Qwen3-VL model whose forward calls `self.get_image_features`."""
        self.vl_model, self.max_bytes = vl_model, max_bytes
        self.compute = vl_model.get_image_features  # the bound original
        self._entries: OrderedDict[bytes, tuple[torch.Tensor, list[torch.Tensor]]] = OrderedDict()
        self._keys: list[bytes] | None = None
        self.bytes = self.hits = self.misses = 0
        self._split = (True, True)  # whether get_image_features returns (pooled, deepstack) split per picture
        vl_model.get_image_features = self._serve

    @contextlib.contextmanager
    def serving(self, keys: list[bytes]):
        """The forwards inside see pictures `keys`, in the order of their pixel_values rows."""
        self._keys = keys
        try:
            yield
        finally:
            self._keys = None

    def active(self) -> bool:
        return not any(p.requires_grad for p in self.vl_model.visual.parameters())

    def _serve(self, pixel_values, image_grid_thw=None, **kwargs):
        keys = self._keys
        if keys is None or image_grid_thw is None or len(keys) != len(image_grid_thw) or not self.active():
            return self.compute(pixel_values, image_grid_thw, **kwargs)
        missing = list(dict.fromkeys(k for k in keys if k not in self._entries))
        self.hits += len(keys) - len(missing)
        self.misses += len(missing)
        if missing:
            rows = image_grid_thw.prod(-1).tolist()
            first = {}
            offset = 0
            for key, n in zip(keys, rows):
                first.setdefault(key, (offset, n))
                offset += n
            index = {key: i for i, key in enumerate(keys)}
            pixels = torch.cat([pixel_values[first[k][0] : first[k][0] + first[k][1]] for k in missing])
            grids = image_grid_thw[[index[k] for k in missing]]
            kwargs.pop("return_dict", None)
            with torch.no_grad():
                out = self.compute(pixels, grids, return_dict=True, **kwargs)
            # transformers 5.19 splits both outputs per picture; 5.17 (the GPU image) leaves the deepstack
            # features concatenated, and its forward reads them so: serve what this version's own call returns
            self._split = (
                isinstance(out.pooler_output, (tuple, list)),
                isinstance(out.deepstack_features[0], (tuple, list)),
            )
            sizes = (grids.prod(-1) // self.vl_model.visual.spatial_merge_size**2).tolist()
            pooled = _per_picture(out.pooler_output, sizes)
            deepstack = [_per_picture(f, sizes) for f in out.deepstack_features]
            for j, key in enumerate(missing):
                self._store(key, pooled[j].detach(), [f[j].detach() for f in deepstack])
        entries = [self._entries[k] for k in keys]
        for k in keys:
            self._entries.move_to_end(k)
        self._evict(keep=set(keys))
        layers = len(entries[0][1])
        split_pooled, split_deepstack = self._split

        def joined(parts: tuple, split: bool):
            return parts if split else torch.cat(parts)

        # the two attributes the model's forward reads, shaped as this version's get_image_features shapes them
        return SimpleNamespace(
            pooler_output=joined(tuple(e[0] for e in entries), split_pooled),
            deepstack_features=[joined(tuple(e[1][i] for e in entries), split_deepstack) for i in range(layers)],
        )

    @staticmethod
    def _size(entry: tuple[torch.Tensor, list[torch.Tensor]]) -> int:
        return sum(t.numel() * t.element_size() for t in [entry[0], *entry[1]])

    def _store(self, key: bytes, embeds: torch.Tensor, deepstack: list[torch.Tensor]) -> None:
        self._entries[key] = (embeds, deepstack)
        self.bytes += self._size(self._entries[key])

    def _evict(self, keep: set[bytes]) -> None:
        while self.bytes > self.max_bytes and self._entries:
            key = next(iter(self._entries))
            if key in keep:  # everything left is in use by this batch
                break
            self.bytes -= self._size(self._entries.pop(key))
