/* A quantised panel's 32-weight chunk as a bf16 AMX tile, for amx_linear.c's amx_quant_matmul:
 * 16 channels' weights, each dequantised to fp32 as dequant.h computes it and rounded to bf16
 * (nearest even), as PyTorch's cast rounds. So the tiles hold, to the bit, the dequantised
 * matrix's bf16 weights. Row-stored formats become A tiles (tile row = one channel's 32 weights,
 * the order a dequantiser writes them); q8_kernels.c's laid-out Q8_0 panels, 4 weights of the 16
 * channels a line, become B tiles (tile row = 2 weights of each channel), or A tiles transposed.
 * Q5_0 and Q4_K, Gemma's commonest formats, look their weights up in a table of the block's
 * values (at most 32) instead of converting each. Only under amx_linear.c's AMX guard. */
#ifndef TREESERVE_TILE_DEQUANT_H
#define TREESERVE_TILE_DEQUANT_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "dequant.h"
#include "transpose.h"

#define PANEL 16 /* output channels a tile */
#define CHUNK 32 /* weights of k a tile product */
#define TILE (CHUNK * PANEL) /* bf16 values a weight tile */
#define PANELS 2000 /* + T_Q8_0: q8_kernels.c's laid-out Q8_0 panels */

/* Chunk c of a panel's 16 channels (rows[c], int8 row scales scales[c]) as a bf16 A tile at
 * dst: tile row ch holds channel ch's 32 weights, dequantised and rounded to bf16 (nearest
 * even), as PyTorch's cast rounds. */
static inline __attribute__((always_inline)) void tile_chunk(void (*deq)(const uint8_t *, int64_t, float, float *),
                                                             const uint8_t *const *rows, const float *scales,
                                                             int64_t c, bf16 *dst) {
    float f[CHUNK] __attribute__((aligned(64)));
    for (int ch = 0; ch < PANEL; ch++) {
        deq(rows[ch], c, scales[ch], f);
        _mm512_store_si512(dst + ch * CHUNK, (__m512i)_mm512_cvtne2ps_pbh(_mm512_load_ps(f + 16), _mm512_load_ps(f)));
    }
}

/* Chunk c of a laid-out Q8_0 panel (fp16 scales [k/32][16], then codes[k/4][16][4] ^ 0x80) as a
 * bf16 B tile: 4 consecutive weights of the 16 channels a 64-byte line, two tile rows a line.
 * Each weight is float(code ^ 0x80) * float(scale) as deq_Q8_0 computes it: here
 * fma(code, d, -128 d), exact as that product is. Panels stream from memory one after the
 * other: the line AHEAD bytes on is asked for (q8_kernels.c's PANEL_AHEAD). */
#define AHEAD 16384
static void tile_q8_0_chunk(const uint8_t *panel, int64_t k, int64_t c, bf16 *dst) {
    const uint16_t *half = (const uint16_t *)panel;
    const uint8_t *codes = panel + 2 * PANEL * (k / 32); /* after the scales: q8_kernels.c's panel_scale_bytes */
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(half + c * PANEL)));
    __m512 scale[4], shift[4]; /* quarter q of a line: channels 4q..4q+3, 4 weights each */
    for (int q = 0; q < 4; q++) {
        scale[q] = _mm512_permutexvar_ps(_mm512_set_epi32(4 * q + 3, 4 * q + 3, 4 * q + 3, 4 * q + 3, 4 * q + 2,
                                                          4 * q + 2, 4 * q + 2, 4 * q + 2, 4 * q + 1, 4 * q + 1,
                                                          4 * q + 1, 4 * q + 1, 4 * q, 4 * q, 4 * q, 4 * q), d);
        shift[q] = _mm512_mul_ps(scale[q], _mm512_set1_ps(-128.0f));
    }
    /* words [channel 0-7 x weight 0-3 | channels 8-15 x weight 0-3] -> (channel c: weights 0, 1) x16, then 2, 3 */
    const __m512i first = _mm512_set_epi16(61, 60, 57, 56, 53, 52, 49, 48, 45, 44, 41, 40, 37, 36, 33, 32,
                                           29, 28, 25, 24, 21, 20, 17, 16, 13, 12, 9, 8, 5, 4, 1, 0);
    const __m512i second = _mm512_add_epi16(first, _mm512_set1_epi16(2));
    for (int i = 0; i < 8; i++) {
        const uint8_t *line = codes + (c * 8 + i) * 64;
        _mm_prefetch((const char *)line + AHEAD, _MM_HINT_T1);
        __m512 w[4];
        for (int q = 0; q < 4; q++)
            w[q] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_load_si128((const __m128i *)(line + 16 * q)))),
                                   scale[q], shift[q]);
        const __m512i lo = (__m512i)_mm512_cvtne2ps_pbh(w[1], w[0]), hi = (__m512i)_mm512_cvtne2ps_pbh(w[3], w[2]);
        bf16 *row = dst + 2 * i * CHUNK;
        _mm512_store_si512(row, _mm512_permutex2var_epi16(lo, first, hi));
        _mm512_store_si512(row + CHUNK, _mm512_permutex2var_epi16(lo, second, hi));
    }
}

