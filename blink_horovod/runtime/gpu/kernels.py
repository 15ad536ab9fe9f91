"""Element functions of the tree kernel (``trees.cu``), generated per dtype as CUDA C++ source.

Blink (MLSys 2020, section 4) reduces each chunk on the receiving GPU.  The kernel accumulates a
node's own elements and its children's in ``blink_acc_t`` and rounds once on the way out.  These
functions are plain C++ with no headers, so that

* NVRTC compiles them without the toolkit's ``cuda_fp16.h``/``cuda_bf16.h`` (not always on the
  include path of a pip-installed CuPy), and
* the very same functions compile for the host (``g++``), where the unit tests check them against
  numpy bit for bit (tests/unit/test_gpu_kernels.py).

Semantics follow the CPU runtime (:mod:`blink_horovod.runtime.dtypes`): float16/bfloat16 compute in
float32 and round to nearest even (on the device with the hardware conversion instructions, whose NaN
is the canonical quiet NaN); integers wrap; min/max propagate NaN as ``np.minimum``; ``average``
divides floats by n and truncates ``x * (1.0 / n)`` in double for integers (Horovod's
``ScaleBuffer``).
"""

from __future__ import annotations

from ...errors import ConfigError
from ..dtypes import DTYPES

__all__ = ["KERNEL_OPS", "acc_source", "host_test_source"]

KERNEL_OPS = ("sum", "min", "max", "product")  # average reduces as sum and the root divides

# dtype -> (storage C type, compute C type, to-compute, from-compute, family)
_TYPES = {
    "float32": ("float", "float", "", "", "float"),
    "float64": ("double", "double", "", "", "float"),
    "float16": ("unsigned short", "float", "blink_f16_to_f32", "blink_f32_to_f16", "float"),
    "bfloat16": ("unsigned short", "float", "blink_bf16_to_f32", "blink_f32_to_bf16", "float"),
    "int8": ("signed char", "int", "", "", "int"),
    "uint8": ("unsigned char", "int", "", "", "int"),
    "int16": ("short", "int", "", "", "int"),
    "int32": ("int", "unsigned int", "", "", "int"),
    "int64": ("long long", "unsigned long long", "", "", "int"),
}
assert set(_TYPES) == set(DTYPES)

_PRELUDE = r"""
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define BLINK_HD __host__ __device__ __forceinline__
#else
#define BLINK_HD static inline
#endif
typedef unsigned int blink_u32;
typedef unsigned long long blink_u64;
typedef long long blink_i64;

BLINK_HD float blink_bits_f32(blink_u32 x) {
#if defined(__CUDA_ARCH__)
    return __uint_as_float(x);
#else
    float f; __builtin_memcpy(&f, &x, 4); return f;
#endif
}
BLINK_HD blink_u32 blink_f32_bits(float f) {
#if defined(__CUDA_ARCH__)
    return __float_as_uint(f);
#else
    blink_u32 x; __builtin_memcpy(&x, &f, 4); return x;
#endif
}
/* bfloat16 is the top half of a float32. */
BLINK_HD float blink_bf16_to_f32(unsigned short h) { return blink_bits_f32(((blink_u32)h) << 16); }
BLINK_HD unsigned short blink_f32_to_bf16(float f) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    /* one instruction, round to nearest even (NaN becomes the canonical quiet NaN) */
    unsigned short h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
#endif
    blink_u32 x = blink_f32_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((x >> 16) | 0x0040u); /* quiet NaN */
    return (unsigned short)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16); /* nearest even */
}
/* IEEE binary16 <-> binary32, exact / nearest even, as numpy's npy_half. */
BLINK_HD float blink_f16_to_f32(unsigned short h) {
#if defined(__CUDA_ARCH__)
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#endif
    blink_u32 sign = ((blink_u32)(h & 0x8000u)) << 16;
    blink_u32 e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0x1fu) return blink_bits_f32(sign | 0x7f800000u | (m << 13));
    if (e == 0) {
        if (m == 0) return blink_bits_f32(sign);
        blink_u32 ee = 113u;  /* 127 - 15 + 1 */
        while (!(m & 0x400u)) { m <<= 1; ee -= 1u; }
        return blink_bits_f32(sign | (ee << 23) | ((m & 0x3ffu) << 13));
    }
    return blink_bits_f32(sign | ((e + 112u) << 23) | (m << 13));
}
BLINK_HD unsigned short blink_f32_to_f16(float f) {
#if defined(__CUDA_ARCH__)
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
#endif
    blink_u32 x = blink_f32_bits(f);
    blink_u32 sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) {  /* NaN: keep the top payload bits, never become infinity */
        blink_u32 r = 0x7c00u + ((ax & 0x7fffffu) >> 13);
        if (r == 0x7c00u) r += 1u;
        return (unsigned short)(sign | r);
    }
    if (ax >= 0x477ff000u) return (unsigned short)(sign | 0x7c00u);  /* rounds past 65504 */
    if (ax < 0x38800000u) {  /* below 2^-14: subnormal half or zero */
        if (ax <= 0x33000000u) return (unsigned short)sign;  /* <= 2^-25 rounds to (even) zero */
        blink_u32 e = ax >> 23, m = (ax & 0x7fffffu) | 0x800000u, shift = 126u - e;
        blink_u32 r = m >> shift, rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
        if (rem > half || (rem == half && (r & 1u))) r += 1u;
        return (unsigned short)(sign | r);
    }
    blink_u32 r = (((ax >> 23) - 112u) << 10) | ((ax & 0x7fffffu) >> 13), rem = ax & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) r += 1u;
    return (unsigned short)(sign | r);
}
"""


