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
#include "dequant.h"

typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));

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
