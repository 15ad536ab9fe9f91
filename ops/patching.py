"""Replace a function everywhere it was imported, and step around the replacement when asked.

Horovod's modules import each other's functions by name (``horovod/torch/
optimizer.py``: ``from horovod.torch.mpi_ops import allreduce_async_,
synchronize``), so patching one module attribute is not enough: the hook
replaces every binding of the original object in every module of the package
(the Python counterpart of symbol interposition, which is what the paper's
``LD_PRELOAD`` relies on).

:func:`bypass` is a context manager under which the replacements call the
originals -- how ``blink perf --impl horovod``, the demo and the benchmarks
time stock Horovod in the same process.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from typing import Any
from collections.abc import Callable, Iterator

__all__ = ["Originals", "bypass", "bypassed", "originals", "replace_everywhere"]

_tls = threading.local()


@contextlib.contextmanager
def bypass() -> Iterator[None]:
    """Within this block (this thread), patched Horovod functions run stock Horovod."""
    depth = getattr(_tls, "depth", 0)
    _tls.depth = depth + 1
    try:
        yield
    finally:
        _tls.depth = depth


def bypassed() -> bool:
    """True inside :func:`bypass` on this thread."""
    return getattr(_tls, "depth", 0) > 0


class Originals(dict):
    """name -> the original object, per patched module."""


_originals: dict[str, Originals] = {}


def originals(module_name: str) -> Originals:
    """The original functions the hook replaced in ``module_name`` (empty if not patched)."""
    return _originals.setdefault(module_name, Originals())


def replace_everywhere(package: str, module: Any, name: str, new: Callable) -> Callable:
    """Set ``module.name = new`` and rebind every other reference to the old object under ``package``.

    Returns the original.  Idempotent: a second call for the same name keeps
    the first original.
    """
    store = originals(module.__name__)
    old = store.get(name, getattr(module, name))
    store.setdefault(name, old)
    current = getattr(module, name)
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or not (mod_name == package or mod_name.startswith(package + ".")):
            continue
        d = getattr(mod, "__dict__", None)
        if not d:
            continue
        for attr, value in list(d.items()):
            if value is old or value is current:
                setattr(mod, attr, new)
    setattr(module, name, new)
    return old
