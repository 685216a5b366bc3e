"""Builds a Qwen3-VL-architecture model folder (HF format) from a config, with no hub access.

python scripts/make_model.py OUT                      the tiny model of configs/tiny.yaml (CPU)
python scripts/make_model.py OUT --shape 8b           Qwen3-VL-8B's shape, random bf16 weights (GPU)
"""

from __future__ import annotations

import argparse
import time

from app.config import TinyModelShape
from app.model.build import build_8b_shaped_model, build_tiny_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--shape", choices=["tiny", "8b"], default="tiny")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    start = time.perf_counter()
    if args.shape == "8b":
        build_8b_shaped_model(args.out, args.device)
    else:
        build_tiny_model(TinyModelShape(), args.out)
    print(f"built {args.shape} model in {args.out} in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
