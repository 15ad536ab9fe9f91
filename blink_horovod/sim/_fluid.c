/* The fluid engine's event loop (engine.py, run) in C: the same algorithm, the same
 * arithmetic in the same order, so the results are bit-identical to the Python loop.
 *
 * engine.py validates the graph and lays it out in flat arrays (CSR for the
 * per-task tuples); native.py compiles this file once per machine and calls
 * blink_fluid_run through ctypes.  Why C: a chunk-level simulation of one
 * allreduce at 1 GB has ~10^5 tasks and ~10^6 rate updates, and the sweep of
 * every DGX-1V allocation runs 362 of them; the interpreter's cost per update dominated.
 *
 * Built with -ffp-contract=off: a fused multiply-add would round differently
 * from Python's separate multiply and subtract.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    double t;
    int64_t v; /* flow version, or -1: head latency over, -2: tail latency over */
    int32_t i; /* task */
} Event;

/* Python compares (t, v, i) tuples: the same order here. */
static inline int ev_less(const Event *a, const Event *b) {
    if (a->t != b->t) return a->t < b->t;
    if (a->v != b->v) return a->v < b->v;
    return a->i < b->i;
}

typedef struct {
    Event *a;
    int64_t n, cap;
} Heap;

/* `a` (n elements of `size` bytes, room for *cap) with room for one more: itself, or grown to twice
 * its capacity (`first` elements at first); NULL when out of memory (then `a` is untouched). */
static void *room_for_one(void *a, int64_t n, int64_t *cap, int64_t first, size_t size) {
    if (n < *cap) return a;
    int64_t nc = *cap ? 2 * *cap : first;
    void *na = realloc(a, (size_t)nc * size);
    if (na) *cap = nc;
    return na;
}

static int heap_push(Heap *h, double t, int64_t v, int32_t i) {
    Event *na = room_for_one(h->a, h->n, &h->cap, 1024, sizeof(Event));
    if (!na) return -1;
    h->a = na;
    int64_t k = h->n++;
    Event e = {t, v, i};
    while (k > 0) {
        int64_t p = (k - 1) / 2;
        if (!ev_less(&e, &h->a[p])) break;
        h->a[k] = h->a[p];
        k = p;
    }
    h->a[k] = e;
    return 0;
}

static Event heap_pop(Heap *h) {
    Event top = h->a[0];
    Event last = h->a[--h->n];
    int64_t k = 0, n = h->n;
    for (;;) {
        int64_t c = 2 * k + 1;
        if (c >= n) break;
        if (c + 1 < n && ev_less(&h->a[c + 1], &h->a[c])) c++;
        if (!ev_less(&h->a[c], &last)) break;
        h->a[k] = h->a[c];
        k = c;
    }
    if (n > 0) h->a[k] = last;
    return top;
}

typedef struct {
    int32_t *a;
    int64_t n, cap;
} Stack;

static int stack_push(Stack *s, int32_t x) {
    int32_t *na = room_for_one(s->a, s->n, &s->cap, 256, sizeof(int32_t));
    if (!na) return -1;
    s->a = na;
    s->a[s->n++] = x;
    return 0;
}

/* Each task of `from` (emptied) goes to `to` at t + delay[i]: at once when there is no delay,
 * else by the heap event (time, event, task).  Nonzero when out of memory. */
static int wait_or_pass(Stack *from, const double *delay, double t, int64_t event, Heap *heap, Stack *to) {
    while (from->n) {
        int32_t i = from->a[--from->n];
        if (delay[i] > 0.0 ? heap_push(heap, t + delay[i], event, i) : stack_push(to, i)) return -1;
    }
    return 0;
}

#define PUSH(s, x) do { if (stack_push(&(s), (x))) goto oom; } while (0)
#define HPUSH(t, v, i) do { if (heap_push(&heap, (t), (v), (i))) goto oom; } while (0)

/* Returns the number of finished tasks (n when nothing deadlocked), or -1 when out of memory.
 *
 * res_off/res_idx: task i's resources are res_idx[res_off[i] .. res_off[i+1]).
 * succ_off/succ_idx: tasks that depend on task i; wait_off/wait_idx: tasks waiting on signal s.
 * npred: per task, dependencies + signals awaited (consumed).
 */
