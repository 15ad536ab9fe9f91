"""The TensorFlow adapter: ``horovod.tensorflow`` with Blink underneath (installed by the import hook).

Horovod's TensorFlow collectives are C++ graph ops (``MPI_LIB.horovod_allreduce``
...).  Blink needs no C++ op of its own (docs/architecture.md, "Tensors cross
without copies"): eagerly, tensors go to numpy and through the engine
directly; inside graphs (``tf.function``, Keras ``fit``) the collective is a
``tf.py_function`` whose body does the same.  Graph ops without data
dependencies may run in any order, but Blink needs one order on every rank,
so the py_functions of one graph are chained by control dependencies in
construction order -- which is program order, the same on every rank.
Gradients are Horovod's: the gradient of an allreduce is the same allreduce
of the upstream gradient (``tf.custom_gradient``); of a broadcast, an
averaged allreduce kept on the root only.

In jobs of several servers, the hierarchical allreduce's cross-server stage
runs on Horovod's own TF ops (:class:`_TFCross`), on a worker thread that the
engine waits for with a deadline, as the torch adapter waits for Horovod's
handles.

Replaced: ``_allreduce``, ``_grouped_allreduce``, ``broadcast``,
``broadcast_`` (in-place variables), ``join``, ``init``, ``shutdown``, the
timeline switches, and the gradient-allreduce factory behind
``DistributedOptimizer`` / ``DistributedGradientTape`` /
``horovod.tensorflow.keras.DistributedOptimizer``, which becomes one grouped
collective per step (Blink fuses it per dtype).  Stock Horovod keeps
allgather, alltoall, reducescatter, ``tf.IndexedSlices`` gradients, Adasum,
process sets other than the whole job, XLA-compiled functions and anything
while the timeline records (counted in ``stats()["fallback"]``).
"""

from __future__ import annotations

import queue
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any
from collections.abc import Sequence

import numpy as np

from ..errors import ConfigError
from .adapter import Adapter, StockView
from .engine import Work
from .errors_bridge import as_horovod_error
from .fallback import fallback
from .negotiation import Meta
from .patching import bypass, bypassed, originals, replace_everywhere
from .scaling import needs_scaling, scale_into
from .horovod_wait import cross_grace, wait_horovod

__all__ = ["context", "disabled_reason", "install"]

_PKG = "horovod.tensorflow"
_state = Adapter()
_m: Any = None        # horovod.tensorflow.mpi_ops
_pkg: Any = None      # horovod.tensorflow
_chain: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()

_TF_NAMES = {"float32": "float32", "float64": "float64", "float16": "float16", "bfloat16": "bfloat16",
             "int32": "int32", "int64": "int64", "int8": "int8", "uint8": "uint8", "int16": "int16", "bool": "bool"}


context = _state.context  # the live Blink context (None before ``init`` or when Blink stays out)
disabled_reason = _state.disabled_reason  # why Blink is not carrying collectives now ("" when it is)


def _o(name: str) -> Any:
    return originals("horovod.tensorflow.mpi_ops")[name]


def _tf():
    import tensorflow as tf

    return tf


def _eager() -> bool:
    return _tf().executing_eagerly()


def _op_name(op) -> str:
    for name in ("Sum", "Average", "Min", "Max", "Product", "Adasum"):
        if op == getattr(_m, name):
            return name.lower()
    raise ValueError(f"op: unknown Horovod reduction {op!r}")


_pset_key = _state.pset_key


def _carry_reason(tensors: Sequence[Any], kind: str) -> str:
    tf = _tf()
    for t in tensors:
        if isinstance(t, tf.IndexedSlices):
            return "tf.IndexedSlices (sparse gradients)"
        dev = getattr(t, "device", "") or ""
        if "GPU" in dev.upper():
            return "GPU tensors (this build has the CPU runtime only)"
        name = t.dtype.name
        if name not in _TF_NAMES:
            return f"dtype {name}"
        if name == "bool" and kind != "broadcast":
            return "bool allreduce"
    try:
        from tensorflow.python.eager import context as _ectx  # noqa: F401
        graph = tf.compat.v1.get_default_graph()
        if getattr(graph, "_xla_compile", False) or getattr(graph, "_jit_compile", False):
            return "XLA-compiled functions"
    except Exception:  # pragma: no cover - private TF attributes
        pass
    return ""


