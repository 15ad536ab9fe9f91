"""The runtime's small parts: dtypes and reductions (bfloat16 without ml_dtypes), placement, futex, rendezvous."""

from __future__ import annotations

import mmap
import os
import threading
import time

import numpy as np
import pytest
from support.loopback import hand_planner
from support.ranks import run_ranks

from blink_horovod.errors import BlinkTimeoutError, ConfigError
from blink_horovod.runtime import dtypes
from blink_horovod.runtime.futex import futex_wait, futex_wake
from blink_horovod.runtime.placement import SHARED, USER, place
from blink_horovod.runtime.rendezvous import FileRendezvous
from blink_horovod.runtime.tuning import ChunkChooser, bucket_of
from blink_horovod.schedule import compile_program
from blink_horovod.topology.machines import cpu

pytestmark = pytest.mark.timeout(60)


# -- dtypes -----------------------------------------------------------------------------
def test_names_and_aliases() -> None:
    assert dtypes.canonical_dtype("half") == "float16" and dtypes.canonical_dtype("float") == "float32"
    assert dtypes.canonical_dtype("double") == "float64" and dtypes.canonical_dtype("bf16") == "bfloat16"
    with pytest.raises(ConfigError, match="dtype: unknown dtype 'quad'"):
        dtypes.canonical_dtype("quad")
    assert dtypes.check_op("AVG") == "average" and dtypes.check_op("prod") == "product"
    with pytest.raises(ConfigError, match="dtype: uint16 is not supported"):
        dtypes.dtype_name(np.uint16)


def test_bfloat16_bits_round_to_nearest_even() -> None:
    # 1 + 2^-8 lies halfway between bf16 1.0 and 1.0078125: ties go to the even one (1.0).
    x = np.array([1.0 + 2**-8, 1.0 + 3 * 2**-8, -2.5, 65504.0, np.inf, -np.inf], np.float32)
    bits = dtypes.f32_to_bf16(x)
    back = dtypes.bf16_to_f32(bits)
    np.testing.assert_array_equal(back, [1.0, 1.015625, -2.5, 65536.0, np.inf, -np.inf])
    nan = dtypes.f32_to_bf16(np.array([np.nan], np.float32))
    assert np.isnan(dtypes.bf16_to_f32(nan)).all()


@pytest.mark.skipif(not dtypes.HAVE_ML_DTYPES, reason="needs ml_dtypes to compare with")
@pytest.mark.parametrize("op", dtypes.OPS)
def test_bfloat16_storage_fallback_matches_ml_dtypes(op: str) -> None:
    import ml_dtypes

    rng = np.random.default_rng(3)
    a = rng.standard_normal(5000).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal(5000).astype(ml_dtypes.bfloat16)
    ref = a.copy()
    dtypes.reduce_into(ref, b, op, "bfloat16")  # ml_dtypes ufuncs
    bits = a.view(np.uint16).copy()
    dtypes.reduce_into(bits, b.view(np.uint16), op, "bfloat16")  # the uint16 path
    np.testing.assert_array_equal(bits, ref.view(np.uint16))
    out = np.empty(5000, np.uint16)
    dtypes.reduce_to(out, a.view(np.uint16), b.view(np.uint16), op, "bfloat16")
    np.testing.assert_array_equal(out, ref.view(np.uint16))
    avg = ref.copy()
    dtypes.finish_average(avg, 3, "bfloat16")
    avg_bits = ref.view(np.uint16).copy()
    dtypes.finish_average(avg_bits, 3, "bfloat16")
    np.testing.assert_array_equal(avg_bits, avg.view(np.uint16))


def test_integer_average_truncates_as_horovod() -> None:
    x = np.array([7, -7, 9, 0], np.int32)
    dtypes.finish_average(x, 2, "int32")
    np.testing.assert_array_equal(x, [3, -3, 4, 0])


