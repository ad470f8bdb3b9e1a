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
#include <pthread.h>

#define TRACT_LINE 64

/* The torn-line check word (tract/lines.py): each word of a line mixed in, seeded
 * with the tag of the line's kind. */
#define TRACT_CHECK_PRIME 0x100000001B3ULL
#define TRACT_CHECK_ADD 0x9E3779B97F4A7C15ULL

static inline uint64_t tract_check_word(uint64_t tag, const volatile uint64_t *words, int n) {
    uint64_t check = tag;
    for (int i = 0; i < n; i++)
        check = (check ^ words[i]) * TRACT_CHECK_PRIME + TRACT_CHECK_ADD;
    return check;
}

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

/* ------------------------------------------------------------------ trace */

/* The cache-control trace (DESIGN.md §5, fast twins).  While a trace is on,
 * every line a flush, invalidate or write-back touches is recorded as
 * (instruction, line address), and every fence as (TRACT_TRACE_*, 0), in
 * call order, by the thread that started it only (a heartbeat thread's
 * flushes are not the step under test).  Off (entries NULL, the production
 * state) it costs each primitive one predictable branch.
 *
 * One trace serves the process: each extension module that includes this
 * header has its own `tract_trace` pointer, which `tract._native._region`'s
 * state is bound to when the module loads (`tract_trace_bind`), so native
 * steps of every module and the Numba kernels (which call _region's C entry
 * points) record into the same buffer. */
enum tract_trace_op {
    TRACT_TRACE_FENCE = 16,
    TRACT_TRACE_STORE_FENCE = 17,
    TRACT_TRACE_LOAD_FENCE = 18
};

/* The shadow memory (DESIGN.md §5: twins that see the data).  While a trace
 * runs with a shadow, the mapping stands for one host's *cache* and the
 * shadow for the *memory* behind it, over the lines [base, base + 64 *
 * lines): a flush, invalidate or write-back only queues its line, with a
 * copy of the bytes the cache holds then; the next fence of any kind (as in
 * tract.testing.incoherent) completes the queue: a line that was dirty (its
 * bytes differ from those of its last fetch) or written by streaming stores
 * goes to memory as it was when queued, and a dropped line that no store
 * touched since is fetched again from memory.  Loads and stores are the
 * native code's own, on the cache: a store after the write-back that should
 * carry it never reaches memory, and a read before its invalidation and
 * fence sees what the cache held, which a test makes stale.  So a twin test
 * compares the memory a step leaves, not only its cache. */
enum tract_shadow_kind {
    TRACT_SHADOW_WRITE = 1,  /* write back if dirty */
    TRACT_SHADOW_DROP = 2,   /* then fetch again */
    TRACT_SHADOW_WHOLE = 4   /* streamed: to memory whatever it held before */
};

typedef struct {
    char *base;          /* the first line shadowed; NULL: no shadow */
    size_t lines;
    uint8_t *memory;     /* what memory holds, 64 bytes a line */
    uint8_t *fetched;    /* what the cache held at each line's last fetch or write-back */
    uint8_t *queued;     /* each queued line's bytes when it was queued */
    uint8_t *kinds;      /* per line: 0, or the tract_shadow_kind bits queued */
    int64_t *queue;      /* the lines queued, in order */
    size_t count;
} tract_shadow_t;

typedef struct {
    int64_t *entries;    /* capacity pairs (op, address); NULL: no trace */
    size_t capacity;
    size_t count;        /* pairs recorded; more than capacity: it overflowed */
    pthread_t thread;    /* the thread whose calls are recorded */
    tract_shadow_t shadow;
} tract_trace_t;

__attribute__((unused)) static tract_trace_t tract_trace_own;
__attribute__((unused)) static tract_trace_t *tract_trace = &tract_trace_own;

static inline void tract_trace_bind(tract_trace_t *shared) { tract_trace = shared; }