def _why_stock(tensors, op_name: str | None, process_set, kind: str) -> str:
    if _state.ctx is None:
        return "-"
    if op_name == "adasum":
        return "adasum"
    if _pset_key(process_set) is None:
        return "process set"
    if _state.recording:
        return "timeline"
    return _carry_reason(tensors, kind)


def _to_stock(tensors, op_name: str | None, process_set, kind: str) -> bool:
    """Whether stock Horovod runs this call; counted as a fallback where Blink is live but cannot carry it."""
    if bypassed():
        return True
    why = _why_stock(tensors, op_name, process_set, kind)
    if why and why != "-":
        fallback(why, why)
    return bool(why)


# -- the numpy core (eager; also the body of the graph's py_functions) ------------------------------------

def _as_array(x) -> np.ndarray:
    """A writable numpy array holding ``x`` (EagerTensor or array); bool is carried as uint8."""
    a = np.array(x, copy=True, order="C")
    if a.dtype == np.bool_:
        a = a.view(np.uint8)
    return a


def _run_allreduce(values: Sequence[Any], name: str | None, opname: str, pre: float, post: float) -> list[np.ndarray]:
    ctx = _state.ctx
    if ctx is None:
        raise as_horovod_error(ConfigError("Blink: horovod.tensorflow is not initialised (hvd.init())"))
    arrays = [_as_array(v) for v in values]
    if needs_scaling(pre):
        for a in arrays:
            scale_into(a, a, pre)
    meta = Meta(kind="allreduce", name=name, dtypes=tuple(_dtype_of(v) for v in values),
                shapes=tuple(tuple(a.shape) for a in arrays), op=opname, prescale=float(pre), postscale=float(post))
    handle = ctx.engine.new_handle(name)
    ctx.engine.submit(Work(meta=meta, handle=handle, arrays=arrays, finish=lambda: arrays))
    return handle.wait()


def _run_broadcast(values: Sequence[Any], root: int, name: str | None) -> list[np.ndarray]:
    ctx = _state.ctx
    if ctx is None:
        raise as_horovod_error(ConfigError("Blink: horovod.tensorflow is not initialised (hvd.init())"))
    if not isinstance(root, (int, np.integer)) or not 0 <= int(root) < ctx.layout.size:
        raise as_horovod_error(ConfigError(f"root_rank: expected a rank in 0..{ctx.layout.size - 1}, got {root!r}"))
    arrays = [_as_array(v) for v in values]
    meta = Meta(kind="broadcast", name=name, dtypes=tuple(_dtype_of(v) for v in values),
                shapes=tuple(tuple(a.shape) for a in arrays), root=int(root))
    handle = ctx.engine.new_handle(name)
    ctx.engine.submit(Work(meta=meta, handle=handle, arrays=arrays, finish=lambda: arrays))
    return handle.wait()


def _dtype_of(v) -> str:
    dt = getattr(v, "dtype", None)
    name = getattr(dt, "name", None) or np.asarray(v).dtype.name
    return _TF_NAMES.get(name, name)


def _restore(arr: np.ndarray, like) -> np.ndarray:
    return arr.view(np.bool_) if like.dtype.name == "bool" else arr


# -- graph plumbing ----------------------------------------------------------------------------------------

def _py_collective(fn, tensors: Sequence[Any]):
    """Run ``fn(list_of_numpy) -> list_of_numpy`` as one py_function, ordered after the graph's previous one."""
    tf = _tf()
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if _eager():
        outs = fn([t.numpy() for t in tensors])
        return [tf.convert_to_tensor(_restore(o, t)) for o, t in zip(outs, tensors)]
    graph = tf.compat.v1.get_default_graph()
    deps = [_chain[graph]] if graph in _chain else []

    def body(*xs):
        outs = fn([x.numpy() for x in xs])
        return [_restore(o, x) for o, x in zip(outs, xs)]

    with tf.control_dependencies(deps):
        outs = tf.py_function(body, tensors, [t.dtype for t in tensors])
    outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    for o, t in zip(outs, tensors):
        o.set_shape(t.shape)
    _chain[graph] = outs[0].op if outs else None
    return outs


def _blink_allreduce_list(tensors, name, op, pre, post):
    tf = _tf()
    opname = _op_name(op)

    @tf.custom_gradient
    def forward(*xs):
        ys = _py_collective(lambda arrs: _run_allreduce(arrs, name, opname, pre, post), xs)

        def grad(*dys):
            return _blink_allreduce_list(list(dys), None, op, pre, post)

        return ys, grad

    out = forward(*tensors)
    return list(out) if isinstance(out, (list, tuple)) else [out]


