"""vLLM's LoRA kernels (shrink, expand) timed on a model's adapted projections under candidate configurations.

The rollout's adapter runs as vLLM's two Triton kernels per adapted projection group and forward pass; on the 8B
workload they took 20% of the round's GPU time with vLLM's default configurations (BENCHMARKS "Where the rollout's
GPU time goes"). This times each kernel the way the engine runs it (inside a CUDA graph, so launch costs do not
count), for the shapes of the model's q/k/v, o, gate/up and down projections at the given token counts, under
vLLM's default configuration and a grid of others, and writes the fastest per shape in vLLM's tuned-configuration
format: a folder to point `VLLM_TUNED_CONFIG_FOLDER` at (`{GPU}_SHRINK.json`, `{GPU}_EXPAND_TRUE.json`, structured
[max_loras + 1][num_slices][m][k][n]; vLLM takes the nearest m, k and n it finds).

    python scripts/bench/lora_kernels.py OUT [--model DIR] [--rank 32] [--tokens 64,3200] [--quick] [--no-grid]

Prints a table (default and best microseconds a call per shape) and, from the calls a round of the loop's workload
makes (13 turns of 16 tokens: one prefill pass and 15 decode passes a turn), the round's LoRA time each way, and
vLLM's default configuration with the grid over the active adapter only (`specialize_active_lora`).

Beside vLLM's kernels it times the same arithmetic as two cuBLAS calls a projection group, for an engine whose one
adapter every token plays: the group's A matrices stacked (one GEMM gives every slice's rank-r product) and its B
matrices block-diagonal (one GEMM adds every slice's output in place). And each way once more with the GPU's L2
cache emptied before every call, as in the engine, where the base layer's GEMM streams the projection's weights
through the cache between two LoRA calls (the emptying's own time is measured alone and taken off). `--no-grid`
skips the configuration search: the comparison alone, in a minute.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import torch

# Qwen3-VL-8B's language model, used without --model
SHAPE_8B = {"hidden_size": 4096, "intermediate_size": 12288, "num_attention_heads": 32, "num_key_value_heads": 8}
MAX_LORAS = 1  # the engine holds one adapter: vLLM sizes its kernels' LoRA dimension max_loras + 1


def projections(text_config: dict) -> dict[str, tuple[int, list[int]]]:
    """Each adapted projection group as vLLM packs it: (input size, output size of each slice)."""
    hidden, inter = text_config["hidden_size"], text_config["intermediate_size"]
    head_dim = text_config.get("head_dim") or hidden // text_config["num_attention_heads"]
    q, kv = text_config["num_attention_heads"] * head_dim, text_config["num_key_value_heads"] * head_dim
    return {
        "qkv": (hidden, [q, kv, kv]),
        "o": (q, [hidden]),
        "gate_up": (hidden, [inter, inter]),
        "down": (inter, [hidden]),
    }


def candidates(op: str, quick: bool) -> list[dict]:
    """The grid searched; every entry carries all the keys vLLM's kernels read."""
    warps, stages = ([4], [2]) if quick else ([4, 8], [2, 3])
    grid = []
    if op == "shrink":
        for bm, bn, bk, sk, w, s in itertools.product(
            [16, 32, 64], [16, 32], [32, 64, 128, 256], [1, 4, 16, 64], warps, stages
        ):
            grid.append(dict(block_m=bm, block_n=bn, block_k=bk, split_k=sk, num_warps=w, num_stages=s))
    else:
        for bm, bn, bk, w, s in itertools.product([16, 32, 64], [32, 64, 128, 256], [16, 32], warps, stages):
            grid.append(dict(block_m=bm, block_n=bn, block_k=bk, num_warps=w, num_stages=s))
    return [{**c, "num_ctas": 1, "group_size_m": 8, "max_nreg": None} for c in grid]


def tuned_tables(best: dict) -> dict[str, dict]:
    """{file name suffix: vLLM's nested table} from {(op, slices, m, k, n): config}."""
    tables: dict[str, dict] = {}
    for (op, slices, m, k, n), config in sorted(best.items()):
        suffix = "SHRINK" if op == "shrink" else "EXPAND_TRUE"  # the engine's expand adds into the base output
        table = tables.setdefault(suffix, {})
        table.setdefault(str(MAX_LORAS + 1), {}).setdefault(str(slices), {}).setdefault(str(m), {}).setdefault(
            str(k), {}
        )[str(n)] = config
    return tables


def write_tables(folder: Path, gpu_name: str, best: dict) -> list[Path]:
    """The files vLLM reads from VLLM_TUNED_CONFIG_FOLDER for this GPU (its name as vLLM spells it)."""
    folder.mkdir(parents=True, exist_ok=True)
    stem = gpu_name.replace(" ", "_").replace("-", "_")
    written = []
    for suffix, table in tuned_tables(best).items():
        path = folder / f"{stem}_{suffix}.json"
        path.write_text(json.dumps(table, indent=1))
        written.append(path)
    return written