/* Start recording this thread's calls into entries[0 .. 2*capacity). */
static inline void tract_trace_begin(int64_t *entries, size_t capacity)
{
    tract_trace->capacity = capacity;
    tract_trace->count = 0;
    tract_trace->thread = pthread_self();
    tract_trace->shadow.base = NULL;
    tract_trace->entries = entries;
}

/* Stop recording; the number of pairs made (more than capacity: overflow). */
static inline size_t tract_trace_end(void)
{
    tract_trace->entries = NULL;
    tract_trace->shadow.base = NULL;
    return tract_trace->count;
}

/* A line op of the shadow: queue the line with the bytes it holds now. */
static inline void tract_shadow_line(tract_shadow_t *s, int kind, uintptr_t address)
{
    if (address < (uintptr_t)s->base) return;
    size_t line = (address - (uintptr_t)s->base) / TRACT_LINE;
    if (line >= s->lines) return;
    if (!s->kinds[line]) s->queue[s->count++] = (int64_t)line;
    s->kinds[line] |= (uint8_t)kind;
    memcpy(s->queued + line * TRACT_LINE, s->base + line * TRACT_LINE, TRACT_LINE);
}

/* A fence of the shadow: every queued line completes, in order. */
static inline void tract_shadow_fence(tract_shadow_t *s)
{
    for (size_t i = 0; i < s->count; i++) {
        size_t line = (size_t)s->queue[i], at = line * TRACT_LINE;
        int kind = s->kinds[line];
        char *cache = s->base + at;
        int unchanged = !memcmp(cache, s->queued + at, TRACT_LINE);
        if ((kind & TRACT_SHADOW_WHOLE) || memcmp(s->queued + at, s->fetched + at, TRACT_LINE)) {
            memcpy(s->memory + at, s->queued + at, TRACT_LINE);
            memcpy(s->fetched + at, s->queued + at, TRACT_LINE);
        }
        if (unchanged && (kind & TRACT_SHADOW_DROP)) {
            memcpy(cache, s->memory + at, TRACT_LINE);
            memcpy(s->fetched + at, s->memory + at, TRACT_LINE);
        }
        s->kinds[line] = 0;
    }
    s->count = 0;
}

/* TRACT_TRACE_STREAM: a line written by streaming stores; it goes to the
 * shadow only (the trace's entries are cache control). */
#define TRACT_TRACE_STREAM 32

__attribute__((unused, noinline)) static void tract_trace_record(int64_t op, uintptr_t address)
{
    tract_trace_t *t = tract_trace;
    if (!pthread_equal(pthread_self(), t->thread)) return;
    if (t->shadow.base) {
        if (op >= TRACT_TRACE_FENCE && op < TRACT_TRACE_STREAM)
            tract_shadow_fence(&t->shadow);
        else if (op == TRACT_TRACE_STREAM)
            tract_shadow_line(&t->shadow, TRACT_SHADOW_WHOLE | TRACT_SHADOW_DROP, address);
        else
            tract_shadow_line(&t->shadow, op == TRACT_INSN_CLWB || op == TRACT_INSN_DC_CVAC
                              ? TRACT_SHADOW_WRITE : TRACT_SHADOW_WRITE | TRACT_SHADOW_DROP,
                              address);
    }
    if (op == TRACT_TRACE_STREAM) return;
    if (t->count < t->capacity) {
        t->entries[2 * t->count] = op;
        t->entries[2 * t->count + 1] = (int64_t)address;
    }
    t->count++;
}

/* TRACT_CACHECTL_NO_TRACE compiles the hook out: only for measuring that
 * it costs nothing (`tract bench trace`). */
#ifdef TRACT_CACHECTL_NO_TRACE
#define TRACT_TRACING 0
#else
#define TRACT_TRACING __builtin_expect(tract_trace->entries != NULL, 0)
#endif

#define TRACT_TRACED(op, address) \
    do { if (TRACT_TRACING) tract_trace_record((op), (uintptr_t)(address)); } while (0)

/* The lines of [dst, dst + n) were just written by streaming stores (whole,
 * line-aligned): for the shadow, which sends them to memory at the fence. */
