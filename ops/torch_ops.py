"""The PyTorch adapter: ``horovod.torch`` with Blink underneath (installed by the import hook).

Horovod's Python layer funnels every collective through a few private
functions of ``horovod/torch/mpi_ops.py`` -- ``_allreduce_async``,
``_grouped_allreduce_async``, ``_broadcast_async`` (and ``_allgather_async``,
``_alltoall_async``, ``_reducescatter_async``, ...) -- and every result
through ``poll`` / ``synchronize``.  Replacing exactly those (plus ``init``,
``shutdown``, ``join``, ``barrier``, the timeline switches and
``DistributedOptimizer``) puts Blink under all of the public API at once:
``allreduce``/``allreduce_``/``*_async``, grouped allreduces, the autograd
functions (their backward passes call the same functions),
``broadcast_parameters``, ``broadcast_optimizer_state``, ``broadcast_object``,
``DistributedOptimizer``, elastic state sync.

The adapter is thin: CPU tensors become numpy arrays without copies
(``Tensor.numpy()`` shares their memory), Horovod's own argument
checks run first so that errors keep their class and text, and everything
else -- ordering, fusion, join, timeouts, the hierarchical data movement --
is the framework-neutral engine's (:mod:`.engine`).

CUDA tensors go to Blink's GPU runtime (:mod:`.torch_cuda`: stream-ordered
as Horovod's NCCL path, fused in GPU memory), bfloat16 included, which stock
Horovod 0.28.1 refuses on CUDA.

What Blink does not carry goes to stock Horovod (:mod:`.fallback`): Adasum,
sparse gradients (allgather), allgather / alltoall / reducescatter, process
sets other than the whole job, CUDA tensors where the GPU runtime cannot run
(no CuPy, no device), and everything while the timeline records.  On the global process
set those still pass through the engine's ordered rounds, so that ``join``
and the submission order keep Horovod's semantics.
"""

from __future__ import annotations

import sys
from typing import Any
from collections.abc import Sequence

import numpy as np

from ..errors import ConfigError, MismatchError
from .adapter import Adapter, StockView
from .engine import Handle, StockWaiter, Work
from .errors_bridge import as_horovod_error
from .fallback import fallback
from .negotiation import Meta
from .patching import bypassed, originals, replace_everywhere
from .scaling import needs_scaling, scale_into
from .horovod_wait import wait_horovod
from .torch_cross import TorchCross

__all__ = ["context", "disabled_reason", "install"]

_PKG = "horovod.torch"
_state = Adapter()
_mpi_ops: Any = None


context = _state.context  # the live Blink context (None before ``init`` or when Blink stays out)
disabled_reason = _state.disabled_reason  # why Blink is not carrying collectives now ("" when it is)


def _o(name: str) -> Any:
    return originals("horovod.torch.mpi_ops")[name]


# -- tensors <-> numpy ----------------------------------------------------------------------------

_TORCH_DTYPES: dict[Any, str] = {}


def _dtype_name(t) -> str | None:
    import torch

    if not _TORCH_DTYPES:
        _TORCH_DTYPES.update({
            torch.float32: "float32", torch.float64: "float64", torch.float16: "float16",
            torch.bfloat16: "bfloat16", torch.int32: "int32", torch.int64: "int64", torch.int8: "int8",
            torch.uint8: "uint8", torch.int16: "int16", torch.bool: "bool",
        })
    return _TORCH_DTYPES.get(t.dtype)


def _numpy(t) -> np.ndarray:
    """A numpy view of a contiguous CPU tensor (no copy)."""
    import torch

    t = t.detach()
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    if t.dtype == torch.bool:
        return t.view(torch.uint8).numpy()
    return t.numpy()


_gpu_why: str | None = None


def _gpu_reason() -> str:
    """Why Blink's GPU runtime cannot carry CUDA tensors here ("" when it can; asked once per process)."""
    global _gpu_why
    if _gpu_why is None:
        from .torch_cuda import gpu_reason

        _gpu_why = gpu_reason()
    return _gpu_why


