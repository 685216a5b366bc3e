"""Random-number-generator states (torch, CUDA, numpy, python) as safetensors tensors plus JSON: nothing pickled."""

from __future__ import annotations

import random
from collections.abc import Mapping

import numpy as np
import torch


def capture_rng() -> tuple[dict[str, torch.Tensor], dict]:
    """(rng_tensors, JSON state) of torch (CPU and initialized CUDA devices), numpy and python's random."""
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors.update({f"torch_cuda_{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    version, words, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return tensors, {
        "python": [version, list(words), gauss],
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
    }


def restore_rng(tensors: Mapping[str, torch.Tensor], json_state: dict) -> None:
    """Inverse of capture_rng (CUDA states only for devices present)."""
    torch.set_rng_state(tensors["torch_cpu"])
    for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
        if f"torch_cuda_{i}" in tensors:
            torch.cuda.set_rng_state(tensors[f"torch_cuda_{i}"], i)
    version, words, gauss = json_state["python"]
    random.setstate((version, tuple(words), gauss))
    kind, keys, pos, has_gauss, cached = json_state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
