"""What Blink holds between ``hvd.init()`` and ``hvd.shutdown()``: layout, communicator, engine.

Built once per ``hvd.init`` by a framework adapter (:mod:`.torch_ops`,
:mod:`.tf_ops`) from stock Horovod's view of the job, and torn down by
``hvd.shutdown`` -- so ``init``/``shutdown`` cycles (Horovod's elastic mode,
its own test suite) leave no shared memory, files or threads behind.  When
Blink cannot run for the job (servers of different sizes, ranks not numbered
server by server), :func:`create_context` returns None with the reason, and
every collective goes to stock Horovod.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Protocol
from collections.abc import Callable, Sequence

import numpy as np

from ..config import Config, load_config
from ..errors import BlinkError
from .engine import Engine
from .fusion import fusion_threshold
from .hierarchical import CrossTransport, Hierarchy
from .layout import Layout, layout_from_horovod

__all__ = [
    "BlinkContext",
    "HorovodView",
    "InitPlan",
    "configure_logging",
    "create_context",
    "cross_sets_after_init",
    "plan_init",
]

log = logging.getLogger("blink_horovod.ops")


class HorovodView(Protocol):
    """Stock Horovod of one framework binding, as the runtime's ``rendezvous.from_horovod`` reads it."""

    def rank(self) -> int: ...
    def size(self) -> int: ...
    def local_rank(self) -> int: ...
    def local_size(self) -> int: ...
    def is_homogeneous(self) -> bool: ...
    def allgather_object(self, obj: Any) -> list: ...


@dataclass
class BlinkContext:
    """The live Blink state of one process."""

    layout: Layout
    config: Config
    engine: Engine
    communicator: Any = None
    rendezvous: Any = None
    cross: CrossTransport | None = None
    status: Any = None  # the StatusResponder (.peer_status); with it, the terminate handler was installed
    machine_ranks: int = 1  # ranks of the job on this machine (servers of one job may share one)

    def close(self) -> None:
        """Stop the engine, free shared memory, leave the rendezvous (idempotent)."""
        try:
            self.engine.close()
        finally:
            for obj in (self.engine.devices, self.communicator, self.rendezvous, self.status):
                if obj is not None:
                    try:
                        obj.close()
                    except Exception as exc:  # closing must not mask the shutdown
                        log.warning("blink: closing %s: %s", type(obj).__name__, exc)
            if self.status is not None:  # the ranks the terminate handler would name are gone by design
                from ..runtime.last_words import uninstall

                uninstall()
            self.communicator = self.rendezvous = self.engine.devices = self.status = None


def configure_logging(level: str) -> None:
    """Send ``blink_horovod`` log records to stderr at ``BLINK_LOG_LEVEL`` (once)."""
    root = logging.getLogger("blink_horovod")
    root.setLevel({"warning": logging.WARNING, "info": logging.INFO, "debug": logging.DEBUG}[level])
    if not root.handlers:
        h = logging.StreamHandler()
        h.setFormatter(logging.Formatter("[%(name)s %(levelname)s] %(message)s"))
        root.addHandler(h)


