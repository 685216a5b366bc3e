"""The trainer's LoRA layers add their update inside the matrix product, scaled at rank r.

PEFT's LoRA Linear computes `base(x) + lora_B(lora_A(x)) * scaling`: the scaling multiplies and the sum adds over
the layer's whole output (up to 12,288 features a token at the 8B shape, seven targets a layer), and with gradient
checkpointing the multiply runs three times a step (forward, recomputation, backward). The same value computed as
`addmm(base(x), lora_A(x) * scaling, lora_B^T)` scales the rank-r intermediate (32 features) and adds in the product's
epilogue. It equals PEFT's forward up to rounding, and PEFT's own forward still runs wherever this one does not apply:
adapters disabled (the KL reference), merged, several active, a variant (DoRA), a LoRA bias, fan-in-fan-out weights,
an active dropout, or float32 adapter weights meeting a lower-precision input outside autocast. PEFT offers no such
path; its LoRA layers are kept (their names, state dict and PEFT format are unchanged), only their forward is swapped.
"""

from __future__ import annotations

import torch
from torch import nn


def fuse_lora_layers(model: nn.Module) -> int:
    """Swaps the forward of every vanilla LoRA Linear in the model; returns how many."""
    from peft.tuners.lora.layer import Linear

    swapped = 0
    for module in model.modules():
        if type(module) is Linear and not getattr(module, "_fused_forward", False):
            module.forward = _fused_forward(module, module.forward)
            module._fused_forward = True
            swapped += 1
    return swapped


def restore_lora_layers(model: nn.Module) -> int:
    """PEFT's own forward back in every layer fuse_lora_layers swapped (to compare both); returns how many."""
    restored = 0
    for module in model.modules():
        if getattr(module, "_fused_forward", False):
            del module.forward, module._fused_forward  # the instance's; the class's forward shows again
            restored += 1
    return restored


def _fused_forward(layer, peft_forward):
    def forward(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        name = _single_vanilla_adapter(layer, x, args, kwargs)
        if name is None:
            return peft_forward(x, *args, **kwargs)
        result = layer.base_layer(x)
        low = layer.lora_A[name](x) * layer.scaling[name]
        weight = layer.lora_B[name].weight
        out = torch.addmm(result.reshape(-1, result.shape[-1]), low.reshape(-1, low.shape[-1]), weight.t())
        return out.view(result.shape)

    return forward


def _dropout_off(dropout: nn.Module) -> bool:
    return isinstance(dropout, nn.Identity) or (isinstance(dropout, nn.Dropout) and dropout.p == 0.0)


def _single_vanilla_adapter(layer, x: torch.Tensor, args: tuple, kwargs: dict) -> str | None:
    """The active adapter's name when the fused forward computes what PEFT's would, else None."""
    if args or kwargs or layer.disable_adapters or layer.merged or layer.fan_in_fan_out:
        return None
    active = [a for a in layer.active_adapters if a in layer.lora_A]
    if len(active) != 1:
        return None
    name = active[0]
    # getattr: PEFT releases before 0.16 mark DoRA in use_dora and have no variants or LoRA bias
    special = (getattr(layer, "lora_variant", {}), getattr(layer, "use_dora", {}), getattr(layer, "lora_bias", {}))
    if name in special[0] or special[1].get(name) or special[2].get(name) or not _dropout_off(layer.lora_dropout[name]):
        return None
    if layer.lora_A[name].weight.dtype != x.dtype and not torch.is_autocast_enabled(x.device.type):
        return None  # PEFT casts the input to the weights' dtype here
    return name
