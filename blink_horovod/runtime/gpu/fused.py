"""A rank's whole program as one generated kernel: host work per collective is one 3-node graph launch.

Blink (MLSys 2020, section 4) generates CUDA code for its schedules; this is
that option of the design ("captured once as a CUDA graph, or generated as one
kernel").  A graph of the lowered commands (:mod:`.graph`) costs host time per
node at launch (measured on the H200: ~3.6 us per memory-operation node,
~0.15 us per kernel node), so its launch grows with chunks and trees.  Here
the commands of :func:`.lowering.lower` are *encoded* into a table in device
memory once per (program, buffer generation), and one kernel interprets it:

* each stream of the lowering becomes a *group* of ``B`` thread blocks that
  runs the stream's commands in order;
* ``wait``: one thread spins (volatile loads, ``__nanosleep``) on a peer's
  flag word through its IPC mapping, then the block syncs; the accept mask is
  computed from the epoch literal, exactly as :func:`.lowering.accept_mask`;
* ``write`` and ``record`` end with a group barrier (every block's data is
  fenced at system scope first), then block 0 stores the flag or the local
  event word; ``join`` spins on the local event word;
* data commands (``copy``, ``reduce``, ``stage_in``, ``stage_out``) are
  split into 16 KiB *stripes of the shared buffer*, stripe ``s`` belonging to
  block ``s % B`` of the group, whatever the command: a byte of the buffer is
  always touched by the same block of a group, so consecutive data commands of
  one stream need only ``__syncthreads``, not a group barrier;
* every global load goes through L2 (``__ldcg``): L1 is not coherent with the
  peers' writes.

Host side: the graph is the kernel alone, one variant per epoch residue
(:mod:`.lowering`); its block 0 reads the argument slot (user tensor address, metadata
fingerprint, epoch) from mapped host memory and forwards it to the other blocks in
device memory (host reads by every block serialise over PCIe), its group barriers are
sense-reversing and its event words carry the epoch, so nothing is reset
between launches, and a launch is one call whatever the number of chunks.  All groups of all ranks spin on each
other, so they must be resident together: ``B`` is chosen so that the blocks
of every rank sharing a device fit twice per SM (:func:`blocks_per_group`).
On one GPU shared by processes *without* MPS the driver time-slices contexts
and every spin costs a slice; the executor picks this mode only where ranks
have their own GPUs or MPS runs (:func:`.executor.flag_mode`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ...errors import BlinkInternalError
from .kernels import element_source, kernel_name
from .lowering import (
    COPY,
    JOIN,
    RECORD,
    REDUCE,
    RESET,
    STAGE_IN,
    STAGE_OUT,
    WAIT,
    WRITE,
    Lowered,
)

__all__ = [
    "ARGS_SLOT",
    "CMD_WORDS",
    "META_WORDS",
    "PERSISTENT_IDLE_S",
    "PERSISTENT_SLOTS",
    "STOP_BIT",
    "STRIPE",
    "THREADS",
    "DirectLaunch",
    "FusedProgram",
    "PersistentLaunch",
    "block_cap",
    "blocks_per_group",
    "decode",
    "encode",
    "fused_source",
    "persistent_name",
]

THREADS = 256  # threads per block
STRIPE = 16384  # bytes of the buffer per stripe (a multiple of 16 and of every itemsize)
CMD_WORDS = 6  # int64 words per encoded command
ARGS_SLOT = 32  # bytes of one launch's argument slot: user pointer, metadata fingerprint, epoch, spare
MIRROR_WORDS = 12  # u64 words at the start of a program's sync area: the argument slot's copy per residue (4 each)
META_WORDS = 8  # flag words at the top of a rank's flag array: META, spare, 3 fingerprint slots of 2 words
_CODE = {WAIT: 1, WRITE: 2, RESET: 3, COPY: 4, REDUCE: 5, STAGE_IN: 6, STAGE_OUT: 7, RECORD: 8, JOIN: 9}
_KIND = {v: k for k, v in _CODE.items()}
_ACCEPT_BIAS = 4  # accept offset d is bit d + 4 (d in -4..4)
STOP_BIT = 1 << 63  # in a persistent launch's bell word: exit once every epoch rung is done
PERSISTENT_SLOTS = 1024  # argument slots of a persistent kernel (epoch e reads slot e % PERSISTENT_SLOTS)
# A persistent kernel leaves after this long with nothing rung (the kernel's comment says why); the executor
# rings without a check while its last ring is younger than half of it, or the kernel still has earlier work.
PERSISTENT_IDLE_S = 0.002


def encode(lw: Lowered, flags: Sequence[int], data: Sequence[int], flag_words: int, itemsize: int) -> np.ndarray:
    """The int64 table one rank's kernel interprets.

    Layout: ``[ngroups, nranks, flags[0..n), data[0..n), start[0..ngroups), commands...]``; ``start[g]`` is
    the index of group ``g``'s first command, each command is ``CMD_WORDS`` words
    ``[code, peer, a, b, c, 0]`` and every group ends with code 0:

    ====== ============================ ==========================================
    code   fields (a, b, c)             meaning
    ====== ============================ ==========================================
    wait   word, accept bits            flags[peer][word] & mask(epoch) != 0
    write  word                         flags[rank][word] = value(epoch)
    reset  flag words                   flags[rank][1:words] = 0
    copy   byte offset, bytes           own[off:+n] = data[peer][off:+n]
    reduce byte offset, bytes           own[off:+n] = op(own, data[peer])
    stage  byte offset, bytes, user off user <-> own (stage_out finishes average)
    record event                        event word = 1 (after a group barrier)
    join   event                        wait until the event word is set
    ====== ============================ ==========================================
    """
    n = lw.nranks
    if len(flags) != n or len(data) != n:
        raise BlinkInternalError(f"fused encode: {len(flags)} flag and {len(data)} data addresses for {n} ranks")
    per = lw.by_stream()
    head = [len(per), n, *map(int, flags), *map(int, data)]
    body: list[list[int]] = []
    starts = []
    pos = len(head) + len(per)
    for cmds in per:
        starts.append(pos)
        for c in cmds:
            code = _CODE.get(c.kind)
            if code is None:  # pragma: no cover - the lowering makes only these kinds
                raise BlinkInternalError(f"fused encode: unknown command {c}")
            if c.kind == WAIT:
                bits = 0
                for d in c.accept:
                    if not -_ACCEPT_BIAS <= d <= _ACCEPT_BIAS:
                        raise BlinkInternalError(f"fused encode: accept offset {d} outside -4..4")
                    bits |= 1 << (d + _ACCEPT_BIAS)
                row = [code, c.peer, c.word, bits, 0]
            elif c.kind == WRITE:
                row = [code, -1, c.word, 0, 0]
            elif c.kind == RESET:
                row = [code, -1, flag_words, 0, 0]
            elif c.kind in (COPY, REDUCE):
                row = [code, c.peer, c.offset * itemsize, c.count * itemsize, 0]
            elif c.kind in (STAGE_IN, STAGE_OUT):
                row = [code, -1, c.offset * itemsize, c.count * itemsize, c.user_offset * itemsize]
            else:  # record, join
                row = [code, -1, c.event, 0, 0]
            body.append(row + [0])
            pos += CMD_WORDS
        body.append([0] * CMD_WORDS)
        pos += CMD_WORDS
    table = np.array(head + starts + [w for row in body for w in row], dtype=np.int64)
    if len(table) != pos:  # pragma: no cover - layout arithmetic
        raise BlinkInternalError("fused encode: table layout is inconsistent")
    return table


def decode(table: np.ndarray) -> list[list[tuple]]:
    """Per group, the commands of a table as ``(kind, peer, a, b, c)`` (tests; the kernel's view)."""
    ng, n = int(table[0]), int(table[1])
    starts = table[2 + 2 * n: 2 + 2 * n + ng]
    out = []
    for s in starts:
        cmds, i = [], int(s)
        while table[i] != 0:
            code, peer, a, b, c = (int(v) for v in table[i:i + 5])
            cmds.append((_KIND[code], peer, a, b, c))
            i += CMD_WORDS
        out.append(cmds)
    return out


# Blocks per group: few where latency rules (a group barrier's cost grows with its blocks), more where
# bandwidth does.  Measured on the H200, 2 ranks under MPS (2026-12-02):
# cap 16 -> 64 raised busbw at 1 GB from 87.6 to 139.5 GB/s (64 MB: 61 -> 75) and doubled the latency of
# 8 B .. 32 KiB (~250 -> ~450-600 us); at 4 ranks residency bounds B below 16 anyway.
SMALL_CAP, LARGE_CAP = 16, 64
LARGE_BYTES = 16 << 20  # a program over this many bytes per rank takes LARGE_CAP


def blocks_per_group(ngroups: int, ranks_on_device: int, sms: int, cap: int = SMALL_CAP) -> int:
    """Blocks per group ``B``: every rank's groups on one device resident together, two blocks per SM."""
    return max(1, min(cap, (2 * sms) // max(1, ngroups * ranks_on_device)))


def block_cap(nbytes: int) -> int:
    """The cap on blocks per group for a program over ``nbytes`` per rank (see ``LARGE_BYTES``)."""
    return LARGE_CAP if nbytes >= LARGE_BYTES else SMALL_CAP


def fused_name(dtype: str, op: str) -> str:
    """``blink_fused_sum_float32`` (``average`` reduces as ``sum``)."""
    return kernel_name("reduce", dtype, op).replace("blink_reduce_", "blink_fused_")


def persistent_name(dtype: str, op: str) -> str:
    """``blink_persist_sum_float32``: the persistent variant of :func:`fused_name`'s kernel."""
    return fused_name(dtype, op).replace("blink_fused_", "blink_persist_")


_KERNEL = r"""
__device__ __forceinline__ unsigned int blink_mask(int e, long long bits) {
    unsigned int m = 0u;
    for (int d = -4; d <= 4; ++d)
        if (bits & (1ll << (d + 4))) m |= 1u << ((((e + d) % 3) + 3) % 3);
    return m;
}
__device__ __forceinline__ void blink_copy_elems(char* dst, const char* src, long long n, int t, int nt) {
    const blink_t* s = (const blink_t*)src;
    blink_t* d = (blink_t*)dst;
    const long long m = n / (long long)sizeof(blink_t);
    for (long long i = t; i < m; i += nt) d[i] = __ldcg(s + i);
}
/* n bytes (a multiple of the element size): 16-byte vectors, 4 in flight per thread, where source and
   destination agree modulo 16; the unaligned head and tail element by element. */
__device__ __forceinline__ void blink_copy_bytes(char* dst, const char* src, long long n, int t, int nt) {
    if ((((unsigned long long)dst ^ (unsigned long long)src) & 15ull) != 0ull || n < 64) {
        blink_copy_elems(dst, src, n, t, nt);
        return;
    }
    long long head = (long long)((16ull - ((unsigned long long)dst & 15ull)) & 15ull);
    if (head > n) head = n;
    const long long m = (n - head) >> 4, tail = n - head - (m << 4);
    if (head) blink_copy_elems(dst, src, head, t, nt);
    const uint4* s = (const uint4*)(src + head);
    uint4* d = (uint4*)(dst + head);
    long long i = t;
    for (; i + 3 * nt < m; i += 4 * nt) {
        uint4 a = __ldcg(s + i), b = __ldcg(s + i + nt), c = __ldcg(s + i + 2 * nt), e = __ldcg(s + i + 3 * nt);
        d[i] = a; d[i + nt] = b; d[i + 2 * nt] = c; d[i + 3 * nt] = e;
    }
    for (; i < m; i += nt) d[i] = __ldcg(s + i);
    if (tail) blink_copy_elems(dst + head + (m << 4), src + head + (m << 4), tail, t, nt);
}
__device__ __forceinline__ unsigned long long blink_clock_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
/* One epoch of the program (``e``: its residue + 3; ``args``: its argument slot): the body of both kernels. */
__device__ __forceinline__ void BODY_NAME(
        const long long* __restrict__ T, blink_u64 args, blink_u64 sync, int e, int B, int rank, int average_n,
        blink_u64 err, int meta_word) {
    const int g = blockIdx.x / B, j = blockIdx.x % B, t = threadIdx.x, nt = blockDim.x;
    const long long ngroups = T[0], nranks = T[1];
    const long long* flags = T + 2;
    const long long* data = T + 2 + nranks;
    const long long* c = T + T[2 + 2 * nranks + g];
    /* sync: the argument mirrors (MIRROR_WORDS), one ``seen`` word per block, then the group barriers
       and event words (FusedProgram lays it out). */
    volatile blink_u64* mirror = (volatile blink_u64*)sync + 4 * (e % 3);
    volatile blink_u64* seen = (volatile blink_u64*)sync + MIRROR_WORDS + blockIdx.x;
    unsigned int* bar = (unsigned int*)((blink_u64*)sync + MIRROR_WORDS + gridDim.x) + 2 * g;  /* arrivals, generation */
    unsigned int* ev = (unsigned int*)((blink_u64*)sync + MIRROR_WORDS + gridDim.x) + 2 * ngroups;
    char* own = (char*)data[rank];
    const unsigned int value = 1u << (e % 3);
    /* The launch's argument slot lives in mapped host memory (no copy node in the graph).  Reads of it by
       many blocks serialise across PCIe (benchmarks/gpu_mapped_probe.py on the H200: 3 loads take 2.6 us
       in one block, 272 us when each of 132 blocks makes them), so block 0 alone reads it and forwards it
       in device memory: this residue's mirror, its epoch word written last.  Another block takes the
       mirror once its epoch is newer than the last epoch that block ran of this program (``seen``): epochs
       only grow, and every block runs every epoch of the program. */
    __shared__ blink_u64 s_args[3];
    if (t == 0) {
        if (blockIdx.x == 0) {
            const volatile blink_u64* a = (const volatile blink_u64*)args;
            s_args[0] = a[0]; s_args[1] = a[1]; s_args[2] = a[2];
            mirror[0] = s_args[0]; mirror[1] = s_args[1];
            __threadfence();
            mirror[2] = s_args[2];
        } else {
            const blink_u64 last = *seen;
            blink_u64 ep;
            while ((ep = mirror[2]) <= last) __nanosleep(32);
            __threadfence();
            s_args[0] = mirror[0]; s_args[1] = mirror[1]; s_args[2] = ep;
        }
        *seen = s_args[2];
    }
    __syncthreads();
    const unsigned int tag = (unsigned int)s_args[2];  /* event words hold their last epoch (epochs start at 1) */
    /* The collective's metadata, checked before any byte moves: every rank posts the fingerprint of
       its (collective, name, dtype, shape, op, root, plan) in its slot of this epoch's residue, then
       its META word; every block compares all ranks' fingerprints.  On a difference every rank sees
       it, moves nothing, records the epoch for its host (which then names the ranks and fields) and
       only posts DONE, so the next epoch's barrier still meets. */
    if (meta_word > 0) {
        const blink_u64 fp = s_args[1], epoch = s_args[2];
        const int slot = meta_word + 2 + 2 * (e % 3);
        if (blockIdx.x == 0 && t == 0) {
            *(volatile blink_u64*)(flags[rank] + 4 * slot) = fp;
            __threadfence_system();
            *(volatile unsigned int*)(flags[rank] + 4 * meta_word) = value;
            __threadfence_system();
        }
        int bad = 0;
        if (t == 0) {
            for (long long q = 0; q < nranks; ++q) {
                const volatile unsigned int* m = (const volatile unsigned int*)(flags[q] + 4 * meta_word);
                while ((*m & value) == 0u) __nanosleep(32);
                __threadfence_system();
                if (*(const volatile blink_u64*)(flags[q] + 4 * slot) != fp) bad = 1;
            }
        }
        if (__syncthreads_or(bad)) {
            if (blockIdx.x == 0 && t == 0) {
                volatile blink_u64* host = (volatile blink_u64*)err;
                if (*host == 0ull) *host = epoch;
                __threadfence_system();
                *(volatile unsigned int*)(flags[rank]) = value;  /* DONE */
                __threadfence_system();
                host[1] = epoch;  /* this epoch's work is over (the host reuses its argument slot) */
            }
            return;
        }
    }
    for (;; c += CMD_WORDS) {
        const long long k = c[0];
        if (k == 0) break;
        if (k == 1) {  /* wait */
            if (t == 0) {
                const volatile unsigned int* f = (const volatile unsigned int*)(flags[c[1]] + 4 * c[2]);
                const unsigned int m = blink_mask(e, c[3]);
                while ((*f & m) == 0u) __nanosleep(32);
                __threadfence_system();
            }
            __syncthreads();
        } else if (k == 2 || k == 8) {  /* write, record: after every block of the group is done */
            __threadfence_system();
            __syncthreads();
            if (B > 1) {
                /* Sense-reversing barrier of the group's blocks: nothing to reset between launches. */
                if (t == 0) {
                    const unsigned int gen = *(volatile unsigned int*)(bar + 1);
                    __threadfence();
                    if (atomicAdd(bar, 1u) == (unsigned int)B - 1u) {
                        *(volatile unsigned int*)bar = 0u;
                        __threadfence();
                        atomicAdd(bar + 1, 1u);
                    } else {
                        while (*(volatile unsigned int*)(bar + 1) == gen) __nanosleep(32);
                    }
                    __threadfence_system();
                }
                __syncthreads();
            }
            if (j == 0 && t == 0) {
                if (k == 2) *(volatile unsigned int*)(flags[rank] + 4 * c[2]) = value;
                else *(volatile unsigned int*)(ev + c[2]) = tag;
                __threadfence_system();
            }
        } else if (k == 9) {  /* join */
            if (t == 0) {
                while (*(volatile unsigned int*)(ev + c[2]) != tag) __nanosleep(32);
                __threadfence_system();
            }
            __syncthreads();
        } else if (k == 3) {  /* reset own program flags */
            unsigned int* f = (unsigned int*)flags[rank];
            for (long long w = 1 + (long long)j * nt + t; w < c[2]; w += (long long)B * nt) f[w] = 0u;
            __syncthreads();
        } else {  /* data, striped over the group's blocks by buffer offset */
            const long long off = c[2], n = c[3];
            char* user = (char*)s_args[0] + c[4];
            const char* peer = k <= 5 ? (const char*)data[c[1]] + off : 0;
            char* mine = own + off;
            long long s = off / STRIPE;
            s += ((j - (int)(s % B)) % B + B) % B;
            for (; s * STRIPE < off + n; s += B) {
                const long long a0 = s * STRIPE > off ? s * STRIPE - off : 0;
                const long long a1 = (s + 1) * STRIPE - off < n ? (s + 1) * STRIPE - off : n;
                if (a1 <= a0) continue;
                if (k == 4) blink_copy_bytes(mine + a0, peer + a0, a1 - a0, t, nt);
                else if (k == 6) blink_copy_bytes(mine + a0, user + a0, a1 - a0, t, nt);
                else if (k == 5) {
                    /* 16-byte vectors, two pairs in flight per thread, where own and peer agree modulo 16
                       (same offsets in page-aligned buffers: always); head and tail element-wise. */
                    char* d0 = mine + a0;
                    const char* y0 = peer + a0;
                    const long long nbytes = a1 - a0;
                    long long head = (long long)((16ull - ((unsigned long long)d0 & 15ull)) & 15ull);
                    if ((((unsigned long long)d0 ^ (unsigned long long)y0) & 15ull) != 0ull || head > nbytes) head = nbytes;
                    const long long m = (nbytes - head) >> 4;
                    const long long rest = head + (m << 4);
                    const int per = (int)(16 / sizeof(blink_t));
                    for (long long i = t; i < m; i += 2 * nt) {
                        const uint4* xs = (const uint4*)(d0 + head);
                        const uint4* ys = (const uint4*)(y0 + head);
                        uint4 xa = __ldcg(xs + i), ya = __ldcg(ys + i), xb, yb;
                        const bool two = i + nt < m;
                        if (two) { xb = __ldcg(xs + i + nt); yb = __ldcg(ys + i + nt); }
                        blink_t* px = (blink_t*)&xa;
                        const blink_t* py = (const blink_t*)&ya;
                        for (int q = 0; q < per; ++q) px[q] = BLINK_OP(px[q], py[q]);
                        ((uint4*)(d0 + head))[i] = xa;
                        if (two) {
                            px = (blink_t*)&xb; py = (const blink_t*)&yb;
                            for (int q = 0; q < per; ++q) px[q] = BLINK_OP(px[q], py[q]);
                            ((uint4*)(d0 + head))[i + nt] = xb;
                        }
                    }
                    blink_t* d = (blink_t*)d0;
                    const blink_t* y = (const blink_t*)y0;
                    const long long hm = head / (long long)sizeof(blink_t);
                    for (long long i = t; i < hm; i += nt) d[i] = BLINK_OP(__ldcg(d + i), __ldcg(y + i));
                    const long long r0 = rest / (long long)sizeof(blink_t), r1 = nbytes / (long long)sizeof(blink_t);
                    for (long long i = r0 + t; i < r1; i += nt) d[i] = BLINK_OP(__ldcg(d + i), __ldcg(y + i));
                } else if (average_n > 1) {
                    blink_t* u = (blink_t*)(user + a0);
                    const blink_t* x = (const blink_t*)(mine + a0);
                    const long long m = (a1 - a0) / (long long)sizeof(blink_t);
                    for (long long i = t; i < m; i += nt) u[i] = blink_finish_average(__ldcg(x + i), average_n);
                } else blink_copy_bytes(user + a0, mine + a0, a1 - a0, t, nt);
            }
            __syncthreads();
        }
    }
    /* Group 0 ends with DONE, after every lane joined it and its blocks' barrier: the epoch is over.
       The host polls this word instead of recording an event per launch. */
    if (meta_word > 0 && blockIdx.x == 0 && t == 0) {
        __threadfence_system();
        ((volatile blink_u64*)err)[1] = s_args[2];
    }
}
/* One launch per collective (graph or cuLaunchKernel). */
extern "C" __global__ void __launch_bounds__(THREADS) KERNEL_NAME(
        const long long* __restrict__ T, blink_u64 args, blink_u64 sync, int e, int B, int rank, int average_n,
        blink_u64 err, int meta_word) {
    BODY_NAME(T, args, sync, e, B, rank, average_n, err, meta_word);
}
/* Persistent (BLINK_GPU_LAUNCH=persistent): one launch runs every epoch from ``first`` on, each when the host
   rings ``bell`` (a word of mapped host memory: the newest epoch rung; bit 63: stop once it is done), so a
   collective costs the host a store, no CUDA call.  Only block 0 reads the host word; it forwards it to
   ``dev`` (device memory: [0] newest epoch rung, [1] the ``first`` of the launch told to exit), where the
   other blocks poll without crossing PCIe, and acknowledges it in err[3].  ``args`` is slot 0 (epoch x uses
   slot x % ARGS_SLOTS: the host may ring that many ahead).  The kernel also leaves by itself after ``idle_ns`` with nothing rung: a spinning kernel must
   not stay resident while its process is idle, since loading a module or freeing memory may wait for every
   kernel of the context (CUDA's lazy loading does), and the host, blocked there, would never ring it.  On
   exit block 0 posts ``first`` in err[2]: the host then knows an epoch rung too late was not taken (err[3]
   says which were) and that this launch's bell word is free. */
extern "C" __global__ void __launch_bounds__(THREADS) PERSIST_NAME(
        const long long* __restrict__ T, blink_u64 args, blink_u64 sync, int B, int rank, int average_n,
        blink_u64 err, int meta_word, blink_u64 idle_ns, blink_u64 bell, blink_u64 dev, long long first) {
    volatile long long* d = (volatile long long*)dev;
    __shared__ int s_go;
    long long last = first - 1;
    for (;;) {
        if (threadIdx.x == 0) {
            unsigned int ns = 32u;
            unsigned long long idle0 = 0ull;
            for (;;) {
                if (blockIdx.x == 0) {
                    const unsigned long long b = *(volatile unsigned long long*)bell;
                    const long long target = (long long)(b & 0x7fffffffffffffffull);
                    if (target > d[0]) {
                        d[0] = target;
                        __threadfence();
                        ((volatile blink_u64*)err)[3] = (blink_u64)target;
                        __threadfence_system();
                    }
                    bool leave = (b >> 63) != 0ull && target <= last;
                    if (!leave && target <= last) {
                        const unsigned long long now = blink_clock_ns();
                        if (idle0 == 0ull) idle0 = now;
                        else if (now - idle0 > idle_ns) leave = true;
                    }
                    if (leave) {
                        d[1] = first;
                        __threadfence();
                        ((volatile blink_u64*)err)[2] = (blink_u64)first;
                        __threadfence_system();
                        s_go = 0;
                        break;
                    }
                }
                /* exit word first: an epoch rung before the exit (fenced before it) is still run */
                const long long x = d[1];
                __threadfence();
                if (d[0] > last) { s_go = 1; break; }
                if (x == first) { s_go = 0; break; }
                __nanosleep(ns);
                if (ns < 1024u) ns <<= 1;
            }
        }
        __syncthreads();
        if (!s_go) return;
        ++last;
        BODY_NAME(T, args + (blink_u64)(ARGS_SLOT * (last % ARGS_SLOTS)), sync, (int)(last % 3) + 3, B, rank, average_n,
                  err, meta_word);
        __syncthreads();
    }
}
"""


def fused_source(dtype: str) -> str:
    """One CUDA module for ``dtype``: the program interpreter kernel per op (sum, min, max, product)."""
    from .kernels import KERNEL_OPS

    defines = {"THREADS": THREADS, "STRIPE": f"{STRIPE}ll", "CMD_WORDS": CMD_WORDS, "ARGS_SLOT": f"{ARGS_SLOT}ll",
               "ARGS_SLOTS": f"{PERSISTENT_SLOTS}ll", "MIRROR_WORDS": MIRROR_WORDS}
    src = [element_source(dtype), "".join(f"#define {k} {v}\n" for k, v in defines.items())]
    cut = _KERNEL.index("/* One epoch of the program")
    helpers, kernel = _KERNEL[:cut], _KERNEL[cut:]
    src.append(helpers)
    for op in KERNEL_OPS:
        name = fused_name(dtype, op)
        src.append(kernel.replace("KERNEL_NAME", name).replace("PERSIST_NAME", persistent_name(dtype, op))
                   .replace("BODY_NAME", name.replace("blink_fused_", "blink_epoch_"))
                   .replace("BLINK_OP", f"blink_op_{op}"))
    return "\n".join(src)


class FusedProgram:
    """One rank's encoded program in device memory, plus its barrier/event words (freed by :meth:`free`)."""

    def __init__(self, cuda: Any, lw: Lowered, flags: Sequence[int], data: Sequence[int], flag_words: int,
                 itemsize: int, blocks: int, stream: Any) -> None:
        self.cuda = cuda
        self.lw = lw
        table = encode(lw, flags, data, flag_words, itemsize)
        self.ngroups = lw.nstreams
        self.blocks = blocks
        # sync: the argument mirrors and a word per block (see the kernel), barrier and event words, then
        # (8-aligned) the two words a persistent launch's blocks poll
        words = 2 * self.ngroups + max(1, lw.nevents)
        self.sync_bytes = 8 * (MIRROR_WORDS + self.ngroups * blocks) + 4 * (words + words % 2) + 16
        nbytes = 8 * len(table)
        self.ptr = cuda.malloc(nbytes + self.sync_bytes)
        self.sync = self.ptr + nbytes
        self.dev_bell = self.sync + self.sync_bytes - 16
        self._persistent: dict[tuple[str, str], PersistentLaunch] = {}
        # On a private non-blocking stream: a copy on the legacy default stream would wait for this
        # context's running programs, which (virtual ranks in one process) may wait for this rank.
        cuda.copy_async(self.ptr, table.ctypes.data, nbytes, stream.ptr, kind="h2d")
        cuda.memset_async(self.sync, 0, self.sync_bytes, stream.ptr)  # once: barriers and events need no reset
        stream.synchronize()

    def capture(self, residue: int, args_host: int, args_device: int, dtype: str, op: str, module: Any,
                origin: Any, err: int = 0, meta_word: int = 0) -> int:
        """Graph for epochs ``= residue (mod 3)``: the kernel alone (it reads the argument slot in mapped host
        memory, ``args_host``; ``args_device`` is unused); returns the exec."""
        from .graph import abandon_capture, instantiate_capture
        from .lowering import RESIDUES

        if not 0 <= residue < RESIDUES:
            raise BlinkInternalError(f"fused capture: residue {residue}")
        c = self.cuda
        fn = module.get_function(fused_name(dtype, op))
        average_n = self.lw.nranks if op == "average" else 0
        sp = origin.ptr
        c.begin_capture(sp)
        try:
            with origin:
                fn((self.ngroups * self.blocks,), (THREADS,),
                   (np.uint64(self.ptr), np.uint64(args_host), np.uint64(self.sync), np.int32(residue + 3),
                    np.int32(self.blocks), np.int32(self.lw.rank), np.int32(average_n), np.uint64(err),
                    np.int32(meta_word)))
        except BaseException:
            abandon_capture(c, sp)
            raise
        return instantiate_capture(c, sp)

    def direct(self, residue: int, args_host: int, dtype: str, op: str, module: Any, err: int = 0,
               meta_word: int = 0) -> DirectLaunch:
        """The same launch as :meth:`capture`'s graph, made by ``cuLaunchKernel`` itself: one driver call
        with a prebuilt parameter array, no graph (a one-node graph's launch costs more host time)."""
        from .lowering import RESIDUES

        if not 0 <= residue < RESIDUES:
            raise BlinkInternalError(f"fused launch: residue {residue}")
        fn = module.get_function(fused_name(dtype, op))
        average_n = self.lw.nranks if op == "average" else 0
        return DirectLaunch(fn, self.ngroups * self.blocks, THREADS,
                            ("u64", self.ptr), ("u64", args_host), ("u64", self.sync), ("i32", residue + 3),
                            ("i32", self.blocks), ("i32", self.lw.rank), ("i32", average_n), ("u64", err),
                            ("i32", meta_word))

    def persistent(self, args_host: int, dtype: str, op: str, module: Any, err: int, meta_word: int) -> PersistentLaunch:
        """The persistent kernel of this program for (dtype, op) (``args_host``: argument slot 0)."""
        hit = self._persistent.get((dtype, op))
        if hit is None:
            fn = module.get_function(persistent_name(dtype, op))
            average_n = self.lw.nranks if op == "average" else 0
            hit = self._persistent[(dtype, op)] = PersistentLaunch(
                fn, self.ngroups * self.blocks, THREADS,
                ("u64", self.ptr), ("u64", args_host), ("u64", self.sync), ("i32", self.blocks),
                ("i32", self.lw.rank), ("i32", average_n), ("u64", err), ("i32", meta_word),
                ("u64", int(PERSISTENT_IDLE_S * 1e9)), ("u64", 0), ("u64", self.dev_bell), ("i64", 0))
        return hit

    def free(self) -> None:
        if self.ptr:
            self.cuda.free(self.ptr)
            self.ptr = 0


class DirectLaunch:
    """A kernel launch ready to go: function, grid and the ``void*[]`` of its parameters built once, so
    :meth:`go` is a single ``cuLaunchKernel`` (through CuPy's thin driver binding)."""

    def __init__(self, fn: Any, grid: int, block: int, *params: tuple[str, int]) -> None:
        import ctypes

        from cupy.cuda import driver

        self._launch = driver.launchKernel
        self._fn = fn  # keeps the module's function alive
        # module.get_function gives a RawKernel; its .kernel is the loaded CUfunction wrapper
        self._fptr = int(getattr(fn, "kernel", fn).ptr)
        self.grid, self.block = int(grid), int(block)
        kinds = {"u64": ctypes.c_uint64, "i32": ctypes.c_int32, "i64": ctypes.c_int64}
        self._values = [kinds[k](v) for k, v in params]
        self._array = (ctypes.c_void_p * len(self._values))(*[ctypes.addressof(v) for v in self._values])
        self._params = ctypes.addressof(self._array)

    def go(self, stream: int) -> None:
        self._launch(self._fptr, self.grid, 1, 1, self.block, 1, 1, 0, stream, self._params, 0)


class PersistentLaunch(DirectLaunch):
    """A persistent fused kernel (:data:`_KERNEL`'s ``PERSIST_NAME``): :meth:`start` launches it once for a run
    of collectives of one program; each collective is then rung by the host with a store to the bell word
    (``GpuExecutor`` keeps the words), not by a CUDA call.  Its last two parameters, the bell word and the
    first epoch, are set per start."""

    def start(self, stream: int, bell: int, first: int) -> None:
        self._values[-3].value = bell
        self._values[-1].value = first
        self.go(stream)
