/* bf16 linear layers on AMX tiles: out[m, n] = x[m, k] . W[n, k]^T (+ bias), W packed at load.
 *
 * oneDNN (PyTorch's bf16 matmul on a CPU) spends 20-40 us a call re-laying the weight out for
 * AMX before it multiplies; at the 16-row steps of a serving engine and a small model that is
 * most of the layer's time. Here the weight is laid out once (`amx_pack` in __init__.py):
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
 * Only built where the compiler targets AMX-BF16 and AVX512-BF16; the caller checks
 * `amx_linear_available()` (which also asks Linux for tile state and probes it, amx.h).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include "amx.h"

#define PANEL 16 /* output channels a tile: the 16 fp32 lanes of an accumulator row */
#define GROUP 4  /* panels a pass over x: accumulator tiles 0-3 */
#define CHUNK 32 /* weights of k a tile product */
#define ROWS 16  /* x rows a tile */

int amx_linear_available(void) { return amx_usable(); }

static void configure(void) {
    tile_config cfg = {0};
    cfg.palette = 1;
    for (int t = 0; t < 7; t++) cfg.rows[t] = ROWS, cfg.colsb[t] = 64; /* 0-3 sums, 4 x, 5-6 weights */
    _tile_loadconfig(&cfg);
}

/* The tile of panel `p`'s chunk `c`. */
#define WEIGHTS(p, c) (w + ((p) * chunks + (c)) * (CHUNK * PANEL))

void amx_linear_bf16(const bf16 *x, int64_t x_stride, int m, const bf16 *w, const bf16 *bias, int64_t n, int64_t k,
                     bf16 *out, int64_t out_stride, int threads) {
    const int64_t chunks = k / CHUNK, panels = (n + PANEL - 1) / PANEL, groups = (panels + GROUP - 1) / GROUP;
    const int full = m / ROWS * ROWS;
    bf16 *tail = NULL;
    if (m > full) {
        tail = aligned_alloc(64, sizeof(bf16) * ROWS * k);
        memset(tail, 0, sizeof(bf16) * ROWS * k);
        for (int i = full; i < m; i++) memcpy(tail + (i - full) * k, x + i * x_stride, sizeof(bf16) * k);
    }
    _Pragma("omp parallel num_threads(threads)") {
        float sums[GROUP][ROWS][PANEL] __attribute__((aligned(64)));
        configure();
        _Pragma("omp for schedule(static)") for (int64_t g = 0; g < groups; g++) {
            const int64_t p0 = g * GROUP;
            const int np = panels - p0 < GROUP ? (int)(panels - p0) : GROUP;
            for (int r0 = 0; r0 < m; r0 += ROWS) {
                const bf16 *a = r0 < full ? x + r0 * x_stride : tail;
                const int64_t a_stride = sizeof(bf16) * (r0 < full ? x_stride : k);
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int64_t c = 0; c < chunks; c++) {
                    _tile_loadd(4, a + c * CHUNK, a_stride);
                    _tile_loadd(5, WEIGHTS(p0, c), 64);
                    _tile_dpbf16ps(0, 4, 5);
                    if (np > 1) {
                        _tile_loadd(6, WEIGHTS(p0 + 1, c), 64);
                        _tile_dpbf16ps(1, 4, 6);
                    }
                    if (np > 2) {
                        _tile_loadd(5, WEIGHTS(p0 + 2, c), 64);
                        _tile_dpbf16ps(2, 4, 5);
                    }
                    if (np > 3) {
                        _tile_loadd(6, WEIGHTS(p0 + 3, c), 64);
                        _tile_dpbf16ps(3, 4, 6);
                    }
                }
                _tile_stored(0, sums[0], 64);
                _tile_stored(1, sums[1], 64);
                _tile_stored(2, sums[2], 64);
                _tile_stored(3, sums[3], 64);
                const int rows = m - r0 < ROWS ? m - r0 : ROWS;
                for (int j = 0; j < np; j++) {
                    const int64_t col = (p0 + j) * PANEL;
                    const __mmask16 live = n - col >= PANEL ? 0xffff : (__mmask16)((1u << (n - col)) - 1);
                    const __m512 b = bias ? _mm512_castsi512_ps(_mm512_slli_epi32(
                                                _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(live, bias + col)), 16))
                                          : _mm512_setzero_ps();
                    for (int i = 0; i < rows; i++) {
                        const __m512 v = _mm512_add_ps(_mm512_load_ps(sums[j][i]), b);
                        _mm256_mask_storeu_epi16(out + (r0 + i) * out_stride + col, live,
                                                 (__m256i)_mm512_cvtneps_pbh(v));
                    }
                }
            }
        }
        _tile_release();
    }
    free(tail);
}
#else
int amx_linear_available(void) { return 0; }
void amx_linear_bf16(const bf16 *x, int64_t x_stride, int m, const bf16 *w, const bf16 *bias, int64_t n, int64_t k,
                     bf16 *out, int64_t out_stride, int threads) {
    (void)x, (void)x_stride, (void)m, (void)w, (void)bias, (void)n, (void)k, (void)out, (void)out_stride, (void)threads;
    abort(); /* never called: amx_linear_available() is 0 */
}
#endif
