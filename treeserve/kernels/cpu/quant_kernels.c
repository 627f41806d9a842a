/* CPU kernels for weights kept quantised: GGUF block formats and per-channel int8.
 *
 * A quantised matrix is `n` rows (output channels) of `k` weights; each row is `row_bytes`
 * bytes of blocks in llama.cpp's layouts (ggml-common.h): Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 hold
 * 32 weights a block, Q4_K, Q5_K, Q6_K hold 256. TYPE_I8 is ours: `k` int8 a row and one
 * fp32 scale a row (`row_scales`), symmetric, for Hugging Face checkpoints quantised at load.
 *
 * qmatmul: out[m, n] = x[m, k] . W[n, k]^T for any m. Output channels go in panels of NP:
 *   a thread dequantises a panel's rows into fp32 (a per-thread, L1/L2-resident buffer), then
 *   multiplies every activation row with them, NP channels x MR rows of 16-lane fp32
 *   accumulators at a time. At one row this streams the quantised bytes once (the GEMV of a
 *   decode step); at many rows each dequantised panel is reused by all of them (the GEMM of
 *   beam search and prefill). Every (row, channel) result is accumulated in one fixed order
 *   (16 lanes along k, then the lanes summed in order), whatever m and the tiling: a row's
 *   result never depends on the batch around it.
 * dequant_rows: selected rows to fp32 (embedding lookups; the reference path's dequantise).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

enum { T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14,
       T_I8 = 1000 };

typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));

#if defined(__F16C__)
#include <immintrin.h>
static inline float fp16_to_f32(const uint8_t *p) { return _cvtsh_ss((unsigned short)(p[0] | (p[1] << 8))); }
#else
static inline float fp16_to_f32(const uint8_t *p) {
    uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (mant << 13);
    } else if (mant == 0) {
        bits = sign;
    } else { /* subnormal: normalise */
        exp = 113;
        while (!(mant & 0x400)) { mant <<= 1; exp--; }
        bits = sign | (exp << 23) | ((mant & 0x3ff) << 13);
    }
    union { uint32_t u; float f; } v = {bits};
    return v.f;
}
#endif

static inline void scale_min_k4(int j, const uint8_t *q, int *sc, int *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* deq_T: weights c*32 .. c*32+31 of a row into w[32]. With AVX-512 (BW) the common formats
 * unpack 32 weights into two 16-lane vectors; the portable loops below are the fallback. */
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define HAVE_AVX512_DEQUANT 1

static inline void store32(float *w, __m512i lo, __m512i hi, __m512 d) {
    _mm512_store_ps(w, _mm512_mul_ps(_mm512_cvtepi32_ps(lo), d));
    _mm512_store_ps(w + 16, _mm512_mul_ps(_mm512_cvtepi32_ps(hi), d));
}

static inline void deq_Q8_0(const uint8_t *row, int64_t c, float row_scale, float *restrict w) {
    const uint8_t *b = row + c * 34;
    const __m512 d = _mm512_set1_ps(fp16_to_f32(b));
    store32(w, _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 2))),
            _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 18))), d);
}

static inline void deq_I8(const uint8_t *row, int64_t c, float row_scale, float *restrict w) {
    const uint8_t *b = row + c * 32;
    store32(w, _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)b)),
            _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 16))), _mm512_set1_ps(row_scale));
}

static inline void deq_Q4_0(const uint8_t *row, int64_t c, float row_scale, float *restrict w) {
    const uint8_t *b = row + c * 18;
    const __m128i q = _mm_loadu_si128((const __m128i *)(b + 2)), low4 = _mm_set1_epi8(0xF);
    const __m512i eight = _mm512_set1_epi32(8);
    store32(w, _mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm_and_si128(q, low4)), eight),
            _mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(q, 4), low4)), eight),
            _mm512_set1_ps(fp16_to_f32(b)));
}

