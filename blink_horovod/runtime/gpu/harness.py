"""A small server of GPU ranks for the GPU tests and benchmarks: plan -> programs -> pieces -> GpuExecutor.

Until :class:`~blink_horovod.runtime.communicator.Communicator` dispatches
``device="cuda"`` to the GPU executor (docs/gpu-runtime.md says how), this is
what drives it: the same plan adoption (rank 0's plan rides in the first
collective's metadata, so ranks without cvxpy need no planner), programs
compiled and proved by the symbolic checker once per size, and the same
pieces the communicator builds (``direct`` pieces for allreduce/broadcast,
segment runs for the two hierarchical stages), on CUDA tensors.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from ...errors import ConfigError
from ...planner.plan import Plan
from ..executor import Piece
from ..transport import WaitContext
from .executor import GPU_MAX_PIECE_BYTES, GpuExecutor

__all__ = ["GpuServer"]


class GpuServer:
    """``local_rank`` of ``local_size`` ranks, with plans from ``planner(collective, root) -> Plan``
    (needed on local rank 0 only) or fixed ``plans`` ``{(collective, root): Plan}``."""

    def __init__(self, local_rank: int, local_size: int, job: str, pids: list[int], timeout: float = 120.0,
                 planner: Callable[[str, int | None], Plan] | None = None, chunk_bytes: int = 1 << 20,
                 device: int | None = None, transport: Any = None, cuda: Any = None,
                 fused_launch: str | None = None) -> None:
        if transport is None:
            from ..shm import ShmTransport

            ctx = WaitContext.start("gpu server setup", timeout, 60.0)
            transport = ShmTransport(local_rank, local_size, job, ctx, pids=pids, data_bytes=4096, nflags=16)
        self.transport = transport
        self.ex = GpuExecutor(self.transport, timeout, 60.0, device=device, cuda=cuda, fused_launch=fused_launch)
        self.rank, self.n = local_rank, local_size
        self.planner = planner
        self.chunk_bytes = chunk_bytes
        self.plans: dict[tuple[str, int | None], Plan] = {}
        self.programs: dict[tuple, Any] = {}

    def program(self, plan: Plan, count: int, chunk: int, kind: str):
        from ...schedule import check_program, compile_program

        key = (id(plan), count, chunk, kind)
        prog = self.programs.get(key)
        if prog is None:
            prog = compile_program(plan, count, chunk, kind)
            check_program(prog, plan)
            self.programs[key] = prog
        return prog

    def _run(self, collective: str, arr: Any, count: int, dtype: str, op: str | None, root: int | None,
             plan_key: tuple[str, int | None], make: Callable[[Plan, int], list[Piece]], stream: Any, name: str,
             key: Any = None) -> None:
        """``key``: the caller's replay key (:meth:`_replay_key`), kept by the executor for the next repeat."""
        from ..dtypes import numpy_dtype

        extras: dict[str, Any] = {}
        plan = self.plans.get(plan_key)
        if plan is None and self.rank == 0:
            if self.planner is None:
                raise ConfigError("planner: local rank 0 needs a planner or a plan")
            extras["plan"] = self.planner(*plan_key).to_dict()
        checked = {"collective": collective, "name": name, "dtype": dtype, "shape": [count], "op": op, "root": root}
        itemsize = numpy_dtype(dtype).itemsize
        chunk = max(1, self.chunk_bytes // itemsize)

        def build(all_extras: list[dict[str, Any]]) -> list[Piece]:
            p = self.plans.get(plan_key)
            if p is None:
                p = self.plans[plan_key] = Plan.from_dict(all_extras[0]["plan"])
            return make(p, chunk)

        self.ex.collective(f"{collective} {name!r}", checked, extras, arr, dtype, op or "sum", build, stream=stream,
                           replay_key=key)

    def _replay_key(self, collective: str, count: int, dtype: str, op: str | None, root: int | None,
                    name: str) -> tuple:
        """Everything that decides a collective's metadata and pieces here (the plan is fixed per key)."""
        return (collective, count, dtype, op, root, name, self.chunk_bytes)

    def allreduce(self, arr: Any, count: int, dtype: str, op: str = "sum", stream: Any = None, name: str = "") -> None:
        key = self._replay_key("allreduce", count, dtype, op, None, name)
        if self.ex.replay(key, arr, stream):  # a repeat is one replay: nothing below runs
            return
        piece = max(1, GPU_MAX_PIECE_BYTES // _itemsize(dtype))

        def make(plan: Plan, chunk: int) -> list[Piece]:
            return [Piece(self.program(plan, min(piece, count - a), chunk, "allreduce"), direct=a)
                    for a in range(0, count, piece)]

        self._run("allreduce", arr, count, dtype, op, None, ("allreduce", None), make, stream, name, key)

    def broadcast(self, arr: Any, count: int, dtype: str, root: int = 0, stream: Any = None, name: str = "") -> None:
        key = self._replay_key("broadcast", count, dtype, None, root, name)
        if self.ex.replay(key, arr, stream):
            return
        piece = max(1, GPU_MAX_PIECE_BYTES // _itemsize(dtype))
        me = self.rank

        def make(plan: Plan, chunk: int) -> list[Piece]:
            return [Piece(self.program(plan, min(piece, count - a), chunk, "broadcast"), direct=a,
                          has_input=me == root, wants_output=me != root) for a in range(0, count, piece)]

        self._run("broadcast", arr, count, dtype, None, root, ("broadcast", root), make, stream, name, key)

    def _segment_runs(self, count: int) -> list[tuple[int, int, int]]:
        n = self.n
        return [(i * count // n, i * count // n, (i + 1) * count // n - i * count // n) for i in range(n)]

    def reduce_to_roots(self, arr: Any, count: int, dtype: str, op: str = "sum", stream: Any = None,
                        name: str = "") -> tuple[int, int]:
        runs = self._segment_runs(count)
        me = self.rank

        def make(plan: Plan, chunk: int) -> list[Piece]:
            return [Piece(self.program(plan, count, chunk, "reduce"), runs, [runs[me]])]

        self._run("reduce_to_roots", arr, count, dtype, op, None, ("allreduce", None), make, stream, name)
        return runs[me][0], runs[me][0] + runs[me][2]

    def broadcast_from_roots(self, arr: Any, count: int, dtype: str, stream: Any = None, name: str = "") -> None:
        runs = self._segment_runs(count)
        me = self.rank

        def make(plan: Plan, chunk: int) -> list[Piece]:
            return [Piece(self.program(plan, count, chunk, "broadcast"), [runs[me]],
                          [r for i, r in enumerate(runs) if i != me])]

        self._run("broadcast_from_roots", arr, count, dtype, None, None, ("allreduce", None), make, stream, name)

    def synchronize(self) -> None:
        self.ex.synchronize()

    def close(self) -> None:
        self.ex.close()


def _itemsize(dtype: str) -> int:
    from ..dtypes import numpy_dtype

    return numpy_dtype(dtype).itemsize


def job_from_env() -> str:
    return os.environ.get("BLINK_TEST_JOB", "gpu")