/* Q5_0 and Q4_K chunks the short way: a block's weights take at most 32 values (d * (q - 16);
 * d * sc * q - dmin * m), so a channel's chunk is one table of those values, computed as
 * deq_T computes them and rounded to bf16, looked up by its codes (VPERMW): the same bits. */
static void tile_q5_0_chunk(const uint8_t *const *rows, int64_t c, bf16 *dst) {
    const __m512 low = _mm512_set_ps(-1, -2, -3, -4, -5, -6, -7, -8, -9, -10, -11, -12, -13, -14, -15, -16);
    const __m512 high = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m256i nibble = _mm256_set1_epi16(0xF);
    for (int ch = 0; ch < PANEL; ch++) {
        const uint8_t *b = rows[ch] + c * 22;
        uint32_t qh;
        memcpy(&qh, b + 2, 4);
        const __m512 d = _mm512_set1_ps(fp16_to_f32(b));
        const __m512i table = (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(d, high), _mm512_mul_ps(d, low));
        const __m256i q = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(b + 6)));
        __m512i code = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(q, nibble)), _mm256_srli_epi16(q, 4), 1);
        code = _mm512_mask_add_epi16(code, (__mmask32)qh, code, _mm512_set1_epi16(16));
        _mm512_store_si512(dst + ch * CHUNK, _mm512_permutexvar_epi16(code, table));
    }
}

static void tile_q4_k_chunk(const uint8_t *const *rows, int64_t c, bf16 *dst) {
    const __m512 codes = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const int s = (int)(c & 7);
    for (int ch = 0; ch < PANEL; ch++) {
        const uint8_t *b = rows[ch] + (c >> 3) * 144;
        float ds, ms;
        k_scale_min(b, s, &ds, &ms);
        const __m512 d = _mm512_set1_ps(ds), m = _mm512_set1_ps(ms);
        const __m512i table = (__m512i)_mm512_cvtne2ps_pbh(d, _mm512_sub_ps(_mm512_mul_ps(d, codes), m));
        __m256i q = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * (s >> 1)));
        if (s & 1) q = _mm256_srli_epi16(q, 4);
        const __m512i code = _mm512_and_si512(_mm512_cvtepu8_epi16(q), _mm512_set1_epi16(0xF));
        _mm512_store_si512(dst + ch * CHUNK, _mm512_permutexvar_epi16(code, table));
    }
}

#define TILE_CASE(T) case T_##T: tile_chunk(deq_##T, rows, scales, c, dst); break

/* Chunk c of a panel of any format (rows: its channels' rows, or rows[0] a laid-out panel) as an
 * A tile, or, `b_tile` (laid-out Q8_0 only), a B tile. */
static void tile_any(int type, const uint8_t *const *rows, const float *scales, int64_t k, int64_t c, int b_tile,
                     bf16 *dst) {
    switch (type) {
        TILE_CASE(Q4_0); TILE_CASE(Q4_1); TILE_CASE(Q5_1); TILE_CASE(Q8_0); TILE_CASE(Q5_K); TILE_CASE(Q6_K);
        TILE_CASE(I8);
        case T_Q5_0: tile_q5_0_chunk(rows, c, dst); break;
        case T_Q4_K: tile_q4_k_chunk(rows, c, dst); break;
        case PANELS + T_Q8_0:
            tile_q8_0_chunk(rows[0], k, c, dst);
            if (!b_tile) {
                __m512i r[PANEL];
                for (int i = 0; i < PANEL; i++) r[i] = _mm512_load_si512(dst + i * CHUNK);
                transpose16(r);
                for (int i = 0; i < PANEL; i++) _mm512_store_si512(dst + i * CHUNK, r[i]);
            }
            break;
    }
}

#endif