def _carry_reason(tensors: Sequence[Any], kind: str) -> str:
    """Why Blink cannot carry these tensors ("" if it can)."""
    for t in tensors:
        if t.device.type == "cuda":
            why = _gpu_reason()
            if why:
                return why
        elif t.device.type != "cpu":
            return f"{t.device.type} tensors"
        if t.is_sparse:
            return "sparse tensors"
        dt = _dtype_name(t)
        if dt is None:
            return f"dtype {t.dtype}"
        if dt == "bool" and kind != "broadcast":
            return "bool allreduce"
        if dt == "bfloat16" and not t.is_cuda:
            try:
                import ml_dtypes  # noqa: F401
            except ImportError:
                return "bfloat16 without ml_dtypes"
    return ""


_pset_key = _state.pset_key


def _op_name(op) -> str:
    m = _mpi_ops
    for name, value in (("sum", m.Sum), ("average", m.Average), ("min", m.Min), ("max", m.Max),
                        ("product", m.Product), ("adasum", m.Adasum)):
        if op == value:
            return name
    raise ValueError(f"op: unknown Horovod reduction {op!r}")


# -- stock Horovod through the engine ---------------------------------------------------------------

class _TorchStockWaiter(StockWaiter):
    def __init__(self, handle: Any, timeout: float) -> None:
        self.h = handle
        self.timeout = timeout

    def poll(self) -> bool:
        return bool(_o("poll")(self.h))

    def wait(self, timeout: float) -> Any:
        return wait_horovod(_o("poll"), _o("synchronize"), self.h, timeout, "stock Horovod collective")


_direct_counters: dict[tuple, int] = {}


def _stock(kind: str, detail: str, process_set, submit_stock, name: str | None, tensors: Sequence[Any]):
    """Hand a collective to stock Horovod: through the engine's order on the global set, directly otherwise.

    ``submit_stock(name)`` calls the original function with ``name``.  Unnamed
    collectives always get an explicit name: Horovod names unnamed ops by its
    per-process handle counter, which Blink's own cross-server ops advance
    unevenly across local ranks (only the root's local rank broadcasts
    across servers), so its automatic names would no longer meet.
    """
    fallback(kind, detail)
    ctx = _state.ctx
    if ctx is None or _pset_key(process_set) is None:
        if name is None:
            ranks = tuple(getattr(process_set, "ranks", None) or ())
            key = (kind, ranks)
            n = _direct_counters.get(key, 0)
            _direct_counters[key] = n + 1
            name = f"blink.{kind}.ps{'_'.join(map(str, ranks))}.noname.{n}"
        return submit_stock(name)
    # Shapes and types are stock Horovod's to check (allgather's first dimensions differ by design):
    # the engine only agrees on the order, by name.
    meta = Meta(kind="stock", name=name, dtypes=(), shapes=(), stock_kind=kind)
    handle = ctx.engine.new_handle(name)
    timeout = ctx.config.timeout_seconds
    work = Work(meta=meta, handle=handle, keepalive=tuple(tensors))
    work.submit = lambda: _TorchStockWaiter(submit_stock(work.name if name is not None else f"blink.{work.name}"),
                                            timeout)
    return ctx.engine.submit(work)


# -- the replaced functions -------------------------------------------------------------------------------

def _allreduce_async(tensor, output, name, op, prescale_factor, postscale_factor, process_set):
    orig = _o("_allreduce_async")
    if bypassed() or _state.ctx is None:
        return orig(tensor, output, name, op, prescale_factor, postscale_factor, process_set)
    return _allreduce_common([tensor], [output], name, op, prescale_factor, postscale_factor, process_set,
                             lambda nm: orig(tensor, output, nm, op, prescale_factor, postscale_factor, process_set),
                             grouped=False)


def _grouped_allreduce_async(tensors, outputs, name, op, prescale_factor, postscale_factor, process_set):
    orig = _o("_grouped_allreduce_async")
    if bypassed() or _state.ctx is None:
        return orig(tensors, outputs, name, op, prescale_factor, postscale_factor, process_set)
    return _allreduce_common(list(tensors), list(outputs), name, op, prescale_factor, postscale_factor, process_set,
                             lambda nm: orig(tensors, outputs, nm, op, prescale_factor, postscale_factor, process_set),
                             grouped=True)


