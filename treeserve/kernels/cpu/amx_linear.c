/* bf16 linear layers on AMX tiles: out[m, n] = x[m, k] . W[n, k]^T (+ bias), for a bf16 weight
 * laid out once (`amx_linear_bf16`) or a quantised one dequantised into tiles per call
 * (`amx_quant_matmul`).
 *
 * oneDNN (PyTorch's bf16 matmul on a CPU) spends 20-40 us a call re-laying the weight out for
 * AMX before it multiplies; at the 16-row steps of a serving engine and a small model that is
 * most of the layer's time. Here a bf16 weight is laid out once (`amx_pack` in __init__.py):
 * output channels in panels of 16 (zero channels pad the last), and per panel k/32 tiles of
 * 16 rows x 64 bytes, row p holding weights 2p and 2p+1 of the 32-weight chunk for each of the
 * 16 channels: TDPBF16PS's B operand. x rows are its A operand, loaded straight from memory 16
 * rows at a time (a last partial block is copied into a zeroed 16-row buffer first).
 *
 * Each thread takes groups of 4 panels (4 accumulator tiles); for every 16-row block, chunk
 * after chunk: load A, then each panel's B and one TDPBF16PS into its accumulator. Sums are
 * fp32; the bias is added to the fp32 sum and the result rounded once to bf16 (nearest even).
 * A row's result does not depend on m, its place in a tile or the threads: each output is one
 * accumulator lane taken through the same chunks in the same order (tested).
 *
 * A quantised weight (GGUF blocks, our int8, or q8_kernels.c's Q8_0 panels) takes the same
 * path: a thread dequantises its group's 4 panels into that tile layout (dequant.h's fp32
 * values, rounded to bf16 as PyTorch's cast rounds), then multiplies every 16-row block with
 * them. So the result is, to the bit, the bf16 layer of the dequantised matrix, whatever m; the
 * dequantising is paid once a call, which the tiles amortise over a batch's rows (at one row it
 * costs more than the 8-bit kernels: `quant_activations` in the engine picks).
 * Only built where the compiler targets AMX-BF16 and AVX512-BF16; the caller checks
 * `amx_linear_available()` (which also asks Linux for tile state and probes it, amx.h).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "dequant.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include "amx.h"
#include "transpose.h"

#define PANEL 16 /* output channels a tile: the 16 fp32 lanes of an accumulator row */
#define GROUP 4  /* panels a pass over x: accumulator tiles 0-3 */
#define CHUNK 32 /* weights of k a tile product */
#define TILE (CHUNK * PANEL) /* bf16 values a weight tile */
#define ROWS 16  /* x rows a tile */
#define PANELS 2000 /* + T_Q8_0: q8_kernels.c's laid-out Q8_0 panels */
#define MAX_PARTS 8

int amx_linear_available(void) { return amx_usable(); }

static void configure(void) {
    tile_config cfg = {0};
    cfg.palette = 1;
    for (int t = 0; t < 7; t++) cfg.rows[t] = ROWS, cfg.colsb[t] = 64; /* 0-3 sums, 4 x, 5-6 weights */
    _tile_loadconfig(&cfg);
}

/* x's rows as A operands: rows r0.. from x itself, or the last partial block from `tail`. */
typedef struct {
    const bf16 *x, *tail;
    int64_t x_stride, k;
    int m, full;
} rows_in;

static rows_in rows_of(const bf16 *x, int64_t x_stride, int m, int64_t k) {
    rows_in r = {x, NULL, x_stride, k, m, m / ROWS * ROWS};
    if (m > r.full) {
        bf16 *tail = aligned_alloc(64, sizeof(bf16) * ROWS * k);
        memset(tail, 0, sizeof(bf16) * ROWS * k);
        for (int i = r.full; i < m; i++) memcpy(tail + (i - r.full) * k, x + i * x_stride, sizeof(bf16) * k);
        r.tail = tail;
    }
    return r;
}

