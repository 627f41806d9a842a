/* Dense bf16 weights on AVX512-BF16 dot products, one kernel for every batch size.
 *
 * bf16_matmul computes out[m, n] = x[m, k] . W[n, k]^T (+ bias) with q8_kernels.c's q8_matmul
 * arguments (so the layer stack chains it the same way), for matrices laid out once, at load,
 * as panels of 16 output channels: panel[k/2][16][2] bf16 holds the weight pair (2i, 2i+1) of
 * channel c at [i][c] (`quant.py`'s `bf16_panels`; the matrix's own size, channels past n zero).
 * One `vdpbf16ps` multiplies a pair of activations, broadcast to every lane, with a pair of
 * weights of 16 channels.
 *
 * Each (row, channel) is one fp32 sum over k in pair order, the same instructions whatever m,
 * the tile, the threads or the rows around it: a row's bits never depend on the batch (the
 * GEMV-below-4-rows / oneDNN-above split it replaces could not promise that, and oneDNN built a
 * kernel per row count). Tiles are MR rows x 2 panels (16 independent sums in registers); rows
 * of fp32 activations are rounded to bf16 first (to nearest even), as the bf16 model does.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define NC 16 /* output channels a panel: one per fp32 lane */
#define MR 8  /* activation rows a tile */
#define MAX_PARTS 8

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

int bf16_panels_available(void) { return 1; }

/* 16 fp32 -> bf16, round to nearest even (bf16.h's store_bf16) */
static inline __m256i to_bf16(__m512 v) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

/* mr rows of x (bf16, `xs` elements apart) against panels a and b (b may be a itself: a last odd
 * panel, whose second half of results is dropped): acc[r][0] for a, acc[r][1] for b. */
static inline __attribute__((always_inline)) void tile(const uint16_t *a, const uint16_t *b, const uint16_t *x,
                                                       int64_t xs, int mr, int64_t k, const uint16_t *ahead,
                                                       int every, int per, __m512 acc[MR][2]) {
    for (int r = 0; r < mr; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t i = 0; i < k / 2; i++) {
        if (ahead && i % every == 0) { /* `per` lines every `every` pairs of k */
            const uint16_t *line = ahead + i / every * per * 2 * NC;
            _mm_prefetch((const char *)line, _MM_HINT_T1);
            if (per == 2) _mm_prefetch((const char *)(line + 2 * NC), _MM_HINT_T1);
        }
        const __m512bh wa = (__m512bh)_mm512_load_si512(a + i * 2 * NC);
        const __m512bh wb = (__m512bh)_mm512_load_si512(b + i * 2 * NC);
        for (int r = 0; r < mr; r++) {
            const __m512bh pair = (__m512bh)_mm512_set1_epi32(*(const int32_t *)(x + r * xs + 2 * i));
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], wa, pair);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], wb, pair);
        }
    }
}

typedef struct { /* where a panel's results go: out's columns col .. col + 16 (`keep` of them) */
    void *out;
    int64_t stride, col;
    const float *bias;
    __mmask16 keep;
    int bf16;
} sink;

static inline void store(const __m512 v, int64_t row, sink o) {
    const __m512 b = o.bias ? _mm512_maskz_loadu_ps(o.keep, o.bias + o.col) : _mm512_setzero_ps();
    const __m512 y = _mm512_add_ps(v, b);
    const int64_t at = row * o.stride + o.col;
    if (o.bf16) _mm256_mask_storeu_epi16((uint16_t *)o.out + at, o.keep, to_bf16(y));
    else _mm512_mask_storeu_ps((float *)o.out + at, o.keep, y);
}

#define TILE_CASE(MRC) case MRC: tile(a, b, x + r0 * xs, xs, MRC, k, at, every, per, acc); break;

/* every row of x against panels a and b, results to sinks oa and ob (ob.keep 0: no panel b).
 * The tiles of rows between them ask for the next pair's weights (`ahead`, NULL for none) into L2
 * as they go, so the matrix streams from memory while they multiply (a decode step's matrices are
 * not in cache: at 16-64 rows 1.1-1.2x, at one row 1.15x on an AVX-512 AMD EPYC). */
static void panel_pair(const uint16_t *a, const uint16_t *b, const uint16_t *ahead, const uint16_t *x, int64_t xs,
                       int64_t m, int64_t k, sink oa, sink ob) {
    __m512 acc[MR][2];
    const int64_t tiles = (m + MR - 1) / MR, lines = k; /* the next pair: 64 k bytes */
    for (int64_t r0 = 0; r0 < m; r0 += MR) {
        const int mr = m - r0 < MR ? (int)(m - r0) : MR;
        /* this tile asks for its share of the next pair's lines as it goes through k */
        const int64_t first = lines * (r0 / MR) / tiles, share = lines * (r0 / MR + 1) / tiles - first;
        const int per = share > k / 2 ? 2 : 1, every = share > k / 2 ? 1 : (int)(k / 2 / (share ? share : 1));
        const uint16_t *at = ahead && share ? ahead + first * 32 : NULL;
        switch (mr) { TILE_CASE(8) TILE_CASE(7) TILE_CASE(6) TILE_CASE(5) TILE_CASE(4) TILE_CASE(3) TILE_CASE(2)
                      default: tile(a, b, x + r0 * xs, xs, 1, k, at, every, per, acc); }
        for (int r = 0; r < mr; r++) {
            store(acc[r][0], r0 + r, oa);
            if (ob.keep) store(acc[r][1], r0 + r, ob);
        }
    }
}

