"""The GPU executor's host logic without a GPU: ranks as threads over the loopback transport, each with a
recording stand-in for its CUDA device, driven through ``Communicator`` as users call it.

What the kernel receives is checked: every rank's tensor as mapped in this rank (the peers' through the
IPC handles they registered), the epoch, the phases, the average's divisor, and the work tables; and
what the host guarantees: one handle per allocation, repeats replayed, a peer's moved tensor followed,
a mismatch raised on every rank, a device-side timeout reported.  The kernel itself runs on the device
(tests/parallel/test_gpu_collectives.py).
"""

from __future__ import annotations

import ctypes
import itertools
import os
import threading
import time

import numpy as np
import pytest
from support.loopback import hand_planner
from support.ranks import rank_outcomes, run_ranks

from blink_horovod.errors import BlinkInternalError, BlinkTimeoutError, MismatchError
from blink_horovod.runtime import communicator as cm
from blink_horovod.runtime.gpu.tree_executor import ARGS_DTYPE, THREADS, TreeExecutor
from blink_horovod.runtime.gpu.work import ITEM_DTYPE, TREE_DTYPE
from blink_horovod.runtime.loopback import LoopbackWorld
from blink_horovod.runtime.shm import ShmTransport
from blink_horovod.runtime.transport import WaitContext
from blink_horovod.topology import machines

pytestmark = pytest.mark.timeout(120)

SEGMENT = 1 << 24  # bytes per fake cudaMalloc block
MAPPED = 1 << 44  # where rank r maps peers' blocks: MAPPED * (r + 1) + their base


class FakeCuda:
    """Records what the executor asks of CUDA; memory is address arithmetic, launches are kept."""

    sms = 132
    device = 0

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.next = (rank + 1) << 32
        self.launches: list[tuple] = []  # (args, grid, block, stream, function) of the tree kernels
        self.tables: dict[int, np.ndarray] = {}
        self.handles_taken: list[int] = []
        self.opened: list[bytes] = []
        self.bids: dict[int, int] = {}
        self._host: list[np.ndarray] = []
        self.syncs: list[int] = []  # the executor's collective number at each host wait for the device
        self.seq_now = lambda: -1

    def malloc(self, nbytes: int) -> int:
        ptr, self.next = self.next, self.next + max(nbytes, 4096)
        return ptr

    def free(self, ptr: int) -> None:
        pass

    def memset(self, ptr: int, value: int, nbytes: int) -> None:
        pass

    def host_alloc(self, nbytes: int) -> tuple[int, np.ndarray]:
        buf = np.zeros(nbytes // 8, np.uint64)
        self._host.append(buf)
        return buf.ctypes.data, buf

    def free_host(self, ptr: int) -> None:
        pass

    def stream(self):
        cuda = self

        class Stream:
            ptr = 99

            def synchronize(self) -> None:
                cuda.syncs.append(cuda.seq_now())

        return Stream()

    def event(self) -> int:
        return 1

    def destroy_event(self, ev: int) -> None:
        pass

    def record(self, ev: int, stream: int) -> None:
        pass

    def done(self, ev: int) -> bool:
        return True

    def ipc_handle(self, ptr: int) -> bytes:
        self.handles_taken.append(ptr)
        return ptr.to_bytes(64, "little")

    def ipc_open(self, handle: bytes) -> int:
        self.opened.append(handle)
        return MAPPED * (self.rank + 1) + int.from_bytes(handle, "little")

    def ipc_close(self, ptr: int) -> None:
        pass

    def pci_bus_id(self) -> str:
        return "0000:41:00.0"  # every rank on one GPU

    def blocks_per_sm(self, fn, block: int) -> int:
        return 2

    def module(self, source: str):
        assert "BLINK_TREES_KERNEL(blink_trees_sum" in source

        class Module:
            def get_function(self, name: str) -> str:
                return name

        return Module()

    def set_device(self) -> None:
        pass

    def stream_pointer(self, stream) -> int:
        return 7

    def address_range(self, ptr: int) -> tuple[int, int]:
        base = ptr - ptr % SEGMENT
        return base, SEGMENT

    def buffer_id(self, ptr: int) -> int:
        return self.bids.get(ptr - ptr % SEGMENT, 1)

    def copy_async(self, dst: int, src: int, nbytes: int, stream: int, kind: str = "d2d") -> None:
        self.tables[dst] = np.frombuffer(ctypes.string_at(src, nbytes), np.uint8).copy()

    def launch_kernel(self, fn, grid: int, block: int, stream: int, params: int) -> None:
        args_ptr = ctypes.c_void_p.from_address(params).value
        args = np.frombuffer(ctypes.string_at(args_ptr, ARGS_DTYPE.itemsize), ARGS_DTYPE).copy()
        self.launches.append((args, grid, block, stream, fn))

    # What the native repeat (runtime/gpu/_replay.c) launches through: a function with cuLaunchKernel's
    # signature, here a recorder that keeps what launch_kernel keeps.
    _LAUNCH = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, *[ctypes.c_uint] * 7, ctypes.c_void_p,
                               ctypes.c_void_p, ctypes.c_void_p)

    _ATTRIBUTE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64)

    def attribute_address(self) -> int:
        """cuPointerGetAttribute's signature, answering the buffer id as buffer_id does."""

        def attribute(data, attr, ptr) -> int:
            assert attr == 7  # CU_POINTER_ATTRIBUTE_BUFFER_ID
            ctypes.c_uint64.from_address(data).value = self.buffer_id(ptr)
            return 0

        self._attribute = self._ATTRIBUTE(attribute)
        return ctypes.cast(self._attribute, ctypes.c_void_p).value

    _NAMES = ("blink_trees_sum", "blink_trees_min", "blink_trees_max", "blink_trees_product")

    def function_address(self, fn) -> int:
        return 0x1000 + self._NAMES.index(fn)

    def launch_address(self) -> int:
        names = self._NAMES

        def launch(function, gx, gy, gz, bx, by, bz, shared, stream, params, extra) -> int:
            self.native_launches += 1
            self.launch_kernel(names[function - 0x1000], gx, bx, stream or 0, params)
            return self.launch_error

        self.native_launches, self.launch_error = 0, 0
        self._launch = self._LAUNCH(launch)
        return ctypes.cast(self._launch, ctypes.c_void_p).value