/* Rows r0..r0+15 times the `np` panels of tiles at w (panel j's chunks at w + j * chunks * TILE),
 * then out[r][col[j] + c] = sum + bias[j] lane c, for the live channels, bf16 or fp32. */
static void multiply_rows(rows_in in, int r0, const bf16 *w, int64_t chunks, int np, const __m512 *bias,
                          const int64_t *col, const __mmask16 *live, void *out, int64_t out_stride, int out_bf16) {
    float sums[GROUP][ROWS][PANEL] __attribute__((aligned(64)));
    const bf16 *a = r0 < in.full ? in.x + r0 * in.x_stride : in.tail;
    const int64_t a_stride = sizeof(bf16) * (r0 < in.full ? in.x_stride : in.k);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t c = 0; c < chunks; c++) {
        _tile_loadd(4, a + c * CHUNK, a_stride);
        _tile_loadd(5, w + c * TILE, 64);
        _tile_dpbf16ps(0, 4, 5);
        if (np > 1) {
            _tile_loadd(6, w + (chunks + c) * TILE, 64);
            _tile_dpbf16ps(1, 4, 6);
        }
        if (np > 2) {
            _tile_loadd(5, w + (2 * chunks + c) * TILE, 64);
            _tile_dpbf16ps(2, 4, 5);
        }
        if (np > 3) {
            _tile_loadd(6, w + (3 * chunks + c) * TILE, 64);
            _tile_dpbf16ps(3, 4, 6);
        }
    }
    _tile_stored(0, sums[0], 64);
    _tile_stored(1, sums[1], 64);
    _tile_stored(2, sums[2], 64);
    _tile_stored(3, sums[3], 64);
    const int rows = in.m - r0 < ROWS ? in.m - r0 : ROWS;
    for (int j = 0; j < np; j++)
        for (int i = 0; i < rows; i++) {
            const __m512 v = _mm512_add_ps(_mm512_load_ps(sums[j][i]), bias[j]);
            const int64_t at = (r0 + i) * out_stride + col[j];
            if (out_bf16) _mm256_mask_storeu_epi16((bf16 *)out + at, live[j], (__m256i)_mm512_cvtneps_pbh(v));
            else _mm512_mask_storeu_ps((float *)out + at, live[j], v);
        }
}

void amx_linear_bf16(const bf16 *x, int64_t x_stride, int m, const bf16 *w, const bf16 *bias, int64_t n, int64_t k,
                     bf16 *out, int64_t out_stride, int threads) {
    const int64_t chunks = k / CHUNK, panels = (n + PANEL - 1) / PANEL, groups = (panels + GROUP - 1) / GROUP;
    const rows_in in = rows_of(x, x_stride, m, k);
    _Pragma("omp parallel num_threads(threads)") {
        configure();
        _Pragma("omp for schedule(static)") for (int64_t g = 0; g < groups; g++) {
            const int64_t p0 = g * GROUP;
            const int np = panels - p0 < GROUP ? (int)(panels - p0) : GROUP;
            __m512 b[GROUP];
            int64_t col[GROUP];
            __mmask16 live[GROUP];
            for (int j = 0; j < np; j++) {
                col[j] = (p0 + j) * PANEL;
                live[j] = n - col[j] >= PANEL ? 0xffff : (__mmask16)((1u << (n - col[j])) - 1);
                b[j] = bias ? _mm512_castsi512_ps(_mm512_slli_epi32(
                                  _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(live[j], bias + col[j])), 16))
                            : _mm512_setzero_ps();
            }
            for (int r0 = 0; r0 < m; r0 += ROWS)
                multiply_rows(in, r0, w + p0 * chunks * TILE, chunks, np, b, col, live, out, out_stride, 1);
        }
        _tile_release();
    }
    free((void *)in.tail);
}

/* A panel's 16 channels (rows[c], int8 row scales scales[c]) as bf16 tiles at dst: each
 * 32-weight chunk dequantised a channel at a time, rounded to bf16 (nearest even), and
 * transposed so that tile row p holds weights 2p, 2p+1 of every channel. */
