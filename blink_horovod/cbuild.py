"""C sources of this package compiled once per machine and loaded through ctypes.

Three parts of blink_horovod have a C twin of a hot loop: the simulator's event
loop (``sim/_fluid.c``), the CPU runtime's streaming copies
(``runtime/_streamcopy.c``) and the GPU executor's repeated collective
(``runtime/gpu/_replay.c``); and one C++ piece must be native code: the
terminate handler that names dead ranks when Horovod aborts
(``runtime/_last_words.cc``).  Each is built on first use with the system C
compiler (``$CC``, else ``cc`` or ``gcc``) into the user's cache directory
(``$XDG_CACHE_HOME/blink_horovod``, else ``~/.cache/blink_horovod``; the
temporary directory where home is read-only), keyed by a hash of the source
and flags, so an edited source is rebuilt and an unchanged one never is.
``make install`` builds them ahead (``python -m blink_horovod.cbuild``).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from collections.abc import Sequence

__all__ = ["SOURCES", "cache_dir", "load"]

BUILD_TIMEOUT_S = 120
_PACKAGE = Path(__file__).parent
# name -> (source, compiler flags); what `python -m blink_horovod.cbuild` builds.
SOURCES: dict[str, tuple[Path, tuple[str, ...]]] = {
    "fluid": (_PACKAGE / "sim" / "_fluid.c", ("-O2", "-fPIC", "-shared", "-ffp-contract=off", "-fno-fast-math")),
    "streamcopy": (_PACKAGE / "runtime" / "_streamcopy.c", ("-O2", "-fPIC", "-shared")),
    "replay": (_PACKAGE / "runtime" / "gpu" / "_replay.c", ("-O2", "-fPIC", "-shared")),
    # C++ (gcc compiles .cc as C++): must share the process's libstdc++, whose terminate handler it sets.
    "last_words": (_PACKAGE / "runtime" / "_last_words.cc",
                   ("-O2", "-fPIC", "-shared", "-pthread", "-Wl,--no-as-needed", "-lstdc++")),
}


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "blink_horovod"


def _build(source: Path, flags: Sequence[str], target: Path) -> None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise OSError("no C compiler (cc or gcc) on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: processes building at once never load a partial file.
    fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *flags, "-o", tmp, str(source)], check=False, capture_output=True, text=True,
                              timeout=BUILD_TIMEOUT_S)
        if proc.returncode != 0:
            raise OSError(f"{cc} exited {proc.returncode}: {proc.stderr.strip()[-500:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load(name: str) -> ctypes.CDLL:
    """The library built from ``SOURCES[name]`` (built now if it is not yet).

    Raises ``OSError`` or ``subprocess.SubprocessError`` where it cannot be built or loaded.
    """
    source, flags = SOURCES[name]
    digest = hashlib.sha256(source.read_bytes() + " ".join(flags).encode()).hexdigest()[:16]
    target = cache_dir() / f"{name}-{digest}.so"
    if not target.exists():
        try:
            _build(source, flags, target)
        except PermissionError:  # a read-only home: the temporary directory instead
            target = Path(tempfile.gettempdir()) / f"blink_horovod-{os.getuid()}" / target.name
            if not target.exists():
                _build(source, flags, target)
    return ctypes.CDLL(str(target))


def main() -> int:
    """Build every C source now; one line each saying where it is or why it could not be built."""
    rc = 0
    for name in SOURCES:
        try:
            print(f"[cbuild] {name}: {load(name)._name}")
        except (OSError, subprocess.SubprocessError) as exc:
            print(f"[cbuild] {name}: not built ({exc}); the Python fallback will be used", file=sys.stderr)
            rc = 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
