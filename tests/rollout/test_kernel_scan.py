"""The guard around vLLM's engine start: modules whose attributes raise leave sys.modules for its duration only,
and looking at every module's attributes says nothing to the user."""

import contextvars
import sys
import types
import warnings

import torch.distributed  # noqa: F401  (holds a deprecated attribute that warns when touched)
from werkzeug.local import LocalProxy

from app.rollout.engines.vllm_kernel_scan import modules_hidden_from_kernel_scan


def test_a_module_holding_an_unbound_proxy_is_hidden_during_the_start_and_back_after():
    trap = types.ModuleType("_mazerl_kernel_scan_trap")
    trap.request = LocalProxy(contextvars.ContextVar("unbound"), unbound_message="unbound proxy touched")
    sys.modules[trap.__name__] = trap
    try:
        with modules_hidden_from_kernel_scan():
            assert trap.__name__ not in sys.modules
            assert "torch" in sys.modules  # modules whose attributes answer stay
        assert sys.modules[trap.__name__] is trap
    finally:
        sys.modules.pop(trap.__name__, None)


def test_the_scan_itself_raises_no_deprecation_warnings():
    """Touching `torch.distributed.reduce_op` warns; the scan looks at it like any attribute and must stay quiet."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with modules_hidden_from_kernel_scan():
            pass
    assert [str(w.message) for w in caught] == []
