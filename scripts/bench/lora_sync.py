"""LoRA sync, trainer -> every rollout actor: Ray object refs against a PEFT folder written and read back.

All paths start with the adapter in the trainer actor's memory and end with every rollout actor holding
its own copy as torch tensors (validated against the model's shapes). The ref path is what the driver
does (`trainer.step` returns the adapter packed into one buffer, each rollout actor's `load_lora`
receives the ref and reads it zero-copy); "ref dict" sends the plain dict of tensors instead. The folder
path writes adapter_model.safetensors + adapter_config.json (app.model.adapters.write_peft_folder) to
--folder-root and each actor reads it with safetensors. Sizes go from the tiny model's adapter up to a
Qwen3-VL-8B-shaped rank-32 adapter (~174 MB in bf16). With --engine, the tiny case also loads the
adapter into a real engine in each actor. Reported: median seconds over --repeats, and the ratio.

    python scripts/bench/lora_sync.py --actors 2 --repeats 5
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time
import uuid

import ray
import torch

from app.config import LoraSettings
from app.model.adapters import AdapterSpec, PackedTensors, pack, read_peft_folder, unpack, validate, write_peft_folder


@ray.remote
class Trainer:
    def __init__(self, shapes: dict, dtype: str):
        g = torch.Generator().manual_seed(0)
        self.tensors = {k: (torch.randn(s, generator=g) * 0.01).to(getattr(torch, dtype)) for k, s in shapes.items()}

    def adapter(self) -> dict:
        return self.tensors

    def packed(self) -> PackedTensors:
        return pack(self.tensors)

    def write_folder(self, spec: AdapterSpec, folder: str) -> float:
        start = time.perf_counter()
        write_peft_folder(self.tensors, spec, folder)
        return time.perf_counter() - start


@ray.remote
class Rollout:
    def __init__(self, spec: AdapterSpec):
        self.spec, self.held = spec, None

    def load_tensors(self, tensors) -> int:
        tensors = unpack(tensors)
        validate(tensors, self.spec)
        self.held = tensors
        return sum(t.numel() for t in tensors.values())

    def load_folder(self, folder: str) -> int:
        tensors, _ = read_peft_folder(folder)
        return self.load_tensors(tensors)


def sizes(which: list[str]) -> dict[str, tuple[object, LoraSettings]]:
    from transformers import AutoConfig

    from app.config import ModelConfig
    from app.model.build import ensure_model, qwen3_vl_8b_config

    out = {}
    if "tiny" in which:
        tiny = AutoConfig.from_pretrained(str(ensure_model(ModelConfig(), "/tmp/mazerl-bench-models"))).text_config
        out["tiny r16"] = (tiny, LoraSettings(rank=16, alpha=32))
    if "8b" in which:
        big = qwen3_vl_8b_config().text_config
        out["8B r8"] = (big, LoraSettings(rank=8, alpha=16))
        out["8B r32"] = (big, LoraSettings(rank=32, alpha=64))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--actors", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--sizes", default="tiny,8b")
    ap.add_argument("--folder-root", default="/tmp/mazerl-bench-sync", help="where the folder path writes")
    args = ap.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=args.actors + 2, include_dashboard=False)
    print(
        f"{'adapter':10} {'MB':>7} {'ref packed s':>13} {'ref dict s':>11} {'PEFT folder s':>14} {'folder/packed':>14}"
    )
    for name, (text_config, lora) in sizes(args.sizes.split(",")).items():
        spec = AdapterSpec.for_model(text_config, lora)
        trainer = Trainer.remote(spec.shapes, args.dtype)
        rollouts = [Rollout.remote(spec) for _ in range(args.actors)]
        ray.get([r.__ray_ready__.remote() for r in rollouts] + [trainer.__ray_ready__.remote()])
        packed_times, ref_times, folder_times = [], [], []
        for _ in range(args.repeats + 1):  # the first round warms up and is dropped
            for method, times in ((trainer.packed, packed_times), (trainer.adapter, ref_times)):
                start = time.perf_counter()
                ref = method.remote()
                ray.get([r.load_tensors.remote(ref) for r in rollouts])
                times.append(time.perf_counter() - start)
                del ref
            folder = os.path.join(args.folder_root, uuid.uuid4().hex)
            start = time.perf_counter()
            ray.get(trainer.write_folder.remote(spec, folder))
            ray.get([r.load_folder.remote(folder) for r in rollouts])
            folder_times.append(time.perf_counter() - start)
            shutil.rmtree(folder, ignore_errors=True)
        packed_s, ref_s, folder_s = (statistics.median(t[1:]) for t in (packed_times, ref_times, folder_times))
        mb = spec.num_parameters * torch.tensor([], dtype=getattr(torch, args.dtype)).element_size() / 1e6
        print(
            f"{name:10} {mb:7.1f} {packed_s:13.3f} {ref_s:11.3f} {folder_s:14.3f} {folder_s / packed_s:14.2f}",
            flush=True,
        )
        for actor in rollouts + [trainer]:
            ray.kill(actor)


if __name__ == "__main__":
    main()
