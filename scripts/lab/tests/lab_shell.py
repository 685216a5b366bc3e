"""Running the lab's shell stages from the lab's tests: the script runner, the tar reader, the CPU smoke overrides."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

SMOKE = (
    "eval.num_mazes=2 sft.mazes_per_step=2 sft.variants=1 rollout.max_turns=9 train.picture_cache_gb=0 "
    "placement.gpus_per_bundle=0 placement.cpus_per_bundle=0.5 model.dtype=float32 train.mazes_per_step=2 "
    "rollout.n_samples_per_prompt=2 eval.eval_interval=1 checkpoint.ckpt_interval=1"
)


def run_script(args: list[str], **env: str) -> subprocess.CompletedProcess:
    environment = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", **env}
    return subprocess.run(["bash", *args], cwd=ROOT, env=environment, capture_output=True, text=True, timeout=600)


def tar_names(pieces: list[Path]) -> list[str]:
    """The member names of the tar these pieces make, joined in order."""
    joined = b"".join(piece.read_bytes() for piece in pieces)
    listed = subprocess.run(["tar", "-tf", "-"], input=joined, capture_output=True, check=True)
    return listed.stdout.decode().split()