# Half types convert two elements at a time where the kernel moves 16-byte vectors: one packing
# conversion (cvt.rn.bf16x2.f32 / cvt.rn.f16x2.f32, sm_80 and later) rounds two float32 sums, where two
# scalar conversions and the packing of their halves take four instructions (measured neutral on an
# H100, whose memory bounds these reductions first: docs/gpu-runtime.md).  Same rounding (nearest even)
# and the same canonical NaN as blink_from_acc on the device.  blink_to_acc2 splits one 32-bit word
# (element 2k in its low half) into two float32s.
def _pair_source(split: str, pack: str, scalar: str) -> list[str]:
    return [
        "#define BLINK_PAIRS 1",
        f"BLINK_HD void blink_to_acc2(blink_u32 w, float* lo, float* hi) {{ {split} }}",
        ("BLINK_HD blink_u32 blink_from_acc2(float lo, float hi) {\n"
         "#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800\n"
         "    blink_u32 w;\n"
         f'    asm("{pack} %0, %1, %2;" : "=r"(w) : "f"(hi), "f"(lo));\n'
         "    return w;\n"
         "#else\n"
         f"    return ((blink_u32){scalar}(hi) << 16) | (blink_u32){scalar}(lo);\n"
         "#endif\n"
         "}"),
    ]


_PAIRS = {
    "bfloat16": _pair_source("*lo = blink_bits_f32(w << 16); *hi = blink_bits_f32(w & 0xffff0000u);",
                             "cvt.rn.bf16x2.f32", "blink_f32_to_bf16"),
    "float16": _pair_source("*lo = blink_f16_to_f32((unsigned short)(w & 0xffffu)); "
                            "*hi = blink_f16_to_f32((unsigned short)(w >> 16));", "cvt.rn.f16x2.f32", "blink_f32_to_f16"),
}


def _check_dtype(dtype: str) -> tuple[str, str, str, str, str]:
    spec = _TYPES.get(dtype)
    if spec is None:
        raise ConfigError(f"dtype: {dtype!r} has no GPU kernels (expected one of {', '.join(DTYPES)})")
    return spec


