"""The ``BLINK_ENABLE=1`` import hook: Horovod patched right after it is imported, no code change.

Blink (Wang et al., MLSys 2020, section 4) slid under unmodified TensorFlow
and PyTorch jobs by ``LD_PRELOAD``-ing a library that exports NCCL's
symbols.  Python's counterpart of symbol interposition is an import hook: a
``.pth`` file installed with the package (``blink_horovod_hook.pth``, see
``setup.py``) runs at interpreter start-up and, only when ``BLINK_ENABLE`` is
set to a true value, calls :func:`install`, which puts a finder at the front
of ``sys.meta_path``.  The finder wraps the loaders of ``horovod.torch``,
``horovod.tensorflow`` and ``horovod.tensorflow.keras``: the module executes
as usual, and the Blink adapter patches it before the importer sees it.

Without ``BLINK_ENABLE`` the ``.pth`` line imports nothing and changes
nothing.  :func:`install` may also be called by hand (then modules already
imported are patched at once).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from typing import Any

__all__ = ["TARGETS", "install", "installed", "patch_module"]

# module -> the adapter that patches it
TARGETS = {
    "horovod.torch": "blink_horovod.ops.torch_ops",
    "horovod.tensorflow": "blink_horovod.ops.tf_ops",
    "horovod.tensorflow.keras": "blink_horovod.ops.keras_ops",
}

_FINDER: _BlinkFinder | None = None


def patch_module(fullname: str, module: Any) -> None:
    """Run the adapter of ``fullname`` on the freshly imported ``module``."""
    adapter = importlib.import_module(TARGETS[fullname])
    adapter.install(module)


class _PatchingLoader(importlib.abc.Loader):
    """Delegates to the real loader, then patches the module it executed."""

    def __init__(self, inner: importlib.abc.Loader, fullname: str) -> None:
        self.inner = inner
        self.fullname = fullname

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:
        self.inner.exec_module(module)
        patch_module(self.fullname, module)

    def __getattr__(self, name: str) -> Any:  # get_resource_reader, is_package, ... of the real loader
        return getattr(self.inner, name)


class _BlinkFinder(importlib.abc.MetaPathFinder):
    """Finds the targets with the other finders and wraps their loaders."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in TARGETS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and not isinstance(spec.loader, _PatchingLoader):
            spec.loader = _PatchingLoader(spec.loader, fullname)
        return spec


def installed() -> bool:
    """True once :func:`install` has put the finder in place."""
    return _FINDER is not None and _FINDER in sys.meta_path


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (idempotent); patch targets already imported.

    Validates the ``BLINK_*`` configuration first (``ConfigError`` naming
    the variable), so a typo does not silently leave Blink out.
    """
    global _FINDER
    from ..config import load_config

    cfg = load_config()
    if not cfg.enable:
        return
    if not installed():
        _FINDER = _BlinkFinder()
        sys.meta_path.insert(0, _FINDER)
    for name in TARGETS:
        mod = sys.modules.get(name)
        if mod is not None:
            patch_module(name, mod)
