/* bf16 linear layers on AMX tiles: out[m, n] = x[m, k] . W[n, k]^T (+ bias), for a bf16 weight
 * laid out once as dense panels (`amx_dense_matmul`) or a quantised one dequantised into tiles
 * per call (`amx_quant_matmul`); both take quant_kernels.c's qmatmul arguments, which the layer
 * stack chains.
 *
 * oneDNN (PyTorch's bf16 matmul on a CPU) spends 20-40 us a call re-laying the weight out for
 * AMX before it multiplies; at the 16-row steps of a serving engine and a small model that is
 * most of the layer's time. Here a bf16 weight is laid out once (quant.py's `bf16_panels`, the
 * layout bf16_panels.c reads too):
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
 * A quantised weight (GGUF blocks, our int8, or q8_kernels.c's Q8_0 panels) is dequantised per
 * call, a group of 4 panels at a time, into bf16 tiles (tile_dequant.h: the dequantised
 * matrix's bf16 weights, to the bit) in a thread's buffer, and multiplied there. Row-stored
 * formats become A tiles (a channel's weights a tile row, as dequantisers write them, so no
 * transpose) and x, laid out once a call, the B operand (`multiply`, swapped): every product pair
 * is the one a bf16 weight's takes, in the same order, so each sum has the same bits (TDPBF16PS
 * gives the same fp32 sum with its operands' roles swapped; tested). While a group multiplies,
 * the vector units dequantise the next one into the other half of the buffer, a slice between
 * chunks (`advance`). So the result is, to the bit, the bf16 layer of the dequantised matrix,
 * whatever m; the dequantising is paid once a call, which the tiles amortise over a batch's
 * rows (at one row it costs more than the 8-bit kernels: `quant_activations` in the engine
 * picks).
 * Only built where the compiler targets AMX-BF16 and AVX512-BF16 (or AVX512-BF16 with the tiles
 * emulated: amx_emulated.h); the caller checks `amx_linear_available()` (which also asks Linux
 * for tile state and probes it, amx.h).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "dequant.h"

#if ((defined(__AMX_TILE__) && defined(__AMX_BF16__)) || defined(TREESERVE_AMX_EMULATED)) && defined(__AVX512BF16__)
#include <omp.h>

#include "amx.h"
#include "tile_dequant.h"
#include "transpose.h"

#define GROUP 4  /* panels a pass over x: accumulator tiles 0-3 (PANEL channels a panel: an accumulator row's lanes) */
#define ROWS 16  /* x rows a tile */
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

typedef struct tiling tiling;
static void advance(tiling *next);

/* The x operand of a 16-row block (row stride `stride` bytes): x's own rows as A (`x_rows`;
 * chunk c at `at` + c * CHUNK), or lay_out_x's tiles as B (chunk c at `at` + c * TILE). */
typedef struct {
    const bf16 *at;
    int64_t stride;
} x_block;

static x_block x_rows(rows_in in, int r0) {
    return r0 < in.full ? (x_block){in.x + r0 * in.x_stride, sizeof(bf16) * in.x_stride}
                        : (x_block){in.tail, sizeof(bf16) * in.k};
}

/* Rows r0..r0+15 (`rows` of them live) times the `np` panels of tiles at w (panel j's chunks at
 * w + j * chunks * TILE), then out[r][col[j] + c] = sum + bias[j] lane c, for the live channels,
 * bf16 or fp32. Between chunks it advances `next` (if any): the vector units dequantise while
 * the tiles multiply. `swapped` (a constant at each call: inlined), the weights are the A operand
 * and x the B one: an accumulator holds [channel][row], transposed on the way out; each product
 * pair is the same, taken in the same order, so every sum has the same bits (tested). */
static inline __attribute__((always_inline)) void multiply(x_block x, int swapped, int r0, int rows, const bf16 *w,
                                                           int64_t chunks, int np, const __m512 *bias,
                                                           const int64_t *col, const __mmask16 *live, void *out,
                                                           int64_t out_stride, int out_bf16, tiling *next) {
#define PRODUCT(acc, weights) \
    if (swapped) _tile_dpbf16ps(acc, weights, 4); \
    else _tile_dpbf16ps(acc, 4, weights)
    float sums[GROUP][ROWS][PANEL] __attribute__((aligned(64)));
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t c = 0; c < chunks; c++) {
        _tile_loadd(4, x.at + c * (swapped ? TILE : CHUNK), x.stride);
        _tile_loadd(5, w + c * TILE, 64);
        PRODUCT(0, 5);
        if (np > 1) {
            _tile_loadd(6, w + (chunks + c) * TILE, 64);
            PRODUCT(1, 6);
        }
        if (np > 2) {
            _tile_loadd(5, w + (2 * chunks + c) * TILE, 64);
            PRODUCT(2, 5);
        }
        if (np > 3) {
            _tile_loadd(6, w + (3 * chunks + c) * TILE, 64);
            PRODUCT(3, 6);
        }
        if (next) advance(next);
    }
