/* CPU kernels for the two passes that dominate decode on a memory-bound CPU.
 *
 * paged_decode_*: attention of one query token per sequence over its KV pages, read in
 *   place through the block table (no gather copy), fp32 accumulation, GQA-aware.
 * sample_rows_*: inverse-CDF draw from softmax(logits) for rows without top-k/top-p/min-p,
 *   one read of the row plus a scan of an L2-resident exp buffer.
 *
 * Each sequence/row is computed by one thread in a fixed order, so results never depend on
 * the batch around it. Built at first use by treeserve/engine/cpu_kernels.py; the PyTorch
 * path in attention.py / sampler.py is the reference these are tested against.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

typedef uint16_t bf16;

static inline float load_f32(float x) { return x; }
static inline float load_bf16(bf16 x) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)x << 16;
    return v.f;
}
static inline float store_f32(float x) { return x; }
#define load_bf16_generic load_bf16
#define store_bf16_generic store_bf16
static inline bf16 store_bf16(float f) {
    union { uint32_t u; float f; } v;
    v.f = f;
    v.u += 0x7fffu + ((v.u >> 16) & 1u); /* round to nearest even */
    return (bf16)(v.u >> 16);
}

#define DEFINE_PAGED_DECODE(SUFFIX, T)                                                          \
void paged_decode_##SUFFIX(const T *q, const T *k_cache, int64_t page_stride, int64_t v_offset, \
                           const int64_t *tables, int64_t table_stride, const int64_t *ctx_lens, \
                           int batch, int q_heads, int kv_heads, int head_dim, int block_size,  \
                           float scale, int64_t window, int threads, T *out) {                  \
    const int group = q_heads / kv_heads;                                                       \
    const int64_t token_stride = (int64_t)kv_heads * head_dim;                                  \
    _Pragma("omp parallel for schedule(dynamic, 4) num_threads(threads)")                       \
    for (int b = 0; b < batch; b++) {                                                           \
        const int64_t len = ctx_lens[b];                                                        \
        const int64_t start = (window > 0 && len > window) ? len - window : 0;                  \
        const int64_t n = len - start;                                                          \
        /* scores[i][head]; query and accumulator [head][dim] in fp32 */                        \
        float *scores = (float *)malloc(sizeof(float) * n * q_heads);                           \
        float *qf = (float *)malloc(sizeof(float) * q_heads * head_dim * 2 + sizeof(float) * q_heads * 2); \
        float *acc = qf + q_heads * head_dim;                                                   \
        float *maxs = acc + q_heads * head_dim;                                                 \
        float *sums = maxs + q_heads;                                                           \
        const T *qb = q + (int64_t)b * q_heads * head_dim;                                      \
        for (int i = 0; i < q_heads * head_dim; i++) {                                          \
            qf[i] = load_##SUFFIX(qb[i]) * scale;                                               \
            acc[i] = 0.0f;                                                                      \
        }                                                                                       \
        for (int hq = 0; hq < q_heads; hq++) { maxs[hq] = -FLT_MAX; sums[hq] = 0.0f; }         \
        const int64_t *table = tables + (int64_t)b * table_stride;                              \
        for (int64_t t = start; t < len; t++) {                                                 \
            const T *row = k_cache + table[t / block_size] * page_stride + (t % block_size) * token_stride; \
            float *s = scores + (t - start) * q_heads;                                          \
            for (int hq = 0; hq < q_heads; hq++) {                                              \
                const T *k = row + (int64_t)(hq / group) * head_dim;                            \
                const float *qq = qf + hq * head_dim;                                           \
                float dot = 0.0f;                                                               \
                _Pragma("omp simd reduction(+:dot)")                                            \
                for (int d = 0; d < head_dim; d++) dot += qq[d] * load_##SUFFIX(k[d]);          \
                s[hq] = dot;                                                                    \
                if (dot > maxs[hq]) maxs[hq] = dot;                                             \
            }                                                                                   \
        }                                                                                       \
        for (int64_t i = 0; i < n; i++)                                                         \
            for (int hq = 0; hq < q_heads; hq++) {                                              \
                float e = expf(scores[i * q_heads + hq] - maxs[hq]);                            \
                scores[i * q_heads + hq] = e;                                                   \
                sums[hq] += e;                                                                  \
            }                                                                                   \
        for (int64_t t = start; t < len; t++) {                                                 \
            const T *row = k_cache + v_offset + table[t / block_size] * page_stride             \
                           + (t % block_size) * token_stride;                                   \
            const float *s = scores + (t - start) * q_heads;                                    \
            for (int hq = 0; hq < q_heads; hq++) {                                              \
                const T *v = row + (int64_t)(hq / group) * head_dim;                            \
                const float p = s[hq];                                                          \
                float *a = acc + hq * head_dim;                                                 \
                _Pragma("omp simd")                                                             \
                for (int d = 0; d < head_dim; d++) a[d] += p * load_##SUFFIX(v[d]);             \
            }                                                                                   \
        }                                                                                       \
        T *o = out + (int64_t)b * q_heads * head_dim;                                           \
        for (int hq = 0; hq < q_heads; hq++) {                                                  \
            const float inv = 1.0f / sums[hq];                                                  \
            for (int d = 0; d < head_dim; d++)                                                  \
                o[hq * head_dim + d] = store_##SUFFIX(acc[hq * head_dim + d] * inv);            \
        }                                                                                       \
        free(scores);                                                                           \
        free(qf);                                                                               \
    }                                                                                           \
}