class FakeTensor:
    """A CUDA array as CuPy shows it (``__cuda_array_interface__``), at a given address."""

    def __init__(self, ptr: int, count: int, typestr: str = "<f4") -> None:
        self.shape = (count,)
        self.__cuda_array_interface__ = {"shape": (count,), "typestr": typestr, "data": (ptr, False),
                                         "version": 3, "strides": None}


class ShmWorld:
    """Thread-ranks over shared memory segments (``ShmTransport``), where repeats go through the native
    call (``runtime/gpu/_replay.c``) as they do on the GPU machine."""

    def __init__(self, n: int) -> None:
        self.n, self.job = n, f"gputest{os.getpid()}x{next(_JOBS)}"

    def transport(self, rank: int) -> ShmTransport:
        ctx = WaitContext.start("test setup", 20.0, 10.0)
        return ShmTransport(rank, self.n, self.job, ctx, pids=[os.getpid()] * self.n, data_bytes=4096, nflags=16)


_JOBS = itertools.count()
WORLDS = {"loopback": LoopbackWorld, "shm": ShmWorld}


def make_comms(world: LoopbackWorld | ShmWorld, rank: int, n: int) -> tuple[cm.Communicator, FakeCuda]:
    t = world.transport(rank)
    cuda = FakeCuda(rank)
    comm = cm.Communicator(rank, n, machines.cpu(n), None, device="cpu", transport=t,
                           planner=hand_planner("star"))
    # The CUDA path as users reach it, with the executor on the recording device.
    comm.device = "cuda"
    comm._executor = TreeExecutor(t, 20.0, 10.0, cuda=cuda)
    if comm._executor._native is not None:
        # Thread-ranks take turns at the GIL: a native repeat waits for its peers' posts as long as they take
        # (the tests count which calls went native; the late-peer test sets a short spin).
        comm._executor._native.spin_ns = 10**10
    return comm, cuda