def acc_source(dtype: str) -> str:
    """Prelude plus the accumulating element functions of the tree kernel (``trees.cu``), host and device.

    ``blink_acc_t`` is what a reduction accumulates in: float32 for float16 and bfloat16 (one
    rounding per reduction, however many sources, as NCCL and vLLM's custom allreduce do), the
    type itself otherwise; integers wrap as numpy's do (sum and product computed unsigned).
    """
    store, comp, to, frm, family = _check_dtype(dtype)
    # Vectors per thread and source in flight, as many as fit 64 registers (ptxas, sm_90): without
    # spilling for float32, the half types and 32/64-bit integers; ptxas 12.9 spills a few bytes in
    # float64's sum and product and in min/max of 8- and 16-bit integers
    # (tests/unit/test_gpu_kernels.py compiles every kernel where the NVRTC and ptxas wheels are installed).
    unroll = {"int16": 2, "int8": 1, "uint8": 1}.get(dtype, 4)
    # Sources whose loads are all issued before any is used (trees.cu): the first two, then one at a
    # time (float32 and int32: two at a time), wherever ptxas keeps everything in registers; the 8- and
    # 16-bit integers keep one (the second source's registers would spill).
    first = 1 if dtype in ("int16", "int8", "uint8") else 2
    batch = 2 if dtype in ("float32", "int32") else 1
    lines = [_PRELUDE, f"typedef {store} blink_t;", f"#define BLINK_UNROLL {unroll}",
             f"#define BLINK_FIRST_LOADS {first}", f"#define BLINK_BATCH {batch}"]
    if family == "float":
        lines += [
            f"typedef {comp} blink_acc_t;",
            *_PAIRS.get(dtype, []),
            f"BLINK_HD blink_acc_t blink_to_acc(blink_t x) {{ return {to + '(x)' if to else 'x'}; }}",
            f"BLINK_HD blink_t blink_from_acc(blink_acc_t x) {{ return {frm + '(x)' if frm else 'x'}; }}",
            "BLINK_HD blink_acc_t blink_acc_sum(blink_acc_t x, blink_acc_t y) { return x + y; }",
            "BLINK_HD blink_acc_t blink_acc_product(blink_acc_t x, blink_acc_t y) { return x * y; }",
            "BLINK_HD blink_acc_t blink_acc_min(blink_acc_t x, blink_acc_t y) { return (x < y || x != x) ? x : y; }",
            "BLINK_HD blink_acc_t blink_acc_max(blink_acc_t x, blink_acc_t y) { return (x > y || x != x) ? x : y; }",
            "BLINK_HD blink_acc_t blink_acc_finish_average(blink_acc_t x, int n) { return x / (blink_acc_t)n; }",
        ]
    else:
        lines += [
            "typedef blink_t blink_acc_t;",
            "BLINK_HD blink_acc_t blink_to_acc(blink_t x) { return x; }",
            "BLINK_HD blink_t blink_from_acc(blink_acc_t x) { return x; }",
            f"BLINK_HD blink_acc_t blink_acc_sum(blink_acc_t x, blink_acc_t y) {{ return (blink_t)(({comp})x + ({comp})y); }}",
            f"BLINK_HD blink_acc_t blink_acc_product(blink_acc_t x, blink_acc_t y) {{ return (blink_t)(({comp})x * ({comp})y); }}",
            "BLINK_HD blink_acc_t blink_acc_min(blink_acc_t x, blink_acc_t y) { return x < y ? x : y; }",
            "BLINK_HD blink_acc_t blink_acc_max(blink_acc_t x, blink_acc_t y) { return x > y ? x : y; }",
            ("BLINK_HD blink_acc_t blink_acc_finish_average(blink_acc_t x, int n) "
             "{ return (blink_t)(blink_i64)((double)x * (1.0 / (double)n)); }"),
        ]
    return "\n".join(lines) + "\n"


def host_test_source(dtype: str) -> str:
    """The element functions wrapped as host loops (``extern "C"``), for the unit tests' g++ build: each op
    of two operands accumulated and rounded once, as the kernel does for a node with one child."""
    src = [acc_source(dtype)]
    for op in KERNEL_OPS:
        src.append(
            f'extern "C" void host_{op}(const blink_t* a, const blink_t* b, blink_t* out, blink_i64 n) '
            f"{{ for (blink_i64 i = 0; i < n; ++i) "
            f"out[i] = blink_from_acc(blink_acc_{op}(blink_to_acc(a[i]), blink_to_acc(b[i]))); }}"
        )
    src.append(
        'extern "C" void host_average(const blink_t* a, blink_t* out, blink_i64 n, int k) '
        "{ for (blink_i64 i = 0; i < n; ++i) out[i] = blink_from_acc(blink_acc_finish_average(blink_to_acc(a[i]), k)); }"
    )
    if dtype in _PAIRS:
        src.append('extern "C" void host_pairs(const blink_u32* w, float* acc, blink_u32* back, blink_i64 n) '
                   "{ for (blink_i64 i = 0; i < n; ++i) { blink_to_acc2(w[i], &acc[2 * i], &acc[2 * i + 1]); "
                   "back[i] = blink_from_acc2(acc[2 * i], acc[2 * i + 1]); } }")
    if dtype == "float16":
        src.append('extern "C" void host_f16_to_f32(const unsigned short* a, float* out, blink_i64 n) '
                   "{ for (blink_i64 i = 0; i < n; ++i) out[i] = blink_f16_to_f32(a[i]); }")
        src.append('extern "C" void host_f32_to_f16(const float* a, unsigned short* out, blink_i64 n) '
                   "{ for (blink_i64 i = 0; i < n; ++i) out[i] = blink_f32_to_f16(a[i]); }")
    return "\n".join(src) + "\n"
