"""Each phase's FLOPs, utilisation and floor (app.observe.efficiency): counted from the model's own shapes."""

from __future__ import annotations

import pytest

from app.observe.efficiency import ModelFlops, peak_tflops, phase_efficiency, step_efficiency
from app.observe.metrics import MetricsSink


def test_parameters_are_counted_from_the_config_without_weights(tiny_model_dir):
    from app.model.load import load_model

    flops = ModelFlops.for_model(tiny_model_dir, patches_per_image=16)
    model = load_model(tiny_model_dir)
    language = model.model.language_model
    vocab = language.embed_tokens.weight.numel()
    assert flops.vision_params == sum(p.numel() for p in model.model.visual.parameters())
    # every matmul weight the language model applies: its layers, and the head (tied or not) once
    assert flops.text_params == sum(p.numel() for p in language.parameters()) - vocab + model.lm_head.weight.numel()


def test_the_work_of_a_phase():
    flops = ModelFlops(text_params=1_000, vision_params=100, patches_per_image=16)
    assert flops.rollout(context_tokens=50, images=3) == 2 * 1_000 * 50 + 2 * 100 * 16 * 3
    assert flops.train(forward_tokens=50, recomputed=0.0) == 4 * 1_000 * 50
    assert flops.train(forward_tokens=50, recomputed=1.0) == 6 * 1_000 * 50
    assert flops.train(forward_tokens=50, recomputed=0.25) == 4.5 * 1_000 * 50  # a quarter of the layers again


def test_the_share_recomputed_follows_the_model_config():
    from app.config.schema import ModelConfig

    assert ModelConfig().recomputed_share == 0.0  # no checkpointing: nothing recomputed, whatever the share says
    assert ModelConfig(gradient_checkpointing=True).recomputed_share == 1.0
    assert ModelConfig(gradient_checkpointing=True, checkpointed_layers=0.5).recomputed_share == 0.5


def test_utilisation_and_floor_need_a_peak():
    on_gpu = phase_efficiency("train", flops=989e12, seconds=4.0, gpus=2, peak=989)
    assert on_gpu == pytest.approx({"train_tflop": 989.0, "train_floor_s": 0.5, "train_mfu": 0.125})
    assert phase_efficiency("train", 1e12, 4.0, gpus=0, peak=989) == {"train_tflop": 1.0}  # a CPU: no utilisation
    assert peak_tflops("NVIDIA H200") == 989.0 and peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert peak_tflops("cpu") == 0.0 and peak_tflops("Some GPU") == 0.0 and peak_tflops("NVIDIA H200", 500) == 500


def test_a_step_reports_both_phases_and_the_console_shows_them(tmp_path, capsys):
    flops = ModelFlops(text_params=8e9, vision_params=6e8, patches_per_image=100)
    metrics = {
        "rollout_context_tokens": 150_000,
        "rollout_images": 900,
        "time_rollout_s": 10.0,
        "train_forward_tokens": 120_000,
        "time_train_s": 15.0,
    }
    out = step_efficiency(metrics, flops, gpus=1, peak=989, recomputed=1.0)
    assert out["train_mfu"] == pytest.approx(6 * 8e9 * 120_000 / 989e12 / 15.0)
    assert out["rollout_floor_s"] == pytest.approx((2 * 8e9 * 150_000 + 2 * 6e8 * 100 * 900) / 989e12)
    sink = MetricsSink(tmp_path, "run", 10, prometheus=False, progress_bar=False)
    sink.record(
        1,
        {
            "rollout_solve_rate": 0.5,
            "time_rollout_s": 10.0,
            "time_train_s": 15.0,
            "time_step_s": 25.0,
            **metrics,
            **out,
        },
    )
    line = capsys.readouterr().out
    assert f"MFU rollout {100 * out['rollout_mfu']:.0f}% train {100 * out['train_mfu']:.0f}%" in line
