"""The fused program table (one kernel per rank): every lowered command survives encoding exactly.

No GPU needed.  The kernel itself runs in tests/parallel/test_gpu_collectives.py
on the device (BLINK_GPU_FLAGS=fused); here the table it interprets is decoded
back into the lowering's commands, which the reference interpreter already
proves correct (tests/unit/test_gpu_lowering.py), for random plans of every
collective kind with staging runs, and the source is checked to define every
(dtype, op) kernel.
"""

from __future__ import annotations

import random
import shutil
import subprocess

import pytest
from test_gpu_lowering import random_plan

from blink_horovod.errors import BlinkInternalError
from blink_horovod.runtime.dtypes import DTYPES, numpy_dtype
from blink_horovod.runtime.gpu.fused import (
    CMD_WORDS,
    block_cap,
    blocks_per_group,
    decode,
    encode,
    fused_name,
    fused_source,
    persistent_name,
)
from blink_horovod.runtime.gpu.kernels import KERNEL_OPS
from blink_horovod.runtime.gpu.lowering import (
    COPY,
    REDUCE,
    STAGE_IN,
    STAGE_OUT,
    WAIT,
    lower,
    plain_runs,
)
from blink_horovod.schedule import check_program, compile_program

pytestmark = pytest.mark.timeout(120)


def _expected(c, itemsize: int, flag_words: int) -> tuple:
    if c.kind == WAIT:
        return (c.kind, c.peer, c.word, sum(1 << (d + 4) for d in c.accept), 0)
    if c.kind in (COPY, REDUCE):
        return (c.kind, c.peer, c.offset * itemsize, c.count * itemsize, 0)
    if c.kind in (STAGE_IN, STAGE_OUT):
        return (c.kind, -1, c.offset * itemsize, c.count * itemsize, c.user_offset * itemsize)
    if c.kind == "reset":
        return (c.kind, -1, flag_words, 0, 0)
    if c.kind == "write":
        return (c.kind, -1, c.word, 0, 0)
    return (c.kind, -1, c.event, 0, 0)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("kind", ["allreduce", "broadcast", "reduce"])
def test_every_command_survives_the_table(seed: int, kind: str):
    rng = random.Random(seed)
    n = rng.choice([2, 3, 4, 5])
    plan = random_plan(rng, n, "broadcast" if kind == "broadcast" else "allreduce")
    count = rng.choice([1, 7, 1000, 4099])
    prog = compile_program(plan, count, rng.choice([1, 64, 333]), kind)
    check_program(prog, plan)
    dtype = rng.choice(DTYPES)
    itemsize = numpy_dtype(dtype).itemsize
    flags = [0x10000 * (q + 1) for q in range(n)]
    data = [0x7000000 + 0x100000 * q for q in range(n)]
    for r in range(n):
        si, so = plain_runs(prog, True, True)
        lw = lower(prog, r, si, so)
        table = encode(lw, flags, data, 4096, itemsize)
        assert list(table[2:2 + n]) == flags and list(table[2 + n:2 + 2 * n]) == data
        got = decode(table)
        want = [[_expected(c, itemsize, 4096) for c in cmds] for cmds in lw.by_stream()]
        assert got == want
        # Every group ends with code 0 and the table is exactly as long as its commands.
        assert len(table) == 2 + 2 * n + lw.nstreams + CMD_WORDS * (len(lw.cmds) + lw.nstreams)


def test_addresses_must_cover_every_rank():
    rng = random.Random(1)
    plan = random_plan(rng, 3, "allreduce")
    prog = compile_program(plan, 10, 4, "allreduce")
    lw = lower(prog, 0, *plain_runs(prog, True, True))
    with pytest.raises(BlinkInternalError, match="3 ranks"):
        encode(lw, [1, 2], [3, 4], 64, 4)


def test_blocks_per_group_keep_every_rank_resident():
    assert blocks_per_group(3, 2, 132) == 16  # capped
    assert blocks_per_group(3, 2, 132, block_cap(1 << 30)) == 44  # large programs: more blocks, still resident
    assert block_cap(4096) == 16 and block_cap(64 << 20) == 64
    assert blocks_per_group(10, 8, 132) == 3  # 240 blocks for 264 slots (two per SM)
    assert blocks_per_group(40, 8, 132) == 1
    for g in range(1, 20):
        for r in (1, 2, 4, 8):
            b = blocks_per_group(g, r, 132)
            assert b >= 1 and (b == 1 or g * r * b <= 2 * 132)


def test_source_defines_every_kernel():
    for dtype in DTYPES:
        src = fused_source(dtype)
        for op in KERNEL_OPS:
            assert src.count(f"void __launch_bounds__(THREADS) {fused_name(dtype, op)}(") == 1
            assert src.count(f"void __launch_bounds__(THREADS) {persistent_name(dtype, op)}(") == 1
        assert src.count("blink_copy_bytes(char* dst") == 1
    assert fused_name("float16", "average") == "blink_fused_sum_float16"


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "int64"])
def test_fused_modules_compile_for_sm90_without_warnings(tmp_path, dtype: str) -> None:
    # Both kernels of every op (one launch per collective, and persistent) from the source NVRTC gets.
    src = tmp_path / f"{dtype}.cu"
    src.write_text(fused_source(dtype))
    proc = subprocess.run(["nvcc", "-std=c++17", "-arch=sm_90", "-cubin", "-o", str(tmp_path / "m.cubin"), str(src)],
                          capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "warning" not in proc.stderr.lower(), proc.stderr