static inline void deq_Q5_0(const uint8_t *row, int64_t c, float row_scale, float *restrict w) {
    const uint8_t *b = row + c * 22;
    uint32_t qh;
    memcpy(&qh, b + 2, 4);
    const __m128i q = _mm_loadu_si128((const __m128i *)(b + 6)), low4 = _mm_set1_epi8(0xF);
    const __m512i sixteen = _mm512_set1_epi32(16);
    __m512i lo = _mm512_cvtepu8_epi32(_mm_and_si128(q, low4));
    __m512i hi = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(q, 4), low4));
    lo = _mm512_mask_or_epi32(lo, (__mmask16)(qh & 0xFFFF), lo, sixteen);
    hi = _mm512_mask_or_epi32(hi, (__mmask16)(qh >> 16), hi, sixteen);
    store32(w, _mm512_sub_epi32(lo, sixteen), _mm512_sub_epi32(hi, sixteen), _mm512_set1_ps(fp16_to_f32(b)));
}

static inline void deq_Q4_K(const uint8_t *row, int64_t c, float row_scale, float *restrict w) {
    const uint8_t *b = row + (c >> 3) * 144;
    const int s = (int)(c & 7);
    int sc, mn;
    scale_min_k4(s, b + 4, &sc, &mn);
    const __m512 d = _mm512_set1_ps(fp16_to_f32(b) * sc), m = _mm512_set1_ps(fp16_to_f32(b + 2) * mn);
    __m256i q = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * (s >> 1)));
    if (s & 1) q = _mm256_srli_epi16(q, 4);
    q = _mm256_and_si256(q, _mm256_set1_epi8(0xF));
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(q)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(q, 1)));
    _mm512_store_ps(w, _mm512_sub_ps(_mm512_mul_ps(d, lo), m));
    _mm512_store_ps(w + 16, _mm512_sub_ps(_mm512_mul_ps(d, hi), m));
}

static inline void deq_Q6_K(const uint8_t *row, int64_t c, float row_scale, float *restrict w) {
    const uint8_t *b = row + (c >> 3) * 210;
    const int half = (int)(c & 7) >> 2, quarter = (int)(c & 3);
    const int8_t *sc = (const int8_t *)(b + 192) + 8 * half + 2 * quarter;
    const float d = fp16_to_f32(b + 208);
    __m256i ql = _mm256_loadu_si256((const __m256i *)(b + 64 * half + 32 * (quarter & 1)));
    __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * half));
    if (quarter >> 1) ql = _mm256_srli_epi16(ql, 4);
    qh = _mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * quarter));
    const __m256i q = _mm256_or_si256(_mm256_and_si256(ql, _mm256_set1_epi8(0xF)),
                                      _mm256_slli_epi16(_mm256_and_si256(qh, _mm256_set1_epi8(3)), 4));
    const __m512i thirty_two = _mm512_set1_epi32(32);
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(q)), thirty_two));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(q, 1)), thirty_two));
    _mm512_store_ps(w, _mm512_mul_ps(_mm512_set1_ps(d * sc[0]), lo));
    _mm512_store_ps(w + 16, _mm512_mul_ps(_mm512_set1_ps(d * sc[1]), hi));
}
#endif

#ifndef HAVE_AVX512_DEQUANT
static inline void deq_Q8_0(const uint8_t *row, int64_t c, float row_scale, float *restrict w) {
    const uint8_t *b = row + c * 34;
    const float d = fp16_to_f32(b);
    const int8_t *q = (const int8_t *)(b + 2);
    for (int l = 0; l < 32; l++) w[l] = d * q[l];
}
#endif

#ifndef HAVE_AVX512_DEQUANT
static inline void deq_Q4_0(const uint8_t *row, int64_t c, float row_scale, float *restrict w) {
    const uint8_t *b = row + c * 18;
    const float d = fp16_to_f32(b);
    for (int l = 0; l < 16; l++) {
        w[l] = d * ((b[2 + l] & 0xF) - 8);
        w[l + 16] = d * ((b[2 + l] >> 4) - 8);
    }
}
#endif

