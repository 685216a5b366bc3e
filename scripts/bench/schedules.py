"""One rollout engine configuration measured on the loop's workload: rollout time, GPU busy share, adapter sync.

The workload is scripts/bench/loop.sh's 8B step: 8 mazes x 8 samples, 9x9 mazes at 32 px, 13 turns with the
whole history, 16 new tokens a reply, temperature 1, a random adapter (r32) pushed the way the trainer pushes it
(one packed host buffer). Per configuration (one process each, since vLLM reads its process mode at start):

    python scripts/bench/schedules.py --model DIR --schedule lockstep|continuous [--engine-process] [--graphs]
                                      [--tower] [--keep-weights] [--dense-lora] [--py-spy RAW] [--timeline DIR]

Reported (one JSON line, then a table row): engine start; rollout seconds and generated tokens per round (median of
--rounds after one warm-up round); the GPU's busy share during the rounds (nvidia-smi's utilization, sampled every
100 ms); the sync as the loop does it (asleep -> wake the weights, load the adapter, wake the KV cache) and the
adapter load alone while awake (medians of 3); whether the adapter the worker holds equals the one sent, bit for
bit, after the first load and again after the sleeps; and whether greedy episodes play the same twice in a row and
after the sleeps as before them. On a CPU (no --model) it runs the tiny model, to check the script.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from actors.heap import freeze_heap  # noqa: E402
from app.config import LoraSettings, ModelConfig  # noqa: E402
from app.model import adapters  # noqa: E402
from app.model.build import ensure_model  # noqa: E402
from app.rollout.engines.base import Sampling  # noqa: E402
from app.rollout.engines.vllm import VLLMEngine  # noqa: E402
from app.rollout.episodes import EpisodeRequest, play_episodes  # noqa: E402
from app.world.maze import generate_maze  # noqa: E402
from app.world.rules import EpisodeSettings  # noqa: E402
from scripts.bench import gpu_gaps  # noqa: E402


class GpuBusy:
    """nvidia-smi's utilization of GPU 0, sampled while the block runs (None without nvidia-smi)."""

    def __enter__(self):
        self.samples: list[float] = []
        try:
            self.proc = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits", "-lms", "100"],
                stdout=subprocess.PIPE,
                text=True,
            )
        except FileNotFoundError:
            self.proc = None
            return self
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        return self

    def _read(self):
        for line in self.proc.stdout:
            first = line.strip().splitlines()[0] if line.strip() else ""
            if first.isdigit():
                self.samples.append(float(first))

    def __exit__(self, *exc):
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait()

    @property
    def share(self) -> float | None:
        return round(statistics.mean(self.samples) / 100, 3) if self.samples else None


class FullCollections:
    """The garbage collector's full (generation 2) passes in this process while the block runs: how many, and the
    seconds the thread stood still in them (the episode loop that feeds the engine runs in this process)."""

    def __enter__(self):
        self.pauses, self._start = [], 0.0
        gc.callbacks.append(self._record)
        return self

    def _record(self, phase: str, info: dict) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.pauses.append(time.perf_counter() - self._start)

    def __exit__(self, *exc):
        gc.callbacks.remove(self._record)

    def summary(self) -> dict:
        longest = max(self.pauses, default=0.0)
        return {"n": len(self.pauses), "total_s": round(sum(self.pauses), 3), "max_s": round(longest, 3)}


def sample_this_process(raw_path: str) -> subprocess.Popen:
    """py-spy attached to this process and its children (the engine core) from now on, not through the engine's
    start, whose minutes of compiling a whole-run profile would spend its time on."""
    cmd = ["py-spy", "record", "--pid", str(os.getpid()), "--subprocesses", "--idle", "-r", "100"]
    sampler = subprocess.Popen([*cmd, "--format", "raw", "-o", raw_path])
    time.sleep(2)  # attached before the first round
    return sampler


def play_round(engine, requests, settings, seed: int) -> tuple[float, int, float | None]:
    """One round of the workload: seconds, generated tokens, the GPU's busy share."""
    with GpuBusy() as busy:
        t = time.perf_counter()
        played = play_episodes(engine, engine.codec, requests, settings, Sampling(16, 1.0, seed=seed))
        seconds = time.perf_counter() - t
    return seconds, sum(x.num_generated_tokens for x in played), busy.share


