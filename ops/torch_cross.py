"""The cross-server stage over stock ``horovod.torch``: Horovod's rings on numpy arrays (or CUDA tensors), in place.

The hierarchical allreduce's stage 2 (:mod:`.hierarchical`) runs on Horovod
itself -- Gloo, MPI or NCCL, whichever the job uses -- on the process sets
of same-local-rank ranks created in ``hvd.init``.  numpy arrays cross into
torch without copies (``torch.from_numpy`` shares the memory) and Horovod
reduces them in place.  Every wait polls with a deadline
(``BLINK_TIMEOUT_SECONDS``) instead of blocking in Horovod's C++ wait.
"""

from __future__ import annotations

from typing import Any
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from .horovod_wait import cross_grace, explained, wait_horovod

__all__ = ["TorchCross"]


class TorchCross:
    """:class:`~.hierarchical.CrossTransport` over the original (unpatched) ``horovod.torch`` functions.

    Parameters
    ----------
    stock:
        The originals: ``_allreduce_async``, ``_broadcast_async``, ``_allgather_async``,
        ``poll``, ``synchronize`` and the op constants ``Sum``, ``Min``, ``Max``, ``Product``.
    process_sets:
        ``tuple(ranks) -> ProcessSet`` for every cross-server set.
    timeout:
        Seconds before a wait raises ``BlinkTimeoutError``.
    """

    def __init__(self, stock: Mapping[str, Any], process_sets: Mapping[tuple[int, ...], Any], timeout: float) -> None:
        import torch  # noqa: F401 - this adapter runs inside horovod.torch

        self.stock = stock
        self.sets = dict(process_sets)
        # A rank that finds a fault within its server tells the other servers only once its own wait
        # there has timed out; the peers waiting for it here wait that much longer, to hear it.
        self.timeout = timeout + cross_grace(timeout)
        self.interrupt: Callable[[], None] | None = None  # raises when a server-mate has failed
        # explain(ranks)(what, waited, cause): the error line naming who holds a wait up (.peer_status)
        self.explain: Callable[[Sequence[int]], Callable[[str, float, BaseException | None], str | None]] | None = None
        self._ops = {"sum": stock["Sum"], "min": stock["Min"], "max": stock["Max"], "product": stock["Product"]}
        self.nccl = bool(stock["nccl_built"]()) if "nccl_built" in stock else False

    def _set(self, ranks: Sequence[int]) -> Any:
        return self.sets[tuple(ranks)]

    def _run(self, submit: Callable[[], Any], what: str, ranks: Sequence[int]) -> Any:
        """Submit a stock op (``submit()`` returns its handle) and wait for it with the deadline."""
        explain = self.explain(ranks) if self.explain is not None else None
        try:
            handle = submit()
        except Exception as exc:  # Horovod already shut down under us (Gloo lost a rank): say which
            out = explained(exc, explain, what, self.timeout)
            if out is exc:
                raise
            raise out from exc
        return wait_horovod(self.stock["poll"], self.stock["synchronize"], handle, self.timeout, what,
                            self.interrupt, explain)

    @staticmethod
    def _tensor(arr: np.ndarray):
        import torch

        if arr.dtype.name == "bfloat16":
            return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(arr)

    def _prepared(self, arr: np.ndarray) -> tuple[Any, np.ndarray | None]:
        """The torch tensor Horovod reduces in place, and the widened copy of a narrow array (or None)."""
        wide = _widened(arr)
        return self._tensor(arr if wide is None else wide), wide

    def _direct(self, t: Any) -> bool:
        """Whether Horovod takes this CUDA tensor as it is: built with NCCL, and a dtype its CUDA kernels
        have.  Otherwise the tensor crosses through host memory here -- as Horovod itself stages CUDA
        tensors when built without NCCL -- which also covers bfloat16, refused on CUDA by Horovod 0.28.1."""
        import torch

        return self.nccl and t.dtype in (torch.float16, torch.float32, torch.float64, torch.int32, torch.int64)

    def _staged(self, t: Any, run: Callable[[np.ndarray], None]) -> None:
        """``run`` on a host copy of CUDA tensor ``t`` (as numpy), then the result copied back."""
        import torch

        host = t.detach().to("cpu")
        if host.dtype == torch.bfloat16:
            import ml_dtypes

            view = host.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        else:
            view = host.view(torch.uint8).numpy().view(np.bool_) if host.dtype == torch.bool else host.numpy()
        run(view)
        t.copy_(host)

    def allreduce(self, arr: Any, op: str, ranks: Sequence[int], name: str) -> None:
        if not isinstance(arr, np.ndarray):  # a CUDA tensor (.torch_cuda)
            if not self._direct(arr):
                self._staged(arr, lambda a: self.allreduce(a, op, ranks, name))
                return
            self._run(lambda: self.stock["_allreduce_async"](arr, arr, name, self._ops[op], 1.0, 1.0,
                                                             self._set(ranks)),
                      f"cross-server allreduce {name}", ranks)
            return
        t, wide = self._prepared(arr)
        self._run(lambda: self.stock["_allreduce_async"](t, t, name, self._ops[op], 1.0, 1.0, self._set(ranks)),
                  f"cross-server allreduce {name}", ranks)
        if wide is not None:
            arr[...] = wide.astype(arr.dtype)  # wraps modulo 2^bits, as the narrow sum/product would

    def broadcast(self, arr: Any, root: int, ranks: Sequence[int], name: str) -> None:
        if not isinstance(arr, np.ndarray):  # a CUDA tensor (.torch_cuda)
            if not self._direct(arr):
                self._staged(arr, lambda a: self.broadcast(a, root, ranks, name))
                return
            self._run(lambda: self.stock["_broadcast_async"](arr, arr, root, name, self._set(ranks)),
                      f"cross-server broadcast {name}", ranks)
            return
        t, wide = self._prepared(arr)
        self._run(lambda: self.stock["_broadcast_async"](t, t, root, name, self._set(ranks)),
                  f"cross-server broadcast {name}", ranks)
        if wide is not None:
            arr[...] = wide.astype(arr.dtype)

    def allgather_rows(self, row: np.ndarray, ranks: Sequence[int], name: str) -> np.ndarray:
        import torch

        t = torch.from_numpy(np.ascontiguousarray(row).reshape(1, -1))
        out = self._run(lambda: self.stock["_allgather_async"](t, t.new(), name, self._set(ranks)),
                        f"cross-server metadata {name}", ranks)
        return out.numpy()


# This CPU build of Horovod 0.28.1 has no uint8/int8/int16/bool collectives,
# which Blink carries: the cross-server stage moves them as int64 (exact for
# min/max, and sums/products wrap to the same narrow result after the cast).
_NARROW = ("uint8", "int8", "int16", "bool")


def _widened(arr: np.ndarray) -> np.ndarray | None:
    """The copy Horovod reduces in place of ``arr``: int64 for the narrow integers; float32 for bfloat16,
    which Horovod 0.28.1 refuses on CPU as on CUDA (exact for broadcast, min and max; a sum or product
    accumulated in float32, then rounded once)."""
    if arr.dtype.name in _NARROW:
        return arr.astype(np.int64)
    if arr.dtype.name == "bfloat16":
        return arr.astype(np.float32)
    return None

