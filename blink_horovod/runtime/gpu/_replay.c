/* The host path of a repeated GPU collective in one native call: post, meet, compare, launch.
 *
 * Why: a training step repeats the same collectives (its gradient buckets), and each repeat's host
 * work is the metadata exchange with the server's peers and one kernel launch.  Done from Python it
 * cost 20-60 us a call on the GPU machine (the exchange's interpreted loads and stores, the launch's
 * wrapper), and since every rank waits for the others' posts, the slowest rank's Python set the pace
 * of all.  Here the same protocol runs without the interpreter (and without the GIL: ctypes releases
 * it for the call):
 *
 *   0. check: the tensor's allocation is still the one the launch was prepared for (the driver's
 *      buffer id of its address; a new allocation at the same address goes back to Python unposted);
 *   1. post: this rank's payload into its metadata slot (seq & 1), then the slot's length word,
 *      then the sequence word, and a futex wake for any peer that sleeps on either word -- the same
 *      bytes and words, in the same order, as Transport.exchange_meta writes from Python;
 *   2. meet: spin until every peer's sequence word reaches seq, for at most spin_ns;
 *   3. compare: every peer's posted bytes against what the prepared launch assumed;
 *   4. launch: the epoch into the kernel's parameter block, then cuLaunchKernel (a pointer to the
 *      driver's function, passed in by the caller) of the tree kernel.
 *
 * Anything else goes back to Python with the payload posted: peers not all there within the spin
 * (Python then waits as every wait does: sleeping on futexes, naming dead, aborted or late peers),
 * or a peer's bytes other than expected (Python then checks them field by field: a mismatch raises,
 * a peer's moved tensor is followed).  So the protocol, its errors and its timeouts stay those of
 * runtime/transport.py and runtime/gpu/tree_executor.py; this file only makes the common case fast.
 *
 * Built by blink_horovod/cbuild.py; loaded with ctypes by runtime/gpu/native_replay.py.
 */
#include <limits.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <sched.h>
#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

/* runtime/transport.py's control words (uint32 indices) */
#define W_META_SEQ 4
#define W_META_LEN 5
#define W_SLEEP 13
#define BLINK_MAX_RANKS 16 /* runtime/gpu/work.py MAX_RANKS */

/* One rank's view of the server's control segments: every rank's words and metadata slot 0 (slot 1
 * follows at meta_bytes), as mapped in this process.  Laid out as native_replay.Peers. */
typedef struct {
    int32_t rank, nranks;
    uint64_t meta_bytes;
    uint32_t *words[BLINK_MAX_RANKS];
    uint8_t *meta[BLINK_MAX_RANKS];
} blink_peers;

/* CUresult cuLaunchKernel(CUfunction, grid xyz, block xyz, shared bytes, CUstream, void **params, void **extra) */
typedef int (*blink_launch_fn)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                               void *, void **, void **);
/* CUresult cuPointerGetAttribute(void *data, CUpointer_attribute, CUdeviceptr) */
typedef int (*blink_attribute_fn)(void *, int, uint64_t);
#define BLINK_BUFFER_ID 7 /* CU_POINTER_ATTRIBUTE_BUFFER_ID */

