"""vLLM's multimodal placeholder scans against those of app/rollout/engines/vllm_front_end.py, on one turn's prompt.

    python scripts/bench/vllm_front_end.py [--history 2000] [--run 81] [--repeats 7]

The prompt: `--history` text tokens, then the picture's `--run` placeholder tokens and two more, as a rollout turn
with the whole history sends it. Reported: microseconds a prompt (median of --repeats, 100 prompts each) of the
installed vLLM's `_iter_placeholders` and `iter_token_matches` (its own, before any install) and of ours.
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from app.rollout.engines import vllm_front_end  # noqa: E402


def micros(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(100):
            list(fn())
        times.append((time.perf_counter() - t) / 100)
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--history", type=int, default=2000)
    ap.add_argument("--run", type=int, default=81)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    import vllm
    from vllm.multimodal.processing import processor

    own_matches, own_placeholders = vllm_front_end.originals(processor)  # its own, before any install
    ids = [i % 50 + 100 for i in range(args.history)] + [7] * args.run + [1, 2]
    update = SimpleNamespace(content=SimpleNamespace(full=[7] * args.run, is_embed=None))
    updates = {"image": [[update]]}
    if len(inspect.signature(own_placeholders).parameters) == 3:  # vLLM 0.26 takes the tokenizer
        processor_args = (ids, updates, None)
        ours = vllm_front_end.placeholder_scan(processor, takes_tokenizer=True)
    else:
        processor_args = (ids, updates)
        ours = vllm_front_end.placeholder_scan(processor, takes_tokenizer=False)
    rows = [
        (
            "_iter_placeholders",
            micros(lambda: own_placeholders(*processor_args), args.repeats),
            micros(lambda: ours(*processor_args), args.repeats),
        ),
        (
            "iter_token_matches",
            micros(lambda: own_matches(ids, [7]), args.repeats),
            micros(lambda: vllm_front_end.token_matches(ids, [7]), args.repeats),
        ),
    ]
    print(f"vLLM {vllm.__version__}, a prompt of {len(ids)} tokens")
    print(f"{'scan':20} {'vLLM us':>9} {'ours us':>9} {'ratio':>6}")
    for name, theirs, mine in rows:
        print(f"{name:20} {theirs:9.1f} {mine:9.1f} {theirs / mine:6.1f}")


if __name__ == "__main__":
    main()
