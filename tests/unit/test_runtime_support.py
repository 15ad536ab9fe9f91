"""Helpers shared by the runtime tests: hand-made plans and loopback ranks as threads.

Plans here are built by hand (chains and stars rooted so that rank i roots the
i-th 1/n, as docs/formats.md requires of allreduce plans), so the runtime tests do
not depend on the planner; programs come from the real schedule compiler.
"""

from __future__ import annotations

import threading
import traceback
from typing import Any, Callable

import numpy as np
import pytest

from blink_horovod.config import load_config
from blink_horovod.planner.plan import Plan, Tree
from blink_horovod.runtime.communicator import Communicator
from blink_horovod.runtime.loopback import LoopbackWorld
from blink_horovod.topology.machines import cpu
from blink_horovod.topology.model import Topology

pytestmark = pytest.mark.timeout(60)


def chain_edges(order: list[int]) -> tuple[tuple[int, int], ...]:
    return tuple((order[i], order[i + 1]) for i in range(len(order) - 1))


def hand_planner(shape: str = "chain", trees_per_root: int = 1) -> Callable[[Topology, str, int | None], Plan]:
    """A planner of chains (or stars) over any topology's GPUs, ignoring links."""

    def plan(topology: Topology, collective: str, root: int | None) -> Plan:
        gpus = list(topology.gpus)
        n = len(gpus)

        def tree_from(r: int, k: int) -> tuple[tuple[int, int], ...]:
            others = [g for g in gpus if g != r]
            if k % 2:
                others.reverse()
            if shape == "star":
                return tuple((r, g) for g in others)
            return chain_edges([r] + others)

        if collective == "allreduce":
            trees = tuple(
                Tree(g, 1.0 / (n * trees_per_root), tree_from(g, k)) for g in gpus for k in range(trees_per_root)
            )
            return Plan("allreduce", topology.name, tuple(gpus), None, trees, 1.0, 1.0)
        r = gpus[0] if root is None else root
        trees = tuple(Tree(r, 1.0 / trees_per_root, tree_from(r, k)) for k in range(trees_per_root))
        return Plan("broadcast", topology.name, tuple(gpus), r, trees, 1.0, 1.0)

    return plan


def run_loopback(
    n: int,
    body: Callable[[int, Communicator], Any],
    *,
    env: dict[str, str] | None = None,
    planner=None,
    topology: Topology | None = None,
    join_timeout: float = 30.0,
    eager: bool = False,
) -> list[Any]:
    """Run ``body(rank, comm)`` on ``n`` loopback ranks (threads); re-raise the first failure.

    ``eager`` False (default) sends even small messages through the trees, so
    that tests of small sizes exercise the programs; True keeps the one-round
    path for small messages.
    """
    world = LoopbackWorld(n)
    cfg = load_config(env or {})
    results: list[Any] = [None] * n
    errors: list[BaseException | None] = [None] * n
    tracebacks: list[str] = [""] * n

    def rank_main(r: int) -> None:
        comm = None
        try:
            comm = Communicator(r, n, topology or cpu(n), None, cfg, transport=world.transport(r),
                                planner=planner or hand_planner())
            if not eager:
                comm.eager_bytes = 0
            results[r] = body(r, comm)
        except BaseException as exc:
            errors[r] = exc
            tracebacks[r] = traceback.format_exc()
        finally:
            if comm is not None:
                comm.close()

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for r, t in enumerate(threads):
        t.join(join_timeout)
        if t.is_alive():
            raise AssertionError(f"loopback rank {r} hung")
    for r, exc in enumerate(errors):
        if exc is not None:
            exc.rank_tracebacks = tracebacks  # type: ignore[attr-defined]
            raise exc
    return results


def rank_errors(n: int, body, **kw) -> list[BaseException | None]:
    """Like run_loopback, but return every rank's exception (None where it succeeded)."""
    world = LoopbackWorld(n)
    cfg = load_config(kw.pop("env", None) or {})
    errors: list[BaseException | None] = [None] * n

    def rank_main(r: int) -> None:
        comm = None
        try:
            comm = Communicator(r, n, kw.get("topology") or cpu(n), None, cfg, transport=world.transport(r),
                                planner=kw.get("planner") or hand_planner())
            if not kw.get("eager", False):
                comm.eager_bytes = 0
            body(r, comm)
        except BaseException as exc:
            errors[r] = exc
        finally:
            if comm is not None:
                comm.close()

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for r, t in enumerate(threads):
        t.join(kw.get("join_timeout", 30.0))
        if t.is_alive():
            raise AssertionError(f"loopback rank {r} hung")
    return errors


def test_hand_plans_are_valid() -> None:
    from blink_horovod.planner.plan import validate_plan

    topo = cpu(4)
    for shape in ("chain", "star"):
        for k in (1, 2):
            validate_plan(hand_planner(shape, k)(topo, "allreduce", None), topo)
            validate_plan(hand_planner(shape, k)(topo, "broadcast", 2), topo)


def integer_data(rank: int, count: int, dtype: np.dtype, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed * 1000 + rank)
    return rng.integers(-8, 9, count).astype(dtype)
