/* Quantised weights times 8-bit activations: llama.cpp's way of multiplying GGUF blocks.
 *
 * q8_matmul computes out[m, n] = x[m, k] . W[n, k]^T like quant_kernels.c's qmatmul, but first
 * rounds each activation row to int8 in blocks of 32 (scale = max|x| / 127 a block, as ggml's
 * Q8_0), then multiplies integers: AVX512-VNNI `vpdpbusd` takes 64 unsigned weight codes and 64
 * signed activations and sums each 4 products into an int32 lane. Every format is unpacked to
 * 64 unsigned codes u with a float scale a per lane (and, for Q4_K, a float offset b per lane):
 *     w = a * (u - off) + b,   off in {0, 8, 16, 32, 128} per format.
 * The `- off` is folded into the integer accumulator's start value (-off * the lane's activation
 * sum, computed once a row), the min term b through the lane's float activation sum. So a weight
 * is never turned into a float, which is what bounds the float-activation kernels at one row.
 *
 * Results: the dequantised matrix times the int8-rounded activations, up to float summation
 * order; each row is rounded, accumulated and reduced in one fixed order whatever m, the tiling
 * and the threads, so a row's result never depends on the batch around it.
 * Formats: Q4_0, Q5_0, Q8_0, Q4_K, Q6_K and our per-channel int8; k a multiple of 64 (and of the
 * format's block). The caller checks `q8_available()` and the formats (quant.py).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { T_Q4_0 = 2, T_Q5_0 = 6, T_Q8_0 = 8, T_Q4_K = 12, T_Q6_K = 14, T_I8 = 1000 };

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__F16C__)
#include <immintrin.h>

int q8_available(void) { return 1; }

static inline float fp16(const uint8_t *p) { return _cvtsh_ss((unsigned short)(p[0] | (p[1] << 8))); }

/* One 64-weight group of a channel: codes, per-lane scale and (Q4_K) per-lane offset. */
typedef struct {
    __m512i u;
    __m512 a, b;
} group;

static inline __m512 two(float lo, float hi) { /* lanes 0-7 = lo, 8-15 = hi */
    return _mm512_insertf32x8(_mm512_set1_ps(lo), _mm256_set1_ps(hi), 1);
}

static inline __m512i halves(__m256i lo, __m256i hi) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

/* 32 nibbles of two 16-byte blocks -> [a low, a high, b low, b high] (the Q4_0/Q5_0 weight order) */
static inline __m512i nibbles2(const uint8_t *a, const uint8_t *b) {
    const __m256i q = _mm256_set_m128i(_mm_loadu_si128((const __m128i *)b), _mm_loadu_si128((const __m128i *)a));
    const __m256i f = _mm256_set1_epi8(0xF);
    const __m512i z = halves(_mm256_and_si256(q, f), _mm256_and_si256(_mm256_srli_epi16(q, 4), f));
    return _mm512_shuffle_i64x2(z, z, _MM_SHUFFLE(3, 1, 2, 0));
}

static inline group g_Q8_0(const uint8_t *row, int64_t g, float rs) {
    const uint8_t *b0 = row + 2 * g * 34, *b1 = b0 + 34;
    const __m512i q = halves(_mm256_loadu_si256((const __m256i *)(b0 + 2)), _mm256_loadu_si256((const __m256i *)(b1 + 2)));
    return (group){_mm512_xor_si512(q, _mm512_set1_epi8((char)0x80)), two(fp16(b0), fp16(b1))};
}

static inline group g_I8(const uint8_t *row, int64_t g, float rs) {
    const __m512i q = _mm512_loadu_si512(row + 64 * g);
    return (group){_mm512_xor_si512(q, _mm512_set1_epi8((char)0x80)), _mm512_set1_ps(rs)};
}

static inline group g_Q4_0(const uint8_t *row, int64_t g, float rs) {
    const uint8_t *b0 = row + 2 * g * 18, *b1 = b0 + 18;
    return (group){nibbles2(b0 + 2, b1 + 2), two(fp16(b0), fp16(b1))};
}

static inline group g_Q5_0(const uint8_t *row, int64_t g, float rs) {
    const uint8_t *b0 = row + 2 * g * 22, *b1 = b0 + 22;
    uint32_t h0, h1;
    memcpy(&h0, b0 + 2, 4);
    memcpy(&h1, b1 + 2, 4);
    const __m512i u = nibbles2(b0 + 6, b1 + 6);
    const __mmask64 high = (__mmask64)h0 | ((__mmask64)h1 << 32); /* bit i: the 5th bit of weight i */
    return (group){_mm512_mask_add_epi8(u, high, u, _mm512_set1_epi8(16)), two(fp16(b0), fp16(b1))};
}