#define TRACT_STREAMED(dst, n) do { if (TRACT_TRACING) { \
    for (size_t tract_at_ = 0; tract_at_ < (size_t)(n); tract_at_ += TRACT_LINE) \
        tract_trace_record(TRACT_TRACE_STREAM, (uintptr_t)(dst) + tract_at_); } } while (0)

/* ------------------------------------------------------------ range loops */

#define TRACT_FOR_LINES(p, addr, len) \
    for (const char *p = (const char *)((uintptr_t)(addr) & ~(uintptr_t)(TRACT_LINE - 1)), \
         *p##_end = (const char *)(addr) + (len); p < p##_end; p += TRACT_LINE)

#ifdef TRACT_X86
/* Write back and drop each line; weakly ordered, so the caller fences. */
__attribute__((target("clflushopt")))
static void tract_clflushopt_range(const char *addr, size_t len)
{
    TRACT_FOR_LINES(p, addr, len) {
        TRACT_TRACED(TRACT_INSN_CLFLUSHOPT, p);
        _mm_clflushopt((void *)p);
    }
}

/* Write back each line, which may stay cached; weakly ordered. */
__attribute__((target("clwb")))
static void tract_clwb_range(const char *addr, size_t len)
{
    TRACT_FOR_LINES(p, addr, len) {
        TRACT_TRACED(TRACT_INSN_CLWB, p);
        _mm_clwb((void *)p);
    }
}
#endif

/* Apply one cache-maintenance instruction to every line that
 * [addr, addr+len) touches.  The caller picks the instruction per action
 * (flush, invalidate, write-back) once, when it maps the pool. */
static inline void tract_lines(int insn, const char *addr, size_t len)
{
    if (len == 0 || insn == TRACT_INSN_NONE) return;  /* NONE: a coherent pool */
    /* each loop records its line as it issues the instruction (one loop, so
     * the trace and the shadow see exactly the lines the instruction does) */
    switch (insn) {
#ifdef TRACT_X86
    /* write back and drop; ordered with other stores */
    case TRACT_INSN_CLFLUSH:
        TRACT_FOR_LINES(p, addr, len) {
            TRACT_TRACED(TRACT_INSN_CLFLUSH, p);
            _mm_clflush(p);
        }
        break;
    case TRACT_INSN_CLFLUSHOPT: tract_clflushopt_range(addr, len); break;
    case TRACT_INSN_CLWB: tract_clwb_range(addr, len); break;
#endif
#ifdef TRACT_AARCH64
    /* clean and invalidate to the point of coherency */
    case TRACT_INSN_DC_CIVAC:
        TRACT_FOR_LINES(p, addr, len) {
            TRACT_TRACED(TRACT_INSN_DC_CIVAC, p);
            __asm__ volatile("dc civac, %0" :: "r"(p) : "memory");
        }
        break;
    /* clean to the point of coherency; the line may stay cached */
    case TRACT_INSN_DC_CVAC:
        TRACT_FOR_LINES(p, addr, len) {
            TRACT_TRACED(TRACT_INSN_DC_CVAC, p);
            __asm__ volatile("dc cvac, %0" :: "r"(p) : "memory");
        }
        break;
#endif
    default:  /* an instruction this build cannot issue: recorded, so traces agree */
        TRACT_FOR_LINES(p, addr, len) TRACT_TRACED(insn, p);
        break;
    }
}

/* ----------------------------------------------------------------- fences */

/* Full fence: orders flushes, loads and stores before what follows. */
static inline void tract_fence(void)
{
    TRACT_TRACED(TRACT_TRACE_FENCE, 0);
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
    TRACT_TRACED(TRACT_TRACE_STORE_FENCE, 0);
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
    TRACT_TRACED(TRACT_TRACE_LOAD_FENCE, 0);
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
        TRACT_STREAMED(dst, 256);
    }
    for (; n; n -= 64, dst += 64, src += 64) {
        _mm512_stream_si512((void *)dst, _mm512_loadu_si512((const void *)src));
        TRACT_STREAMED(dst, 64);
    }
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
        TRACT_STREAMED(dst, 128);
    }
    for (; n; n -= 64, dst += 64, src += 64) {
        _mm256_stream_si256((__m256i *)dst, _mm256_loadu_si256((const __m256i *)src));
        _mm256_stream_si256((__m256i *)(dst + 32), _mm256_loadu_si256((const __m256i *)(src + 32)));
        TRACT_STREAMED(dst, 64);
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
        TRACT_STREAMED(dst, 64);
    }
}
#endif