#undef PRODUCT
    _tile_stored(0, sums[0], 64);
    _tile_stored(1, sums[1], 64);
    _tile_stored(2, sums[2], 64);
    _tile_stored(3, sums[3], 64);
    for (int j = 0; j < np; j++) {
        __m512i r[ROWS];
        for (int i = 0; i < ROWS; i++) r[i] = _mm512_load_si512(sums[j][i]);
        if (swapped) transpose16(r); /* [channel][row] -> [row][channel] */
        for (int i = 0; i < rows; i++) {
            const __m512 v = _mm512_add_ps((__m512)r[i], bias[j]);
            const int64_t at = (r0 + i) * out_stride + col[j];
            if (out_bf16) _mm256_mask_storeu_epi16((bf16 *)out + at, live[j], (__m256i)_mm512_cvtneps_pbh(v));
            else _mm512_mask_storeu_ps((float *)out + at, live[j], v);
        }
    }
}

/* x as swapped multiply's B operands: 16-row block b's chunk c at xt + (b * chunks + c) * TILE, tile
 * row p holding weights 2p, 2p+1 of the chunk for each of the block's 16 rows (zeros past m). */
static void lay_out_x(const bf16 *x, int64_t x_stride, int m, int64_t chunks, bf16 *xt) {
    for (int r0 = 0; r0 < m; r0 += ROWS)
        for (int64_t c = 0; c < chunks; c++) {
            __m512i r[ROWS];
            for (int i = 0; i < ROWS; i++)
                r[i] = r0 + i < m ? _mm512_loadu_si512(x + (r0 + i) * x_stride + c * CHUNK) : _mm512_setzero_si512();
            transpose16(r);
            for (int p = 0; p < ROWS; p++) _mm512_store_si512(xt + (r0 / ROWS * chunks + c) * TILE + p * CHUNK, r[p]);
        }
}

/* A dense bf16 matrix laid out once as panels (quant.py's `bf16_panels`: each panel's k/32 chunks
 * of [16 pairs][16 channels][2] are TDPBF16PS's B tiles as they lie) times x's rows as A tiles,
 * straight from memory; bias fp32 [n] or NULL, out bf16 or fp32. */
static void amx_linear_bf16(const bf16 *x, int64_t x_stride, int m, const bf16 *w, const float *bias, int64_t n,
                            int64_t k, void *out, int64_t out_stride, int out_bf16, int threads) {
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
                b[j] = bias ? _mm512_maskz_loadu_ps(live[j], bias + col[j]) : _mm512_setzero_ps();
            }
            for (int r0 = 0; r0 < m; r0 += ROWS)
                multiply(x_rows(in, r0), 0, r0, m - r0 < ROWS ? m - r0 : ROWS, w + p0 * chunks * TILE, chunks, np, b, col,
                         live, out, out_stride, out_bf16, NULL);
        }
        _tile_release();
    }
    free((void *)in.tail);
}

/* W row-stacked from `parts` matrices, each in its own format (quant_kernels.c's qmatmul). */
typedef struct {
    int parts;
    const int *types;
    const uint8_t *const *ws;
    const int64_t *row_bytes, *part_rows;
    const float *const *row_scales;
    const float *bias;
    int64_t k, chunks, panels, first_panel[MAX_PARTS + 1], first_col[MAX_PARTS + 1];
} stacked;

/* A group of 4 panels on its way into bf16 tiles: what to read, where the tiles go, how far it
 * got (`done` of `units`, a unit one panel's chunk) and its pace: `advance` (once a chunk of the
 * previous group's multiplying, `steps` of them) does units so that the group is ready when the
 * previous one is done. */
struct tiling {
    int np, type[GROUP], b_tiles;
    const uint8_t *rows[GROUP][PANEL];
    float scales[GROUP][PANEL];
    int64_t k, chunks, units, done, steps, owed;
    bf16 *tiles;
    __m512 bias[GROUP];
    int64_t col[GROUP];
    __mmask16 live[GROUP];
};

