"""The MIAD chunk-size tuner: the walk, convergence on pipeline-shaped curves, bounds, bad input."""

from __future__ import annotations

import math

import pytest

from blink_horovod.errors import ConfigError
from blink_horovod.schedule.miad import MiadTuner, tune

pytestmark = pytest.mark.timeout(30)

MB = 1 << 20


def pipeline_throughput(size: int, depth: int, gbps: float, per_chunk_us: float):
    """Throughput (GB/s) of a chunked pipeline over a tree of ``depth`` links.

    time = (chunks + depth - 1) * (chunk/B + o): pipeline fill and drain plus a fixed
    cost per chunk operation (Blink, section 4); optimum near sqrt(size*o*B/depth).
    """

    def f(chunk: int) -> float:
        chunk = min(chunk, size)
        chunks = math.ceil(size / chunk)
        t = (chunks + depth - 1) * (chunk / (gbps * 1e9) + per_chunk_us * 1e-6)
        return size / t / 1e9

    return f


def best_on_grid(f, lo: int, hi: int) -> float:
    return max(f(x) for x in range(lo, hi + 1, lo))


def test_walk_multiplies_while_rising_then_decreases_additively() -> None:
    t = MiadTuner(start_bytes=MB, factor=2)
    curve = {1: 10.0, 2: 14.0, 4: 16.0, 8: 15.0, 7: 15.5, 6: 15.4}
    while not t.converged:
        x = t.propose()
        t.observe(x, curve[x // MB])
    assert [x // MB for x, _ in t.history] == [1, 2, 4, 8, 7, 6]
    assert t.best == 4 * MB and t.propose() == 4 * MB
    # After convergence it keeps proposing the best, whatever it observes.
    t.observe(4 * MB, 1.0)
    assert t.propose() == 4 * MB and t.converged


def test_paper_example_four_iterations_from_one_megabyte() -> None:
    # Rising to 4 MB, falling at 8 MB and at 7 MB: stable after the 4th measurement's
    # decision plus one additive probe.
    curve = {1: 8.0, 2: 11.0, 4: 12.5, 8: 12.0, 7: 11.9}
    best, hist = tune(lambda x: curve[x // MB])
    assert best == 4 * MB
    assert [x // MB for x, _ in hist] == [1, 2, 4, 8, 7]
    # With the additive step as large as the last increase, the walk ends at once: 4 iterations.
    best, hist = tune(lambda x: curve[x // MB], decrease_bytes=4 * MB)
    assert best == 4 * MB and len(hist) == 4


@pytest.mark.parametrize(
    "size,depth,gbps,us",
    [
        (256 * MB, 3, 22.0, 30.0),  # DGX-1V-like 4-GPU broadcast, CUDA-op overheads
        (1024 * MB, 7, 25.0, 20.0),
        (64 * MB, 2, 12.0, 10.0),  # PCIe
        (1024 * MB, 1, 150.0, 5.0),  # one-hop trees on a switch
    ],
)
def test_converges_near_the_optimum_of_a_pipeline(size: int, depth: int, gbps: float, us: float) -> None:
    f = pipeline_throughput(size, depth, gbps, us)
    best, hist = tune(f, start_bytes=MB, max_bytes=size)
    assert len(hist) <= 16
    assert f(best) >= 0.97 * best_on_grid(f, 256 << 10, min(size, 64 * MB)), (best, hist)
    assert f(best) == max(t for _, t in hist)


def test_noise_within_tolerance_does_not_count_as_rising() -> None:
    t = MiadTuner(start_bytes=MB, tolerance=0.05)
    t.observe(MB, 10.0)
    t.observe(2 * MB, 10.3)  # +3%: flat
    assert t.phase in ("decrease", "converged")
    assert t.propose() == MB or t.converged


def test_bounds_and_alignment() -> None:
    t = MiadTuner(start_bytes=3 * MB, factor=3, max_bytes=20 * MB, align_bytes=4096)
    sizes = []
    while not t.converged and len(sizes) < 10:
        x = t.propose()
        sizes.append(x)
        t.observe(x, float(x))  # always rising: stops at the bound
    assert sizes == [3 * MB, 9 * MB, 20 * MB]
    assert t.best == 20 * MB and all(x % 4096 == 0 for x in sizes)
    t = MiadTuner(start_bytes=100, min_bytes=4096, align_bytes=512)
    assert t.propose() == 4096


def test_falling_at_once_stays_at_the_start() -> None:
    best, hist = tune(lambda x: 100.0 / x)
    assert best == MB and [x for x, _ in hist] == [MB, 2 * MB]


def test_reset_starts_over() -> None:
    t = MiadTuner()
    t.observe(MB, 1.0)
    t.observe(2 * MB, 0.5)
    t.observe(t.propose(), 0.1) if not t.converged else None
    t.reset()
    assert t.history == [] and t.phase == "increase" and t.propose() == MB


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"start_bytes": 0}, "start_bytes"),
        ({"factor": 1.0}, "factor"),
        ({"factor": float("nan")}, "factor"),
        ({"decrease_bytes": -5}, "decrease_bytes"),
        ({"min_bytes": 10, "max_bytes": 5}, "max_bytes"),
        ({"tolerance": 1.5}, "tolerance"),
        ({"align_bytes": True}, "align_bytes"),
    ],
)
def test_bad_arguments(kwargs: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        MiadTuner(**kwargs)


def test_bad_observations_and_iterations() -> None:
    t = MiadTuner()
    with pytest.raises(ConfigError, match="throughput"):
        t.observe(MB, float("nan"))
    with pytest.raises(ConfigError, match="chunk_bytes"):
        t.observe(0, 1.0)
    with pytest.raises(ConfigError, match="max_iters"):
        tune(lambda x: 1.0, max_iters=0)
    _, hist = tune(lambda x: float(x), max_iters=3)
    assert len(hist) == 3
