/* CPU kernels for the passes that dominate inference of small models on a CPU.
 *
 * paged_decode_*: attention of one query token per sequence over its KV pages, read in
 *   place through the page table (no gather copy), fp32 accumulation, GQA-aware.
 * paged_prefill_bf16: the same for chunks of queries (a prefill over a cached prefix).
 * rms_norm_bf16, linear_bf16: RMSNorm, and a GEMV for linear layers at a few rows.
 * argmax_rows_*: the greedy pick, torch.argmax's answer in one read of each row.
 * paged_*_fp8_*, store_kv_fp8: the same over an FP8 KV cache (e4m3 pages, per-layer scales).
 * sample_rows_*: inverse-CDF draw from softmax(logits) for rows without top-k/top-p/min-p,
 *   two reads of the row plus a scan of its chunks' sums; sample_rows_masked_* the
 *   same over the tokens a structured-output bitmask allows.
 *
 * Each sequence/row is computed by one thread in a fixed order, so results never depend on
 * the batch around it. Built at first use by treeserve/kernels/cpu/__init__.py; the PyTorch
 * paths (engine/attention.py, engine/sampler.py, layers/) are the reference these are
 * tested against.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "prefill_work.h"
#include "fp8.h"
#ifdef __AVX512F__
#include <immintrin.h>
#endif

static inline float load_f32(float x) { return x; }
static inline float store_f32(float x) { return x; }
#define load_bf16_generic load_bf16
#define store_bf16_generic store_bf16

/* K and V rows read ahead, non-temporal: a decode reads each once per step, and rows fetched
 * this way are not kept in the outer caches, where the host's state for the next step lives. */
#define NTA_AHEAD 8
static inline void prefetch_row_nta(const void *row, int64_t bytes) {
    for (int64_t at = 0; at < bytes; at += 64) __builtin_prefetch((const char *)row + at, 0, 0);
}
/* Where key or value t of a sequence starts, in elements from the cache's start (through its table). */
static inline int64_t kv_row(const int64_t *table, int64_t t, int page_size, int64_t page_stride,
                             int64_t token_stride) {
    return table[t / page_size] * page_stride + (t % page_size) * token_stride;
}

#define DEFINE_PAGED_DECODE(SUFFIX, T)                                                          \
void paged_decode_##SUFFIX(const T *q, const T *k_cache, int64_t page_stride, int64_t v_offset, \
                           const int64_t *tables, int64_t table_stride, const int64_t *ctx_lens, \
                           int batch, int q_heads, int kv_heads, int head_dim, int page_size,  \
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
            const T *row = k_cache + kv_row(table, t, page_size, page_stride, token_stride);   \
            if (t + NTA_AHEAD < len)                                                            \
                prefetch_row_nta(k_cache + kv_row(table, t + NTA_AHEAD, page_size, page_stride, token_stride), \
                                 token_stride * (int64_t)sizeof(T));                            \
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
            const T *row = k_cache + v_offset + kv_row(table, t, page_size, page_stride, token_stride); \
            if (t + NTA_AHEAD < len)                                                            \
                prefetch_row_nta(k_cache + v_offset + kv_row(table, t + NTA_AHEAD, page_size, page_stride, \
                                                             token_stride),                     \
                                 token_stride * (int64_t)sizeof(T));                            \
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

/* The draw in two levels: the exp pass sums each chunk of SAMPLE_CHUNK entries (a fixed vector
 * order) and the chunk sums in index order; the target's chunk is found over those sums and
 * the token within it by a running sum of its entries' exps (recomputed). A scan of every
 * entry one add after another took ~0.2 ms a row of Gemma's 262k (the adds' latency); the
 * chunk sums also round less than that one long running sum. */
