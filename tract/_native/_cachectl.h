/*
 * tract cache-control primitives: flush, invalidate, write-back, fences and
 * non-temporal copies over a mapped pool.
 *
 * Why these exist (DESIGN.md R3, R4): a CXL pool shared by several hosts is
 * not coherent across them.  A writer must push its dirty lines to the device
 * (flush or write-back) and fence before it publishes; a reader must drop its
 * possibly stale copy (invalidate = flush of a clean line) and fence before
 * it reads.  Every primitive here works on whole 64-byte lines: a range is
 * widened to the lines it touches.
 *
 * Instruction choice.  The CPU is asked once (tract_cpu_features) which of
 * clflush, clflushopt and clwb it has; the Python layer (tract/platform.py)
 * chooses from that, the TRACT_FLUSH variable and the pool configuration one
 * instruction per action (flush, invalidate, write-back) and passes it to
 * every call, so no call here asks the CPU again.  clflushopt and clwb are
 * weakly ordered: the caller's fence orders them.
 *
 * Non-x86 builds, and x86 builds with TRACT_CACHECTL_PORTABLE defined (CI
 * builds that path on x86 so it cannot rot), use aarch64 "dc" cache
 * maintenance where available and otherwise compiler fences only.
 */
#ifndef TRACT_CACHECTL_H
#define TRACT_CACHECTL_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define TRACT_LINE 64

enum tract_insn {
    TRACT_INSN_NONE = 0,
    TRACT_INSN_CLFLUSH = 1,
    TRACT_INSN_CLFLUSHOPT = 2,
    TRACT_INSN_CLWB = 3,
    TRACT_INSN_DC_CIVAC = 4,
    TRACT_INSN_DC_CVAC = 5
};

enum tract_feature {
    TRACT_HAS_CLFLUSH = 1 << 0,
    TRACT_HAS_CLFLUSHOPT = 1 << 1,
    TRACT_HAS_CLWB = 1 << 2,
    TRACT_HAS_SSE2 = 1 << 3,
    TRACT_HAS_AVX2 = 1 << 4,
    TRACT_HAS_AVX512F = 1 << 5,
    TRACT_HAS_DC = 1 << 6
};

enum tract_nt_kind {
    TRACT_NT_NONE = 0,
    TRACT_NT_SSE2 = 1,
    TRACT_NT_AVX2 = 2,
    TRACT_NT_AVX512 = 3
};

#if (defined(__x86_64__) || defined(__i386__)) && !defined(TRACT_CACHECTL_PORTABLE)
#define TRACT_X86 1
#include <cpuid.h>
#include <immintrin.h>
#define TRACT_BUILD_PATH "x86"
#elif defined(__aarch64__) && !defined(TRACT_CACHECTL_PORTABLE)
#define TRACT_AARCH64 1
#define TRACT_BUILD_PATH "aarch64"
#else
#define TRACT_BUILD_PATH "portable"
#endif

/* ------------------------------------------------------------------ CPUID */

#ifdef TRACT_X86
/* xgetbv without -mxsave: the OS must have enabled a register state before
 * the vector instructions that use it may run. */
static inline uint64_t tract_xgetbv0(void)
{
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((uint64_t)hi << 32) | lo;
}
#endif

/* Bit set of enum tract_feature for this CPU and OS. */
static inline int tract_cpu_features(void)
{
    int features = 0;
#ifdef TRACT_X86
    unsigned int a, b, c, d;
    int os_avx = 0, os_avx512 = 0;
    if (!__get_cpuid(1, &a, &b, &c, &d))
        return 0;
    if (d & (1u << 19)) features |= TRACT_HAS_CLFLUSH;
    if (d & (1u << 26)) features |= TRACT_HAS_SSE2;
    if ((c & (1u << 27)) && (c & (1u << 28))) {  /* OSXSAVE and AVX */
        uint64_t xcr0 = tract_xgetbv0();
        os_avx = (xcr0 & 0x6) == 0x6;
        os_avx512 = os_avx && (xcr0 & 0xe0) == 0xe0;
    }
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d)) {
        if (b & (1u << 23)) features |= TRACT_HAS_CLFLUSHOPT;
        if (b & (1u << 24)) features |= TRACT_HAS_CLWB;
        if (os_avx && (b & (1u << 5))) features |= TRACT_HAS_AVX2;
        if (os_avx512 && (b & (1u << 16))) features |= TRACT_HAS_AVX512F;
    }
#elif defined(TRACT_AARCH64)
    features |= TRACT_HAS_DC;
#endif
    return features;
}