def _blink_broadcast_list(tensors, root, name):
    tf = _tf()

    @tf.custom_gradient
    def forward(*xs):
        ys = _py_collective(lambda arrs: _run_broadcast(arrs, root, name), xs)

        def grad(*dys):
            red = _blink_allreduce_list(list(dys), None, _m.Average, 1.0, 1.0)
            if _m.rank() != root:
                return [r * 0 for r in red]
            return red

        return ys, grad

    out = forward(*tensors)
    return list(out) if isinstance(out, (list, tuple)) else [out]


# -- replaced functions --------------------------------------------------------------------------------------

def _allreduce_of(fn_name: str, tensors, grouped: bool, name, op, prescale_factor, postscale_factor,
                  ignore_name_scope, process_set):
    op = _m.Sum if op is None else op
    process_set = _m.global_process_set if process_set is None else process_set
    listed = list(tensors) if grouped else [tensors]
    if _to_stock(listed, _op_name(op), process_set, "allreduce"):
        return _o(fn_name)(tensors, name=name, op=op, prescale_factor=prescale_factor,
                           postscale_factor=postscale_factor, ignore_name_scope=ignore_name_scope,
                           process_set=process_set)
    out = _blink_allreduce_list(listed, name, op, prescale_factor, postscale_factor)
    return out if grouped else out[0]


def _allreduce(tensor, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0, ignore_name_scope=False,
               process_set=None):
    return _allreduce_of("_allreduce", tensor, False, name, op, prescale_factor, postscale_factor,
                         ignore_name_scope, process_set)


def _grouped_allreduce(tensors, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                       ignore_name_scope=False, process_set=None):
    return _allreduce_of("_grouped_allreduce", tensors, True, name, op, prescale_factor, postscale_factor,
                         ignore_name_scope, process_set)


def broadcast(tensor, root_rank, name=None, ignore_name_scope=False, process_set=None):
    orig = _o("broadcast")
    process_set = _m.global_process_set if process_set is None else process_set
    if _to_stock([tensor], None, process_set, "broadcast"):
        return orig(tensor, root_rank, name=name, ignore_name_scope=ignore_name_scope, process_set=process_set)
    return _blink_broadcast_list([tensor], root_rank, name)[0]


def broadcast_(variables, root_rank, name=None, process_set=None):
    orig = _o("broadcast_")
    process_set = _m.global_process_set if process_set is None else process_set
    variables = list(variables)
    values = [v.read_value() if hasattr(v, "read_value") else v for v in variables]
    if _to_stock(values, None, process_set, "broadcast"):
        return orig(variables, root_rank, name=name, process_set=process_set)
    tf = _tf()
    values = _blink_broadcast_list([v.read_value() for v in variables], root_rank, name)
    assigns = [v.assign(x) for v, x in zip(variables, values)]
    if _eager():
        return [v.read_value() for v in variables]
    with tf.control_dependencies(assigns):
        return [v.read_value() for v in variables]


def join():
    if bypassed() or _state.ctx is None:
        return _o("join")()
    tf = _tf()

    def run(_):
        ctx = _state.ctx
        handle = ctx.engine.new_handle(None)
        ctx.engine.submit(Work(meta=Meta(kind="barrier", name=None, dtypes=(), shapes=()), handle=handle, join=True))
        return [np.asarray(handle.wait(), dtype=np.int32)]

    return _py_collective(run, [tf.constant(0, dtype=tf.int32)])[0]



def _stock_passthrough(fn_name: str, kind: str):
    def replacement(*args, **kwargs):
        if not bypassed() and _state.ctx is not None:
            fallback(kind, f"Blink does not implement {kind}")
        return _o(fn_name)(*args, **kwargs)

    replacement.__name__ = fn_name
    replacement.__doc__ = f"Blink: ``{fn_name}`` runs on stock Horovod (counted in stats()['fallback'])."
    return replacement


# -- the gradient allreduce behind DistributedOptimizer / DistributedGradientTape -------------------------------