/* Copy n bytes into the mapping so that, on return, all of them are in
 * memory (R3 for payloads): whole lines go by streaming stores of the given
 * kind, which bypass the cache; the partial lines at either end go by
 * ordinary stores and are written back with `insn`.  With kind NONE this is
 * memcpy and a write-back of the range.  The caller's one store fence (one
 * per batch of copies) then puts all of it in memory. */
static inline void tract_stream_in(int kind, int insn, char *dst, const char *src, size_t n)
{
    if (n == 0) return;
    size_t head = (size_t)(-(uintptr_t)dst & (TRACT_LINE - 1));
    if (head > n) head = n;
    size_t body = (n - head) & ~(size_t)(TRACT_LINE - 1);
    size_t tail = n - head - body;
    if (kind == TRACT_NT_NONE || body == 0) {
        memcpy(dst, src, n);
        tract_lines(insn, dst, n);
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
}

/* tract_stream_in, then the store fence: in memory on return. */
static inline void tract_copy_in_nt(int kind, int insn, char *dst, const char *src, size_t n)
{
    tract_stream_in(kind, insn, dst, src, n);
    tract_store_fence();
}

/* Copy n bytes out of the mapping into private memory (an engine's buffer)
 * by streaming stores where the destination is line-aligned: a big copy
 * then reads no destination line it is about to overwrite (a memcpy's
 * stores read each one first).  No cache control: the destination is no
 * pool memory.  The caller ends the batch with tract_private_fence, so
 * other threads and devices see the bytes once the call returns. */
static inline void tract_stream_out(int kind, char *dst, const char *src, size_t n)
{
#ifdef TRACT_X86
    size_t body = n & ~(size_t)(TRACT_LINE - 1);
    if (!((uintptr_t)dst & (TRACT_LINE - 1)) && body && kind != TRACT_NT_NONE) {
        if (kind == TRACT_NT_AVX512) tract_stream_avx512(dst, src, body);
        else if (kind == TRACT_NT_AVX2) tract_stream_avx2(dst, src, body);
        else tract_stream_sse2(dst, src, body);
        memcpy(dst + body, src + body, n - body);
        return;
    }
#else
    (void)kind;
#endif
    memcpy(dst, src, n);
}

/* Streaming stores into private memory visible to every other agent: a
 * store fence that is no protocol step (nothing of the pool's is ordered by
 * it), so it is not traced. */
static inline void tract_private_fence(void)
{
#ifdef TRACT_X86
    _mm_sfence();
#else
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
#endif
}

/* ----------------------------------------------------------- checksums */

/* XXH64 (bit-exact with the reference: `xxhash.xxh64`): the digest of small
 * pieces (up to 240 bytes) and of a block's piece digests. */
#define TRACT_P1 0x9E3779B185EBCA87ULL
#define TRACT_P2 0xC2B2AE3D27D4EB4FULL
#define TRACT_P3 0x165667B19E3779F9ULL
#define TRACT_P4 0x85EBCA77C2B2AE63ULL
#define TRACT_P5 0x27D4EB2F165667C5ULL

static inline uint64_t tract_rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

static inline uint64_t tract_read64(const char *p) { uint64_t v; memcpy(&v, p, 8); return v; }

static inline uint32_t tract_read32(const char *p) { uint32_t v; memcpy(&v, p, 4); return v; }

static inline uint64_t tract_xxh64_round(uint64_t acc, uint64_t input)
{
    acc += input * TRACT_P2;
    return tract_rotl64(acc, 31) * TRACT_P1;
}

static inline void tract_xxh64_init(uint64_t v[4], uint64_t seed)
{
    v[0] = seed + TRACT_P1 + TRACT_P2;
    v[1] = seed + TRACT_P2;
    v[2] = seed;
    v[3] = seed - TRACT_P1;
}

/* Fold n bytes (a multiple of 32) into the four lanes. */
static inline void tract_xxh64_stripes(uint64_t v[4], const char *p, size_t n)
{
    uint64_t a = v[0], b = v[1], c = v[2], d = v[3];
    for (const char *end = p + n; p < end; p += 32) {
        a = tract_xxh64_round(a, tract_read64(p));
        b = tract_xxh64_round(b, tract_read64(p + 8));
        c = tract_xxh64_round(c, tract_read64(p + 16));
        d = tract_xxh64_round(d, tract_read64(p + 24));
    }
    v[0] = a; v[1] = b; v[2] = c; v[3] = d;
}

static inline uint64_t tract_xxh64_merge(uint64_t acc, uint64_t lane)
{
    acc ^= tract_xxh64_round(0, lane);
    return acc * TRACT_P1 + TRACT_P4;
}

/* The digest of `total` bytes whose stripes are in v and whose last
 * (total % 32) bytes are at tail. */
static inline uint64_t tract_xxh64_end(const uint64_t v[4], const char *tail, size_t total,
                                      uint64_t seed)
{
    uint64_t h;
    if (total >= 32) {
        h = tract_rotl64(v[0], 1) + tract_rotl64(v[1], 7) + tract_rotl64(v[2], 12)
            + tract_rotl64(v[3], 18);
        h = tract_xxh64_merge(h, v[0]);
        h = tract_xxh64_merge(h, v[1]);
        h = tract_xxh64_merge(h, v[2]);
        h = tract_xxh64_merge(h, v[3]);
    } else {
        h = seed + TRACT_P5;
    }
    h += (uint64_t)total;
    size_t left = total & 31;
    for (; left >= 8; left -= 8, tail += 8) {
        h ^= tract_xxh64_round(0, tract_read64(tail));
        h = tract_rotl64(h, 27) * TRACT_P1 + TRACT_P4;
    }
    if (left >= 4) {
        h ^= (uint64_t)tract_read32(tail) * TRACT_P1;
        h = tract_rotl64(h, 23) * TRACT_P2 + TRACT_P3;
        tail += 4;
        left -= 4;
    }
    for (; left; left--, tail++) {
        h ^= (uint64_t)(unsigned char)*tail * TRACT_P5;
        h = tract_rotl64(h, 11) * TRACT_P1;
    }
    h ^= h >> 33;
    h *= TRACT_P2;
    h ^= h >> 29;
    h *= TRACT_P3;
    h ^= h >> 32;
    return h;
}

static inline uint64_t tract_xxh64(const char *p, size_t n, uint64_t seed)
{
    uint64_t v[4];
    tract_xxh64_init(v, seed);
    size_t body = n & ~(size_t)31;
    tract_xxh64_stripes(v, p, body);
    return tract_xxh64_end(v, p + body, n, seed);
}

/* XXH3-64 for inputs longer than 240 bytes (bit-exact with
 * `xxhash.xxh3_64`), fused with the copy it checks: each 64-byte stripe is
 * loaded once, folded into the accumulators and stored (streaming stores
 * into the pool, plain ones out of it). */
static const unsigned char TRACT_XXH3_SECRET[192] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c,
    0xf7, 0x21, 0xad, 0x1c, 0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb,
    0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f, 0xcb, 0x79, 0xe6, 0x4e,
    0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6,
    0x81, 0x3a, 0x26, 0x4c, 0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb,
    0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3, 0x71, 0x64, 0x48, 0x97,
    0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7,
    0xc7, 0x0b, 0x4f, 0x1d, 0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31,
    0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64, 0xea, 0xc5, 0xac, 0x83,
    0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26,
    0x29, 0xd4, 0x68, 0x9e, 0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc,
    0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce, 0x45, 0xcb, 0x3a, 0x8f,
    0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};

