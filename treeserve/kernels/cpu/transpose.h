/* A 16 x 16 transpose of 32-bit lanes in AVX-512 registers: how the quantised kernels turn 16
 * channels' rows of weights into the channel-interleaved order their products read (q8_kernels.c's
 * panels, amx_linear.c's bf16 tiles). Only under __AVX512F__. */
#ifndef TREESERVE_TRANSPOSE_H
#define TREESERVE_TRANSPOSE_H
#include <immintrin.h>

/* 16 x 16 dwords: in[c] holds 16 dwords of channel c; out[i] gets dword i of every channel. */
static inline void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    /* now r[4a+j] holds, in each 128-bit lane L, dword j of channels 4a..4a+3 of source lane L */
    for (int i = 0; i < 4; i++) {
        const __m512i a = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88), b = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xDD);
        const __m512i c = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88), d = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xDD);
        t[i] = _mm512_shuffle_i32x4(a, c, 0x88);      /* source lane 0 */
        t[i + 4] = _mm512_shuffle_i32x4(b, d, 0x88);  /* source lane 1 */
        t[i + 8] = _mm512_shuffle_i32x4(a, c, 0xDD);  /* source lane 2 */
        t[i + 12] = _mm512_shuffle_i32x4(b, d, 0xDD); /* source lane 3 */
    }
    for (int i = 0; i < 16; i++) r[i] = t[i];
}

#endif