#define SAMPLE_CHUNK 64
#define DEFINE_SAMPLE_ROWS(SUFFIX, T)                                                           \
void sample_rows_##SUFFIX(const T *logits, int64_t row_stride, int rows, int vocab,             \
                          const double *uniforms, int64_t *out, int threads) {                  \
    const int chunks = (vocab + SAMPLE_CHUNK - 1) / SAMPLE_CHUNK;                               \
    _Pragma("omp parallel num_threads(threads)")                                                \
    {                                                                                           \
        float *sums = (float *)malloc(sizeof(float) * (chunks > 0 ? chunks : 1));               \
        _Pragma("omp for schedule(static)")                                                     \
        for (int r = 0; r < rows; r++) {                                                        \
            const T *x = logits + (int64_t)r * row_stride;                                      \
            float m = -FLT_MAX;                                                                \
            for (int i = 0; i < vocab; i++) {                                                   \
                float v = load_##SUFFIX(x[i]);                                                  \
                m = v > m ? v : m;                                                              \
            }                                                                                   \
            float total = 0.0f;                                                                 \
            for (int c = 0; c < chunks; c++) {                                                  \
                const int end = (c + 1) * SAMPLE_CHUNK < vocab ? (c + 1) * SAMPLE_CHUNK : vocab; \
                float sum = 0.0f;                                                               \
                _Pragma("omp simd reduction(+:sum)")                                            \
                for (int i = c * SAMPLE_CHUNK; i < end; i++) sum += expf(load_##SUFFIX(x[i]) - m); \
                sums[c] = sum;                                                                  \
                total += sum;                                                                   \
            }                                                                                   \
            const float target = (float)(uniforms[r] * total);                                  \
            float cum = 0.0f;                                                                   \
            int64_t pick = -1;                                                                  \
            int last = -1; /* the last chunk with weight: rounding may leave target unreached */ \
            for (int c = 0; c < chunks && pick < 0; c++) {                                      \
                if (sums[c] <= 0.0f) continue;                                                  \
                last = c;                                                                       \
                if (cum + sums[c] <= target) {                                                  \
                    cum += sums[c];                                                             \
                    continue;                                                                   \
                }                                                                               \
                const int end = (c + 1) * SAMPLE_CHUNK < vocab ? (c + 1) * SAMPLE_CHUNK : vocab; \
                for (int i = c * SAMPLE_CHUNK; i < end; i++) {                                  \
                    const float e = expf(load_##SUFFIX(x[i]) - m);                              \
                    cum += e;                                                                   \
                    if (cum > target && e > 0.0f) {                                             \
                        pick = i;                                                               \
                        break;                                                                  \
                    }                                                                           \
                }                                                                               \
            }                                                                                   \
            if (pick < 0 && last >= 0) /* the last token of nonzero probability */              \
                for (int i = (last + 1) * SAMPLE_CHUNK < vocab ? (last + 1) * SAMPLE_CHUNK - 1 : vocab - 1; \
                     i >= last * SAMPLE_CHUNK && pick < 0; i--)                                 \
                    if (expf(load_##SUFFIX(x[i]) - m) > 0.0f) pick = i;                         \
            out[r] = pick;                                                                      \
        }                                                                                       \
        free(sums);                                                                             \
    }                                                                                           \
}

DEFINE_SAMPLE_ROWS(f32, float)
DEFINE_SAMPLE_ROWS(bf16, bf16)

/* argmax_rows_*: torch.argmax of each row: the first maximum, or the first NaN where a row has
 * one (argmax ranks NaN above every number). A greedy step of a 262k vocabulary took ~10
 * PyTorch operators (chunk maxima, then the chunk), each slow from the caches a forward
 * swept; this is one read of the row and a scan of one chunk (of the row, for its first NaN,
 * where it has one). NaN is found from the bits (the file's -ffast-math lets
 * the compiler assume there is none); the max and the equality compare floats, so -0.0 and
 * 0.0 tie (the first wins, as in torch) and a row of -inf gives 0. */
#define ARGMAX_CHUNK 64
typedef uint32_t bits_f32;
typedef uint16_t bits_bf16;
static inline int nan_bits_f32(uint32_t b) { return (b & 0x7fffffffu) > 0x7f800000u; }
static inline int nan_bits_bf16(uint16_t b) { return (b & 0x7fffu) > 0x7f80u; }
/* Each chunk's max and NaN flag vectorised; the first chunk holding the row's max is kept. */
#define DEFINE_ARGMAX_ROWS(SUFFIX, T)                                                           \
void argmax_rows_##SUFFIX(const T *logits, int64_t row_stride, int rows, int vocab, int64_t *out, \
                          int threads) {                                                        \
    _Pragma("omp parallel for num_threads(threads) schedule(static)")                           \
    for (int r = 0; r < rows; r++) {                                                            \
        const T *x = logits + (int64_t)r * row_stride;                                          \
        const bits_##SUFFIX *bits = (const bits_##SUFFIX *)x;                                   \
        float m = -FLT_MAX;                                                                     \
        int best = 0, nan = 0;                                                                  \
        for (int c = 0; c < vocab; c += ARGMAX_CHUNK) {                                         \
            const int end = c + ARGMAX_CHUNK < vocab ? c + ARGMAX_CHUNK : vocab;                \
            float cm = -FLT_MAX;                                                                \
            int cn = 0;                                                                         \
            _Pragma("omp simd reduction(max:cm) reduction(|:cn)")                               \
            for (int i = c; i < end; i++) {                                                     \
                const float v = load_##SUFFIX(x[i]);                                            \
                cm = v > cm ? v : cm;                                                           \
                cn |= nan_bits_##SUFFIX(bits[i]);                                               \
            }                                                                                   \
            nan |= cn;                                                                          \
            if (cm > m) m = cm, best = c;                                                       \
        }                                                                                       \
        int64_t pick = 0;                                                                       \
        if (nan) {                                                                              \
            for (int i = 0; i < vocab; i++)                                                     \
                if (nan_bits_##SUFFIX(bits[i])) {                                               \
                    pick = i;                                                                   \
                    break;                                                                      \
                }                                                                               \
        } else {                                                                                \
            for (int i = best; i < vocab; i++)                                                  \
                if (load_##SUFFIX(x[i]) == m) {                                                 \
                    pick = i;                                                                   \
                    break;                                                                      \
                }                                                                               \
        }                                                                                       \
        out[r] = pick;                                                                          \
    }                                                                                           \
}

DEFINE_ARGMAX_ROWS(f32, float)
DEFINE_ARGMAX_ROWS(bf16, bf16)

/* sample_rows_masked_*: the same draw over the tokens a constraint allows (bit i of a row's
 * int32 words; tokens at or past mask_vocab are never allowed), and for rows whose uniform is
 * negative the first allowed maximum (greedy). A row with nothing allowed gets -1. It walks
 * the set bits only (a grammar usually allows few tokens), so it reads a fraction of the row;
 * the sum runs over the allowed tokens in index order. */
#define DEFINE_SAMPLE_ROWS_MASKED(SUFFIX, T)                                                    \
void sample_rows_masked_##SUFFIX(const T *logits, int64_t row_stride, int rows, int vocab,      \
                                 const int32_t *masks, int64_t mask_stride, int mask_vocab,     \
                                 const double *uniforms, int64_t *out, int threads) {           \
    const int n = vocab < mask_vocab ? vocab : mask_vocab;                                      \
    const int words = (n + 31) / 32;                                                            \
    _Pragma("omp parallel num_threads(threads)")                                                \
    {                                                                                           \
        float *val = (float *)malloc(sizeof(float) * (n > 0 ? n : 1));                          \
        int32_t *ids = (int32_t *)malloc(sizeof(int32_t) * (n > 0 ? n : 1));                    \
        _Pragma("omp for schedule(static)")                                                     \
        for (int r = 0; r < rows; r++) {                                                        \
            const T *x = logits + (int64_t)r * row_stride;                                      \
            const uint32_t *bits = (const uint32_t *)(masks + (int64_t)r * mask_stride);        \
            int count = 0;                                                                      \
            float m = -INFINITY;                                                                \
            int64_t best = -1;                                                                  \
            for (int w = 0; w < words; w++) {                                                   \
                uint32_t word = bits[w];                                                        \
                while (word) {                                                                  \
                    const int i = w * 32 + __builtin_ctz(word);                                 \
                    word &= word - 1;                                                           \
                    if (i >= n) break;                                                          \
                    const float v = load_##SUFFIX(x[i]);                                        \
                    ids[count] = i;                                                             \
                    val[count++] = v;                                                           \
                    if (best < 0 || v > m) { m = v; best = i; }                                 \
                }                                                                               \
            }                                                                                   \
            if (uniforms[r] < 0.0 || best < 0) { out[r] = best; continue; }                     \
            float sum = 0.0f;                                                                   \
            for (int j = 0; j < count; j++) { val[j] = expf(val[j] - m); sum += val[j]; }       \
            const float target = (float)(uniforms[r] * sum);                                    \
            float cum = 0.0f;                                                                   \
            int64_t pick = -1;                                                                  \
            for (int j = 0; j < count; j++) {                                                   \
                if (val[j] > 0.0f) pick = ids[j];                                               \
                cum += val[j];                                                                  \
                if (cum > target && val[j] > 0.0f) break;                                       \
            }                                                                                   \
            out[r] = pick;                                                                      \
        }                                                                                       \
        free(val);                                                                              \
        free(ids);                                                                              \
    }                                                                                           \
}

DEFINE_SAMPLE_ROWS_MASKED(f32, float)
DEFINE_SAMPLE_ROWS_MASKED(bf16, bf16)

/* paged_decode_bf16: the bf16 decode attention. Where the compiler targets AVX512-BF16 and
 * head_dim is a multiple of 32, q.k runs as bf16 dot products over keys transposed 16 at a
 * time (fp32 accumulation, the scale applied to the dot), the softmax is a vector pass per
 * head, and p.v accumulates the heads of a KV group in fp32 registers; otherwise the generic
 * loop. Where AMX tiles run, head_dim >= 64 and a KV group has at most 16 query heads, both
 * products are tile products instead (`decode_seq_tiles`; at head_dim 32 the vector path was
 * faster). paged_prefill_bf16 (below) shares its helpers. */
#ifdef __AVX512BF16__
#include <immintrin.h>

static inline __m512 bf16x16_to_ps(const bf16 *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* exp(x) for x <= 0: 2^(x log2 e) as 2^round * a degree-6 Taylor polynomial of 2^f, |f| <= 1/2
 * (relative error ~1e-7 from the polynomial, ~1e-5 from rounding x log2 e at x near -87). */
static inline __m512 exp_ps(__m512 x) {
    const __m512 y = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(1.44269504088896341f));
    const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(y, n);
    __m512 p = _mm512_set1_ps(1.5403530393381609e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* The lanes of the 16 values at i that exist in a row of n. */
static inline __mmask16 lanes_in(int64_t i, int64_t n) {
    return i >= n ? 0 : n - i < 16 ? (__mmask16)((1u << (n - i)) - 1) : 0xFFFF;
}

/* The largest of a row's n scores. */
static inline float row_max(const float *s, int64_t n) {
    __m512 vmax = _mm512_set1_ps(-FLT_MAX);
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 keys = lanes_in(i, n);
        vmax = _mm512_mask_max_ps(vmax, keys, vmax, _mm512_maskz_loadu_ps(keys, s + i));
    }
    return _mm512_reduce_max_ps(vmax);
}

/* rowoff[i]: where the row of key start + i (i < n) begins in the arena, in elements, plus `head`. */
static inline void key_rows(const int64_t *table, int64_t start, int64_t n, int page_size, int64_t page_stride,
                            int64_t token_stride, int64_t head, int64_t *rowoff) {
    int64_t page = start / page_size, slot = start % page_size;
    for (int64_t i = 0; i < n; i++, slot++) {
        if (slot == page_size) page++, slot = 0;
        rowoff[i] = table[page] * page_stride + slot * token_stride + head;
    }
}

/* vp[jp][d], pairs jp in [jp0, jp1) of a block of keys: dim d of keys 2jp and 2jp + 1 as one
 * dword (the bf16 dot products' and tile products' pair layout), zeros for keys outside [j0, j1);
 * key j's V row starts at values + rowoff[j]. */
static inline void v_pairs(const bf16 *values, const int64_t *rowoff, int j0, int j1, int jp0, int jp1, int head_dim,
                           int32_t *vp) {
    const __m512i lo_half = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38,
                                             6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi_half = _mm512_add_epi16(lo_half, _mm512_set1_epi16(16));
    for (int jp = jp0; jp < jp1; jp++) {
        const int k0 = 2 * jp, k1 = 2 * jp + 1;
        int32_t *dst = vp + jp * head_dim;
        for (int c = 0; c < head_dim; c += 32) {
            const __m512i v0 = k0 >= j0 && k0 < j1 ? _mm512_loadu_si512(values + rowoff[k0] + c) : _mm512_setzero_si512();
            const __m512i v1 = k1 >= j0 && k1 < j1 ? _mm512_loadu_si512(values + rowoff[k1] + c) : _mm512_setzero_si512();
            _mm512_store_si512(dst + c, _mm512_permutex2var_epi16(v0, lo_half, v1));
            _mm512_store_si512(dst + c + 16, _mm512_permutex2var_epi16(v0, hi_half, v1));
        }
    }
}

/* Transpose 16 rows of 16 dwords in place: afterwards r[c] holds dword c of every row. */
static inline void transpose16_epi32(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) { /* r[4m + j], 128-bit lane k: column 4k + j of rows 4m..4m+3 */
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int j = 0; j < 4; j++) { /* 4x4 transpose of 128-bit lanes across r[j], r[4+j], r[8+j], r[12+j] */
        const __m512i u0 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x44), u1 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xEE);
        const __m512i u2 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x44);
        const __m512i u3 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xEE);
        t[j] = _mm512_shuffle_i32x4(u0, u2, 0x88);
        t[4 + j] = _mm512_shuffle_i32x4(u0, u2, 0xDD);
        t[8 + j] = _mm512_shuffle_i32x4(u1, u3, 0x88);
        t[12 + j] = _mm512_shuffle_i32x4(u1, u3, 0xDD);
    }
    for (int i = 0; i < 16; i++) r[i] = t[i];
}

/* Lane l of the result: the dot product of lanes[*] lane l (dims 2p, 2p+1 of row l, p < pairs)
 * with `x`, a bf16 vector of 2 * pairs dims broadcast a pair at a time; two accumulators. */
static inline __m512 dot_lanes(const __m512i *lanes, const bf16 *x, int pairs) {
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    for (int p = 0; p < pairs; p += 2) {
        int32_t x0, x1;
        memcpy(&x0, x + 2 * p, 4);
        memcpy(&x1, x + 2 * p + 2, 4);
        acc0 = _mm512_dpbf16_ps(acc0, (__m512bh)lanes[p], (__m512bh)_mm512_set1_epi32(x0));
        acc1 = _mm512_dpbf16_ps(acc1, (__m512bh)lanes[p + 1], (__m512bh)_mm512_set1_epi32(x1));
    }
    return _mm512_add_ps(acc0, acc1);
}

/* Keys read ahead: a sequence's pages are scattered over the arena, so the hardware prefetcher
 * cannot follow its K and V rows from page to page; asking for the rows 16 keys ahead (into L2)
 * halves the time of a decode whose KV is not in cache (64 sequences x 200 keys, head_dim 32). */
#define KV_AHEAD 16
/* p.v for a tile of the V row: C chunks of 32 values (each inside one KV head: head_dim % 32 ==
 * 0) by G query heads of their groups. One 64-byte load gives a chunk's even values (a dword's low
 * bf16, shifted up) and odd values (its high bf16, masked): 2 C G independent fp32 accumulators,
 * enough to hide the FMA latency that one accumulator a query head and 16 values was bound by.
 * Each output value still sums its keys in order with one FMA a key (the same bits). */