/* How far ahead of the stripe being hashed its source is prefetched: the
 * fused copy loads, hashes and stores one stripe after another, so without
 * it fewer misses are in flight than in a plain copy (measured on this
 * machine: 0.84x a plain streaming copy without, 0.94-0.98x with). */
#define TRACT_XXH3_PREFETCH 1024
#define TRACT_XXH3_P32_1 0x9E3779B1ULL
#define TRACT_XXH3_P32_2 0x85EBCA77ULL
#define TRACT_XXH3_P32_3 0xC2B2AE3DULL

static inline void tract_xxh3_secret(unsigned char secret[192], uint64_t seed)
{
    memcpy(secret, TRACT_XXH3_SECRET, 192);
    if (!seed) return;
    for (int i = 0; i < 192; i += 16) {
        uint64_t low = tract_read64((const char *)secret + i) + seed;
        uint64_t high = tract_read64((const char *)secret + i + 8) - seed;
        memcpy(secret + i, &low, 8);
        memcpy(secret + i + 8, &high, 8);
    }
}

/* One stripe: fold src[0..64) into acc; with dst, store it there too
 * (streaming when nt). */
static inline void tract_xxh3_stripe(uint64_t acc[8], const char *src, const unsigned char *key,
                                     char *dst, int nt)
{
    uint64_t data[8];
    memcpy(data, src, 64);
    for (int i = 0; i < 8; i++) {
        uint64_t mixed = data[i] ^ tract_read64((const char *)key + 8 * i);
        acc[i ^ 1] += data[i];
        acc[i] += (mixed & 0xFFFFFFFFULL) * (mixed >> 32);
    }
    if (dst) {
#ifdef TRACT_X86
        if (nt) {
            for (int i = 0; i < 8; i++) _mm_stream_si64((long long *)(dst + 8 * i), (long long)data[i]);
            TRACT_STREAMED(dst, 64);
            return;
        }
#endif
        memcpy(dst, data, 64);
    }
}

