"""The CUDA calls of the GPU executor, in one place: memory, IPC, streams, events, graphs, stream memory ops.

Everything goes through CuPy's thin runtime bindings (``cupy.cuda.runtime``:
raw pointers and handles as ints) and, for the stream memory operations CuPy
does not wrap, cuda-bindings' driver API (``cuStreamWriteValue32``,
``cuStreamWaitValue32``).  Both were seen working on the H200 machine
(docs/gpu-runtime.md): IPC between processes of one
device, and ``cuStreamWriteValue32`` captured in a graph and replayed.

Imported only by the executor; importing it needs CuPy, calling it a GPU.
Failures raise :class:`~blink_horovod.errors.BlinkInternalError` naming the
call.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from ...errors import BlinkInternalError, ConfigError

__all__ = ["Cuda", "SameProcessCuda", "available", "device_pointer", "stream_pointer"]


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


def device_pointer(arr: Any) -> int:
    """Device address of ``arr``: an int, a CuPy array, a torch tensor, or anything with
    ``__cuda_array_interface__``."""
    if isinstance(arr, (int, np.integer)) and not isinstance(arr, bool):
        return int(arr)
    # Cheapest first (this runs on every collective): torch's data_ptr(), CuPy's data.ptr; the
    # interface dict (built anew on each access) last.
    ptr = getattr(arr, "data_ptr", None)
    if callable(ptr):
        return int(ptr())
    data = getattr(arr, "data", None)
    if data is not None and hasattr(data, "ptr"):
        return int(data.ptr)
    cai = getattr(arr, "__cuda_array_interface__", None)
    if cai is not None:
        return int(cai["data"][0])
    raise ConfigError(f"tensor: expected a CUDA array (CuPy, torch, __cuda_array_interface__), got {type(arr).__name__}")


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


def device_count() -> int:
    import cupy

    return int(cupy.cuda.runtime.getDeviceCount())


FLAG_OPS = ("kernel", "memop", "fused")  # fused: the whole program as one kernel (.fused)

# Flag words as tiny kernels (Blink section 4 generates the whole program as CUDA code; these are its
# synchronisation primitives).  The wait spins with volatile loads and a short back-off so that the
# peers' kernels keep the SMs; the fences order the data of earlier work before the flag (writer) and
# the flag before later reads (reader), also across GPUs (system scope).
FLAG_SOURCE = r"""
extern "C" __global__ void blink_flag_wait_and(unsigned long long addr, unsigned int mask) {
    const volatile unsigned int* f = (const volatile unsigned int*)addr;
    while ((*f & mask) == 0u) { __nanosleep(64); }
    __threadfence_system();
}
extern "C" __global__ void blink_flag_write(unsigned long long addr, unsigned int value) {
    __threadfence_system();
    *(volatile unsigned int*)addr = value;
    __threadfence_system();
}
"""


_BUFFER_ID = 7  # CU_POINTER_ATTRIBUTE_BUFFER_ID


class Cuda:
    """CUDA on one device for this process (``device`` index)."""

    NOT_READY = 600  # cudaErrorNotReady

    def __init__(self, device: int, flag_ops: str = "kernel") -> None:
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
        self._wait_and = driver.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_AND
        self._write_default = driver.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT
        self.sms = self.rt.deviceGetAttribute(self.rt.cudaDevAttrMultiProcessorCount, device)
        if flag_ops not in FLAG_OPS:
            raise ConfigError(f"flag_ops: expected one of {', '.join(FLAG_OPS)}, got {flag_ops!r}")
        self.flag_ops = flag_ops
        self._flag_fns: tuple[Any, Any] | None = None
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

    def copy_to_device(self, dst: int, data: np.ndarray) -> None:
        data = np.ascontiguousarray(data)
        self.rt.memcpy(dst, data.ctypes.data, data.nbytes, self.rt.memcpyHostToDevice)

    def read_u32(self, src: int) -> int:
        out = np.zeros(1, np.uint32)
        self.rt.memcpy(out.ctypes.data, src, 4, self.rt.memcpyDeviceToHost)
        return int(out[0])

    def synchronize(self) -> None:
        self.rt.deviceSynchronize()

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

    def timing_event(self) -> int:
        return int(self.rt.eventCreateWithFlags(0))

    def destroy_event(self, ev: int) -> None:
        self.rt.eventDestroy(ev)

    def record(self, ev: int, stream: int) -> None:
        self.rt.eventRecord(ev, stream)

    def join(self, stream: int, ev: int) -> None:
        self.rt.streamWaitEvent(stream, ev, 0)

    def done(self, ev: int) -> bool:
        status = int(self.rt.eventQuery(ev))
        if status == 0:
            return True
        if status == self.NOT_READY:
            return False
        raise BlinkInternalError(f"CUDA event query failed with error {status} (a kernel or copy faulted)")

    def stream_done(self, stream: int) -> bool:
        """Whether all work queued on ``stream`` has finished (``cudaStreamQuery``: no wait, no queued work)."""
        try:
            status = int(self.rt.streamQuery(stream))
        except self.rt.CUDARuntimeError as exc:
            status = int(exc.status)
        if status == 0:
            return True
        if status == self.NOT_READY:
            return False
        raise BlinkInternalError(f"CUDA stream query failed with error {status} (a kernel or copy faulted)")

    def elapsed_ms(self, start: int, end: int) -> float:
        return float(self.rt.eventElapsedTime(start, end))

    # -- asynchronous work (captured into graphs) --------------------------------
    def copy_async(self, dst: int, src: int, nbytes: int, stream: int, kind: str = "d2d") -> None:
        k = {"d2d": self.rt.memcpyDeviceToDevice, "h2d": self.rt.memcpyHostToDevice,
             "d2h": self.rt.memcpyDeviceToHost}[kind]
        self.rt.memcpyAsync(dst, src, nbytes, k, stream)

    def memset_async(self, ptr: int, value: int, nbytes: int, stream: int) -> None:
        self.rt.memsetAsync(ptr, value, nbytes, stream)

    def _flag_kernels(self) -> tuple[Any, Any]:
        if self._flag_fns is None:
            mod = self.module(FLAG_SOURCE)
            self._flag_fns = (mod.get_function("blink_flag_wait_and"), mod.get_function("blink_flag_write"))
        return self._flag_fns

    def write_value(self, stream: int, addr: int, value: int) -> None:
        """``*addr = value`` after all prior work of the stream (with its memory fence).

        ``flag_ops="kernel"``: a one-thread kernel; ``"memop"``: ``cuStreamWriteValue32``.  Both are
        captured into graphs; a graph's launch costs ~3.6 us of host time per memory-operation node
        on the H200 machine (benchmarks/gpu_pingpong.py: 461 us for 128) but far less per kernel node,
        which is why kernels are the default."""
        if self.flag_ops != "memop":
            with self.cupy.cuda.ExternalStream(stream):
                self._flag_kernels()[1]((1,), (1,), (np.uint64(addr), np.uint32(value)))
            return
        d = self.drv
        self._check(d.cuStreamWriteValue32(d.CUstream(stream), d.CUdeviceptr(addr), d.cuuint32_t(value),
                                           self._write_default), "cuStreamWriteValue32")

    def wait_value_and(self, stream: int, addr: int, mask: int) -> None:
        """Later work of the stream waits until ``*addr & mask != 0`` (a spinning one-thread kernel, or
        ``cuStreamWaitValue32(AND)`` with ``flag_ops="memop"``)."""
        if self.flag_ops != "memop":
            with self.cupy.cuda.ExternalStream(stream):
                self._flag_kernels()[0]((1,), (1,), (np.uint64(addr), np.uint32(mask)))
            return
        d = self.drv
        self._check(d.cuStreamWaitValue32(d.CUstream(stream), d.CUdeviceptr(addr), d.cuuint32_t(mask),
                                          self._wait_and), "cuStreamWaitValue32")

    # -- graphs ------------------------------------------------------------------
    def begin_capture(self, stream: int) -> None:
        self.rt.streamBeginCapture(stream, self.rt.streamCaptureModeRelaxed)

    def end_capture(self, stream: int) -> int:
        return int(self.rt.streamEndCapture(stream))

    def instantiate(self, graph: int) -> int:
        return int(self.rt.graphInstantiate(graph))

    def destroy_graph(self, graph: int) -> None:
        self.rt.graphDestroy(graph)

    def destroy_exec(self, exe: Any) -> None:
        if isinstance(exe, int):  # else a fused DirectLaunch: nothing to destroy
            self.rt.graphExecDestroy(exe)

    def upload(self, exe: int, stream: int) -> None:
        self.rt.graphUpload(exe, stream)

    def launch(self, exe: Any, stream: int) -> None:
        """Launch a graph exec, or a fused program's prebuilt kernel launch (:class:`.fused.DirectLaunch`)."""
        if isinstance(exe, int):
            self.rt.graphLaunch(exe, stream)
        else:
            exe.go(stream)

    # -- kernels -----------------------------------------------------------------
    def launch_kernel(self, fn: Any, grid: int, block: int, stream: int, params: int) -> None:
        """``cuLaunchKernel`` of a RawModule function with a ready ``void*[]`` of parameters (an address)."""
        self.cupy.cuda.driver.launchKernel(int(getattr(fn, "kernel", fn).ptr), grid, 1, 1, block, 1, 1, 0,
                                           stream, params, 0)

    def blocks_per_sm(self, fn: Any, block: int) -> int:
        """How many blocks of ``block`` threads of ``fn`` one SM holds at once (the occupancy calculator)."""
        return int(self.cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(
            int(getattr(fn, "kernel", fn).ptr), block, 0))


    def module(self, source: str) -> Any:
        """A compiled CuPy RawModule (NVRTC)."""
        mod = self.cupy.RawModule(code=source, options=("-std=c++17",))
        mod.compile()
        return mod