static void start(tiling *t, const stacked *s, int64_t g, bf16 *tiles, int64_t steps, int b_tiles) {
    const int64_t p0 = g * GROUP;
    t->np = s->panels - p0 < GROUP ? (int)(s->panels - p0) : GROUP;
    t->k = s->k, t->chunks = s->chunks, t->units = t->np * s->chunks, t->done = 0, t->steps = steps, t->owed = 0;
    t->tiles = tiles, t->b_tiles = b_tiles;
    for (int jp = 0; jp < t->np; jp++) {
        const int64_t pn = p0 + jp;
        int j = 0;
        while (pn >= s->first_panel[j + 1]) j++;
        const int64_t n = s->part_rows[j], c0 = (pn - s->first_panel[j]) * PANEL;
        const int nc = (int)(n - c0 < PANEL ? n - c0 : PANEL);
        for (int c = 0; c < PANEL; c++) {
            const int64_t ch = c0 + (c < nc ? c : nc - 1);
            t->rows[jp][c] = s->types[j] >= PANELS ? s->ws[j] + (pn - s->first_panel[j]) * s->row_bytes[j]
                                                   : s->ws[j] + ch * s->row_bytes[j];
            t->scales[jp][c] = s->row_scales[j] ? s->row_scales[j][ch] : 0.0f;
        }
        t->type[jp] = s->types[j];
        t->col[jp] = s->first_col[j] + c0;
        t->live[jp] = (__mmask16)((1u << nc) - 1);
        t->bias[jp] = s->bias ? _mm512_maskz_loadu_ps(t->live[jp], s->bias + t->col[jp]) : _mm512_setzero_ps();
    }
}

static void unit(tiling *t) {
    const int jp = (int)(t->done / t->chunks);
    const int64_t c = t->done % t->chunks;
    tile_any(t->type[jp], t->rows[jp], t->scales[jp], t->k, c, t->b_tiles, t->tiles + (jp * t->chunks + c) * TILE);
    t->done++;
}

static void advance(tiling *t) {
    for (t->owed += t->units; t->owed >= t->steps && t->done < t->units; t->owed -= t->steps) unit(t);
}

static void finish(tiling *t) {
    while (t->done < t->units) unit(t);
}

/* This thread's buffers (0: two groups' tiles, 1: x laid out), kept from call to call (OpenMP
 * keeps its threads): allocated afresh, a buffer above malloc's mmap threshold (128 KB) was new
 * pages, page-faulted in, on every call. */
static bf16 *scratch(int slot, size_t bytes) {
    static __thread bf16 *buffer[2];
    static __thread size_t size[2];
    if (bytes > size[slot]) {
        free(buffer[slot]);
        buffer[slot] = aligned_alloc(64, bytes);
        size[slot] = bytes;
    }
    return buffer[slot];
}

/* quant_kernels.c's qmatmul with bf16 x (x_bf16 must be 1): W row-stacked from `parts` matrices,
 * each in its own format (part j: part_rows[j] rows, or panels, of row_bytes[j] bytes at
 * ws[j]; row_scales[j]: int8's). A part's last panel repeats its last channel; those lanes are
 * not stored. A thread's groups are contiguous; while one group multiplies, the next one is
 * dequantised into the other half of its buffer. */
