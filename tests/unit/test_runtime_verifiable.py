"""``blink perf -c``'s data (runtime.verifiable): exact, different per rank, and a direct formula.

The expected results are checked against a naive reduction of the inputs in
float64 (every value is a small integer, so float64 holds every partial
result exactly), across block boundaries of the generator.
"""

from __future__ import annotations

import numpy as np
import pytest

from blink_horovod.runtime import verifiable as vf
from blink_horovod.runtime.dtypes import DTYPES, OPS, finish_average

pytestmark = pytest.mark.timeout(120)

COUNT = 2 * vf._BLOCK + 1234  # three generator blocks, the last one ragged


def _naive(dtype: str, n: int, op: str) -> np.ndarray:
    xs = [vf.to_float64(vf.make_input(dtype, n, r, COUNT, op), dtype) for r in range(n)]
    if op in ("sum", "average"):
        return np.sum(xs, axis=0)
    return {"min": np.minimum, "max": np.maximum, "product": np.multiply}[op].reduce(xs)


@pytest.mark.parametrize("dtype", DTYPES)
def test_expected_is_the_reduction_of_the_inputs(dtype: str) -> None:
    for n in (2, 3, 4):
        for op in OPS:
            want = vf.expected(dtype, n, COUNT, op)
            naive = _naive(dtype, n, op)
            if op == "average":
                total = vf.expected(dtype, n, COUNT, "sum")
                finish_average(total, n, dtype)
                np.testing.assert_array_equal(vf.to_float64(want, dtype), vf.to_float64(total, dtype))
                naive = naive / n
                # floats: the exact quotient; integers: Horovod's trunc(x * (1/n))
                if np.dtype(want.dtype).kind in "iu":
                    naive = np.trunc(_naive(dtype, n, "sum") * (1.0 / n))
                else:
                    continue  # rounding of inexact quotients is finish_average's, tested above
            np.testing.assert_array_equal(vf.to_float64(want, dtype), naive, err_msg=f"{dtype} {op} n={n}")


def test_inputs_differ_per_rank_and_stay_exact() -> None:
    for dtype in DTYPES:
        for op in OPS:
            a, b = vf.make_input(dtype, 4, 0, COUNT, op), vf.make_input(dtype, 4, 1, COUNT, op)
            assert a.tobytes() != b.tobytes(), (dtype, op)
            sums = np.abs(_naive(dtype, 4, "sum"))
            assert sums.max() <= vf.exact_limit(dtype)


def test_broadcast_root_pattern_differs_from_the_others() -> None:
    root = vf.make_input("float32", 4, 2, COUNT, collective="broadcast", root=2)
    other = vf.make_input("float32", 4, 1, COUNT, collective="broadcast", root=2)
    assert vf.count_wrong(root, vf.expected("float32", 4, COUNT, collective="broadcast", root=2), "float32") == 0
    assert vf.count_wrong(other, vf.expected("float32", 4, COUNT, collective="broadcast", root=2), "float32") > 0


def test_count_wrong_counts_differences_and_nans() -> None:
    want = vf.expected("float32", 4, COUNT, "sum")
    got = want.copy()
    got[[0, vf._BLOCK, COUNT - 1]] += 1
    got[5] = np.nan
    assert vf.count_wrong(got, want, "float32") == 4
    bits = np.array([0x0000, 0x8000, 0x3F80], np.uint16)  # bfloat16 without ml_dtypes: +0, -0, 1
    assert vf.count_wrong(bits, np.array([0x8000, 0x0000, 0x3F80], np.uint16), "bfloat16") == 0