#define PV_TILE(C, G)                                                                                      \
    static void pv_tile_##C##_##G(const bf16 *values, const int64_t *rowoff, int64_t n, const float *scores, \
                                  const float *inv, int c0, int g0, int group, int head_dim, bf16 *o) {    \
        const float *s[C][G];                                                                               \
        __m512 even[C][G], odd[C][G];                                                                       \
        for (int c = 0; c < C; c++)                                                                         \
            for (int g = 0; g < G; g++) {                                                                   \
                s[c][g] = scores + (int64_t)((c0 + c) * 32 / head_dim * group + g0 + g) * n;                \
                even[c][g] = odd[c][g] = _mm512_setzero_ps();                                               \
            }                                                                                               \
        const __m512i high = _mm512_set1_epi32((int)0xFFFF0000);                                            \
        for (int64_t i = 0; i < n; i++) {                                                                   \
            const bf16 *row = values + rowoff[i] + c0 * 32;                                                 \
            for (int c = 0; c < C && i + KV_AHEAD < n; c++)                                                 \
                _mm_prefetch((const char *)(values + rowoff[i + KV_AHEAD] + (c0 + c) * 32), _MM_HINT_T1);  \
            for (int c = 0; c < C; c++) {                                                                   \
                const __m512i v = _mm512_loadu_si512(row + 32 * c);                                         \
                const __m512 ve = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));                            \
                const __m512 vo = _mm512_castsi512_ps(_mm512_and_si512(v, high));                           \
                for (int g = 0; g < G; g++) {                                                               \
                    const __m512 p = _mm512_set1_ps(s[c][g][i]);                                            \
                    even[c][g] = _mm512_fmadd_ps(p, ve, even[c][g]);                                        \
                    odd[c][g] = _mm512_fmadd_ps(p, vo, odd[c][g]);                                          \
                }                                                                                           \
            }                                                                                               \
        }                                                                                                   \
        for (int c = 0; c < C; c++)                                                                         \
            for (int g = 0; g < G; g++) {                                                                   \
                const int hq = (c0 + c) * 32 / head_dim * group + g0 + g;                                   \
                float e[16], d[16];                                                                         \
                _mm512_storeu_ps(e, _mm512_mul_ps(even[c][g], _mm512_set1_ps(inv[hq])));                   \
                _mm512_storeu_ps(d, _mm512_mul_ps(odd[c][g], _mm512_set1_ps(inv[hq])));                     \
                bf16 *out = o + (int64_t)hq * head_dim + (c0 + c) * 32 % head_dim;                          \
                for (int l = 0; l < 16; l++) out[2 * l] = store_bf16(e[l]), out[2 * l + 1] = store_bf16(d[l]); \
            }                                                                                               \
    }
PV_TILE(4, 1)
PV_TILE(4, 2)
PV_TILE(2, 4)
PV_TILE(1, 1)
PV_TILE(1, 2)
PV_TILE(1, 4)

static void pv_tile(int c_tile, int g_tile, const bf16 *values, const int64_t *rowoff, int64_t n,
                    const float *scores, const float *inv, int c0, int g0, int group, int head_dim, bf16 *o) {
    void (*tile)(const bf16 *, const int64_t *, int64_t, const float *, const float *, int, int, int, int, bf16 *) =
        c_tile == 4 ? (g_tile == 1 ? pv_tile_4_1 : pv_tile_4_2)
        : c_tile == 2 ? pv_tile_2_4
        : (g_tile == 1 ? pv_tile_1_1 : g_tile == 2 ? pv_tile_1_2 : pv_tile_1_4);
    tile(values, rowoff, n, scores, inv, c0, g0, group, head_dim, o);
}

/* One sequence's decode. Keys go 16 at a time into the lanes of a vector: a block of 16 key
 * rows of one KV head is transposed to kt[p] = dims (2p, 2p+1) of each key, so q.k for a query
 * head is head_dim/2 bf16 dot products with the query's pair broadcast, giving 16 scores with no
 * horizontal sum; each block is transposed once for the group of query heads sharing it. */
static void decode_seq_bf16(const bf16 *qb, const bf16 *k_cache, int64_t page_stride, int64_t v_offset,
                            const int64_t *table, int64_t start, int64_t len, int q_heads, int kv_heads,
                            int head_dim, int page_size, float scale, float *scores, int64_t *rowoff, __m512i *kt,
                            bf16 *o) {
    const int group = q_heads / kv_heads, pairs = head_dim / 2;
    const int64_t n = len - start;
    const int64_t token_stride = (int64_t)kv_heads * head_dim;
    const __m512 vscale = _mm512_set1_ps(scale);
    key_rows(table, start, n, page_size, page_stride, token_stride, 0, rowoff);
    const int row_lines = (int)(token_stride * sizeof(bf16) / 64);
    for (int64_t i0 = 0; i0 < n; i0 += 16) {
        for (int64_t j = i0 + KV_AHEAD; j < i0 + KV_AHEAD + 16 && j < n; j++) /* every head's K rows */
            for (int l = 0; l < row_lines; l++) _mm_prefetch((const char *)(k_cache + rowoff[j]) + 64 * l, _MM_HINT_T1);
        const int m = n - i0 < 16 ? (int)(n - i0) : 16;
        for (int h = 0; h < kv_heads; h++) {
            const bf16 *head = k_cache + (int64_t)h * head_dim;
            for (int c = 0; c < pairs; c += 16) {
                __m512i r[16];
                for (int j = 0; j < 16; j++)
                    r[j] = j < m ? _mm512_loadu_si512(head + rowoff[i0 + j] + 2 * c) : _mm512_setzero_si512();
                transpose16_epi32(r);
                for (int p = 0; p < 16; p++) kt[c + p] = r[p];
            }
            const __mmask16 keys = (__mmask16)((1u << m) - 1);
            for (int g = 0; g < group; g++) {
                const int hq = h * group + g;
                const bf16 *qh = qb + (int64_t)hq * head_dim;
                _mm512_mask_storeu_ps(scores + hq * n + i0, keys, _mm512_mul_ps(dot_lanes(kt, qh, pairs), vscale));
            }
        }
    }
    float inv[q_heads];
    for (int hq = 0; hq < q_heads; hq++) {
        float *s = scores + hq * n;
        const __m512 m = _mm512_set1_ps(row_max(s, n));
        __m512 vsum = _mm512_setzero_ps();
        for (int64_t i = 0; i < n; i += 16) {
            const __mmask16 keys = lanes_in(i, n);
            const __m512 e = _mm512_maskz_mov_ps(keys, exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(keys, s + i), m)));
            _mm512_mask_storeu_ps(s + i, keys, e);
            vsum = _mm512_add_ps(vsum, e);
        }
        inv[hq] = 1.0f / _mm512_reduce_add_ps(vsum);
    }
    /* p.v: the V row in tiles of c_tile chunks of 32 values by g_tile query heads (pv_tile) */
    const bf16 *values = k_cache + v_offset;
    const int chunks = kv_heads * head_dim / 32, g_tile = group % 4 == 0 ? 4 : group % 2 == 0 ? 2 : 1;
    const int c_tile = g_tile == 4 ? 2 : 4;
    for (int g0 = 0; g0 < group; g0 += g_tile) {
        int c0 = 0;
        for (; c0 + c_tile <= chunks; c0 += c_tile)
            pv_tile(c_tile, g_tile, values, rowoff, n, scores, inv, c0, g0, group, head_dim, o);
        for (; c0 < chunks; c0++) pv_tile(1, g_tile, values, rowoff, n, scores, inv, c0, g0, group, head_dim, o);
    }
}

/* paged_prefill_bf16: causal attention of chunks of queries over their KV pages, read in
 * place: sequence b's q_lens[b] queries start at flat row q_starts[b], query i sits at
 * position ctx_lens[b] - q_lens[b] + i and sees keys [max(0, pos + 1 - window), pos + 1).
 * A row is one (query, query head of a KV head's group); a tile is 16 rows in the 16 lanes of
 * a vector, and a work item is (sequence, KV head, up to PREFILL_TILES consecutive tiles; with
 * AMX tiles and head_dim >= 64 up to PREFILL_TILES_MAX while the call keeps 4 items a thread),
 * so one pass over a KV head's pages serves its query heads and the item's tiles share each
 * block of keys. Keys go in blocks of 32, FlashAttention-2's online softmax per
 * row: q.k for 8 keys at a time (bf16 dot products, each loaded pair of q reused by the 8, the
 * key's pair broadcast from its page), the block's scores, the row's running max and its exps,
 * then p.v as bf16 dot products too (p rounded to bf16; the block's V rows interleaved a pair
 * of keys at a time, once for the item's tiles), accumulating head_dim x 16 rows in fp32.
 * Order of sums, per row: a score is its dims' pairs summed in order in one fp32 chain, times
 * scale * log2(e) (the exps are powers of 2); key blocks are aligned to absolute positions
 * [32j, 32j + 32); after block j the reference is m_j = m_{j-1}, or max(m_{j-1}, the block's
 * scores) where that passes m_{j-1} (with tiles: by more than RESCALE_SLACK, so a p is at most 2^8
 * and most blocks rescale nothing), and both the
 * denominator and each output value are (their value after block j - 1) * 2^(m_{j-1} - m_j),
 * then plus the block's pairs of keys
 * (2i, 2i + 1) in order, one dot product instruction a pair (bf16(p) times v, or times 1 for the
 * denominator); the output is that sum times 1 / the denominator, rounded to bf16 once. Keys a
 * row does not see, and blocks or pairs its tile skips, add exact zeros and scale by exactly 1,
 * so a row's bits depend only on its own query and keys, never on the chunk, tile, item or
 * batch around it. head_dim must be a multiple of 32.
 *
 * With `tiles` (AMX-BF16; `prefill_tiles_available`), the two products run as tile products
 * and the softmax between them as above: a block's scores are S^T = K . Q^T (A: 16 keys' K rows
 * in a [32][head_dim] copy, zeros for keys out of the item's range; B: the tile's qt, 32 dims a
 * tile; C: [key][row], the vector path's `s` layout), and its output O += P . V (A: the tile's p
 * pairs transposed to rows; B: the V pairs; C: O [row][head_dim] fp32, scaled by alpha first).
 * The tile sums each score's and each output's 16 pairs of a product in the order the silicon
 * adds them, rows independent of one another, so the same invariance holds; the bits differ
 * from the vector path's. */
#define PREFILL_TILE 16
#define PREFILL_TILES 8     /* tiles a work item on the vector path */
#define PREFILL_TILES_MAX 32 /* with tiles: a block's K rows and V pairs serve up to this many tiles */
#define KEY_BLOCK 32
#define MASKED_SCORE (-1e30f) /* finite: -ffast-math assumes no infinities */
#define RESCALE_SLACK 8.0f /* base 2 */

/* acc + a . (the bf16 pair at p, broadcast): the pair as the instruction's broadcast operand
 * (GCC loads it into a register by a separate broadcast). */
