/* paged_prefill_avx2: causal attention of chunks of queries over their bf16 KV pages on AVX2 + FMA
 * CPUs (no bf16 dot products): paged_prefill_bf16's contract (cpu_kernels.c). Sequence b's
 * q_lens[b] queries start at flat row q_starts[b]; query i sits at position
 * ctx_lens[b] - q_lens[b] + i and sees keys [max(0, pos + 1 - window), pos + 1).
 *
 * A row is one (query, query head of a KV head's group); a tile is 8 rows in the 8 lanes of a
 * vector, and a work item is (sequence, KV head, up to ITEM_TILES consecutive tiles), so one pass
 * over a KV head's pages serves its query heads and the item's tiles share each block of keys,
 * widened to fp32 once, while it is in L1. Keys go in blocks of 32 aligned to absolute positions
 * [32j, 32j + 32), FlashAttention-2's online softmax per row: q.k for 8 keys at a time (each
 * loaded dim of q reused by the 8, the key's dim broadcast), the block's scores, the row's running
 * max and its exps (fp32, not rounded), then p.v accumulating head_dim x 8 rows in fp32.
 *
 * Order of sums, per row: a score is its dims summed in order in one fp32 FMA chain, times
 * scale * log2(e) (the exps are powers of 2); after block j the max is m_j = max(m_{j-1}, the
 * block's scores), and the denominator and each output value are (their value after block j - 1)
 * * 2^(m_{j-1} - m_j), then plus the block's keys in order (one add, or one FMA, a key); the
 * output is that sum times 1 / the denominator, rounded to bf16 once. Keys a row does not see,
 * and blocks or octets its tile skips, add exact zeros and scale by exactly 1, so a row's bits
 * depend only on its own query and keys, never on the chunk, tile, item, batch or threads.
 * head_dim must be a multiple of 8. Built without -ffast-math, so the compiler keeps this order.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "prefill_work.h"

#define LANES 8
#define ITEM_TILES 8 /* tiles a work item */
#define KEY_BLOCK 32
#define MASKED_SCORE (-1e30f)

typedef struct {
    int32_t lo[LANES], hi[LANES]; /* each lane's keys [lo, hi) */
    __m256 m, den;                /* running max (base 2) and denominator */
    __m256 *qt;                   /* [head_dim]: lane l holds dim d of row l */
    __m256 *acc;                  /* [head_dim]: the p.v sums, lane l row l */
} tile_state;

static inline __m256 widen8(const bf16 *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* 2^x for x <= 0: 2^round(x) times a degree-6 polynomial of 2^f, |f| <= 1/2 (relative error
 * ~2e-7); exactly 1 at x = 0, exactly 0 for x <= -127 (MASKED_SCORE included). */
static inline __m256 exp2_ps(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-127.0f));
    const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_sub_ps(x, n);
    __m256 p = _mm256_set1_ps(1.5403530393381609e-4f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3333558146428443e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6181291076284772e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5504108664821580e-2f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022650695910071e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718055994531e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits)); /* n = -127: bits 0, the result 0 */
}

/* s[u] lane l = q row l . key row k + 8u, for 8 keys of the block's fp32 K rows `k` [32][head_dim]. */
static inline void qk_keys8(const __m256 *qt, const float *k, int head_dim, __m256 *s) {
    __m256 acc[8];
    for (int u = 0; u < 8; u++) acc[u] = _mm256_setzero_ps();
    for (int d = 0; d < head_dim; d++) {
        const __m256 q = _mm256_load_ps((const float *)(qt + d));
        for (int u = 0; u < 8; u++) acc[u] = _mm256_fmadd_ps(q, _mm256_broadcast_ss(k + u * head_dim + d), acc[u]);
    }
    for (int u = 0; u < 8; u++) s[u] = acc[u];
}

/* acc[d] for 8 dims from d0: times alpha where `rescale`, plus p[j] times V row j, keys [j0, j1). */
static inline void pv_dims8(__m256 *acc, const __m256 *p, const float *v, int head_dim, int d0, int j0, int j1,
                            int rescale, __m256 alpha) {
    __m256 a[8];
    for (int c = 0; c < 8; c++) a[c] = rescale ? _mm256_mul_ps(acc[d0 + c], alpha) : acc[d0 + c];
    for (int j = j0; j < j1; j++) {
        const __m256 pj = p[j];
        const float *row = v + j * head_dim + d0;
        for (int c = 0; c < 8; c++) a[c] = _mm256_fmadd_ps(pj, _mm256_broadcast_ss(row + c), a[c]);
    }
    for (int c = 0; c < 8; c++) acc[d0 + c] = a[c];
}

/* One block of keys [b0, b0 + 32) for a tile whose keys fall in [klo, khi): k and v are the
 * block's fp32 K and V rows, zeros for keys out of the item's range. */
