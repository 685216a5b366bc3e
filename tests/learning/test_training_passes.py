"""`PolicyTrainer.train_step` with several passes over a batch: what its metrics say about how far the update moved.

In the first pass the PPO ratio is 1 by construction, so the clip fraction and the policy's drift are measured
in the last pass; read from the first, they say 0 on every step whatever the update did.
"""

from __future__ import annotations

import dataclasses

import pytest

from tests.conftest import tiny_config


@pytest.fixture(scope="module")
def batch(tiny_model_dir, tiny_lora, codec):
    """Two groups of four sampled episodes, rewarded 1 and 0 alternately so that every group carries signal, played by
    the base model (its own engine: the session's may hold an adapter another module loaded)."""
    from app.rollout.engines.base import Sampling
    from app.rollout.engines.hf import HFEngine
    from app.rollout.episodes import EpisodeRequest, play_episodes
    from app.world.maze import generate_maze
    from app.world.rules import EpisodeSettings

    requests = [EpisodeRequest(generate_maze(group, 7), group, s) for group in range(2) for s in range(4)]
    settings = EpisodeSettings(max_turns=2, maze_size=7, cell_px=32, image_history=0, max_model_len=4096)
    trajectories = play_episodes(
        HFEngine(tiny_model_dir, tiny_lora), codec, requests, settings, Sampling(8, 1.0, seed=3)
    )
    return [dataclasses.replace(t, reward=float(t.sample % 2)) for t in trajectories]


def train_once(tiny_model_dir, batch, *overrides):
    from app.learning.training import PolicyTrainer

    trainer = PolicyTrainer(tiny_config("train.micro_batch=8", *overrides), tiny_model_dir)
    return trainer.train_step(batch)


def test_one_pass_neither_clips_nor_reports_drift(tiny_model_dir, batch):
    metrics = train_once(tiny_model_dir, batch, "train.update_epochs=1", "train.lr=0.05")
    assert metrics["clip_fraction"] == 0.0 and metrics["update_kl"] == 0.0
    assert metrics["zero_variance_groups"] == 0 and metrics["grad_norm"] > 0


def test_later_passes_report_the_drift_and_the_clipped_share_of_the_last_pass(tiny_model_dir, batch):
    gentle = train_once(tiny_model_dir, batch, "train.update_epochs=2", "train.lr=1e-5")
    bold = train_once(tiny_model_dir, batch, "train.update_epochs=3", "train.lr=0.05")
    assert 0.0 < gentle["update_kl"] < bold["update_kl"]
    assert bold["clip_fraction"] > 0.0
    assert gentle["clip_fraction"] <= bold["clip_fraction"]
    # the first pass's figures stay on-policy: the entropy of the batch as sampled
    assert gentle["entropy"] == pytest.approx(bold["entropy"], rel=1e-4)


def test_the_learning_rate_schedule_counts_training_steps_not_passes(tiny_model_dir, batch):
    """Warm-up over 4 training steps at two passes a step: 1/4, 2/4, 3/4 of the rate, then all of it. Stepped once
    a pass, the schedule had reached the full rate at the second step (the tenth GPU attempt's warm-up)."""
    from app.learning.training import PolicyTrainer

    trainer = PolicyTrainer(
        tiny_config("train.micro_batch=8", "train.update_epochs=2", "train.lr=1e-3", "train.warmup_steps=4"),
        tiny_model_dir,
    )
    rates = [trainer.train_step(batch)["lr"] for _ in range(5)]
    assert rates == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3])


def test_max_update_kl_bounds_how_far_a_step_moves_the_policy(tiny_model_dir, batch):
    """A bold step (lr 0.05, three passes), measured unbounded, then bounded at a tenth of that move: the
    bounded step fits, keeps a halved share of its last optimizer step, and skips the passes after it."""
    free = train_once(tiny_model_dir, batch, "train.update_epochs=3", "train.lr=0.05", "train.max_update_kl=1e9")
    assert (free["update_scale"], free["update_halvings"], free["passes_done"]) == (1.0, 0, 3)
    assert free["step_kl"] > 0.0
    cap = free["step_kl"] / 10
    bounded = train_once(tiny_model_dir, batch, "train.update_epochs=3", "train.lr=0.05", f"train.max_update_kl={cap}")
    assert 0.0 < bounded["step_kl"] <= cap
    assert 0.0 < bounded["update_scale"] < 1.0 and bounded["update_halvings"] >= 1
    assert bounded["passes_done"] < 3


