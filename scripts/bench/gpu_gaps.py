"""Where the GPU waits: the idle time between the kernels of a torch profiler trace, by the length of each gap.

    python scripts/bench/gpu_gaps.py TRACE.pt.trace.json[.gz]

A rollout round's GPU is idle a third of the phase (BENCHMARKS "Where the rollout's GPU time goes"); the lengths of
the idle gaps say whose time it is: gaps of microseconds sit between the kernels of one forward pass, gaps of a
millisecond or so between an engine's steps (its scheduler, sampling, output handling on the host), and gaps of
tens of milliseconds between the turns of a lockstep round (the replies handed back, the next prompts rendered and
added). The trace is the one vLLM's torch profiler writes (`profiler_config`, `LLM.start_profile`), or any chrome
trace whose device work is events of category kernel, gpu_memcpy or gpu_memset. Printed: a JSON summary.
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

DEVICE_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}
# upper bounds of the gap classes, microseconds: within a pass, between passes, between steps, between turns
GAP_CLASSES = ((20, "under 20 us"), (200, "20-200 us"), (2_000, "0.2-2 ms"), (20_000, "2-20 ms"), (None, "20 ms+"))


def device_intervals(trace: dict) -> list[tuple[float, float]]:
    """(start, end) in microseconds of every kernel, copy and fill the trace holds, in start order."""
    events = trace.get("traceEvents", trace) if isinstance(trace, dict) else trace
    spans = [
        (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)))
        for e in events
        if isinstance(e, dict) and e.get("ph") == "X" and e.get("cat") in DEVICE_CATEGORIES
    ]
    return sorted(spans)


def gaps_summary(intervals: list[tuple[float, float]], longest: int = 10) -> dict:
    """The span from the first kernel's start to the last one's end, the time covered by at least one kernel (busy;
    kernels on several streams count once), and the idle gaps in classes by length: count and seconds each."""
    if not intervals:
        return {"kernels": 0}
    classes = {name: [0, 0.0] for _, name in GAP_CLASSES}
    busy, gaps = 0.0, []
    start, end = intervals[0]
    for s, e in intervals[1:]:
        if s > end:  # a gap: the merged run so far ends here
            busy += end - start
            gaps.append((s - end, end))
            start, end = s, e
        else:
            end = max(end, e)
    busy += end - start
    first = intervals[0][0]
    for length, at in gaps:
        name = next(n for bound, n in GAP_CLASSES if bound is None or length < bound)
        classes[name][0] += 1
        classes[name][1] += length / 1e6
    span = (end - first) / 1e6
    return {
        "kernels": len(intervals),
        "span_s": round(span, 6),
        "busy_s": round(busy / 1e6, 6),
        "busy_share": round(busy / 1e6 / span, 4) if span > 0 else None,
        "idle_s": round(span - busy / 1e6, 6),
        "gaps": {name: {"count": n, "s": round(s, 6)} for name, (n, s) in classes.items()},
        "longest_ms": [
            {"ms": round(length / 1e3, 2), "at_s": round((at - first) / 1e6, 3)}
            for length, at in sorted(gaps)[::-1][:longest]
        ],
    }


def read_trace(path: str | Path) -> dict:
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def newest_trace(folder: str | Path) -> Path | None:
    """The trace file a profiler last wrote in folder (tensorboard_trace_handler's names end .pt.trace.json[.gz])."""
    traces = [p for p in Path(folder).rglob("*.pt.trace.json*") if p.is_file()]
    return max(traces, key=lambda p: p.stat().st_mtime) if traces else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    args = ap.parse_args()
    print(json.dumps(gaps_summary(device_intervals(read_trace(args.trace))), indent=1))


if __name__ == "__main__":
    main()
