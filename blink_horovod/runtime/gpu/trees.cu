/* Blink's spanning-tree collectives as one kernel per collective (Blink, MLSys 2020, sections 3-4).
 *
 * Compiled by NVRTC after kernels.element_source(dtype), which defines blink_t (the storage type),
 * blink_acc_t (float32 for half types: they accumulate in float32 inside a reduction), the conversions
 * blink_to_acc / blink_from_acc, blink_acc_<op> and blink_acc_finish_average.  No include directive: NVRTC needs no
 * toolkit headers.
 *
 * Every rank of the server runs this kernel on its own buffer, the caller's tensor, in place.  The peers'
 * tensors are reached through their IPC mappings (buf[p]); nothing here knows whether a peer is on this
 * GPU or across NVLink.  The work is a list of items, each a range [lo, hi) of elements of one tree;
 * block b takes items b, b + B, b + 2B, ... in that order on every rank, so item i of every rank is done
 * by the same block index.
 *
 * Allreduce, per item, reduce phase: a leaf posts red[i]; an inner node waits for red[i] of each child
 * (one thread, acquire), then buf[me] = op(buf[me], buf[child]...) accumulated in blink_acc_t, and posts
 * red[i] (release); the root writes the final value (divided by n for average) and posts fin[i].
 * Broadcast phase: a non-root waits for fin[i] of its parent, copies buf[parent] into buf[me] and posts
 * fin[i].  A broadcast collective is the broadcast phase alone (the root posts fin[i] first).
 *
 * Flags are epoch numbers, monotonic per communicator, so they are never reset.  The kernel ends with a
 * per-block barrier: block b posts done[b] and waits for done[b] of every peer, because peer p's block b
 * is the only block that reads this rank's items of block b; once this kernel has ended no peer reads
 * the caller's tensor any more, so the caller may reuse or free it in stream order.  A rank cannot start
 * epoch e + 1 before every rank finished e, so a flag is never more than one epoch ahead of its reader.
 *
 * Every wait gives up after timeout_ns or when the host sets this rank's abort word, records the epoch
 * in the error word and lets the block run on without moving data (posting its flags, so that the peers
 * drain too): the host raises a clear error instead of hanging.
 */

#define BLINK_MAXR 16

struct BlinkItem {
    long long lo, hi;
    int tree, pad0;
    long long pad1;
};

struct BlinkTree {
    int parent, nchild;
    int child[BLINK_MAXR];
};

struct BlinkArgs {
    blink_u64 epoch;
    blink_u64 buf[BLINK_MAXR];    /* rank p's tensor, element 0, in this process's address space */
    blink_u64 flags[BLINK_MAXR];  /* rank p's flag words, likewise */
    blink_u64 items;              /* device: BlinkItem[nitems] */
    blink_u64 trees;              /* device: BlinkTree[ntrees], this rank's view */
    blink_u64 timeout_ns;
    blink_u64 ctl;                      /* mapped host memory: [0] abort (set by the host), [1] error epoch,
                                           [2] what the wait that gave up waited for (blink_wait) */
    int nitems, rank, nranks, phases;  /* phases: 1 reduce, 2 broadcast */
    int average_n, vec;                 /* vec: every buf[p] is 16-byte aligned */
    int red_word, fin_word;             /* word offsets of red[] and fin[] in a flag segment */
    int done_word;                      /* word offset of done[] (one word per block) */
};

#define BLINK_THREADS 512

