"""scripts/play.py through the served API equals the evaluator on the same engine type, adapter and seeds.

The adapter is trained here: supervised steps (app.learning.training's SFT on app.learning.sft's solver
demonstrations) on the held-out mazes themselves, so that a few dozen steps give a policy that moves, turns, stops
and sometimes solves (a test fixture may memorise eval mazes; a training run never does). The reference is what the
evaluator computes: app.rollout.episodes.play_episodes greedily on the transformers engine with that adapter, then
app.observe.evaluation.eval_report; each maze is played on its own, as the server plays each request, so both sides
run the same arithmetic. The server reads adapters from a local export folder, the layout a run writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import Future
from pathlib import Path

import pytest

from tests.conftest import tiny_config
from tests.s3_server import free_port

pytestmark = pytest.mark.timeout(900)

ROOT = Path(__file__).resolve().parents[2]
OVERRIDES = [
    "maze.size=5",
    "maze.feedback=compass",
    "rollout.max_turns=6",
    "rollout.image_history=0",
    "rollout.max_new_tokens=12",
    "lora.rank=8",
    "lora.alpha=16",
    "train.micro_batch=8",
    "eval.seed=0",
    "eval.num_mazes=6",
]
SFT_STEPS, SFT_LR = 45, 1e-2
TOKEN = f"token-{uuid.uuid4().hex}"


@pytest.fixture(scope="module")
def cfg():
    return tiny_config(*OVERRIDES)


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("export")


@pytest.fixture(scope="module")
def training(cfg, tiny_model_dir, export_dir) -> Future:
    """Trains the adapter on a thread while the server starts; the future's result is (step, tensors, final NLL)."""
    future: Future = Future()

    def train() -> None:
        try:
            from app.learning.sft import demonstrations
            from app.learning.training import PolicyTrainer
            from app.storage.checkpoint import export_adapter
            from app.world.rules import EpisodeSettings
            from app.world.sampler import eval_mazes

            trainer = PolicyTrainer(cfg, tiny_model_dir)
            demos = demonstrations(
                eval_mazes(cfg.eval.seed, cfg.eval.num_mazes, cfg.maze.size),
                trainer.codec,
                EpisodeSettings.from_config(cfg),
            )
            for _ in range(SFT_STEPS):
                nll = trainer.sft_step(demos, SFT_LR)["sft_nll"]
            tensors = trainer.trained_tensors()
            export_adapter(str(export_dir), SFT_STEPS, tensors, trainer.spec.peft_config())
            future.set_result((SFT_STEPS, tensors, nll))
        except BaseException as e:  # noqa: BLE001 - handed to the test
            future.set_exception(e)

    threading.Thread(target=train, daemon=True).start()
    return future


@pytest.fixture(scope="module")
def server(ray_cluster, tiny_model_dir, export_dir, training):
    """Starts on the export folder while the adapter is still training: the adapter is found when it is there."""
    from ray import serve

    from app.serve.api import ServeSettings, token_digest
    from app.serve.deployment import build_app

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    settings = ServeSettings(
        model_path=tiny_model_dir,
        adapters_root=str(export_dir),
        lora_rank=8,
        lora_alpha=16,
        token_sha256=token_digest(TOKEN),
        max_model_len=2048,
    )
    serve.run(build_app(settings, num_cpus=0.5), name="mazerl-play", route_prefix="/")
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        serve.shutdown()


@pytest.fixture(scope="module")
def trained(training):
    step, tensors, nll = training.result(timeout=600)
    print(f"\nSFT: {step} steps, final NLL {nll:.3f}")
    return f"global_step_{step:06d}", tensors


@pytest.fixture(scope="module")
def evaluator_report(cfg, tiny_model_dir, trained) -> dict:
    from app.observe.evaluation import eval_report
    from app.rollout.engines.base import Sampling
    from app.rollout.engines.hf import HFEngine
    from app.rollout.episodes import EpisodeRequest, play_episodes
    from app.world.rules import EpisodeSettings
    from app.world.sampler import eval_mazes

    engine = HFEngine(tiny_model_dir, cfg.lora)
    engine.load_lora(trained[1], 1)
    greedy = Sampling(max_new_tokens=cfg.rollout.max_new_tokens, temperature=0.0)
    trajectories = [
        t
        for i, maze in enumerate(eval_mazes(cfg.eval.seed, cfg.eval.num_mazes, cfg.maze.size))
        for t in play_episodes(
            engine, engine.codec, [EpisodeRequest(maze, i)], EpisodeSettings.from_config(cfg), greedy
        )
    ]
    report = eval_report(trajectories, cfg.rollout.max_turns)
    report["replies"] = {t.maze_seed: t.replies for t in trajectories}
    return report


def run_play(server: str, *args: str) -> subprocess.CompletedProcess:
    overrides = [a for o in OVERRIDES for a in ("--set", o)]
    env = {**os.environ, "MAZERL_TOKEN": TOKEN}
    return subprocess.run(
        # the evaluator's config (tests/tiny.yaml): the same pictures, turns and grammar on both sides
        [
            sys.executable,
            str(ROOT / "scripts" / "play.py"),
            "--base-url",
            server,
            "--config",
            str(ROOT / "tests" / "tiny.yaml"),
            *overrides,
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=ROOT,
    )


def test_play_reaches_the_evaluator_solve_rate_with_the_same_actions(server, trained, evaluator_report, tmp_path):
    name, _ = trained
    out, gif = tmp_path / "results.json", tmp_path / "replay.gif"
    started = time.monotonic()
    done = run_play(server, "--model", name, "--json", str(out), "--gif", str(gif), "--concurrency", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    print(f"play.py: {done.stdout.strip()} ({time.monotonic() - started:.1f} s)")
    served = json.loads(out.read_text())
    assert f"solve rate {evaluator_report['solve_rate']:.3f}" in done.stdout
    assert served["solve_rate"] == evaluator_report["solve_rate"]
    assert served["solvable"] == evaluator_report["solvable"]
    by_seed = {m["seed"]: m for m in served["mazes"]}
    for expected in evaluator_report["mazes"]:
        got = by_seed[expected["seed"]]
        assert (got["actions"], got["outcome"], got["turns"]) == (
            expected["actions"],
            expected["outcome"],
            expected["turns"],
        ), expected["seed"]
        assert got["replies"] == evaluator_report["replies"][expected["seed"]]
    # the policy is not trivial: it moves in more than one direction, and the episodes differ
    moves = {a for m in evaluator_report["mazes"] for a in m["actions"] if a and "move" in a}
    assert len(moves) >= 2 and len({tuple(m["actions"]) for m in evaluator_report["mazes"]}) >= 2, moves

    from PIL import Image

    from app.observe.replay import pick_episode

    with Image.open(gif) as image:
        assert image.format == "GIF" and image.n_frames == pick_episode(served["mazes"])["turns"] + 1


def test_play_reports_server_errors(server):
    done = run_play(server, "--model", "global_step_424242", "--seeds", "0")
    assert done.returncode == 1 and "404" in done.stderr and "available" in done.stderr
