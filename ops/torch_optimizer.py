"""``hvd.DistributedOptimizer`` for PyTorch with Blink's fixed gradient buckets.

Stock Horovod registers a hook per parameter and allreduces each gradient as
it appears; its background thread fuses whatever is ready, in whatever order
the ranks produced it (it negotiates by name).  Blink runs collectives in
submission order, so this optimizer cuts the parameters into fixed buckets
once (:mod:`.fusion`, in the manner of PyTorch DDP's reducer) and launches
bucket ``k`` when all its gradients are ready and buckets ``0..k-1`` are
launched -- the same order on every rank, overlapping the rest of backward.
Parameters a rank's backward did not touch (dynamic graphs; Horovod's
``test_force_allreduce``) get zero gradients in ``synchronize()``, as in
stock Horovod, and their buckets launch there, still in order.

Everything else of Horovod's ``_DistributedOptimizer`` is kept as it is
(``step``, ``skip_synchronize``, ``zero_grad`` checks, argument validation,
``backward_passes_per_step``): the class is built the way Horovod builds it
(``type(name, (optimizer.__class__,), methods)``), with Horovod's methods
and the bucket methods below.  Adasum, and process sets other than the whole
job, keep stock Horovod's optimizer (counted as fallbacks).
"""

from __future__ import annotations

import threading
from typing import Any

from .fallback import fallback
from .fusion import BucketTracker, fusion_threshold, plan_buckets
from .patching import bypassed, originals, replace_everywhere

__all__ = ["DistributedOptimizer", "install"]

_stock_factory: Any = None


class _BucketMethods:
    """Methods that replace Horovod's per-parameter hooks with ordered buckets."""

    def _register_hooks(self):
        from horovod.common.util import split_list

        params = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        order = list(reversed(params))  # backward produces gradients roughly last layer first
        if self._groups is not None:
            if isinstance(self._groups, list):
                ids = {id(p) for p in order}
                buckets = [[p for p in g if id(p) in ids] for g in self._groups]
                grouped = {id(p) for g in buckets for p in g}
                buckets = [b for b in buckets if b] + [[p] for p in order if id(p) not in grouped]
            else:
                buckets = [list(b) for b in split_list(order, self._groups) if b]
        else:
            nbytes = [p.numel() * p.element_size() for p in order]
            buckets = [[order[i] for i in b] for b in plan_buckets(nbytes, fusion_threshold())]
        self._blink_buckets = buckets
        self._blink_slot = {p: i for i, p in enumerate(p for b in buckets for p in b)}
        index, slots = 0, []
        for b in buckets:
            slots.append(list(range(index, index + len(b))))
            index += len(b)
        self._blink_tracker = BucketTracker(slots)
        self._blink_lock = threading.Lock()
        self._blink_launched: list[tuple[int, Any, Any]] = []
        for p in params:
            self._requires_update.add(p)
            p_tmp = p.expand_as(p)
            grad_acc = p_tmp.grad_fn.next_functions[0][0]
            grad_acc.register_hook(self._make_hook(p))
            self._grad_accs.append(grad_acc)

    def _make_hook(self, p):
        def hook(*ignore):
            if self._allreduce_delay[p] <= 0:
                raise AssertionError(
                    "Gradients were computed more than backward_passes_per_step times before call to step(). "
                    "Increase backward_passes_per_step to accumulate gradients locally.")
            assert not p.grad.requires_grad
            self._allreduce_delay[p] -= 1
            if self._allreduce_delay[p] == 0:
                with self._blink_lock:
                    for b in self._blink_tracker.ready(self._blink_slot[p]):
                        self._blink_launch(b)
        return hook

    def _blink_launch(self, b: int) -> None:
        """Submit bucket ``b``: one grouped allreduce of its dense gradients (Blink fuses per dtype)."""
        from horovod.torch.mpi_ops import Average, grouped_allreduce_async_, sparse_allreduce_async

        members = self._blink_buckets[b]
        dense, ctxs, sparse = [], [], []
        for p in members:
            if p.grad is None:
                # As stock Horovod: a rank whose backward skipped p still submits zeros.
                p.grad = p.data.new(p.size()).zero_()
            g = p.grad
            if g.is_sparse:
                if self.sparse_as_dense:
                    g = g.to_dense()
                else:
                    sparse.append(p)
                    continue
            gc, ctx = self._compression.compress(g)
            dense.append((p, g, gc))
            ctxs.append(ctx)
        handle = None
        if dense:
            if self.op == Average:
                pre, post = 1.0 / self.gradient_predivide_factor, self.gradient_predivide_factor
            else:
                pre, post = 1.0, 1.0
            handle = grouped_allreduce_async_([gc for _, _, gc in dense], op=self.op, prescale_factor=pre,
                                              postscale_factor=post, process_set=self.process_set)
        sparse_handles = []
        for p in sparse:
            fallback("sparse", "sparse gradients are allgathered by stock Horovod")
            sparse_handles.append((p, sparse_allreduce_async(p.grad, name=self._parameter_names.get(p), op=self.op,
                                                             process_set=self.process_set)))
        self._blink_launched.append((b, (handle, dense, ctxs), sparse_handles))
        self._handles[tuple(members)] = (handle, ctxs)

    def synchronize(self):
        if not self.process_set.included() or not hasattr(self, "_blink_tracker"):
            self._synchronized = True  # one rank (no hooks registered) or not in the set: nothing to reduce
            return
        from horovod.torch.mpi_ops import synchronize as hvd_synchronize

        with self._blink_lock:
            for b in self._blink_tracker.pending():
                self._blink_launch(b)
            launched, self._blink_launched = self._blink_launched, []
            self._blink_tracker.reset()
        for b, (handle, dense, ctxs), sparse_handles in launched:
            if handle is not None:
                outputs = hvd_synchronize(handle)
                for (p, g, gc), out, ctx in zip(dense, outputs, ctxs):
                    result = self._compression.decompress(out, ctx)
                    if result is not p.grad:
                        if p.grad.is_sparse:  # sparse_as_dense: back to sparse for the update
                            p.grad.zero_().add_(result.to_sparse())
                        elif result.data_ptr() != p.grad.data_ptr():
                            p.grad.copy_(result)
            for p, h in sparse_handles:
                aggregated = h()
                p.grad.zero_().add_(aggregated)
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = self.backward_passes_per_step
        self._handles.clear()
        self._synchronized = True

    def load_state_dict(self, *args, **kwargs):
        self._handles = {}
        self._synchronized = False
        self._should_synchronize = True
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = self.backward_passes_per_step
        if hasattr(self, "_blink_tracker"):
            self._blink_tracker.reset()
            self._blink_launched = []
        super(self.__class__, self).load_state_dict(*args, **kwargs)