def _horovod_check(factory, tensor) -> None:
    """Horovod's own argument check, except for dtypes Blink carries and this build lacks.

    A CPU build of Horovod 0.28.1 has no uint8/int8/int16/bool kernels for
    every op; Blink's runtime reduces them exactly, so only a tensor Blink
    cannot carry either (non-contiguous, unknown dtype) keeps Horovod's error.
    """
    try:
        _mpi_ops._check_function(factory, tensor)
    except ValueError:
        import torch

        if not tensor.is_contiguous():
            raise
        # bfloat16 on CUDA (stock Horovod 0.28.1 refuses it) and CUDA tensors of a Horovod built
        # without CUDA: Blink's GPU runtime carries them.
        if tensor.is_cuda and _dtype_name(tensor) is not None and not _gpu_reason():
            return
        if tensor.dtype not in (torch.uint8, torch.int8, torch.int16, torch.bool):
            raise


def _allreduce_common(tensors, outputs, name, op, pre, post, process_set, stock_call, grouped: bool):
    m = _mpi_ops
    factory = m._grouped_allreduce_function_factory if grouped else m._allreduce_function_factory
    _horovod_check(factory, tensors[0])  # Horovod's own errors: unsupported type, not contiguous
    if grouped:
        for t in tensors[1:]:
            _horovod_check(factory, t)
        if len({t.device for t in tensors}) > 1:
            # a RuntimeError, as stock Horovod's (its suite expects one), naming where each tensor is
            devices = [str(t.device) for t in tensors]
            where = "; ".join(f"{d}: tensors {[i for i, x in enumerate(devices) if x == d]}"
                              for d in dict.fromkeys(devices))
            raise MismatchError(f"Tensors in grouped allreduce must all be on the same device ({where})")
    opname = _op_name(op)
    if opname == "adasum":
        return _stock("adasum", "Adasum reduction", process_set, stock_call, name, tensors)
    key = _pset_key(process_set)
    if key is None:
        return _stock("process set", "process sets other than the whole job", process_set, stock_call, name, tensors)
    if _state.recording:
        return _stock("timeline", "the timeline is recording", process_set, stock_call, name, tensors)
    why = _carry_reason(tensors, "allreduce")
    if why:
        return _stock(why, why, process_set, stock_call, name, tensors)
    device, ready = None, None
    if tensors[0].is_cuda:  # copied and prescaled in the caller's stream order (.torch_cuda)
        from .torch_cuda import prepare

        arrays, ready = prepare(tensors, outputs, pre)
        device = outputs[0].device
    else:
        arrays = []
        for t, out in zip(tensors, outputs):
            a_in, a_out = _numpy(t), _numpy(out)
            if out is not t:
                if needs_scaling(pre):
                    scale_into(a_out, a_in, pre)
                else:
                    np.copyto(a_out, a_in)
            elif needs_scaling(pre):
                scale_into(a_out, a_out, pre)
            arrays.append(a_out)
    meta = Meta(kind="allreduce", name=name, dtypes=tuple(_dtype_name(t) for t in tensors),
                shapes=tuple(tuple(t.shape) for t in tensors), op=opname, prescale=float(pre),
                postscale=float(post), process_set=key, device="cpu" if device is None else "cuda")
    ctx = _state.ctx
    handle = ctx.engine.new_handle(name)
    result = tuple(outputs) if grouped else outputs[0]
    work = Work(meta=meta, handle=handle, arrays=arrays, finish=lambda: result, keepalive=(tensors, outputs),
                device=device, ready=ready)
    return ctx.engine.submit(work)


