"""Qwen3-VL's 3-D rotary positions (time, row, column) of a training batch, computed on the host in one pass.

transformers computes them inside every forward (`get_rope_index`): a Python loop over the batch's sequences that
reads each one back from the device, groups its tokens and builds small tensors piece by piece. On a GPU that is
several stream synchronisations and ~25 kernel launches a sequence: on the H200 a see-stage step of 256 questions
ran 1.41x faster, and an SFT step 1.48x, once the positions came from here (docs/BENCHMARKS.md). The trainer already
holds the token ids on the host, so this computes the same positions with numpy before anything moves to the device,
and the model's forward takes them as `position_ids` (which skips its own computation).

The rule, as the library applies it to images (Qwen2-VL's M-RoPE): a text token's three positions are all its
running index; the tokens of one picture of (t, h, w) patches merged m x m share the time position where the
picture starts, and take row and column offsets from it; the running index then resumes at the start plus
max(h, w) / m. Padding (attention mask 0) gets position 0. Videos are not handled: no episode has one.

Written by hand because the library has only the per-sequence loop; tests/learning/speedups/test_rope_positions.py
checks every value against it."""

from __future__ import annotations

import functools

import numpy as np
import torch


@functools.lru_cache(maxsize=4096)
def _positions(length: int, runs: tuple[tuple[int, int, int, int], ...]) -> np.ndarray:
    """[3, length] positions of one sequence whose image runs are (start, end, rows, cols) in merged tokens.

    Cached by layout: the sequences of a run come from a handful of templates (the same prompt with the
    picture at the same offset), so most batches compute nothing here.
    """
    out = np.empty((3, length), dtype=np.int64)
    text_from, position = 0, 0
    for start, end, rows, cols in runs:
        out[:, text_from:start] = np.arange(position, position + start - text_from)
        position += start - text_from
        out[0, start:end] = position
        out[1, start:end] = position + np.repeat(np.arange(rows), cols)
        out[2, start:end] = position + np.tile(np.arange(cols), rows)
        position += max(rows, cols)
        text_from = end
    out[:, text_from:] = np.arange(position, position + length - text_from)
    return out


def _placeholder_runs(token_ids: np.ndarray, image_pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(starts, ends) of the runs of image placeholders in one sequence."""
    is_pad = np.concatenate(([False], np.asarray(token_ids) == image_pad_id, [False]))
    edges = np.flatnonzero(is_pad[1:] != is_pad[:-1])
    return edges[0::2], edges[1::2]


def batch_positions(
    sequences: list[np.ndarray], width: int, image_pad_id: int, grids: list[tuple[int, int, int]], merge: int
) -> torch.Tensor:
    """position_ids [3, batch, width] for right-padded sequences; `grids` lists every picture's (t, h, w) patch
    grid in order of appearance over the batch (as image_grid_thw does)."""
    out = np.zeros((3, len(sequences), width), dtype=np.int64)
    pictures = iter(grids)
    for row, ids in enumerate(sequences):
        runs = []
        for start, end in zip(*(edge.tolist() for edge in _placeholder_runs(ids, image_pad_id))):
            t, h, w = next(pictures, (0, 0, 0))
            rows, cols = h // merge, w // merge
            if t != 1 or end - start != rows * cols:
                raise ValueError(
                    f"a run of {end - start} image placeholders does not fit the next picture, of grid {(t, h, w)}"
                )
            runs.append((start, end, rows, cols))
        out[:, row, : len(ids)] = _positions(len(ids), tuple(runs))
    if next(pictures, None) is not None:
        raise ValueError("the batch has more pictures than runs of image placeholders")
    return torch.from_numpy(out)