def tensor_at(cuda: FakeCuda, offset: int, count: int, typestr: str = "<f4") -> FakeTensor:
    return FakeTensor(((cuda.rank + 1) << 36) + offset, count, typestr)


def run(n: int, body, close=lambda comm: comm.close(), world: str = "loopback"):
    """``body(rank, comm, cuda)`` on n thread-ranks over the ``world`` transport; ``close(comm)`` after it,
    whatever happened."""
    world = WORLDS[world](n)

    def rank(r: int):
        comm, cuda = make_comms(world, r, n)
        try:
            return body(r, comm, cuda)
        finally:
            close(comm)

    return run_ranks(rank, n, timeout=60)


def test_each_rank_gets_every_tensor_through_its_mapping() -> None:
    n, count = 3, 1000

    def body(r, comm, cuda):
        x = tensor_at(cuda, 4096, count)
        comm.allreduce(x, "average", name="g")
        args, grid, block, _stream, fn = cuda.launches[-1]
        return args[0], grid, block, fn

    got = run(n, body)
    for r, (a, grid, block, fn) in enumerate(got):
        assert a["rank"] == r and a["nranks"] == n and a["epoch"] == 1
        assert a["phases"] == 3 and a["average_n"] == n and fn == "blink_trees_sum"
        assert block == THREADS and 1 <= grid <= 132 * 2 // n
        for q in range(n):
            own = ((q + 1) << 36) + 4096
            want = own if q == r else MAPPED * (r + 1) + (own - own % SEGMENT) + own % SEGMENT
            assert a["buf"][q] == want, (r, q)
        assert a["vec"] == 1  # every tensor 16-byte aligned
        assert a["nitems"] >= n  # a star per rank, each with at least one item


@pytest.mark.parametrize("world", WORLDS)
def test_tables_of_a_known_plan_are_uploaded_before_the_exchange(world: str) -> None:
    """Uploading work tables waits for the device.  With the plan already agreed on, that wait comes before
    the collective's metadata exchange, where no peer's kernel can yet be spinning for this rank's; a plan
    new to every rank is uploaded after the exchange, and every rank meets the others again before any
    launch."""
    n = 2

    def body(r, comm, cuda):
        ex = comm._executor
        cuda.seq_now = lambda: ex.seq
        x = tensor_at(cuda, 0, 1 << 16)
        start = ex.seq
        comm.allreduce(x, name="a")  # new plan: exchange (start + 1), upload, meeting (start + 2)
        first = (start, list(cuda.syncs), ex.seq)
        cuda.syncs.clear()
        comm.allreduce(x, name="a")  # replayed: no upload, no meeting
        replayed = (list(cuda.syncs), ex.seq)
        y = tensor_at(cuda, 1 << 20, 3 << 16)  # x's allocation: no new handle
        before = ex.seq
        comm.allreduce(y, name="b")  # known plan, new size: upload before the exchange, no meeting
        return first, replayed, (before, list(cuda.syncs), ex.seq), len(cuda.launches)

    for first, replayed, known, launches in run(n, body, world=world):
        start, syncs, end = first
        assert syncs == [start + 1] and end == start + 2, first
        assert replayed[0] == [] and replayed[1] == end + 1, replayed
        before, syncs, after = known
        assert syncs == [before] and after == before + 1, known
        assert launches == 3