static inline __attribute__((always_inline)) void tile_panel(void (*deq)(const uint8_t *, int64_t, float, float *),
                                                             const uint8_t *const *rows, const float *scales,
                                                             int64_t k, bf16 *dst) {
    float f[PANEL][CHUNK] __attribute__((aligned(64)));
    for (int64_t c = 0; c < k / CHUNK; c++) {
        __m512i r[PANEL];
        for (int ch = 0; ch < PANEL; ch++) {
            deq(rows[ch], c, scales[ch], f[ch]);
            r[ch] = (__m512i)_mm512_cvtne2ps_pbh(_mm512_load_ps(f[ch] + 16), _mm512_load_ps(f[ch]));
        }
        transpose16(r);
        for (int i = 0; i < PANEL; i++) _mm512_store_si512(dst + c * TILE + i * CHUNK, r[i]);
    }
}

/* A laid-out Q8_0 panel (codes[k/4][16][4] ^ 0x80, then fp16 scales [k/32][16]) as bf16 tiles:
 * 4 consecutive weights of the 16 channels a 64-byte line, each scaled as deq_Q8_0 scales it
 * (float(code) * float(scale): exact), two tile rows a line. Panels stream from memory one
 * after the other: the line AHEAD bytes on is asked for (q8_kernels.c's PANEL_AHEAD). */
#define AHEAD 16384
static void tile_q8_0_panel(const uint8_t *codes, int64_t k, bf16 *dst) {
    const uint16_t *half = (const uint16_t *)(codes + PANEL * k);
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                           21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0); /* [a x16, b x16] -> (a, b) x16 */
    for (int64_t blk = 0; blk < k / CHUNK; blk++) {
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(half + blk * PANEL)));
        for (int i = 0; i < 8; i++) {
            _mm_prefetch((const char *)codes + (blk * 8 + i) * 64 + AHEAD, _MM_HINT_T1);
            const __m512i v = _mm512_xor_si512(_mm512_load_si512(codes + (blk * 8 + i) * 64), flip);
            __m512 w[4];
            for (int b = 0; b < 4; b++) /* sign-extend byte b of each lane */
                w[b] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 24 - 8 * b), 24)));
            bf16 *row = dst + blk * TILE + 2 * i * CHUNK;
            _mm512_store_si512(row, _mm512_permutexvar_epi16(pairs, (__m512i)_mm512_cvtne2ps_pbh(w[1], w[0])));
            _mm512_store_si512(row + CHUNK, _mm512_permutexvar_epi16(pairs, (__m512i)_mm512_cvtne2ps_pbh(w[3], w[2])));
        }
    }
}

/* This thread's buffer for a group's tiles, kept from call to call (OpenMP keeps its threads):
 * allocated afresh, a buffer above malloc's mmap threshold (128 KB: k >= 1024) was new pages,
 * page-faulted in, on every call. */
static bf16 *scratch(size_t bytes) {
    static __thread bf16 *buffer;
    static __thread size_t size;
    if (bytes > size) {
        free(buffer);
        buffer = aligned_alloc(64, bytes);
        size = bytes;
    }
    return buffer;
}

#define TILE_CASE(T) case T_##T: tile_panel(deq_##T, rows, scales, k, dst); break

static void tile_any(int type, const uint8_t *const *rows, const float *scales, int64_t k, bf16 *dst) {
    switch (type) {
        TILE_CASE(Q4_0); TILE_CASE(Q4_1); TILE_CASE(Q5_0); TILE_CASE(Q5_1); TILE_CASE(Q8_0);
        TILE_CASE(Q4_K); TILE_CASE(Q5_K); TILE_CASE(Q6_K); TILE_CASE(I8);
        case PANELS + T_Q8_0: tile_q8_0_panel(rows[0], k, dst); break;
    }
}