def test_max_update_kl_with_one_pass_measures_against_the_rollout_time_policy(tiny_model_dir, batch):
    """One pass has no pre-update logprobs computed apart; the bound takes them from the pass itself."""
    loose = train_once(tiny_model_dir, batch, "train.update_epochs=1", "train.lr=0.05", "train.max_update_kl=1e9")
    assert loose["step_kl"] > 0.0 and loose["update_scale"] == 1.0
    tight = train_once(
        tiny_model_dir, batch, "train.update_epochs=1", "train.lr=0.05", f"train.max_update_kl={loose['step_kl'] / 3}"
    )
    assert 0.0 <= tight["step_kl"] <= loose["step_kl"] / 3 and tight["update_scale"] < 1.0


def test_max_update_kl_must_not_be_negative():
    from app.config import ConfigError

    with pytest.raises(ConfigError, match="max_update_kl"):
        tiny_config("train.max_update_kl=-0.1")


def test_entropy_bonus_keeps_the_policy_more_spread_than_the_same_step_without_it(tiny_model_dir, batch):
    """Two steps on the same batch: the second step's first pass measures the entropy the first step left."""
    from app.learning.training import PolicyTrainer

    def entropy_after_one_step(coef: str) -> tuple[float, float]:
        trainer = PolicyTrainer(
            tiny_config("train.micro_batch=8", "train.lr=0.02", f"train.entropy_coef={coef}"), tiny_model_dir
        )
        first = trainer.train_step(batch)
        return first["entropy"], trainer.train_step(batch)["entropy"]

    before, plain = entropy_after_one_step("0")
    same_start, bonus = entropy_after_one_step("2.0")
    assert same_start == pytest.approx(before, rel=1e-5)  # both start from the same policy
    assert bonus > plain  # the same step, the same batch: with the bonus the policy stays more spread