static void tile_block(tile_state *t, const float *k, const float *v, int64_t b0, int64_t klo, int64_t khi,
                       int head_dim, float scale) {
    const int j0 = (int)((klo > b0 ? klo : b0) - b0), j1 = (int)((khi < b0 + KEY_BLOCK ? khi : b0 + KEY_BLOCK) - b0);
    const int q0 = j0 / 8 * 8, q1 = (j1 + 7) / 8 * 8; /* the octets scored */
    __m256 s[KEY_BLOCK];
    for (int j = q0; j < q1; j += 8) qk_keys8(t->qt, k + j * head_dim, head_dim, s + j);
    const int full = q0 == 0 && q1 == KEY_BLOCK && t->lo[LANES - 1] <= b0 && t->hi[0] >= b0 + KEY_BLOCK;
    const __m256 vscale = _mm256_set1_ps(scale * 1.44269504088896341f), vmasked = _mm256_set1_ps(MASKED_SCORE);
    const __m256i lo = _mm256_sub_epi32(_mm256_loadu_si256((const __m256i *)t->lo), _mm256_set1_epi32(1));
    const __m256i hi = _mm256_loadu_si256((const __m256i *)t->hi);
    __m256 bmax = vmasked;
    for (int j = q0; j < q1; j++) {
        s[j] = _mm256_mul_ps(s[j], vscale);
        if (!full) { /* key b0 + j is seen where lo <= b0 + j < hi */
            const __m256i key = _mm256_set1_epi32((int32_t)(b0 + j));
            const __m256i seen = _mm256_and_si256(_mm256_cmpgt_epi32(key, lo), _mm256_cmpgt_epi32(hi, key));
            s[j] = _mm256_blendv_ps(vmasked, s[j], _mm256_castsi256_ps(seen));
        }
        bmax = _mm256_max_ps(bmax, s[j]);
    }
    const __m256 m_new = _mm256_max_ps(t->m, bmax);
    const __m256 alpha = exp2_ps(_mm256_sub_ps(t->m, m_new)); /* exactly 1 where the max stays */
    const int rescale = _mm256_movemask_ps(_mm256_cmp_ps(m_new, t->m, _CMP_NEQ_UQ)) != 0;
    t->m = m_new;
    const __m256 unmasked = _mm256_set1_ps(MASKED_SCORE / 2);
    __m256 den = rescale ? _mm256_mul_ps(t->den, alpha) : t->den;
    for (int j = q0; j < q1; j++) {
        __m256 e = exp2_ps(_mm256_sub_ps(s[j], m_new));
        if (!full) /* a row with no key yet has m_new = MASKED_SCORE */
            e = _mm256_and_ps(e, _mm256_cmp_ps(s[j], unmasked, _CMP_GT_OQ));
        s[j] = e;
        den = _mm256_add_ps(den, e);
    }
    t->den = den;
    for (int d = 0; d < head_dim; d += 8) pv_dims8(t->acc, s, v, head_dim, d, q0, q1, rescale, alpha);
}

/* K or V rows of keys [b0 + j0, b0 + j1) widened to fp32 rows of `dst` [32][head_dim], zeros elsewhere. */
static void widen_block(const bf16 *cache, const int64_t *rowoff, int64_t b0, int j0, int j1, int head_dim,
                        float *dst) {
    for (int j = 0; j < KEY_BLOCK; j++) {
        float *row = dst + j * head_dim;
        if (j < j0 || j >= j1) {
            memset(row, 0, sizeof(float) * head_dim);
            continue;
        }
        const bf16 *src = cache + rowoff[b0 + j];
        for (int d = 0; d < head_dim; d += 8) _mm256_storeu_ps(row + d, widen8(src + d));
    }
}