def _make_cached_allreduce_grads_fn(name, device_dense, device_sparse, compression, sparse_as_dense, op,
                                    gradient_predivide_factor, groups, process_set):
    """Horovod's factory (same arguments): one grouped Blink allreduce of all dense gradients per step."""
    stock = originals("horovod.tensorflow")["_make_cached_allreduce_grads_fn"](
        name, device_dense, device_sparse, compression, sparse_as_dense, op, gradient_predivide_factor, groups,
        process_set)
    if op == _m.Average:
        pre, post = 1.0 / gradient_predivide_factor, gradient_predivide_factor
    else:
        pre, post = 1.0, 1.0
    tf = _tf()

    def allreduce_grads(grads, vars=None, use_generic_names=False):
        dense_grads = [g for g in grads if g is not None and not isinstance(g, tf.IndexedSlices)]
        if _to_stock(dense_grads, _op_name(op), process_set, "allreduce"):
            return stock(grads, vars, use_generic_names)
        with tf.name_scope(name + "_Allreduce"):
            if sparse_as_dense:
                grads = [tf.convert_to_tensor(g) if g is not None and isinstance(g, tf.IndexedSlices) else g
                         for g in grads]
            out = list(grads)
            dense = [i for i, g in enumerate(grads) if g is not None and not isinstance(g, tf.IndexedSlices)]
            sparse = [i for i, g in enumerate(grads) if g is not None and isinstance(g, tf.IndexedSlices)]
            if dense:
                comp = [compression.compress(grads[i]) for i in dense]
                reduced = _blink_allreduce_list([c for c, _ in comp], None, op, pre, post)
                for i, r, (_, cctx) in zip(dense, reduced, comp):
                    out[i] = compression.decompress(r, cctx)
            for i in sparse:
                fallback("tf.IndexedSlices (sparse gradients)", "sparse gradients are allgathered by stock Horovod")
                with bypass():
                    out[i] = _pkg.allreduce(grads[i], device_dense=device_dense, device_sparse=device_sparse,
                                            compression=compression, op=op, process_set=process_set)
            return out

    if _eager():
        from horovod.tensorflow.util import _make_subgraph

        return _make_subgraph(allreduce_grads)
    return allreduce_grads


# -- init / shutdown ----------------------------------------------------------------------------------------

class _CrossJob:
    """One stock op handed to a :class:`_CrossWorker`: its result (or error) once ``done`` is set."""

    __slots__ = ("done", "error", "fn", "result")

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            self.error = exc
        finally:
            self.done.set()