static inline __attribute__((always_inline)) __m512 dpbf16_bcast(__m512 acc, __m512bh a, const void *p) {
    __asm__("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(a), "m"(*(const int32_t *)p));
    return acc;
}

/* Scores of 8 keys for a tile's 16 rows: dots[u] lane l = q row l . key row kr[u], one chain
 * a key over the pairs of dims in order. */
static inline __attribute__((always_inline)) void qk_keys8(const __m512i *qt, const bf16 *const *kr, int pairs,
                                                           __m512 *dots) {
    __m512 acc[8];
    for (int u = 0; u < 8; u++) acc[u] = _mm512_setzero_ps();
    for (int p = 0; p < pairs; p++) {
        const __m512bh qv = (__m512bh)_mm512_load_si512(qt + p);
        for (int u = 0; u < 8; u++) acc[u] = dpbf16_bcast(acc[u], qv, kr[u] + 2 * p);
    }
    for (int u = 0; u < 8; u++) dots[u] = acc[u];
}

static void qk_block(const __m512i *qt, const bf16 *const *kr, int pairs, int n, __m512 *dots) {
    for (int j = 0; j < n; j += 8) {
        if (pairs == 16)
            qk_keys8(qt, kr + j, 16, dots + j); /* head_dim 32: q stays in registers */
        else
            qk_keys8(qt, kr + j, pairs, dots + j);
    }
}

/* acc[a] += sum over the pairs jp in [p0, p1) of P[jp] . vp[jp][a] for 16 accumulators a (lanes:
 * rows), scaled first by alpha where `rescale`. */
static inline void pv_chunk(float *accp, const __m512i *P, const int32_t *vp, int vp_stride, int p0, int p1,
                            int rescale, __m512 alpha) {
    __m512 acc[16];
    for (int a = 0; a < 16; a++) {
        acc[a] = _mm512_load_ps(accp + 16 * a);
        if (rescale) acc[a] = _mm512_mul_ps(acc[a], alpha);
    }
    for (int jp = p0; jp < p1; jp++) {
        const __m512bh pv = (__m512bh)_mm512_load_si512(P + jp);
        const int32_t *v = vp + jp * vp_stride;
        for (int a = 0; a < 16; a++) acc[a] = dpbf16_bcast(acc[a], pv, v + a);
    }
    for (int a = 0; a < 16; a++) _mm512_store_ps(accp + 16 * a, acc[a]);
}

/* 2^x for x <= 0 where the result is rounded to bf16 next: 2^round(x) times a degree-4
 * polynomial of 2^f, |f| <= 1/2 (relative error ~3e-6, against bf16's 2^-9); exactly 1 at x = 0,
 * exactly 0 at x = MASKED_SCORE. */
static inline __m512 exp2_bf16_ps(__m512 x) {
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(9.58277099e-03f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.59062362e-02f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.40240991e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.93124235e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

typedef struct {
    int32_t lo[PREFILL_TILE], hi[PREFILL_TILE]; /* each lane's keys [lo, hi) */
    __m512 m, den;                              /* running reference max and denominator */
    __m512i *qt;                                /* [head_dim / 2]: lane l holds dims (2p, 2p + 1) of row l */
    float *acc;                                 /* p.v sums: [head_dim][16], with tiles [16][head_dim] */
} prefill_tile;

/* A block of 32 keys as both paths read it. */
typedef struct {
    const bf16 *kr[KEY_BLOCK]; /* each key's K row (a key out of the item's range: another key's row) */
    const bf16 *kb;            /* tiles: the K rows [KEY_BLOCK][head_dim], zeros out of the item's range */
    __m512i *P;                /* [KEY_BLOCK / 2]: lane l: bf16 p of keys 2jp, 2jp + 1 */
    const int32_t *vp;         /* [KEY_BLOCK / 2][head_dim]: dim d of keys 2jp, 2jp + 1 */
    int tiles;
} key_block;

#if (defined(__AMX_TILE__) && defined(__AMX_BF16__)) || defined(TREESERVE_AMX_EMULATED)
#include "amx.h"
#define HAVE_TILES 1

static void configure_tiles(void) {
    tile_config cfg = {0};
    cfg.palette = 1;
    for (int t = 0; t < 7; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64; /* 0-1 S^T, 2 K, 3 Q^T, 4 P, 5 V, 6 O */
    _tile_loadconfig(&cfg);
}

/* s[j] lane l = key j . row l for the keys of halves [h0, h1) of the block (16 keys a half). */
static void qk_tiles(const prefill_tile *tile, const bf16 *kb, int head_dim, int h0, int h1, __m512 *s) {
    const int64_t k_stride = 2 * head_dim;
    _tile_zero(0);
    _tile_zero(1);
    for (int c = 0; c < head_dim / 32; c++) {
        _tile_loadd(3, tile->qt + 16 * c, 64);
        if (h0 == 0) {
            _tile_loadd(2, kb + 32 * c, k_stride);
            _tile_dpbf16ps(0, 2, 3);
        }
        if (h1 == 2) {
            _tile_loadd(2, kb + 16 * head_dim + 32 * c, k_stride);
            _tile_dpbf16ps(1, 2, 3);
        }
    }
    if (h0 == 0) _tile_stored(0, s, 64);
    if (h1 == 2) _tile_stored(1, s + 16, 64);
}

/* acc[l][:] = acc[l][:] * alpha lane l (where `rescale`) + P row l . V, P's 16 pairs (zeros
 * outside the tile's keys) transposed to rows. */
static void pv_tiles(float *acc, const __m512i *P, const int32_t *vp, int head_dim, int rescale, __m512 alpha) {
    __m512i rows[16];
    for (int jp = 0; jp < 16; jp++) rows[jp] = _mm512_load_si512(P + jp);
    transpose16_epi32(rows);
    _tile_loadd(4, rows, 64);
    if (rescale) {
        float a[16];
        _mm512_storeu_ps(a, alpha);
        for (int l = 0; l < 16; l++) {
            const __m512 al = _mm512_set1_ps(a[l]);
            for (int d = 0; d < head_dim; d += 16)
                _mm512_store_ps(acc + l * head_dim + d, _mm512_mul_ps(_mm512_load_ps(acc + l * head_dim + d), al));
        }
    }
    for (int d = 0; d < head_dim; d += 16) {
        _tile_loadd(6, acc + d, 4 * head_dim);
        _tile_loadd(5, vp + d, 4 * head_dim);
        _tile_dpbf16ps(6, 4, 5);
        _tile_stored(6, acc + d, 4 * head_dim);
    }
}

/* Decode on tiles, a KV group of `group` <= 16 query heads (one query each) a pass over the KV
 * head's keys. Scores S = K . Q^T, 16 keys a tile product and 32 dims a step (A: the 16 keys' K
 * rows, read in place where they are one run of a page, else copied, zeros past the context; B:
 * the group's q pairs; C: [16 keys][group] fp32 over all dims, times scale once). The softmax
 * per head as decode_seq_bf16's (fp32 exps of s - max); p is rounded to bf16 and the
 * denominator sums the rounded p (vector lanes in order, then across lanes). O = P . V in
 * blocks of 32 keys, 16 dims a tile product (A: P [group][32 keys]; B: the block's V pairs; C:
 * O [group][16 dims] fp32, read, added to and written back a block); the output is O times
 * 1 / the denominator, rounded to bf16 once. A sequence's bits depend on its query and keys
 * only, not on the batch around it. */
#define DT_S 0 /* the decode tiles (numerals: the tile intrinsics paste them into register names) */
#define DT_K 1
#define DT_Q 2
#define DT_O 3
#define DT_P 4
#define DT_V 5

static void configure_decode_tiles(int group) {
    tile_config cfg = {0};
    cfg.palette = 1;
    cfg.rows[DT_S] = 16, cfg.colsb[DT_S] = (uint16_t)(4 * group);
    cfg.rows[DT_K] = 16, cfg.colsb[DT_K] = 64;
    cfg.rows[DT_Q] = 16, cfg.colsb[DT_Q] = (uint16_t)(4 * group);
    cfg.rows[DT_O] = (uint8_t)group, cfg.colsb[DT_O] = 64;
    cfg.rows[DT_P] = (uint8_t)group, cfg.colsb[DT_P] = 64;
    cfg.rows[DT_V] = 16, cfg.colsb[DT_V] = 64;
    _tile_loadconfig(&cfg);
}

/* A sequence's buffers: q pairs [head_dim / 2][group], K rows [16][head_dim], S [n32][group], V
 * pairs [16][head_dim], O [group][head_dim], scores [group][n32], P [group][n32] bf16, key row
 * offsets [n]. */
typedef struct {
    int32_t *qt, *vp;
    bf16 *k_rows, *P;
    float *s_tiles, *acc, *scores;
    int64_t *rowoff;
} decode_buffers;

/* Their bytes, each 64-byte aligned; where `buf` is not NULL, b's pointers into it. */
static size_t decode_buffers_in(char *buf, int64_t n, int group, int head_dim, decode_buffers *b) {
    const int64_t n32 = (n + 31) / 32 * 32;
    size_t at = 0;
#define DT_TAKE(field, type, count)                                     \
    if (buf) b->field = (type *)(buf + at);                             \
    at += ((size_t)(count) * sizeof(type) + 63) / 64 * 64
    DT_TAKE(qt, int32_t, head_dim / 2 * group);
    DT_TAKE(k_rows, bf16, 16 * head_dim);
    DT_TAKE(s_tiles, float, n32 * group);
    DT_TAKE(vp, int32_t, 16 * head_dim);
    DT_TAKE(acc, float, group * head_dim);
    DT_TAKE(scores, float, group * n32);
    DT_TAKE(P, bf16, group * n32);
    DT_TAKE(rowoff, int64_t, n);
#undef DT_TAKE
    return at;
}

static void decode_seq_tiles(const bf16 *qb, const bf16 *k_cache, int64_t page_stride, int64_t v_offset,
                             const int64_t *table, int64_t start, int64_t len, int kv_heads, int head_dim,
                             int group, int page_size, float scale, char *buf, bf16 *o) {
    const int pairs = head_dim / 2;
    const int64_t n = len - start, n32 = (n + 31) / 32 * 32, token_stride = (int64_t)kv_heads * head_dim;
    decode_buffers b;
    decode_buffers_in(buf, n, group, head_dim, &b);
    int32_t *qt = b.qt, *vp = b.vp;
    bf16 *k_rows = b.k_rows, *P = b.P;
    float *s_tiles = b.s_tiles, *acc = b.acc, *scores = b.scores;
    int64_t *rowoff = b.rowoff;
    key_rows(table, start, n, page_size, page_stride, token_stride, 0, rowoff);
    const bf16 *values = k_cache + v_offset;
    const int head_lines = head_dim * (int)sizeof(bf16) / 64;
    const __m512i lanes_at = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                                _mm512_set1_epi32(group));
    for (int h = 0; h < kv_heads; h++) {
        for (int g = 0; g < group; g++) { /* qt[p][g]: dims (2p, 2p + 1) of query head g */
            const int32_t *qh = (const int32_t *)(qb + (int64_t)(h * group + g) * head_dim);
            for (int p = 0; p < pairs; p++) qt[p * group + g] = qh[p];
        }
        for (int64_t i0 = 0; i0 < n; i0 += 16) {
            for (int64_t j = i0 + KV_AHEAD; j < i0 + KV_AHEAD + 16 && j < n; j++)
                for (int l = 0; l < head_lines; l++)
                    _mm_prefetch((const char *)(k_cache + rowoff[j] + (int64_t)h * head_dim) + 64 * l, _MM_HINT_T1);
            const int m = n - i0 < 16 ? (int)(n - i0) : 16;
            const bf16 *kr = k_cache + rowoff[i0] + (int64_t)h * head_dim;
            int64_t k_stride = token_stride;
            int run = m == 16; /* the 16 keys' rows one after another (one run of a page) */
            for (int j = 1; j < 16 && run; j++) run = rowoff[i0 + j] == rowoff[i0] + j * token_stride;
            if (!run) {
                for (int j = 0; j < 16; j++) {
                    if (j < m) memcpy(k_rows + j * head_dim, k_cache + rowoff[i0 + j] + (int64_t)h * head_dim, 2 * (size_t)head_dim);
                    else memset(k_rows + j * head_dim, 0, 2 * (size_t)head_dim);
                }
                kr = k_rows, k_stride = head_dim;
            }
            _tile_zero(DT_S);
            for (int c = 0; c < head_dim / 32; c++) {
                _tile_loadd(DT_K, kr + 32 * c, 2 * k_stride);
                _tile_loadd(DT_Q, qt + 16 * c * group, 4 * group);
                _tile_dpbf16ps(DT_S, DT_K, DT_Q);
            }
            _tile_stored(DT_S, s_tiles + i0 * group, 4 * group);
        }
        for (int64_t i0 = 0; i0 < n; i0 += 16) { /* read once every store is done: no load waits on one */
            const __mmask16 keys = lanes_in(i0, n);
            for (int g = 0; g < group; g++) {
                const __m512 sg = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), keys, lanes_at, s_tiles + i0 * group + g, 4);
                _mm512_store_ps(scores + g * n32 + i0, _mm512_mul_ps(sg, _mm512_set1_ps(scale)));
            }
        }
        float inv[16];
        for (int g = 0; g < group; g++) {
            float *s = scores + g * n32;
            const __m512 mx = _mm512_set1_ps(row_max(s, n));
            __m512 vsum = _mm512_setzero_ps();
            for (int64_t i = 0; i < n32; i += 16) { /* zeros past the context */
                const __mmask16 keys = lanes_in(i, n);
                const __m512 e = _mm512_maskz_mov_ps(keys, exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(keys, s + i), mx)));
                const __m256bh pb = _mm512_cvtneps_pbh(e);
                _mm256_store_si256((__m256i *)(P + g * n32 + i), (__m256i)pb);
                vsum = _mm512_add_ps(vsum, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)pb), 16)));
            }
            inv[g] = 1.0f / _mm512_reduce_add_ps(vsum);
        }
        memset(acc, 0, sizeof(float) * group * head_dim);
        for (int64_t b0 = 0; b0 < n; b0 += 32) {
            for (int64_t j = b0 + 32; j < b0 + 64 && j < n; j++) /* the next block's V rows */
                for (int l = 0; l < head_lines; l++)
                    _mm_prefetch((const char *)(values + rowoff[j] + (int64_t)h * head_dim) + 64 * l, _MM_HINT_T0);
            const int in_block = n - b0 < 32 ? (int)(n - b0) : 32; /* zeros past the context */
            v_pairs(values + (int64_t)h * head_dim, rowoff + b0, 0, in_block, 0, 16, head_dim, vp);
            _tile_loadd(DT_P, P + b0, 2 * n32);
            for (int d = 0; d < head_dim; d += 16) {
                _tile_loadd(DT_O, acc + d, 4 * head_dim);
                _tile_loadd(DT_V, vp + d, 4 * head_dim);
                _tile_dpbf16ps(DT_O, DT_P, DT_V);
                _tile_stored(DT_O, acc + d, 4 * head_dim);
            }
        }
        for (int g = 0; g < group; g++) {
            bf16 *out = o + (int64_t)(h * group + g) * head_dim;
            const __m512 ig = _mm512_set1_ps(inv[g]);
            for (int d = 0; d < head_dim; d += 16)
                _mm256_storeu_si256((__m256i *)(out + d), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(acc + g * head_dim + d), ig)));
        }
    }
}
#endif