#ifdef TRACT_X86
/* tract_xxh3_stripe over `count` stripes with AVX2 (xxhash's own
 * vectorisation: 32x32->64 products of the keyed halves, plus the data
 * with its 64-bit lanes swapped); key advances 8 bytes a stripe.  With
 * dst the loaded data is stored there (streaming when nt: dst 32-aligned). */
__attribute__((target("avx2")))
static void tract_xxh3_stripes_avx2(uint64_t acc64[8], const char *src, const unsigned char *key,
                                    size_t count, char *dst, int nt)
{
    __m256i acc[2] = {_mm256_loadu_si256((const __m256i *)acc64),
                      _mm256_loadu_si256((const __m256i *)(acc64 + 4))};
    for (size_t s = 0; s < count; s++, src += 64, key += 8) {
        _mm_prefetch(src + TRACT_XXH3_PREFETCH, _MM_HINT_T0);
        for (int j = 0; j < 2; j++) {
            __m256i data = _mm256_loadu_si256((const __m256i *)(src + 32 * j));
            __m256i mixed = _mm256_xor_si256(data,
                _mm256_loadu_si256((const __m256i *)(key + 32 * j)));
            __m256i product = _mm256_mul_epu32(mixed, _mm256_shuffle_epi32(mixed, 0x31));
            __m256i swapped = _mm256_shuffle_epi32(data, 0x4E);
            acc[j] = _mm256_add_epi64(acc[j], _mm256_add_epi64(product, swapped));
            if (dst) {
                if (nt) _mm256_stream_si256((__m256i *)(dst + 32 * j), data);
                else _mm256_storeu_si256((__m256i *)(dst + 32 * j), data);
            }
        }
        if (dst && nt) TRACT_STREAMED(dst, 64);
        if (dst) dst += 64;
    }
    _mm256_storeu_si256((__m256i *)acc64, acc[0]);
    _mm256_storeu_si256((__m256i *)(acc64 + 4), acc[1]);
}
#endif

