"""Loopback ranks for the runtime and ops tests: hand-made plans, communicators over threads.

Plans here are built by hand (chains and stars rooted so that rank i roots
the i-th 1/n, as docs/formats.md requires of allreduce plans), so the runtime
tests do not depend on the planner; programs come from the real schedule
compiler.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from blink_horovod.config import load_config
from blink_horovod.planner.plan import Plan, Tree
from blink_horovod.runtime.communicator import Communicator
from blink_horovod.runtime.loopback import LoopbackWorld
from blink_horovod.topology.machines import cpu
from blink_horovod.topology.model import Topology

from .ranks import rank_outcomes, run_ranks

__all__ = ["chain_edges", "hand_planner", "rank_errors", "run_loopback"]


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


def _loopback_rank(n: int, body: Callable[[int, Communicator], Any], env: dict[str, str] | None,
                   planner, topology: Topology | None, eager: bool) -> Callable[[int], Any]:
    world = LoopbackWorld(n)
    cfg = load_config(env or {})

    def rank_main(r: int) -> Any:
        comm = Communicator(r, n, topology or cpu(n), None, cfg, transport=world.transport(r),
                            planner=planner or hand_planner())
        try:
            if not eager:
                comm.eager_bytes = 0
            return body(r, comm)
        finally:
            comm.close()

    return rank_main


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
    """Run ``body(rank, comm)`` on ``n`` loopback ranks (threads); re-raise the lowest failing rank's error.

    ``eager`` False (default) sends even small messages through the trees, so
    that tests of small sizes exercise the programs; True keeps the one-round
    path for small messages.
    """
    return run_ranks(_loopback_rank(n, body, env, planner, topology, eager), n, join_timeout)


def rank_errors(n: int, body: Callable[[int, Communicator], Any], *, env: dict[str, str] | None = None, planner=None,
                topology: Topology | None = None, join_timeout: float = 30.0,
                eager: bool = False) -> list[BaseException | None]:
    """Like :func:`run_loopback`, but return every rank's exception (None where it succeeded)."""
    outcomes = rank_outcomes(_loopback_rank(n, body, env, planner, topology, eager), n, join_timeout)
    return [o.error for o in outcomes]