/* d, dmin, scales[12], qs[128]: group j of a super-block is sub-blocks 2j (low nibbles of
 * qs[32j..]) and 2j+1 (high nibbles), each with a 6-bit scale and min. */
static inline void scale_min_k4(int j, const uint8_t *q, int *sc, int *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

static inline group g_Q4_K(const uint8_t *row, int64_t g, float rs) {
    const uint8_t *b = row + (g >> 2) * 144;
    const int j = (int)(g & 3);
    int s0, m0, s1, m1;
    scale_min_k4(2 * j, b + 4, &s0, &m0);
    scale_min_k4(2 * j + 1, b + 4, &s1, &m1);
    const float d = fp16(b), dmin = fp16(b + 2);
    const __m256i q = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * j)), f = _mm256_set1_epi8(0xF);
    return (group){halves(_mm256_and_si256(q, f), _mm256_and_si256(_mm256_srli_epi16(q, 4), f)),
                   two(d * s0, d * s1), two(-dmin * m0, -dmin * m1)};
}

/* ql[128], qh[64], int8 scales[16], d: group j is half j/2, quarters 2(j%2) and 2(j%2)+1; a
 * quarter's 32 weights take ql's nibbles (low for quarters 0-1) and 2 bits of qh; 16 weights a scale. */
static inline group g_Q6_K(const uint8_t *row, int64_t g, float rs) {
    const uint8_t *b = row + (g >> 2) * 210;
    const int j = (int)(g & 3), half = j >> 1, q0 = 2 * (j & 1);
    __m512i lo = _mm512_loadu_si512(b + 64 * half);
    if (j & 1) lo = _mm512_srli_epi16(lo, 4);
    lo = _mm512_and_si512(lo, _mm512_set1_epi8(0xF));
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * half));
    __m512i hi = halves(_mm256_srli_epi16(qh, 2 * q0), _mm256_srli_epi16(qh, 2 * q0 + 2));
    hi = _mm512_slli_epi16(_mm512_and_si512(hi, _mm512_set1_epi8(3)), 4);
    const int8_t *sc = (const int8_t *)(b + 192) + 8 * half + 2 * q0;
    const __m128 s4 = _mm_mul_ps(_mm_set1_ps(fp16(b + 208)), _mm_cvtepi32_ps(_mm_cvtepi8_epi32(_mm_cvtsi32_si128(*(const int *)sc))));
    const __m512 a = _mm512_permutexvar_ps(_mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0),
                                           _mm512_castps128_ps512(s4));
    return (group){_mm512_or_si512(lo, hi), a};
}

/* Activation rows rounded to int8 in blocks of 32, with what the kernels need per int32 lane
 * (4 activations): the block's scale, minus the lane's code sum, and scale x code sum. */
typedef struct {
    int8_t *q;     /* [m][k] codes */
    float *d;      /* [m][k/4] block scale of each lane */
    int32_t *neg;  /* [m][k/4] -(sum of the lane's 4 codes) */
    float *sum;    /* [m][k/4] block scale * the lane's code sum */
} acts;

static void quantize_row(const void *xv, int bf16, int64_t k, int8_t *q, float *d, int32_t *neg, float *sum) {
    float x[32] __attribute__((aligned(64)));
    for (int64_t b = 0; b < k / 32; b++) {
        for (int i = 0; i < 32; i++) {
            if (bf16) {
                const uint32_t bits = (uint32_t)((const uint16_t *)xv)[b * 32 + i] << 16;
                memcpy(&x[i], &bits, 4);
            } else {
                x[i] = ((const float *)xv)[b * 32 + i];
            }
        }
        float amax = 0.0f;
        for (int i = 0; i < 32; i++) amax = __builtin_fabsf(x[i]) > amax ? __builtin_fabsf(x[i]) : amax;
        const float scale = amax / 127.0f, inv = scale > 0.0f ? 1.0f / scale : 0.0f;
        for (int i = 0; i < 32; i++) q[b * 32 + i] = (int8_t)__builtin_nearbyintf(x[i] * inv);
        for (int l = 0; l < 8; l++) {
            const int8_t *c = q + b * 32 + 4 * l;
            const int32_t s = c[0] + c[1] + c[2] + c[3];
            d[b * 8 + l] = scale;
            neg[b * 8 + l] = -s;
            sum[b * 8 + l] = scale * (float)s;
        }
    }
}

