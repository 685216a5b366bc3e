"""One call records a step's metrics: Ray metrics (Prometheus), the JSONL log, and the console.

Ray metric names are `mazerl_<name>` with a `run` tag, created once per name; only numbers are
exported. Ray's metrics agent adds its own namespace, so Prometheus (each node's metrics export port,
`ray.nodes()[i]["MetricsExportPort"]`) serves them as `ray_mazerl_<name>` (`prometheus_name`), next to
the labels Ray adds (SessionName, WorkerId, Component, ...). A gauge keeps its last value while the
driver lives, so a metric recorded only every eval_interval steps reads as a step function.
The JSONL log (`<run dir>/metrics.jsonl`) keeps everything, one object per line, and is what plots
and reports (app/observe/report.py) are rebuilt from. The console shows a progress bar with the latest solve rate
when attached to a terminal, and one line per step otherwise (Ray job logs).
"""

from __future__ import annotations

import json
import logging
import math
import re
import sys
import time
from pathlib import Path

from ray.util.metrics import Gauge
from tqdm import tqdm

log = logging.getLogger("mazerl.metrics")

# Exported to Prometheus with a one-line description; every other numeric metric goes to the log only.
EXPORTED = {
    "eval_solve_rate": "held-out solve rate (stop on goal within max_turns), greedy",
    "eval_solvable_bound": "share of held-out mazes solvable within max_turns",
    "eval_sampled_solve_rate": "held-out solve rate at the rollout temperature (eval.samples plays a maze)",
    "eval_sampled_pass_at_k": "share of held-out mazes solved by at least one of eval.samples sampled plays",
    "rollout_solve_rate": "solve rate of the step's training episodes",
    "rollout_reward_mean": "mean reward of the step's training episodes",
    "rollout_informative_groups": "the step's groups whose runs earned differing rewards (non-zero GRPO advantages)",
    "rollout_groups_all_solved": "the step's groups whose every run solved its maze (no GRPO signal: mastered)",
    "rollout_groups_none_solved": "the step's groups of which no run solved its maze (no GRPO signal: too hard)",
    "rollout_rounds": "rounds of mazes the step played (more than 1 when train.min_informative_groups refilled it)",
    "train_loss": "GRPO loss",
    "train_pg_loss": "policy-gradient part of the loss, token mean",
    "train_kl": "KL to the reference policy (adapter disabled), token mean",
    "train_clip_fraction": "share of tokens whose ratio was clipped in the step's last pass (0 with update_epochs 1)",
    "train_update_kl": "k3 KL(pre-update || current policy) in the step's last pass, token mean: how far it moved",
    "train_step_kl": "k3 KL(policy before the step || after it) on its batch, token mean (train.max_update_kl > 0)",
    "train_update_scale": "share of the optimizer's last step kept under train.max_update_kl (1 whole, 0 dropped)",
    "train_entropy": "policy entropy on trained tokens",
    "train_step_anchored_turn_share": "share of training turns compared with other turns from the same cell "
    "(train.step_advantage_weight > 0)",
    "train_grad_norm": "global gradient norm before clipping",
    "train_peak_memory_gb": "a trainer rank's peak GPU memory in the step (PyTorch's reserved memory), GiB",
    "train_logprob_mismatch_mean": "mean |trainer - rollout| logprob on sampled tokens",
    "rollout_generated_tokens_per_s": "generated tokens per second in the rollout phase",
    "rollout_turns_mean": "mean turns of the step's training episodes",
    "rollout_invalid_action_rate": "share of training turns whose action was invalid (unparsed or into a wall)",
    "rollout_context_full_rate": "share of the step's training episodes ended because the context would pass "
    "rollout.max_model_len (reward 0)",
    "eval_context_full": "held-out episodes ended because the context would pass rollout.max_model_len",
    "eval_solve_rate_of_solvable": "held-out solve rate among mazes solvable within max_turns",
    "eval_mean_turns": "mean turns of held-out episodes",
    "eval_invalid_action_rate": "share of held-out turns whose action was invalid",
    "eval_why_first_try_open": "share of held-out moves tried (not repeats) into an open cell: perception",
    "eval_why_first_try_toward": "share of held-out moves tried (not repeats) along a shortest path",
    "eval_why_first_try_open_room": "the same as first_try_open, made from rooms only: seeing walls, not positions",
    "train_logprob_mismatch_max": "max |trainer - rollout| logprob on sampled tokens",
    "train_rollout_ratio_weight": "mean weight min(pi_before_update / pi_that_played, train.rollout_ratio_cap) of "
    "trained tokens (1 without the cap)",
    "rollout_mfu": "the rollout phase's FLOP utilisation: 2*N per context token and 2*N_vision per picture patch, "
    "over its time and the GPUs' peak (metrics.peak_tflops)",
    "train_mfu": "the train phase's FLOP utilisation: 4*N per forward token (6*N with gradient checkpointing), over "
    "its time and the GPUs' peak",
    "rollout_floor_s": "the least time the rollout phase's work could take at the GPUs' peak",
    "train_floor_s": "the least time the train phase's work could take at the GPUs' peak",
    "rollout_tflop": "the rollout phase's work, TFLOP",
    "train_tflop": "the train phase's work, TFLOP",
    "time_rollout_s": "rollout phase duration",
    "time_train_s": "train phase duration",
    "time_sync_s": "LoRA sync duration",
    "time_eval_s": "evaluation duration",
    "time_checkpoint_s": "adapter export and checkpoint duration (near zero when neither is due)",
    "time_step_s": "whole step duration",
    "lora_version": "adapter version the rollout engines hold",
    "rollout_lora_version": "adapter version that played the step's batch (one step behind with rollout.play_ahead)",
    "recoveries": "actor or node losses recovered from",
    "stalls": "waits of the driver that ran past their bound (waits.*), each answered like a lost actor",
    "checkpoint_age_steps": "steps since the last complete checkpoint",
    "replica_pending": "checkpoints and adapters committed to the shared directory whose S3 copy is not made yet",
    "step": "the step number",
}


