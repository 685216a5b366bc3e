"""The GRPO update on one trainer rank: the policy model with LoRA, sharded with FSDP2, and its optimizer.

`PolicyTrainer` runs in a plain process (world size 1, no process group) for tests and scripts, and as
rank r of N inside `actors.trainer.TrainerActor`, where every rank holds the whole batch's trajectories,
computes the same advantages, and trains on its own share of the sequences. Ranks run the same number
of forward/backward passes (FSDP's collectives must line up), padding with zero-weight passes.
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from app.config import Config
from app.learning import grpo
from app.learning.batch import TrainItem, advantage_table, build_items, micro_batches, rollout_logprob_table, shard
from app.learning.forward import PolicyForward
from app.learning.speedups.compiled_layers import compile_language_layers
from app.learning.speedups.picture_cache import PictureCache
from app.learning.speedups.vision_cache import VisionCache
from app.learning.step_advantages import advantages_for
from app.learning.trust_region import bounded_step
from app.model import adapters, load
from app.model.load import apply_lora, load_model, load_processor, train_whole_modules, train_without_dropout
from app.rollout.encoding import ChatCodec
from app.rollout.trajectory import Trajectory


class PolicyTrainer:
    def __init__(
        self, cfg: Config, model_dir: str, rank: int = 0, world: int = 1, device: str = "cpu", train_base: bool = False
    ):
        """train_base: every weight of the model trains too, not only the LoRA (full-model SFT, one process)."""
        self.cfg, self.rank, self.world, self.model_dir = cfg, rank, world, model_dir
        self.device = torch.device(device)
        self.distributed = world > 1 and dist.is_available() and dist.is_initialized()  # not in-process vLLM's group
        self.processor = load_processor(model_dir)
        compute_dtype = getattr(torch, cfg.model.dtype)
        self.codec = ChatCodec(self.processor)
        base = load_model(model_dir, cfg.model.dtype, self.device)
        self.spec = adapters.AdapterSpec.for_model(base.config.text_config, cfg.lora, base.config.vision_config)
        if cfg.model.gradient_checkpointing:
            load.checkpoint_decoder_layers(base, cfg.model.checkpointed_layers)
        torch.manual_seed(cfg.train.seed)  # every rank must initialise the same LoRA before sharding
        self.model = apply_lora(base, cfg.lora, cfg.model.adapter_init)
        train_without_dropout(self.model)
        if cfg.lora.modules_to_save:  # the tower, the language model: whole beside the LoRA; FSDP2 casts for itself
            train_whole_modules(self.model, cfg.lora.modules_to_save, None if self.distributed else compute_dtype)
        if train_base:
            if self.distributed:
                raise ValueError("full-model SFT runs in one process; train_base with a process group is not supported")
            for p in self.model.parameters():
                p.requires_grad_(True)
        self.vision_cache = None
        if (
            cfg.train.vision_cache_gb > 0 and not train_base and not self.distributed and not cfg.lora.modules_to_save
        ):  # why not: app/learning/speedups/vision_cache.py; a trained tower changes its outputs every step
            self.vision_cache = VisionCache(self.model.base_model.model.model, int(cfg.train.vision_cache_gb * 2**30))
        if cfg.model.compile_layers:  # before FSDP2 wraps the layers: its hooks run eagerly around the compiled code
            compile_language_layers(self.model)
        if self.distributed:
            self._shard_with_fsdp2()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self._param_groups(cfg.train.lr), weight_decay=cfg.train.weight_decay, betas=(0.9, 0.999), eps=1e-8
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        self.steps_done, self._sft_optimizer, self.pictures = 0, None, None
        if cfg.train.picture_cache_gb > 0:
            self.pictures = PictureCache(
                self.codec, self.device, compute_dtype, int(cfg.train.picture_cache_gb * 2**30)
            )
        self.forward = PolicyForward(self.model, self.codec, self.device, cfg.rollout.temperature, compute_dtype)
        self.forward.pictures, self.forward.vision_cache = self.pictures, self.vision_cache

    def _shard_with_fsdp2(self) -> None:
        mp = MixedPrecisionPolicy(param_dtype=getattr(torch, self.cfg.model.dtype), reduce_dtype=torch.float32)
        inner = self.model.base_model.model.model
        for block in list(inner.visual.blocks) + list(inner.language_model.layers):
            fully_shard(block, mp_policy=mp)
        fully_shard(self.model, mp_policy=mp)

    def _lr_factor(self, step: int) -> float:
        t = self.cfg.train
        if t.warmup_steps and step < t.warmup_steps:
            return (step + 1) / t.warmup_steps
        if t.lr_schedule == "cosine":
            span = max(self.cfg.total_steps - t.warmup_steps, 1)
            return 0.5 * (1 + math.cos(math.pi * min(step - t.warmup_steps, span) / span))
        return 1.0

    def token_logprobs(self, batch: list[TrainItem], with_grad: bool, **options):
        """(logp, entropy, mask, positions) of a batch under the policy: app.learning.forward.PolicyForward."""
        return self.forward.token_logprobs(batch, with_grad, **options)

    # ------------------------------------------------------------ the update
    def train_step(self, trajectories: list[Trajectory]) -> dict:
        t0, started_at = time.perf_counter(), time.time()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        cfg = self.cfg.train
        result, steps = advantages_for(cfg, trajectories)
        everything = build_items(trajectories, result, steps, cfg.step_advantage_weight)
        items = shard(everything, self.rank, self.world)
        batches = micro_batches(items, everything, cfg.micro_batch)
        local = torch.tensor([float(sum(it.tokens for it in items)), float(batches.real)])
        total_tokens, passes = (
            self._all_reduce(local[:1].clone()).item(),
            int(self._all_reduce(local[1:].clone(), "max").item()),
        )
        forward_tokens = self._all_reduce(torch.tensor([float(sum(len(it.token_ids) for it in items))])).item()
        # first pass: pg, kl, tokens, entropy, |mismatch|, max mismatch, loss, the rollout ratio's truncated weight
        sums = torch.zeros(8, dtype=torch.float64)
        # the last pass's clipped tokens, k3(old || current) and tokens: in the first pass the ratio is 1 by
        # construction, so only a later pass shows how far the update moved the policy and what the clip cut
        moved = torch.zeros(3, dtype=torch.float64)
        grad_norm, bound = 0.0, None
        # the pre-update logprobs, for the later passes' ratios and the trust region's drift: the first pass's own,
        # since the optimizer steps only after a whole pass over the batch (a separate no-grad forward was one
        # forward of the batch in five for nothing)
        old: list[torch.Tensor | None] = [None] * passes
        keep_old = cfg.update_epochs > 1 or cfg.max_update_kl > 0
        for epoch in range(cfg.update_epochs):
            moved.zero_()  # what the last pass run shows (passes may stop early under max_update_kl)
            for i in range(passes):
                batch, weight = batches.get(i)  # weight 0: a padding pass that keeps collectives aligned
                logp, entropy, mask, wanted = self.token_logprobs(
                    batch, with_grad=True, entropy_grad=cfg.entropy_coef > 0
                )
                old_logp = logp.detach() if old[i] is None else old[i]
                if keep_old and old[i] is None:  # the first pass runs before any step: pre-update
                    old[i] = old_logp
                adv = advantage_table(batch)[:, wanted + 1].to(logp.device)
                rollout_logp = rollout_logprob_table(batch)[:, wanted + 1].to(logp.device)
                cap = cfg.rollout_ratio_cap  # truncated importance sampling: the engine's policy played the batch
                behaviour = torch.exp(old_logp - rollout_logp).clamp(max=cap) if cap > 0 else None
                ref = None
                if self.cfg.train.kl_coef > 0:
                    ref = self.token_logprobs(batch, with_grad=False, adapter=False)[0]
                terms = grpo.policy_loss(
                    logp,
                    old_logp,
                    adv,
                    mask * weight,
                    cfg.clip_low,
                    cfg.clip_high,
                    max(total_tokens, 1.0) / self.world,
                    ref,
                    cfg.kl_coef,
                    entropy,
                    cfg.entropy_coef,
                    behaviour,
                )
                if self.distributed and hasattr(self.model, "set_requires_gradient_sync"):
                    self.model.set_requires_gradient_sync(i == passes - 1)
                terms.loss.backward()
                if weight:
                    drift = (grpo.kl_k3(old_logp, logp.detach()) * mask).sum().item() if old[i] is not None else 0.0
                    moved += torch.tensor([terms.clipped.item(), drift, terms.tokens], dtype=torch.float64)
                if epoch == 0 and weight:
                    diff = ((logp.detach() - rollout_logp).abs() * mask).cpu()
                    sums += torch.tensor(
                        [
                            terms.pg_loss.item(),
                            terms.kl.item(),
                            terms.tokens,
                            float((entropy.detach().cpu() * mask.cpu()).sum()),
                            float(diff.sum()),
                            0.0,
                            terms.loss.item(),
                            float((behaviour * mask).sum()) if behaviour is not None else terms.tokens,
                        ],
                        dtype=torch.float64,
                    )
                    sums[5] = max(sums[5].item(), float(diff.max()) if diff.numel() else 0.0)
            if cfg.max_update_kl <= 0:
                grad_norm = self._clip_and_step(self.optimizer)
                continue
            norms = []
            bound = bounded_step(
                self.params,
                lambda: norms.append(self._clip_and_step(self.optimizer)),
                lambda: self._drift(batches, old, passes),
                cfg.max_update_kl,
                kl_before=bound.kl if bound is not None else 0.0,
            )
            grad_norm = norms[0]
            if bound.halvings:  # at the bound already: a further pass could only be shrunk back to it
                break
        # once a training step, not once a pass: warmup_steps and the cosine span count training steps, whatever
        # update_epochs is (stepped per pass, two passes would halve the warm-up)
        lr = self.optimizer.param_groups[0]["lr"]  # the rate this step trained at (the scheduler moves on next)
        self.scheduler.step()
        self.steps_done += 1
        metrics = self._metrics(sums, moved, grad_norm, lr, result, len(items), time.perf_counter() - t0)
        if steps is not None:
            turns = max(sum(len(t.states) for t in trajectories), 1)
            metrics.update(
                step_anchor_groups=steps.anchor_groups,
                step_informative_anchor_groups=steps.informative_anchor_groups,
                step_anchored_turn_share=steps.anchored_turns / turns,
            )
        metrics["forward_tokens"] = forward_tokens * cfg.update_epochs  # every position, every pass (for MFU)
        metrics["started_at"] = started_at
        if self.device.type == "cuda":  # what this rank's step needed at most, the allocator's cache included
            metrics["peak_memory_gb"] = torch.cuda.max_memory_reserved(self.device) / 2**30
        if bound is not None:
            metrics.update(
                step_kl=bound.kl, update_scale=bound.scale, update_halvings=bound.halvings, passes_done=epoch + 1
            )
        return metrics

    def _drift(self, batches, old: list[torch.Tensor], passes: int) -> float:
        """k3 KL(pre-update policy || current one), token mean over the step's trained tokens on every rank.
        Every rank runs all its passes, padding ones included: FSDP2's forward gathers parameters collectively."""
        s = torch.zeros(2, dtype=torch.float64)
        for i in range(passes):
            batch, weight = batches.get(i)
            logp, _, mask, _ = self.token_logprobs(batch, with_grad=False)
            s += torch.tensor(
                [float((grpo.kl_k3(old[i], logp) * mask * weight).sum()), float((mask * weight).sum())],
                dtype=torch.float64,
            )
        s = self._all_reduce(s)
        return s[0].item() / max(s[1].item(), 1.0)

    def sft_step(self, demonstrations: list[Trajectory], lr: float) -> dict:
        """One supervised step: token-mean negative log-likelihood of the demonstrated replies."""
        t0 = time.perf_counter()
        if self._sft_optimizer is None:  # its own optimizer: the warm start leaves GRPO's Adam state untouched
            self._sft_optimizer = torch.optim.AdamW(self._param_groups(lr), weight_decay=0.0)
        for group in self._sft_optimizer.param_groups:  # the caller's schedule (warmup) sets each step's rate
            group["lr"] = lr * group["lr_scale"]
        keep = grpo.AdvantageResult([0.0] * len(demonstrations), [True] * len(demonstrations), len(demonstrations), 0)
        everything = build_items(demonstrations, keep)
        items = shard(everything, self.rank, self.world)
        batches = micro_batches(items, everything, self.cfg.train.micro_batch)
        local = torch.tensor([float(sum(it.tokens for it in items)), float(batches.real)])
        total_tokens = self._all_reduce(local[:1].clone()).item()
        passes = int(self._all_reduce(local[1:].clone(), "max").item())
        nll = torch.zeros(2, dtype=torch.float64)
        for i in range(passes):
            batch, weight = batches.get(i)
            logp, _, mask, _ = self.token_logprobs(batch, with_grad=True, temperature=1.0)
            loss = -(logp * mask * weight).sum() / (max(total_tokens, 1.0) / self.world)
            if self.distributed and hasattr(self.model, "set_requires_gradient_sync"):
                self.model.set_requires_gradient_sync(i == passes - 1)
            loss.backward()
            nll += torch.tensor(
                [-(logp.detach() * mask * weight).sum().item(), (mask * weight).sum().item()], dtype=torch.float64
            )
        grad_norm = self._clip_and_step(self._sft_optimizer)
        s = self._all_reduce(nll.clone())
        return {
            "sft_nll": s[0].item() / max(s[1].item(), 1.0),
            "sft_tokens": s[1].item(),
            "grad_norm": grad_norm,
            "sft_step_s": time.perf_counter() - t0,
        }

    def release_cached_memory(self) -> None:
        """Returns the blocks PyTorch's caching allocator keeps after a step to the device, so that a vLLM
        engine sharing the GPU can wake its KV cache (on one H200 the 8B-shaped engine could not: out of
        memory at wake-up with the trainer's freed activations still reserved)."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _clip_and_step(self, optimizer) -> float:
        limit = self.cfg.train.grad_clip if self.cfg.train.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self.params, limit)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def _all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Sum (or max) over ranks of a small host tensor; NCCL only reduces device tensors, so it travels."""
        if self.distributed:
            on_device = t.to(self.device)
            dist.all_reduce(on_device, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
            t = on_device.to(t.device)
        return t

    def _metrics(
        self,
        sums: torch.Tensor,
        moved: torch.Tensor,
        grad_norm: float,
        lr: float,
        result: grpo.AdvantageResult,
        sequences: int,
        seconds: float,
    ) -> dict:
        mismatch_max = self._all_reduce(sums[5:6].clone().float(), "max").item()
        s, last = self._all_reduce(sums.clone()), self._all_reduce(moved.clone())
        tokens, last_tokens = max(s[2].item(), 1.0), max(last[2].item(), 1.0)
        return {
            "loss": s[6].item() / self.world,
            "pg_loss": s[0].item() / tokens,
            "kl": s[1].item() / tokens,
            "entropy": s[3].item() / tokens,
            "clip_fraction": last[0].item() / last_tokens,
            "update_kl": last[1].item() / last_tokens,
            "logprob_mismatch_mean": s[4].item() / tokens,
            "logprob_mismatch_max": mismatch_max,
            "rollout_ratio_weight": s[7].item() / tokens,  # 1.0 unless train.rollout_ratio_cap weights the tokens
            "grad_norm": grad_norm,
            "lr": lr,
            "trained_tokens": s[2].item(),
            "groups": result.groups,
            "zero_variance_groups": result.zero_variance_groups,
            "sequences_this_rank": sequences,
            "train_step_s": seconds,
        }

    # ------------------------------------------------------------ the adapter
    def _param_groups(self, lr: float) -> list[dict]:
        """AdamW's groups: the LoRA (with every other trained weight) at `lr`; the vision tower, when it trains
        whole, at lora.tower_lr_scale times it: one Adam step moves each weight by about the rate, which a
        low-rank update spreads over r directions and a whole matrix takes in full."""
        tower = {id(p) for name, (_, p) in self._trained_parameters().items() if not adapters.is_lora(name)}
        groups = [{"params": [p for p in self.params if id(p) not in tower], "lr": lr, "lr_scale": 1.0}]
        if tower:
            scale = self.cfg.lora.tower_lr_scale
            groups.append({"params": [p for p in self.params if id(p) in tower], "lr": lr * scale, "lr_scale": scale})
        return groups

    def _trained_parameters(self) -> dict[str, tuple[str, torch.nn.Parameter]]:
        """The adapter's parameters by PEFT's saved name (the LoRA, and the vision tower when it trains), each with
        its name in the model."""
        named = ((next(iter(adapters.normalize_keys({n: None}))), n, p) for n, p in self.model.named_parameters())
        return {peft_name: (n, p) for peft_name, n, p in named if peft_name in self.spec.shapes}

    def trained_tensors(self, on_device: bool = False) -> dict[str, torch.Tensor]:
        """The full adapter under PEFT's names (the LoRA, plus the vision tower's weights when lora.modules_to_save
        names it), as copies (a collective under FSDP: every rank must call it).

        on_device keeps them on the training device, for app.model.adapters.pack's single transfer to the host."""
        out = {}
        for name, (_, p) in self._trained_parameters().items():
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            out[name] = full.detach().clone() if on_device else full.detach().to("cpu", copy=True).contiguous()
        return out

    # ------------------------------------------------------------ checkpoint state
    def optimizer_state(self) -> tuple[dict[str, torch.Tensor], dict]:
        """(flat tensors, JSON) of AdamW and the LR schedule, unsharded (a collective under FSDP).

        Unsharded and keyed by parameter name, so a run resumes on any number of trainer ranks.
        """

        full = get_optimizer_state_dict(
            self.model, self.optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        tensors = {}
        for fqn, entry in full.get("state", {}).items():
            for key, value in entry.items():
                value = value if torch.is_tensor(value) else torch.tensor(value)
                tensors[f"{fqn}::{key}"] = value.detach().to("cpu").contiguous()
        groups = [{k: v for k, v in g.items()} for g in full.get("param_groups", [])]
        return tensors, {"param_groups": groups, "last_epoch": self.scheduler.last_epoch, "steps_done": self.steps_done}

    def load_state(
        self, adapter: dict[str, torch.Tensor], optimizer: dict[str, torch.Tensor] | None, json_state: dict | None
    ) -> None:
        """Sets the LoRA (and AdamW + schedule when given) from unsharded tensors; every rank must call it."""

        adapter = adapters.normalize_keys(adapter)
        adapters.validate(adapter, self.spec)
        trained = self._trained_parameters()
        full = {trained[k][0]: v.to(trained[k][1].dtype) for k, v in adapter.items()}
        options = StateDictOptions(full_state_dict=True, strict=False)
        set_model_state_dict(self.model, full, options=options)
        if optimizer and json_state:
            state: dict = {}
            for key, value in optimizer.items():
                fqn, field_name = key.rsplit("::", 1)
                state.setdefault(fqn, {})[field_name] = value
            set_optimizer_state_dict(
                self.model,
                self.optimizer,
                {"state": state, "param_groups": json_state["param_groups"]},
                options=options,
            )
            self.scheduler.last_epoch = json_state["last_epoch"]
            for group, base in zip(self.optimizer.param_groups, self.scheduler.base_lrs):
                group["lr"] = base * self._lr_factor(self.scheduler.last_epoch)
            self.steps_done = json_state["steps_done"]