def _broadcast_async(tensor, output, root_rank, name, process_set):
    orig = _o("_broadcast_async")
    if bypassed() or _state.ctx is None:
        return orig(tensor, output, root_rank, name, process_set)
    m = _mpi_ops
    _horovod_check(m._broadcast_function_factory, tensor)
    stock_call = lambda nm: orig(tensor, output, root_rank, nm, process_set)  # noqa: E731
    key = _pset_key(process_set)
    if key is None:
        return _stock("process set", "process sets other than the whole job", process_set, stock_call, name, [tensor])
    if _state.recording:
        return _stock("timeline", "the timeline is recording", process_set, stock_call, name, [tensor])
    why = _carry_reason([tensor], "broadcast")
    if why:
        return _stock(why, why, process_set, stock_call, name, [tensor])
    ctx = _state.ctx
    if not isinstance(root_rank, (int, np.integer)) or not 0 <= int(root_rank) < ctx.layout.size:
        raise as_horovod_error(ConfigError(
            f"root_rank: expected a rank in 0..{ctx.layout.size - 1}, got {root_rank!r}"))
    device, ready = None, None
    if tensor.is_cuda:
        from .torch_cuda import prepare

        arrays, ready = prepare([tensor], [output], 1.0)
        device = output.device
    else:
        arrays = [_numpy(output)]
        if output is not tensor:
            np.copyto(arrays[0], _numpy(tensor))
    meta = Meta(kind="broadcast", name=name, dtypes=(_dtype_name(tensor),), shapes=(tuple(tensor.shape),),
                root=int(root_rank), process_set=key, device="cpu" if device is None else "cuda")
    handle = ctx.engine.new_handle(name)
    work = Work(meta=meta, handle=handle, arrays=arrays, finish=lambda: output, keepalive=(tensor, output),
                device=device, ready=ready)
    return ctx.engine.submit(work)


def _stock_passthrough(fn_name: str, kind: str, tensor_at: int, name_at: int, pset_at: int):
    """A replacement that sends ``fn_name`` to stock Horovod at its place in the engine's order.

    ``*_at`` are the positions of the tensor(s), the name and the process set
    in the private function's signature (``horovod/torch/mpi_ops.py``).
    """
    def replacement(*args, **kwargs):
        orig = _o(fn_name)
        if bypassed() or _state.ctx is None:
            return orig(*args, **kwargs)
        tensors = args[tensor_at]
        tensors = list(tensors) if isinstance(tensors, (list, tuple)) else [tensors]
        name = args[name_at] if len(args) > name_at else kwargs.get("name")
        process_set = args[pset_at] if len(args) > pset_at else kwargs.get("process_set")
        def call(nm):
            a = list(args)
            if len(a) > name_at:
                a[name_at] = nm
                return orig(*a, **kwargs)
            return orig(*a, **{**kwargs, "name": nm})

        return _stock(kind, f"Blink does not implement {kind}", process_set, call,
                      name if isinstance(name, str) else None, tensors)

    replacement.__name__ = fn_name
    replacement.__doc__ = f"Blink: ``{fn_name}`` runs on stock Horovod (counted in stats()['fallback'])."
    return replacement


def poll(handle):
    if isinstance(handle, Handle):
        return handle.poll()
    return _o("poll")(handle)


def synchronize(handle):
    if isinstance(handle, Handle):
        return handle.wait()
    return _o("synchronize")(handle)


def join(device=-1) -> int:
    if bypassed() or _state.ctx is None:
        return _o("join")(device)
    ctx = _state.ctx
    devices = ctx.engine.devices
    if devices is not None and devices.device is None:  # a joined rank may serve CUDA rounds: on this GPU
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            devices.join_device = torch.device("cuda", torch.cuda.current_device())
    handle = ctx.engine.new_handle(None)
    ctx.engine.submit(Work(meta=Meta(kind="barrier", name=None, dtypes=(), shapes=()), handle=handle, join=True))
    return int(handle.wait())


def barrier(process_set=None):
    if process_set is None:
        process_set = _mpi_ops.global_process_set
    if bypassed() or _state.ctx is None or _pset_key(process_set) is None:
        return _o("barrier")(process_set)
    ctx = _state.ctx
    handle = ctx.engine.new_handle(None)
    ctx.engine.submit(Work(meta=Meta(kind="barrier", name=None, dtypes=(), shapes=()), handle=handle))
    handle.wait()



# -- init / shutdown ------------------------------------------------------------------------------------------