/* q8_matmul's arguments: W row-stacked from `parts` laid-out bf16 matrices (types and row scales
 * unused: every part is bf16 panels; row_bytes is a panel's bytes, 32 k). */
void bf16_matmul(int parts, const int *types, const uint8_t *const *ws, const int64_t *row_bytes,
                 const float *const *row_scales, const int64_t *part_rows, int64_t k, const void *xv,
                 int64_t x_stride, int m, const float *bias, void *out, int64_t out_stride, int out_bf16, int x_bf16,
                 int threads) {
    (void)types, (void)row_scales, (void)row_bytes;
    int64_t first_pair[MAX_PARTS + 1] = {0}, first_col[MAX_PARTS + 1] = {0};
    for (int j = 0; j < parts && j < MAX_PARTS; j++) {
        const int64_t panels = (part_rows[j] + NC - 1) / NC;
        first_pair[j + 1] = first_pair[j] + (panels + 1) / 2;
        first_col[j + 1] = first_col[j] + part_rows[j];
    }
    const uint16_t *x = (const uint16_t *)xv;
    uint16_t *rounded = NULL;
    if (!x_bf16) { /* fp32 rows: to bf16 once, as the bf16 model's activations */
        rounded = aligned_alloc(64, ((size_t)m * k * 2 + 63) / 64 * 64);
        for (int64_t r = 0; r < m; r++)
            for (int64_t i = 0; i < k; i += 16) {
                const __mmask16 live = k - i >= 16 ? 0xFFFF : (__mmask16)((1u << (k - i)) - 1);
                _mm256_mask_storeu_epi16(rounded + r * k + i, live,
                                         to_bf16(_mm512_maskz_loadu_ps(live, (const float *)xv + r * x_stride + i)));
            }
        x = rounded;
        x_stride = k;
    }
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t pp = 0; pp < first_pair[parts]; pp++) {
        int j = 0;
        while (pp >= first_pair[j + 1]) j++;
        const int64_t n = part_rows[j], p0 = 2 * (pp - first_pair[j]), c0 = p0 * NC;
        const uint16_t *a = (const uint16_t *)ws[j] + p0 * k * NC;
        const int has_b = c0 + NC < n;
        const uint16_t *b = has_b ? a + k * NC : a;
        const int na = (int)(n - c0 < NC ? n - c0 : NC), nb = has_b ? (int)(n - c0 - NC < NC ? n - c0 - NC : NC) : 0;
        const sink oa = {out, out_stride, first_col[j] + c0, bias, (__mmask16)((1u << na) - 1), out_bf16};
        const sink ob = {out, out_stride, first_col[j] + c0 + NC, bias, (__mmask16)((1u << nb) - 1), out_bf16};
        /* the next pair: this part's, or the next part's first */
        const uint16_t *ahead = pp + 1 < first_pair[j + 1] ? a + 2 * k * NC
                                : pp + 1 < first_pair[parts] ? (const uint16_t *)ws[j + 1] : NULL;
        panel_pair(a, b, ahead, x, x_stride, m, k, oa, ob);
    }
    free(rounded);
}


/* fp32 rows `ids` of a matrix laid out as panels (row i: lane i % 16 of panel i / 16), exactly its
 * bf16 values: an embedding table's lookups (the layer stack's `embed`, quant.py's `bf16_panel_rows`). */
void bf16_panel_rows(const uint8_t *w, int64_t k, const int64_t *ids, int64_t count, float *out) {
    for (int64_t i = 0; i < count; i++) {
        const uint16_t *panel = (const uint16_t *)w + ids[i] / NC * NC * k;
        const int64_t lane = ids[i] % NC;
        for (int64_t p = 0; p < k / 2; p++)
            for (int j = 0; j < 2; j++) {
                const uint32_t bits = (uint32_t)panel[(p * NC + lane) * 2 + j] << 16;
                memcpy(out + i * k + 2 * p + j, &bits, sizeof bits);
            }
    }
}
#else
int bf16_panels_available(void) { return 0; }
void bf16_panel_rows(const uint8_t *w, int64_t k, const int64_t *ids, int64_t count, float *out) {
    (void)w, (void)k, (void)ids, (void)count, (void)out;
    abort(); /* quant.py never calls it where bf16_panels_available() is 0 */
}
void bf16_matmul(int parts, const int *types, const uint8_t *const *ws, const int64_t *row_bytes,
                 const float *const *row_scales, const int64_t *part_rows, int64_t k, const void *xv,
                 int64_t x_stride, int m, const float *bias, void *out, int64_t out_stride, int out_bf16, int x_bf16,
                 int threads) { abort(); }
#endif