int prefill_tiles_available(void) {
#ifdef HAVE_TILES
    return amx_usable();
#else
    return 0;
#endif
}

/* The keys of block [b0, b0 + 32) a tile whose keys fall in [klo, khi) sees, [j0, j1), and
 * those it scores, [q0, q1): octets, or with tiles halves. */
typedef struct {
    int j0, j1, q0, q1;
} block_span;

static inline block_span span_of(const key_block *kb, int64_t b0, int64_t klo, int64_t khi) {
    block_span sp;
    sp.j0 = (int)((klo > b0 ? klo : b0) - b0), sp.j1 = (int)((khi < b0 + KEY_BLOCK ? khi : b0 + KEY_BLOCK) - b0);
    const int step = kb->tiles ? 16 : 8;
    sp.q0 = sp.j0 / step * step, sp.q1 = (sp.j1 + step - 1) / step * step;
    return sp;
}

/* s[q0, q1): the tile's raw scores of the block's keys (keys out of [j0, j1) are masked later). */
static inline __attribute__((always_inline)) void block_scores(const prefill_tile *tile, const key_block *kb, block_span sp, int head_dim, __m512 *s) {
#ifdef HAVE_TILES
    if (kb->tiles) {
        qk_tiles(tile, kb->kb, head_dim, sp.q0 / 16, sp.q1 / 16, s);
        return;
    }
#endif
    qk_block(tile->qt, kb->kr + sp.q0, head_dim / 2, sp.q1 - sp.q0, s + sp.q0);
}

/* One block of keys [b0, b0 + 32) for a tile whose keys fall in [klo, khi): scores (with tiles
 * already in s, from `block_scores`), online softmax, then p.v. */
static inline __attribute__((always_inline)) void prefill_block(prefill_tile *tile, const key_block *kb, int64_t b0, int64_t klo, int64_t khi,
                          int head_dim, float scale, __m512 *s) {
    const block_span sp = span_of(kb, b0, klo, khi);
    const int j0 = sp.j0, j1 = sp.j1, q0 = sp.q0, q1 = sp.q1;
    __m512 own[KEY_BLOCK] __attribute__((aligned(64)));
    if (!kb->tiles) s = own, block_scores(tile, kb, sp, head_dim, s);
    __m512i *P = kb->P;
    /* every row sees every key of the block: no masks */
    const int full = j0 == 0 && j1 == KEY_BLOCK && tile->lo[PREFILL_TILE - 1] <= b0 && tile->hi[0] >= b0 + KEY_BLOCK;
    /* scores in base 2: exp(x * scale) = 2^(x * scale * log2 e) */
    const __m512 vscale = _mm512_set1_ps(scale * 1.44269504088896341f), vmasked = _mm512_set1_ps(MASKED_SCORE);
    const __m512i vlo = _mm512_loadu_si512(tile->lo), vhi = _mm512_loadu_si512(tile->hi);
    __m512 bmax = vmasked;
    for (int j = q0; j < q1; j++) {
        s[j] = _mm512_mul_ps(s[j], vscale);
        if (!full) {
            const __m512i vt = _mm512_set1_epi32((int32_t)(b0 + j));
            const __mmask16 valid = _mm512_cmpge_epi32_mask(vt, vlo) & _mm512_cmplt_epi32_mask(vt, vhi);
            s[j] = _mm512_mask_mov_ps(vmasked, valid, s[j]);
        }
        bmax = _mm512_max_ps(bmax, s[j]);
    }
    /* with tiles, the reference moves only where the block's max passes it by more than
     * RESCALE_SLACK (O lives in memory between tile products: a rescale is a round trip) */
    const __m512 slack = _mm512_set1_ps(kb->tiles ? RESCALE_SLACK : 0.0f);
    const __mmask16 moves = _mm512_cmp_ps_mask(bmax, _mm512_add_ps(tile->m, slack), _CMP_GT_OQ);
    const __m512 m_new = _mm512_mask_max_ps(tile->m, moves, tile->m, bmax);
    const __m512 alpha = exp2_bf16_ps(_mm512_sub_ps(tile->m, m_new)); /* exactly 1 where it stays */
    const int rescale = moves != 0;
    tile->m = m_new;
    const __m512 unmasked = _mm512_set1_ps(MASKED_SCORE / 2);
    const __m512i ones = _mm512_set1_epi32(0x3F803F80); /* bf16 (1, 1): the denominator's pairs */
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                                22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    __m512 den = _mm512_mul_ps(tile->den, alpha);
    const int p0 = q0 / 2, p1 = q1 / 2; /* pairs of keys: a key the tile does not see gets p = 0 */
    for (int jp = p0; jp < p1; jp++) {
        __m512 e0 = exp2_bf16_ps(_mm512_sub_ps(s[2 * jp], m_new)), e1 = exp2_bf16_ps(_mm512_sub_ps(s[2 * jp + 1], m_new));
        if (!full) { /* a row with no key yet has m_new = MASKED_SCORE */
            e0 = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(s[2 * jp], unmasked, _CMP_GT_OQ), e0);
            e1 = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(s[2 * jp + 1], unmasked, _CMP_GT_OQ), e1);
        }
        const __m512i pair = _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
        _mm512_store_si512(P + jp, pair);
        den = _mm512_dpbf16_ps(den, (__m512bh)pair, (__m512bh)ones);
    }
    tile->den = den;