# -- placement ----------------------------------------------------------------------------
def test_star_allreduce_stages_only_leaf_inputs_and_root_segment() -> None:
    plan = hand_planner("star")(cpu(4), "allreduce", None)
    prog = compile_program(plan, 400, 100, "allreduce")
    for r in range(4):
        pl = place(prog, r, True, True)
        seg = prog.segments[r]
        # Input staged exactly where this rank is a leaf: everything but its own segment.
        assert sum(b - a for a, b in pl.stage_in) == 300
        assert all(not (a < seg[1] and seg[0] < b) for a, b in pl.stage_in)
        assert pl.stage_out == (seg,)
        copies = [o for o in pl.ops if o[0] == 0]
        assert copies and all(o[6] == USER for o in copies)  # broadcast leaves write the user's array
        # Partial sums may stay in the user's array; the last one, which the
        # leaves then copy, must be in shared memory.
        last: dict = {}
        for o in pl.ops:
            if o[0] == 1:
                last[(o[3], o[4])] = o
        assert last and all(o[6] == SHARED for o in last.values())


def test_broadcast_chain_forwards_through_shared_and_leaf_goes_direct() -> None:
    plan = hand_planner("chain")(cpu(3), "broadcast", 0)
    prog = compile_program(plan, 50, 10, "broadcast")
    root = place(prog, 0, True, False)
    assert root.stage_in == ((0, 50),) and root.stage_out == ()
    middle = place(prog, 1, False, True)
    assert all(o[6] == SHARED for o in middle.ops if o[0] == 0) and middle.stage_out == ((0, 50),)
    leaf = place(prog, 2, False, True)
    assert all(o[6] == USER for o in leaf.ops if o[0] == 0) and leaf.stage_out == ()


# -- futex --------------------------------------------------------------------------------
def test_futex_wakes_a_sleeper_and_times_out() -> None:
    mm = mmap.mmap(-1, 4096)
    words = np.frombuffer(mm, np.uint32, 4)
    addr = words.ctypes.data
    start = time.monotonic()
    futex_wait(addr, 0, 0.05)
    assert 0.03 < time.monotonic() - start < 1.0
    futex_wait(addr, 7, 5.0)  # value differs: returns at once

    def poster() -> None:
        time.sleep(0.05)
        words[0] = 1
        futex_wake(addr)

    threading.Thread(target=poster).start()
    start = time.monotonic()
    while words[0] == 0:
        futex_wait(addr, 0, 5.0)
    assert time.monotonic() - start < 2.0


# -- rendezvous ---------------------------------------------------------------------------
def test_file_rendezvous_allgather_and_cleanup(tmp_path) -> None:
    d = str(tmp_path / "rdv")

    def rank(r: int) -> tuple:
        rdv = FileRendezvous(d, r, 3, timeout=10)
        a = rdv.allgather(r * 10)
        b = rdv.allgather({"r": r})
        job = rdv.job_id
        rdv.barrier()
        rdv.close()
        return a, b, job

    out = run_ranks(rank, 3, 20)
    assert all(o[0] == [0, 10, 20] and o[1] == [{"r": 0}, {"r": 1}, {"r": 2}] for o in out)
    assert len({o[2] for o in out}) == 1
    assert not os.path.exists(d)


def test_file_rendezvous_times_out_naming_missing_ranks(tmp_path) -> None:
    rdv = FileRendezvous(str(tmp_path), 0, 3, timeout=0.3)
    with pytest.raises(BlinkTimeoutError, match=r"waiting for rank 1; ranks not arrived: \[1, 2\]"):
        rdv.allgather("x")


def test_rendezvous_rejects_bad_ranks(tmp_path) -> None:
    with pytest.raises(ConfigError, match="rank 3 is not in 0..2"):
        FileRendezvous(str(tmp_path), 3, 3)


# -- chunk size ---------------------------------------------------------------------------
def test_chunk_size_fixed_and_buckets() -> None:
    assert ChunkChooser(65536).chunk_bytes(1 << 30, None) == 65536
    assert bucket_of(1) == 1 and bucket_of(1000) == 1024 and bucket_of(1024) == 1024


