"""The trainer's vision cache: the frozen tower runs once per distinct picture, and no logprob or gradient changes."""

import pytest
import torch

from tests.conftest import tiny_config
from tests.learning.speedups.test_rope_positions import _mixed_items


@pytest.fixture(scope="module")
def trainers(tiny_model_dir):
    from app.learning.training import PolicyTrainer

    plain = PolicyTrainer(tiny_config("train.picture_cache_gb=0", "train.vision_cache_gb=0"), tiny_model_dir)
    cached = PolicyTrainer(tiny_config("train.picture_cache_gb=0.1", "train.vision_cache_gb=0.1"), tiny_model_dir)
    return plain, cached


def _repeated_items(codec):
    items = _mixed_items(codec)
    return items + items[:3]  # pictures seen again in the same batch, as a group's runs see them


def test_cached_logprobs_and_gradients_equal_the_recomputed_ones(trainers):
    plain, cached = trainers
    assert plain.vision_cache is None and cached.vision_cache is not None
    items = _repeated_items(cached.codec)
    pictures = [png for it in items for png in it.images]
    distinct = len(set(pictures))
    assert distinct < len(pictures)
    grads = []
    for trainer in (plain, cached):
        trainer.model.zero_grad()
        logp, _, mask, _ = trainer.token_logprobs(items, with_grad=True, temperature=1.0)
        (logp * mask).sum().backward()
        grads.append([p.grad.clone() for p in trainer.params])
        if trainer is plain:
            want = logp.detach()
    assert cached.vision_cache.misses == distinct and cached.vision_cache.hits == len(pictures) - distinct
    assert torch.allclose(logp.detach(), want, atol=1e-5)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(*grads))
    # a second forward over the same batch (the next epoch, the trust region's measuring pass) runs no tower
    before = cached.vision_cache.misses
    again, _, _, _ = cached.token_logprobs(items, with_grad=False, temperature=1.0)
    assert cached.vision_cache.misses == before
    assert torch.allclose(again, want, atol=1e-5)


def test_the_cache_steps_aside_while_the_vision_tower_trains(trainers):
    _, cached = trainers
    visual = cached.model.base_model.model.model.visual
    items = _mixed_items(cached.codec)[:2]
    hits, misses = cached.vision_cache.hits, cached.vision_cache.misses
    try:
        for p in visual.parameters():
            p.requires_grad_(True)
        cached.token_logprobs(items, with_grad=True, temperature=1.0)
    finally:
        for p in visual.parameters():
            p.requires_grad_(False)
    assert (cached.vision_cache.hits, cached.vision_cache.misses) == (hits, misses)


def test_the_cache_stays_in_its_budget_but_keeps_what_the_batch_uses(tiny_model_dir):
    from app.learning.training import PolicyTrainer

    trainer = PolicyTrainer(tiny_config("train.vision_cache_gb=0.0000001"), tiny_model_dir)  # ~107 bytes
    items = _mixed_items(trainer.codec)
    first, second = items[:2], items[3:]
    trainer.token_logprobs(first, with_grad=False, temperature=1.0)
    in_use = len({png for it in first for png in it.images})
    assert len(trainer.vision_cache._entries) == in_use  # over budget, but all in use by the batch
    trainer.token_logprobs(second, with_grad=False, temperature=1.0)
    assert len(trainer.vision_cache._entries) == len({png for it in second for png in it.images})


class _OlderTransformersModel(torch.nn.Module):
    """get_image_features as transformers 5.17 (the GPU image) returns it: the pooled embeddings split per picture,
    the deepstack features one concatenated tensor per layer, which its forward reads as they are."""

    def __init__(self):
        super().__init__()
        self.visual = torch.nn.Linear(2, 2)
        self.visual.spatial_merge_size = 2
        self.visual.requires_grad_(False)
        self.calls = 0

    def get_image_features(self, pixel_values, image_grid_thw=None, **kwargs):
        from types import SimpleNamespace

        self.calls += 1
        merged = pixel_values.reshape(-1, 4, pixel_values.shape[-1]).sum(1)  # 4 patches merge into one token
        sizes = (image_grid_thw.prod(-1) // 4).tolist()
        return SimpleNamespace(pooler_output=torch.split(merged, sizes), deepstack_features=[merged * 2, merged * 3])


def test_the_cache_serves_the_output_shapes_of_the_transformers_it_runs_under():
    from app.learning.speedups.vision_cache import VisionCache

    model = _OlderTransformersModel()
    compute = model.get_image_features
    cache = VisionCache(model, 1 << 20)
    grids = torch.tensor([[1, 2, 2], [1, 4, 2], [1, 2, 2]])  # pictures of 1, 2 and 1 tokens; the first and last equal
    a, b = torch.randn(4, 3), torch.randn(8, 3)
    pixels = torch.cat([a, b, a])
    want = compute(pixels, grids)
    with cache.serving([b"a", b"b", b"a"]):
        got = model.get_image_features(pixels, grids)
        assert cache.misses == 2 and cache.hits == 1
        again = model.get_image_features(pixels, grids)  # all from the cache now
    assert model.calls == 2 and cache.hits == 4  # the direct call, then one tower run for the two distinct pictures
    for out in (got, again):
        assert isinstance(out.pooler_output, tuple) and len(out.pooler_output) == 3
        assert all(torch.allclose(x, y) for x, y in zip(out.pooler_output, want.pooler_output))
        assert all(torch.is_tensor(f) for f in out.deepstack_features)  # concatenated, as this version's forward wants
        assert all(torch.allclose(x, y) for x, y in zip(out.deepstack_features, want.deepstack_features))