#define NP 4 /* output channels a panel */
#define MR 4 /* activation rows a tile */
#ifndef PF_BYTES
#define PF_BYTES 4096
#endif

/* Rows x.*[r0 .. r0+mr) against NP channels; `unpack`, `shift` (log2 off, or -1 for none) and
 * `with_min` are constants at each call, so the NP x mr accumulators live in registers. The
 * channels' groups come from `unpacked` (the panel unpacked once, for many rows) or are
 * unpacked as they are used (a few rows: one pass over the bytes); the arithmetic is the same. */
static inline __attribute__((always_inline)) void tile(group (*unpack)(const uint8_t *, int64_t, float), int shift,
                                                       int with_min, const uint8_t *const *rows, const float *scales,
                                                       int64_t k, const group *unpacked, acts x, int64_t r0, int mr,
                                                       int64_t row_bytes, int64_t ahead,
                                                       float *res) {
    __m512 acc[NP][MR];
    const int64_t step = row_bytes / (k / 64); /* a row's bytes a group */
    for (int c = 0; c < NP; c++)
        for (int r = 0; r < mr; r++) acc[c][r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < k / 64; g++) {
        __m512i xq[MR], start[MR];
        for (int r = 0; r < mr; r++) {
            const int64_t row = r0 + r;
            xq[r] = _mm512_loadu_si512(x.q + row * k + 64 * g);
            start[r] = shift < 0 ? _mm512_setzero_si512()
                                 : _mm512_slli_epi32(_mm512_loadu_si512(x.neg + row * (k / 4) + 16 * g), shift);
        }
        for (int c = 0; c < NP; c++) {
            if (ahead) _mm_prefetch((const char *)rows[c] + ahead + g * step, _MM_HINT_T0);
            const group w = unpacked ? unpacked[g * NP + c] : unpack(rows[c], g, scales[c]);
            for (int r = 0; r < mr; r++) {
                const int64_t lane = (r0 + r) * (k / 4) + 16 * g;
                const __m512i s = _mm512_dpbusd_epi32(start[r], w.u, xq[r]);
                const __m512 a = _mm512_mul_ps(w.a, _mm512_loadu_ps(x.d + lane));
                acc[c][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), a, acc[c][r]);
                if (with_min) acc[c][r] = _mm512_fmadd_ps(_mm512_loadu_ps(x.sum + lane), w.b, acc[c][r]);
            }
        }
    }
    for (int c = 0; c < NP; c++)
        for (int r = 0; r < mr; r++) res[r * NP + c] = _mm512_reduce_add_ps(acc[c][r]); /* a fixed tree */
}

