"""The CPU runtime's streaming copies (runtime/_streamcopy.c) give numpy's bytes, at every size and alignment."""

from __future__ import annotations

import numpy as np
import pytest

from blink_horovod import cbuild
from blink_horovod.config import load_config
from blink_horovod.runtime import streamcopy
from blink_horovod.runtime.streamcopy import STREAM_MIN_BYTES, Copier

pytestmark = pytest.mark.timeout(120)

native = pytest.mark.skipif(not Copier().streaming, reason="no C compiler: copies are numpy's here")


@native
@pytest.mark.parametrize("nbytes", [STREAM_MIN_BYTES, STREAM_MIN_BYTES + 1, STREAM_MIN_BYTES + 63, 3 << 20])
@pytest.mark.parametrize("dst_off", [0, 1, 8, 15])
@pytest.mark.parametrize("src_off", [0, 3])
def test_copy_matches_numpy_at_any_alignment(nbytes: int, dst_off: int, src_off: int) -> None:
    rng = np.random.default_rng(nbytes + 16 * dst_off + src_off)
    src_buf = rng.integers(0, 256, nbytes + 64, dtype=np.uint8)
    dst_buf = np.full(nbytes + 64, 0xAB, np.uint8)
    src = src_buf[src_off : src_off + nbytes]
    dst = dst_buf[dst_off : dst_off + nbytes]
    Copier().copy(dst, src)
    assert np.array_equal(dst, src)
    # not a byte outside the destination
    assert (dst_buf[:dst_off] == 0xAB).all() and (dst_buf[dst_off + nbytes :] == 0xAB).all()


@native
@pytest.mark.parametrize("dtype", ["float32", "float64", "int64", "float16"])
def test_copy2_writes_both_destinations(dtype: str) -> None:
    n = (5 * STREAM_MIN_BYTES + 12) // np.dtype(dtype).itemsize
    src = np.arange(n).astype(dtype)
    a, b = np.zeros(n, dtype), np.ones(n, dtype)
    Copier().copy2(a, b, src)
    assert np.array_equal(a, src) and np.array_equal(b, src)


def test_small_or_strided_or_disabled_copies_are_numpy_and_still_right() -> None:
    off = Copier(enabled=False)
    assert not off.streaming
    for c in (off, Copier()):
        src = np.arange(1 << 20, dtype=np.float32)
        dst = np.zeros_like(src)
        c.copy(dst[::2], src[::2])  # strided: never the native path
        assert np.array_equal(dst[::2], src[::2]) and not dst[1::2].any()
        small = np.zeros(100, np.float32)
        c.copy(small, src[:100])
        assert np.array_equal(small, src[:100])
        x, y = np.zeros(7, np.int32), np.zeros(7, np.int32)
        c.copy2(x, y, np.arange(7, dtype=np.int32))
        assert x.tolist() == y.tolist() == list(range(7))


def test_status_says_how_copies_run() -> None:
    line = streamcopy.status()
    assert line.startswith(("streaming stores", "memcpy", "numpy copies"))


def test_stream_copy_variable() -> None:
    assert load_config({}).stream_copy is True
    assert load_config({"BLINK_STREAM_COPY": "0"}).stream_copy is False


def test_every_c_source_is_built_or_explained(tmp_path, monkeypatch) -> None:
    """A fresh cache folder: cbuild compiles each source into it (or raises a clear OSError without a compiler)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    for name in cbuild.SOURCES:
        try:
            lib = cbuild.load(name)
        except OSError as exc:
            assert "compiler" in str(exc) or "exited" in str(exc)
            continue
        assert str(tmp_path) in lib._name
    # a source that does not compile names the compiler's complaint
    bad = tmp_path / "bad.c"
    bad.write_text("int f( {")
    monkeypatch.setitem(cbuild.SOURCES, "bad", (bad, ("-O2", "-fPIC", "-shared")))
    with pytest.raises(OSError, match="exited|compiler"):
        cbuild.load("bad")