# -- 16-bit floats ----------------------------------------------------------------------------
def test_half_conversions_are_exact_for_every_bit_pattern() -> None:
    from blink_horovod.runtime.halfs import f16_to_f32, f32_to_f16

    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    values = f16_to_f32(bits)
    np.testing.assert_array_equal(values[~np.isnan(values)],
                                  bits.view(np.float16).astype(np.float32)[~np.isnan(values)])
    back = np.empty(65536, np.uint16)
    f32_to_f16(values, back)
    nan = np.isnan(values)
    np.testing.assert_array_equal(back[~nan], bits[~nan])
    assert np.isnan(back[nan].view(np.float16)).all()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_float32_to_half_rounds_like_numpy() -> None:
    from blink_horovod.runtime.halfs import f32_to_f16

    rng = np.random.default_rng(11)
    x = rng.integers(0, 2**32, 2_000_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    edges = np.array([65504, 65519.996, 65520, 65536, 2.9802322e-8, 2.98023224e-8, 5.96e-8, -0.0, 1e-45,
                      6.1035156e-05, 6.1035152e-05, np.inf, -np.inf], np.float32)
    x = np.concatenate([x, edges])
    got = np.empty(x.size, np.uint16)
    f32_to_f16(x, got)
    ok = ~np.isnan(x)
    np.testing.assert_array_equal(got[ok], x[ok].astype(np.float16).view(np.uint16))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("op", dtypes.OPS)
def test_fast_float16_reductions_are_bit_identical_to_numpy(op: str) -> None:
    rng = np.random.default_rng(12)
    a = (rng.standard_normal(100_000) * 300).astype(np.float16)
    b = (rng.standard_normal(100_000) * 3).astype(np.float16)
    fn = {"sum": np.add, "average": np.add, "min": np.minimum, "max": np.maximum, "product": np.multiply}[op]
    want = fn(a, b)
    got = a.copy()
    dtypes.reduce_into(got, b, op, "float16")
    ok = ~np.isnan(want)
    np.testing.assert_array_equal(got.view(np.uint16)[ok], want.view(np.uint16)[ok])
    s = want.copy()
    dtypes.finish_average(s, 3, "float16")
    np.testing.assert_array_equal(s.view(np.uint16)[ok], (want / np.float16(3)).view(np.uint16)[ok])


# -- topology of the server -------------------------------------------------------------------
def test_server_topology_from_blink_topology_or_cpu() -> None:
    from blink_horovod.config import load_config
    from blink_horovod.runtime.communicator import resolve_topology

    assert resolve_topology(3, load_config({})).name == "cpu3"
    assert resolve_topology(4, load_config({"BLINK_TOPOLOGY": "dgx1v:0,1,4,5"})).gpus == (0, 1, 4, 5)
    with pytest.raises(ConfigError, match=r"BLINK_TOPOLOGY: 'dgx1v' has 8 GPUs but the server runs 4 ranks"):
        resolve_topology(4, load_config({"BLINK_TOPOLOGY": "dgx1v"}))


def test_cuda_device_is_refused_clearly() -> None:
    from blink_horovod.config import load_config
    from blink_horovod.runtime.communicator import Communicator

    with pytest.raises(ConfigError, match="device: 'cuda' is not usable here"):
        Communicator(0, 1, None, None, load_config({}), device="cuda")


# -- the shared-memory transport, ranks as threads of this process ----------------------------
@pytest.mark.parametrize("use_futex", [True, False])
def test_shm_transport_collectives_in_threads(tmp_path, monkeypatch, use_futex: bool) -> None:
    from blink_horovod.config import load_config
    from blink_horovod.runtime import futex
    from blink_horovod.runtime.communicator import Communicator
    from blink_horovod.runtime.shm import linked_segments, shm_dir

    if not use_futex:
        monkeypatch.setattr(futex, "HAVE_FUTEX", False)  # the portable sleep-poll fallback
    n, job = 3, f"unit{os.getpid()}{int(use_futex)}"
    rdv_dir = str(tmp_path / "rdv")

    def rank(r: int) -> tuple:
        rdv = FileRendezvous(rdv_dir, r, n, timeout=20, job_id=job)
        comm = Communicator(r, n, None, rdv, load_config({"BLINK_CHUNK_BYTES": "16K"}), planner=hand_planner("star"))
        try:
            comm.eager_bytes = 0
            x = np.full(100_000, r + 1, np.float32)
            comm.allreduce(x)
            y = np.arange(50, dtype=np.int64) * (r + 1)
            comm.broadcast(y, 1)
            return x, y
        finally:
            comm.close()
            rdv.close()

    out = run_ranks(rank, n, 60)
    for x, y in out:
        assert (x == 6).all() and (y == np.arange(50) * 2).all()
    assert not [f for f in os.listdir(shm_dir()) if f.startswith(f"blink-{job}-")]
    assert not [p for p in linked_segments() if job in p]