#ifdef TRACT_X86
/* The same with AVX-512: one register per stripe, two stripes a round into
 * two accumulators (their sum is the one accumulator: the lanes only add
 * within a block of stripes), dst 64-aligned when nt. */
__attribute__((target("avx512f")))
static inline __m512i tract_xxh3_mix512(__m512i data, const unsigned char *key)
{
    __m512i mixed = _mm512_xor_si512(data, _mm512_loadu_si512((const void *)key));
    __m512i product = _mm512_mul_epu32(mixed, _mm512_shuffle_epi32(mixed, (_MM_PERM_ENUM)0x31));
    return _mm512_add_epi64(product, _mm512_shuffle_epi32(data, (_MM_PERM_ENUM)0x4E));
}

__attribute__((target("avx512f")))
static void tract_xxh3_stripes_avx512(uint64_t acc64[8], const char *src,
                                      const unsigned char *key, size_t count, char *dst, int nt)
{
    __m512i acc = _mm512_loadu_si512((const void *)acc64), odd = _mm512_setzero_si512();
    size_t s = 0;
    for (; s + 2 <= count; s += 2, src += 128, key += 16) {
        _mm_prefetch(src + TRACT_XXH3_PREFETCH, _MM_HINT_T0);
        _mm_prefetch(src + TRACT_XXH3_PREFETCH + 64, _MM_HINT_T0);
        __m512i first = _mm512_loadu_si512((const void *)src);
        __m512i second = _mm512_loadu_si512((const void *)(src + 64));
        if (dst) {
            if (nt) {
                _mm512_stream_si512((void *)dst, first);
                _mm512_stream_si512((void *)(dst + 64), second);
                TRACT_STREAMED(dst, 128);
            } else {
                _mm512_storeu_si512((void *)dst, first);
                _mm512_storeu_si512((void *)(dst + 64), second);
            }
            dst += 128;
        }
        acc = _mm512_add_epi64(acc, tract_xxh3_mix512(first, key));
        odd = _mm512_add_epi64(odd, tract_xxh3_mix512(second, key + 8));
    }
    if (s < count) {
        __m512i data = _mm512_loadu_si512((const void *)src);
        if (dst) {
            if (nt) {
                _mm512_stream_si512((void *)dst, data);
                TRACT_STREAMED(dst, 64);
            } else {
                _mm512_storeu_si512((void *)dst, data);
            }
        }
        acc = _mm512_add_epi64(acc, tract_xxh3_mix512(data, key));
    }
    _mm512_storeu_si512((void *)acc64, _mm512_add_epi64(acc, odd));
}
#endif

static inline uint64_t tract_fold128(uint64_t a, uint64_t b)
{
    __uint128_t product = (__uint128_t)a * b;
    return (uint64_t)product ^ (uint64_t)(product >> 64);
}

#ifdef TRACT_X86
static inline void tract_xxh3_stripes(int vector, uint64_t acc[8], const char *src,
                                      const unsigned char *key, size_t count, char *dst, int nt)
{
    if (vector == 2) tract_xxh3_stripes_avx512(acc, src, key, count, dst, nt);
    else tract_xxh3_stripes_avx2(acc, src, key, count, dst, nt);
}
#endif

/* XXH3-64 of src[0..n), n > 240; with dst, src is copied there as it is
 * hashed (nt: streaming stores, a last partial line written back with
 * `insn`; the caller's store fence puts it all in memory). */
