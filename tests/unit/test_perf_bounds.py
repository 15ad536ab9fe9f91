"""The yardsticks ``blink perf --device cuda`` prints beside each row (cli/perf_cmd.py)."""

from __future__ import annotations

import pytest

from blink_horovod.cli.perf_cmd import hbm_bound_busbw, optimum_busbw

pytestmark = pytest.mark.timeout(30)


def test_hbm_bound_matches_the_machine_figures() -> None:
    # One H200, copy rate 4229 GB/s (read + write), 1 GB per rank: 1057 / 793 / 463 GB/s busbw at 2 / 4 / 8.
    for n, want in ((2, 1057), (4, 793), (8, 463)):
        assert hbm_bound_busbw(4229e9, 1 << 30, "allreduce", n) == pytest.approx(want, rel=0.01)
    # A broadcast needs half the traffic and has busbw factor 1.
    assert hbm_bound_busbw(4000e9, 1 << 30, "broadcast", 4) == pytest.approx(1000.0)


def test_optimum_busbw_is_the_plans_rate_with_nccl_tests_factor() -> None:
    assert optimum_busbw(257.142857, "allreduce", 8) == pytest.approx(450.0, rel=1e-6)
    assert optimum_busbw(100.0, "broadcast", 8) == 100.0