class SameProcessCuda(Cuda):
    """:class:`Cuda` for virtual ranks that are threads of one process (benchmarks and tests on one GPU).

    CUDA IPC cannot map a buffer into the process that allocated it, and threads need no mapping:
    the "handle" is the device address itself.  Everything else (memory, streams, graphs, stream
    memory operations, kernels) is the real device's, in the process's one context, where peers'
    streams run concurrently instead of being time-sliced as separate processes' contexts are.
    """

    shares_context = True  # every rank's kernels in one context (no persistent launches: executor)

    def ipc_handle(self, ptr: int) -> bytes:
        return int(ptr).to_bytes(8, "little")

    def ipc_open(self, handle: bytes) -> int:
        return int.from_bytes(handle, "little")

    def ipc_close(self, ptr: int) -> None:
        pass  # the owner frees it

    def __init__(self, device: int, flag_ops: str = "kernel") -> None:
        super().__init__(device, flag_ops)
        self._deferred: list[int] = []

    def free(self, ptr: int) -> None:
        """Deferred until :meth:`release_deferred`: ``cudaFree`` waits for the whole context, so a
        rank freeing its old buffer generation would wait for peer threads' graphs that wait for this
        rank's next launch (a deadlock processes cannot have: each has its own context)."""
        self._deferred.append(ptr)

    def release_deferred(self) -> None:
        for ptr in self._deferred:
            super().free(ptr)
        self._deferred.clear()