def test_tables_match_the_plan_and_broadcast_runs_the_second_phase_only() -> None:
    n, count = 4, 1 << 16

    def body(r, comm, cuda):
        x = tensor_at(cuda, 0, count)
        comm.broadcast(x, root=2, name="b")
        a = cuda.launches[-1][0][0]
        items = cuda.tables[int(a["items"])].view(ITEM_DTYPE)[: a["nitems"]]
        trees = cuda.tables[int(a["trees"])].view(TREE_DTYPE)
        return a, items, trees

    for r, (a, items, trees) in enumerate(run(n, body)):
        assert a["phases"] == 2 and a["average_n"] == 0
        assert items["lo"][0] == 0 and items["hi"][-1] == count
        assert all(trees["parent"] == (-1 if r == 2 else 2))  # hand-made stars from the root


@pytest.mark.parametrize("world", WORLDS)
def test_a_repeat_is_replayed_and_one_handle_is_taken_per_allocation(world: str) -> None:
    n = 2

    def body(r, comm, cuda):
        x = tensor_at(cuda, 0, 256)
        y = tensor_at(cuda, 8192, 256)  # same allocation, another tensor
        for _ in range(5):
            comm.allreduce(x, name="x")
        comm.allreduce(y, name="y")
        comm.allreduce(x, name="x")  # a repeat again: native over shared memory
        last = comm._executor.last_native  # that call's phases, as the latency probe reads them
        phases = None if last is None else last.phases_ns()
        epochs = [int(lw[0][0]["epoch"]) for lw in cuda.launches]
        return (epochs, len(cuda.handles_taken), len(cuda.opened), len(comm._executor._replays),
                getattr(cuda, "native_launches", 0), phases)

    for epochs, taken, opened, replays, native, phases in run(n, body, world=world):
        assert epochs == list(range(1, 8))
        # Over shared memory, repeats launch from native code once every peer's repeat payload is known
        # (the second call's peers still sent their handles): calls 3 to 5 and 7.
        assert native == (4 if world == "shm" else 0)
        # The native call times its phases (the launch here is the recorder's Python: never 0 ns).
        assert (phases is not None and phases[3] > 0 and min(phases) >= 0) if world == "shm" else phases is None
        assert taken == 2  # the flag segment, then one tensor allocation
        assert opened == 2  # the peer's flag segment, then its allocation (once, though two tensors)
        assert replays == 2


@pytest.mark.parametrize("world", WORLDS)
def test_a_peer_whose_tensor_moved_is_followed_by_a_rank_that_replays(world: str) -> None:
    n = 2

    def body(r, comm, cuda):
        x = tensor_at(cuda, 0, 512)
        comm.allreduce(x, name="x")
        comm.allreduce(x, name="x")
        if r == 1:  # rank 1's tensor now lives in a new allocation; rank 0's did not move
            cuda.bids[((r + 1) << 36)] = 2
        comm.allreduce(x, name="x")
        return [lw[0][0]["buf"][: n].tolist() for lw in cuda.launches], len(cuda.opened), len(cuda.handles_taken)

    (bufs0, opened0, _), (bufs1, _, taken1) = run(n, body, world=world)
    assert taken1 == 3  # rank 1 registered its new allocation (flags, old, new)...
    assert opened0 == 3  # ...rank 0, replaying, opened that handle...
    assert bufs0[2][1] == MAPPED + (2 << 36)  # ...and hands the kernel its mapping
    assert bufs1[2][1] == (2 << 36)  # while rank 1 uses its own tensor as always


def test_a_mismatch_is_raised_on_every_rank_naming_the_field() -> None:
    n = 3
    world = LoopbackWorld(n)

    def rank(r: int):
        comm, cuda = make_comms(world, r, n)
        try:
            x = tensor_at(cuda, 0, 100 if r != 1 else 101)
            comm.allreduce(x, name="m")
        finally:
            comm.close()

    outcomes = rank_outcomes(rank, n, timeout=60)
    for o in outcomes:
        assert isinstance(o.error, MismatchError), o
        assert "shape" in str(o.error) and "rank 1" in str(o.error)


