"""A trainer out of GPU memory ends the job as one config error that names the knob to change (app/learning/
out_of_memory.py), carried from the trainer actor to the driver, not as torch's allocator message after a retry."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import ray
import torch

from app.config import ConfigError, load_config
from app.learning.out_of_memory import explained_out_of_memory, out_of_memory_error

ROOT = Path(__file__).resolve().parents[2]
GIB = 1024**3
H100 = {"total": 79 * GIB, "peak": 56 * GIB, "others": 22 * GIB}  # configs/h200.yaml's trainer beside its engine


def config(*overrides: str):
    return load_config(str(ROOT / "configs" / "h200.yaml"), list(overrides))


def test_the_error_names_the_checkpointed_share_first_then_every_other_way_to_free_memory():
    e = out_of_memory_error(config(), "train step", H100)
    assert e.field_path == "model.checkpointed_layers"
    assert "reached 56.0 GiB of the GPU's 79.0 GiB" in e.problem and "held 22.0 GiB" in e.problem
    assert "model.checkpointed_layers (now 0.0" in e.fix and "train.micro_batch (now 4)" in e.fix
    assert "rollout.keep_weights=false" in e.fix


def test_with_every_layer_checkpointed_the_micro_batch_comes_first():
    e = out_of_memory_error(config("model.checkpointed_layers=1.0", "rollout.keep_weights=false"), "train step", H100)
    assert e.field_path == "train.micro_batch"
    assert "checkpointed_layers" not in e.fix and "keep_weights" not in e.fix
    off = out_of_memory_error(
        config("model.gradient_checkpointing=false", "model.checkpointed_layers=1.0"), "warm-start step", H100
    )
    assert off.field_path == "model.gradient_checkpointing" and "warm-start step" in off.problem


def test_a_config_error_keeps_its_parts_across_a_pickle():
    e = pickle.loads(pickle.dumps(out_of_memory_error(config(), "train step", H100)))
    assert isinstance(e, ConfigError) and e.field_path == "model.checkpointed_layers" and "56.0 GiB" in str(e)


@ray.remote
class Raising:
    def fail(self, cfg):
        raise out_of_memory_error(cfg, "train step", H100)


def test_a_config_error_raised_in_an_actor_reaches_the_driver_as_one(ray_cluster):
    actor = Raising.options(num_cpus=0.1).remote()
    with pytest.raises(ConfigError) as caught:
        ray.get(actor.fail.remote(config()), timeout=120)
    e = getattr(caught.value, "cause", caught.value)  # what app.main prints
    assert e.field_path == "model.checkpointed_layers" and str(e).startswith("config error at")
    ray.kill(actor)


def test_out_of_host_memory_on_a_cpu_trainer_stays_torchs_own_error():
    with pytest.raises(torch.OutOfMemoryError), explained_out_of_memory(config(), "cpu", "train step"):
        raise torch.OutOfMemoryError("host")


@pytest.mark.gpu
def test_a_real_cuda_out_of_memory_becomes_the_config_error_with_the_gpus_figures():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    total = torch.cuda.get_device_properties(0).total_memory
    with pytest.raises(ConfigError) as caught, explained_out_of_memory(config(), "cuda:0", "train step"):
        torch.empty(2**45, dtype=torch.uint8, device="cuda")  # 35 TB
    assert caught.value.field_path == "model.checkpointed_layers"
    assert f"of the GPU's {total / GIB:.1f} GiB" in caught.value.problem
    assert isinstance(caught.value.__cause__, torch.OutOfMemoryError)