/* quant_kernels.c's qmatmul with bf16 x (x_bf16 must be 1): W row-stacked from `parts` matrices,
 * each in its own format (part j: part_rows[j] rows, or panels, of row_bytes[j] bytes at
 * ws[j]; row_scales[j]: int8's). A part's last panel repeats its last channel; those lanes are
 * not stored. */
void amx_quant_matmul(int parts, const int *types, const uint8_t *const *ws, const int64_t *row_bytes,
                      const float *const *row_scales, const int64_t *part_rows, int64_t k, const void *x,
                      int64_t x_stride, int m, const float *bias, void *out, int64_t out_stride, int out_bf16,
                      int x_bf16, int threads) {
    (void)x_bf16;
    int64_t first_panel[MAX_PARTS + 1] = {0}, first_col[MAX_PARTS + 1] = {0};
    for (int j = 0; j < parts && j < MAX_PARTS; j++) {
        first_panel[j + 1] = first_panel[j] + (part_rows[j] + PANEL - 1) / PANEL;
        first_col[j + 1] = first_col[j] + part_rows[j];
    }
    const int64_t chunks = k / CHUNK, panels = first_panel[parts], groups = (panels + GROUP - 1) / GROUP;
    const rows_in in = rows_of((const bf16 *)x, x_stride, m, k);
    _Pragma("omp parallel num_threads(threads)") {
        bf16 *w = scratch(sizeof(bf16) * GROUP * PANEL * k);
        configure();
        _Pragma("omp for schedule(static)") for (int64_t g = 0; g < groups; g++) {
            const int64_t p0 = g * GROUP;
            const int np = panels - p0 < GROUP ? (int)(panels - p0) : GROUP;
            __m512 b[GROUP];
            int64_t col[GROUP];
            __mmask16 live[GROUP];
            for (int jp = 0; jp < np; jp++) {
                const int64_t pn = p0 + jp;
                int j = 0;
                while (pn >= first_panel[j + 1]) j++;
                const int64_t n = part_rows[j], c0 = (pn - first_panel[j]) * PANEL;
                const int nc = (int)(n - c0 < PANEL ? n - c0 : PANEL);
                const uint8_t *rows[PANEL];
                float scales[PANEL];
                for (int c = 0; c < PANEL; c++) {
                    const int64_t ch = c0 + (c < nc ? c : nc - 1);
                    rows[c] = types[j] >= PANELS ? ws[j] + (pn - first_panel[j]) * row_bytes[j] : ws[j] + ch * row_bytes[j];
                    scales[c] = row_scales[j] ? row_scales[j][ch] : 0.0f;
                }
                tile_any(types[j], rows, scales, k, w + jp * chunks * TILE);
                col[jp] = first_col[j] + c0;
                live[jp] = (__mmask16)((1u << nc) - 1);
                b[jp] = bias ? _mm512_maskz_loadu_ps(live[jp], bias + col[jp]) : _mm512_setzero_ps();
            }
            for (int r0 = 0; r0 < m; r0 += ROWS)
                multiply_rows(in, r0, w, chunks, np, b, col, live, out, out_stride, out_bf16);
        }
        _tile_release();
    }
    free((void *)in.tail);
}
#else
int amx_linear_available(void) { return 0; }
void amx_linear_bf16(const bf16 *x, int64_t x_stride, int m, const bf16 *w, const bf16 *bias, int64_t n, int64_t k,
                     bf16 *out, int64_t out_stride, int threads) {
    (void)x, (void)x_stride, (void)m, (void)w, (void)bias, (void)n, (void)k, (void)out, (void)out_stride, (void)threads;
    abort(); /* never called: amx_linear_available() is 0 */
}
void amx_quant_matmul(int parts, const int *types, const uint8_t *const *ws, const int64_t *row_bytes,
                      const float *const *row_scales, const int64_t *part_rows, int64_t k, const void *x,
                      int64_t x_stride, int m, const float *bias, void *out, int64_t out_stride, int out_bf16,
                      int x_bf16, int threads) {
    abort(); /* never called: amx_linear_available() is 0 */
}
#endif
