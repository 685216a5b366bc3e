"""Builds the tiny Qwen3-VL-architecture model of configs/tiny.yaml (random weights, local tokenizer, no hub).

    python scripts/make_tiny_model.py OUT

Same as `python scripts/make_model.py OUT --shape tiny`; other shapes (the 8B one) are in make_model.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.make_model import main  # noqa: E402

if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1].startswith("-"):
        sys.exit(__doc__)
    sys.argv += ["--shape", "tiny"]
    main()