#ifdef HAVE_TILES
    if (kb->tiles) { /* the tile product takes all 16 pairs: zeros for keys the tile does not score */
        for (int jp = 0; jp < KEY_BLOCK / 2; jp++)
            if (jp < p0 || jp >= p1) _mm512_store_si512(P + jp, _mm512_setzero_si512());
        pv_tiles(tile->acc, P, kb->vp, head_dim, rescale, alpha);
        return;
    }
#endif
    for (int a = 0; a < head_dim; a += 16)
        pv_chunk(tile->acc + 16 * a, P, kb->vp + a, head_dim, p0, p1, rescale, alpha);
}

static void prefill_item_bf16(const bf16 *q, int64_t q_row_stride, const bf16 *k_cache, int64_t page_stride,
                              int64_t v_offset, const int64_t *table, int page_size, int64_t token_stride,
                              int kv_head, int head_dim, int group, int64_t first_pos, int first_row, int rows,
                              int64_t window, float scale, int tiles_on, char *buf, bf16 *out) {
    const int pairs = head_dim / 2, tiles = (rows + PREFILL_TILE - 1) / PREFILL_TILE;
    prefill_tile tile[PREFILL_TILES_MAX];
    __m512(*scores)[KEY_BLOCK] = (__m512(*)[KEY_BLOCK])buf; /* with tiles: [tiles][KEY_BLOCK] */
    char *next = buf + (tiles_on ? sizeof(__m512) * KEY_BLOCK * tiles : 0);
    for (int t = 0; t < tiles; t++) {
        prefill_tile *T = tile + t;
        T->qt = (__m512i *)next;
        T->acc = (float *)(T->qt + pairs);
        next = (char *)(T->acc + 16 * head_dim);
        memset(T->acc, 0, sizeof(float) * 16 * head_dim);
        T->m = _mm512_set1_ps(MASKED_SCORE), T->den = _mm512_setzero_ps();
        const bf16 *qr[PREFILL_TILE];
        for (int l = 0; l < PREFILL_TILE; l++) {
            const int i = t * PREFILL_TILE + l, r = first_row + (i < rows ? i : rows - 1); /* padding: the last row, unwritten */
            const int64_t pos = first_pos + r / group;
            T->hi[l] = (int32_t)(pos + 1);
            T->lo[l] = window > 0 && pos + 1 > window ? (int32_t)(pos + 1 - window) : 0;
            qr[l] = q + (int64_t)(r / group) * q_row_stride + (int64_t)(kv_head * group + r % group) * head_dim;
        }
        for (int c = 0; c < pairs; c += 16) { /* 16 rows x 16 pairs of dims, transposed */
            __m512i r[16];
            for (int l = 0; l < PREFILL_TILE; l++) r[l] = _mm512_loadu_si512(qr[l] + 2 * c);
            transpose16_epi32(r);
            for (int p = 0; p < 16; p++) _mm512_store_si512(T->qt + c + p, r[p]);
        }
    }
    key_block kb = {.P = (__m512i *)next, .tiles = tiles_on};
    int32_t *vp = (int32_t *)(kb.P + KEY_BLOCK / 2);
    bf16 *k_rows = (bf16 *)(vp + KEY_BLOCK / 2 * head_dim); /* kb.kb: [KEY_BLOCK][head_dim] */
    kb.vp = vp, kb.kb = k_rows;
    int64_t *rowoff = (int64_t *)(k_rows + KEY_BLOCK * head_dim);
    const int64_t klo = tile[0].lo[0], khi = tile[tiles - 1].hi[PREFILL_TILE - 1];
    /* rowoff[t]: key t's K row in the arena */
    key_rows(table, klo, khi - klo, page_size, page_stride, token_stride, (int64_t)kv_head * head_dim, rowoff + klo);
    const bf16 *values = k_cache + v_offset;
    const int row_lines = head_dim * (int)sizeof(bf16) / 64;
    for (int64_t b0 = klo / KEY_BLOCK * KEY_BLOCK; b0 < khi; b0 += KEY_BLOCK) {
        const block_span item = span_of(&kb, b0, klo, khi); /* the keys any of the item's tiles sees */
        const int j0 = item.j0, j1 = item.j1;
        /* the next block's K and V rows into L2, not L1: the vector path reads K rows once a
         * tile (with tiles, where K rows are copied once a block, reading ahead cost more than it
         * saved); an item's sums, q pairs and V pairs fill most of L1, and lines asked for into
         * L1 pushed them out */
        for (int64_t t = b0 + KEY_BLOCK; !tiles_on && t < b0 + 2 * KEY_BLOCK && t < khi; t++)
            for (int l = 0; l < row_lines; l++) {
                _mm_prefetch((const char *)(k_cache + rowoff[t]) + 64 * l, _MM_HINT_T1);
                _mm_prefetch((const char *)(values + rowoff[t]) + 64 * l, _MM_HINT_T1);
            }
        const int jp0 = tiles_on ? 0 : j0 / 8 * 4, jp1 = tiles_on ? KEY_BLOCK / 2 : (j1 + 7) / 8 * 4;
        v_pairs(values, rowoff + b0, j0, j1, jp0, jp1, head_dim, vp);
        for (int j = 0; j < KEY_BLOCK; j++) kb.kr[j] = k_cache + rowoff[b0 + (j < j0 || j >= j1 ? j0 : j)];
        if (tiles_on)
            for (int j = j0 / 16 * 16; j < (j1 + 15) / 16 * 16; j++) {
                if (j >= j0 && j < j1) memcpy(k_rows + j * head_dim, kb.kr[j], sizeof(bf16) * head_dim);
                else memset(k_rows + j * head_dim, 0, sizeof(bf16) * head_dim);
            }
        /* with tiles, every tile's scores first: a tile store read back at once by vector loads
         * stalls until it reaches the cache (the vector path scores inside prefill_block) */
        for (int t = 0; t < tiles && tiles_on; t++) {
            const int64_t tlo = tile[t].lo[0], thi = tile[t].hi[PREFILL_TILE - 1];
            if (tlo < b0 + KEY_BLOCK && thi > b0) block_scores(tile + t, &kb, span_of(&kb, b0, tlo, thi), head_dim, scores[t]);
        }
        for (int t = 0; t < tiles; t++) {
            const int64_t tlo = tile[t].lo[0], thi = tile[t].hi[PREFILL_TILE - 1];
            if (tlo < b0 + KEY_BLOCK && thi > b0) prefill_block(tile + t, &kb, b0, tlo, thi, head_dim, scale, scores[t]);
        }
    }
    for (int t = 0; t < tiles; t++) {
        float inv[PREFILL_TILE];
        _mm512_storeu_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.0f), tile[t].den));
        const int n = rows - t * PREFILL_TILE < PREFILL_TILE ? rows - t * PREFILL_TILE : PREFILL_TILE;
        if (tiles_on) { /* acc [16][head_dim]: rows as they lie */
            for (int l = 0; l < n; l++) {
                const int row = first_row + t * PREFILL_TILE + l;
                bf16 *o = out + (int64_t)(row / group) * q_row_stride + (int64_t)(kv_head * group + row % group) * head_dim;
                const __m512 il = _mm512_set1_ps(inv[l]);
                for (int a = 0; a < head_dim; a += 16) {
                    const __m512 x = _mm512_mul_ps(_mm512_load_ps(tile[t].acc + l * head_dim + a), il);
                    _mm256_storeu_si256((__m256i *)(o + a), (__m256i)_mm512_cvtneps_pbh(x));
                }
            }
            continue;
        }
        for (int a = 0; a < head_dim; a += 16) { /* 16 dims x 16 rows, transposed to rows */
            __m512i r[16];
            for (int d = 0; d < 16; d++) r[d] = _mm512_load_si512(tile[t].acc + 16 * (a + d));
            transpose16_epi32(r);
            for (int l = 0; l < n; l++) {
                const int row = first_row + t * PREFILL_TILE + l;
                bf16 *o = out + (int64_t)(row / group) * q_row_stride + (int64_t)(kv_head * group + row % group) * head_dim;
                const __m512 x = _mm512_mul_ps(_mm512_castsi512_ps(r[l]), _mm512_set1_ps(inv[l]));
                _mm256_storeu_si256((__m256i *)(o + a), (__m256i)_mm512_cvtneps_pbh(x));
            }
        }
    }
}

void paged_decode_bf16(const bf16 *q, const bf16 *k_cache, int64_t page_stride, int64_t v_offset,
                       const int64_t *tables, int64_t table_stride, const int64_t *ctx_lens, int batch, int q_heads,
                       int kv_heads, int head_dim, int page_size, float scale, int64_t window, int threads,
                       bf16 *out) {
    if (head_dim % 32 != 0) {
        paged_decode_bf16_generic(q, k_cache, page_stride, v_offset, tables, table_stride, ctx_lens, batch, q_heads,
                                  kv_heads, head_dim, page_size, scale, window, threads, out);
        return;
    }
    const int group = q_heads / kv_heads;
#ifdef HAVE_TILES
    const int tiles = head_dim >= 64 && group <= 16 && amx_usable(); /* at head_dim 32 the vector path was faster */
#else
    const int tiles = 0;
#endif
    _Pragma("omp parallel num_threads(threads)")
    {
#ifdef HAVE_TILES
        if (tiles) configure_decode_tiles(group);
#endif
        _Pragma("omp for schedule(dynamic, 4)")
        for (int b = 0; b < batch; b++) {
            const int64_t len = ctx_lens[b];
            const int64_t start = (window > 0 && len > window) ? len - window : 0;
            const int64_t n = len - start;
            bf16 *o = out + (int64_t)b * q_heads * head_dim;
            const bf16 *qb = q + (int64_t)b * q_heads * head_dim;
            const int64_t *table = tables + (int64_t)b * table_stride;
#ifdef HAVE_TILES
            if (tiles) {
                char *buf = (char *)aligned_alloc(64, decode_buffers_in(NULL, n, group, head_dim, NULL));
                decode_seq_tiles(qb, k_cache, page_stride, v_offset, table, start, len, kv_heads, head_dim, group,
                                 page_size, scale, buf, o);
                free(buf);
                continue;
            }
#endif
            /* buf: kt [head_dim / 2 vectors], key row offsets [n], scores [q_heads][n] */
            const size_t floats = (size_t)head_dim * 8 + (size_t)n * 2 + (size_t)n * q_heads;
            float *buf = (float *)aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64);
            decode_seq_bf16(qb, k_cache, page_stride, v_offset, table, start, len, q_heads, kv_heads, head_dim,
                            page_size, scale, buf + head_dim * 8 + n * 2, (int64_t *)(buf + head_dim * 8),
                            (__m512i *)buf, o);
            free(buf);
        }
#ifdef HAVE_TILES
        if (tiles) _tile_release();
#endif
    }
}

