"""The tree kernel's element functions, compiled for the host with g++, against numpy bit for bit.

The same source (:func:`blink_horovod.runtime.gpu.kernels.acc_source`) is
what NVRTC compiles on the GPU machine ahead of ``trees.cu``; here ``g++``
builds it into a shared library and every dtype/op is compared with the CPU
runtime's reductions (:func:`blink_horovod.runtime.dtypes.reduce_to`),
including float16/bfloat16 rounding, subnormals, infinities, NaN propagation
and integer wrap-around.  When ``nvcc`` is installed the whole kernel source
is also compiled for sm_90.
"""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess

import numpy as np
import pytest

from blink_horovod.runtime.dtypes import (
    DTYPES,
    bf16_to_f32,
    f32_to_bf16,
    finish_average,
    numpy_dtype,
    reduce_to,
)
from blink_horovod.runtime.gpu.kernels import KERNEL_OPS, host_test_source
from blink_horovod.runtime.gpu.tree_executor import ARGS_DTYPE, kernel_source

pytestmark = pytest.mark.timeout(300)

GXX = shutil.which("g++")


@pytest.fixture(scope="module")
def libs(tmp_path_factory):
    if GXX is None:
        pytest.skip("g++ not installed")
    d = tmp_path_factory.mktemp("kernels")
    out = {}
    for dt in DTYPES:
        src = d / f"{dt}.cpp"
        so = d / f"{dt}.so"
        src.write_text(host_test_source(dt))
        # -ffp-contract=off: no fused multiply-add, as numpy's separate ufunc steps.
        subprocess.run([GXX, "-O2", "-ffp-contract=off", "-shared", "-fPIC", "-x", "c++", str(src), "-o", str(so)],
                       check=True, capture_output=True)
        out[dt] = ctypes.CDLL(str(so))
    return out


def storage(dt: str) -> np.dtype:
    return np.dtype(np.uint16) if dt in ("float16", "bfloat16") else numpy_dtype(dt)


