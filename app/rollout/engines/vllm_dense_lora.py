"""An engine's one adapter applied as two dense matrix products a projection, in place of vLLM's LoRA kernels.

vLLM's LoRA layers call its punica kernels (Triton), made for batches that mix many adapters: each token looks up its
slot. An engine with one slot (`max_loras=1`, the rollout engine's case) computes the same sums with two plain GEMMs
(cuBLAS) a projection group: the group's A matrices stacked into one [n·r, in] matrix give every slice's rank-r
product in one call, and its B matrices placed block-diagonally in one [out, n·r] matrix add every slice into the
output in one call, with no float32 buffer to fill. vLLM has no such option, hence this module.

How: once vLLM has made its LoRA layers (`LoRAModelRunnerMixin.load_lora_model`), each eligible layer's slot
tensors are made views of one stacked A and one block-diagonal B, so that vLLM's own adapter loading (`set_lora`,
`reset_lora`) fills them, CUDA graphs captured later keep their addresses, and sleep mode moves them with the
weights; the layer's `_apply_lora_to_output` is replaced on the instance. When every layer of the language model's
punica wrapper is dense, the wrapper prepares only the token map they read. A token of a request without the
adapter (slot -1 in that map) gets nothing added, as with vLLM's kernels. The arithmetic is vLLM's: the rank-r
product rounded to the adapter's dtype, then multiplied by B and added to the output.

Eligible: a linear LoRA layer of the language model with one slot, one tensor-parallel rank and LoRAs not fully
sharded; other layers keep vLLM's kernels. An engine asks for it with `additional_config={CONFIG_KEY: True}`
(vLLM's channel for its plugins' settings, part of its compile cache's key). `install` must run in vLLM's worker
before the model loads: VLLMEngine calls it for an engine core in its process, and vllm_worker, the worker extension
vLLM imports first in an engine core's own process, calls it there. The vLLM internals used are pinned by the
versions vllm_worker names; tests/rollout/test_dense_lora.py checks the outputs against vLLM's own kernels.
"""

from __future__ import annotations

import functools
import types

import torch

CONFIG_KEY = "mazerl_dense_lora"


def install() -> None:
    """Wraps vLLM's `load_lora_model` so that an engine whose additional_config asks for it gets dense LoRA layers
    (their names in the model runner's `mazerl_dense_lora_layers`); idempotent, inert for every other engine."""
    from vllm.v1.worker.lora_model_runner_mixin import LoRAModelRunnerMixin

    original = LoRAModelRunnerMixin.load_lora_model
    if getattr(original, "mazerl_dense", False):
        return

    @functools.wraps(original)
    def load_lora_model(self, model, vllm_config, device):
        model = original(self, model, vllm_config, device)
        extra = vllm_config.additional_config
        if isinstance(extra, dict) and extra.get(CONFIG_KEY):
            self.mazerl_dense_lora_layers = densify(self.lora_manager._adapter_manager)
        return model

    load_lora_model.mazerl_dense = True
    LoRAModelRunnerMixin.load_lora_model = load_lora_model


def densify(manager) -> list[str]:
    """Makes every eligible layer of a LoRAModelManager dense; returns their names."""
    from vllm.lora.layers.base_linear import BaseLinearLayerWithLoRA
    from vllm.lora.model_manager import DEFAULT_LANGUAGE_WRAPPER_KEY

    config = manager.lora_config
    language = manager.punica_wrapper_mapping.get(DEFAULT_LANGUAGE_WRAPPER_KEY)
    if config.max_loras != 1 or config.fully_sharded_loras or language is None:
        return []
    # the vision tower's layers have their own wrapper, whose token map is not the language model's
    on_language = {name: layer for name, layer in manager.modules.items() if layer.punica_wrapper is language}
    dense = [
        name
        for name, layer in on_language.items()
        if isinstance(layer, BaseLinearLayerWithLoRA) and layer.tp_size == 1 and stack_slots(layer)
    ]
    if len(dense) == len(on_language):
        language.update_metadata = types.MethodType(token_slots_only, language)
    return dense


def token_slots_only(wrapper, mapping, lora_index_to_id, max_loras, vocab_size, **kwargs) -> None:
    """A punica wrapper's `update_metadata` for one whose every layer is dense: only the token -> slot map that
    dense_lora reads (copied to the device without waiting). vLLM's own also prepares its kernels' metadata, which
    reads values back from the device (a sort, a unique, a flag) and so holds the host until the GPU has run every
    step queued before it, each time the batch changes."""
    wrapper.is_prefill = mapping.is_prefill
    wrapper._update_base_metadata(mapping, lora_index_to_id, max_loras, vocab_size)


def stack_slots(layer) -> bool:
    """Re-makes the layer's slot tensors as views of one stacked A [1, 1, n·r, in] and one block-diagonal B
    [1, 1, out, n·r] (contents kept) and switches its forward to dense_lora; False (layer untouched) when its slots
    are not the one-slot shapes this expects."""
    a_slots, b_slots = tuple(layer.lora_a_stacked), tuple(layer.lora_b_stacked)
    n, outs = len(a_slots), tuple(layer.output_slices)
    if n == 0 or len(b_slots) != n or len(outs) != n:
        return False
    _, _, rank, width = a_slots[0].shape
    if any(tuple(a.shape) != (1, 1, rank, width) for a in a_slots):
        return False
    if any(tuple(b.shape) != (1, 1, out, rank) for b, out in zip(b_slots, outs)):
        return False
    if n == 1:
        stacked_a, block_b = a_slots[0], b_slots[0]
    else:
        stacked_a = a_slots[0].new_zeros(1, 1, n * rank, width)
        block_b = b_slots[0].new_zeros(1, 1, sum(outs), n * rank)
        a_views, b_views, row = [], [], 0
        for i, (a, b, out) in enumerate(zip(a_slots, b_slots, outs)):
            a_view = stacked_a[:, :, i * rank : (i + 1) * rank, :]
            b_view = block_b[:, :, row : row + out, i * rank : (i + 1) * rank]
            a_view.copy_(a)
            b_view.copy_(b)
            a_views.append(a_view)
            b_views.append(b_view)
            row += out
        layer.lora_a_stacked, layer.lora_b_stacked = tuple(a_views), tuple(b_views)
    layer.mazerl_stacked_a, layer.mazerl_block_b = stacked_a[0, 0], block_b[0, 0]
    layer._apply_lora_to_output = types.MethodType(dense_lora, layer)
    return True


def dense_lora(layer, x: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
    """output += (x · Aᵀ)·Bᵀ for the tokens that play the adapter's slot, in place; `_apply_lora_to_output`'s
    contract (x and output [tokens, ·], or [1, tokens, ·] from the transformers backend)."""
    shape = output.shape
    if x.ndim == 3 and output.ndim == 3:
        x, output = x.flatten(0, 1), output.flatten(0, 1)
    a, b = layer.mazerl_stacked_a, layer.mazerl_block_b
    shrunk = torch.mm(x.to(a.dtype), a.t())
    plays = layer.punica_wrapper._token_lora_indices[: x.shape[0]] == 0
    shrunk = torch.where(plays.unsqueeze(1), shrunk, torch.zeros((), dtype=shrunk.dtype, device=shrunk.device))
    output.addmm_(shrunk.to(output.dtype), b.t().to(output.dtype))
    return output.reshape(shape)