int64_t blink_fluid_run(
    int32_t n, const double *lat, const double *nbytes, const double *tail,
    const int64_t *res_off, const int32_t *res_idx,
    const int64_t *succ_off, const int32_t *succ_idx,
    int32_t nsig, const int64_t *wait_off, const int32_t *wait_idx, const int32_t *raises,
    int32_t *npred, int32_t ncap, const double *cap, double t0, double eps_t,
    double *finish, uint8_t *finished, int64_t *events_out) {
    int64_t result = -1;
    int64_t nentries = res_off[n];
    /* active[r]: the flows on resource r, as entries e of res_idx (swap-remove via pos[e]). */
    int64_t *act_off = calloc((size_t)ncap + 1, sizeof(int64_t));
    int64_t *act_len = calloc((size_t)ncap + 1, sizeof(int64_t));
    int32_t *act = malloc((size_t)(nentries ? nentries : 1) * sizeof(int32_t));
    int64_t *pos = malloc((size_t)(nentries ? nentries : 1) * sizeof(int64_t));
    int32_t *owner = malloc((size_t)(nentries ? nentries : 1) * sizeof(int32_t));
    double *rem = calloc((size_t)n + 1, sizeof(double));
    double *rate = calloc((size_t)n + 1, sizeof(double));
    double *tlast = calloc((size_t)n + 1, sizeof(double));
    int64_t *ver = calloc((size_t)n + 1, sizeof(int64_t));
    uint8_t *raised = calloc((size_t)nsig + 1, 1);
    uint8_t *dirty_mark = calloc((size_t)ncap + 1, 1);
    int64_t *seen = calloc((size_t)n + 1, sizeof(int64_t)); /* instant stamp: flow already recomputed */
    Stack ready = {0}, moving = {0}, moved = {0}, over = {0}, dirty = {0};
    Heap heap = {0};
    if (!act_off || !act_len || !act || !pos || !owner || !rem || !rate || !tlast || !ver || !raised || !dirty_mark || !seen)
        goto oom;
    /* A resource holds at most the entries that name it: size its slice by that count. */
    for (int64_t e = 0; e < nentries; e++) act_off[res_idx[e] + 1]++;
    for (int32_t r = 0; r < ncap; r++) act_off[r + 1] += act_off[r];
    for (int32_t i = 0; i < n; i++)
        for (int64_t e = res_off[i]; e < res_off[i + 1]; e++) owner[e] = i;

    int64_t events = 0, done = 0, stamp = 0;
    double t = t0;
    for (int32_t i = 0; i < n; i++)
        if (npred[i] == 0) PUSH(ready, i);

    for (;;) {
        while (ready.n || moving.n || moved.n || over.n) {
            if (wait_or_pass(&ready, lat, t, -1, &heap, &moving)) goto oom;
            while (moving.n) {
                int32_t i = moving.a[--moving.n];
                if (nbytes[i] > 0.0) {
                    rem[i] = nbytes[i];
                    rate[i] = 0.0;
                    tlast[i] = t;
                    for (int64_t e = res_off[i]; e < res_off[i + 1]; e++) {
                        int32_t r = res_idx[e];
                        pos[e] = act_len[r];
                        act[act_off[r] + act_len[r]++] = (int32_t)e;
                        if (!dirty_mark[r]) { dirty_mark[r] = 1; PUSH(dirty, r); }
                    }
                } else PUSH(moved, i);
            }
            if (wait_or_pass(&moved, tail, t, -2, &heap, &over)) goto oom;
            while (over.n) {
                int32_t i = over.a[--over.n];
                finish[i] = t;
                finished[i] = 1;
                done++;
                for (int64_t k = succ_off[i]; k < succ_off[i + 1]; k++) {
                    int32_t s = succ_idx[k];
                    if (--npred[s] == 0) PUSH(ready, s);
                }
                int32_t sig = raises[i];
                if (sig >= 0 && !raised[sig]) {
                    raised[sig] = 1;
                    for (int64_t k = wait_off[sig]; k < wait_off[sig + 1]; k++) {
                        int32_t s = wait_idx[k];
                        if (--npred[s] == 0) PUSH(ready, s);
                    }
                }
            }
        }
        if (dirty.n) {
            stamp++;
            for (int64_t d = 0; d < dirty.n; d++) {
                int32_t r0 = dirty.a[d];
                dirty_mark[r0] = 0;
                for (int64_t k = act_off[r0]; k < act_off[r0] + act_len[r0]; k++) {
                    int32_t f = owner[act[k]];
                    if (seen[f] == stamp) continue;
                    seen[f] = stamp;
                    double nw = 0.0;
                    for (int64_t e = res_off[f]; e < res_off[f + 1]; e++) {
                        int32_t r = res_idx[e];
                        double share = cap[r] / (double)act_len[r];
                        if (e == res_off[f] || share < nw) nw = share;
                    }
                    double old = rate[f];
                    if (nw != old) {
                        if (old > 0.0) {
                            double left = rem[f] - old * (t - tlast[f]);
                            rem[f] = left > 0.0 ? left : 0.0;
                        }
                        tlast[f] = t;
                        rate[f] = nw;
                        int64_t v = ++ver[f];
                        HPUSH(t + rem[f] / nw, v, f);
                    }
                }
            }
            dirty.n = 0;
        }
        if (!heap.n) break;
        t = heap.a[0].t;
        double horizon = t + eps_t + t * 1e-12;
        while (heap.n && heap.a[0].t <= horizon) {
            Event ev = heap_pop(&heap);
            int32_t i = ev.i;
            events++;
            if (ev.v == -1) PUSH(moving, i);
            else if (ev.v == -2) PUSH(over, i);
            else if (ev.v == ver[i] && !finished[i]) {
                for (int64_t e = res_off[i]; e < res_off[i + 1]; e++) {
                    int32_t r = res_idx[e];
                    /* swap-remove entry e from active[r] */
                    int64_t p = pos[e], last = act_off[r] + act_len[r] - 1;
                    int32_t moved_e = act[last];
                    act[act_off[r] + p] = moved_e;
                    pos[moved_e] = p;
                    act_len[r]--;
                    if (!dirty_mark[r]) { dirty_mark[r] = 1; PUSH(dirty, r); }
                }
                rem[i] = 0.0;
                ver[i] = ev.v + 1;
                PUSH(moved, i);
            }
        }
    }
    *events_out = events;
    result = done;
oom:
    free(act_off); free(act_len); free(act); free(pos); free(owner);
    free(rem); free(rate); free(tlast); free(ver); free(raised); free(dirty_mark); free(seen);
    free(ready.a); free(moving.a); free(moved.a); free(over.a); free(dirty.a); free(heap.a);
    return result;
}