static inline void deq_Q4_1(const uint8_t *row, int64_t c, float row_scale, float *restrict w) {
    const uint8_t *b = row + c * 20;
    const float d = fp16_to_f32(b), m = fp16_to_f32(b + 2);
    for (int l = 0; l < 16; l++) {
        w[l] = d * (b[4 + l] & 0xF) + m;
        w[l + 16] = d * (b[4 + l] >> 4) + m;
    }
}

#ifndef HAVE_AVX512_DEQUANT
static inline void deq_Q5_0(const uint8_t *row, int64_t c, float row_scale, float *restrict w) {
    const uint8_t *b = row + c * 22;
    const float d = fp16_to_f32(b);
    uint32_t qh;
    memcpy(&qh, b + 2, 4);
    for (int l = 0; l < 16; l++) {
        const int h0 = ((qh >> l) << 4) & 0x10, h1 = (qh >> (l + 12)) & 0x10;
        w[l] = d * (((b[6 + l] & 0xF) | h0) - 16);
        w[l + 16] = d * (((b[6 + l] >> 4) | h1) - 16);
    }
}
#endif

static inline void deq_Q5_1(const uint8_t *row, int64_t c, float row_scale, float *restrict w) {
    const uint8_t *b = row + c * 24;
    const float d = fp16_to_f32(b), m = fp16_to_f32(b + 2);
    uint32_t qh;
    memcpy(&qh, b + 4, 4);
    for (int l = 0; l < 16; l++) {
        const int h0 = ((qh >> l) << 4) & 0x10, h1 = (qh >> (l + 12)) & 0x10;
        w[l] = d * ((b[8 + l] & 0xF) | h0) + m;
        w[l + 16] = d * ((b[8 + l] >> 4) | h1) + m;
    }
}

#ifndef HAVE_AVX512_DEQUANT
/* d, dmin, scales[12], qs[128]; sub-block s of 8 uses nibble s%2 of qs[32*(s/2)..] */
static inline void deq_Q4_K(const uint8_t *row, int64_t c, float row_scale, float *restrict w) {
    const uint8_t *b = row + (c >> 3) * 144;
    const int s = (int)(c & 7);
    int sc, mn;
    scale_min_k4(s, b + 4, &sc, &mn);
    const float d = fp16_to_f32(b) * sc, m = fp16_to_f32(b + 2) * mn;
    const uint8_t *q = b + 16 + 32 * (s >> 1);
    const int shift = 4 * (s & 1);
    for (int l = 0; l < 32; l++) w[l] = d * ((q[l] >> shift) & 0xF) - m;
}
#endif

/* d, dmin, scales[12], qh[32], qs[128]; the 5th bit of sub-block s is bit s of qh[l] */
static inline void deq_Q5_K(const uint8_t *row, int64_t c, float row_scale, float *restrict w) {
    const uint8_t *b = row + (c >> 3) * 176;
    const int s = (int)(c & 7);
    int sc, mn;
    scale_min_k4(s, b + 4, &sc, &mn);
    const float d = fp16_to_f32(b) * sc, m = fp16_to_f32(b + 2) * mn;
    const uint8_t *qh = b + 16, *q = b + 48 + 32 * (s >> 1);
    const int shift = 4 * (s & 1);
    for (int l = 0; l < 32; l++) w[l] = d * (((q[l] >> shift) & 0xF) | (((qh[l] >> s) & 1) << 4)) - m;
}

