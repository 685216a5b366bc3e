"""An exported adapter folder merged into its base model, as a model folder that loads with no adapter.

    .venv/bin/python scripts/merge_adapter.py runs/tiny/export/global_step_000020 /tmp/merged [--base MODEL_DIR]

A run that trains every weight (lora.modules_to_save [visual, language_model]) exports a whole model in adapter
form; the serving app serves it as its model (`python -m app.serve --model /tmp/merged`), vLLM loads it as any
Qwen3-VL folder. A LoRA (or LoRA and vision tower) export merges the same way.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.model.merge import merge_adapter_folder  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("adapter", help="an exported adapter folder (adapter_config.json + adapter_model.safetensors)")
    ap.add_argument("out", help="the model folder to write")
    ap.add_argument("--base", help="the base model's folder (default: the adapter's base_model_name_or_path)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="the saved weights' dtype")
    args = ap.parse_args(argv)
    try:
        out = merge_adapter_folder(args.adapter, args.out, args.base, args.dtype)
    except (OSError, ValueError) as e:
        print(f"merge_adapter: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"model": str(out)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