@pytest.mark.parametrize("world", WORLDS)
def test_a_timeout_found_by_the_kernel_is_reported_at_the_next_call(world: str) -> None:
    n = 2

    def body(r, comm, cuda):
        x = tensor_at(cuda, 0, 64)
        comm.allreduce(x, name="t")
        # what the kernel writes when a wait gives up: what it waited for (the peer's reduce flag of item 5),
        # then the epoch (1)
        comm._executor._ctl_view[2] = (5 << 16) | (1 << 8) | (1 - r) + 1
        comm._executor._ctl_view[1] = 1
        with pytest.raises(BlinkTimeoutError,
                           match=f"rank {r}'s GPU gave up waiting for rank {1 - r}'s reduce flag of item 5 in "
                                 "collective epoch 1"):
            comm.allreduce(x, name="t")
        comm._executor._ctl_view[1] = comm._executor._ctl_view[2] = 0
        return True

    def close(comm) -> None:  # a failed executor: nothing to drain
        comm._executor._closed = True
        comm._executor.t.close()

    assert run(n, body, close, world=world) == [True, True]


@pytest.mark.parametrize("world", WORLDS)
def test_a_mismatch_met_while_peers_replay_is_raised_on_every_rank(world: str) -> None:
    """Ranks 0 and 2 repeat a collective (natively over shared memory) while rank 1 calls it with another op:
    the bytes differ, the fields are checked, and every rank raises naming rank 1 and the op."""
    n = 3

    def body(r, comm, cuda):
        x = tensor_at(cuda, 0, 4096)
        for _ in range(3):
            comm.allreduce(x, name="m")
        with pytest.raises(MismatchError) as err:
            comm.allreduce(x, "max" if r == 1 else "sum", name="m")
        return str(err.value)

    def close(comm) -> None:  # failed executors: nothing to drain
        comm._executor._closed = True
        comm._executor.t.close()

    for message in run(n, body, close, world=world):
        assert "rank 1" in message and "op" in message, message


def test_a_late_peer_is_waited_for_as_every_wait_is() -> None:
    """A peer that posts long after the native call's spin: the call hands back with this rank's payload
    posted, Python's wait (sleeping, checking the peers) takes over, and the launch is the same."""
    n = 3

    def body(r, comm, cuda):
        comm._executor._native.spin_ns = 20_000_000  # 20 ms, well under rank 2's delay
        x = tensor_at(cuda, 0, 4096)
        for i in range(5):
            if r == 2 and i == 3:
                time.sleep(0.3)
            comm.allreduce(x, name="late")
        return [int(lw[0][0]["epoch"]) for lw in cuda.launches], cuda.native_launches, \
            [lw[0][0]["buf"][:n].tolist() for lw in cuda.launches]

    got = run(n, body, world="shm")
    for r, (epochs, native, bufs) in enumerate(got):
        assert epochs == [1, 2, 3, 4, 5], (r, epochs)
        # calls 3 and 5 native everywhere; call 4 too on rank 2, which came last and found every post there
        assert native == (3 if r == 2 else 2), (r, native)
        assert all(b == bufs[1] for b in bufs[1:]), (r, bufs)


def test_a_failed_native_launch_is_raised_naming_the_cuda_error() -> None:
    n = 2

    def body(r, comm, cuda):
        x = tensor_at(cuda, 0, 4096)
        for _ in range(3):
            comm.allreduce(x, name="f")
        cuda.launch_error = 700 if r == 0 else 0
        if r == 0:
            # named by its own sequence number (6: the setup, three allreduces and the meeting after the first
            # call's new mappings came before it), not by that of the call the repeat was recorded from
            with pytest.raises(BlinkInternalError,
                               match=r"allreduce 'f' \(collective 6\): cuLaunchKernel failed with CUDA error 700"):
                comm.allreduce(x, name="f")
        else:
            comm.allreduce(x, name="f")
        return cuda.native_launches

    def close(comm) -> None:
        comm._executor._closed = True
        comm._executor.t.close()

    assert run(n, body, close, world="shm") == [2, 2]  # rank 0's failed launch is counted as tried


