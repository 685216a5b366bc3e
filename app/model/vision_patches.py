"""The Qwen3-VL vision tower's patch embedding as the matrix product it is.

transformers embeds the pictures' patches with an nn.Conv3d whose kernel equals its stride: each output is one
patch's flattened pixels times the kernel, a single matrix product over all patches. PyTorch's Conv3d kernels are
far slower than that product: on a CPU 7x in float32 and 80x in bfloat16 for the forward and backward of 2,592
patches (the backward of a trained tower's conv took 73% of a bf16 training step), and since PyTorch 2.9 the CUDA
path no longer uses cuDNN's Conv3d (pytorch/pytorch#166122). vLLM computes the same layer as the product
(`Conv3dLayer._forward_mulmat`), so the trainer doing so also computes what the engine computes.

The module keeps its nn.Conv3d and its weight, so checkpoints, adapters (`modules_to_save`), FSDP2 sharding and
parametrizations see the same parameter; only the forward changes. Written here because transformers has no
option for it.
"""

from __future__ import annotations

import math
import types

import torch
import torch.nn.functional as F
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionPatchEmbed


def linear_patch_embed(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """Qwen3VLVisionPatchEmbed.forward as one matrix product: [patches, C*T*P*P] x [C*T*P*P, hidden]."""
    weight = self.proj.weight  # read once: a parametrized weight is computed at each read
    patch = math.prod(weight.shape[1:])
    flat = hidden_states.reshape(-1, patch).to(dtype=weight.dtype)
    return F.linear(flat, weight.reshape(weight.shape[0], patch), self.proj.bias)


def use_linear_patch_embed(model) -> int:
    """Routes every patch embedding of `model` whose convolution is a per-patch product (kernel equal to stride,
    no padding, no groups) through linear_patch_embed; returns how many."""

    count = 0
    for module in model.modules():
        if not isinstance(module, Qwen3VLVisionPatchEmbed):
            continue
        conv = module.proj
        if tuple(conv.kernel_size) == tuple(conv.stride) and not any(conv.padding) and conv.groups == 1:
            module.forward = types.MethodType(linear_patch_embed, module)
            count += 1
    return count
