"""Every knob of a mazerl run, as typed dataclasses: one line of doc and the allowed range per field."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from app.config.knobs import knob
from app.config.rollout import RolloutConfig
from app.config.waits import WaitConfig

LANGUAGE_MODEL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class TinyModelShape:
    hidden_size: int = knob(128, "text hidden size", ge=32)
    intermediate_size: int = knob(256, "text MLP size", ge=32)
    num_layers: int = knob(2, "text decoder layers", ge=1)
    num_heads: int = knob(4, "attention heads", ge=1)
    num_kv_heads: int = knob(2, "key/value heads (must divide num_heads)", ge=1)
    head_dim: int = knob(32, "per-head size; vLLM's CPU attention needs 32, 64, 80, 96, 112 or 128", ge=8)
    vision_depth: int = knob(2, "vision tower blocks", ge=1)
    vision_hidden_size: int = knob(64, "vision tower width", ge=16)
    vision_heads: int = knob(2, "vision tower attention heads", ge=1)
    vocab_size: int = knob(1024, "BPE vocabulary trained locally, before the special tokens", ge=300)
    rope_theta: float = knob(
        5_000_000.0,
        "text RoPE base; Qwen's 5e6 leaves a small model ~1 frequency that tells "
        "neighbouring picture cells apart, 1e4 leaves several",
        gt=1.0,
    )
    seed: int = knob(0, "seed of the random weights and of the tokenizer corpus")


@dataclass
class ModelConfig:
    path: str = knob("tiny", "local folder of a Qwen3-VL model in HF format, or 'tiny' to build one here")
    tiny: TinyModelShape = knob(TinyModelShape(), "shape of the model built when path is 'tiny'")
    adapter_init: str | None = knob(None, "PEFT adapter folder to start the policy from (the SFT warm start)")
    dtype: Literal["float32", "bfloat16"] = knob("float32", "weights and compute dtype")
    gradient_checkpointing: bool = knob(False, "recompute activations in the backward pass to save memory")
    checkpointed_layers: float = knob(
        1.0,
        "with gradient_checkpointing, the share of decoder layers recomputed in the backward pass; the others keep "
        "their activations (a faster step for more memory)",
        ge=0.0,
        le=1.0,
    )
    compile_layers: bool = knob(
        False, "the trainer's decoder layers compiled by torch.compile: fused elementwise kernels, ~1 min at start"
    )

    @property
    def recomputed_share(self) -> float:
        """The share of the decoder layers whose forward the backward pass computes again (0 without checkpointing)."""
        return self.checkpointed_layers if self.gradient_checkpointing else 0.0


@dataclass
class LoraSettings:
    rank: int = knob(32, "LoRA rank r", ge=1, le=512)
    alpha: int = knob(64, "LoRA alpha; the update is scaled by alpha / rank", ge=1)
    dropout: float = knob(0.0, "LoRA dropout; must be 0: the engines sample without it", ge=0.0, lt=1.0)
    target_modules: list[str] = knob(LANGUAGE_MODEL_PROJECTIONS, "module names that get LoRA; LM projections only")
    modules_to_save: list[str] = knob(
        [],
        "whole modules trained beside the LoRA and synced with it (PEFT's): [], [visual] (the vision tower), "
        "[visual, language_model] (every weight)",
    )
    tower_lr_scale: float = knob(
        0.1, "the learning rate of the modules that train whole over the LoRA's (train.lr, sft.lr)", gt=0.0
    )


@dataclass
class MazeSettings:
    size: int = knob(9, "grid side including the wall border (odd): 9 is VisGym easy, 11 hard", ge=5, le=41)
    cell_px: int = knob(25, "pixels per maze cell in the rendered image", ge=4, le=128)
    feedback: Literal["visgym", "compass", "route"] = knob(
        "visgym",
        "observation text: VisGym's (what happened); plus where the goal lies (compass) or which way "
        "a shortest path starts (route): hints for models that cannot yet see, at CPU scale",
    )


@dataclass
class TrainConfig:
    lr: float = knob(3e-6, "AdamW learning rate", gt=0.0, le=1.0)
    epochs: int = knob(20, "passes over the training maze set", ge=1)
    dataset_size: int = knob(256, "training mazes in one epoch", ge=1)
    max_steps: int = knob(0, "stop after this many steps; 0 runs all epochs", ge=0)
    mazes_per_step: int = knob(8, "mazes per GRPO step (each played n_samples_per_prompt times)", ge=1)
    random_starts: float = knob(
        0.0,
        "share of a step's mazes whose group starts on a random open cell (not the goal) "
        "instead of VisGym's corner: shorter episodes whose rewards say more about each "
        "turn; evaluation always starts in the corner",
        ge=0.0,
        le=1.0,
    )
    micro_batch: int = knob(4, "sequences per forward/backward on one trainer rank", ge=1)
    picture_cache_gb: float = knob(
        0.0,
        "processed pictures kept on the trainer's device, by content (repeated "
        "maze states skip the host-side image processor); 0 disables",
        ge=0.0,
    )
    vision_cache_gb: float = knob(
        1.0,
        "the frozen vision tower's outputs kept per distinct picture on the trainer's "
        "device (one trainer process; app/learning/speedups/vision_cache.py); 0 recomputes them",
        ge=0.0,
    )
    update_epochs: int = knob(1, "optimizer passes over each step's batch", ge=1)
    clip_low: float = knob(0.2, "PPO ratio clip below 1", ge=0.0, lt=1.0)
    clip_high: float = knob(0.2, "PPO ratio clip above 1", ge=0.0)
    rollout_ratio_cap: float = knob(
        0.0,
        "weight each trained token by min(pi_before_update / pi_that_played_it, cap) (truncated importance sampling, "
        "for rollout.play_ahead's older adapter and the engine's numerics); 0 leaves the weight out",
        ge=0.0,
    )
    kl_coef: float = knob(
        0.0,
        "weight of the KL to the reference (adapter disabled: the base, so not with a warm start); 0 skips it",
        ge=0.0,
    )
    advantage: Literal["grpo", "drgrpo"] = knob("grpo", "grpo divides by the group std, drgrpo does not")
    drop_zero_variance_groups: bool = knob(
        False,
        "leave out groups whose samples all earned the same reward "
        "(kept when step advantages still tell their turns apart)",
    )
    min_informative_groups: int = knob(
        0,
        "dynamic sampling (DAPO): while fewer of a step's groups earned differing "
        "rewards, the step plays mazes_per_step more fresh mazes (app/driver/cluster.py "
        "sampling_phase); 0 plays one round",
        ge=0,
    )
    refill_rounds: int = knob(
        0,
        "the most extra rounds of fresh mazes a step plays to reach min_informative_groups "
        "(bounds a step's rollout time at 1 + refill_rounds rounds)",
        ge=0,
    )
    step_advantage_weight: float = knob(
        0.0,
        "weight of each turn's anchor-state advantage (GiGPO: its return compared "
        "with the group's other turns from the same cell) added to the episode's; "
        "0 is plain GRPO",
        ge=0.0,
    )
    step_advantage_mode: Literal["grpo", "drgrpo"] = knob(
        "grpo",
        "how a turn's return is compared within its anchor "
        "group: grpo divides by the group's std (returns 0.95^10 and "
        "0.95^11 become -1 and +1), drgrpo only centres it",
    )
    step_discount: float = knob(
        0.95, "discount of a turn's return for the step advantage: gamma^(turns after it) x reward", gt=0.0, le=1.0
    )
    max_update_kl: float = knob(
        0.0,
        "bound on how far one training step moves the policy: k3 KL(before || after) on "
        "its batch, token mean; a step past it is shrunk by halves until it fits, and "
        "further passes are skipped (app/learning/trust_region.py); 0 leaves steps unbounded",
        ge=0.0,
    )
    entropy_coef: float = knob(
        0.0,
        "weight of an entropy bonus on the trained tokens (token mean, at the sampling "
        "temperature): keeps the spread between a group's runs that gives GRPO its signal, "
        "which collapses as the policy grows sure of itself; 0 skips it",
        ge=0.0,
    )
    grad_clip: float = knob(1.0, "max global grad norm; 0 disables clipping", ge=0.0)
    weight_decay: float = knob(0.0, "AdamW weight decay", ge=0.0)
    warmup_steps: int = knob(0, "linear LR warm-up over this many training steps (each of update_epochs passes)", ge=0)
    lr_schedule: Literal["constant", "cosine"] = knob("constant", "LR after warm-up")
    seed: int = knob(42, "seed of the maze sampler, sampling and LoRA init")


@dataclass
class SftConfig:
    steps: int = knob(
        0,
        "supervised warm-start steps on BFS demonstrations before GRPO (fresh runs only; with target_solve_rate, "
        "the steps before the first check); 0 skips",
        ge=0,
    )
    target_solve_rate: float = knob(
        0.0,
        "go on with the warm start until its greedy policy solves this share of validation mazes (training mazes "
        "set aside); GRPO learns from a policy that sometimes solves, not from one that never or always does; "
        "0 runs exactly `steps`",
        ge=0.0,
        le=1.0,
    )
    max_invalid_rate: float = knob(
        1.0,
        "with target_solve_rate: at most this share of the validation turns malformed or into walls",
        ge=0.0,
        le=1.0,
    )
    check_every: int = knob(5, "with target_solve_rate: warm-start steps between validation checks", ge=1)
    max_steps: int = knob(
        0, "with target_solve_rate: the most warm-start steps, target met or not (0: 4 x steps)", ge=0
    )
    validation_mazes: int = knob(
        16, "with target_solve_rate: training mazes set aside to check the warm start on", ge=1
    )
    lr: float = knob(1e-3, "learning rate of the warm start", gt=0.0, le=1.0)
    mazes_per_step: int = knob(8, "demonstrated mazes per warm-start step", ge=1)
    noise: float = knob(
        0.0,
        "chance that a demonstration turn is a random move (in context, not trained), so the "
        "warm start also shows the way back from states off the shortest path",
        ge=0.0,
        lt=1.0,
    )
    variants: int = knob(
        1,
        "distinct examples per maze (noise, random starts, question cells), each made once and replayed in turn",
        ge=1,
    )
    random_starts: float = knob(
        0.0,
        "share of demonstrations that start from a random open cell instead of the "
        "corner: the solver's way from every part of the maze",
        ge=0.0,
        le=1.0,
    )
    perception: int = knob(
        0,
        "questions per demonstrated maze and step on which moves are open from a random cell "
        "(free labels that teach a model from random weights to see walls); 0 asks none",
        ge=0,
    )


@dataclass
class PlacementConfig:
    num_bundles: int = knob(1, "bundles N: N rollout actors and N trainer ranks, pair i sharing bundle i", ge=1)
    gpus_per_bundle: float = knob(
        0,
        "GPUs in each bundle: 0 on a CPU machine, 1 on a GPU box; 0.5 lets two jobs "
        "share one GPU (set rollout.gpu_memory_utilization to match)",
        ge=0,
        le=1,
    )
    cpus_per_bundle: float = knob(1.0, "CPUs in each bundle, shared by its rollout actor and trainer rank", gt=0.0)
    colocate_all: bool = knob(True, "rollout actor i and trainer rank i share bundle i (phases alternate)")
    rollouts_per_bundle: int = knob(
        1,
        "rollout actors (engines) in each bundle, sharing its rollout GPU and CPUs: an "
        "in-process vLLM engine is one host thread, so small models generate faster "
        "from several",
        ge=1,
        le=16,
    )
    threads: int = knob(
        0,
        "torch threads of each trainer rank and rollout actor; 0: the bundle's CPUs, rounded (phases alternate)",
        ge=0,
    )
    evaluator_cpus: float = knob(0.1, "CPUs reserved for the evaluator", gt=0.0)
    consolidator_cpus: float = knob(0.1, "CPUs reserved for the checkpoint consolidator on the head node", gt=0.0)
    ray_address: str | None = knob(None, "Ray cluster to join ('auto' or host:port); none starts a local one")
    wait_for_resources_s: float = knob(120.0, "how long to wait for the placement group before failing", gt=0.0)


@dataclass
class EvalConfig:
    eval_interval: int = knob(10, "evaluate every this many steps; 0 only at start and end", ge=0)
    num_mazes: int = knob(64, "held-out mazes, played greedily once each", ge=1)
    seed: int = knob(1_000_000, "first seed of the held-out set (seeds seed..seed+num_mazes-1)", ge=0)
    at_start: bool = knob(True, "evaluate the starting policy before step 1")
    samples: int = knob(
        0,
        "also play each held-out maze this many times at rollout.temperature (sampled_solve_rate, "
        "sampled_pass_at_k); 0 greedy only",
        ge=0,
    )


@dataclass
class CheckpointConfig:
    ckpt_path: str = knob("", "folder of full training checkpoints; empty means <run dir>/checkpoints")
    ckpt_interval: int = knob(20, "write a full checkpoint every this many steps; 0 never", ge=0)
    hf_save_interval: int = knob(20, "export a PEFT adapter every this many steps; 0 never", ge=0)
    resume_mode: Literal["latest", "none", "path"] = knob(
        "latest",
        "where the run starts: the latest complete checkpoint, none, or resume_path (a recovery "
        "resumes from the run's own newest checkpoint)",
    )
    resume_path: str | None = knob(None, "checkpoint folder to resume from when resume_mode is 'path'")
    export_dir: str = knob("", "folder of exported adapters; empty means <run dir>/export")
    s3_uri: str | None = knob(None, "s3://bucket/prefix that also receives adapters and checkpoints")
    s3_endpoint_url: str | None = knob(None, "endpoint of an S3-compatible store; none uses AWS")
    keep_last: int = knob(3, "full checkpoints kept on disk; older ones are deleted", ge=1)
    max_failures: int = knob(3, "actor or node losses the driver recovers from before giving up", ge=0)


@dataclass
class MetricsConfig:
    prometheus: bool = knob(True, "export metrics through ray.util.metrics (Ray's Prometheus endpoint)")
    progress_bar: bool = knob(True, "show a progress bar with the latest solve rate")
    peak_tflops: float = knob(
        0.0,
        "a GPU's peak matrix TFLOP/s, the denominator of each phase's MFU; 0 takes the GPU's known bf16 dense peak "
        "(H100/H200 989) and reports no utilisation on a CPU or an unknown GPU",
        ge=0.0,
    )


@dataclass
class Config:
    run_name: str = knob("tiny", "name of the run: its folder under output_dir and its metric label")
    output_dir: str = knob("runs", "parent folder of run folders (logs, eval results, checkpoints)")
    model: ModelConfig = knob(ModelConfig(), "the policy model")
    lora: LoraSettings = knob(LoraSettings(), "the trained adapter")
    maze: MazeSettings = knob(MazeSettings(), "the maze world, for training and evaluation")
    rollout: RolloutConfig = knob(RolloutConfig(), "episodes and engines")
    train: TrainConfig = knob(TrainConfig(), "the GRPO update")
    sft: SftConfig = knob(SftConfig(), "the supervised warm start")
    placement: PlacementConfig = knob(PlacementConfig(), "Ray placement")
    eval: EvalConfig = knob(EvalConfig(), "the held-out evaluation")
    checkpoint: CheckpointConfig = knob(CheckpointConfig(), "adapters, checkpoints, resume")
    metrics: MetricsConfig = knob(MetricsConfig(), "metrics and progress")
    waits: WaitConfig = knob(WaitConfig(), "bounds on every wait of the driver (docs/OPERATING.md, Waits)")

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.run_name

    @property
    def episodes_per_step(self) -> int:
        return self.train.mazes_per_step * self.rollout.n_samples_per_prompt

    @property
    def total_steps(self) -> int:
        per_epoch = -(-self.train.dataset_size // self.train.mazes_per_step)
        steps = self.train.epochs * per_epoch
        return min(steps, self.train.max_steps) if self.train.max_steps else steps