static uint64_t tract_xxh3_copy(char *dst, const char *src, size_t n, uint64_t seed, int nt,
                                int insn, int vector)
{
    if (dst && nt && ((uintptr_t)dst & (TRACT_LINE - 1))) {
        /* not line-aligned: plain copies, then the whole range written back */
        uint64_t h = tract_xxh3_copy(dst, src, n, seed, 0, insn, vector);
        tract_lines(insn, dst, n);
        return h;
    }
    unsigned char secret[192];
    tract_xxh3_secret(secret, seed);
    uint64_t acc[8] = {TRACT_XXH3_P32_3, TRACT_P1, TRACT_P2, TRACT_P3, TRACT_P4,
                       TRACT_XXH3_P32_2, TRACT_P5, TRACT_XXH3_P32_1};
    const size_t per_block = (192 - 64) / 8, block = 64 * per_block;
    size_t blocks = (n - 1) / block, done = 0;
    for (size_t b = 0; b < blocks; b++) {
#ifdef TRACT_X86
        if (vector) {
            tract_xxh3_stripes(vector, acc, src + done, secret, per_block,
                               dst ? dst + done : NULL, nt);
            done += block;
        } else
#endif
        for (size_t s = 0; s < per_block; s++, done += 64)
            tract_xxh3_stripe(acc, src + done, secret + 8 * s, dst ? dst + done : NULL, nt);
        for (int i = 0; i < 8; i++) {
            acc[i] ^= acc[i] >> 47;
            acc[i] ^= tract_read64((const char *)secret + 192 - 64 + 8 * i);
            acc[i] *= TRACT_XXH3_P32_1;
        }
    }
    size_t stripes = ((n - 1) - block * blocks) / 64;
#ifdef TRACT_X86
    if (vector) {
        tract_xxh3_stripes(vector, acc, src + done, secret, stripes, dst ? dst + done : NULL, nt);
        done += 64 * stripes;
    } else
#endif
    for (size_t s = 0; s < stripes; s++, done += 64)
        tract_xxh3_stripe(acc, src + done, secret + 8 * s, dst ? dst + done : NULL, nt);
    tract_xxh3_stripe(acc, src + n - 64, secret + 192 - 64 - 7, NULL, 0);
    if (dst) {  /* the bytes past the last whole stripe: whole lines streamed too */
        size_t whole = nt && vector ? (n - done) & ~(size_t)(TRACT_LINE - 1) : 0;
#ifdef TRACT_X86
        if (whole && vector == 2) tract_stream_avx512(dst + done, src + done, whole);
        else if (whole) tract_stream_avx2(dst + done, src + done, whole);
#endif
        done += whole;
        memcpy(dst + done, src + done, n - done);
        if (nt) tract_lines(insn, dst + done, n - done);
    }
    uint64_t h = (uint64_t)n * TRACT_P1;
    for (int i = 0; i < 4; i++)
        h += tract_fold128(acc[2 * i] ^ tract_read64((const char *)secret + 11 + 16 * i),
                           acc[2 * i + 1] ^ tract_read64((const char *)secret + 11 + 16 * i + 8));
    h ^= h >> 37;
    h *= 0x165667919E3779F9ULL;
    return h ^ (h >> 32);
}

/* The digest of a payload piece: XXH3-64 above 240 bytes, XXH64 up to
 * that; with dst, src is copied there as it is hashed (see tract_xxh3_copy;
 * kind and insn as for tract_copy_in_nt when nt: the caller store-fences). */
static inline uint64_t tract_digest_copy(char *dst, const char *src, size_t n, uint64_t seed,
                                         int nt, int kind, int insn)
{
    int vector = kind == TRACT_NT_AVX512 ? 2 : kind == TRACT_NT_AVX2 ? 1 : 0;
    if (n > 240) {
        int stream = nt && kind != TRACT_NT_NONE;
        uint64_t h = tract_xxh3_copy(dst, src, n, seed, stream, insn, vector);
        if (dst && nt && !stream) tract_lines(insn, dst, n);  /* no streaming stores (R3) */
        return h;
    }
    if (!dst) return tract_xxh64(src, n, seed);
    if (nt) tract_stream_in(kind, insn, dst, src, n);
    else memcpy(dst, src, n);
    return tract_xxh64(nt ? src : dst, n, seed);
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
