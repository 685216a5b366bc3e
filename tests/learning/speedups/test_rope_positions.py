"""The trainer's host-made rotary positions equal the model's own, value for value, and change no logprob."""

import numpy as np
import pytest
import torch

from app.learning import grpo
from app.learning.batch import build_items
from app.learning.sft import demonstration, perception_example
from app.learning.speedups.rope_positions import batch_positions
from app.learning.training import PolicyTrainer
from app.rollout.engines.base import logprobs_of
from app.world.maze import generate_maze
from app.world.rules import EpisodeSettings
from tests.conftest import tiny_config


def _mixed_items(codec):
    """Sequences of every layout a run makes: one-picture questions, windowed episode turns, a whole episode
    with several pictures, and pictures of two sizes (224 px, and 112 px resized to 128 px)."""
    whole = EpisodeSettings(max_turns=6, maze_size=7, cell_px=32, image_history=0)
    windowed = EpisodeSettings(max_turns=6, maze_size=7, cell_px=32, image_history=1, turn_history=1)
    small = EpisodeSettings(max_turns=4, maze_size=7, cell_px=16, image_history=2)
    trajectories = [
        demonstration(generate_maze(1, 7), codec, whole),
        demonstration(generate_maze(2, 7), codec, windowed),
        demonstration(generate_maze(3, 7), codec, small, noise=0.5, seed=3),
        perception_example(generate_maze(4, 7), (1, 1), codec, 32),
        perception_example(generate_maze(5, 7), (3, 3), codec, 16),
    ]
    keep = grpo.AdvantageResult([0.0] * len(trajectories), [True] * len(trajectories), len(trajectories), 0)
    return build_items(trajectories, keep)


@pytest.fixture(scope="module")
def trainer(tiny_model_dir):
    return PolicyTrainer(tiny_config("train.picture_cache_gb=0"), tiny_model_dir)


def test_positions_equal_the_models_get_rope_index(trainer):
    items = _mixed_items(trainer.codec)
    assert len({len(it.images) for it in items}) > 1 and len(items) > 5
    inputs, _, _ = trainer.forward.inputs(items)
    ours = inputs.pop("position_ids")
    theirs, _ = trainer.model.base_model.model.model.get_rope_index(
        inputs["input_ids"],
        inputs["mm_token_type_ids"],
        inputs["image_grid_thw"],
        attention_mask=inputs["attention_mask"],
    )
    assert ours.shape == theirs.shape
    assert torch.equal(ours, theirs)


def test_logprobs_are_those_of_the_models_own_positions(trainer):
    items = _mixed_items(trainer.codec)
    logp, _, mask, wanted = trainer.token_logprobs(items, with_grad=False, temperature=1.0)
    inputs, ids, _ = trainer.forward.inputs(items)
    del inputs["position_ids"]
    with torch.no_grad():
        logits = trainer.model(**inputs, logits_to_keep=wanted, use_cache=False).logits.float()
    targets = torch.where(mask > 0, ids[:, wanted + 1], trainer.codec.pad_id)
    want = logprobs_of(logits, targets, 1.0, trainer.forward.forbidden)
    assert torch.allclose(logp * mask, want * mask, atol=1e-5)


def test_a_placeholder_run_that_does_not_fit_its_picture_is_refused():
    pad = 7
    ids = np.array([1, 2, pad, pad, pad, 3])
    with pytest.raises(ValueError, match="does not fit"):
        batch_positions([ids], 6, pad, [(1, 4, 4)], 2)  # 3 placeholders, but a 2x2-token picture
    with pytest.raises(ValueError, match="more pictures"):
        batch_positions([np.array([1, 2, 3])], 3, pad, [(1, 4, 4)], 2)
