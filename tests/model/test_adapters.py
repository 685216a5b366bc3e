"""The adapter as data in transit: one packed buffer, private copies for an engine, the finiteness check."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from app.model import adapters


def sample_tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "a.lora_A.weight": torch.randn(4, 6, generator=g).to(torch.bfloat16),
        "a.lora_B.weight": torch.randn(5, 4, generator=g).to(torch.bfloat16),
        "b.lora_A.weight": torch.randn(3, 7, generator=g),
        "empty": torch.zeros(0, 4),
    }


def test_pack_round_trips_names_dtypes_shapes_and_bytes():
    tensors = sample_tensors()
    packed = adapters.pack(tensors)
    assert packed.nbytes == sum(t.numel() * t.element_size() for t in tensors.values())
    back = adapters.unpack(packed)
    assert list(back) == list(tensors)
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and back[name].shape == t.shape and torch.equal(back[name], t)


def test_unpack_views_the_buffer_without_copying():
    packed = adapters.pack(sample_tensors())
    view = adapters.unpack(packed)["b.lora_A.weight"]
    packed.buffer[:] = 0
    assert not view.any()


@pytest.mark.parametrize("as_packed", [True, False])
def test_private_copies_equal_the_adapter_and_share_nothing(as_packed):
    tensors = sample_tensors()
    source = adapters.pack(tensors) if as_packed else tensors
    copies = adapters.private_copies(source, "cpu")
    assert all(torch.equal(copies[k], tensors[k]) for k in tensors)
    for t in copies.values():  # an engine scales lora_B in place: that must never reach the source
        t.add_(1) if t.numel() else None
    assert all(torch.equal(adapters.unpack(source)[k], tensors[k]) for k in tensors)


def test_private_copies_convert_dtype():
    copies = adapters.private_copies(adapters.pack(sample_tensors()), "cpu", torch.float32)
    assert {t.dtype for t in copies.values()} == {torch.float32}


def test_check_finite_names_the_bad_tensor():
    tensors = sample_tensors()
    adapters.check_finite(tensors)
    tensors["a.lora_B.weight"][1, 2] = float("inf")
    with pytest.raises(adapters.AdapterMismatch, match="a.lora_B.weight holds NaN or infinite"):
        adapters.check_finite(tensors)


def test_packed_buffer_is_one_numpy_array_for_the_object_store():
    packed = adapters.pack(sample_tensors())
    assert isinstance(packed.buffer, np.ndarray) and packed.buffer.dtype == np.uint8 and packed.buffer.ndim == 1


def test_trainer_lora_tensors_are_copies_on_the_training_device(tiny_model_dir):
    from app.config import load_config
    from app.learning.training import PolicyTrainer

    trainer = PolicyTrainer(load_config(None, ["lora.rank=8", "lora.alpha=16"], check_paths=False), tiny_model_dir)
    on_device = trainer.trained_tensors(on_device=True)
    host = trainer.trained_tensors()
    assert set(on_device) == set(trainer.spec.shapes) == set(host)
    assert all(torch.equal(on_device[k], host[k]) for k in host)
    params = {p.data_ptr() for p in trainer.model.parameters()}
    assert not params & {t.data_ptr() for t in on_device.values()}  # never the live parameters
