/* Copies with non-temporal (streaming) stores, for blink_horovod's CPU runtime.
 *
 * Why: a plain copy (glibc memcpy below its non-temporal threshold, which is
 * hundreds of MB on most machines) reads every destination line into the cache
 * before overwriting it ("read for ownership"), so copying N bytes moves 3N
 * bytes over the memory bus.  Blink's chunk copies (a rank's input staged into
 * its shared segment, results copied into the caller's tensor) are written once
 * and read later by another process, after the writer's caches have moved on:
 * streaming stores skip the read and move 2N.  The CPU runtime is bound by
 * memory bandwidth (docs/benchmarks.md), so this is time saved.
 *
 * Streaming stores are weakly ordered: every function ends with a store fence,
 * so a flag written after it (the step's "posted" word) is never seen before
 * the data.  On machines other than x86-64 the functions are plain memcpy.
 *
 * Built by blink_horovod/cbuild.py for runtime/streamcopy.py; loaded with ctypes.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define BLINK_STREAMING 1
#else
#define BLINK_STREAMING 0
#endif

int blink_streaming(void) { return BLINK_STREAMING; }

#if BLINK_STREAMING
/* dst[0:n] = src[0:n] with 16-byte streaming stores; no fence. */
static void stream_copy(unsigned char *dst, const unsigned char *src, size_t n) {
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    if (head > n) head = n;
    memcpy(dst, src, head);
    dst += head; src += head; n -= head;
    size_t body = n & ~(size_t)63;
    for (size_t i = 0; i < body; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    memcpy(dst + body, src + body, n - body);
}
#endif

/* dst[0:n] = src[0:n]; the regions do not overlap. */
void blink_copy(void *dst, const void *src, size_t n) {
#if BLINK_STREAMING
    stream_copy((unsigned char *)dst, (const unsigned char *)src, n);
    _mm_sfence();
#else
    memcpy(dst, src, n);
#endif
}

/* dst1[0:n] = dst2[0:n] = src[0:n], block by block so src is read from memory once. */
void blink_copy2(void *dst1, void *dst2, const void *src, size_t n) {
    const size_t block = 64 << 10;
    for (size_t a = 0; a < n; a += block) {
        size_t m = n - a < block ? n - a : block;
#if BLINK_STREAMING
        stream_copy((unsigned char *)dst1 + a, (const unsigned char *)src + a, m);
        stream_copy((unsigned char *)dst2 + a, (const unsigned char *)src + a, m);
#else
        memcpy((unsigned char *)dst1 + a, (const unsigned char *)src + a, m);
        memcpy((unsigned char *)dst2 + a, (const unsigned char *)src + a, m);
#endif
    }
#if BLINK_STREAMING
    _mm_sfence();
#endif
}