def count_prompt_tokens(engine) -> dict:
    """Counts, from here on, the prompt tokens of every lockstep generate call and those vLLM found cached."""
    counts = {"prompt": 0, "cached": 0}
    generate = engine.llm.generate

    def counted(*args, **kwargs):
        outputs = generate(*args, **kwargs)
        for out in outputs:
            counts["prompt"] += len(out.prompt_token_ids)
            counts["cached"] += out.num_cached_tokens or 0
        return outputs

    engine.llm.generate = counted
    return counts


# GPU kernels by kind, from words in their names (FlashAttention, cuBLAS/CUTLASS GEMMs, vLLM's Triton LoRA kernels)
KERNEL_KINDS = (
    ("lora", ("lora", "sgmv", "bgmv", "punica")),
    ("attention", ("flash", "fmha", "attn", "attention")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "sm80_", "cublas")),
    ("norm/activation", ("rms", "norm", "silu", "act_and_mul", "rotary")),
)


def kernel_kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, words in KERNEL_KINDS if any(w in low for w in words)), "other")


def kernel_times(engine, requests, settings, path: str) -> dict:
    """One round under torch.profiler: the GPU's kernel time by kind and the 25 longest kernels, written to path."""
    from torch.profiler import ProfilerActivity, profile

    gpu = torch.cuda.is_available()  # on a CPU, the operators' own time: a check of the script, not of kernels
    with profile(activities=[ProfilerActivity.CUDA if gpu else ProfilerActivity.CPU]) as prof:
        seconds, _, _ = play_round(engine, requests, settings, 7)
    own = (lambda e: e.self_device_time_total) if gpu else (lambda e: e.self_cpu_time_total)
    kernels = [(e.key, own(e) / 1e6, e.count) for e in prof.key_averages() if own(e) > 0]
    kinds: dict[str, float] = {}
    for name, s, _ in kernels:
        kinds[kernel_kind(name)] = kinds.get(kernel_kind(name), 0.0) + s
    top = sorted(kernels, key=lambda k: -k[1])[:25]
    summary = {
        "round_s": round(seconds, 2),
        "gpu_kernel_s": round(sum(kinds.values()), 3),
        "by_kind_s": {k: round(v, 3) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
        "top": [{"name": n[:160], "s": round(s, 4), "count": c, "kind": kernel_kind(n)} for n, s, c in top],
    }
    Path(path).write_text(json.dumps(summary, indent=1))
    return {k: summary[k] for k in ("round_s", "gpu_kernel_s", "by_kind_s")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a Qwen3-VL folder (scripts/make_model.py --shape 8b); none: the tiny model")
    ap.add_argument("--schedule", choices=["lockstep", "continuous"], default="lockstep")
    ap.add_argument("--engine-process", action="store_true")
    ap.add_argument("--graphs", action="store_true", help="CUDA graphs (enforce_eager off)")
    ap.add_argument("--keep-weights", action="store_true", help="sleep frees the KV cache only")
    ap.add_argument("--logits-processor", action="store_true", help="mask by vllm_logits, not bad words")
    ap.add_argument("--tower", action="store_true", help="the adapter carries the vision tower (modules_to_save)")
    ap.add_argument("--image-history", type=int, default=0, help="rollout.image_history (0: every picture)")
    ap.add_argument("--mazes", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-turns", type=int, default=13)
    ap.add_argument("--json", help="append the result here")
    ap.add_argument("--py-spy", metavar="RAW", help="py-spy samples of the rounds (this process and the engine core)")
    ap.add_argument("--without-lora", action="store_true", help="the rounds again with no adapter in the requests")
    ap.add_argument("--kernels", metavar="JSON", help="one more round under torch.profiler: GPU time by kernel kind")
    ap.add_argument("--timeline", metavar="DIR", help="one more round under vLLM's profiler: the GPU's idle gaps")
    ap.add_argument("--lora-dual-stream", action="store_true", help="VLLM_LORA_ENABLE_DUAL_STREAM: the adapter beside")
    ap.add_argument("--lora-configs", metavar="DIR", help="VLLM_TUNED_CONFIG_FOLDER (scripts/bench/lora_kernels.py's)")
    ap.add_argument("--dense-lora", action="store_true", help="rollout.dense_lora: the adapter as two cuBLAS GEMMs")
    ap.add_argument("--unfrozen-heap", action="store_true", help="no gc.freeze once the engine runs (heap.py)")
    ap.add_argument(
        "--specialize-active-lora", action="store_true", help="vLLM's LoRA grid over the active adapters only"
    )
    args = ap.parse_args()

    gpu = torch.cuda.is_available()
    model_dir = args.model or str(ensure_model(ModelConfig(), "/tmp/mazerl-bench-models"))
    lora = LoraSettings(rank=32, alpha=64) if args.model else LoraSettings(rank=8, alpha=16)
    if args.tower:
        lora.modules_to_save = ["visual"]
    if args.lora_dual_stream:  # vLLM reads both when the engine starts (its engine core inherits them)
        os.environ["VLLM_LORA_ENABLE_DUAL_STREAM"] = "1"
    if args.lora_configs:
        os.environ["VLLM_TUNED_CONFIG_FOLDER"] = str(Path(args.lora_configs).resolve())
    if args.specialize_active_lora:  # an engine argument the product does not pass: given to vllm.LLM here
        import vllm

        vllm.LLM = functools.partial(vllm.LLM, specialize_active_lora=True)
    if args.timeline:  # vLLM's profiler runs where the engine core runs, in this process or its own
        import vllm

        profiler = {"profiler": "torch", "torch_profiler_dir": str(Path(args.timeline).resolve())}
        profiler.update(torch_profiler_with_stack=False, torch_profiler_use_gzip=False)  # plain json writes faster
        vllm.LLM = functools.partial(vllm.LLM, profiler_config=profiler)
    if args.kernels and args.engine_process:
        ap.error("--kernels profiles this process's CUDA work: the engine core must run in it (no --engine-process)")
    start = time.perf_counter()
    engine = VLLMEngine(
        model_dir,
        lora,
        dtype="bfloat16" if gpu else "float32",
        max_model_len=8192,
        max_images=args.max_turns,
        gpu_memory_utilization=0.45,
        sleep_level=1,
        enforce_eager=not args.graphs,
        schedule=args.schedule,
        engine_process=args.engine_process,
        keep_weights=args.keep_weights,
        forbid_with="logits_processor" if args.logits_processor else "bad_words",
        dense_lora=args.dense_lora,
    )
    if not args.unfrozen_heap:  # as the rollout actor does once its engine has started
        freeze_heap()
    result = {
        "image_history": args.image_history,
        "schedule": args.schedule,
        "engine_process": args.engine_process,
        "graphs": args.graphs,
        "keep_weights": args.keep_weights,
        "tower": args.tower,
        "bad_words": not args.logits_processor,
        "lora_dual_stream": os.environ.get("VLLM_LORA_ENABLE_DUAL_STREAM", "0") == "1",
        "lora_configs": os.environ.get("VLLM_TUNED_CONFIG_FOLDER"),
        "specialize_active_lora": args.specialize_active_lora,
        "dense_lora": args.dense_lora,
        "frozen_heap": not args.unfrozen_heap,
        "engine_start_s": round(time.perf_counter() - start, 1),
    }
    dtype = torch.bfloat16 if gpu else torch.float32
    g = torch.Generator(device="cuda" if gpu else "cpu").manual_seed(0)
    device = "cuda" if gpu else "cpu"
    tensors = {k: torch.randn(s, generator=g, device=device, dtype=dtype) * 0.01 for k, s in engine.spec.shapes.items()}
    packed = adapters.pack(tensors)  # what the trainer hands the rollout actors
    engine.load_lora(packed, 0)
    sent = adapters.held_form(tensors, lora.rank, lora.alpha, dtype)

    def held_as_sent() -> bool:  # what the worker holds, read back, against what was sent
        held = engine.lora_state()
        return set(held) == set(sent) and all(torch.equal(held[k], sent[k].cpu()) for k in sent)

    result["held_equal"] = held_as_sent()

    settings = EpisodeSettings(args.max_turns, 9, 32, args.image_history, 8192)
    requests = [EpisodeRequest(generate_maze(100 + i // 8, 9), i // 8, i % 8) for i in range(args.mazes * 8)]

    def probe() -> list[list[str]]:  # greedy replies: the same before and after sleeping, or the sleep broke state
        return [t.replies for t in play_episodes(engine, engine.codec, requests[:8:2], settings, Sampling(16, 0.0))]

    before = probe()
    result["same_twice"] = probe() == before  # greedy play repeats itself before any sleep (else: not a sleep's doing)
    syncs, loads = [], []
    for version in (1, 2, 3):
        engine.sleep()
        t = time.perf_counter()
        engine.load_lora(packed, version)
        engine.wake()
        syncs.append(time.perf_counter() - t)
        t = time.perf_counter()
        engine.load_lora(packed, version + 10)
        loads.append(time.perf_counter() - t)
    result.update(sync_s=round(statistics.median(syncs), 3), load_awake_s=round(statistics.median(loads), 3))
    engine.load_lora(packed, 0)
    result["held_equal_after"] = held_as_sent()
    result["same_after_sleeps"] = probe() == before
    play_episodes(engine, engine.codec, requests[:16], settings, Sampling(16, 1.0, seed=99))  # warm-up
    prompts = count_prompt_tokens(engine) if args.schedule == "lockstep" else None
    rounds = []
    sampler = sample_this_process(args.py_spy) if args.py_spy else None
    with FullCollections() as collections:
        for r in range(args.rounds):
            rounds.append(play_round(engine, requests, settings, r))
    if sampler is not None:
        sampler.send_signal(signal.SIGINT)  # py-spy writes its samples when interrupted
        sampler.wait(timeout=120)
    result.update(
        rollout_s=round(statistics.median(s for s, _, _ in rounds), 2),
        rollout_rounds_s=[round(s, 2) for s, _, _ in rounds],
        generated_tokens=[n for _, n, _ in rounds],
        gpu_busy=[b for _, _, b in rounds],
        full_collections=collections.summary(),
    )
    if prompts is not None:  # how much of each prompt vLLM's prefix cache already held
        result.update(prompt_tokens=prompts["prompt"], prefix_cached_tokens=prompts["cached"])
    if args.without_lora:
        adapter = engine._lora_request  # the bench plays the same engine both ways; the product always sets one
        engine._lora_request = None
        bare = [play_round(engine, requests, settings, r) for r in range(args.rounds)]
        engine._lora_request = adapter
        result.update(
            rollout_without_lora_s=round(statistics.median(s for s, _, _ in bare), 2),
            rollout_without_lora_rounds_s=[round(s, 2) for s, _, _ in bare],
            gpu_busy_without_lora=[b for _, _, b in bare],
        )
    if args.kernels:
        result["kernels"] = kernel_times(engine, requests, settings, args.kernels)
    if args.timeline:
        engine.llm.start_profile()
        with FullCollections() as collections:
            seconds, _, _ = play_round(engine, requests, settings, 8)
        engine.llm.stop_profile()
        trace = gpu_gaps.newest_trace(args.timeline)
        gaps = gpu_gaps.gaps_summary(gpu_gaps.device_intervals(gpu_gaps.read_trace(trace))) if trace else {}
        result["timeline"] = {
            "round_s": round(seconds, 2),
            "trace": str(trace),
            "full_collections": collections.summary(),
            **gaps,
        }
    engine.shutdown()
    print(json.dumps(result), flush=True)
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(result) + "\n")
    # the engine core's process takes 40 s and more to go at the interpreter's exit, after the result is written:
    # it is killed and waited for (left behind, it would hold the GPU's memory from the next configuration's run)
    sys.stdout.flush()
    children = psutil.Process().children(recursive=True)
    for child in children:
        child.kill()
    psutil.wait_procs(children, timeout=60)
    os._exit(0)


if __name__ == "__main__":
    main()