DEFINE_PAGED_DECODE(f32, float)
DEFINE_PAGED_DECODE(bf16_generic, bf16)

#define DEFINE_SAMPLE_ROWS(SUFFIX, T)                                                           \
void sample_rows_##SUFFIX(const T *logits, int64_t row_stride, int rows, int vocab,             \
                          const double *uniforms, int64_t *out, int threads) {                  \
    _Pragma("omp parallel num_threads(threads)")                                                \
    {                                                                                           \
        float *buf = (float *)malloc(sizeof(float) * vocab);                                    \
        _Pragma("omp for schedule(static)")                                                     \
        for (int r = 0; r < rows; r++) {                                                        \
            const T *x = logits + (int64_t)r * row_stride;                                      \
            float m = -FLT_MAX;                                                                \
            for (int i = 0; i < vocab; i++) {                                                   \
                float v = load_##SUFFIX(x[i]);                                                  \
                m = v > m ? v : m;                                                              \
            }                                                                                   \
            float sum = 0.0f;                                                                   \
            _Pragma("omp simd reduction(+:sum)")                                                \
            for (int i = 0; i < vocab; i++) {                                                   \
                buf[i] = expf(load_##SUFFIX(x[i]) - m);                                         \
                sum += buf[i];                                                                  \
            }                                                                                   \
            const float target = (float)(uniforms[r] * sum);                                    \
            float cum = 0.0f;                                                                   \
            int64_t pick = -1;                                                                  \
            for (int i = 0; i < vocab; i++) {                                                   \
                if (buf[i] > 0.0f) pick = i;                                                    \
                cum += buf[i];                                                                  \
                if (cum > target && buf[i] > 0.0f) break;                                       \
            }                                                                                   \
            out[r] = pick;                                                                      \
        }                                                                                       \
        free(buf);                                                                              \
    }                                                                                           \
}

DEFINE_SAMPLE_ROWS(f32, float)
DEFINE_SAMPLE_ROWS(bf16, bf16)

/* paged_decode_bf16: the bf16 decode attention. Where the compiler targets AVX512-BF16 and
 * head_dim is a multiple of 32, q.k runs as bf16 dot products (one instruction per 32 dims,
 * fp32 accumulation, the scale applied to the dot), scores are kept per head so the softmax
 * is a contiguous pass, and p.v accumulates in fp32 vectors; otherwise the generic loop. */
#ifdef __AVX512BF16__
#include <immintrin.h>

static inline __m512 bf16x16_to_ps(const bf16 *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

static void decode_seq_bf16(const bf16 *qb, const bf16 *k_cache, int64_t page_stride, int64_t v_offset,
                            const int64_t *table, int64_t start, int64_t len, int q_heads, int kv_heads,
                            int head_dim, int block_size, float scale, float *scores, float *acc, bf16 *o) {
    const int group = q_heads / kv_heads;
    const int64_t n = len - start;
    const int64_t token_stride = (int64_t)kv_heads * head_dim;
    for (int64_t t = start; t < len; t++) {
        const bf16 *row = k_cache + table[t / block_size] * page_stride + (t % block_size) * token_stride;
        for (int hq = 0; hq < q_heads; hq++) {
            const bf16 *k = row + (int64_t)(hq / group) * head_dim;
            const bf16 *qh = qb + (int64_t)hq * head_dim;
            __m512 dot = _mm512_setzero_ps();
            for (int c = 0; c < head_dim; c += 32)
                dot = _mm512_dpbf16_ps(dot, (__m512bh)_mm512_loadu_si512(k + c), (__m512bh)_mm512_loadu_si512(qh + c));
            scores[hq * n + (t - start)] = _mm512_reduce_add_ps(dot) * scale;
        }
    }
    for (int hq = 0; hq < q_heads; hq++) {
        float *s = scores + hq * n;
        float m = -FLT_MAX, sum = 0.0f;
        for (int64_t i = 0; i < n; i++) m = s[i] > m ? s[i] : m;
        _Pragma("omp simd reduction(+:sum)")
        for (int64_t i = 0; i < n; i++) {
            s[i] = expf(s[i] - m);
            sum += s[i];
        }
        const float inv = 1.0f / sum;
        for (int64_t i = 0; i < n; i++) s[i] *= inv;
    }
    for (int i = 0; i < q_heads * head_dim; i++) acc[i] = 0.0f;
    for (int64_t t = start; t < len; t++) {
        const bf16 *row = k_cache + v_offset + table[t / block_size] * page_stride + (t % block_size) * token_stride;
        for (int hq = 0; hq < q_heads; hq++) {
            const bf16 *v = row + (int64_t)(hq / group) * head_dim;
            const __m512 p = _mm512_set1_ps(scores[hq * n + (t - start)]);
            float *a = acc + hq * head_dim;
            for (int d = 0; d < head_dim; d += 16)
                _mm512_storeu_ps(a + d, _mm512_fmadd_ps(p, bf16x16_to_ps(v + d), _mm512_loadu_ps(a + d)));
        }
    }
    for (int i = 0; i < q_heads * head_dim; i++) o[i] = store_bf16(acc[i]);
}

void paged_decode_bf16(const bf16 *q, const bf16 *k_cache, int64_t page_stride, int64_t v_offset,
                       const int64_t *tables, int64_t table_stride, const int64_t *ctx_lens, int batch, int q_heads,
                       int kv_heads, int head_dim, int block_size, float scale, int64_t window, int threads,
                       bf16 *out) {
    if (head_dim % 32 != 0) {
        paged_decode_bf16_generic(q, k_cache, page_stride, v_offset, tables, table_stride, ctx_lens, batch, q_heads,
                                  kv_heads, head_dim, block_size, scale, window, threads, out);
        return;
    }
    _Pragma("omp parallel for schedule(dynamic, 4) num_threads(threads)")
    for (int b = 0; b < batch; b++) {
        const int64_t len = ctx_lens[b];
        const int64_t start = (window > 0 && len > window) ? len - window : 0;
        float *scores = (float *)malloc(sizeof(float) * ((len - start) * q_heads + q_heads * head_dim));
        decode_seq_bf16(q + (int64_t)b * q_heads * head_dim, k_cache, page_stride, v_offset,
                        tables + (int64_t)b * table_stride, start, len, q_heads, kv_heads, head_dim, block_size,
                        scale, scores, scores + (len - start) * q_heads, out + (int64_t)b * q_heads * head_dim);
        free(scores);
    }
}
#else
void paged_decode_bf16(const bf16 *q, const bf16 *k_cache, int64_t page_stride, int64_t v_offset,
                       const int64_t *tables, int64_t table_stride, const int64_t *ctx_lens, int batch, int q_heads,
                       int kv_heads, int head_dim, int block_size, float scale, int64_t window, int threads,
                       bf16 *out) {
    paged_decode_bf16_generic(q, k_cache, page_stride, v_offset, tables, table_stride, ctx_lens, batch, q_heads,
                              kv_heads, head_dim, block_size, scale, window, threads, out);
}
#endif

/* rms_norm_bf16: each row x / rms(x) in fp32, then the model's gain, then one rounding.
 * Gemma (weight_bf16 NULL): out = bf16(x_hat * gain), gain fp32 (1 + w). Llama (gain NULL):
 * out = bf16(w * bf16(x_hat)), as transformers rounds before the weight. One op instead of
 * the eight small ones PyTorch runs for it on a CPU (per norm, per layer, per step). */
void rms_norm_bf16(const bf16 *x, int64_t rows, int dim, const float *gain, const bf16 *weight, float eps,
                   bf16 *out, int threads) {
    _Pragma("omp parallel for schedule(static) num_threads(threads) if (rows * dim > 262144)")
    for (int64_t r = 0; r < rows; r++) {
        const bf16 *xr = x + r * dim;
        bf16 *o = out + r * dim;
        float sum = 0.0f;
        _Pragma("omp simd reduction(+:sum)")
        for (int i = 0; i < dim; i++) {
            float v = load_bf16(xr[i]);
            sum += v * v;
        }
        const float scale = 1.0f / sqrtf(sum / (float)dim + eps);
        if (gain) {
            for (int i = 0; i < dim; i++) o[i] = store_bf16(load_bf16(xr[i]) * scale * gain[i]);
        } else {
            for (int i = 0; i < dim; i++) o[i] = store_bf16(load_bf16(weight[i]) * load_bf16(store_bf16(load_bf16(xr[i]) * scale)));
        }
    }
}

/* linear_bf16: out[i, j] = sum_k x[i, k] * w[j, k] (+ bias[j]) for a few rows of x (decode).
 * At batch 1 a linear layer is a read of its weights, so speed is memory bandwidth; this
 * streams each weight row once per call with AVX512-BF16 dot products (fp32 accumulation,
 * one rounding to bf16 at the end), 8 weight rows by 2 x rows at a time, split over threads
 * by weight rows.
 * Each output is summed in a fixed order whatever the number of x rows. Only built where
 * the compiler targets AVX512-BF16; linear_bf16_available() tells the caller. */
#ifdef __AVX512BF16__
#include <immintrin.h>

int linear_bf16_available(void) { return 1; }

static inline __m512 dot_step(__m512 acc, const bf16 *w, const bf16 *x, __mmask32 mask) {
    __m512i wv = _mm512_maskz_loadu_epi16(mask, w);
    __m512i xv = _mm512_maskz_loadu_epi16(mask, x);
    return _mm512_dpbf16_ps(acc, (__m512bh)wv, (__m512bh)xv);
}

#define W_ROWS 8 /* weight rows per block: 8 concurrent streams keep the memory system busiest */
#define X_ROWS 2 /* x rows per pass over a block: 16 accumulators + 8 weight registers */

/* One block of W_ROWS weight rows against xs (1 or X_ROWS, a constant after inlining) x rows. */
static inline __attribute__((always_inline)) void linear_block(const bf16 *const *wr, const bf16 *const *xr,
                                                               const int xs, const int full, const __mmask32 tail,
                                                               __m512 acc[X_ROWS][W_ROWS]) {
    for (int i = 0; i < xs; i++)
        for (int r = 0; r < W_ROWS; r++) acc[i][r] = _mm512_setzero_ps();
    for (int kk = 0; kk < full; kk += 32) {
        __m512bh wv[W_ROWS];
        for (int r = 0; r < W_ROWS; r++) wv[r] = (__m512bh)_mm512_loadu_si512(wr[r] + kk);
        for (int i = 0; i < xs; i++) {
            __m512bh xv = (__m512bh)_mm512_loadu_si512(xr[i] + kk);
            for (int r = 0; r < W_ROWS; r++) acc[i][r] = _mm512_dpbf16_ps(acc[i][r], wv[r], xv);
        }
    }
    if (tail)
        for (int i = 0; i < xs; i++)
            for (int r = 0; r < W_ROWS; r++) acc[i][r] = dot_step(acc[i][r], wr[r] + full, xr[i] + full, tail);
}

void linear_bf16(const bf16 *x, int64_t x_stride, int m, const bf16 *w, const bf16 *bias, int64_t n, int k,
                 bf16 *out, int64_t out_stride, int threads) {
    const int full = k / 32 * 32;
    const __mmask32 tail = (__mmask32)((1ull << (k - full)) - 1);
    const int64_t blocks = (n + W_ROWS - 1) / W_ROWS;
    _Pragma("omp parallel for schedule(static) num_threads(threads)")
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t j0 = b * W_ROWS;
        const int rows = n - j0 < W_ROWS ? (int)(n - j0) : W_ROWS;
        const bf16 *wr[W_ROWS];
        for (int r = 0; r < W_ROWS; r++) wr[r] = w + (j0 + (r < rows ? r : 0)) * k; /* short block: repeat row 0 */
        for (int i0 = 0; i0 < m; i0 += X_ROWS) {
            const int xs = m - i0 < X_ROWS ? m - i0 : X_ROWS;
            const bf16 *xr[X_ROWS];
            for (int i = 0; i < X_ROWS; i++) xr[i] = x + (int64_t)(i0 + (i < xs ? i : 0)) * x_stride;
            __m512 acc[X_ROWS][W_ROWS];
            if (xs == X_ROWS)
                linear_block(wr, xr, X_ROWS, full, tail, acc);
            else
                linear_block(wr, xr, 1, full, tail, acc);
            for (int i = 0; i < xs; i++)
                for (int r = 0; r < rows; r++) {
                    float sum = _mm512_reduce_add_ps(acc[i][r]);
                    if (bias) sum += load_bf16(bias[j0 + r]);
                    out[(int64_t)(i0 + i) * out_stride + j0 + r] = store_bf16(sum);
                }
        }
    }
}
#else
int linear_bf16_available(void) { return 0; }
#endif