void paged_prefill_bf16(const bf16 *q, const bf16 *k_cache, int64_t page_stride, int64_t v_offset,
                        const int64_t *tables, int64_t table_stride, const int64_t *q_starts, const int64_t *q_lens,
                        const int64_t *ctx_lens, int batch, int q_heads, int kv_heads, int head_dim, int page_size,
                        float scale, int64_t window, int tiles, int threads, bf16 *out) {
    const int group = q_heads / kv_heads;
#ifdef HAVE_TILES
    tiles = tiles && amx_usable();
#else
    tiles = 0;
#endif
    /* with tiles and head_dim >= 64, items as large as leave each thread 4 to take (at head_dim
     * 32 a block's K and V cost little, and 8 tiles' scores and sums stay in L1); an item's size
     * does not change a row's bits */
    int item_tiles = tiles && head_dim >= 64 ? PREFILL_TILES_MAX : PREFILL_TILES;
    while (item_tiles > PREFILL_TILES &&
           prefill_item_count(q_lens, batch, group, kv_heads, PREFILL_TILE * item_tiles) < 4 * threads)
        item_tiles /= 2;
    const int item_rows = PREFILL_TILE * item_tiles;
    const int64_t token_stride = (int64_t)kv_heads * head_dim, q_row_stride = (int64_t)q_heads * head_dim;
    int64_t n, max_ctx;
    prefill_work *work = prefill_work_list(q_lens, ctx_lens, batch, group, kv_heads, item_rows, window, threads, &n, &max_ctx);
    /* per tile: scores with tiles [KEY_BLOCK vectors], qt [head_dim / 2 vectors], p.v sums [head_dim
     * vectors]; P [KEY_BLOCK / 2 vectors], V pairs [KEY_BLOCK / 2 x head_dim dwords], K rows
     * [KEY_BLOCK x head_dim], key row offsets [max_ctx] */
    const size_t bytes = (size_t)64 * (item_tiles * ((tiles ? KEY_BLOCK : 0) + head_dim / 2 + head_dim) + KEY_BLOCK / 2) +
                         sizeof(int32_t) * KEY_BLOCK / 2 * head_dim + sizeof(bf16) * KEY_BLOCK * head_dim +
                         sizeof(int64_t) * (size_t)max_ctx;
    _Pragma("omp parallel num_threads(threads)")
    {
        char *buf = (char *)aligned_alloc(64, (bytes + 63) / 64 * 64);
#ifdef HAVE_TILES
        if (tiles) configure_tiles();
#endif
        _Pragma("omp for schedule(dynamic, 1)")
        for (int64_t w = 0; w < n; w++) {
            const int64_t b = work[w].seq, h = work[w].kv_head, r = work[w].row;
            const int64_t rows = q_lens[b] * group - r;
            prefill_item_bf16(q + q_starts[b] * q_row_stride, q_row_stride, k_cache, page_stride, v_offset,
                              tables + b * table_stride, page_size, token_stride, (int)h, head_dim, group,
                              ctx_lens[b] - q_lens[b], (int)r, rows < item_rows ? (int)rows : item_rows, window,
                              scale, tiles, buf, out + q_starts[b] * q_row_stride);
        }
#ifdef HAVE_TILES
        if (tiles) _tile_release();
#endif
        free(buf);
    }
    free(work);
}

#else
int prefill_tiles_available(void) { return 0; }
void paged_decode_bf16(const bf16 *q, const bf16 *k_cache, int64_t page_stride, int64_t v_offset,
                       const int64_t *tables, int64_t table_stride, const int64_t *ctx_lens, int batch, int q_heads,
                       int kv_heads, int head_dim, int page_size, float scale, int64_t window, int threads,
                       bf16 *out) {
    paged_decode_bf16_generic(q, k_cache, page_stride, v_offset, tables, table_stride, ctx_lens, batch, q_heads,
                              kv_heads, head_dim, page_size, scale, window, threads, out);
}
#endif

/* gated_act_bf16: out[r, i] = bf16(act(gate[r, i]) * up[r, i]) over a fused gate|up output
 * [rows, 2 * inter], act read from `table` (bf16 act(x) for every bf16 bit pattern x, filled by
 * PyTorch's own kernel, padded by 2 entries: AVX-512 gathers read 4 bytes), the product in fp32
 * rounded once to nearest even: PyTorch's bits for act(gate) * up, in one pass over the rows
 * instead of an activation pass and a product pass (the activation alone was ~1 ms a Gemma 3
 * layer at a 512-token prefill). The layer stack calls it too. */
void gated_act_bf16(const bf16 *gate_up, int64_t rows, int64_t inter, const bf16 *table, bf16 *out, int threads) {
    _Pragma("omp parallel for schedule(static) num_threads(threads) if (rows * inter > 65536)")
    for (int64_t r = 0; r < rows; r++) {
        const bf16 *gate = gate_up + r * 2 * inter, *up = gate + inter;
        bf16 *o = out + r * inter;
        int64_t i = 0;
#ifdef __AVX512F__
        for (; i < inter; i += 16) {
            const __mmask16 live = inter - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (inter - i)) - 1);
            const __m512i g = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(live, gate + i));
            const __m512i a = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, g, table, 2);
            const __m512i u = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(live, up + i));
            const __m512i bits = _mm512_castps_si512(_mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(a, 16)),
                                                                   _mm512_castsi512_ps(_mm512_slli_epi32(u, 16))));
            const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
            const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
            _mm256_mask_storeu_epi16(o + i, live, _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
        }
#endif
        for (; i < inter; i++) o[i] = store_bf16(load_bf16(table[gate[i]]) * load_bf16(up[i]));
    }
}

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
 * the compiler targets AVX512-BF16; avx512_bf16_built() tells the caller. */
#ifdef __AVX512BF16__
#include <immintrin.h>

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
#endif

/* rope_bf16: rotary embedding of rows of heads, x [tokens, heads, dim] (rows `row_stride`
 * apart, heads contiguous) into contiguous out, with per-token cos/sin rows [tokens, dim]:
 * out = bf16(bf16(x * cos) + bf16(rotate_half(x) * sin)), the roundings of PyTorch's bf16 ops. */
void rope_bf16(const bf16 *x, int64_t row_stride, int64_t tokens, int heads, int dim, const bf16 *cos,
               const bf16 *sin, bf16 *out, int threads) {
    const int half = dim / 2;
    _Pragma("omp parallel for schedule(static) num_threads(threads) if (tokens * heads * dim > 262144)")
    for (int64_t t = 0; t < tokens; t++) {
        const bf16 *c = cos + t * dim, *s = sin + t * dim;
        for (int h = 0; h < heads; h++) {
            const bf16 *xi = x + t * row_stride + (int64_t)h * dim;
            bf16 *o = out + (t * heads + h) * dim;
            _Pragma("omp simd")
            for (int i = 0; i < half; i++) {
                const float a = load_bf16(xi[i]), b = load_bf16(xi[i + half]);
                const float ac = load_bf16(store_bf16(a * load_bf16(c[i])));
                const float bs = load_bf16(store_bf16(-b * load_bf16(s[i])));
                const float bc = load_bf16(store_bf16(b * load_bf16(c[i + half])));
                const float as = load_bf16(store_bf16(a * load_bf16(s[i + half])));
                o[i] = store_bf16(ac + bs);
                o[i + half] = store_bf16(bc + as);
            }
        }
    }
}

/* store_kv: the K and V rows of `tokens` new tokens (`width` elements of `elem` bytes each, rows
 * `k_stride` / `v_stride` elements apart) copied into their slots (pages[t], offsets[t]) of one
 * layer's cache (page_stride, token_stride elements; V at v_offset elements from K): the bytes
 * `k_cache[pages, offsets] = k` writes, in one call instead of two indexing ops a layer. */
void store_kv(const char *k, int64_t k_stride, const char *v, int64_t v_stride, int64_t tokens, int64_t width,
              int elem, char *k_cache, int64_t page_stride, int64_t token_stride, int64_t v_offset,
              const int64_t *pages, const int64_t *offsets) {
    for (int64_t t = 0; t < tokens; t++) {
        char *slot = k_cache + (pages[t] * page_stride + offsets[t] * token_stride) * elem;
        memcpy(slot, k + t * k_stride * elem, (size_t)(width * elem));
        memcpy(slot + v_offset * elem, v + t * v_stride * elem, (size_t)(width * elem));
    }
}

/* copy_slots: single tokens' K/V, every layer: slot (src_pages[i], src_offsets[i]) onto slot
 * (dst_pages[i], dst_offsets[i]) of an arena whose pages are `page_bytes` apart and each hold,
 * per layer, K then V of `page_size` tokens of `token_bytes` (kv/arena.py's layout): the bytes
 * `buffer[dst_pages, :, :, dst_offsets] = buffer[src_pages, :, :, src_offsets]` writes, without
 * its gathered copy (no slot is both a source and a destination: twins' new slots). */
void copy_slots(char *buffer, int64_t page_bytes, int64_t layers, int64_t page_size, int64_t token_bytes,
                const int64_t *src_pages, const int64_t *src_offsets, const int64_t *dst_pages,
                const int64_t *dst_offsets, int64_t count) {
    const int64_t part = page_size * token_bytes; /* one layer's K, then its V */
    for (int64_t i = 0; i < count; i++) {
        const char *src = buffer + src_pages[i] * page_bytes + src_offsets[i] * token_bytes;
        char *dst = buffer + dst_pages[i] * page_bytes + dst_offsets[i] * token_bytes;
        for (int64_t p = 0; p < 2 * layers; p++) memcpy(dst + p * part, src + p * part, (size_t)token_bytes);
    }
}

/* 1 where the AVX512-BF16 kernels (linear_bf16, paged_prefill_bf16, paged_decode_bf16's fast
 * path) were compiled in: the compiler targets this CPU's AVX512-BF16. */
#ifdef __AVX512BF16__
int avx512_bf16_built(void) { return 1; }
#else
int avx512_bf16_built(void) { return 0; }
#endif