/* ------------------------------------------------------------ range loops */

#define TRACT_FOR_LINES(p, addr, len) \
    for (const char *p = (const char *)((uintptr_t)(addr) & ~(uintptr_t)(TRACT_LINE - 1)), \
         *p##_end = (const char *)(addr) + (len); p < p##_end; p += TRACT_LINE)

#ifdef TRACT_X86
/* Write back and drop each line; weakly ordered, so the caller fences. */
__attribute__((target("clflushopt")))
static void tract_clflushopt_range(const char *addr, size_t len)
{
    TRACT_FOR_LINES(p, addr, len) _mm_clflushopt((void *)p);
}

/* Write back each line, which may stay cached; weakly ordered. */
__attribute__((target("clwb")))
static void tract_clwb_range(const char *addr, size_t len)
{
    TRACT_FOR_LINES(p, addr, len) _mm_clwb((void *)p);
}
#endif

/* Apply one cache-maintenance instruction to every line that
 * [addr, addr+len) touches.  The caller picks the instruction per action
 * (flush, invalidate, write-back) once, when it maps the pool. */
static inline void tract_lines(int insn, const char *addr, size_t len)
{
    if (len == 0) return;
    switch (insn) {
#ifdef TRACT_X86
    /* write back and drop; ordered with other stores */
    case TRACT_INSN_CLFLUSH: { TRACT_FOR_LINES(p, addr, len) _mm_clflush(p); } break;
    case TRACT_INSN_CLFLUSHOPT: tract_clflushopt_range(addr, len); break;
    case TRACT_INSN_CLWB: tract_clwb_range(addr, len); break;
#endif
#ifdef TRACT_AARCH64
    /* clean and invalidate to the point of coherency */
    case TRACT_INSN_DC_CIVAC: {
        TRACT_FOR_LINES(p, addr, len) __asm__ volatile("dc civac, %0" :: "r"(p) : "memory");
    } break;
    /* clean to the point of coherency; the line may stay cached */
    case TRACT_INSN_DC_CVAC: {
        TRACT_FOR_LINES(p, addr, len) __asm__ volatile("dc cvac, %0" :: "r"(p) : "memory");
    } break;
#endif
    default: break;  /* NONE: a coherent pool, or no instruction exists */
    }
}

/* ----------------------------------------------------------------- fences */

/* Full fence: orders flushes, loads and stores before what follows. */
static inline void tract_fence(void)
{
#if defined(TRACT_X86)
    _mm_mfence();
#elif defined(TRACT_AARCH64)
    __asm__ volatile("dsb sy" ::: "memory");
#else
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
#endif
}

/* Store fence: orders stores, streaming stores and clflushopt/clwb. */
static inline void tract_store_fence(void)
{
#if defined(TRACT_X86)
    _mm_sfence();
#elif defined(TRACT_AARCH64)
    __asm__ volatile("dsb st" ::: "memory");
#else
    __atomic_thread_fence(__ATOMIC_RELEASE);
#endif
}

/* Load fence: later loads wait for earlier ones (and for clflush). */
static inline void tract_load_fence(void)
{
#if defined(TRACT_X86)
    _mm_lfence();
#elif defined(TRACT_AARCH64)
    __asm__ volatile("dsb ld" ::: "memory");
#else
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
#endif
}

/* ------------------------------------------------------ non-temporal copy */

#ifdef TRACT_X86
/* Streaming copy of n bytes (a multiple of 64) to 64-byte-aligned dst. */
__attribute__((target("avx512f")))
static void tract_stream_avx512(char *dst, const char *src, size_t n)
{
    for (; n >= 256; n -= 256, dst += 256, src += 256) {
        __m512i a = _mm512_loadu_si512((const void *)src);
        __m512i b = _mm512_loadu_si512((const void *)(src + 64));
        __m512i c = _mm512_loadu_si512((const void *)(src + 128));
        __m512i d = _mm512_loadu_si512((const void *)(src + 192));
        _mm512_stream_si512((void *)dst, a);
        _mm512_stream_si512((void *)(dst + 64), b);
        _mm512_stream_si512((void *)(dst + 128), c);
        _mm512_stream_si512((void *)(dst + 192), d);
    }
    for (; n; n -= 64, dst += 64, src += 64)
        _mm512_stream_si512((void *)dst, _mm512_loadu_si512((const void *)src));
}

__attribute__((target("avx2")))
static void tract_stream_avx2(char *dst, const char *src, size_t n)
{
    for (; n >= 128; n -= 128, dst += 128, src += 128) {
        __m256i a = _mm256_loadu_si256((const __m256i *)src);
        __m256i b = _mm256_loadu_si256((const __m256i *)(src + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(src + 64));
        __m256i d = _mm256_loadu_si256((const __m256i *)(src + 96));
        _mm256_stream_si256((__m256i *)dst, a);
        _mm256_stream_si256((__m256i *)(dst + 32), b);
        _mm256_stream_si256((__m256i *)(dst + 64), c);
        _mm256_stream_si256((__m256i *)(dst + 96), d);
    }
    for (; n; n -= 64, dst += 64, src += 64) {
        _mm256_stream_si256((__m256i *)dst, _mm256_loadu_si256((const __m256i *)src));
        _mm256_stream_si256((__m256i *)(dst + 32), _mm256_loadu_si256((const __m256i *)(src + 32)));
    }
}

static void tract_stream_sse2(char *dst, const char *src, size_t n)
{
    for (; n; n -= 64, dst += 64, src += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)src);
        __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
        _mm_stream_si128((__m128i *)dst, a);
        _mm_stream_si128((__m128i *)(dst + 16), b);
        _mm_stream_si128((__m128i *)(dst + 32), c);
        _mm_stream_si128((__m128i *)(dst + 48), d);
    }
}
#endif

