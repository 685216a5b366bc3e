"""Benchmark maze generation and rendering: mazes per second on 9x9 mazes at 25 px per cell.

    python scripts/bench/maze.py [--n 10000] [--repeats 3]

Each figure is the median over the repetitions, because timings on a small shared machine are noisy.
Rendered images are dropped as soon as they are made: keeping 10k of them (1.5 GB) would measure
the memory allocator rather than the renderer.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

# Run as a plain script from anywhere: make the repository root importable.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.world.maze import Maze, generate_maze  # noqa: E402
from app.world.render import render  # noqa: E402

SIZE = 9
CELL_PX = 25


def time_generation(seeds: range) -> tuple[float, list[Maze]]:
    started = time.perf_counter()
    mazes = [generate_maze(seed, SIZE) for seed in seeds]
    return time.perf_counter() - started, mazes


def time_rendering(mazes: list[Maze]) -> float:
    started = time.perf_counter()
    for maze in mazes:
        render(maze, maze.start, CELL_PX)
    return time.perf_counter() - started


def time_both(seeds: range) -> float:
    started = time.perf_counter()
    for seed in seeds:
        maze = generate_maze(seed, SIZE)
        render(maze, maze.start, CELL_PX)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=10_000, help="mazes per repetition (seeds 0..n-1)")
    parser.add_argument("--repeats", type=int, default=3, help="repetitions; the median is reported")
    args = parser.parse_args()
    if args.n < 1 or args.repeats < 1:
        parser.error("--n and --repeats must be at least 1")

    seeds = range(args.n)
    generation, rendering, both = [], [], []
    for _ in range(args.repeats):
        seconds, mazes = time_generation(seeds)
        generation.append(seconds)
        rendering.append(time_rendering(mazes))
        both.append(time_both(seeds))

    print(
        f"{args.n} mazes {SIZE}x{SIZE}, {CELL_PX} px/cell, median of {args.repeats}; "
        f"python {platform.python_version()} on {platform.machine()}"
    )
    for name, times in [("generate", generation), ("render", rendering), ("generate+render", both)]:
        median = statistics.median(times)
        print(f"{name:>16}: {args.n / median:8.0f} mazes/s  ({median:.2f} s per {args.n})")


if __name__ == "__main__":
    main()