enum { LAUNCHED = 0, NOT_MET = 1, DIFFERENT = 2, LAUNCH_FAILED = 3, MOVED = 4 };

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void wake(uint32_t *word) {
#if defined(__linux__) && defined(SYS_futex)
    syscall(SYS_futex, word, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
#else
    (void)word;
#endif
}

/* Post this rank's payload of collective seq (transport.py: write_region, store(W_META_LEN + slot),
 * store(W_META_SEQ)); wake a peer that says it sleeps on one of the two words. */
static void blink_post(const blink_peers *p, uint32_t seq, const uint8_t *payload, uint32_t len) {
    uint32_t slot = seq & 1u, *own = p->words[p->rank];
    memcpy(p->meta[p->rank] + (uint64_t)slot * p->meta_bytes, payload, len);
    __atomic_store_n(&own[W_META_LEN + slot], len, __ATOMIC_RELEASE);
    __atomic_store_n(&own[W_META_SEQ], seq, __ATOMIC_RELEASE);
    /* Between the stores and the loads of the peers' sleep words: a sleeper stores its word, then
     * loads ours (Dekker); without the fence both could miss each other. */
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    uint32_t t_len = ((uint32_t)(p->rank + 1) << 24) | (W_META_LEN + slot);
    uint32_t t_seq = ((uint32_t)(p->rank + 1) << 24) | W_META_SEQ;
    int woke_len = 0, woke_seq = 0;
    for (int r = 0; r < p->nranks; r++) {
        if (r == p->rank) continue;
        uint32_t token = __atomic_load_n(&p->words[r][W_SLEEP], __ATOMIC_ACQUIRE);
        if (token == t_len && !woke_len) { wake(&own[W_META_LEN + slot]); woke_len = 1; }
        if (token == t_seq && !woke_seq) { wake(&own[W_META_SEQ]); woke_seq = 1; }
    }
}

/* Whether every peer has posted collective seq, waiting up to spin_ns (yielding the CPU every
 * yield_every loads where ranks may outnumber cores; 0: never). */
static int blink_met(const blink_peers *p, uint32_t seq, uint64_t spin_ns, uint32_t yield_every) {
    uint64_t end = now_ns() + spin_ns;
    for (uint32_t i = 1;; i++) {
        int all = 1;
        for (int r = 0; r < p->nranks && all; r++)
            if (r != p->rank && __atomic_load_n(&p->words[r][W_META_SEQ], __ATOMIC_ACQUIRE) < seq) all = 0;
        if (all) return 1;
        if ((i & 63u) == 0 && now_ns() >= end) return 0;
        if (yield_every && i % yield_every == 0) sched_yield();
    }
}

/* Whether every peer's posted payload of collective seq equals the expected one (expected bytes of
 * rank r at expected + offsets[r], lens[r] long; this rank's own entry is not compared). */
static int blink_same(const blink_peers *p, uint32_t seq, const uint8_t *expected, const uint32_t *offsets,
               const uint32_t *lens) {
    uint32_t slot = seq & 1u;
    for (int r = 0; r < p->nranks; r++) {
        if (r == p->rank) continue;
        uint32_t len = __atomic_load_n(&p->words[r][W_META_LEN + slot], __ATOMIC_ACQUIRE);
        if (len != lens[r] || memcmp(p->meta[r] + (uint64_t)slot * p->meta_bytes, expected + offsets[r], len) != 0)
            return 0;
    }
    return 1;
}

/* Everything a prepared repeat needs but its sequence number, stream and epoch (native_replay.Call). */
typedef struct {
    const blink_peers *peers;
    const uint8_t *payload;   /* this rank's payload */
    const uint8_t *expected;  /* every rank's payload as the prepared launch assumed: rank r's at offsets[r] */
    const uint32_t *offsets, *lens;
    blink_launch_fn launch;
    blink_attribute_fn attribute; /* the allocation check */
    uint64_t ptr, bid;        /* the tensor's address and its allocation's buffer id */
    void *function;           /* CUfunction */
    void **params;            /* the kernel's void *[1] */
    uint64_t *epoch_slot;     /* the parameter block's epoch */
    uint64_t spin_ns;
    uint32_t len, yield_every, grid, block;
    int32_t cuda_error, pad;
    /* The last call's phases in ns (its profile, read by benchmarks/gpu_latency_probe.py): the allocation
     * check, the post, the wait for the peers' posts and the comparison, the launch. */
    uint64_t ns_check, ns_post, ns_met, ns_launch;
} blink_replay_call;

/* The whole repeat: returns LAUNCHED, MOVED (nothing posted: the tensor's allocation is another one),
 * NOT_MET (posted; some peer not there within spin_ns), DIFFERENT (posted; every peer there, some with
 * other bytes) or LAUNCH_FAILED (c->cuda_error: the CUresult). */
int blink_replay(blink_replay_call *c, uint32_t seq, void *stream, uint64_t epoch) {
    uint64_t bid = 0, t0 = now_ns(), t1, t2, t3;
    c->ns_post = c->ns_met = c->ns_launch = 0;
    int moved = c->attribute(&bid, BLINK_BUFFER_ID, c->ptr) != 0 || bid != c->bid;
    t1 = now_ns();
    c->ns_check = t1 - t0;
    if (moved) return MOVED;
    blink_post(c->peers, seq, c->payload, c->len);
    t2 = now_ns();
    c->ns_post = t2 - t1;
    int met = blink_met(c->peers, seq, c->spin_ns, c->yield_every);
    int same = met && blink_same(c->peers, seq, c->expected, c->offsets, c->lens);
    t3 = now_ns();
    c->ns_met = t3 - t2;
    if (!met) return NOT_MET;
    if (!same) return DIFFERENT;
    *c->epoch_slot = epoch;
    int err = c->launch(c->function, c->grid, 1, 1, c->block, 1, 1, 0, stream, c->params, NULL);
    c->ns_launch = now_ns() - t3;
    if (err) {
        c->cuda_error = err;
        return LAUNCH_FAILED;
    }
    return LAUNCHED;
}
