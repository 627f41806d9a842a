/* avx2_linear_bf16: out[m, n] = bf16(sum_k x[m, k] * w[n, k] + bias[n]) for bf16 x and w, on AVX2
 * with FMA (CPUs without AVX512-BF16, whose bf16 products PyTorch emulates).
 *
 * The weights stay bf16 (half the bytes of an fp32 copy) and are widened in registers; each product
 * of two bf16 values is exact in fp32 and the sum is kept in fp32 and rounded once, as an fp32 matmul
 * of the widened values would be, in this order for every output: eight lanes, lane j summing the
 * k = j (mod 8) terms by fused multiply-adds in increasing k, then the lanes added pairwise
 * ((0+4, 1+5, 2+6, 3+7), then (0+2, 1+3), then 0+1), then the k % 8 tail terms in increasing k,
 * then the bias. Outputs are computed in blocks (four rows by two outputs, one row by four, or alone)
 * with the same operations for each, so a row's bits never depend on how many rows share the call
 * (batch invariance).
 * Built without -ffast-math so that the compiler keeps this order.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef uint16_t bf16;

static inline __m256 load_bf16(const bf16 *p) {
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline float widen(bf16 v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline bf16 round_bf16(float f) { /* round to nearest even, as PyTorch's .to(bfloat16) (finite inputs) */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x7fffffu)) return (bf16)((u >> 16) | 0x40); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
}

static inline float hsum(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    __m128 s = _mm_add_ps(lo, hi);                   /* 0+4, 1+5, 2+6, 3+7 */
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));          /* (0+4)+(2+6), (1+5)+(3+7) */
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 0x55));   /* then those two */
    return _mm_cvtss_f32(s);
}

/* `cols` (1..4) outputs from w rows wn[0..cols) for `rows` (1..4) rows, rows x cols <= 8: the order the
 * header states (always inlined with constant rows and cols, so each shape is its own unrolled loop) */
static inline __attribute__((always_inline)) void dot_block(const float *const *xr, int rows, const bf16 *const *wn,
                                                            int cols, int k8, int k, float sums[][4]) {
    __m256 acc[4][4];
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) acc[r][c] = _mm256_setzero_ps();
    for (int i = 0; i < k8; i += 8) {
        __m256 w[4];
        for (int c = 0; c < cols; c++) w[c] = load_bf16(wn[c] + i);
        for (int r = 0; r < rows; r++) {
            const __m256 xv = _mm256_loadu_ps(xr[r] + i);
            for (int c = 0; c < cols; c++) acc[r][c] = _mm256_fmadd_ps(xv, w[c], acc[r][c]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) {
            float s = hsum(acc[r][c]);
            for (int i = k8; i < k; i++) s = __builtin_fmaf(xr[r][i], widen(wn[c][i]), s);
            sums[r][c] = s;
        }
}

/* x: m rows of k bf16 at x_stride; w: n rows of k bf16 (contiguous); bias: n floats or NULL; out: m x n bf16 */
void avx2_linear_bf16(const bf16 *x, int64_t x_stride, int m, const bf16 *w, const float *bias, int64_t n, int k,
                      bf16 *out, int threads) {
    float *xf = (float *)aligned_alloc(64, ((size_t)m * k * sizeof(float) + 63) / 64 * 64);
    for (int r = 0; r < m; r++)
        for (int i = 0; i < k; i++) xf[(size_t)r * k + i] = widen(x[r * x_stride + i]);
    const int k8 = k & ~7;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t j = 0; j < n; j += 4) {
        const int cols = n - j < 4 ? (int)(n - j) : 4;
        const bf16 *wn[4];
        for (int c = 0; c < 4; c++) wn[c] = w + (j + (c < cols ? c : cols - 1)) * (int64_t)k;
        for (int r0 = 0; r0 < m; r0 += 4) {
            const int rows = m - r0 < 4 ? m - r0 : 4;
            const float *xr[4];
            float sums[4][4];
            for (int r = 0; r < rows; r++) xr[r] = xf + (size_t)(r0 + r) * k;
            if (rows == 4 && cols == 4) { /* two 4-row x 2-output blocks */
                float half[4][4];
                dot_block(xr, 4, wn, 2, k8, k, sums);
                dot_block(xr, 4, wn + 2, 2, k8, k, half);
                for (int r = 0; r < 4; r++) sums[r][2] = half[r][0], sums[r][3] = half[r][1];
            } else if (cols == 4) {
                for (int r = 0; r < rows; r++) dot_block(xr + r, 1, wn, 4, k8, k, sums + r);
            } else {
                for (int r = 0; r < rows; r++)
                    for (int c = 0; c < cols; c++) {
                        float one[1][4];
                        dot_block(xr + r, 1, wn + c, 1, k8, k, one);
                        sums[r][c] = one[0][0];
                    }
            }
            for (int r = 0; r < rows; r++)
                for (int c = 0; c < cols; c++)
                    out[(int64_t)(r0 + r) * n + j + c] = round_bf16(sums[r][c] + (bias ? bias[j + c] : 0.0f));
        }
    }
    free(xf);
}