def graph_time_us(fn, calls: int = 20, replays: int = 10, before=None) -> float:
    """Microseconds a call, measured over CUDA-graph replays of `calls` calls (the engine's decode runs in graphs).
    before: captured ahead of every call and timed with it (cold_time_us takes its own time off)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # compiles the kernel and fills vLLM's pointer tables before capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            if before is not None:
                before()
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (calls * replays)


class L2Flush:
    """Writes a buffer four times the GPU's L2 cache, so that the next call reads its operands from memory."""

    def __init__(self):
        size = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 * 2**20)
        self.buffer = torch.empty(4 * size, dtype=torch.uint8, device="cuda")
        self.alone_us = graph_time_us(self)

    def __call__(self):
        self.buffer.zero_()


def cold_time_us(fn, flush: L2Flush) -> float:
    """Microseconds a call with the L2 cache emptied before it, the emptying's own time taken off."""
    return max(graph_time_us(fn, before=flush) - flush.alone_us, 0.0)


def dense_lora_(y: torch.Tensor, x: torch.Tensor, a_stacked: torch.Tensor, b_block_diagonal: torch.Tensor, mid):
    """y += x @ A_i.T @ B_i.T for every slice i, in place, as two GEMMs: a_stacked is the slices' A matrices (r x
    in each) one under the other, b_block_diagonal their B matrices (out_i x r) on its diagonal (torch.block_diag),
    mid an (m x slices*r) buffer. vLLM's semantics for one adapter played by every token (scale 1: vLLM's B
    matrices carry the adapter's scaling)."""
    torch.mm(x, a_stacked.t(), out=mid)
    y.addmm_(mid, b_block_diagonal.t())
    return y


def dense_calls(in_size: int, outs: list[int], m: int, rank: int, dev: str = "cuda"):
    """(shrink, expand, both): the dense way's calls for one projection group at m tokens."""
    dtype = torch.bfloat16
    x = torch.randn(m, in_size, device=dev, dtype=dtype)
    a_stacked = torch.randn(len(outs) * rank, in_size, device=dev, dtype=dtype) * 0.01
    b_block = torch.block_diag(*[torch.randn(n, rank, device=dev, dtype=dtype) * 0.01 for n in outs])
    mid = torch.empty(m, len(outs) * rank, device=dev, dtype=dtype)
    y = torch.zeros(m, sum(outs), device=dev, dtype=dtype)
    return (
        lambda: torch.mm(x, a_stacked.t(), out=mid),
        lambda: y.addmm_(mid, b_block.t()),
        lambda: dense_lora_(y, x, a_stacked, b_block, mid),
    )