/* The FP8 KV cache (kv_cache_dtype "fp8_e4m3"): pages of e4m3 bytes (fp8.h), each layer with a
 * (k_scale, v_scale) pair at `kv_scales`. A value is stored as e4m3(x * (1 / scale)) and read as
 * e4m3 * scale. Portable C for every CPU (the compiler vectorises the loops for the one it
 * targets; no AVX-512 path reads FP8 pages). The attention of one query row folds the scales
 * where they cost nothing: k_scale into the query, v_scale into the final division. */

/* 1 / x rounded once, as PyTorch divides: under -ffast-math GCC divides through a reciprocal
 * estimate (1 / 1.0f came out 1 - 2^-24, which moved ties of the e4m3 rounding). */
__attribute__((noinline, optimize("no-fast-math"))) static float exact_inverse(float x) { return 1.0f / x; }

/* store_kv_fp8: store_kv for an FP8 cache, the new rows fp32 (src_bf16 0) or bf16 (1). */
void store_kv_fp8(const char *k, int64_t k_stride, const char *v, int64_t v_stride, int64_t tokens, int64_t width,
                  int src_bf16, fp8 *k_cache, int64_t page_stride, int64_t token_stride, int64_t v_offset,
                  const int64_t *pages, const int64_t *offsets, const float *kv_scales) {
    const float inv[2] = {exact_inverse(kv_scales[0]), exact_inverse(kv_scales[1])};
    for (int64_t t = 0; t < tokens; t++) {
        fp8 *slot = k_cache + pages[t] * page_stride + offsets[t] * token_stride;
        for (int part = 0; part < 2; part++) {
            const char *src = part ? v + t * v_stride * (src_bf16 ? 2 : 4) : k + t * k_stride * (src_bf16 ? 2 : 4);
            fp8 *dst = slot + (part ? v_offset : 0);
            const float s = inv[part];
            if (src_bf16) {
                const bf16 *x = (const bf16 *)src;
                _Pragma("omp simd")
                for (int64_t i = 0; i < width; i++) dst[i] = store_fp8(load_bf16(x[i]) * s);
            } else {
                const float *x = (const float *)src;
                _Pragma("omp simd")
                for (int64_t i = 0; i < width; i++) dst[i] = store_fp8(x[i] * s);
            }
        }
    }
}

/* One query row (qf: its q_heads heads in fp32, times the softmax scale and k_scale) over keys
 * [start, len) of a sequence's FP8 pages; acc [q_heads][head_dim] gets sum p v (fp32, in key
 * order), sums the softmax denominators; scores holds (len - start) x q_heads floats. */
static void attend_row_fp8(const float *qf, const fp8 *k_cache, int64_t page_stride, int64_t v_offset,
                           const int64_t *table, int64_t start, int64_t len, int q_heads, int kv_heads, int head_dim,
                           int page_size, float *scores, float *acc, float *sums) {
    const int group = q_heads / kv_heads;
    const int64_t token_stride = (int64_t)kv_heads * head_dim, n = len - start;
    float maxs[q_heads];
    for (int hq = 0; hq < q_heads; hq++) maxs[hq] = -FLT_MAX, sums[hq] = 0.0f;
    for (int i = 0; i < q_heads * head_dim; i++) acc[i] = 0.0f;
    for (int64_t t = start; t < len; t++) {
        const fp8 *row = k_cache + kv_row(table, t, page_size, page_stride, token_stride);
        if (t + NTA_AHEAD < len)
            prefetch_row_nta(k_cache + kv_row(table, t + NTA_AHEAD, page_size, page_stride, token_stride),
                             token_stride);
        float *s = scores + (t - start) * q_heads;
        for (int hq = 0; hq < q_heads; hq++) {
            const fp8 *k = row + (int64_t)(hq / group) * head_dim;
            const float *qq = qf + hq * head_dim;
            float dot = 0.0f;
            _Pragma("omp simd reduction(+:dot)")
            for (int d = 0; d < head_dim; d++) dot += qq[d] * load_fp8(k[d]);
            s[hq] = dot;
            if (dot > maxs[hq]) maxs[hq] = dot;
        }
    }
    for (int64_t i = 0; i < n; i++)
        for (int hq = 0; hq < q_heads; hq++) {
            const float e = expf(scores[i * q_heads + hq] - maxs[hq]);
            scores[i * q_heads + hq] = e;
            sums[hq] += e;
        }
    for (int64_t t = start; t < len; t++) {
        const fp8 *row = k_cache + v_offset + kv_row(table, t, page_size, page_stride, token_stride);
        const float *s = scores + (t - start) * q_heads;
        for (int hq = 0; hq < q_heads; hq++) {
            const fp8 *v = row + (int64_t)(hq / group) * head_dim;
            const float p = s[hq];
            float *a = acc + hq * head_dim;
            _Pragma("omp simd")
            for (int d = 0; d < head_dim; d++) a[d] += p * load_fp8(v[d]);
        }
    }
}

/* paged_decode_fp8_*: paged_decode_* over FP8 pages (q and out fp32 or bf16). */
#define DEFINE_PAGED_DECODE_FP8(SUFFIX, T)                                                      \
void paged_decode_fp8_##SUFFIX(const T *q, const fp8 *k_cache, int64_t page_stride, int64_t v_offset, \
                               const int64_t *tables, int64_t table_stride, const int64_t *ctx_lens, \
                               int batch, int q_heads, int kv_heads, int head_dim, int page_size, \
                               float scale, int64_t window, const float *kv_scales, int threads, T *out) { \
    const int width = q_heads * head_dim;                                                       \
    const float q_scale = scale * kv_scales[0], v_scale = kv_scales[1];                         \
    _Pragma("omp parallel for schedule(dynamic, 4) num_threads(threads)")                       \
    for (int b = 0; b < batch; b++) {                                                           \
        const int64_t len = ctx_lens[b];                                                        \
        const int64_t start = (window > 0 && len > window) ? len - window : 0;                  \
        float *buf = (float *)malloc(sizeof(float) * ((len - start) * q_heads + 2 * width + q_heads)); \
        float *qf = buf + (len - start) * q_heads, *acc = qf + width, *sums = acc + width;      \
        const T *qb = q + (int64_t)b * width;                                                   \
        for (int i = 0; i < width; i++) qf[i] = load_##SUFFIX(qb[i]) * q_scale;                 \
        attend_row_fp8(qf, k_cache, page_stride, v_offset, tables + (int64_t)b * table_stride, start, len, \
                       q_heads, kv_heads, head_dim, page_size, buf, acc, sums);                \
        T *o = out + (int64_t)b * width;                                                        \
        for (int hq = 0; hq < q_heads; hq++) {                                                  \
            const float f = v_scale / sums[hq];                                                 \
            for (int d = 0; d < head_dim; d++) o[hq * head_dim + d] = store_##SUFFIX(acc[hq * head_dim + d] * f); \
        }                                                                                       \
        free(buf);                                                                              \
    }                                                                                           \
}

DEFINE_PAGED_DECODE_FP8(f32, float)
DEFINE_PAGED_DECODE_FP8(bf16, bf16)

/* paged_prefill_fp8_*: paged_prefill_bf16's causal chunks (same arguments, q and out fp32 or
 * bf16) over FP8 pages, one query row at a time: query i of sequence b, at position pos =
 * ctx_lens[b] - q_lens[b] + i, attends as a decode of context pos + 1 would. */
#define DEFINE_PAGED_PREFILL_FP8(SUFFIX, T)                                                     \
void paged_prefill_fp8_##SUFFIX(const T *q, const fp8 *k_cache, int64_t page_stride, int64_t v_offset, \
                                const int64_t *tables, int64_t table_stride, const int64_t *q_starts, \
                                const int64_t *q_lens, const int64_t *ctx_lens, int batch, int q_heads, \
                                int kv_heads, int head_dim, int page_size, float scale, int64_t window, \
                                const float *kv_scales, int threads, T *out) {                  \
    const int width = q_heads * head_dim;                                                       \
    const float q_scale = scale * kv_scales[0], v_scale = kv_scales[1];                         \
    int64_t rows = 0, max_ctx = 0;                                                              \
    for (int b = 0; b < batch; b++) {                                                           \
        rows += q_lens[b];                                                                      \
        max_ctx = ctx_lens[b] > max_ctx ? ctx_lens[b] : max_ctx;                                \
    }                                                                                           \
    int64_t *work = (int64_t *)malloc(sizeof(int64_t) * 2 * (rows + 1)); /* (sequence, query) */ \
    int64_t n = 0;                                                                              \
    for (int b = 0; b < batch; b++)                                                             \
        for (int64_t i = 0; i < q_lens[b]; i++) work[2 * n] = b, work[2 * n + 1] = i, n++;     \
    _Pragma("omp parallel num_threads(threads)")                                                \
    {                                                                                           \
        float *buf = (float *)malloc(sizeof(float) * (max_ctx * q_heads + 2 * width + q_heads)); \
        float *qf = buf + max_ctx * q_heads, *acc = qf + width, *sums = acc + width;            \
        _Pragma("omp for schedule(dynamic, 4)")                                                 \
        for (int64_t w = 0; w < n; w++) {                                                       \
            const int64_t b = work[2 * w], i = work[2 * w + 1];                                 \
            const int64_t len = ctx_lens[b] - q_lens[b] + i + 1;                                \
            const int64_t start = (window > 0 && len > window) ? len - window : 0;              \
            const T *qr = q + (q_starts[b] + i) * width;                                        \
            for (int j = 0; j < width; j++) qf[j] = load_##SUFFIX(qr[j]) * q_scale;             \
            attend_row_fp8(qf, k_cache, page_stride, v_offset, tables + b * table_stride, start, len, q_heads, \
                           kv_heads, head_dim, page_size, buf, acc, sums);                     \
            T *o = out + (q_starts[b] + i) * width;                                             \
            for (int hq = 0; hq < q_heads; hq++) {                                              \
                const float f = v_scale / sums[hq];                                             \
                for (int d = 0; d < head_dim; d++) o[hq * head_dim + d] = store_##SUFFIX(acc[hq * head_dim + d] * f); \
            }                                                                                   \
        }                                                                                       \
        free(buf);                                                                              \
    }                                                                                           \
    free(work);                                                                                 \
}

DEFINE_PAGED_PREFILL_FP8(f32, float)
DEFINE_PAGED_PREFILL_FP8(bf16, bf16)