class _CrossWorker:
    """A daemon thread running the stock ops handed to it, one after the other."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[_CrossJob | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name="blink-tf-cross", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        with bypass():  # whatever this thread calls of Horovod is stock Horovod
            while True:
                job = self._jobs.get()
                if job is None:
                    return
                job.run()

    def submit(self, fn: Callable[[], Any]) -> _CrossJob:
        job = _CrossJob(fn)
        self._jobs.put(job)
        return job

    def stop(self) -> None:
        """The thread ends once the op it runs (if any) returns."""
        self._jobs.put(None)


# How long one poll of a running cross-server op blocks: it wakes as soon as the op completes, and
# between polls the deadline and the server-mates are checked (wait_horovod).
_POLL_S = 0.01


def _poll(job: _CrossJob) -> bool:
    return job.done.wait(_POLL_S)


def _synchronize(job: _CrossJob) -> Any:
    if job.error is not None:
        raise job.error
    return job.result


class _TFCross:
    """Cross-server stage over the original ``horovod.tensorflow`` ops, bounded and interruptible like
    :class:`.torch_cross.TorchCross`.

    ``horovod.tensorflow`` has no handle to poll (``horovod.torch`` has ``poll``/``synchronize``):
    an op run eagerly blocks its thread until Horovod completes it.  So each op runs on a worker
    thread, and the engine thread waits for it with :func:`.horovod_wait.wait_horovod`: up to
    ``BLINK_TIMEOUT_SECONDS`` plus :func:`.horovod_wait.cross_grace`, raising ``BlinkTimeoutError``
    past it, and calling ``interrupt`` (set by :func:`.context.create_context`: it raises the error
    a server-mate aborted with) between polls.  The op's input tensor is made, and its result
    copied into the engine's array, on the engine thread: the worker only reads that array (TF
    may share its memory), so an op left behind never writes into it.

    When a wait gives up, its op is stranded: it stays queued in Horovod (the peers that never
    submitted it) and its worker thread stays blocked in it, until Horovod completes it (the
    peers submit it after all) or shuts down (``hvd.shutdown``, the process's exit), which ends
    it with an error nobody reads.  By then the engine has stopped with the error it raised; the
    next op, should there be one, runs on a fresh worker thread (a daemon: a stranded op never
    holds the process at exit).
    """

    def __init__(self, sets: dict, m, timeout: float) -> None:
        self.sets = sets
        self.m = m
        # As TorchCross: the peers waiting for a rank that found a fault within its server wait this
        # much longer than BLINK_TIMEOUT_SECONDS, to hear of it from that rank.
        self.timeout = timeout + cross_grace(timeout)
        self.interrupt: Callable[[], None] | None = None  # raises when a server-mate has failed
        # explain(ranks)(what, waited, cause): the error line naming who holds a wait up (.peer_status)
        self.explain: Callable[[Sequence[int]], Callable[[str, float, BaseException | None], str | None]] | None = None
        self._ops = {"sum": m.Sum, "min": m.Min, "max": m.Max, "product": m.Product}
        self._worker: _CrossWorker | None = None

    def _run(self, fn: Callable[[], Any], what: str, ranks: Sequence[int]) -> np.ndarray:
        """``fn()`` (a stock op, then ``.numpy()``) on the worker thread, waited for with the deadline."""
        if self._worker is None:
            self._worker = _CrossWorker()
        job = self._worker.submit(fn)
        try:
            explain = self.explain(ranks) if self.explain is not None else None
            return wait_horovod(_poll, _synchronize, job, self.timeout, what, self.interrupt, explain)
        except BaseException:
            if not job.done.is_set():  # stranded: the next op gets a thread of its own
                self._worker.stop()
                self._worker = None
            raise

    def allreduce(self, arr: np.ndarray, op: str, ranks: Sequence[int], name: str) -> None:
        t = _tf().constant(arr)
        ps, red = self.sets[tuple(ranks)], self._ops[op]
        out = self._run(lambda: _o("_allreduce")(t, name=name, op=red, process_set=ps).numpy(),
                        f"cross-server allreduce {name}", ranks)
        np.copyto(arr, out)

    def broadcast(self, arr: np.ndarray, root: int, ranks: Sequence[int], name: str) -> None:
        t = _tf().constant(arr)
        ps = self.sets[tuple(ranks)]
        out = self._run(lambda: _o("broadcast")(t, root, name=name, process_set=ps).numpy(),
                        f"cross-server broadcast {name}", ranks)
        np.copyto(arr, out)

    def allgather_rows(self, row: np.ndarray, ranks: Sequence[int], name: str) -> np.ndarray:
        t = _tf().constant(row.reshape(1, -1))
        ps = self.sets[tuple(ranks)]
        return self._run(lambda: _o("allgather")(t, name=name, process_set=ps).numpy(),
                         f"cross-server metadata {name}", ranks)


def init(*args, **kwargs):
    from horovod.tensorflow.functions import allgather_object

    m = _m
    return _state.init(_o("init"), m, args, kwargs, StockView(m, allgather_object),
                       lambda sets, cfg: _TFCross(sets, m, cfg.timeout_seconds))



_REPLACED = {
    "_allreduce": _allreduce,
    "_grouped_allreduce": _grouped_allreduce,
    "broadcast": broadcast,
    "broadcast_": broadcast_,
    "join": join,
    "init": init,
    **_state.replacements(_o),
    "allgather": _stock_passthrough("allgather", "allgather"),
    "grouped_allgather": _stock_passthrough("grouped_allgather", "allgather"),
    "alltoall": _stock_passthrough("alltoall", "alltoall"),
    "_reducescatter": _stock_passthrough("_reducescatter", "reducescatter"),
    "_grouped_reducescatter": _stock_passthrough("_grouped_reducescatter", "reducescatter"),
}


def install(module: Any = None) -> None:
    """Patch ``horovod.tensorflow`` (already imported) so that its collectives run through Blink."""
    global _m, _pkg
    m = sys.modules["horovod.tensorflow.mpi_ops"]
    if getattr(m, "_blink_installed", False):
        return
    _m, _pkg = m, sys.modules["horovod.tensorflow"]
    for name, fn in _REPLACED.items():
        if hasattr(m, name):
            replace_everywhere(_PKG, m, name, fn)
    replace_everywhere(_PKG, _pkg, "_make_cached_allreduce_grads_fn", _make_cached_allreduce_grads_fn)
    m._blink_installed = True
    if m.is_initialized():
        init()
