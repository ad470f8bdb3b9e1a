/* Standalone check of _cachectl.h, compiled by tests/test_native_build.py
 * once for the x86 path and once with TRACT_CACHECTL_PORTABLE, so the
 * portable path builds and runs on x86 CI and cannot rot.  Exits non-zero
 * and names the case on any mismatch. */
#include <stdio.h>
#include <stdlib.h>
#include "_cachectl.h"

static const size_t sizes[] = {0, 1, 63, 64, 65, 4095, 4096, (2u << 20) - 1, 2u << 20,
                               (2u << 20) + 1};
static const size_t offsets[] = {0, 1, 7, 63, 64, 4095};

int main(void)
{
    size_t cap = (2u << 20) + 8192 + 128;
    unsigned char *src = malloc(cap), *dst = aligned_alloc(4096, cap);
    if (!src || !dst) return 2;
    for (size_t i = 0; i < cap; i++) src[i] = (unsigned char)(i * 131 + 7);
    int features = tract_cpu_features();
    int kinds[] = {TRACT_NT_NONE, TRACT_NT_SSE2, TRACT_NT_AVX2, TRACT_NT_AVX512};
    int needs[] = {0, TRACT_HAS_SSE2, TRACT_HAS_AVX2, TRACT_HAS_AVX512F};
    int insn = (features & TRACT_HAS_CLFLUSH) ? TRACT_INSN_CLFLUSH
             : (features & TRACT_HAS_DC) ? TRACT_INSN_DC_CIVAC : TRACT_INSN_NONE;
    int checked = 0;
    for (int k = 0; k < 4; k++) {
        if (needs[k] && !(features & needs[k])) continue;
        for (size_t s = 0; s < sizeof sizes / sizeof *sizes; s++)
            for (size_t o = 0; o < sizeof offsets / sizeof *offsets; o++) {
                size_t n = sizes[s], off = offsets[o];
                memset(dst, 0x5a, cap);
                tract_copy_in_nt(kinds[k], insn, (char *)dst + off, (const char *)src, n);
                tract_lines(insn, (const char *)dst, cap);
                tract_fence();
                if (memcmp(dst + off, src, n)) {
                    printf("FAIL kind %d size %zu offset %zu: bytes differ\n", kinds[k], n, off);
                    return 1;
                }
                for (size_t i = 0; i < off; i++)
                    if (dst[i] != 0x5a) { printf("FAIL kind %d: wrote before\n", kinds[k]); return 1; }
                for (size_t i = off + n; i < cap; i++)
                    if (dst[i] != 0x5a) { printf("FAIL kind %d: wrote after\n", kinds[k]); return 1; }
                checked++;
            }
    }
    tract_store_fence();
    tract_load_fence();
    printf("ok %s features %#x cases %d\n", TRACT_BUILD_PATH, features, checked);
    free(src);
    free(dst);
    return 0;
}
