"""Small warm-started LPs on HiGHS: the packing LP of column generation and the pool LPs of refinement.

Column generation (:mod:`.optimum`) re-solves the packing LP
``max 1.x s.t. A x <= c, x >= 0`` after every new tree, and the refinement
(:mod:`.refine`) solves many LPs over one fixed pool of trees with changing
objectives and right-hand sides.  HiGHS (Huangfu & Hall, "Parallelizing the
dual revised simplex method", 2018) warm-starts each re-solve from the last
basis, ~0.5 ms instead of ~5 ms for a cold ``scipy.optimize.linprog`` call, so
:class:`LP` keeps one HiGHS instance per model.  It uses highspy's plain
binding class: the public ``highspy.Highs`` wrapper prints a banner on stdout
when constructed, and ``blink plan`` writes JSON there.  Without highspy it
falls back to ``scipy.optimize.linprog`` (HiGHS too), solved cold.

Models are scaled by the caller so that values are O(1): HiGHS' tolerances
are absolute.
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import linprog

from ..errors import BlinkInternalError

__all__ = ["LP", "PackingLP"]

_TOL = 1e-10

try:  # the binding without the banner-printing Python wrapper
    from highspy import _core as _highs_core

    _RawHighs = _highs_core._Highs
    _INF = float(_highs_core.kHighsInf)
except (ImportError, AttributeError):  # pragma: no cover - highspy is pinned in requirements.txt
    _highs_core = None
    _RawHighs = None
    _INF = float("inf")


class LP:
    """``max c.x  s.t.  row_lo <= A x <= row_hi,  0 <= x <= col_hi``, columns addable.

    Parameters
    ----------
    row_lo, row_hi : bounds of the rows (``-inf`` / ``inf`` for one-sided rows).
    use_highs : False forces the scipy fallback (tests).
    """

    def __init__(self, row_lo: np.ndarray, row_hi: np.ndarray, *, use_highs: bool = True) -> None:
        self.row_lo = np.asarray(row_lo, dtype=float).copy()
        self.row_hi = np.asarray(row_hi, dtype=float).copy()
        self.m = len(self.row_lo)
        self.cols: list[np.ndarray] = []
        self.cost: list[float] = []
        self.col_hi: list[float] = []
        self._h = None
        if use_highs and _RawHighs is not None:
            h = _RawHighs()
            h.setOptionValue("output_flag", False)
            h.setOptionValue("primal_feasibility_tolerance", _TOL)
            h.setOptionValue("dual_feasibility_tolerance", _TOL)
            h.changeObjectiveSense(_highs_core.ObjSense.kMaximize)
            empty_i = np.array([], dtype=np.int32)
            h.addRows(self.m, _clip(self.row_lo), _clip(self.row_hi), 0, empty_i, empty_i, np.array([], dtype=float))
            self._h = h

    @property
    def ncols(self) -> int:
        return len(self.cols)

    def add_column(self, col: np.ndarray, cost: float = 1.0, upper: float = float("inf")) -> int:
        """Add a column; returns its index."""
        col = np.asarray(col, dtype=float)
        self.cols.append(col)
        self.cost.append(float(cost))
        self.col_hi.append(float(upper))
        if self._h is not None:
            nz = np.flatnonzero(col)
            self._h.addCol(float(cost), 0.0, _clip1(upper), len(nz), nz.astype(np.int32), col[nz])
        return len(self.cols) - 1

    def set_costs(self, cost: np.ndarray) -> None:
        cost = np.asarray(cost, dtype=float)
        self.cost = list(cost)
        if self._h is not None and len(cost):
            idx = np.arange(len(cost), dtype=np.int32)
            self._h.changeColsCost(len(cost), idx, cost)

    def set_col_upper(self, col: int, upper: float) -> None:
        self.col_hi[col] = float(upper)
        if self._h is not None:
            self._h.changeColBounds(int(col), 0.0, _clip1(upper))

    def set_row_bounds(self, rows: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> None:
        rows = np.asarray(rows, dtype=np.int64)
        self.row_lo[rows] = lo
        self.row_hi[rows] = hi
        if self._h is not None and len(rows):
            self._h.changeRowsBounds(len(rows), rows.astype(np.int32), _clip(np.asarray(lo, float)), _clip(np.asarray(hi, float)))

    def solve(self) -> tuple[np.ndarray, np.ndarray, float] | None:
        """``(x, row_duals, objective)``, or None when infeasible.

        Row duals are the prices of the rows' upper bounds (>= 0 for a binding ``<=``).
        """
        if not self.cols:
            return np.zeros(0), np.zeros(self.m), 0.0
        if self._h is not None:
            self._h.run()
            status = self._h.getModelStatus()
            if status == _highs_core.HighsModelStatus.kInfeasible:
                return None
            if status != _highs_core.HighsModelStatus.kOptimal:
                raise BlinkInternalError(f"planner LP failed: HiGHS status {self._h.modelStatusToString(status)}")
            sol = self._h.getSolution()
            x = np.asarray(sol.col_value, dtype=float)
            # HiGHS' duals of a maximisation: positive on a binding upper bound.
            duals = np.asarray(sol.row_dual, dtype=float)
            return np.maximum(x, 0.0), duals, float(np.dot(self.cost, x))
        return self._solve_scipy()

    def _solve_scipy(self) -> tuple[np.ndarray, np.ndarray, float] | None:
        a = np.stack(self.cols, axis=1)
        up = np.isfinite(self.row_hi)
        lo = np.isfinite(self.row_lo)
        a_ub = np.vstack([a[up], -a[lo]])
        b_ub = np.concatenate([self.row_hi[up], -self.row_lo[lo]])
        res = linprog(
            -np.asarray(self.cost),
            A_ub=a_ub,
            b_ub=b_ub,
            bounds=[(0, None if not np.isfinite(h) else h) for h in self.col_hi],
            method="highs",
            options={"primal_feasibility_tolerance": _TOL, "dual_feasibility_tolerance": _TOL},
        )
        if res.status == 2:
            return None
        if res.status != 0:
            raise BlinkInternalError(f"planner LP failed: {res.message}")
        marg = -np.asarray(res.ineqlin.marginals, dtype=float)
        duals = np.zeros(self.m)
        duals[np.flatnonzero(up)] += marg[: up.sum()]
        duals[np.flatnonzero(lo)] -= marg[up.sum():]
        x = np.maximum(np.asarray(res.x, dtype=float), 0.0)
        return x, duals, float(np.dot(self.cost, x))


def _clip(v: np.ndarray) -> np.ndarray:
    return np.clip(np.asarray(v, dtype=float), -_INF, _INF)


def _clip1(v: float) -> float:
    return max(-_INF, min(_INF, v))


class PackingLP:
    """``max sum x  s.t.  A x <= capacity, x >= 0``: the restricted master of column generation.

    Capacities are scaled to ``max = 1`` inside; results come back in GB/s.
    """

    def __init__(self, capacity: np.ndarray, *, use_highs: bool = True) -> None:
        self.scale = float(np.max(capacity))
        b = np.asarray(capacity, dtype=float) / self.scale
        self.lp = LP(np.full(len(b), -np.inf), b, use_highs=use_highs)
        self.m = len(b)

    def add_column(self, load: np.ndarray) -> None:
        """Add one tree: ``load[r]`` bytes on resource ``r`` per byte through the tree."""
        self.lp.add_column(load, 1.0)

    def solve(self) -> tuple[np.ndarray, np.ndarray, float]:
        """Returns ``(x, duals, value)``: rates in GB/s; duals ``y`` with ``c.y = value``.

        Scaling ``c`` and ``x`` by the same factor leaves the dual feasible region
        (``A^T y >= 1``) unchanged, so the duals need no rescaling.
        """
        out = self.lp.solve()
        if out is None:  # x = 0 is always feasible
            raise BlinkInternalError("packing LP reported infeasible")
        x, y, _ = out
        x = x * self.scale
        y = np.maximum(y, 0.0)
        return x, y, float(x.sum())


def solve_milp(
    cost: np.ndarray,
    a: np.ndarray,
    row_lo: np.ndarray,
    row_hi: np.ndarray,
    col_hi: np.ndarray,
    integer: np.ndarray,
    *,
    max_nodes: int,
    time_limit_s: float,
    incumbent: np.ndarray | None = None,
) -> tuple[np.ndarray, bool] | None:
    """``min cost.x  s.t.  row_lo <= a x <= row_hi, 0 <= x <= col_hi``, ``x[integer]`` integral.

    HiGHS' branch and cut, limited to ``max_nodes`` branch-and-bound nodes
    (a deterministic effort limit: every rank planning the same topology must
    get the same plan) and, as a safety net only, ``time_limit_s``; started
    from ``incumbent`` (a feasible point) when given.  Returns ``(x,
    proven_optimal)`` or None when nothing feasible was found.  The caller
    guards the C stdout (HiGHS' MIP code can print debug lines there).
    """
    from scipy.optimize import Bounds, LinearConstraint, milp

    n = len(cost)
    if _RawHighs is None:  # pragma: no cover - highspy is pinned
        res = milp(cost, constraints=LinearConstraint(a, row_lo, row_hi), integrality=integer.astype(int),
                   bounds=Bounds(np.zeros(n), col_hi), options={"time_limit": time_limit_s, "node_limit": max_nodes, "disp": False})
        return None if res.x is None else (np.asarray(res.x), res.status == 0)
    h = _RawHighs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", float(max(time_limit_s, 0.01)))
    h.setOptionValue("mip_max_nodes", int(max_nodes))
    h.setOptionValue("mip_rel_gap", 0.0)
    h.setOptionValue("mip_feasibility_tolerance", 1e-9)
    empty_i = np.array([], dtype=np.int32)
    for j in range(n):
        h.addCol(float(cost[j]), 0.0, _clip1(float(col_hi[j])), 0, empty_i, np.array([], dtype=float))
    rows_i, cols_i = np.nonzero(a)
    order = np.argsort(rows_i, kind="stable")
    rows_i, cols_i = rows_i[order], cols_i[order]
    starts = np.searchsorted(rows_i, np.arange(a.shape[0])).astype(np.int32)
    vals = a[rows_i, cols_i].astype(float)
    h.addRows(a.shape[0], _clip(row_lo), _clip(row_hi), len(vals), starts, cols_i.astype(np.int32), vals)
    idx = np.flatnonzero(integer).astype(np.int32)
    if len(idx):
        h.changeColsIntegrality(len(idx), idx, np.full(len(idx), int(_highs_core.HighsVarType.kInteger), dtype=np.uint8))
    if incumbent is not None:
        h.setSolution(n, np.arange(n, dtype=np.int32), np.asarray(incumbent, dtype=float))
    h.run()
    info = h.getInfo()
    if int(info.primal_solution_status) != int(_highs_core.SolutionStatus.kSolutionStatusFeasible):
        return None
    x = np.asarray(h.getSolution().col_value, dtype=float)
    return x, h.getModelStatus() == _highs_core.HighsModelStatus.kOptimal
