"""An actor's long-lived heap kept out of the garbage collector's full passes.

A rollout or trainer process holds ~750,000 objects that the garbage collector tracks once torch, transformers and
vLLM are imported and the model is built, and every one of them lives as long as the process. CPython's full
collection walks them all (0.4-0.7 s on the 2-core CPU), and it runs whenever enough younger objects have survived:
in the middle of a rollout that is a pause of the host thread that feeds the GPU. Freezing them (`gc.freeze`, what
vLLM's engine core does to its own process after it starts) moves them to a generation no collection scans; objects
created afterwards are collected as before, and a frozen object freed by its reference count is freed as before.
"""

from __future__ import annotations

import gc


def freeze_heap() -> int:
    """Collects what is garbage now, then freezes every object left; returns how many objects are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
