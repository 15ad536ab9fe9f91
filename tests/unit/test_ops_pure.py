"""Pure parts of the Horovod integration: scaling arithmetic, layout, buckets, negotiation decisions."""

from __future__ import annotations

import numpy as np
import pytest

from blink_horovod.errors import ConfigError
from blink_horovod.ops.fusion import BucketTracker, FlatBuffer, fusion_threshold, plan_buckets
from blink_horovod.ops.layout import Layout, layout_from_env, layout_from_horovod
from blink_horovod.ops.negotiation import Meta, Proposal, decide_global, decide_server, encode_summary
from blink_horovod.ops.scaling import average_postscale, scale_into

pytestmark = pytest.mark.timeout(60)


# -- scaling: Horovod's ScaleBufferCPUImpl ---------------------------------------------------------------------

def test_float32_scales_in_float32() -> None:
    x = np.array([1.1, -2.3, 77.7], dtype=np.float32)
    out = np.empty_like(x)
    scale_into(out, x, 0.123456789)
    np.testing.assert_array_equal(out, x * np.float32(0.123456789))


def test_integers_scale_in_double_and_truncate_toward_zero() -> None:
    x = np.array([-7, -3, 3, 7, 2**31 - 1], dtype=np.int64)
    out = np.empty_like(x)
    scale_into(out, x, 0.5)
    np.testing.assert_array_equal(out, [-3, -1, 1, 3, (2**31 - 1) // 2])
    for dt in ("int8", "uint8", "int16", "int32"):
        y = np.array([5, 9], dtype=dt)
        scale_into(y, y, 1.0 / 3)
        np.testing.assert_array_equal(y, np.array([1, 3], dtype=dt))


def test_float16_scales_through_float32() -> None:
    x = np.array([1.0, 3.0, 1000.0], dtype=np.float16)
    out = np.empty_like(x)
    scale_into(out, x, 0.1)
    np.testing.assert_array_equal(out, (x.astype(np.float32) * np.float32(0.1)).astype(np.float16))


def test_average_postscale() -> None:
    assert average_postscale(2.0, 4) == 0.5


# -- layout ----------------------------------------------------------------------------------------------------------

def test_layout_servers_and_cross_sets() -> None:
    lay = Layout(rank=5, size=8, local_size=4)
    assert (lay.server, lay.local_rank, lay.num_servers) == (1, 1, 2)
    assert lay.server_ranks() == [4, 5, 6, 7]
    assert lay.cross_ranks() == [1, 5]
    assert lay.all_cross_sets() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert lay.locate(6) == (1, 2)
    assert lay.covers_whole_servers([4, 5, 6, 7]) == [1]
    assert lay.covers_whole_servers([0, 1, 4, 5]) is None


def test_layout_rejects_bad_local_size() -> None:
    with pytest.raises(ConfigError, match="BLINK_LOCAL_SIZE"):
        Layout(rank=0, size=6, local_size=4)
    with pytest.raises(ConfigError, match="BLINK_LOCAL_SIZE"):
        layout_from_env({"HOROVOD_RANK": "0", "HOROVOD_SIZE": "4", "BLINK_LOCAL_SIZE": "zero"})


def test_layout_from_launcher_variables() -> None:
    gloo = {"HOROVOD_RANK": "3", "HOROVOD_SIZE": "4", "HOROVOD_LOCAL_SIZE": "2"}
    assert layout_from_env(gloo) == Layout(3, 4, 2)
    mpi = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
           "BLINK_LOCAL_SIZE": "2"}
    assert layout_from_env(mpi) == Layout(1, 4, 2)  # BLINK_LOCAL_SIZE wins: two servers on one host
    assert layout_from_env({}) is None
    assert layout_from_horovod(0, 6, 2, False, {}) is None  # servers of different sizes: Blink stays out
    assert layout_from_horovod(0, 6, 4, False, {"BLINK_LOCAL_SIZE": "3"}) == Layout(0, 6, 3)


# -- fusion ------------------------------------------------------------------------------------------------------------

def test_plan_buckets_threshold() -> None:
    assert plan_buckets([4, 4, 4, 10, 1], 8) == [[0, 1], [2], [3], [4]]
    assert plan_buckets([1, 2, 3], 0) == [[0], [1], [2]]
    assert plan_buckets([], 8) == []


def test_bucket_tracker_launches_in_order_only() -> None:
    t = BucketTracker([[0, 1], [2], [3, 4]])
    assert t.ready(3) == [] and t.ready(2) == []   # bucket 1 complete, but bucket 0 not launched yet
    assert t.ready(0) == [] and t.ready(1) == [0, 1]
    assert t.ready(4) == [2] and t.launched_all()
    t.reset()
    assert t.ready(2) == [] and t.pending() == [0, 1, 2]


def test_fusion_threshold_env() -> None:
    assert fusion_threshold({}) == 128 * 1024 * 1024
    assert fusion_threshold({"HOROVOD_FUSION_THRESHOLD": "0"}) == 0
    with pytest.raises(ConfigError, match="HOROVOD_FUSION_THRESHOLD"):
        fusion_threshold({"HOROVOD_FUSION_THRESHOLD": "lots"})


def test_flat_buffer_round_trip_and_single_view() -> None:
    a, b = np.arange(6, dtype=np.float32).reshape(2, 3), np.arange(4, dtype=np.float32)
    buf = FlatBuffer([a, b])
    np.testing.assert_array_equal(buf.flat, np.concatenate([a.ravel(), b]))
    buf.flat *= 2
    buf.copy_out()
    np.testing.assert_array_equal(b, np.arange(4) * 2)
    single = FlatBuffer([a])
    assert np.shares_memory(single.flat, a)
    with pytest.raises(ValueError, match="mixed dtypes"):
        FlatBuffer([a, b.astype(np.float64)])


# -- negotiation ---------------------------------------------------------------------------------------------------------

def meta(shape=(4,), dtype="float32", op="sum", kind="allreduce", root=-1):
    return Meta(kind, None, (dtype,), (tuple(shape),), op=op, root=root)


def prop(rank, *named, joined=False, join_round=-1, metas=()):
    return Proposal(rank, tuple(m.entry(n) for n, m in named), joined=joined, join_round=join_round, metas=metas)


def test_ready_everywhere_in_first_ranks_order_and_fused() -> None:
    p0 = prop(0, ("a", meta((4,))), ("b", meta((5,))), ("c", meta((6,))))
    p1 = prop(1, ("c", meta((6,))), ("a", meta((4,))))  # another order, and no "b" yet
    view = decide_server([p1, p0])
    assert [e.name for e in view.ready] == ["a", "c"] and dict(view.waiting) == {"b": (1,)}
    d = decide_global(view, None, 0, 1 << 20)
    assert d.action == "run" and d.names == ["a", "c"]  # fused: same fusion class
    assert decide_global(view, None, 0, 0).names == ["a"]  # HOROVOD_FUSION_THRESHOLD=0: one at a time


def test_nothing_ready_means_wait() -> None:
    d = decide_global(decide_server([prop(0, ("a", meta())), prop(1, ("b", meta()))]), None, 0, 1 << 20)
    assert d.action == "wait"
    # Each name's missing ranks are known, also for the name the lowest rank lacks (stall warnings name them).
    assert dict(d.waiting) == {"a": (1,), "b": (0,)}


def test_mismatch_needs_a_metadata_round_then_names_ranks_and_field() -> None:
    m0, m1 = meta((17, 17)), meta((18, 18))
    first = decide_global(decide_server([prop(0, ("x", m0)), prop(1, ("x", m1))]), None, 0, 1 << 20)
    assert first.action == "mismatch" and first.names == ["x"] and first.message == ""
    second = decide_global(decide_server([prop(0, ("x", m0), metas=(("x", m0),)),
                                          prop(1, ("x", m1), metas=(("x", m1),))]), None, 0, 1 << 20)
    assert second.action == "mismatch"
    assert second.message == "allreduce 'x': shape differs: rank 0 sent [17, 17], rank 1 sent [18, 18]"


def test_mismatch_messages_name_the_field_values_and_ranks() -> None:
    from blink_horovod.ops.negotiation import Meta, format_ranks, mismatch_message

    assert mismatch_message("t", {0: meta(), 1: meta(dtype="int32"), 2: meta(), 3: meta()}) == \
        "allreduce 't': dtype differs: rank 1 sent int32, ranks 0, 2, 3 sent float32"
    assert mismatch_message("t", {0: meta(kind="broadcast", root=0), 1: meta(kind="broadcast", root=1)}) == \
        "broadcast 't': root differs: rank 0 sent 0, rank 1 sent 1"
    assert "op differs: rank 3 sent max, ranks 0, 1, 2 sent sum" in mismatch_message(
        "t", {r: meta(op="max" if r == 3 else "sum") for r in range(4)})
    assert "collective differs: rank 0 sent broadcast, ranks 1, 2 sent allreduce" in mismatch_message(
        "t", {0: meta(kind="broadcast", root=0), 1: meta(), 2: meta()})
    scaled = Meta("allreduce", None, ("float32",), ((4,),), prescale=0.5)
    assert "prescale differs: rank 0 sent 1.0, rank 1 sent 0.5" in mismatch_message("t", {0: meta(), 1: scaled})
    assert format_ranks([7, 0, 1, 2, 3, 5]) == "ranks 0-3, 5, 7"
    on_gpu = Meta("allreduce", None, ("float32",), ((4,),), device="cuda")
    assert "device differs: rank 1 sent cuda, ranks 0, 2 sent cpu" in mismatch_message(
        "t", {0: meta(), 1: on_gpu, 2: meta()})


def test_cuda_entries_cross_servers_with_their_device() -> None:
    """A CUDA collective's row keeps its device (a joined server serves it on its GPU) and never fuses with
    a CPU one."""
    from blink_horovod.ops.negotiation import Meta, _entry_from_row, _rows

    gpu = Meta("allreduce", None, ("float32",), ((4,),), device="cuda")
    view = decide_server([prop(0, ("g", gpu), ("c", meta((4,))))])
    row = _rows(encode_summary(view))[0]
    assert _entry_from_row(row, "g").device == "cuda" and _entry_from_row(row, "g").kind == "allreduce"
    assert gpu.fuse_class() != meta((4,)).fuse_class()
    assert decide_global(view, None, 0, 1 << 20).names == ["g"]


def server_round(ranks, name, metas, asked):
    """One server's view of a round in which ``ranks`` submitted ``name`` with ``metas[rank]``."""
    return decide_server([prop(r, (name, metas[r]), metas=((name, metas[r]),) if asked else ()) for r in ranks])


@pytest.mark.parametrize("odd", [0, 1, 2, 3])
@pytest.mark.parametrize("servers,local", [(2, 2), (4, 1)])
def test_a_mismatch_on_one_server_reaches_every_server_with_the_details(servers, local, odd) -> None:
    metas = {r: meta((4097,) if r == odd else (4096,)) for r in range(servers * local)}
    groups = [list(range(s * local, (s + 1) * local)) for s in range(servers)]
    others = ", ".join(str(r) for r in range(4) if r != odd)
    expected = f"allreduce 'g': shape differs: rank {odd} sent [4097], ranks {others} sent [4096]"
    for asked in (False, True):
        views = [server_round(g, "g", metas, asked) for g in groups]
        rows = np.stack([encode_summary(v) for v in views])
        decisions = [decide_global(v, rows, s, 1 << 20) for s, v in enumerate(views)]
        assert all(d.action == "mismatch" and d.names == ["g"] for d in decisions), decisions
        assert {d.message for d in decisions} == ({""} if not asked else {expected})


def test_servers_that_disagree_between_them_name_every_rank() -> None:
    metas = {r: meta(op="average" if r >= 2 else "sum") for r in range(4)}
    for asked in (False, True):
        views = [server_round([0, 1], "g", metas, asked), server_round([2, 3], "g", metas, asked)]
        rows = np.stack([encode_summary(v) for v in views])
        msgs = {decide_global(v, rows, s, 1 << 20).message for s, v in enumerate(views)}
        expected = "allreduce 'g': op differs: ranks 0, 1 sent sum, ranks 2, 3 sent average"
        assert msgs == ({""} if not asked else {expected})


def test_a_server_that_has_not_submitted_the_name_yet_is_waited_for() -> None:
    metas = {r: meta((5,) if r == 1 else (4,)) for r in range(4)}
    a = server_round([0, 1], "g", metas, True)
    b = decide_server([prop(2, ("other", meta())), prop(3, ("other", meta()))])  # "g" not submitted yet
    rows = np.stack([encode_summary(a), encode_summary(b)])
    d = decide_global(b, rows, 1, 1 << 20)
    assert d.action == "mismatch" and d.names == [] and d.message == "" and d.key != 0


def test_details_too_large_to_cross_servers_point_to_the_servers_log() -> None:
    rng = np.random.default_rng(0)
    shapes = [tuple((int(n),) for n in rng.integers(1, 1 << 30, 1000)) for _ in range(2)]  # incompressible
    big = {r: Meta("allreduce", None, ("float32",) * 1000, shapes[r == 1]) for r in range(4)}
    views = [server_round([0, 1], "g", big, True), server_round([2, 3], "g", big, True)]
    rows = np.stack([encode_summary(v) for v in views])
    d0, d1 = (decide_global(v, rows, s, 1 << 20) for s, v in enumerate(views))
    assert d0.message == d1.message and "server 0 (ranks 0, 1)" in d0.message and "log" in d0.message
    assert "shape differs" in d0.log and d1.log == ""


def test_join_rounds() -> None:
    view = decide_server([prop(0, joined=True, join_round=3), prop(1, ("a", meta()), ("b", meta()))])
    d = decide_global(view, None, 0, 1 << 20)
    assert d.action == "run" and d.names == ["a"] and d.any_joined  # single collectives while anyone has joined
    done = decide_global(decide_server([prop(0, joined=True, join_round=3), prop(1, joined=True, join_round=5)]),
                         None, 0, 1 << 20)
    assert done.action == "done_join" and done.last_joined == 1


def test_cross_server_summaries() -> None:
    a = decide_server([prop(0, ("g", meta((8,))), ("h", meta((9,)))), prop(1, ("g", meta((8,))), ("h", meta((9,))))])
    b = decide_server([prop(2, ("h", meta((9,)))), prop(3, ("h", meta((9,))))])
    d = decide_global(a, np.stack([encode_summary(a), encode_summary(b)]), 0, 1 << 20)
    assert d.action == "run" and d.names == ["h"]
    c = decide_server([prop(2, ("h", meta((7,)))), prop(3, ("h", meta((7,))))])
    bad = decide_global(a, np.stack([encode_summary(a), encode_summary(c)]), 0, 1 << 20)
    assert bad.action == "mismatch" and bad.names == ["h"] and bad.message == ""  # details next round
    # a fully joined server learns what to serve from the summary alone
    joined = decide_server([prop(2, joined=True, join_round=0), prop(3, joined=True, join_round=0)])
    d = decide_global(joined, np.stack([encode_summary(a), encode_summary(joined)]), 1, 1 << 20)
    assert d.action == "run" and d.head.numel == (("float32", 8),)


# -- Keras version check, errors bridge ---------------------------------------------------------------------------------

def test_keras3_is_refused_with_the_fix_in_the_message() -> None:
    from types import SimpleNamespace

    from blink_horovod.errors import BlinkError
    from blink_horovod.ops.keras_ops import check_legacy_keras

    check_legacy_keras(SimpleNamespace(__version__="2.21.0"))
    with pytest.raises(BlinkError, match="TF_USE_LEGACY_KERAS=1"):
        check_legacy_keras(SimpleNamespace(__version__="3.15.1"))


def test_errors_keep_their_blink_class_and_become_horovods() -> None:
    from blink_horovod.errors import BlinkTimeoutError, MismatchError
    from blink_horovod.ops.errors_bridge import as_horovod_error

    e = as_horovod_error(MismatchError("Mismatched tensor shapes"))
    assert isinstance(e, MismatchError) and isinstance(e, RuntimeError) and str(e) == "Mismatched tensor shapes"
    t = as_horovod_error(BlinkTimeoutError("late"))
    assert isinstance(t, BlinkTimeoutError) and isinstance(t, TimeoutError)
    try:
        from horovod.common.exceptions import HorovodInternalError
    except ImportError:
        return
    assert isinstance(e, HorovodInternalError) and isinstance(t, HorovodInternalError)


def test_a_stuck_round_names_what_each_rank_submitted_instead() -> None:
    from blink_horovod.ops.negotiation import stuck_message

    def p(rank, name, overdue):
        return Proposal(rank, (meta().entry(name),), overdue=overdue)

    # one server: the round that finds a rank overdue has every rank's names
    d = decide_global(decide_server([p(0, "grad.w", True), p(1, "grad.b", False), p(2, "grad.w", False)]),
                      None, 0, 1 << 20)
    assert d.action == "stuck" and stuck_message(dict(d.stuck), 10)[0].startswith(
        "allreduce 'grad.w': name differs: rank 1 sent 'grad.b', ranks 0, 2 sent 'grad.w' (no collective")
    # two servers: the first round asks the other server for its names, the next has them all
    names = {0: "grad.w", 1: "grad.b", 2: "grad.w", 3: "grad.w"}
    for asked in (False, True):
        views = [decide_server([p(r, names[r], asked or r == 0) for r in rs]) for rs in ([0, 1], [2, 3])]
        rows = np.stack([encode_summary(v) for v in views])
        ds = [decide_global(v, rows, s, 1 << 20) for s, v in enumerate(views)]
        assert all(d.action == "stuck" for d in ds)
        msgs = {stuck_message(dict(d.stuck), 10) for d in ds}
        if not asked:
            assert all(not d.stuck for d in ds)
        else:
            expected = ("allreduce 'grad.w': name differs: rank 1 sent 'grad.b', ranks 0, 2, 3 sent 'grad.w' "
                        "(no collective was submitted by every rank within 10 s, BLINK_TIMEOUT_SECONDS)")
            assert msgs == {(expected, True)}


def test_a_request_for_metadata_that_agrees_is_forgotten() -> None:
    metas = {r: meta() for r in range(4)}
    views = [server_round([0, 1], "g", metas, True), server_round([2, 3], "g", metas, True)]
    rows = np.stack([encode_summary(v) for v in views])
    assert {decide_global(v, rows, s, 1 << 20).action for s, v in enumerate(views)} == {"forget"}


def test_a_rank_past_the_timeout_ends_a_mismatch_a_server_cannot_detail() -> None:
    # server 0 disagrees on "g"; server 1 never submitted it and its rank 2 is past the timeout
    metas = {0: meta((4,)), 1: meta((5,))}
    a = server_round([0, 1], "g", metas, True)
    b = decide_server([Proposal(2, (meta().entry("h"),), overdue=True), Proposal(3, (meta().entry("h"),))])
    rows = np.stack([encode_summary(a), encode_summary(b)])
    assert {decide_global(v, rows, s, 1 << 20).action for s, v in enumerate([a, b])} == {"stuck"}