static void prefill_item(const bf16 *q, int64_t q_row_stride, const bf16 *k_cache, int64_t page_stride,
                         int64_t v_offset, const int64_t *table, int page_size, int64_t token_stride, int kv_head,
                         int head_dim, int group, int64_t first_pos, int first_row, int rows, int64_t window,
                         float scale, char *buf, bf16 *out) {
    const int tiles = (rows + LANES - 1) / LANES;
    tile_state tile[ITEM_TILES];
    __m256 *next = (__m256 *)buf;
    for (int t = 0; t < tiles; t++) {
        tile_state *T = tile + t;
        T->qt = next, T->acc = next + head_dim, next += 2 * head_dim;
        memset(T->acc, 0, sizeof(__m256) * head_dim);
        T->m = _mm256_set1_ps(MASKED_SCORE), T->den = _mm256_setzero_ps();
        float *qt = (float *)T->qt;
        for (int l = 0; l < LANES; l++) {
            const int i = t * LANES + l, r = first_row + (i < rows ? i : rows - 1); /* padding: the last row, unwritten */
            const int64_t pos = first_pos + r / group;
            T->hi[l] = (int32_t)(pos + 1);
            T->lo[l] = window > 0 && pos + 1 > window ? (int32_t)(pos + 1 - window) : 0;
            const bf16 *qr = q + (int64_t)(r / group) * q_row_stride + (int64_t)(kv_head * group + r % group) * head_dim;
            for (int d = 0; d < head_dim; d++) qt[d * LANES + l] = load_bf16(qr[d]);
        }
    }
    float *kf = (float *)next, *vf = kf + KEY_BLOCK * head_dim;
    int64_t *rowoff = (int64_t *)(vf + KEY_BLOCK * head_dim);
    const int64_t klo = tile[0].lo[0], khi = tile[tiles - 1].hi[LANES - 1];
    int64_t page = klo / page_size, slot = klo % page_size;
    for (int64_t t = klo; t < khi; t++, slot++) { /* rowoff[t]: key t's K row in the arena */
        if (slot == page_size) page++, slot = 0;
        rowoff[t] = table[page] * page_stride + slot * token_stride + (int64_t)kv_head * head_dim;
    }
    for (int64_t b0 = klo / KEY_BLOCK * KEY_BLOCK; b0 < khi; b0 += KEY_BLOCK) {
        const int j0 = (int)((klo > b0 ? klo : b0) - b0), j1 = (int)((khi < b0 + KEY_BLOCK ? khi : b0 + KEY_BLOCK) - b0);
        widen_block(k_cache, rowoff, b0, j0, j1, head_dim, kf);
        widen_block(k_cache + v_offset, rowoff, b0, j0, j1, head_dim, vf);
        for (int t = 0; t < tiles; t++) {
            const int64_t tlo = tile[t].lo[0], thi = tile[t].hi[LANES - 1];
            if (tlo < b0 + KEY_BLOCK && thi > b0) tile_block(tile + t, kf, vf, b0, tlo, thi, head_dim, scale);
        }
    }
    for (int t = 0; t < tiles; t++) {
        float inv[LANES], o[LANES];
        _mm256_storeu_ps(inv, _mm256_div_ps(_mm256_set1_ps(1.0f), tile[t].den));
        const int n = rows - t * LANES < LANES ? rows - t * LANES : LANES;
        for (int d = 0; d < head_dim; d++) {
            _mm256_storeu_ps(o, tile[t].acc[d]);
            for (int l = 0; l < n; l++) {
                const int row = first_row + t * LANES + l;
                bf16 *dst = out + (int64_t)(row / group) * q_row_stride + (int64_t)(kv_head * group + row % group) * head_dim;
                dst[d] = store_bf16(o[l] * inv[l]);
            }
        }
    }
}

/* paged_prefill_bf16's signature, so the layer stack calls either through one pointer; `tiles` is
 * not read (AVX2 has none). */
void paged_prefill_avx2(const bf16 *q, const bf16 *k_cache, int64_t page_stride, int64_t v_offset,
                        const int64_t *tables, int64_t table_stride, const int64_t *q_starts, const int64_t *q_lens,
                        const int64_t *ctx_lens, int batch, int q_heads, int kv_heads, int head_dim, int page_size,
                        float scale, int64_t window, int tiles, int threads, bf16 *out) {
    (void)tiles;
    const int group = q_heads / kv_heads, item_rows = LANES * ITEM_TILES;
    const int64_t token_stride = (int64_t)kv_heads * head_dim, q_row_stride = (int64_t)q_heads * head_dim;
    int64_t n, max_ctx;
    prefill_work *work = prefill_work_list(q_lens, ctx_lens, batch, group, kv_heads, item_rows, window, threads, &n, &max_ctx);
    /* per tile: qt and acc [head_dim vectors each]; K and V rows [KEY_BLOCK x head_dim fp32 each];
     * key row offsets [max_ctx] */
    const size_t bytes = sizeof(__m256) * ITEM_TILES * 2 * head_dim + sizeof(float) * 2 * KEY_BLOCK * head_dim +
                         sizeof(int64_t) * (size_t)max_ctx;
#pragma omp parallel num_threads(threads)
    {
        char *buf = (char *)aligned_alloc(64, (bytes + 63) / 64 * 64);
#pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < n; w++) {
            const int64_t b = work[w].seq, h = work[w].kv_head, r = work[w].row;
            const int64_t rows = q_lens[b] * group - r;
            prefill_item(q + q_starts[b] * q_row_stride, q_row_stride, k_cache, page_stride, v_offset,
                         tables + b * table_stride, page_size, token_stride, (int)h, head_dim, group,
                         ctx_lens[b] - q_lens[b], (int)r, rows < item_rows ? (int)rows : item_rows, window, scale,
                         buf, out + q_starts[b] * q_row_stride);
        }
        free(buf);
    }
    free(work);
}
