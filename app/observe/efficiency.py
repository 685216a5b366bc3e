"""How far each phase of a step is from what the hardware could do: FLOP-based utilisation and the phase's floor.

The work a phase must do, counted as matrix FLOPs: the rollout processes every context token once (prefix caching
keeps a turn from recomputing the turns before it) at 2·N for the language model, and every picture's patches at
2·N_vision for the vision tower; the train phase runs a forward and a backward over every forward token: 4·N a
token (the backward's activation gradients; LoRA's own weight gradients are negligible), 6·N with gradient
checkpointing (the forward again in the backward), 4·N + 2·N·s where only a share s of the layers is checkpointed.
N counts the language model's matmul weights (its layers and the output head, not the embedding table). Divided
by the phase's time and the GPUs' peak (metrics.peak_tflops, or the GPU's known bf16 dense peak), it is the phase's
MFU; the work divided by the peak is the phase's floor, the time it could take at best. On a CPU there is no
peak: the FLOPs are reported, the utilisation not.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AutoConfig, Qwen3VLForConditionalGeneration

# bf16 dense tensor-core peaks, TFLOP/s a GPU, by a word of the device's name (NVIDIA's data sheets).
PEAK_TFLOPS = {
    "H200": 989.0,
    "H100": 989.0,
    "GH200": 989.0,
    "B200": 2250.0,
    "A100": 312.0,
    "L40S": 362.0,
    "A10G": 70.0,
    "L4": 121.0,
}


def peak_tflops(device_name: str, configured: float = 0.0) -> float:
    """The GPU's peak: the configured one, else the known one for its name, else 0 (unknown: no utilisation)."""
    if configured > 0:
        return configured
    return next((peak for word, peak in PEAK_TFLOPS.items() if word in device_name.split()), 0.0)


@dataclass(frozen=True)
class ModelFlops:
    text_params: int  # the language model's matmul weights: layers and output head, not the embedding table
    vision_params: int
    patches_per_image: int

    @classmethod
    def for_model(cls, model_dir: str, patches_per_image: int) -> ModelFlops:
        """Counted on the meta device from the model's config: no weights are read."""
        config = AutoConfig.from_pretrained(model_dir)
        with torch.device("meta"):
            model = Qwen3VLForConditionalGeneration._from_config(config)
        vision = sum(p.numel() for p in model.model.visual.parameters())
        embedding = model.model.language_model.embed_tokens.weight.numel()
        head = 0 if config.tie_word_embeddings else model.lm_head.weight.numel()
        text = sum(p.numel() for p in model.model.language_model.parameters()) - embedding + head
        if config.tie_word_embeddings:
            text += embedding  # a tied head still multiplies every position by the vocabulary matrix
        return cls(text, vision, patches_per_image)

    def rollout(self, context_tokens: float, images: float) -> float:
        return 2.0 * self.text_params * context_tokens + 2.0 * self.vision_params * self.patches_per_image * images

    def train(self, forward_tokens: float, recomputed: float) -> float:
        """recomputed: the share of the layers whose forward the backward pass computes again (checkpointing)."""
        return (4.0 + 2.0 * float(recomputed)) * self.text_params * forward_tokens


def phase_efficiency(phase: str, flops: float, seconds: float, gpus: float, peak: float) -> dict:
    """{phase}_tflop, and with a peak: {phase}_mfu (share of the peak reached) and {phase}_floor_s (its best time)."""
    out = {f"{phase}_tflop": flops / 1e12}
    if peak > 0 and gpus > 0:
        capacity = peak * 1e12 * gpus
        out[f"{phase}_floor_s"] = flops / capacity
        out[f"{phase}_mfu"] = flops / capacity / max(seconds, 1e-9)
    return out


def step_efficiency(metrics: dict, flops: ModelFlops, gpus: float, peak: float, recomputed: float) -> dict:
    """A step's efficiency metrics from its own metrics (rollout context tokens and pictures, train tokens)."""
    out = {}
    if "rollout_context_tokens" in metrics:
        work = flops.rollout(metrics["rollout_context_tokens"], metrics.get("rollout_images", 0.0))
        out.update(phase_efficiency("rollout", work, metrics.get("time_rollout_s", 0.0), gpus, peak))
    if "train_forward_tokens" in metrics:
        work = flops.train(metrics["train_forward_tokens"], recomputed)
        out.update(phase_efficiency("train", work, metrics.get("time_train_s", 0.0), gpus, peak))
    return out