def create_context(hvd: HorovodView, cross_factory: Callable[[Layout], CrossTransport | None],
                   config: Config | None = None) -> tuple[BlinkContext | None, str]:
    """Set Blink up for the job stock Horovod just initialised.

    Returns ``(context, "")``, or ``(None, reason)`` when Blink stays out.
    ``cross_factory(layout)`` gives the cross-server transport (it needs the
    process sets the adapter created in ``hvd.init``).
    """
    cfg = config or load_config()
    configure_logging(cfg.log_level)
    layout = layout_from_horovod(hvd.rank(), hvd.size(), hvd.local_size(), hvd.is_homogeneous(), _env())
    if layout is None:
        return None, "servers run different numbers of ranks (set BLINK_LOCAL_SIZE to override)"
    cross = status = None
    machine_ranks = 1
    engine_of: list[Engine] = []  # the engine, once made: what the status responder reports
    if layout.multi_server:
        cross = cross_factory(layout)
        if cross is None:
            return None, "the cross-server process sets could not be created"
    if layout.size > 1:
        # Here, while every rank is on the same path: the one Horovod exchange of status addresses.
        status, addresses, machines = _status_addresses(hvd, engine_of)
        machine_ranks = sum(1 for m in machines.values() if m == machines[layout.rank])
        from ..runtime.last_words import install as install_last_words

        install_last_words(layout.rank, addresses)  # undone by BlinkContext.close
        if cross is not None and hasattr(cross, "explain"):
            cross.explain = _explainer(layout.rank, engine_of, addresses)
    comm = rdv = None
    if layout.local_size > 1:
        from ..runtime.communicator import Communicator  # lazy: importing ops stays cheap
        from ..runtime.rendezvous import from_horovod

        try:
            rdv = from_horovod(hvd, cfg)
        except BlinkError as exc:
            if status is not None:
                status.close()
            return None, str(exc)
        if (rdv.local_rank, rdv.local_size) != (layout.local_rank, layout.local_size):
            rdv.close()
            if status is not None:
                status.close()
            return None, (f"Horovod's numbering is not server by server (rank {layout.rank}: local rank "
                          f"{rdv.local_rank} of {rdv.local_size} on its host, expected {layout.local_rank})")
        comm = Communicator(layout.local_rank, layout.local_size, None, rdv, cfg)
    intra = comm.allgather_object if comm is not None else (lambda obj: [obj])
    if cross is not None and comm is not None and comm.transport is not None:
        comm.transport.rank_offset = layout.server * layout.local_size  # errors name global ranks
        if hasattr(cross, "interrupt"):
            cross.interrupt = _peer_check(comm.transport, cfg)

    def cross_allgather(row: np.ndarray, name: str) -> np.ndarray:
        return cross.allgather_rows(row, layout.cross_ranks(), name)  # type: ignore[union-attr]

    engine = Engine(layout.rank, layout.size, layout.server, Hierarchy(layout, comm, cross), intra,
                    cross_allgather if cross is not None else None, cfg.timeout_seconds, fusion_threshold(),
                    cfg.stall_check_seconds, cfg.eager_bytes)
    engine_of.append(engine)
    log.info("blink: rank %d of %d, server %d of %d (%d ranks each), topology %s", layout.rank, layout.size,
             layout.server, layout.num_servers, layout.local_size,
             comm.topology.name if comm is not None else "-")
    return BlinkContext(layout, cfg, engine, comm, rdv, cross, status, machine_ranks), ""


@dataclass
class InitPlan:
    """How ``hvd.init`` is called under Blink: the user's process sets plus the cross-server ones."""

    process_sets: Any
    dynamic: bool
    custom_comm: bool


def plan_init(ProcessSet: Any, comm: Any, process_sets: Any) -> InitPlan:
    """Add the cross-server process sets (one per local rank) to the user's ``hvd.init`` arguments.

    Static process sets must be known at ``init`` (Horovod creates them
    there), so the layout comes from the launcher's variables
    (:func:`.layout.layout_from_env`); with ``process_sets="dynamic"`` they are
    added after ``init`` instead.  A custom communicator (``comm=``) keeps
    Blink out of the job.
    """
    import os

    from ..errors import ConfigError
    from .layout import layout_from_env

    dynamic = isinstance(process_sets, str) and process_sets.lower() == "dynamic"
    custom_comm = not (comm is None or (isinstance(comm, (list, tuple)) and len(comm) == 0))
    try:
        pre = layout_from_env(os.environ)
    except ConfigError as exc:
        log.warning("blink: %s", exc)
        pre = None
    if pre is None or not pre.multi_server or custom_comm or dynamic:
        return InitPlan(process_sets, dynamic, custom_comm)
    user = list(process_sets or [])
    have = {tuple(ps.ranks) for ps in user if getattr(ps, "ranks", None) is not None}
    # With one rank per server the cross set is the whole job: Horovod's global set carries it, and
    # registering it again makes Horovod fail init ("mismatching numbers of process sets").
    ours = [ProcessSet(r) for r in pre.all_cross_sets() if tuple(r) not in have and len(r) < pre.size]
    return InitPlan(user + ours, dynamic, custom_comm)


