"""The CUDA calls of the GPU executor, in one place: memory, IPC, streams, events, kernels.

Everything goes through CuPy's thin runtime and driver bindings (raw pointers
and handles as ints) and, where CuPy has no wrapper, cuda-bindings' driver API
(``cuMemGetAddressRange``) or libcuda itself through ctypes (the allocation id
read on every repeated collective).  CUDA IPC between processes of one device
was seen working on the H200 machine (docs/gpu-runtime.md).

Imported only by the executor; importing it needs CuPy, calling it a GPU.
Failures raise :class:`~blink_horovod.errors.BlinkInternalError` naming the
call.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from ...errors import BlinkInternalError, ConfigError

__all__ = ["Cuda", "available", "current_bus_id", "stream_pointer"]


def available() -> tuple[bool, str]:
    """Whether CuPy, cuda-bindings and a CUDA device are usable here, and why not."""
    try:
        import cupy
        from cuda.bindings import driver  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means: not usable  # pragma: no cover
        return False, f"cupy/cuda-bindings not importable: {exc}"
    try:
        import cupy

        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001  # pragma: no cover
        return False, f"no CUDA device: {exc}"
    return (n > 0), f"{n} CUDA device(s)"


def stream_pointer(stream: Any) -> int:
    """Raw ``cudaStream_t`` of ``stream``: None (CuPy's current stream), an int, a CuPy
    stream (``.ptr``) or a torch stream (``.cuda_stream``)."""
    if stream is None:
        import cupy

        return int(cupy.cuda.get_current_stream().ptr)
    if isinstance(stream, (int, np.integer)) and not isinstance(stream, bool):
        return int(stream)
    for attr in ("ptr", "cuda_stream"):
        v = getattr(stream, attr, None)
        if v is not None:
            return int(v)
    raise ConfigError(f"stream: expected a CUDA stream (CuPy, torch or int), got {type(stream).__name__}")


def current_bus_id() -> str:
    """PCI bus id of the calling thread's current CUDA device (the GPU this rank uses)."""
    import cupy

    rt = cupy.cuda.runtime
    return str(rt.deviceGetPCIBusId(rt.getDevice()))


_BUFFER_ID = 7  # CU_POINTER_ATTRIBUTE_BUFFER_ID


class Cuda:
    """CUDA on one device for this process (``device`` index)."""

    NOT_READY = 600  # cudaErrorNotReady

    def __init__(self, device: int) -> None:
        try:
            import cupy
            from cuda.bindings import driver
        except Exception as exc:  # noqa: BLE001
            raise ConfigError(f"device: 'cuda' needs cupy and cuda-bindings: {exc}") from None
        self.cupy = cupy
        self.rt = cupy.cuda.runtime
        self.drv = driver
        n = self.rt.getDeviceCount()
        if not 0 <= device < n:
            raise ConfigError(f"device: CUDA device {device} does not exist ({n} visible)")
        self.device = device
        self.rt.setDevice(device)
        self._check(driver.cuInit(0), "cuInit")
        self.sms = self.rt.deviceGetAttribute(self.rt.cudaDevAttrMultiProcessorCount, device)
        self._libcuda: Any = None

    def set_device(self) -> None:
        """Make this executor's device current for the calling thread (CuPy kernels launch there)."""
        self.rt.setDevice(self.device)

    def stream_pointer(self, stream: Any) -> int:
        return stream_pointer(stream)

    def _check(self, result: Any, what: str) -> Any:
        err = result[0] if isinstance(result, tuple) else result
        if int(err) != 0:
            try:
                _, name = self.drv.cuGetErrorName(err)
                name = name.decode() if isinstance(name, bytes) else str(name)
            except Exception:  # noqa: BLE001  # pragma: no cover
                name = str(err)
            raise BlinkInternalError(f"CUDA {what} failed: {name}")
        return result[1:] if isinstance(result, tuple) and len(result) > 1 else None

    # -- memory ------------------------------------------------------------------
    def malloc(self, nbytes: int) -> int:
        try:
            return int(self.rt.malloc(nbytes))
        except Exception as exc:  # noqa: BLE001 - CuPy's error, re-raised with the size
            raise BlinkInternalError(f"cudaMalloc of {nbytes} bytes on device {self.device} failed: {exc}") from None

    def free(self, ptr: int) -> None:
        self.rt.free(ptr)

    def host_alloc(self, nbytes: int) -> tuple[int, np.ndarray]:
        """Pinned, mapped host memory and a uint64 numpy view of it."""
        ptr = int(self.rt.hostAlloc(nbytes, self.rt.hostAllocPortable | self.rt.hostAllocMapped))
        view = np.ctypeslib.as_array((ctypes.c_uint64 * (nbytes // 8)).from_address(ptr))
        return ptr, view

    def free_host(self, ptr: int) -> None:
        self.rt.freeHost(ptr)

    def memset(self, ptr: int, value: int, nbytes: int) -> None:
        self.rt.memset(ptr, value, nbytes)

    # -- IPC ---------------------------------------------------------------------
    def ipc_handle(self, ptr: int) -> bytes:
        return bytes(self.rt.ipcGetMemHandle(ptr))

    def ipc_open(self, handle: bytes) -> int:
        try:
            return int(self.rt.ipcOpenMemHandle(handle, self.rt.cudaIpcMemLazyEnablePeerAccess))
        except Exception as exc:  # noqa: BLE001
            raise BlinkInternalError(f"cudaIpcOpenMemHandle failed on device {self.device}: {exc}") from None

    def ipc_close(self, ptr: int) -> None:
        self.rt.ipcCloseMemHandle(ptr)

    def address_range(self, ptr: int) -> tuple[int, int]:
        """``(base, size)`` of the ``cudaMalloc`` allocation that holds ``ptr`` (``cuMemGetAddressRange``)."""
        d = self.drv
        base, size = self._check(d.cuMemGetAddressRange(d.CUdeviceptr(ptr)), "cuMemGetAddressRange")
        return int(base), int(size)

    def buffer_id(self, ptr: int) -> int:
        """The allocation's identity (``CU_POINTER_ATTRIBUTE_BUFFER_ID``: unique per allocation in the process).

        Called on every repeated collective, so straight through ctypes (a microsecond less than the
        cuda-bindings wrapper)."""
        if self._libcuda is None:
            self._libcuda = ctypes.CDLL("libcuda.so.1")
            self._bid = ctypes.c_uint64(0)
            self._bid_ref = ctypes.byref(self._bid)
        err = self._libcuda.cuPointerGetAttribute(self._bid_ref, _BUFFER_ID, ctypes.c_uint64(ptr))
        if err:
            raise BlinkInternalError(f"CUDA cuPointerGetAttribute(BUFFER_ID) of {ptr:#x} failed with error {err}")
        return int(self._bid.value)

    def pci_bus_id(self) -> str:
        """This device's PCI bus id (ranks with the same one share a GPU)."""
        return str(self.rt.deviceGetPCIBusId(self.device))

    # -- streams and events -----------------------------------------------------
    def stream(self) -> Any:
        """A non-blocking CuPy stream (``.ptr`` for raw calls, ``with s:`` for kernels)."""
        return self.cupy.cuda.Stream(non_blocking=True)

    def event(self) -> int:
        return int(self.rt.eventCreateWithFlags(self.rt.eventDisableTiming))

    def destroy_event(self, ev: int) -> None:
        self.rt.eventDestroy(ev)

    def record(self, ev: int, stream: int) -> None:
        self.rt.eventRecord(ev, stream)

    def done(self, ev: int) -> bool:
        status = int(self.rt.eventQuery(ev))
        if status == 0:
            return True
        if status == self.NOT_READY:
            return False
        raise BlinkInternalError(f"CUDA event query failed with error {status} (a kernel or copy faulted)")

    # -- asynchronous work -------------------------------------------------------
    def copy_async(self, dst: int, src: int, nbytes: int, stream: int, kind: str = "d2d") -> None:
        k = {"d2d": self.rt.memcpyDeviceToDevice, "h2d": self.rt.memcpyHostToDevice,
             "d2h": self.rt.memcpyDeviceToHost}[kind]
        self.rt.memcpyAsync(dst, src, nbytes, k, stream)

    # -- kernels -----------------------------------------------------------------
    def launch_kernel(self, fn: Any, grid: int, block: int, stream: int, params: int) -> None:
        """``cuLaunchKernel`` of a RawModule function with a ready ``void*[]`` of parameters (an address)."""
        self.cupy.cuda.driver.launchKernel(self.function_address(fn), grid, 1, 1, block, 1, 1, 0,
                                           stream, params, 0)

    def launch_address(self) -> int:
        """The address of the driver's ``cuLaunchKernel``, for native code that launches (``_replay.c``)."""
        return _driver_address("cuLaunchKernel")

    def attribute_address(self) -> int:
        """The address of the driver's ``cuPointerGetAttribute`` (``_replay.c`` checks a buffer id with it)."""
        return _driver_address("cuPointerGetAttribute")

    def function_address(self, fn: Any) -> int:
        """The ``CUfunction`` of a RawModule function."""
        return int(getattr(fn, "kernel", fn).ptr)

    def blocks_per_sm(self, fn: Any, block: int) -> int:
        """How many blocks of ``block`` threads of ``fn`` one SM holds at once (the occupancy calculator)."""
        return int(self.cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(
            int(getattr(fn, "kernel", fn).ptr), block, 0))


    def module(self, source: str) -> Any:
        """A compiled CuPy RawModule (NVRTC)."""
        mod = self.cupy.RawModule(code=source, options=("-std=c++17",))
        mod.compile()
        return mod


def _driver_address(name: str) -> int:
    """The address of the CUDA driver's entry point ``name`` (``libcuda``), for native callers."""
    return int(ctypes.cast(getattr(ctypes.CDLL("libcuda.so.1"), name), ctypes.c_void_p).value)
