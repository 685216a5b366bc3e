"""app.model.vision_attention: the batched vision attention computes what transformers' per-picture loop computes."""

from __future__ import annotations

import copy

import pytest
import torch

from app.model.load import load_model
from app.model.vision_attention import use_batched_vision_attention
from app.rollout.encoding import as_image
from app.world.maze import generate_maze
from app.world.render import render


@pytest.fixture(scope="module")
def models(tiny_model_dir):
    batched = load_model(tiny_model_dir)
    looping = copy.deepcopy(batched)
    for module in looping.modules():  # back to the library's own forward
        module.__dict__.pop("forward", None)
    return batched, looping


def pictures(codec, sizes):
    images = []
    for i, size in enumerate(sizes):
        maze = generate_maze(i, size)
        images.append(as_image(render(maze, maze.start, 32)))
    return codec.vision_inputs(images)


@pytest.mark.parametrize("sizes", [(7, 7, 7), (7, 9, 7)])
def test_batched_attention_matches_the_per_picture_loop_values_and_gradients(models, codec, sizes):
    batched, looping = models
    inputs = pictures(codec, sizes)
    outputs, grads = [], []
    for model in (batched, looping):
        model.zero_grad()
        pixels = inputs["pixel_values"].clone().requires_grad_(True)
        out = model.model.visual(pixels, grid_thw=inputs["image_grid_thw"])
        hidden = out.pooler_output if hasattr(out, "pooler_output") else out[0]
        hidden = torch.cat(hidden) if isinstance(hidden, (list, tuple)) else hidden
        (hidden.square().sum()).backward()
        outputs.append(hidden.detach())
        grads.append(model.model.visual.blocks[0].attn.qkv.weight.grad.clone())
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-3, atol=1e-4)


def test_every_vision_attention_module_is_routed(tiny_model_dir):
    model = load_model(tiny_model_dir)
    depth = model.config.vision_config.depth
    attention = [m for m in model.model.visual.modules() if type(m).__name__ == "Qwen3VLVisionAttention"]
    assert len(attention) == depth and all("forward" in m.__dict__ for m in attention)
    assert use_batched_vision_attention(model) == depth  # idempotent