def cross_sets_after_init(plan: InitPlan) -> dict[tuple[int, ...], Any]:
    """``tuple(ranks) -> ProcessSet`` of every static set that Horovod initialised."""
    out: dict[tuple[int, ...], Any] = {}
    if plan.dynamic or not plan.process_sets:
        return out
    for ps in plan.process_sets:
        if getattr(ps, "ranks", None) is not None and ps.process_set_id is not None:
            out[tuple(ps.ranks)] = ps
    return out


def add_missing_sets(layout: Layout, sets: dict, add_process_set: Callable[[list[int]], Any],
                     global_set: Any = None) -> bool:
    """Add (dynamically) the cross-server sets ``sets`` lacks; False if Horovod refuses.

    A cross set that is the whole job (one rank per server) is Horovod's ``global_set``."""
    for ranks in layout.all_cross_sets():
        if tuple(ranks) not in sets and global_set is not None and len(ranks) == layout.size:
            sets[tuple(ranks)] = global_set
        if tuple(ranks) not in sets:
            try:
                sets[tuple(ranks)] = add_process_set(ranks)
            except Exception as exc:  # static process sets and no HOROVOD_DYNAMIC_PROCESS_SETS
                log.warning("blink: cannot add process set %s: %s", ranks, exc)
                return False
    return True


def _status_addresses(hvd: HorovodView, engine_of: list[Engine]
                      ) -> tuple[Any, dict[int, tuple[list[str], int, int]], dict[int, str]]:
    """Start this rank's status responder and learn every rank's ``(hosts, port, pid)`` and machine
    (:func:`.peer_status.machine_id`), in one Horovod allgather."""
    import os

    from .peer_status import StatusResponder, machine_id

    responder = StatusResponder(lambda: engine_of[0].status() if engine_of else {"state": "starting", "round": 0})
    try:
        rows = hvd.allgather_object((*responder.address(), os.getpid(), machine_id()))
    except BaseException:
        responder.close()
        raise
    return (responder, {r: (list(row[0]), int(row[1]), int(row[2])) for r, row in enumerate(rows)},
            {r: str(row[3]) for r, row in enumerate(rows)})


def _explainer(me: int, engine_of: list[Engine], addresses: dict[int, tuple[list[str], int, int]]
               ) -> Callable[[Sequence[int]], Callable[[str, float, BaseException | None], str | None]]:
    """``explain(ranks)(what, waited, cause)``: the error line of a cross-server wait on ``ranks`` that
    timed out (``cause`` None) or that stock Horovod failed, after asking those ranks where they are
    (:func:`.peer_status.explain_timeout`, :func:`.peer_status.explain_failure`)."""
    from .peer_status import explain_failure, explain_timeout, query_status

    pids = {r: a[2] for r, a in addresses.items()}

    def for_ranks(ranks: Sequence[int]) -> Callable[[str, float, BaseException | None], str | None]:
        def explain(what: str, waited: float, cause: BaseException | None) -> str | None:
            others = {r: addresses[r][:2] for r in ranks if r != me and r in addresses}
            statuses = query_status(others)
            if cause is not None:
                return explain_failure(what, me, statuses, pids, cause)
            my_round = int(engine_of[0].status()["round"]) if engine_of else 0
            return explain_timeout(what, me, waited, my_round, statuses)
        return explain

    return for_ranks


def _peer_check(transport: Any, cfg: Config) -> Callable[[], None]:
    """Raises, during a cross-server wait, the error a server-mate aborted with (its own, or one it
    learnt from another server), so that no rank waits out the timeout for a peer that will never come."""
    from ..runtime.transport import WaitContext

    ctx = WaitContext.start("cross-server exchange", cfg.timeout_seconds, cfg.stall_check_seconds)
    return lambda: transport.check_peers(ctx)


def _env() -> dict:
    import os

    return dict(os.environ)