/* Copy n bytes into the mapping so that, on return, all of them are in
 * memory (R3 for payloads): whole lines go by streaming stores of the given
 * kind, which bypass the cache; the partial lines at either end go by
 * ordinary stores and are written back with `insn`; one sfence orders all
 * of it.  With kind NONE this is memcpy and a write-back of the range. */
static inline void tract_copy_in_nt(int kind, int insn, char *dst, const char *src, size_t n)
{
    if (n == 0) return;
    size_t head = (size_t)(-(uintptr_t)dst & (TRACT_LINE - 1));
    if (head > n) head = n;
    size_t body = (n - head) & ~(size_t)(TRACT_LINE - 1);
    size_t tail = n - head - body;
    if (kind == TRACT_NT_NONE || body == 0) {
        memcpy(dst, src, n);
        tract_lines(insn, dst, n);
        tract_store_fence();
        return;
    }
    if (head) {
        memcpy(dst, src, head);
        tract_lines(insn, dst, head);
    }
#ifdef TRACT_X86
    if (kind == TRACT_NT_AVX512) tract_stream_avx512(dst + head, src + head, body);
    else if (kind == TRACT_NT_AVX2) tract_stream_avx2(dst + head, src + head, body);
    else tract_stream_sse2(dst + head, src + head, body);
#endif
    if (tail) {
        memcpy(dst + head + body, src + head + body, tail);
        tract_lines(insn, dst + head + body, tail);
    }
    tract_store_fence();
}

/* ------------------------------------------------- coherent pools only */

/* Compare-and-swap on a u64; returns the value found.  Atomic only among
 * hosts that share coherence (one host, or a hardware-coherent device). */
static inline uint64_t tract_cas_u64(uint64_t *addr, uint64_t expected, uint64_t desired)
{
    __atomic_compare_exchange_n(addr, &expected, desired, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    return expected;
}

/* Atomic add on a u64; returns the new value.  For node-local memory (one
 * host: coherent), e.g. the count of a lock's local waiters. */
static inline uint64_t tract_add_u64(uint64_t *addr, int64_t delta)
{
    return __atomic_add_fetch(addr, (uint64_t)delta, __ATOMIC_SEQ_CST);
}

/* Add ``delta`` to a u32 atomically unless the result would leave
 * 0..2^32-1; returns the value found.  Atomic among the processes of one
 * host (its caches are coherent): for pool lines only this host's node
 * writes (R2), e.g. a node's pin counters. */
static inline uint32_t tract_add_u32_bounded(uint32_t *addr, int64_t delta)
{
    uint32_t old = __atomic_load_n(addr, __ATOMIC_SEQ_CST);
    for (;;) {
        int64_t sum = (int64_t)old + delta;
        if (sum < 0 || sum > (int64_t)UINT32_MAX)
            return old;
        if (__atomic_compare_exchange_n(addr, &old, (uint32_t)sum, 0, __ATOMIC_SEQ_CST,
                                        __ATOMIC_SEQ_CST))
            return old;
    }
}

/* Atomic load of a u64 (sequentially consistent), node-local memory. */
static inline uint64_t tract_load_u64(const uint64_t *addr)
{
    return __atomic_load_n(addr, __ATOMIC_SEQ_CST);
}

#endif /* TRACT_CACHECTL_H */
