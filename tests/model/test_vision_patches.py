"""app.model.vision_patches: the patch embedding as a matrix product computes what transformers' Conv3d computes,
and the loaded models never run a Conv3d (7-80x slower on a CPU, and the backward of a trained tower's conv was
73% of a bf16 training step)."""

from __future__ import annotations

import copy
import time

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionPatchEmbed

from app.model.load import load_model
from app.model.vision_patches import use_linear_patch_embed
from app.rollout.encoding import as_image
from app.world.maze import generate_maze
from app.world.render import render


def pixels(codec, count=3, size=7):
    images = [as_image(render(generate_maze(i, size), generate_maze(i, size).start, 32)) for i in range(count)]
    return codec.vision_inputs(images)


def tower_output(model, inputs) -> torch.Tensor:
    out = model.model.visual(inputs["pixel_values"], grid_thw=inputs["image_grid_thw"])
    hidden = out.pooler_output if hasattr(out, "pooler_output") else out[0]
    return torch.cat(hidden) if isinstance(hidden, (list, tuple)) else hidden


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_product_computes_the_convolution_values_and_gradients(tiny_model_dir, codec, dtype):
    """Against the float64 truth of the same weights and pixels: in float32 both agree to rounding; in bfloat16 the
    product is as close as the Conv3d or closer (a product accumulates in float32, the CPU's bf16 conv does not)."""
    model = load_model(tiny_model_dir, dtype)
    embed = model.model.visual.patch_embed
    library = copy.deepcopy(embed)
    library.__dict__.pop("forward")  # back to transformers' Conv3d
    truth = copy.deepcopy(library).double()
    x = pixels(codec)["pixel_values"]
    results = []
    for module in (embed, library, truth):
        module.zero_grad()
        out = module(x.to(module.proj.weight.dtype))
        out.double().square().sum().backward()
        results.append((out.detach().double(), module.proj.weight.grad.double(), module.proj.bias.grad.double()))
    assert results[0][0].shape == (x.shape[0], model.config.vision_config.hidden_size)
    for got, conv, true in zip(results[0], results[1], results[2]):
        scale = true.abs().max()
        if dtype == "float32":
            torch.testing.assert_close(got / scale, true / scale, rtol=0, atol=1e-5)
        else:
            assert (got - true).abs().max() <= (conv - true).abs().max() * 1.05 + 1e-3 * scale


def test_a_loaded_model_sees_its_pictures_without_a_convolution(tiny_model_dir, codec, monkeypatch):
    model = load_model(tiny_model_dir)
    inputs = pixels(codec)
    with torch.no_grad():
        library = copy.deepcopy(model)
        library.model.visual.patch_embed.__dict__.pop("forward")
        expected = tower_output(library, inputs)

    def no_conv(*args, **kwargs):
        raise AssertionError("the patch embedding ran a Conv3d")

    monkeypatch.setattr(F, "conv3d", no_conv)
    monkeypatch.setattr(torch.nn.Conv3d, "forward", no_conv)
    with torch.no_grad():
        seen = tower_output(model, inputs)
    torch.testing.assert_close(seen, expected, rtol=1e-4, atol=1e-5)
    # the parameter stays the Conv3d's: the same names and shapes in checkpoints and adapters
    weight = dict(model.named_parameters())["model.visual.patch_embed.proj.weight"]
    assert weight.dim() == 5 and isinstance(model.model.visual.patch_embed.proj, torch.nn.Conv3d)
    assert use_linear_patch_embed(model) == 1  # idempotent, one patch embedding


def test_a_convolution_that_is_not_a_per_patch_product_is_left_alone():
    class Config:
        patch_size, temporal_patch_size, in_channels, hidden_size = 4, 2, 3, 8

    embed = Qwen3VLVisionPatchEmbed(Config())
    embed.proj = torch.nn.Conv3d(3, 8, kernel_size=(2, 4, 4), stride=(2, 2, 2))  # overlapping windows
    holder = torch.nn.Sequential(embed)
    assert use_linear_patch_embed(holder) == 0 and "forward" not in embed.__dict__


def test_the_bf16_backward_is_not_the_convolutions(tiny_model_dir, codec):
    """The defect this module fixes, measured side by side: a bf16 forward and backward of the tower's patch
    embedding, the product against the Conv3d (80x on a 2-core CPU without bf16 instructions, 3.5x on one with
    AVX512-BF16, whose oneDNN convolution is fast: 2x asked, where the Conv3d itself would measure 1x)."""
    embed = load_model(tiny_model_dir, "bfloat16").model.visual.patch_embed
    library = copy.deepcopy(embed)
    library.__dict__.pop("forward")
    x = pixels(codec, count=8)["pixel_values"]

    def timed(module):
        best = float("inf")
        for _ in range(3):
            module.zero_grad()
            start = time.perf_counter()
            module(x).float().square().sum().backward()
            best = min(best, time.perf_counter() - start)
        return best

    assert timed(embed) * 2 < timed(library)
