"""The vision tower's patch embedding, transformers' Conv3d against the matrix product the product computes
(app/model/vision_patches.py), side by side on this machine's CPU or GPU.

Qwen3-VL-8B's tower by default (1,152 wide, 3 x 2 x 16 x 16 pixels a patch); the patch count of a train step of the
loop's 8B workload by default: 64 episodes x 13 pictures x 324 patches (a 9x9 maze at 32 px is 288 px square).
Times the forward alone (a frozen tower: no gradient) and the forward and backward (a trained tower), median of
--repeats after a warm-up, in each dtype.

    python scripts/bench/patch_embed.py [--device cuda] [--patches 269568] [--hidden 1152] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionPatchEmbed

from app.model.vision_patches import use_linear_patch_embed


class TowerShape:
    patch_size, temporal_patch_size, in_channels = 16, 2, 3

    def __init__(self, hidden: int):
        self.hidden_size = hidden


def timed(step, device: str, repeats: int) -> float:
    step()  # warm-up: kernel selection, allocator
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--patches", type=int, default=64 * 13 * 324)
    ap.add_argument("--hidden", type=int, default=1152)
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    torch.manual_seed(0)
    print(f"{args.device}, {args.patches} patches, hidden {args.hidden}, median of {args.repeats}")
    print(f"{'dtype':9} {'pass':17} {'Conv3d':>10} {'product':>10} {'ratio':>7}")
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        conv = Qwen3VLVisionPatchEmbed(TowerShape(args.hidden)).to(args.device, dtype)
        product = Qwen3VLVisionPatchEmbed(TowerShape(args.hidden)).to(args.device, dtype)
        product.load_state_dict(conv.state_dict())
        assert use_linear_patch_embed(product) == 1
        pixels = torch.randn(args.patches, 3 * 2 * 16 * 16, device=args.device, dtype=dtype)

        def forward(module):
            with torch.no_grad():
                module(pixels)

        def train(module):
            module.zero_grad(set_to_none=True)
            module(pixels).float().square().mean().backward()

        for label, step in (("forward", forward), ("forward+backward", train)):
            a = timed(lambda: step(conv), args.device, args.repeats)
            b = timed(lambda: step(product), args.device, args.repeats)
            print(f"{name:9} {label:17} {a * 1e3:8.2f}ms {b * 1e3:8.2f}ms {a / b:6.1f}x", flush=True)


if __name__ == "__main__":
    main()