#define TILE_CASE(T, SHIFT, MIN)                                                          \
    case T_##T:                                                                           \
        switch (mr) {                                                                     \
        case 4: tile(g_##T, SHIFT, MIN, rows, scales, k, unpacked, x, r0, 4, row_bytes, ahead, res); break;           \
        case 3: tile(g_##T, SHIFT, MIN, rows, scales, k, unpacked, x, r0, 3, row_bytes, ahead, res); break;           \
        case 2: tile(g_##T, SHIFT, MIN, rows, scales, k, unpacked, x, r0, 2, row_bytes, ahead, res); break;           \
        default: tile(g_##T, SHIFT, MIN, rows, scales, k, unpacked, x, r0, 1, row_bytes, ahead, res); break;          \
        }                                                                                 \
        break

static void tile_any(int type, const uint8_t *const *rows, const float *scales, int64_t k, const group *unpacked,
                     acts x, int64_t r0, int mr, int64_t row_bytes, int64_t ahead, float *res) {
    switch (type) { /* off = 2^shift: Q8_0/int8 128 (codes stored signed), Q4_0 8, Q5_0 16, Q6_K 32 */
        TILE_CASE(Q8_0, 7, 0); TILE_CASE(I8, 7, 0); TILE_CASE(Q4_0, 3, 0);
        TILE_CASE(Q5_0, 4, 0); TILE_CASE(Q6_K, 5, 0); TILE_CASE(Q4_K, -1, 1);
    }
}

#define UNPACK_CASE(T)                                                                    \
    case T_##T:                                                                           \
        for (int64_t g = 0; g < k / 64; g++)                                              \
            for (int c = 0; c < NP; c++) out[g * NP + c] = g_##T(rows[c], g, scales[c]);  \
        break

/* A panel's groups, unpacked once for many rows (the order `tile` reads them in). */
static void unpack_panel(int type, const uint8_t *const *rows, const float *scales, int64_t k, group *out) {
    switch (type) {
        UNPACK_CASE(Q8_0); UNPACK_CASE(I8); UNPACK_CASE(Q4_0);
        UNPACK_CASE(Q5_0); UNPACK_CASE(Q6_K); UNPACK_CASE(Q4_K);
    }
}

static inline uint16_t f32_to_bf16(float f) {
    union { float f; uint32_t u; } v = {f};
    v.u += 0x7fffu + ((v.u >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(v.u >> 16);
}

#define MAX_PARTS 8

/* Arguments as quant_kernels.c's qmatmul: W row-stacked from `parts` matrices in their formats. */
void q8_matmul(int parts, const int *types, const uint8_t *const *ws, const int64_t *row_bytes,
               const float *const *row_scales, const int64_t *part_rows, int64_t k, const void *xv, int64_t x_stride,
               int m, const float *bias, void *out, int64_t out_stride, int out_bf16, int x_bf16, int threads) {
    int64_t first_panel[MAX_PARTS + 1] = {0}, first_col[MAX_PARTS + 1] = {0};
    for (int j = 0; j < parts && j < MAX_PARTS; j++) {
        first_panel[j + 1] = first_panel[j] + (part_rows[j] + NP - 1) / NP;
        first_col[j + 1] = first_col[j] + part_rows[j];
    }
    const int64_t panels = first_panel[parts];
    const size_t codes = ((size_t)m * k + 63) / 64 * 64, lanes = ((size_t)m * (k / 4) * 4 + 63) / 64 * 64;
    acts x = {aligned_alloc(64, codes), aligned_alloc(64, lanes), aligned_alloc(64, lanes), aligned_alloc(64, lanes)};
    const int elem = x_bf16 ? 2 : 4;
    #pragma omp parallel num_threads(threads)
    {
        #pragma omp for schedule(static)
        for (int r = 0; r < m; r++)
            quantize_row((const char *)xv + (int64_t)r * x_stride * elem, x_bf16, k, x.q + (int64_t)r * k,
                         x.d + (int64_t)r * (k / 4), x.neg + (int64_t)r * (k / 4), x.sum + (int64_t)r * (k / 4));
        float res[MR * NP];
        group *unpacked = m > MR ? aligned_alloc(64, sizeof(group) * NP * (k / 64)) : NULL;
        #pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {
            int j = 0;
            while (p >= first_panel[j + 1]) j++;
            const int64_t n = part_rows[j], rb = row_bytes[j], c0 = (p - first_panel[j]) * NP;
            const int np = (int)(n - c0 < NP ? n - c0 : NP);
            const uint8_t *rows[NP];
            float scales[NP];
            for (int c = 0; c < NP; c++) { /* the last panel repeats its last channel; those results are dropped */
                const int64_t ch = c0 + (c < np ? c : np - 1);
                rows[c] = ws[j] + ch * rb;
                scales[c] = row_scales[j] ? row_scales[j][ch] : 0.0f;
            }
            const int64_t panels_ahead = (PF_BYTES + NP * rb - 1) / (NP * rb);
            const int64_t ahead = m <= MR && c0 + panels_ahead * NP < n ? panels_ahead * NP * rb : 0;
            const int64_t col = first_col[j] + c0;
            if (unpacked) unpack_panel(types[j], rows, scales, k, unpacked);
            for (int64_t r0 = 0; r0 < m; r0 += MR) {
                const int mr = m - r0 < MR ? (int)(m - r0) : MR;
                tile_any(types[j], rows, scales, k, unpacked, x, r0, mr, rb, ahead, res);
                for (int r = 0; r < mr; r++)
                    for (int c = 0; c < np; c++) {
                        const float v = res[r * NP + c] + (bias ? bias[col + c] : 0.0f);
                        const int64_t at = (r0 + r) * out_stride + col + c;
                        if (out_bf16) ((uint16_t *)out)[at] = f32_to_bf16(v);
                        else ((float *)out)[at] = v;
                    }
            }
        }
        free(unpacked);
    }
    free(x.q);
    free(x.d);
    free(x.neg);
    free(x.sum);
}

#else
int q8_available(void) { return 0; }
void q8_matmul(int parts, const int *types, const uint8_t *const *ws, const int64_t *row_bytes,
               const float *const *row_scales, const int64_t *part_rows, int64_t k, const void *xv, int64_t x_stride,
               int m, const float *bias, void *out, int64_t out_stride, int out_bf16, int x_bf16, int threads) {
    abort(); /* quant.py never calls it where q8_available() is 0 */
}
#endif