#ifndef HAVE_AVX512_DEQUANT
/* ql[128], qh[64], int8 scales[16], d; halves of 128, quarters of 32 */
static inline void deq_Q6_K(const uint8_t *row, int64_t c, float row_scale, float *restrict w) {
    const uint8_t *b = row + (c >> 3) * 210;
    const int half = (int)(c & 7) >> 2, quarter = (int)(c & 3);
    const uint8_t *ql = b + 64 * half + 32 * (quarter & 1), *qh = b + 128 + 32 * half;
    const int8_t *sc = (const int8_t *)(b + 192) + 8 * half + 2 * quarter;
    const float d = fp16_to_f32(b + 208);
    const int lshift = 4 * (quarter >> 1), hshift = 2 * quarter;
    const float d0 = d * sc[0], d1 = d * sc[1];
    for (int l = 0; l < 32; l++) {
        const int q = (((ql[l] >> lshift) & 0xF) | (((qh[l] >> hshift) & 3) << 4)) - 32;
        w[l] = (l < 16 ? d0 : d1) * q;
    }
}
#endif

#ifndef HAVE_AVX512_DEQUANT
static inline void deq_I8(const uint8_t *row, int64_t c, float row_scale, float *restrict w) {
    const int8_t *q = (const int8_t *)row + c * 32;
    for (int l = 0; l < 32; l++) w[l] = row_scale * q[l];
}
#endif

#define ROW_LOOP(T) for (int64_t c = 0; c < k / 32; c++) deq_##T(row, c, row_scale, out + c * 32); break

static void dequant_row(int type, const uint8_t *row, int64_t k, float row_scale, float *restrict out) {
    switch (type) { /* once a row, so each type's loop is compiled (and vectorised) on its own */
    case T_Q4_0: ROW_LOOP(Q4_0);
    case T_Q4_1: ROW_LOOP(Q4_1);
    case T_Q5_0: ROW_LOOP(Q5_0);
    case T_Q5_1: ROW_LOOP(Q5_1);
    case T_Q8_0: ROW_LOOP(Q8_0);
    case T_Q4_K: ROW_LOOP(Q4_K);
    case T_Q5_K: ROW_LOOP(Q5_K);
    case T_Q6_K: ROW_LOOP(Q6_K);
    case T_I8: ROW_LOOP(I8);
    }
}

void dequant_rows(int type, const uint8_t *w, int64_t row_bytes, const float *row_scales, const int64_t *ids,
                  int64_t count, int64_t k, float *out, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t i = 0; i < count; i++) {
        const int64_t r = ids[i];
        dequant_row(type, w + r * row_bytes, k, row_scales ? row_scales[r] : 0.0f, out + i * k);
    }
}

static inline float hsum(v16 a) { /* fixed order: the same for every row and channel */
    float s = 0.0f;
    for (int i = 0; i < 16; i++) s += a[i];
    return s;
}

#define NP 4 /* output channels a panel */

/* Rows r0..r0+mr-1 against the NP channels of one dequantised panel (wp: NP x k fp32);
 * mr is a constant at each call, so the NP x mr accumulators live in registers. */
static inline __attribute__((always_inline)) void panel_rows(const float *wp, int64_t k, const float *x,
                                                             int64_t x_stride, int r0, int mr, float *res) {
    v16 acc[NP][4];
    for (int c = 0; c < NP; c++)
        for (int r = 0; r < mr; r++) acc[c][r] = (v16){0};
    for (int64_t kk = 0; kk < k; kk += 16) {
        v16 xv[4];
        for (int r = 0; r < mr; r++) xv[r] = *(const v16u *)(x + (r0 + r) * x_stride + kk);
        for (int c = 0; c < NP; c++) {
            const v16 wv = *(const v16 *)(wp + c * k + kk);
            for (int r = 0; r < mr; r++) acc[c][r] += wv * xv[r];
        }
    }
    for (int c = 0; c < NP; c++)
        for (int r = 0; r < mr; r++) res[r * NP + c] = hsum(acc[c][r]);
}

typedef void (*deq_fn)(const uint8_t *, int64_t, float, float *restrict);

/* The same products and sums as dequant_row + panel_rows, without the panel: each 32-weight
 * chunk of the NP channels is unpacked into registers (a stack buffer the compiler keeps hot)
 * and used at once. For a few rows, where one pass over the weights is the whole cost. */
