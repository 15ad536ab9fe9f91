"""The host side of the CUDA tensor path (ops/torch_cuda.py, ops/torch_cross.py), on CPU tensors.

What decides results without a GPU: Horovod's scaling arithmetic on torch tensors (the same rounding
as :func:`blink_horovod.ops.scaling.scale_into` on numpy), the fusion of a round's tensors per dtype
into one buffer and back, and the cross-server stage's trip through host memory for the dtypes
Horovod's CUDA kernels lack.  The device part runs in tests/parallel/test_ops_torch_cuda.py.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from blink_horovod.ops.scaling import scale_into  # noqa: E402
from blink_horovod.ops.torch_cross import TorchCross  # noqa: E402
from blink_horovod.ops.torch_cuda import TorchCudaStages, scale_tensor  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def _np(t):
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32,
                                   torch.int64, torch.int8, torch.uint8])
@pytest.mark.parametrize("factor", [0.5, 1 / 3, 3.0, -0.7])
def test_scale_tensor_rounds_as_horovod(dtype, factor: float) -> None:
    base = (torch.arange(-50, 50) * 7 % 97).to(dtype)
    t = base.clone()
    scale_tensor(t, factor)
    want = _np(base.clone())
    scale_into(want, want.copy(), factor)
    assert np.array_equal(_np(t).astype(np.float64), want.astype(np.float64)), (dtype, factor)


def test_fusion_round_trip_per_dtype() -> None:
    stages = TorchCudaStages.__new__(TorchCudaStages)
    stages.device, stages._buffers = torch.device("cpu"), {}

    class W:
        def __init__(self, arrays):
            self.arrays = arrays

    a, b, c = torch.arange(5, dtype=torch.int32), torch.arange(3, dtype=torch.float64), torch.arange(7, dtype=torch.int32)
    groups = stages._groups([W([a, b]), W([c])])
    assert [[t.dtype for t in g] for g in groups] == [[torch.float64], [torch.int32, torch.int32]]
    flat = stages._fused(groups[1], copy_in=True)
    assert flat.tolist() == list(range(5)) + list(range(7))
    flat.mul_(10)
    stages._unfuse(flat, groups[1])
    assert a.tolist() == [10 * i for i in range(5)] and c.tolist() == [10 * i for i in range(7)]
    assert stages._fused(groups[0], copy_in=True) is b  # one tensor: no copy at all
    first = stages._buffer(torch.int32, 10).data_ptr()
    assert stages._buffer(torch.int32, 100).data_ptr() == first  # the buffer stays put while it fits


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8, torch.uint8, torch.float32])
def test_cross_stage_through_host_memory(dtype) -> None:
    cross = TorchCross.__new__(TorchCross)
    cross.nccl = False
    t = torch.arange(6).to(dtype)
    assert not cross._direct(t)
    seen = []

    def run(arr: np.ndarray) -> None:  # stands where Horovod's CPU allreduce writes its result
        seen.append(arr.dtype)
        arr[...] = arr * 2

    cross._staged(t, run)
    assert t.to(torch.float64).tolist() == [2.0 * i for i in range(6)]
    assert seen and seen[0].itemsize == t.element_size()
    cross.nccl = True
    assert cross._direct(torch.zeros(2, dtype=torch.float32)) and not cross._direct(torch.zeros(2, dtype=torch.bfloat16))


def test_bfloat16_crosses_servers_as_float32() -> None:
    """Horovod 0.28.1 refuses bfloat16 on CPU and CUDA: the cross-server stage reduces a float32 copy
    and rounds once (broadcast, min and max stay exact)."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    from blink_horovod.ops.torch_cross import _widened

    arr = np.array([1.5, -2.25, 3e38], dtype=ml_dtypes.bfloat16)
    wide = _widened(arr)
    assert wide is not None and wide.dtype == np.float32
    assert (wide.astype(arr.dtype).view(np.uint16) == arr.view(np.uint16)).all()
    assert _widened(np.zeros(3, np.float32)) is None and _widened(np.zeros(3, np.int8)).dtype == np.int64