def DistributedOptimizer(optimizer, named_parameters=None, compression=None, backward_passes_per_step=1,
                         op=None, gradient_predivide_factor=1.0, num_groups=0, groups=None, sparse_as_dense=False,
                         process_set=None):
    """Horovod's ``DistributedOptimizer`` (same arguments), with Blink's ordered gradient buckets."""
    import warnings

    from horovod.torch import mpi_ops
    from horovod.torch.compression import Compression
    from horovod.torch.optimizer import _DistributedOptimizer

    from . import torch_ops

    compression = Compression.none if compression is None else compression
    op = mpi_ops.Average if op is None else op
    process_set = mpi_ops.global_process_set if process_set is None else process_set
    args = (optimizer, named_parameters, compression, backward_passes_per_step, op, gradient_predivide_factor,
            num_groups, groups, sparse_as_dense, process_set)
    if bypassed() or torch_ops.context() is None:
        return _stock_factory(*args)
    if op == mpi_ops.Adasum:
        fallback("adasum", "Adasum optimizer")
        return _stock_factory(*args)
    if torch_ops._pset_key(process_set) is None:
        fallback("process set", "DistributedOptimizer on a process set other than the whole job")
        return _stock_factory(*args)
    # Horovod's own argument checks (horovod/torch/optimizer.py: DistributedOptimizer).
    if gradient_predivide_factor != 1.0:
        if mpi_ops.rocm_built():
            raise ValueError("gradient_predivide_factor not supported yet with ROCm")
        if op != mpi_ops.Average:
            raise ValueError("gradient_predivide_factor not supported with op != Average")
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed in v0.23.0.",
                      DeprecationWarning)
        if groups is None:
            groups = num_groups
    if backward_passes_per_step <= 0:
        raise ValueError("backward_passes_per_step must be > 0")
    methods = dict(_DistributedOptimizer.__dict__)
    methods.update({k: v for k, v in _BucketMethods.__dict__.items() if not k.startswith("__")})
    # Horovod's broadcast_optimizer_state steps a fresh optimizer without its allreduce only when
    # optimizer.__module__ == DistributedOptimizer.__module__ (the factory it imports, i.e. this one):
    # the class must say this module, or ranks with empty state submit an allreduce rank 0 never does.
    methods["__module__"] = __name__
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), methods)
    return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step, op,
               gradient_predivide_factor, groups, sparse_as_dense, process_set)


def install() -> None:
    """Replace ``horovod.torch.DistributedOptimizer`` (everywhere it was imported)."""
    global _stock_factory
    import horovod.torch.optimizer as hopt

    if _stock_factory is None:
        _stock_factory = originals("horovod.torch.optimizer").get("DistributedOptimizer", hopt.DistributedOptimizer)
    replace_everywhere("horovod.torch", hopt, "DistributedOptimizer", DistributedOptimizer)