def sample(dt: str, n: int, rng: np.random.Generator) -> np.ndarray:
    """Storage-typed values: random bits for floats (all classes), full range for integers."""
    if dt in ("float16", "bfloat16"):
        x = rng.integers(0, 1 << 16, n, dtype=np.uint32).astype(np.uint16)
        x[:8] = [0, 0x8000, 0x7C00 if dt == "float16" else 0x7F80, 1, 0x3C00 if dt == "float16" else 0x3F80, 0x7BFF, 0x0400, 0x7E00]
        return x
    if dt in ("float32", "float64"):
        dtype = np.dtype(dt)
        bits = rng.integers(0, 1 << 62, n, dtype=np.int64).astype(np.uint64)
        x = (bits.astype(np.uint32) if dt == "float32" else bits).view(dtype).copy()
        x[: n // 2] = rng.standard_normal(n // 2).astype(dtype)
        x[:6] = [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45 if dt == "float32" else 5e-324]
        return x
    info = np.iinfo(numpy_dtype(dt))
    return rng.integers(info.min, info.max, n, endpoint=True).astype(numpy_dtype(dt))


def as_values(x: np.ndarray, dt: str) -> np.ndarray:
    """Numpy values of storage ``x`` (bfloat16 via float32)."""
    if dt == "float16":
        return x.view(np.float16)
    if dt == "bfloat16":
        return bf16_to_f32(x)
    return x


def cpu_reduce(a: np.ndarray, b: np.ndarray, op: str, dt: str) -> np.ndarray:
    """The CPU runtime's reduction on the same storage."""
    if dt == "float16":
        out = np.empty_like(a.view(np.float16))
        with np.errstate(all="ignore"):
            reduce_to(out, a.view(np.float16), b.view(np.float16), op, dt)
        return out.view(np.uint16)
    if dt == "bfloat16":
        out = np.empty_like(a)
        with np.errstate(all="ignore"):
            out[...] = f32_to_bf16(getattr(np, {"sum": "add", "product": "multiply", "min": "minimum",
                                               "max": "maximum"}[op])(bf16_to_f32(a), bf16_to_f32(b)))
        return out
    out = np.empty_like(a)
    with np.errstate(all="ignore"):
        reduce_to(out, a, b, op, dt)
    return out


def same(got: np.ndarray, want: np.ndarray, dt: str) -> None:
    """Equal bits, except that any NaN matches any NaN (payloads are the hardware's business)."""
    vg, vw = as_values(got, dt), as_values(want, dt)
    if vg.dtype.kind == "f":
        nan_g, nan_w = np.isnan(vg), np.isnan(vw)
        np.testing.assert_array_equal(nan_g, nan_w)
        np.testing.assert_array_equal(got[~nan_g].view(np.uint8 if got.itemsize == 1 else f"u{got.itemsize}"),
                                      want[~nan_w].view(np.uint8 if want.itemsize == 1 else f"u{want.itemsize}"))
    else:
        np.testing.assert_array_equal(got, want)


def call(lib, name: str, *arrays: np.ndarray, n: int, extra: tuple = ()) -> None:
    fn = getattr(lib, name)
    fn.restype = None
    fn(*[a.ctypes.data_as(ctypes.c_void_p) for a in arrays], ctypes.c_longlong(n), *extra)


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("op", KERNEL_OPS)
def test_reduce_element_functions_equal_numpy(libs, dt: str, op: str) -> None:
    rng = np.random.default_rng(hash((dt, op)) % (1 << 32))
    n = 200_000
    a, b = sample(dt, n, rng), sample(dt, n, rng)
    b[:6] = a[:6][::-1]
    out = np.empty_like(a)
    call(libs[dt], f"host_{op}", a, b, out, n=n)
    same(out, cpu_reduce(a, b, op, dt), dt)


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("k", [2, 3, 7, 8])
def test_average_finish_equals_the_cpu_runtime(libs, dt: str, k: int) -> None:
    rng = np.random.default_rng(k)
    n = 50_000
    a = sample(dt, n, rng)
    out = np.empty_like(a)
    call(libs[dt], "host_average", a, out, n=n, extra=(ctypes.c_int(k),))
    if dt == "float16":
        want = a.view(np.float16).copy()
        with np.errstate(all="ignore"):
            finish_average(want, k, dt)
        want = want.view(np.uint16)
    elif dt == "bfloat16":
        want = a.copy()
        with np.errstate(all="ignore"):
            want[...] = f32_to_bf16(bf16_to_f32(a) / np.float32(k))
    else:
        want = a.copy()
        with np.errstate(all="ignore"):
            finish_average(want, k, dt)
    same(out, want, dt)


def test_float16_conversions_exhaustive(libs) -> None:
    lib = libs["float16"]
    h = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    f = np.empty(h.size, np.float32)
    call(lib, "host_f16_to_f32", h, f, n=h.size)
    want = h.view(np.float16).astype(np.float32)
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(f), nan)
    np.testing.assert_array_equal(f[~nan].view(np.uint32), want[~nan].view(np.uint32))
    # float32 -> float16 around every half boundary (ties, subnormals, overflow) and at random.
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 1 << 32, 2_000_000, dtype=np.uint64).astype(np.uint32)
    edges = want[np.isfinite(want)].view(np.uint32)
    bits = np.concatenate([bits, edges, edges + 1, edges - 1, edges + (1 << 12), edges + (1 << 12) + 1,
                           np.array([0x477FEFFF, 0x477FF000, 0x33000000, 0x33000001, 0x387FFFFF], np.uint32)])
    x = bits.view(np.float32)
    out = np.empty(x.size, np.uint16)
    call(lib, "host_f32_to_f16", x, out, n=x.size)
    with np.errstate(all="ignore"):
        ref = x.astype(np.float16).view(np.uint16)
    same(out, ref, "float16")


@pytest.mark.parametrize("dt", ["float16", "bfloat16"])
def test_half_pairs_split_and_pack_as_single_elements(libs, dt: str) -> None:
    """The kernel's vector path converts half types two at a time (element 2k in the low half of word k):
    the same values as one at a time, and packed back bit for bit (NaN aside)."""
    h = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    words = np.concatenate([h, h[::-1]]).view(np.uint32).copy()  # every half value in both positions
    acc = np.empty(2 * words.size, np.float32)
    back = np.empty_like(words)
    call(libs[dt], "host_pairs", words, acc, back, n=words.size)
    halves = words.view(np.uint16)
    want = halves.view(np.float16).astype(np.float32) if dt == "float16" else bf16_to_f32(halves)
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(acc), nan)
    np.testing.assert_array_equal(acc[~nan].view(np.uint32), want[~nan].view(np.uint32))
    back_h = back.view(np.uint16)
    np.testing.assert_array_equal(back_h[~nan], halves[~nan])