static inline __attribute__((always_inline)) void fused_rows(deq_fn deq, const uint8_t *const *rows,
                                                             const float *scales, int64_t k, const float *x,
                                                             int64_t x_stride, int mr, float *res) {
    v16 acc[NP][4];
    float wb[NP][32] __attribute__((aligned(64)));
    for (int c = 0; c < NP; c++)
        for (int r = 0; r < mr; r++) acc[c][r] = (v16){0};
    for (int64_t kc = 0; kc < k / 32; kc++) {
        for (int c = 0; c < NP; c++) deq(rows[c], kc, scales[c], wb[c]);
        for (int h = 0; h < 2; h++) {
            v16 xv[4];
            for (int r = 0; r < mr; r++) xv[r] = *(const v16u *)(x + r * x_stride + kc * 32 + h * 16);
            for (int c = 0; c < NP; c++) {
                const v16 wv = *(const v16 *)(wb[c] + h * 16);
                for (int r = 0; r < mr; r++) acc[c][r] += wv * xv[r];
            }
        }
    }
    for (int c = 0; c < NP; c++)
        for (int r = 0; r < mr; r++) res[r * NP + c] = hsum(acc[c][r]);
}

/* One switch over formats and row counts for a fused-rows kernel F (mr is a constant at each
 * call, so its accumulators live in registers). */
