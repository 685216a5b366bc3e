"""The language model's decoder layers compiled by torch.compile (model.compile_layers), in the trainer.

Between its matrix products a decoder layer runs a few dozen elementwise kernels (the RMS norms and their float32
round trips, rotary positions, SwiGLU, residual adds), which in an 8B step on the H200 held about a third of the
device time. Inductor fuses them into a few kernels. Each layer compiles with dynamic shapes, so micro-batches of
another length reuse the compiled code; every layer runs the same code, so one compile serves all of them. With
several trainer ranks the layers are compiled before FSDP2 shards them: its gathering hooks run eagerly around the
compiled code (torch._dynamo skips FSDP2's hooks by default).

Inductor keeps a fused kernel's intermediates in float32 where eager bf16 rounds each op's result to bf16; the
engines round as eager does, so compiled layers emulate those casts (`emulate_precision_casts`) and score the
engine's tokens as the eager trainer does.
"""

from __future__ import annotations

from torch import nn


def compile_language_layers(model: nn.Module) -> int:
    """Compiles each decoder layer of the (PEFT-wrapped) Qwen3-VL language model in place; returns how many."""
    layers = model.base_model.model.model.language_model.layers
    for layer in layers:
        layer.compile(dynamic=True, options={"emulate_precision_casts": True})
    return len(layers)
