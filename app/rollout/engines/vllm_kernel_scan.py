"""vLLM's engine start, shielded from modules that raise on attribute access."""

from __future__ import annotations

import contextlib
import sys
import warnings


def _raises_on_hasattr(value) -> bool:
    try:
        hasattr(value, "__dict__")
        return False
    except Exception:
        return True


@contextlib.contextmanager
def modules_hidden_from_kernel_scan():
    """Hide, while the engine starts, modules holding objects that raise on attribute access.

    vLLM's worker init rebinds Triton kernels by scanning every module in sys.modules and calling
    hasattr() on each module attribute; an unbound context proxy (flask.request, werkzeug LocalProxy,
    pulled in by moto, Ray's dashboard or a user's server) raises RuntimeError there and aborts the
    engine. No vLLM option skips the scan, so those modules leave sys.modules for its duration only.
    """
    hidden = {}
    with warnings.catch_warnings():  # deprecated attributes warn when touched; this look at them is no use of them
        warnings.simplefilter("ignore")
        for name, module in list(sys.modules.items()):
            namespace = getattr(module, "__dict__", None) or {}
            try:
                if any(_raises_on_hasattr(v) for v in list(namespace.values())):
                    hidden[name] = module
            except Exception:
                continue
    for name in hidden:
        del sys.modules[name]
    try:
        yield
    finally:
        for name, module in hidden.items():
            sys.modules.setdefault(name, module)
