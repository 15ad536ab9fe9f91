"""A CPU emulation of the few CUDA calls the GPU executor makes (tests only; no tests collected here).

It exists to run the executor's *host* code (executor.py, graph.py,
harness.py: IPC exchange, buffer growth, argument slots, graph cache,
capture, launch ordering, close) on a machine without a GPU.  It proves
nothing about CUDA itself -- that is what benchmarks/gpu_probe_run.sh is for.

Model: one address space (a numpy byte array) shared by the ranks, which are
threads; an IPC handle is the address.  Each rank has ONE hardware queue: a
worker thread that executes its stream work strictly in issue order (a valid,
and the most serialising, CUDA schedule; the lowering's order edges make it
deadlock-free).  Capture records the calls issued on the rank's streams while
capturing; a launch enqueues the recorded calls.  Waits spin on memory words.
Kernels are executed with the CPU runtime's numpy reductions.
"""

from __future__ import annotations

import struct
import threading
import time
from collections import deque

import numpy as np

from blink_horovod.runtime.dtypes import finish_average, numpy_dtype, reduce_to


class Heap:
    """Device memory of the emulated machine."""

    def __init__(self, nbytes: int = 64 << 20) -> None:
        self.mem = np.zeros(nbytes, np.uint8)
        self.next = 4096
        self.lock = threading.Lock()
        self.live: dict[int, int] = {}

    def alloc(self, n: int) -> int:
        with self.lock:
            a = -(-self.next // 256) * 256
            if a + n > self.mem.size:
                raise MemoryError(f"emulated device memory exhausted ({n} bytes)")
            self.next = a + n
            self.live[a] = n
            return a

    def words(self, addr: int) -> np.ndarray:
        return self.mem[addr : addr + 4].view(np.uint32)

    def view(self, addr: int, dtype: str, count: int) -> np.ndarray:
        dt = numpy_dtype(dtype)
        return self.mem[addr : addr + count * dt.itemsize].view(dt)


class _Stream:
    def __init__(self, cuda: EmuCuda) -> None:
        self.cuda = cuda
        self.ptr = cuda._new_handle()

    def __enter__(self):
        self.cuda._current = self.ptr
        return self

    def __exit__(self, *exc) -> None:
        self.cuda._current = 0

    def synchronize(self) -> None:
        self.cuda.synchronize()


class _Kernel:
    def __init__(self, cuda: EmuCuda, name: str) -> None:
        self.cuda, self.name = cuda, name
        parts = name.split("_")
        self.kind = parts[1]  # reduce | stage
        if self.kind == "reduce":
            self.op, self.dtype = parts[2], "_".join(parts[3:])
        else:
            self.op, self.dtype = parts[2], "_".join(parts[3:])  # in|out, dtype

    def __call__(self, grid, block, args) -> None:
        assert isinstance(grid, tuple) and isinstance(block, tuple)
        for a in args:
            assert isinstance(a, (np.uint64, np.int64, np.int32)), f"kernel argument {a!r} is not a numpy scalar"
        self.cuda._enqueue(self.cuda._current, ("kernel", self, tuple(int(a) for a in args)))


class _Module:
    def __init__(self, cuda: EmuCuda, source: str) -> None:
        self.cuda, self.source = cuda, source

    def get_function(self, name: str) -> _Kernel:
        assert f" {name}(" in self.source, f"kernel {name} is not in the module"
        return _Kernel(self.cuda, name)


class EmuCuda:
    """The methods of :class:`blink_horovod.runtime.gpu.device.Cuda`, emulated for one rank (thread)."""

    NOT_READY = 600

    def __init__(self, heap: Heap, device: int = 0, inline: bool = False) -> None:
        """``inline``: no worker thread; queued work runs in the caller's thread when it synchronizes
        or queries an event (one rank alone only: nothing can wait for a peer)."""
        self.heap, self.device, self.sms = heap, device, 4
        self._h = 1
        self._current = 0
        self._capture: list | None = None
        self._capturing_origin = 0
        self._graphs: dict[int, list] = {}
        self._events: dict[int, int] = {}  # event -> sequence number it completes at (0: never recorded)
        self._issued = 0
        self._executed = 0
        self._q: deque = deque()
        self._cv = threading.Condition()
        self._stop = False
        self.error: BaseException | None = None
        self.launches = 0
        self.inline = inline
        self._worker = None if inline else threading.Thread(target=self._run, daemon=True)
        if self._worker is not None:
            self._worker.start()

    def _new_handle(self) -> int:
        self._h += 1
        return self._h * 16

    # -- the queue ----------------------------------------------------------------
    def _enqueue(self, stream: int, item) -> None:
        if self._capture is not None:
            self._capture.append(item)
            return
        if self.inline:
            self._issued += 1
            self._q.append((self._issued, item))
            return
        with self._cv:
            self._issued += 1
            self._q.append((self._issued, item))
            self._cv.notify_all()

    def _drain_inline(self) -> None:
        while self._q:
            seq, item = self._q.popleft()
            self._execute(item)
            self._executed = seq

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._q and not self._stop:
                    self._cv.wait(0.05)
                if self._stop and not self._q:
                    return
                seq, item = self._q.popleft()
            try:
                self._execute(item)
            except BaseException as exc:  # noqa: BLE001 - surfaced by done()
                self.error = exc
            with self._cv:
                self._executed = seq
                self._cv.notify_all()

    def _execute(self, item) -> None:
        kind = item[0]
        h = self.heap
        if kind == "graph":
            for sub in self._graphs[item[1]]:
                self._execute(sub)
        elif kind == "copy":
            _, dst, src, n = item
            h.mem[dst : dst + n] = h.mem[src : src + n].copy()
        elif kind == "memset":
            _, ptr, value, n = item
            h.mem[ptr : ptr + n] = value
        elif kind == "write":
            h.words(item[1])[0] = item[2]
        elif kind == "wait":
            _, addr, mask = item
            deadline = time.monotonic() + 30
            while not int(h.words(addr)[0]) & mask:
                if self._stop or time.monotonic() > deadline:
                    raise RuntimeError(f"emulated wait on {addr:#x} mask {mask:#x} never satisfied")
                time.sleep(0.0002)
        elif kind == "kernel":
            k, a = item[1], item[2]
            if k.kind == "reduce":
                dst, x, y, n = a
                d = h.view(dst, k.dtype, n)
                reduce_to(d, h.view(x, k.dtype, n).copy(), h.view(y, k.dtype, n), k.op, k.dtype)
            elif k.op == "in":
                args, uoff, buf, n = a
                user = struct.unpack("<Q", h.mem[args : args + 8].tobytes())[0]
                isz = numpy_dtype(k.dtype).itemsize
                h.view(buf, k.dtype, n)[...] = h.view(user + uoff * isz, k.dtype, n)
            else:
                args, uoff, buf, n, avg = a
                user = struct.unpack("<Q", h.mem[args : args + 8].tobytes())[0]
                isz = numpy_dtype(k.dtype).itemsize
                out = h.view(user + uoff * isz, k.dtype, n)
                out[...] = h.view(buf, k.dtype, n)
                if avg > 1:
                    finish_average(out, avg, k.dtype)
        elif kind in ("record", "join"):
            pass  # one in-order queue: everything issued before is done
        else:  # pragma: no cover
            raise AssertionError(item)

    # -- Cuda's methods ---------------------------------------------------------------
    def set_device(self) -> None:
        pass

    def stream_pointer(self, stream) -> int:
        return 0 if stream is None else int(stream if isinstance(stream, int) else stream.ptr)

    def malloc(self, nbytes: int) -> int:
        return self.heap.alloc(nbytes)

    def free(self, ptr: int) -> None:
        assert ptr in self.heap.live, f"free of unknown pointer {ptr:#x}"
        del self.heap.live[ptr]

    def host_alloc(self, nbytes: int):
        ptr = self.heap.alloc(nbytes)
        return ptr, self.heap.mem[ptr : ptr + nbytes].view(np.uint64)

    def free_host(self, ptr: int) -> None:
        self.free(ptr)

    def memset(self, ptr: int, value: int, nbytes: int) -> None:
        self.synchronize()
        self.heap.mem[ptr : ptr + nbytes] = value

    def copy_to_device(self, dst: int, data: np.ndarray) -> None:
        self.synchronize()
        b = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        self.heap.mem[dst : dst + b.size] = b

    def synchronize(self) -> None:
        if self.inline:
            self._drain_inline()
            return
        with self._cv:
            while self._executed < self._issued:
                self._cv.wait(0.05)
        if self.error:
            raise self.error

    def ipc_handle(self, ptr: int) -> bytes:
        return struct.pack("<Q", ptr) + bytes(56)

    def ipc_open(self, handle: bytes) -> int:
        return struct.unpack("<Q", handle[:8])[0]

    def ipc_close(self, ptr: int) -> None:
        pass

    def stream(self) -> _Stream:
        return _Stream(self)

    def event(self) -> int:
        ev = self._new_handle()
        self._events[ev] = 0
        return ev

    timing_event = event

    def destroy_event(self, ev: int) -> None:
        self._events.pop(ev, None)

    def record(self, ev: int, stream: int) -> None:
        if self._capture is not None:
            self._capture.append(("record", ev))
            return
        if self.inline:
            self._issued += 1
            self._q.append((self._issued, ("record", ev)))
            self._events[ev] = self._issued
            return
        with self._cv:
            self._issued += 1
            self._q.append((self._issued, ("record", ev)))
            self._events[ev] = self._issued
            self._cv.notify_all()

    def join(self, stream: int, ev: int) -> None:
        self._enqueue(stream, ("join", ev))

    def done(self, ev: int) -> bool:
        if self.error:
            raise self.error
        if self.inline and self._executed < self._events.get(ev, 0):
            self._drain_inline()
        return self._executed >= self._events.get(ev, 0)

    def elapsed_ms(self, a: int, b: int) -> float:
        return 1.0

    def copy_async(self, dst: int, src: int, nbytes: int, stream: int, kind: str = "d2d") -> None:
        self._enqueue(stream, ("copy", dst, src, nbytes))

    def memset_async(self, ptr: int, value: int, nbytes: int, stream: int) -> None:
        self._enqueue(stream, ("memset", ptr, value, nbytes))

    def write_value(self, stream: int, addr: int, value: int) -> None:
        assert 0 < value < 1 << 32
        self._enqueue(stream, ("write", addr, value))

    def wait_value_and(self, stream: int, addr: int, mask: int) -> None:
        assert 0 < mask < 1 << 32
        self._enqueue(stream, ("wait", addr, mask))

    def begin_capture(self, stream: int) -> None:
        assert self._capture is None, "nested capture"
        self._capture, self._capturing_origin = [], stream

    def end_capture(self, stream: int) -> int:
        assert stream == self._capturing_origin
        g = self._new_handle()
        self._graphs[g] = self._capture or []
        self._capture = None
        return g

    def instantiate(self, graph: int) -> int:
        e = self._new_handle()
        self._graphs[e] = list(self._graphs[graph])
        return e

    def destroy_graph(self, graph: int) -> None:
        del self._graphs[graph]

    def destroy_exec(self, exe: int) -> None:
        del self._graphs[exe]

    def upload(self, exe: int, stream: int) -> None:
        pass

    def launch(self, exe: int, stream: int) -> None:
        assert self._capture is None
        self.launches += 1
        self._enqueue(stream, ("graph", exe))

    def module(self, source: str) -> _Module:
        return _Module(self, source)

    def shutdown(self) -> None:
        self._stop = True
        if self._worker is not None:
            self._worker.join(5)