__device__ __forceinline__ blink_u64 blink_ld_acquire(const blink_u64* p) {
    blink_u64 v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void blink_st_release(blink_u64* p, blink_u64 v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ blink_u64 blink_clock_ns() {
    blink_u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

/* What a wait waits for (the host names it when the wait gives up: tree_executor.py, _WAITED). */
#define BLINK_WAIT_RED 1  /* a child's reduce flag of item `index` */
#define BLINK_WAIT_FIN 2  /* the parent's broadcast flag of item `index` */
#define BLINK_WAIT_DONE 3 /* a peer's end-of-collective flag of block `index` */

/* One thread: wait until rank `peer`'s flag word (`what`, `index`) reaches a.epoch; false on timeout or
 * abort: then ctl[2] says what was waited for, in one store (blocks that give up at once overwrite each
 * other whole), and ctl[1], the error word, the epoch. */
__device__ bool blink_wait(const BlinkArgs& a, int peer, int what, int word, long long index, blink_u64 start) {
    const blink_u64* w = (const blink_u64*)(a.flags[peer]) + word;
    if (blink_ld_acquire(w) >= a.epoch) return true;
    const volatile blink_u64* ctl = (const volatile blink_u64*)a.ctl;
    unsigned spins = 0;
    while (blink_ld_acquire(w) < a.epoch) {
        if ((++spins & 255u) == 0u) {
            if (ctl[0] != 0ull || blink_clock_ns() - start > a.timeout_ns) {
                if (ctl[1] == 0ull) {  /* the first wait to give up names what it waited for */
                    ((volatile blink_u64*)ctl)[2] =
                        ((blink_u64)index << 16) | ((blink_u64)what << 8) | (blink_u64)(peer + 1);
                    ((volatile blink_u64*)ctl)[1] = a.epoch;
                }
                return false;
            }
        }
    }
    return true;
}

__device__ __forceinline__ blink_u64* blink_word(const BlinkArgs& a, int rank, int word) {
    return (blink_u64*)(a.flags[rank]) + word;
}

union BlinkVec {
    uint4 u;
    blink_u32 w[4];
    blink_t e[16 / sizeof(blink_t)];
};

/* A vector's elements as blink_acc_t, and back (rounded once, divided by n first where finish):
 * half types two at a time (BLINK_PAIRS, kernels.py), where one packing conversion rounds two sums. */
__device__ __forceinline__ void blink_unpack(const BlinkVec& v, blink_acc_t* x) {
#ifdef BLINK_PAIRS
#pragma unroll
    for (int k = 0; k < 4; ++k) blink_to_acc2(v.w[k], &x[2 * k], &x[2 * k + 1]);
#else
#pragma unroll
    for (int k = 0; k < 16 / (int)sizeof(blink_t); ++k) x[k] = blink_to_acc(v.e[k]);
#endif
}

__device__ __forceinline__ blink_acc_t blink_finished(blink_acc_t x, int finish) {
    return finish ? blink_acc_finish_average(x, finish) : x;
}

__device__ __forceinline__ void blink_pack(BlinkVec& v, const blink_acc_t* x, int finish) {
#ifdef BLINK_PAIRS
#pragma unroll
    for (int k = 0; k < 4; ++k) v.w[k] = blink_from_acc2(blink_finished(x[2 * k], finish), blink_finished(x[2 * k + 1], finish));
#else
#pragma unroll
    for (int k = 0; k < 16 / (int)sizeof(blink_t); ++k) v.e[k] = blink_from_acc(blink_finished(x[k], finish));
#endif
}

/* buf[me][lo, hi) = op over srcs (srcs[0] is buf[me]); fan-in up to BLINK_MAXR, unrolled so that the
 * source pointers stay in registers. */
template <int OP> __device__ __forceinline__ blink_acc_t blink_acc_op(blink_acc_t x, blink_acc_t y);
template <> __device__ __forceinline__ blink_acc_t blink_acc_op<0>(blink_acc_t x, blink_acc_t y) { return blink_acc_sum(x, y); }
template <> __device__ __forceinline__ blink_acc_t blink_acc_op<1>(blink_acc_t x, blink_acc_t y) { return blink_acc_min(x, y); }
template <> __device__ __forceinline__ blink_acc_t blink_acc_op<2>(blink_acc_t x, blink_acc_t y) { return blink_acc_max(x, y); }
template <> __device__ __forceinline__ blink_acc_t blink_acc_op<3>(blink_acc_t x, blink_acc_t y) { return blink_acc_product(x, y); }

/* acc = op(acc, v's elements), elementwise, in blink_acc_t. */
template <int OP>
__device__ __forceinline__ void blink_fold(blink_acc_t* acc, const BlinkVec& v) {
    const int E = 16 / sizeof(blink_t);
    blink_acc_t x[E];
    blink_unpack(v, x);
#pragma unroll
    for (int k = 0; k < E; ++k) acc[k] = blink_acc_op<OP>(acc[k], x[k]);
}

/* [lo, hi) split into a scalar head, 16-byte vectors and a scalar tail (vectors only where vec). */
__device__ __forceinline__ void blink_split(const BlinkArgs& a, long long lo, long long hi, long long* vlo,
                                            long long* vhi) {
    const int E = 16 / sizeof(blink_t);
    *vlo = *vhi = hi;
    if (a.vec) {
        long long l = (lo + E - 1) / E * E, h = hi / E * E;
        if (l < h) { *vlo = l; *vhi = h; }
    }
}

/* One element: op over the sources (src[0] is this rank), finished on the root. */
template <int OP>
__device__ __forceinline__ void blink_reduce_one(const BlinkArgs& a, const int* src, int nsrc, long long x,
                                                 int finish) {
    blink_t* dst = (blink_t*)(a.buf[a.rank]);
    blink_acc_t acc = blink_to_acc(dst[x]);
    for (int j = 1; j < nsrc; ++j) acc = blink_acc_op<OP>(acc, blink_to_acc(((const blink_t*)(a.buf[src[j]]))[x]));
    dst[x] = blink_from_acc(finish ? blink_acc_finish_average(acc, finish) : acc);
}

/* buf[me][lo, hi) = op over the sources, accumulated in blink_acc_t.  Each thread loads U vectors of
 * every source before it stores any (the destination is source 0, so loads cannot move past stores
 * by themselves): U * nsrc 16-byte loads in flight per thread. */
template <int OP>
__device__ void blink_reduce_range(const BlinkArgs& a, const int* src, int nsrc, long long lo, long long hi,
                                   int finish) {
    const int E = 16 / sizeof(blink_t);
    const int U = BLINK_UNROLL;
    long long vlo, vhi;
    blink_split(a, lo, hi, &vlo, &vhi);
    for (long long x = lo + threadIdx.x; x < vlo; x += blockDim.x) blink_reduce_one<OP>(a, src, nsrc, x, finish);
    /* source j's vectors: (const uint4*)a.buf[src[j]], looked up where used (shared memory and the
     * constant bank: an array of 16 pointers would not fit the registers) */
#define BLINK_SRC(j) ((const uint4*)(a.buf[src[j]]))
    uint4* d = (uint4*)(a.buf[a.rank]);
    const long long step = blockDim.x, end = vhi / E;
    long long v = vlo / E + threadIdx.x;
    for (; v + (U - 1) * step < end; v += U * step) {
        /* The first BLINK_FIRST_LOADS sources (kernels.py: 2, or 1 where registers are short; every inner
         * node has a child, so nsrc >= 2) are loaded before any is unpacked: an unpack uses its load at
         * once, so unpacking source 0 first would wait out one memory round trip before source 1's
         * loads were issued (half types: two round trips where float32, whose unpack is no
         * instruction, has one). */
        blink_acc_t acc[U][E];
        {
            BlinkVec s0[U], s1[U];
#pragma unroll
            for (int u = 0; u < U; ++u) s0[u].u = BLINK_SRC(0)[v + u * step];
            if (BLINK_FIRST_LOADS > 1) {
#pragma unroll
                for (int u = 0; u < U; ++u) s1[u].u = BLINK_SRC(1)[v + u * step];
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {
                blink_unpack(s0[u], acc[u]);
                if (BLINK_FIRST_LOADS > 1) blink_fold<OP>(acc[u], s1[u]);
            }
        }
#pragma unroll
        for (int j = BLINK_FIRST_LOADS; j < BLINK_MAXR; j += BLINK_BATCH) {
            if (j < nsrc) {
                /* the next BLINK_BATCH sources' loads all issued before any is used: one round trip */
                BlinkVec t[BLINK_BATCH][U];
#pragma unroll
                for (int b = 0; b < BLINK_BATCH; ++b) {
                    if (b == 0 || j + b < nsrc) {
#pragma unroll
                        for (int u = 0; u < U; ++u) t[b][u].u = BLINK_SRC(j + b)[v + u * step];
                    }
                }
#pragma unroll
                for (int b = 0; b < BLINK_BATCH; ++b) {
                    if (b == 0 || j + b < nsrc) {
#pragma unroll
                        for (int u = 0; u < U; ++u) blink_fold<OP>(acc[u], t[b][u]);
                    }
                }
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            BlinkVec out;
            blink_pack(out, acc[u], finish);
            d[v + u * step] = out.u;
        }
    }
    for (; v < end; v += step) {
        blink_acc_t acc[E];
        BlinkVec in;
        in.u = BLINK_SRC(0)[v];
        blink_unpack(in, acc);
        for (int j = 1; j < nsrc; ++j) {
            BlinkVec t;
            t.u = BLINK_SRC(j)[v];
            blink_fold<OP>(acc, t);
        }
        BlinkVec out;
        blink_pack(out, acc, finish);
        d[v] = out.u;
    }
    for (long long x = vhi + threadIdx.x; x < hi; x += blockDim.x) blink_reduce_one<OP>(a, src, nsrc, x, finish);
#undef BLINK_SRC
}

/* buf[me][lo, hi) = buf[from][lo, hi): 16-byte accesses, four in flight per thread. */
__device__ void blink_copy_range(const BlinkArgs& a, int from, long long lo, long long hi) {
    const int E = 16 / sizeof(blink_t);
    blink_t* dst = (blink_t*)(a.buf[a.rank]);
    const blink_t* src = (const blink_t*)(a.buf[from]);
    long long vlo, vhi;
    blink_split(a, lo, hi, &vlo, &vhi);
    for (long long x = lo + threadIdx.x; x < vlo; x += blockDim.x) dst[x] = src[x];
    const uint4* s = (const uint4*)src;
    uint4* d = (uint4*)dst;
    const long long step = blockDim.x, end = vhi / E;
    long long v = vlo / E + threadIdx.x;
    for (; v + 3 * step < end; v += 4 * step) {
        uint4 x0 = s[v], x1 = s[v + step], x2 = s[v + 2 * step], x3 = s[v + 3 * step];
        d[v] = x0;
        d[v + step] = x1;
        d[v + 2 * step] = x2;
        d[v + 3 * step] = x3;
    }
    for (; v < end; v += step) d[v] = s[v];
    for (long long x = vhi + threadIdx.x; x < hi; x += blockDim.x) dst[x] = src[x];
}

template <int OP>
__device__ void blink_trees_body(const BlinkArgs& a) {
    __shared__ int ok;
    __shared__ int src[BLINK_MAXR];
    const BlinkItem* items = (const BlinkItem*)a.items;
    const BlinkTree* trees = (const BlinkTree*)a.trees;
    const int B = gridDim.x, me = a.rank;
    const blink_u64 e = a.epoch;
    const blink_u64 start = blink_clock_ns();
    if (threadIdx.x == 0) ok = 1;
    __syncthreads();
    if (a.phases & 1) {
        for (int i = blockIdx.x; i < a.nitems; i += B) {
            const BlinkItem it = items[i];
            const BlinkTree& t = trees[it.tree];
            const bool root = t.parent < 0;
            if (t.nchild == 0) {  /* a leaf: its input is its partial result */
                if (threadIdx.x == 0) blink_st_release(blink_word(a, me, a.red_word + i), e);
                continue;
            }
            if (threadIdx.x == 0) {
                src[0] = me;
                for (int c = 0; c < t.nchild; ++c) {
                    src[c + 1] = t.child[c];
                    if (ok && !blink_wait(a, t.child[c], BLINK_WAIT_RED, a.red_word + i, i, start)) ok = 0;
                }
            }
            __syncthreads();
            if (ok) blink_reduce_range<OP>(a, src, t.nchild + 1, it.lo, it.hi, root ? a.average_n : 0);
            __syncthreads();
            if (threadIdx.x == 0) {
                blink_st_release(blink_word(a, me, (root ? a.fin_word : a.red_word) + i), e);
            }
        }
    }
    if (a.phases & 2) {
        for (int i = blockIdx.x; i < a.nitems; i += B) {
            const BlinkItem it = items[i];
            const BlinkTree& t = trees[it.tree];
            if (t.parent < 0) {
                if (!(a.phases & 1) && threadIdx.x == 0) blink_st_release(blink_word(a, me, a.fin_word + i), e);
                continue;
            }
            if (threadIdx.x == 0 && ok && !blink_wait(a, t.parent, BLINK_WAIT_FIN, a.fin_word + i, i, start)) ok = 0;
            __syncthreads();
            if (ok) blink_copy_range(a, t.parent, it.lo, it.hi);
            __syncthreads();
            if (threadIdx.x == 0) {
                blink_st_release(blink_word(a, me, a.fin_word + i), e);
            }
        }
    }
    /* Nobody reads this rank's tensor once every peer's block b is done with this epoch. */
    if (threadIdx.x == 0) {
        blink_st_release(blink_word(a, me, a.done_word + blockIdx.x), e);
        for (int p = 0; p < a.nranks; ++p)
            if (p != me && ok && !blink_wait(a, p, BLINK_WAIT_DONE, a.done_word + blockIdx.x, blockIdx.x, start)) ok = 0;
    }
}

#define BLINK_TREES_KERNEL(NAME, OP) \
    extern "C" __global__ void __launch_bounds__(BLINK_THREADS, 2) NAME(const __grid_constant__ BlinkArgs a) { blink_trees_body<OP>(a); }
