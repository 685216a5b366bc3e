"""app.learning.speedups.lora_forward: the trainer's LoRA layers give PEFT's values and gradients in fewer passes,
and PEFT's own forward runs wherever the fused one does not apply."""

from __future__ import annotations

import copy

import pytest
import torch

from app.config import LoraSettings


@pytest.fixture(scope="module")
def lora_model(tiny_model_dir):
    """The tiny model with a rank-8 LoRA whose B is not zero (a fresh LoRA adds nothing)."""
    from app.model.load import apply_lora, load_model, train_without_dropout

    torch.manual_seed(0)
    model = apply_lora(load_model(tiny_model_dir, "float32", torch.device("cpu")), LoraSettings(rank=8, alpha=16))
    train_without_dropout(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05)
    return model


def ids() -> dict:
    torch.manual_seed(1)
    return {"input_ids": torch.randint(10, 200, (2, 24)), "attention_mask": torch.ones(2, 24, dtype=torch.long)}


def lora_b_calls(model) -> list:
    """Counts calls of the lora_B modules: PEFT's forward calls them, the fused one reads their weight."""
    calls = []
    for name, module in model.named_modules():
        if name.endswith("lora_B.default"):
            module.register_forward_hook(lambda *_: calls.append(1))
    return calls


def logits_and_grads(model, **inputs):
    model.zero_grad(set_to_none=True)
    logits = model(**inputs, use_cache=False).logits
    logits.float().square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


def test_fused_layers_match_pefts_values_and_gradients(lora_model):
    from app.learning.speedups.lora_forward import fuse_lora_layers

    fused = copy.deepcopy(lora_model)
    assert fuse_lora_layers(fused) > 0 and fuse_lora_layers(fused) == 0  # once per layer
    peft_calls, fused_calls = lora_b_calls(lora_model), lora_b_calls(fused)
    want, want_grads = logits_and_grads(lora_model, **ids())
    got, got_grads = logits_and_grads(fused, **ids())
    assert peft_calls and not fused_calls  # the fused path ran in every layer
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert set(got_grads) == set(want_grads) and any("lora_A" in n for n in got_grads)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-4, atol=1e-6)


def test_pefts_forward_runs_with_adapters_disabled_or_a_dropout_on(lora_model):
    from app.learning.speedups.lora_forward import fuse_lora_layers

    fused = copy.deepcopy(lora_model)
    fuse_lora_layers(fused)
    calls = lora_b_calls(fused)
    with torch.no_grad(), fused.disable_adapter(), lora_model.disable_adapter():
        base = lora_model(**ids(), use_cache=False).logits
        torch.testing.assert_close(fused(**ids(), use_cache=False).logits, base)
    assert not calls  # disabled: neither path adds a LoRA
    for module in fused.modules():
        if hasattr(module, "lora_dropout") and "default" in module.lora_dropout:
            module.lora_dropout["default"] = torch.nn.Dropout(0.5)
    with torch.no_grad():
        fused(**ids(), use_cache=False)
    assert calls  # a dropout that drops: PEFT's forward, which applies it


def test_in_bfloat16_under_autocast_the_fused_layers_compute_in_bfloat16(tiny_model_dir):
    """The trainer's case: a bf16 model, float32 LoRA masters, autocast (app/learning/forward.py)."""
    from app.learning.speedups.lora_forward import fuse_lora_layers
    from app.model.load import apply_lora, load_model

    torch.manual_seed(0)
    model = apply_lora(load_model(tiny_model_dir, "bfloat16", torch.device("cpu")), LoraSettings(rank=8, alpha=16))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05)
    fused = copy.deepcopy(model)
    fuse_lora_layers(fused)
    calls = lora_b_calls(fused)
    with torch.no_grad():
        want = model(**ids(), use_cache=False).logits.float()  # PEFT's: float32 LoRA products
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = fused(**ids(), use_cache=False).logits.float()
    assert not calls and {p.dtype for n, p in fused.named_parameters() if "lora_" in n} == {torch.float32}
    assert (got - want).abs().mean() < 0.05 * want.abs().mean()  # bf16 rounding, not another function
    with torch.no_grad():  # float32 weights meeting bf16 input without autocast: PEFT's casting, not an error
        fused(**ids(), use_cache=False)
    assert calls


def test_a_dora_layer_keeps_pefts_forward(tiny_model_dir):
    """DoRA rescales the adapted weight's columns: not base + B A x, so the fused forward must not take it."""
    from peft import LoraConfig, get_peft_model

    from app.learning.speedups.lora_forward import fuse_lora_layers
    from app.model.load import load_model

    torch.manual_seed(0)
    model = get_peft_model(
        load_model(tiny_model_dir, "float32", torch.device("cpu")),
        LoraConfig(r=8, lora_alpha=16, target_modules=r".*language_model.*\.(q_proj|v_proj)", use_dora=True),
    )
    with torch.no_grad():
        want = model(**ids(), use_cache=False).logits
    assert fuse_lora_layers(model) > 0
    calls = lora_b_calls(model)
    with torch.no_grad():
        torch.testing.assert_close(model(**ids(), use_cache=False).logits, want)
    assert calls