def kernel_calls(op: str, in_size: int, outs: list[int], m: int, rank: int, specialize: bool = False):
    """(call with a given configuration or None for vLLM's default, (slices, m, k, n) as vLLM keys it).
    specialize: the grid over the active adapters only (vLLM's `specialize_active_lora`), not over max_loras + 1."""
    import vllm.lora.ops.triton_ops.lora_expand_op as expand_op
    import vllm.lora.ops.triton_ops.lora_shrink_op as shrink_op
    from vllm.lora.ops.triton_ops.lora_kernel_metadata import LoRAKernelMeta

    dev, dtype = "cuda", torch.bfloat16
    meta = LoRAKernelMeta.make(MAX_LORAS, m, dev)
    meta.prepare_tensors(torch.zeros(m, dtype=torch.int64, device=dev))  # every token plays the adapter
    args = meta.meta_args(m, specialize_active_lora=specialize)
    x = torch.randn(m, in_size, device=dev, dtype=dtype)
    a = [torch.randn(MAX_LORAS, 1, rank, in_size, device=dev, dtype=dtype) * 0.01 for _ in outs]
    b = [torch.randn(MAX_LORAS, 1, n, rank, device=dev, dtype=dtype) * 0.01 for n in outs]
    mid = torch.zeros(len(outs), m, rank, device=dev, dtype=torch.float32)
    y = torch.zeros(m, sum(outs), device=dev, dtype=dtype)
    module, default = (
        (shrink_op, shrink_op.get_lora_op_configs) if op == "shrink" else (expand_op, expand_op.get_lora_op_configs)
    )

    def call(config: dict | None):
        configs = default if config is None else (lambda *a, **k: config)

        def run():  # vLLM's op reads its configuration through the name its module imported
            module.get_lora_op_configs = configs
            if op == "shrink":
                shrink_op._lora_shrink(x, a, mid, *args, 1.0)
            else:
                expand_op._lora_expand(mid, b, y, *args, offset_start=0, add_inputs=True)

        return run

    key = (len(outs), m, in_size, rank) if op == "shrink" else (len(outs), m, rank, max(outs))
    return call, key


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--model", help="a Qwen3-VL folder (its text_config's shapes); default: Qwen3-VL-8B's")
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--tokens", default="64,3200", help="token counts a pass: the decode batch, a turn's prefill")
    ap.add_argument("--quick", action="store_true", help="one warp count and stage count: a quarter of the grid")
    ap.add_argument("--no-grid", action="store_true", help="vLLM's defaults against the dense way only, no tuning")
    args = ap.parse_args()
    out = Path(args.out)
    text = json.loads((Path(args.model) / "config.json").read_text())["text_config"] if args.model else SHAPE_8B
    gpu = torch.cuda.get_device_name()
    best, rows, start = {}, [], time.perf_counter()
    flush = L2Flush()
    # the decode batch first: its passes are most of a round's, so a run stopped early keeps what matters most
    for m, (name, (in_size, outs)), op in itertools.product(
        [int(t) for t in args.tokens.split(",")], projections(text).items(), ["shrink", "expand"]
    ):
        call, (slices, mm, k, n) = kernel_calls(op, in_size, outs, m, args.rank)
        default_us = graph_time_us(call(None))
        specialized_us = graph_time_us(kernel_calls(op, in_size, outs, m, args.rank, specialize=True)[0](None))
        default_cold_us = cold_time_us(call(None), flush)
        timed = [(default_us, None)]  # None: vLLM's default stays unless a candidate beats it
        for config in [] if args.no_grid else candidates(op, args.quick):
            try:
                timed.append((graph_time_us(call(config)), config))
            except Exception as e:  # a configuration Triton cannot build for this shape (shared memory, registers)
                print(f"  {op} {name} m={m} {config}: {type(e).__name__}", flush=True)
        best_us, fastest = min(timed, key=lambda t: t[0])
        if fastest is not None:
            best[(op, slices, mm, k, n)] = fastest
        row = dict(op=op, module=name, m=m, slices=slices, k=k, n=n, default_us=round(default_us, 2))
        row["default_specialized_us"] = round(specialized_us, 2)
        row["default_cold_us"] = round(default_cold_us, 2)
        dense = dense_calls(in_size, outs, m, args.rank)[0 if op == "shrink" else 1]
        row.update(dense_us=round(graph_time_us(dense), 2), dense_cold_us=round(cold_time_us(dense, flush), 2))
        rows.append({**row, "best_us": round(best_us, 2), "best": fastest or "default"})
        print(json.dumps(rows[-1]), flush=True)
        written = write_tables(out / "lora_configs", gpu, best)  # after every shape: a stopped run keeps its tables
        (out / "lora_kernels.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    # a round of the loop's workload: per projection group and pass one shrink and one expand, 36 layers
    layers = text.get("num_hidden_layers", 36)
    passes = {int(t): (195 if i == 0 else 13) for i, t in enumerate(args.tokens.split(","))}  # decode, then prefill
    timings = ("default_us", "best_us", "default_specialized_us", "default_cold_us", "dense_us", "dense_cold_us")
    round_of = {k: sum(r[k] * passes[r["m"]] * layers for r in rows) / 1e6 for k in timings}
    round_default, round_best, round_specialized = (round_of[k] for k in timings[:3])
    head = f"{'op':7} {'module':8} {'m':>5} {'default us':>11} {'specialized':>11} {'best us':>9}"
    print(head + f" {'cold':>8} {'dense':>8} {'dense cold':>10}")
    for r in rows:
        print(
            f"{r['op']:7} {r['module']:8} {r['m']:5d} {r['default_us']:11.2f} {r['default_specialized_us']:11.2f} "
            f"{r['best_us']:9.2f} {r['default_cold_us']:8.2f} {r['dense_us']:8.2f} {r['dense_cold_us']:10.2f}"
        )
    print(
        f"{gpu}: a round's LoRA kernels {round_default:.3f} s by default, {round_specialized:.3f} s with the grid "
        f"over the active adapter only, {round_best:.3f} s tuned "
        f"({len(written)} files in {out / 'lora_configs'}; {time.perf_counter() - start:.0f} s)"
    )
    print(
        f"L2 emptied before each call ({flush.alone_us:.1f} us a flush, taken off): vLLM's kernels "
        f"{round_of['default_cold_us']:.3f} s a round, the dense way {round_of['dense_cold_us']:.3f} s "
        f"({round_of['dense_us']:.3f} s with a warm L2)"
    )


if __name__ == "__main__":
    main()