#define FUSED_CASE(F, T)                                                            \
    case T_##T:                                                                     \
        switch (mr) {                                                               \
        case 4: F(deq_##T, rows, scales, k, x, x_stride, 4, res); break;            \
        case 3: F(deq_##T, rows, scales, k, x, x_stride, 3, res); break;            \
        case 2: F(deq_##T, rows, scales, k, x, x_stride, 2, res); break;            \
        default: F(deq_##T, rows, scales, k, x, x_stride, 1, res); break;           \
        }                                                                           \
        break
#define FUSED_SWITCH(F)                                                             \
    switch (type) {                                                                 \
        FUSED_CASE(F, Q4_0); FUSED_CASE(F, Q4_1); FUSED_CASE(F, Q5_0);              \
        FUSED_CASE(F, Q5_1); FUSED_CASE(F, Q8_0); FUSED_CASE(F, Q4_K);              \
        FUSED_CASE(F, Q5_K); FUSED_CASE(F, Q6_K); FUSED_CASE(F, I8);                \
    }

static void fused(int type, const uint8_t *const *rows, const float *scales, int64_t k, const float *x,
                  int64_t x_stride, int mr, float *res) {
    FUSED_SWITCH(fused_rows)
}

#if defined(HAVE_AVX512_DEQUANT) && defined(__AVX512BF16__)
/* bf16 activations (a bf16 model): the unpacked weights are rounded to bf16 (what a bf16 copy
 * of the dequantised matrix holds) and multiplied with AVX512-BF16 dot products (exact
 * products, fp32 sums): twice the multiplies an instruction of the fp32 path. Both paths
 * below round and add in the same order, so a row's result never depends on the batch. */
#define HAVE_BF16_DOT 1

static inline __m512bh bf16x32(const float *w) { /* 32 fp32 -> bf16, round to nearest even */
    return _mm512_cvtne2ps_pbh(_mm512_loadu_ps(w + 16), _mm512_loadu_ps(w));
}

static inline __m512bh load_bh(const uint16_t *p) { return (__m512bh)_mm512_loadu_si512(p); }

static inline __attribute__((always_inline)) void finish_bh(__m512 acc[NP][4], int mr, float *res) {
    for (int c = 0; c < NP; c++)
        for (int r = 0; r < mr; r++) res[r * NP + c] = _mm512_reduce_add_ps(acc[c][r]); /* a fixed tree */
}

static inline __attribute__((always_inline)) void panel_rows_bh(const uint16_t *wp, int64_t k, const uint16_t *x,
                                                                int64_t x_stride, int r0, int mr, float *res) {
    __m512 acc[NP][4];
    for (int c = 0; c < NP; c++)
        for (int r = 0; r < mr; r++) acc[c][r] = _mm512_setzero_ps();
    for (int64_t kk = 0; kk < k; kk += 32) {
        __m512bh xv[4];
        for (int r = 0; r < mr; r++) xv[r] = load_bh(x + (r0 + r) * x_stride + kk);
        for (int c = 0; c < NP; c++) {
            const __m512bh wv = load_bh(wp + c * k + kk);
            for (int r = 0; r < mr; r++) acc[c][r] = _mm512_dpbf16_ps(acc[c][r], wv, xv[r]);
        }
    }
    finish_bh(acc, mr, res);
}

static inline __attribute__((always_inline)) void fused_rows_bh(deq_fn deq, const uint8_t *const *rows,
                                                                const float *scales, int64_t k, const uint16_t *x,
                                                                int64_t x_stride, int mr, float *res) {
    __m512 acc[NP][4];
    float wb[NP][32] __attribute__((aligned(64)));
    for (int c = 0; c < NP; c++)
        for (int r = 0; r < mr; r++) acc[c][r] = _mm512_setzero_ps();
    for (int64_t kc = 0; kc < k / 32; kc++) {
        __m512bh xv[4];
        for (int r = 0; r < mr; r++) xv[r] = load_bh(x + r * x_stride + kc * 32);
        for (int c = 0; c < NP; c++) {
            deq(rows[c], kc, scales[c], wb[c]);
            const __m512bh wv = bf16x32(wb[c]);
            for (int r = 0; r < mr; r++) acc[c][r] = _mm512_dpbf16_ps(acc[c][r], wv, xv[r]);
        }
    }
    finish_bh(acc, mr, res);
}

static void fused_bh(int type, const uint8_t *const *rows, const float *scales, int64_t k, const uint16_t *x,
                     int64_t x_stride, int mr, float *res) {
    FUSED_SWITCH(fused_rows_bh)
}

/* The panel's channels as bf16 (from fp32 rows through the same rounding as fused_rows_bh). */
static void panel_to_bh(const float *wp, int64_t k, uint16_t *wpb) {
    for (int64_t i = 0; i < NP * k; i += 32) _mm512_storeu_si512(wpb + i, (__m512i)bf16x32(wp + i));
}

int bf16_dot_available(void) { return 1; }
#else
int bf16_dot_available(void) { return 0; }
#endif

#define FUSED_MAX_ROWS 4 /* up to here the weights are unpacked per use; above, once per panel */

/* A panel kernel F over rows r0..r0+mr-1, with mr a constant at each call. */
#define PANEL_MR(F, panel, rows_x)                                                  \
    switch (mr) {                                                                   \
    case 4: F(panel, k, rows_x, x_stride, r0, 4, res); break;                       \
    case 3: F(panel, k, rows_x, x_stride, r0, 3, res); break;                       \
    case 2: F(panel, k, rows_x, x_stride, r0, 2, res); break;                       \
    default: F(panel, k, rows_x, x_stride, r0, 1, res); break;                      \
    }

#define MAX_PARTS 8

/* out[m, n] (fp32, or bf16 when out_bf16) = x[m, k] (rows x_stride apart; fp32, or bf16 when
 * x_bf16, which needs bf16_dot_available()) . W^T (+ bias), W row-stacked from `parts`
 * matrices (a fused q/k/v or gate/up), each in its own format: part j is part_rows[j] rows of
 * row_bytes[j] bytes at ws[j] (scales[j]: int8's row scales). One parallel region covers every
 * part's panels. */
void qmatmul(int parts, const int *types, const uint8_t *const *ws, const int64_t *row_bytes,
             const float *const *row_scales, const int64_t *part_rows, int64_t k, const void *xv, int64_t x_stride,
             int m, const float *bias, void *out, int64_t out_stride, int out_bf16, int x_bf16, int threads) {
    const float *x = (const float *)xv;
    int64_t first_panel[MAX_PARTS + 1] = {0}, first_col[MAX_PARTS + 1] = {0};
    for (int j = 0; j < parts && j < MAX_PARTS; j++) {
        first_panel[j + 1] = first_panel[j] + (part_rows[j] + NP - 1) / NP;
        first_col[j + 1] = first_col[j] + part_rows[j];
    }
    const int64_t panels = first_panel[parts];
    #pragma omp parallel num_threads(threads)
    {
        float *wp = m > FUSED_MAX_ROWS ? (float *)aligned_alloc(64, sizeof(float) * NP * k) : NULL;
        uint16_t *wpb = wp && x_bf16 ? (uint16_t *)aligned_alloc(64, sizeof(uint16_t) * NP * k) : NULL;
        float res[4 * NP];
        #pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {
            int j = 0;
            while (p >= first_panel[j + 1]) j++;
            const int type = types[j];
            const int64_t n = part_rows[j], rb = row_bytes[j], c0 = (p - first_panel[j]) * NP;
            const int np = (int)(n - c0 < NP ? n - c0 : NP);
            const uint8_t *rows[NP];
            float scales[NP];
            for (int c = 0; c < NP; c++) { /* the last panel repeats its last channel; those results are dropped */
                const int64_t ch = c0 + (c < np ? c : np - 1);
                rows[c] = ws[j] + ch * rb;
                scales[c] = row_scales[j] ? row_scales[j][ch] : 0.0f;
                if (wp) dequant_row(type, rows[c], k, scales[c], wp + c * k);
            }
            if (!wp) /* a few rows: the bytes stream through once; ask for a later panel's early */
                for (int64_t at = 2 * NP * rb; at < 3 * NP * rb && c0 + 2 * NP < n; at += 64)
                    __builtin_prefetch(rows[0] + at);
            const int64_t col = first_col[j] + c0;
#ifdef HAVE_BF16_DOT
            if (wpb) panel_to_bh(wp, k, wpb);
#endif
            for (int r0 = 0; r0 < m; r0 += 4) {
                const int mr = m - r0 < 4 ? m - r0 : 4;
#ifdef HAVE_BF16_DOT
                const uint16_t *xb = (const uint16_t *)xv;
                if (x_bf16 && !wp) fused_bh(type, rows, scales, k, xb + r0 * x_stride, x_stride, mr, res);
                else if (x_bf16) PANEL_MR(panel_rows_bh, wpb, xb)
                else
#endif
                if (!wp) fused(type, rows, scales, k, x + r0 * x_stride, x_stride, mr, res);
                else PANEL_MR(panel_rows, wp, x)
                for (int r = 0; r < mr; r++)
                    for (int c = 0; c < np; c++) {
                        const float v = res[r * NP + c] + (bias ? bias[col + c] : 0.0f);
                        const int64_t at = (int64_t)(r0 + r) * out_stride + col + c;
                        if (out_bf16) ((uint16_t *)out)[at] = store_bf16(v);
                        else ((float *)out)[at] = v;
                    }
            }
        }
        free(wp);
        free(wpb);
    }
}

/* Per-channel symmetric int8 of an fp32 matrix [n, k]: scale = max|w| / 127, q = round(w / scale). */
void quantize_i8(const float *w, int64_t n, int64_t k, int8_t *q, float *scales, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < n; r++) {
        const float *row = w + r * k;
        float amax = 0.0f;
        for (int64_t i = 0; i < k; i++) amax = row[i] > amax ? row[i] : (-row[i] > amax ? -row[i] : amax);
        const float scale = amax / 127.0f, inv = scale > 0.0f ? 1.0f / scale : 0.0f;
        scales[r] = scale;
        for (int64_t i = 0; i < k; i++) {
            float v = row[i] * inv;
            v = v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v);
            q[r * k + i] = (int8_t)__builtin_roundf(v);
        }
    }
}