def test_kernel_source_has_every_op_and_no_include() -> None:
    for dt in DTYPES:
        src = kernel_source(dt)
        for op in KERNEL_OPS:
            assert f"BLINK_TREES_KERNEL(blink_trees_{op}," in src
        assert "#include" not in src  # NVRTC without toolkit headers


SPILL_FREE = ("float32", "float16", "bfloat16", "int32", "int64")


def _toolkit_wheels() -> tuple[str, str] | None:
    """libnvrtc and ptxas of the ``nvidia-cuda-nvrtc-cu12`` and ``nvidia-cuda-nvcc-cu12`` wheels, where
    installed (optional: ``pip install nvidia-cuda-nvrtc-cu12 nvidia-cuda-nvcc-cu12``, no GPU needed)."""
    import glob
    import importlib.util

    found = []
    for pkg, pattern in (("nvidia.cuda_nvrtc", "lib/libnvrtc.so.*"), ("nvidia.cuda_nvcc", "bin/ptxas")):
        try:
            spec = importlib.util.find_spec(pkg)
        except ModuleNotFoundError:
            return None
        dirs = list(spec.submodule_search_locations or []) if spec is not None else []
        paths = [p for d in dirs for p in sorted(glob.glob(f"{d}/{pattern}"))
                 if "builtins" not in p and ".alt." not in p]
        if not paths:
            return None
        found.append(paths[0])
    return found[0], found[1]


@pytest.mark.skipif(_toolkit_wheels() is None, reason="the NVRTC and ptxas wheels are not installed")
@pytest.mark.parametrize("dt", DTYPES)
def test_device_kernels_compile_for_sm90_without_spills(tmp_path, dt: str) -> None:
    """The kernels as the GPU machine builds them (NVRTC, no toolkit headers), then ptxas for sm_90: every
    op's kernel compiles within ``__launch_bounds__``'s 64 registers.  float32, the half types and the
    32/64-bit integers do not spill (their unroll is chosen for that: kernels.py); ptxas 12.9 spills a
    few bytes in float64's sum and product and in min/max of the 8- and 16-bit integers (a smaller
    unroll removes them, at fewer loads in flight: not yet measured on a GPU which is faster)."""
    nvrtc_path, ptxas = _toolkit_wheels()  # type: ignore[misc]
    lib = ctypes.CDLL(nvrtc_path)
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), kernel_source(dt).encode(), b"trees.cu", 0, None, None) == 0
    opts = (ctypes.c_char_p * 2)(b"-std=c++17", b"--gpu-architecture=compute_90")
    rc = lib.nvrtcCompileProgram(prog, 2, opts)
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    assert rc == 0, log.value.decode()
    lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
    ptx = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetPTX(prog, ptx)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    (tmp_path / "k.ptx").write_bytes(ptx.value)
    # The kernel's one parameter is struct BlinkArgs by value: the host's layout (ARGS_DTYPE) must be as large.
    sizes = {int(m) for m in re.findall(rb"\.param \.align \d+ \.b8 \w+_param_0\[(\d+)\]", ptx.value)}
    assert sizes == {ARGS_DTYPE.itemsize}, (sizes, ARGS_DTYPE.itemsize)
    proc = subprocess.run([ptxas, "-arch=sm_90", "-v", str(tmp_path / "k.ptx"), "-o", str(tmp_path / "k.cubin")],
                          capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr
    usage = [line for line in proc.stderr.splitlines() if "spill" in line]
    assert len(usage) == len(KERNEL_OPS), proc.stderr
    spilled = [int(m) for m in re.findall(r"(\d+) bytes spill stores", proc.stderr)]
    assert max(spilled) <= (0 if dt in SPILL_FREE else 32), proc.stderr
    regs = [int(m) for m in re.findall(r"Used (\d+) registers", proc.stderr)]
    assert regs and max(regs) <= 64, proc.stderr


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.parametrize("dt", ["float16", "bfloat16", "float64", "int8"])
def test_device_modules_compile_for_sm90(tmp_path, dt: str) -> None:
    src = tmp_path / f"{dt}.cu"
    src.write_text(kernel_source(dt))
    proc = subprocess.run(["nvcc", "-arch=sm_90", "-cubin", "-o", str(tmp_path / f"{dt}.cubin"), str(src)],
                          capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "warning" not in proc.stderr.lower(), proc.stderr
