"""Fused execution steps (runtime.steps): chains of reductions in one pass, dual writes, same results.

Programs come from the real schedule compiler on hand-made plans; the fused
executor is compared with the op-by-op one on the loopback transport, exactly.
"""

from __future__ import annotations

import numpy as np
import pytest
from support.loopback import hand_planner, run_loopback
from support.plans import expected, values

from blink_horovod.runtime import executor as executor_mod
from blink_horovod.runtime import steps as steps_mod
from blink_horovod.runtime.dtypes import DTYPES, OPS
from blink_horovod.runtime.placement import SHARED, place, subtract
from blink_horovod.runtime.steps import STEP_POST, STEP_REDUCE, fuse
from blink_horovod.schedule import compile_program
from blink_horovod.topology.machines import cpu

pytestmark = pytest.mark.timeout(120)


def test_star_root_reduces_its_chunks_in_one_step_and_writes_both_places() -> None:
    plan = hand_planner("star")(cpu(4), "allreduce", None)
    prog = compile_program(plan, 4000, 250, "allreduce")
    for r in range(4):
        pl = place(prog, r, True, True)
        st = fuse(pl)
        reduces = [s for s in st.steps if s.kind == STEP_REDUCE]
        # One step per chunk of the rank's own segment, reading all three leaves.
        assert reduces and all(len(s.peers) == 3 and s.ops == 3 for s in reduces)
        assert sum(s.stop - s.start for s in reduces) == 1000
        # The reduced chunks go to the shared buffer (the leaves read them) and to the
        # user's array in the same pass: nothing is left to copy out.
        assert all(s.dst_loc == SHARED and s.dual for s in reduces)
        assert pl.stage_out and st.stage_out == ()
        assert sum(s.ops for s in st.steps if s.kind != STEP_POST) == sum(1 for o in pl.ops if o[0] != STEP_POST)


def test_unfused_steps_are_the_placed_ops() -> None:
    plan = hand_planner("chain", 2)(cpu(4), "allreduce", None)
    prog = compile_program(plan, 999, 100, "allreduce")
    for r in range(4):
        pl = place(prog, r, True, True)
        st = fuse(pl, fuse_chains=False)
        assert [(s.kind, s.peers[:1] if s.peers else (), s.start, s.stop) for s in st.steps if s.kind != STEP_POST] \
            == [(o[0], (o[1],), o[3], o[4]) for o in pl.ops if o[0] != STEP_POST]


def test_subtract_regions() -> None:
    assert subtract(((0, 10), (20, 30)), {(0, 5), (22, 30)}) == ((5, 10), (20, 22))
    assert subtract(((0, 10),), {(0, 10)}) == ()


@pytest.mark.parametrize("shape,trees", [("star", 1), ("chain", 2)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_equals_op_by_op_for_every_dtype_and_op(monkeypatch, shape: str, trees: int, dtype: str) -> None:
    """Fusion changes how many passes over memory a chunk takes, never a result bit."""
    # Small blocks, so that a chunk spans several blocks (and a ragged last one).
    monkeypatch.setattr(steps_mod, "BLOCK_BYTES", 96)
    monkeypatch.setattr(executor_mod, "BLOCK_BYTES", 96)
    count = 3001

    def run(fused: bool) -> list:
        monkeypatch.setattr(executor_mod, "_FUSE", fused)

        def body(r, comm):
            outs = []
            for op in OPS:
                x = values(r, count, dtype, op)
                comm.allreduce(x, op)
                outs.append(x)
            b = values(r, count, dtype, "sum")
            comm.broadcast(b, 1)
            return outs + [b]

        return run_loopback(4, body, planner=hand_planner(shape, trees), env={"BLINK_CHUNK_BYTES": "1000"})

    fused, plain = run(True), run(False)
    for a, b in zip(fused, plain):
        for x, y in zip(a, b):
            assert x.tobytes() == y.tobytes()
    for op, x in zip(OPS, fused[0]):
        np.testing.assert_array_equal(x.astype(np.float64), expected(4, count, dtype, op))