def test_a_batch_played_by_another_policy_trains_weighted_by_its_truncated_ratio(tiny_model_dir, batch):
    """train.rollout_ratio_cap: each trained token's loss times min(pi_before / pi_played, cap). Played by these very
    weights, the ratio is 1 and the step is the plain one; played by a policy 4x less likely to pick each sampled
    token (as an older adapter may be), the weight is the cap, 2, and the first pass's gradient doubles."""
    import math

    import numpy as np

    def played_by_another(t):
        shifted = [
            dataclasses.replace(s, rollout_logprobs=(s.rollout_logprobs - math.log(4) * s.loss_mask).astype(np.float32))
            for s in t.sequences
        ]
        return dataclasses.replace(t, sequences=shifted)

    plain = train_once(tiny_model_dir, batch, "train.lr=1e-6")
    same = train_once(tiny_model_dir, batch, "train.lr=1e-6", "train.rollout_ratio_cap=2")
    other = train_once(
        tiny_model_dir, [played_by_another(t) for t in batch], "train.lr=1e-6", "train.rollout_ratio_cap=2"
    )
    assert plain["rollout_ratio_weight"] == 1.0 and same["rollout_ratio_weight"] == pytest.approx(1.0, abs=1e-3)
    assert same["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-3)
    assert other["rollout_ratio_weight"] == pytest.approx(2.0)
    assert other["grad_norm"] == pytest.approx(2 * plain["grad_norm"], rel=1e-3)


def test_entropy_coef_must_not_be_negative():
    from app.config import ConfigError

    with pytest.raises(ConfigError, match="train.entropy_coef"):
        tiny_config("train.entropy_coef=-0.1")


def test_a_single_rank_trainer_ignores_a_process_group_it_did_not_make(tiny_model_dir, batch, tmp_path):
    """An in-process vLLM engine initialises torch.distributed in its process; a one-rank trainer built beside it
    must neither shard with FSDP2 nor all-reduce over that group (it failed once the engine's group was gone)."""
    import torch.distributed as dist

    from app.learning.training import PolicyTrainer

    made = not dist.is_initialized()
    if made:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/group", rank=0, world_size=1)
    try:
        trainer = PolicyTrainer(tiny_config(), tiny_model_dir)
        assert not trainer.distributed
    finally:
        if made:
            dist.destroy_process_group()
    assert trainer.train_step(batch)["trained_tokens"] > 0  # no group needed, whatever the process holds


def test_a_bfloat16_model_computes_its_lora_in_bfloat16_from_float32_master_weights(tiny_model_dir, batch):
    """PEFT casts a LoRA layer's input to its weights' float32 by default: float32 products and a float32 copy of
    every layer's activations beside the bfloat16 model (a third of the device time of an 8B step on the H200).
    The trainer computes them in the model's dtype, as FSDP2's mixed precision and the engines do."""
    import torch

    from app.learning.training import PolicyTrainer

    trainer = PolicyTrainer(tiny_config("train.micro_batch=8", "model.dtype=bfloat16", "train.lr=1e-3"), tiny_model_dir)
    seen = []
    for name, module in trainer.model.named_modules():
        if name.endswith("lora_A.default"):
            module.register_forward_hook(lambda _, args, out: seen.append((args[0].dtype, out.dtype)))
    before = {id(p): p.detach().clone() for p in trainer.params}
    metrics = trainer.train_step(batch)
    assert seen and set(seen) == {(torch.bfloat16, torch.bfloat16)}
    assert {p.dtype for p in trainer.params} == {torch.float32}  # the masters: Adam steps below bf16's resolution
    assert metrics["grad_norm"] > 0 and any(not torch.equal(before[id(p)], p) for p in trainer.params)


def test_compiled_layers_train_the_same_step_as_eager_ones(tiny_model_dir, batch):
    """model.compile_layers: the decoder layers compiled by torch.compile give the eager step's loss, gradient norm
    and updated LoRA (up to the fused kernels' rounding)."""
    from app.learning.training import PolicyTrainer

    def trained(*overrides):
        cfg = tiny_config("train.micro_batch=8", "train.lr=1e-3", "placement.num_bundles=1", *overrides)
        trainer = PolicyTrainer(cfg, tiny_model_dir)
        return trainer, trainer.train_step(batch), trainer.trained_tensors()

    _, eager, eager_lora = trained()
    compiled_trainer, compiled, compiled_lora = trained("model.compile_layers=true")
    layers = compiled_trainer.model.base_model.model.model.language_model.layers
    assert all(layer._compiled_call_impl is not None for layer in layers)
    assert compiled["loss"] == pytest.approx(eager["loss"], rel=1e-4, abs=1e-6)
    assert compiled["grad_norm"] == pytest.approx(eager["grad_norm"], rel=1e-3)
    for name, value in eager_lora.items():  # Adam's first step is lr x sign(g): a near-zero gradient may flip
        assert ((compiled_lora[name] - value).abs() > 1e-6).float().mean() < 0.01, name


@pytest.mark.parametrize("trains", ["[]", "[visual,language_model]"], ids=["lora", "every_weight"])
def test_compiled_layers_in_bf16_score_the_engines_tokens_as_the_eager_trainer(
    tiny_model_dir, tiny_lora, codec, trains
):
    """In bf16 the compiled layers round as eager ones do (inductor's `emulate_precision_casts`): without it their
    fused kernels kept intermediates in float32, and the mismatch against a bf16 engine's log-probabilities was 4.4
    times the eager trainer's (4.4e-3 against 1.0e-3 on these episodes). Every weight trained: the compiled layers
    hold parametrized weights (bf16 copies of float32 masters)."""
    from app.learning.training import PolicyTrainer
    from app.rollout.engines.base import Sampling
    from app.rollout.engines.hf import HFEngine
    from app.rollout.episodes import EpisodeRequest, play_episodes
    from app.world.maze import generate_maze
    from app.world.rules import EpisodeSettings

    engine = HFEngine(tiny_model_dir, tiny_lora, dtype="bfloat16")
    requests = [EpisodeRequest(generate_maze(group, 7), group, s) for group in range(2) for s in range(4)]
    settings = EpisodeSettings(max_turns=2, maze_size=7, cell_px=32, image_history=0, max_model_len=4096)
    played = play_episodes(engine, codec, requests, settings, Sampling(8, 1.0, seed=3))
    played = [dataclasses.replace(t, reward=float(t.sample % 2)) for t in played]

    def mismatch(*overrides):
        cfg = tiny_config(
            "train.micro_batch=8",
            "placement.num_bundles=1",
            "model.dtype=bfloat16",
            f"lora.modules_to_save={trains}",
            *overrides,
        )
        return PolicyTrainer(cfg, tiny_model_dir).train_step(played)["logprob_mismatch_mean"]

    eager, compiled = mismatch(), mismatch("model.compile_layers=true")
    assert 0 < eager < 0.01
    assert compiled <= 1.2 * eager, (compiled, eager)