def init(*args, **kwargs):
    m = _mpi_ops

    def make_cross(sets, cfg):
        stock = {n: _o(n) for n in ("_allreduce_async", "_broadcast_async", "_allgather_async", "poll",
                                    "synchronize")}
        stock.update(Sum=m.Sum, Min=m.Min, Max=m.Max, Product=m.Product,
                     nccl_built=getattr(m, "nccl_built", lambda: False))
        return TorchCross(stock, sets, cfg.timeout_seconds)

    def make_devices(ctx):
        from .torch_cuda import TorchCudaStages

        return TorchCudaStages(ctx.layout, ctx.cross, ctx.config, ctx.rendezvous, ctx.machine_ranks)

    from horovod.torch.functions import allgather_object

    return _state.init(_o("init"), m, args, kwargs, StockView(m, allgather_object), make_cross, make_devices)



# -- installation -------------------------------------------------------------------------------------------------

_REPLACED = {
    "_allreduce_async": _allreduce_async,
    "_grouped_allreduce_async": _grouped_allreduce_async,
    "_broadcast_async": _broadcast_async,
    # (tensor, output, name, process_set)
    "_allgather_async": _stock_passthrough("_allgather_async", "allgather", 0, 2, 3),
    "_grouped_allgather_async": _stock_passthrough("_grouped_allgather_async", "allgather", 0, 2, 3),
    # (tensor, splits, output, output_received_splits, name, process_set)
    "_alltoall_async": _stock_passthrough("_alltoall_async", "alltoall", 0, 4, 5),
    # (tensor, output, name, op, process_set, prescale_factor, postscale_factor)
    "_reducescatter_async": _stock_passthrough("_reducescatter_async", "reducescatter", 0, 2, 4),
    "_grouped_reducescatter_async": _stock_passthrough("_grouped_reducescatter_async", "reducescatter", 0, 2, 4),
    "poll": poll,
    "synchronize": synchronize,
    "join": join,
    "barrier": barrier,
    "init": init,
    **_state.replacements(_o),
}


# Horovod's autograd functions whose backward passes run collectives on the incoming gradients.
_AUTOGRAD = ("HorovodAllreduce", "HorovodGroupedAllreduce", "HorovodBroadcast", "HorovodAllgather",
             "HorovodGroupedAllgather", "HorovodAlltoall", "HorovodReducescatter", "HorovodGroupedReducescatter")


def _contiguous_backward(fn_cls: Any) -> None:
    """Give ``fn_cls.backward`` contiguous gradients while Blink carries the job.

    Autograd hands a backward pass whatever layout the next op produced:
    ``hvd.allreduce(x).sum().backward()`` delivers an expanded (stride-0)
    ones tensor, and Horovod's backward passes it straight into
    ``allreduce``, whose ``_check_function`` refuses non-contiguous tensors
    (stock Horovod 0.28.1 fails that line with "Tensor is required to be
    contiguous.").  Autograd through allreduce must work,
    and a gradient's layout is not the user's choice, so the gradients are
    made contiguous here (a copy only when they are not); a non-contiguous
    tensor passed to a collective directly keeps Horovod's ValueError.
    """
    if getattr(fn_cls, "_blink_backward", None) is not None:
        return
    orig = fn_cls.backward

    def backward(ctx, *grads):
        if _state.ctx is not None and not bypassed():
            grads = tuple(g.contiguous() if g is not None and hasattr(g, "is_contiguous") else g for g in grads)
        return orig(ctx, *grads)

    backward.__doc__ = f"Blink: {fn_cls.__name__}'s backward with contiguous gradients (see _contiguous_backward)."
    fn_cls._blink_backward = orig
    fn_cls.backward = staticmethod(backward)


def install(module: Any = None) -> None:
    """Patch ``horovod.torch`` (already imported) so that its collectives run through Blink."""
    global _mpi_ops
    mpi_ops = sys.modules["horovod.torch.mpi_ops"]
    if getattr(mpi_ops, "_blink_installed", False):
        return
    _mpi_ops = mpi_ops
    for name, fn in _REPLACED.items():
        if hasattr(mpi_ops, name):
            replace_everywhere(_PKG, mpi_ops, name, fn)
    for cls_name in _AUTOGRAD:
        if hasattr(mpi_ops, cls_name):
            _contiguous_backward(getattr(mpi_ops, cls_name))
    from . import torch_optimizer

    torch_optimizer.install()
    mpi_ops._blink_installed = True
    if mpi_ops.is_initialized():  # the hook came late: take over the running job
        init()
