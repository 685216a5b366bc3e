"""The trainer's cache of processed pictures gives exactly what the image processor gives, and stays bounded."""

import torch

from app.learning.speedups.picture_cache import PictureCache
from app.model.load import load_processor
from app.rollout.encoding import ChatCodec, image_to_png, png_to_image
from app.world.maze import generate_maze
from app.world.render import render_image


def _pngs(n: int) -> list[bytes]:
    maze = generate_maze(3, 7)
    cells = [(r, c) for r in range(7) for c in range(7) if maze.is_open((r, c))][:n]
    return [image_to_png(render_image(maze, cell, 32)) for cell in cells]


def test_cached_inputs_equal_the_processors_and_repeats_hit(tiny_model_dir):
    codec = ChatCodec(load_processor(tiny_model_dir))
    cache = PictureCache(codec, torch.device("cpu"), torch.float32, max_bytes=2**30)
    pngs = _pngs(4)
    batch = [pngs[0], pngs[1], pngs[0], pngs[2], pngs[3], pngs[1]]
    want = codec.vision_inputs([png_to_image(p) for p in batch])
    got = cache.vision_inputs(batch)
    assert torch.equal(got["pixel_values"], want["pixel_values"])
    assert torch.equal(got["image_grid_thw"], want["image_grid_thw"])
    assert (cache.misses, cache.hits) == (4, 2)
    again = cache.vision_inputs(list(reversed(batch)))
    assert torch.equal(
        again["pixel_values"], codec.vision_inputs([png_to_image(p) for p in reversed(batch)])["pixel_values"]
    )
    assert (cache.misses, cache.hits) == (4, 8)


def test_cache_evicts_least_recent_pictures_beyond_its_budget(tiny_model_dir):
    codec = ChatCodec(load_processor(tiny_model_dir))
    pngs = _pngs(5)
    one = codec.vision_inputs([png_to_image(pngs[0])])["pixel_values"]
    per_picture = one.numel() * one.element_size()
    cache = PictureCache(codec, torch.device("cpu"), torch.float32, max_bytes=2 * per_picture)
    for png in pngs:
        cache.vision_inputs([png])
    assert cache.bytes <= 2 * per_picture and len(cache._entries) == 2
    cache.vision_inputs([pngs[4]])  # the newest is still there
    assert cache.hits == 1
    cache.vision_inputs([pngs[0]])  # the oldest was evicted
    assert cache.misses == 6
    big = cache.vision_inputs(pngs)  # one batch larger than the budget is still served whole
    assert big["image_grid_thw"].shape[0] == 5