def test_ranks_sharing_a_gpu_without_mps_are_warned(tmp_path, monkeypatch, caplog) -> None:
    from blink_horovod.runtime.gpu import tree_executor

    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    assert not tree_executor.mps_active()
    with caplog.at_level("WARNING", logger="blink_horovod.runtime"):
        run(2, lambda r, comm, cuda: None)
    assert any("without MPS" in r.message for r in caplog.records)
    (tmp_path / "control").touch()
    assert tree_executor.mps_active()


def test_a_peer_gone_while_the_gpu_works_is_named_by_synchronize() -> None:
    from blink_horovod.errors import BlinkInternalError

    n = 2
    gone = threading.Event()

    def body(r, comm, cuda):
        x = tensor_at(cuda, 0, 64)
        comm.allreduce(x, name="s")
        if r == 1:  # rank 1 leaves; rank 0's kernel would wait for it forever
            comm._executor.t.close()
            gone.set()
            return None
        gone.wait(10)
        cuda.done = lambda ev: False
        with pytest.raises(BlinkInternalError, match=r"rank 1 closed .* while rank 0 waits for it \(its GPU"):
            comm.synchronize()
        return True

    def close(comm) -> None:
        comm._executor._closed = True
        comm._executor.t.close()

    assert run(n, body, close) == [True, None]


@pytest.mark.parametrize("setting,expect", [
    # Servers of one job on one machine: a rank that says 4 ranks share its GPU (``sharers``) makes its
    # whole server take a quarter of the SMs each, so that every spinning block stays resident.
    ({"sharers": 4}, (4, lambda slots: slots // 4)),
    # ``BLINK_GPU_SM_SHARE``: the kernels of the GPU's ranks take that share of its block slots together,
    # and every rank launches the grid of the smallest share any rank asked for.
    ({"sm_share": 0.5}, (2, lambda slots: int(slots * 0.5) // 2)),
    # Compute beside the collectives (the ops layer under Horovod) on a shared GPU: half the slots unless
    # some rank set BLINK_GPU_SM_SHARE (the smallest set holds).
    ({"overlap": True}, (2, lambda slots: int(slots * 0.5) // 2)),
    ({"overlap": True, "sm_share": 0.75}, (2, lambda slots: int(slots * 0.75) // 2)),
])
def test_what_one_rank_says_of_the_gpu_shrinks_every_ranks_grid(setting: dict, expect: tuple) -> None:
    world = LoopbackWorld(2)

    def rank(r: int):
        ex = TreeExecutor(world.transport(r), 20.0, 10.0, cuda=FakeCuda(r), **(setting if r == 0 else {}))
        try:
            return ex.ranks_on_device, ex.blocks
        finally:
            ex.close()

    out = run_ranks(rank, 2, timeout=60)
    slots = 132 * FakeCuda(0).blocks_per_sm(None, 512)
    assert out == [(expect[0], expect[1](slots))] * 2


def test_a_wait_that_gave_up_is_named() -> None:
    from blink_horovod.runtime.gpu.tree_executor import _waited

    # trees.cu's blink_wait leaves index << 16 | what << 8 | peer + 1; errors name global ranks
    assert _waited((7 << 16) | (3 << 8) | 3, 8) == "rank 10's end-of-collective flag of block 7"
    assert _waited((102 << 16) | (1 << 8) | 2) == "rank 1's reduce flag of item 102"
    assert _waited((0 << 16) | (4 << 8) | 3) == "a peer's flags"  # no such wait


def test_the_overlap_share_holds_only_where_ranks_share_a_gpu() -> None:
    from blink_horovod.runtime.gpu.tree_executor import OVERLAP_SHARE, _agreed_share

    alone, shared = [{"overlap": True}, {}], [{"overlap": True}, {"share": None}]
    assert _agreed_share(alone, 1) == 1.0 and _agreed_share(shared, 2) == OVERLAP_SHARE
    assert _agreed_share([{}, {}], 2) == 1.0  # blink perf and direct users: no compute beside
    assert _agreed_share([{"share": 0.9, "overlap": True}, {"share": 1.0}], 2) == 0.9