RAY_NAMESPACE = "ray"  # the prefix Ray's metrics agent puts before every metric it exports


def ray_metric_name(name: str) -> str:
    """The name given to ray.util.metrics: `mazerl_<name>`."""
    return "mazerl_" + re.sub(r"[^a-zA-Z0-9_]", "_", name)


def prometheus_name(name: str) -> str:
    """The exact name Prometheus scrapes from Ray's metrics export port: `ray_mazerl_<name>`."""
    return f"{RAY_NAMESPACE}_{ray_metric_name(name)}"


def format_duration(seconds: float) -> str:
    """12 s, 3 min 05 s, 1 h 02 min: what a person reads at a glance."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


class MetricsSink:
    def __init__(
        self, run_dir: str | Path, run_name: str, total_steps: int, prometheus: bool = True, progress_bar: bool = True
    ):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.run_name, self.total_steps = run_name, total_steps
        self._gauges: dict = {}
        self._prometheus = prometheus
        self._export_failed = False
        self._bar = None
        self.latest_solve_rate: float | None = None
        self._step_times: list[tuple[int, float]] = []  # (step, when recorded): the time left is estimated from them
        if progress_bar and sys.stderr.isatty():
            self._bar = tqdm(total=total_steps, desc=f"mazerl {run_name}", unit="step", dynamic_ncols=True)

    def record(self, step: int, metrics: dict) -> None:
        entry = {"step": step, "time": time.time(), **metrics}
        with self.path.open("a") as f:
            f.write(json.dumps(entry, default=_plain) + "\n")
        if "eval_solve_rate" in metrics:
            self.latest_solve_rate = metrics["eval_solve_rate"]
        if self._prometheus:
            try:
                self._export(entry)
            except Exception as e:  # metrics must never stop training; the JSONL log still has everything
                if not self._export_failed:
                    log.warning("exporting metrics to Ray failed (%s: %s); continuing without", type(e).__name__, e)
                self._export_failed = True
        self._console(step, metrics)

    def _export(self, entry: dict) -> None:

        for name, value in entry.items():
            if name not in EXPORTED or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            if not math.isfinite(value):
                continue
            gauge = self._gauges.get(name)
            if gauge is None:
                gauge = self._gauges[name] = Gauge(ray_metric_name(name), description=EXPORTED[name], tag_keys=("run",))
            gauge.set(float(value), tags={"run": self.run_name})

    def _left(self, step: int) -> str:
        """About how long the steps left take, from the median of the recent steps' durations."""
        self._step_times.append((step, time.time()))
        recent = self._step_times[-11:]
        gaps = sorted((t1 - t0) / (s1 - s0) for (s0, t0), (s1, t1) in zip(recent, recent[1:]) if s1 > s0)
        if not gaps or step >= self.total_steps:
            return ""
        return f"~{format_duration(gaps[len(gaps) // 2] * (self.total_steps - step))} left"

    def _console(self, step: int, m: dict) -> None:
        if "sft_step" in m:
            parts = [
                f"warm start {m['sft_step']}/{m.get('sft_most', '?')}",
                f"nll {m.get('sft_nll', float('nan')):.3f}",
            ]
            if "sft_validation_solve_rate" in m:
                parts.append(
                    f"validation solve {100 * m['sft_validation_solve_rate']:.1f}% "
                    f"(target {100 * m.get('sft_target', 0):.0f}%), "
                    f"invalid {100 * m['sft_validation_invalid_action_rate']:.0f}%"
                )
            print(" | ".join(parts), flush=True)
            return
        solve = "n/a" if self.latest_solve_rate is None else f"{100 * self.latest_solve_rate:.1f}%"
        parts = [f"step {step}/{self.total_steps}", f"eval solve {solve}"]
        if "rollout_solve_rate" in m:
            parts.append(f"train solve {100 * m['rollout_solve_rate']:.1f}%")
        if "train_loss" in m:
            parts.append(f"loss {m['train_loss']:+.4f}")
        if "train_logprob_mismatch_mean" in m:
            parts.append(f"mismatch {m['train_logprob_mismatch_mean']:.1e}")
        anatomy = " ".join(
            f"{k[5:-2]} {m[k]:.1f}s"
            for k in ("time_rollout_s", "time_train_s", "time_sync_s", "time_eval_s", "time_checkpoint_s")
            if k in m
        )
        if anatomy:
            parts.append(anatomy)
        mfu = " ".join(
            f"{phase} {100 * m[f'{phase}_mfu']:.0f}%" for phase in ("rollout", "train") if f"{phase}_mfu" in m
        )
        if mfu:
            parts.append(f"MFU {mfu}")
        left = self._left(step) if "time_step_s" in m else ""
        if left:
            parts.append(left)
        line = " | ".join(parts)
        if self._bar is not None:
            self._bar.set_postfix_str(f"solve {solve}")
            self._bar.update(max(0, step - self._bar.n))
            self._bar.write(line)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _plain(value):
    if hasattr(value, "item"):
        return value.item()
    return str(value)


def read_log(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