void amx_quant_matmul(int parts, const int *types, const uint8_t *const *ws, const int64_t *row_bytes,
                      const float *const *row_scales, const int64_t *part_rows, int64_t k, const void *x,
                      int64_t x_stride, int m, const float *bias, void *out, int64_t out_stride, int out_bf16,
                      int x_bf16, int threads) {
    (void)x_bf16;
    stacked s = {parts, types, ws, row_bytes, part_rows, row_scales, bias, k, k / CHUNK, 0, {0}, {0}};
    for (int j = 0; j < parts && j < MAX_PARTS; j++) {
        s.first_panel[j + 1] = s.first_panel[j] + (part_rows[j] + PANEL - 1) / PANEL;
        s.first_col[j + 1] = s.first_col[j] + part_rows[j];
    }
    s.panels = s.first_panel[parts];
    const int64_t groups = (s.panels + GROUP - 1) / GROUP, group_tiles = GROUP * s.chunks * TILE;
    /* Laid-out Q8_0 panels alone are B tiles as they are dequantised, with x the A operand
     * (multiply unswapped); any other part makes the weights A tiles and x, laid out, B. */
    int b_tiles = 1;
    for (int j = 0; j < parts; j++) b_tiles &= types[j] >= PANELS;
    const int64_t blocks = (m + ROWS - 1) / ROWS;
    const rows_in in = b_tiles ? rows_of((const bf16 *)x, x_stride, m, k) : (rows_in){0};
    _Pragma("omp parallel num_threads(threads)") {
        const int tid = omp_get_thread_num(), nth = omp_get_num_threads();
        const int64_t g0 = groups * tid / nth, g1 = groups * (tid + 1) / nth;
        bf16 *buffer = scratch(0, sizeof(bf16) * 2 * group_tiles), *xt = NULL;
        if (!b_tiles && g0 < g1) {
            xt = scratch(1, sizeof(bf16) * blocks * s.chunks * TILE);
            lay_out_x((const bf16 *)x, x_stride, m, s.chunks, xt);
        }
        tiling t[2];
        configure();
        if (g0 < g1) {
            start(&t[0], &s, g0, buffer, blocks * s.chunks, b_tiles);
            finish(&t[0]);
        }
        for (int64_t g = g0; g < g1; g++) {
            tiling *now = &t[(g - g0) % 2], *next = g + 1 < g1 ? &t[(g - g0 + 1) % 2] : NULL;
            if (next) start(next, &s, g + 1, buffer + (g - g0 + 1) % 2 * group_tiles, blocks * s.chunks, b_tiles);
            for (int r0 = 0; r0 < m; r0 += ROWS) {
                const int rows = m - r0 < ROWS ? m - r0 : ROWS;
                if (b_tiles)
                    multiply(x_rows(in, r0), 0, r0, rows, now->tiles, s.chunks, now->np, now->bias, now->col,
                             now->live, out, out_stride, out_bf16, next);
                else
                    multiply((x_block){xt + r0 / ROWS * s.chunks * TILE, 64}, 1, r0, rows, now->tiles, s.chunks,
                             now->np, now->bias, now->col, now->live, out, out_stride, out_bf16, next);
            }
            if (next) finish(next);
        }
        _tile_release();
    }
    free((void *)in.tail);
}

/* quant_kernels.c's qmatmul for row-stacked parts of dense bf16 panels (quant.py's BF16_PANELS, k
 * % 32 == 0): amx_linear_bf16 on each part's panels as they lie, into its columns of out. fp32
 * rows of x are rounded to bf16 first (to nearest even), as the bf16 model and bf16_panels.c do. */
void amx_dense_matmul(int parts, const int *types, const uint8_t *const *ws, const int64_t *row_bytes,
                      const float *const *row_scales, const int64_t *part_rows, int64_t k, const void *x,
                      int64_t x_stride, int m, const float *bias, void *out, int64_t out_stride, int out_bf16,
                      int x_bf16, int threads) {
    (void)types, (void)row_bytes, (void)row_scales;
    bf16 *rounded = NULL;
    if (!x_bf16) {
        rounded = malloc(sizeof(bf16) * (size_t)(m > 0 ? m : 1) * (size_t)k);
        for (int i = 0; i < m; i++)
            for (int64_t j = 0; j < k; j++) rounded[i * k + j] = store_bf16(((const float *)x)[i * x_stride + j]);
        x = rounded, x_stride = k;
    }
    int64_t col = 0;
    for (int j = 0; j < parts; j++) {
        char *part_out = (char *)out + col * (out_bf16 ? sizeof(bf16) : sizeof(float));
        amx_linear_bf16((const bf16 *)x, x_stride, m, (const bf16 *)ws[j], bias ? bias + col : NULL, part_rows[j], k,
                        part_out, out_stride, out_bf16, threads);
        col += part_rows[j];
    }
    free(rounded);
}
#else
int amx_linear_available(void) { return 0; }
void amx_dense_matmul(int parts, const int *types, const uint8_t *const *ws, const int64_t *row_bytes,
                      const float *const *row_scales, const int64_t *part_rows, int64_t k, const void *x,
                      int64_t x_stride, int m, const float *bias, void *out, int64_t out_stride, int out_bf16,
                      int x_bf16, int threads) {
    abort(); /* never called: amx_linear_available() is 0 */
}
void amx_quant_matmul(int parts, const int *types, const uint8_t *const *ws, const int64_t *row_bytes,
                      const float *const *row_scales, const int64_t *part_rows, int64_t k, const void *x,
                      int64_t x_stride, int m, const float *bias, void *out, int64_t out_stride, int out_bf16,
                      int x_bf16, int threads) {
    abort(); /* never called: amx_linear_available() is 0 */
}
#endif
