/* Quantised weights times 8-bit activations: llama.cpp's way of multiplying GGUF blocks.
 *
 * q8_matmul computes out[m, n] = x[m, k] . W[n, k]^T like quant_kernels.c's qmatmul, but first
 * rounds each activation row to int8 in blocks of 32 (scale = max|x| / 127 a block, as ggml's
 * Q8_0) and then multiplies integers. Every format is unpacked to unsigned codes u with a float
 * scale a per block (32 weights; 16 for Q6_K) and, for Q4_K, a float minimum b per block:
 *     w = a * (u - off) + b,   off in {0, 8, 16, 32, 128} per format.
 * Output channels go in panels of 16, one per int32 lane: a panel's codes are unpacked once,
 * interleaved so that 64 bytes hold 4 consecutive weights of each of the 16 channels, and every
 * activation row multiplies them: AVX512-VNNI `vpdpbusd` with 4 activations broadcast to all
 * lanes, or, for 16 rows at a time where the CPU has AMX, one tile product a block (TDPBSUD).
 * Either way each (row, channel, block) gets its exact integer sum, the `- off` folded in as
 * -off * the block's activation sum; then, block after block, in one order:
 *     acc = fma(float(sum), a * activation scale, acc)   [+ b * activation scale * code sum]
 * So a weight is never turned into a float, and a row's result is the same bits whatever m,
 * the tiling, the threads, or which of VNNI and AMX computed its sums (tested).
 *
 * A matrix can be laid out once, at load, as its panels (`q8_panels`; type T + PANELS), the
 * file's size: each panel its block scales, then Q8_0's codes as `multiply` reads them, a byte
 * each, or a nibble format's still packed (two a byte, plus Q5_0's fifth and Q6_K's top bits;
 * `nibble_panel`). A thread then streams its panels as one run of bytes, in the order it reads
 * them (its first 16 KB asked for at once, then lines 16 KB ahead) instead of 16 rows at once.
 * A few rows read the packed codes as they are (`group_vector`; nothing transposed per call);
 * more than a tile unpack a panel once (`expand`). AMX takes Q8_0's codes as they lie, and a
 * packed panel's unpacked once into the channel rows `multiply_amx` reads from the file's
 * layout (`channel_rows`). The same codes and scales, so the same bits as the file's layout.
 * (The nibble formats' panels measured no faster at prefill sizes, where unpacking is shared
 * by the rows; at one row they are 2-3x: Gemma 3's layers at one row spent most of a matmul
 * unpacking.)
 *
 * Results: the dequantised matrix times the int8-rounded activations, up to float summation.
 * Formats: Q4_0, Q5_0, Q8_0, Q4_K, Q6_K and our per-channel int8; k a multiple of 64 (and of the
 * format's block). The caller checks `q8_available()` and the formats (quant.py).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { T_Q4_0 = 2, T_Q5_0 = 6, T_Q8_0 = 8, T_Q4_K = 12, T_Q6_K = 14, T_I8 = 1000, PANELS = 2000 };

/* How a panel's code vectors lie (`group_vector`): EXPANDED, a byte a code (what `unpack_panel`
 * makes of the file's rows, and laid-out Q8_0); the nibble formats laid out (`q8_panels`) pack
 * two code vectors a 64-byte line, low and high nibbles (NIBBLES), plus Q5_0's fifth bits as a
 * 64-bit mask a vector (NIBBLES_BIT5) or Q6_K's two top bits, four vectors a line (NIBBLES_BITS56). */
enum { EXPANDED, NIBBLES, NIBBLES_BIT5, NIBBLES_BITS56 };

/* The formats, once for every switch below: X(format, weights a scale block, log2 of the code
 * offset (-1: none; Q8_0 and int8 store signed codes, offset 128), whether a minimum term, how
 * its laid-out panels hold the codes). */
#define FORMATS(X)                                                                                \
    X(Q8_0, 32, 7, 0, EXPANDED) X(I8, 32, 7, 0, EXPANDED) X(Q4_0, 32, 3, 0, NIBBLES)             \
    X(Q5_0, 32, 4, 0, NIBBLES_BIT5) X(Q6_K, 16, 5, 0, NIBBLES_BITS56) X(Q4_K, 32, -1, 1, NIBBLES)

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__F16C__)
#include <immintrin.h>

#include "transpose.h"

int q8_available(void) { return 1; }

/* Each format: codes_T gives the 64 unsigned codes of a channel's 64-weight group g; scales_T
 * (below) the group's block scales for 16 channels at once. */
#define NC 16 /* output channels a panel: one per int32 lane */

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

static inline __m512i codes_Q8_0(const uint8_t *row, int64_t g) {
    const uint8_t *b0 = row + 2 * g * 34;
    const __m512i q = halves(_mm256_loadu_si256((const __m256i *)(b0 + 2)), _mm256_loadu_si256((const __m256i *)(b0 + 36)));
    return _mm512_xor_si512(q, _mm512_set1_epi8((char)0x80));
}

static inline __m512i codes_I8(const uint8_t *row, int64_t g) {
    return _mm512_xor_si512(_mm512_loadu_si512(row + 64 * g), _mm512_set1_epi8((char)0x80));
}

static inline __m512i codes_Q4_0(const uint8_t *row, int64_t g) {
    return nibbles2(row + 2 * g * 18 + 2, row + 2 * g * 18 + 20);
}

static inline __m512i codes_Q5_0(const uint8_t *row, int64_t g) {
    const uint8_t *b0 = row + 2 * g * 22, *b1 = b0 + 22;
    uint32_t h0, h1;
    memcpy(&h0, b0 + 2, 4);
    memcpy(&h1, b1 + 2, 4);
    const __m512i u = nibbles2(b0 + 6, b1 + 6);
    const __mmask64 high = (__mmask64)h0 | ((__mmask64)h1 << 32); /* bit i: the 5th bit of weight i */
    return _mm512_mask_add_epi8(u, high, u, _mm512_set1_epi8(16));
}

/* d, dmin, scales[12], qs[128]: group j of a super-block is sub-blocks 2j (low nibbles of
 * qs[32j..]) and 2j+1 (high nibbles), each with a 6-bit scale and min. */
static inline __m512i codes_Q4_K(const uint8_t *row, int64_t g) {
    const __m256i q = _mm256_loadu_si256((const __m256i *)(row + (g >> 2) * 144 + 16 + 32 * (g & 3)));
    const __m256i f = _mm256_set1_epi8(0xF);
    return halves(_mm256_and_si256(q, f), _mm256_and_si256(_mm256_srli_epi16(q, 4), f));
}

/* ql[128], qh[64], int8 scales[16], d: group j is half j/2, quarters 2(j%2) and 2(j%2)+1; a
 * quarter's 32 weights take ql's nibbles (low for quarters 0-1) and 2 bits of qh; 16 weights a scale. */
static inline __m512i codes_Q6_K(const uint8_t *row, int64_t g) {
    const uint8_t *blk = row + (g >> 2) * 210;
    const int j = (int)(g & 3), half = j >> 1, q0 = 2 * (j & 1);
    __m512i lo = _mm512_loadu_si512(blk + 64 * half);
    if (j & 1) lo = _mm512_srli_epi16(lo, 4);
    lo = _mm512_and_si512(lo, _mm512_set1_epi8(0xF));
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * half));
    __m512i hi = halves(_mm256_srli_epi16(qh, 2 * q0), _mm256_srli_epi16(qh, 2 * q0 + 2));
    hi = _mm512_slli_epi16(_mm512_and_si512(hi, _mm512_set1_epi8(3)), 4);
    return _mm512_or_si512(lo, hi);
}

/* Activation rows rounded to int8 in blocks of 32: codes, each block's scale, each 16 codes'
 * sum (the `- off` term and Q4_K's minimums need it) and scale x the 32-block's code sum. */
typedef struct {
    int8_t *q;      /* [m][k] codes */
    float *d;       /* [m][k/32] block scales */
    int32_t *s16;   /* [m][k/16] code sums of 16 */
    float *sum;     /* [m][k/32] block scale * code sum */
    int32_t *off;   /* [m][k/32] -128 x the block's code sum: the term codes stored + 128 add */
} acts;

/* One block of 32 activations as floats (bf16 widened exactly). */
static inline void load_block(const void *xv, int bf16, int64_t b, __m512 *lo, __m512 *hi) {
    if (bf16) {
        const uint16_t *h = (const uint16_t *)xv + b * 32;
        *lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)h)), 16));
        *hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(h + 16))), 16));
    } else {
        *lo = _mm512_loadu_ps((const float *)xv + b * 32);
        *hi = _mm512_loadu_ps((const float *)xv + b * 32 + 16);
    }
}

/* Vectorised, with scalar code's results to the bit: |x| max, one division for the scale and
 * one for its inverse, x * inv rounded to nearest even (nearbyintf), exact integer sums. */
static void quantize_row(const void *xv, int bf16, int64_t k, int8_t *q, float *d, int32_t *s16, float *sum,
                         int32_t *off) {
    const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    for (int64_t b = 0; b < k / 32; b++) {
        __m512 lo, hi;
        load_block(xv, bf16, b, &lo, &hi);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(lo, sign), _mm512_and_ps(hi, sign)));
        const float scale = amax / 127.0f, inv = scale > 0.0f ? 1.0f / scale : 0.0f;
        const __m512 vinv = _mm512_set1_ps(inv);
        const int rn = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
        const __m512i qlo = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(lo, vinv), rn));
        const __m512i qhi = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(hi, vinv), rn));
        _mm_storeu_si128((__m128i *)(q + b * 32), _mm512_cvtepi32_epi8(qlo));
        _mm_storeu_si128((__m128i *)(q + b * 32 + 16), _mm512_cvtepi32_epi8(qhi));
        const int32_t h0 = _mm512_reduce_add_epi32(qlo), h1 = _mm512_reduce_add_epi32(qhi);
        d[b] = scale;
        s16[2 * b] = h0;
        s16[2 * b + 1] = h1;
        sum[b] = scale * (float)(h0 + h1);
        off[b] = -((h0 + h1) << 7);
    }
}

#define MR 8 /* activation rows a tile */
#define AMX_ROWS 16 /* activation rows an AMX tile */

/* A panel: NC channels unpacked for every row that multiplies them. codes[c4][lane][4] holds
 * weights 4*c4 .. 4*c4+3 of channel `lane` (64 bytes a chunk of 4: one vpdpbusd multiplies them
 * with 4 activations broadcast to every lane), scale[blk][lane] each block's weight scale,
 * low[blk][lane] Q4_K's minimum term (-dmin * m). Blocks are 32 weights, 16 for Q6_K. */
typedef struct {
    uint8_t *codes;
    float *scale, *low;
    int64_t ahead; /* laid-out panels (streamed from memory): prefetch this many bytes ahead; else 0 */
} panel;

/* scales_T: group g's block scales of 16 channels, as vectors a[0], a[NC], ... (2 blocks, 4 for
 * Q6_K), and Q4_K's minimum terms b[0], b[NC]: gathered from the channels' rows (`base` + the
 * lanes of `at`), each computed as the dequantiser does (the same float operations). */
static inline __m512i gather(const uint8_t *base, __m512i at, int64_t offset) {
    return _mm512_i32gather_epi32(at, base + offset, 1);
}
static inline __m512 low_fp16(__m512i words) { return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(words)); }
static inline __m512 high_fp16(__m512i words) { return low_fp16(_mm512_srli_epi32(words, 16)); }
static inline __m512i byte_of(__m512i words, int i) { /* unsigned byte i of each lane */
    return _mm512_and_si512(_mm512_srli_epi32(words, 8 * i), _mm512_set1_epi32(0xFF));
}

#define FP16_FIRST(T, BYTES)                                                                  \
    static inline void scales_##T(const uint8_t *base, __m512i at, int64_t g, const float *rs, float *a, float *b) { \
        _mm512_store_ps(a, low_fp16(gather(base, at, 2 * g * BYTES)));                        \
        _mm512_store_ps(a + NC, low_fp16(gather(base, at, (2 * g + 1) * BYTES)));             \
    }
FP16_FIRST(Q8_0, 34)
FP16_FIRST(Q4_0, 18)
FP16_FIRST(Q5_0, 22)

static inline void scales_I8(const uint8_t *base, __m512i at, int64_t g, const float *rs, float *a, float *b) {
    _mm512_store_ps(a, _mm512_loadu_ps(rs));
    _mm512_store_ps(a + NC, _mm512_loadu_ps(rs));
}

/* Q4_K's 6-bit scales and mins of group g's two sub-blocks (2(g%4), 2(g%4)+1) from a super-block's
 * d|dmin dword and scale dwords q0..3, q4..7, q8..11 of 16 channels (a lane each). */
static inline void q4_k_scales(__m512i dd, __m512i q0, __m512i q4, __m512i q8, int64_t g, float *a, float *b) {
    const __m512 d = low_fp16(dd), minus_dmin = _mm512_castsi512_ps(
        _mm512_xor_si512(_mm512_castps_si512(high_fp16(dd)), _mm512_set1_epi32((int)0x80000000u)));
    const __m512i six = _mm512_set1_epi32(63), four = _mm512_set1_epi32(0xF);
    for (int h = 0; h < 2; h++) {
        const int sub = 2 * (int)(g & 3) + h;
        __m512i sc, mn;
        if (sub < 4) {
            sc = _mm512_and_si512(byte_of(q0, sub), six);
            mn = _mm512_and_si512(byte_of(q4, sub), six);
        } else {
            const __m512i hi = byte_of(q8, sub - 4);
            sc = _mm512_or_si512(_mm512_and_si512(hi, four), _mm512_slli_epi32(_mm512_srli_epi32(byte_of(q0, sub - 4), 6), 4));
            mn = _mm512_or_si512(_mm512_srli_epi32(hi, 4), _mm512_slli_epi32(_mm512_srli_epi32(byte_of(q4, sub - 4), 6), 4));
        }
        _mm512_store_ps(a + h * NC, _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc)));
        _mm512_store_ps(b + h * NC, _mm512_mul_ps(minus_dmin, _mm512_cvtepi32_ps(mn)));
    }
}

static inline void scales_Q4_K(const uint8_t *base, __m512i at, int64_t g, const float *rs, float *a, float *b) {
    const int64_t blk = (g >> 2) * 144;
    q4_k_scales(gather(base, at, blk), gather(base, at, blk + 4), gather(base, at, blk + 8), gather(base, at, blk + 12),
                g, a, b);
}

/* Q6_K: int8 scales[16] at 192 (four a group), d at 208 (gathered from 206: inside the block) */
static inline void scales_Q6_K(const uint8_t *base, __m512i at, int64_t g, const float *rs, float *a, float *b) {
    const int64_t blk = (g >> 2) * 210;
    const int j = (int)(g & 3);
    const __m512 d = high_fp16(gather(base, at, blk + 206));
    const __m512i sc = gather(base, at, blk + 192 + 8 * (j >> 1) + 4 * (j & 1));
    for (int i = 0; i < 4; i++) { /* sign-extend byte i */
        const __m512i v = _mm512_srai_epi32(_mm512_slli_epi32(sc, 24 - 8 * i), 24);
        _mm512_store_ps(a + i * NC, _mm512_mul_ps(d, _mm512_cvtepi32_ps(v)));
    }
}

/* Unpack NC channels (rows[c], row scales scales[c]) into p; `per_group`: weight-scale blocks a
 * 64-weight group (2, or 4 for Q6_K). `channel_rows`: codes a channel a row (for AMX) instead of
 * interleaved. */
static inline __attribute__((always_inline)) void unpack_panel(
    __m512i (*codes)(const uint8_t *, int64_t),
    void (*scale)(const uint8_t *, __m512i, int64_t, const float *, float *, float *), int per_group,
    const uint8_t *const *rows, const float *scales, int64_t k, int64_t ahead, int64_t step, int channel_rows,
    panel p) {
    int32_t offsets[NC];
    for (int c = 0; c < NC; c++) offsets[c] = (int32_t)(rows[c] - rows[0]);
    const __m512i at = _mm512_loadu_si512(offsets);
    for (int64_t g = 0; g < k / 64; g++) {
        __m512i r[NC];
        for (int c = 0; c < NC; c++) {
            if (ahead) _mm_prefetch((const char *)rows[c] + ahead + g * step, _MM_HINT_T1);
            r[c] = codes(rows[c], g);
        }
        scale(rows[0], at, g, scales, p.scale + g * per_group * NC, p.low + g * per_group * NC);
        if (channel_rows) { /* AMX: a channel's codes in a row of their own (the A operand) */
            for (int c = 0; c < NC; c++) _mm512_store_si512(p.codes + c * k + 64 * g, r[c]);
            continue;
        }
        transpose16(r);
        for (int i = 0; i < 16; i++) _mm512_store_si512(p.codes + (g * 16 + i) * 64, r[i]);
    }
}

#define UNPACK_CASE(T, BLOCK, SHIFT, MIN, LAYOUT)                                                   \
    case T_##T: unpack_panel(codes_##T, scales_##T, 64 / BLOCK, rows, scales, k, ahead, step, channel_rows, p); break;

static void unpack_any(int type, const uint8_t *const *rows, const float *scales, int64_t k, int64_t ahead,
                       int64_t step, int channel_rows, panel p) {
    switch (type) { FORMATS(UNPACK_CASE) }
}

/* Bytes of a laid-out panel's block scales, before its codes (`q8_0_panel`, `nibble_panel`). */
static inline int64_t panel_scale_bytes(int type, int64_t k) {
    return type == T_Q6_K ? k / 256 * 288 : k; /* fp16 a 32-block, Q4_K's 256 bytes a super-block: k */
}

/* Bytes a 64-weight group of a panel's codes takes (16 channels), by layout. */
static inline int64_t group_bytes(int layout) {
    return layout == EXPANDED ? 1024 : layout == NIBBLES ? 512 : layout == NIBBLES_BIT5 ? 640 : 768;
}

/* Code vector i (0-15) of a panel's 64-weight group at `group` (weights 4i .. 4i+3 of the group,
 * 16 channels, 4 bytes a lane: what one vpdpbusd multiplies), read as `layout` lays it
 * (`q8_panels` documents the packed ones). Panels streamed from memory (p.ahead) ask for each
 * line of packed codes, and one line in 4 of byte codes, p.ahead bytes on. Callers unroll i, so
 * every offset below is a constant. */
static inline __attribute__((always_inline)) __m512i group_vector(panel p, int layout, const uint8_t *group, int i) {
    if (layout == EXPANDED) { /* one line in 4 asked for: the hardware prefetcher follows the run */
        if (p.ahead && !(i & 3)) _mm_prefetch((const char *)group + i * 64 + p.ahead, _MM_HINT_T1);
        return _mm512_load_si512(group + i * 64);
    }
    const uint8_t *line = group + (i >> 1) * 64;
    if (p.ahead && !(i & 1)) _mm_prefetch((const char *)line + p.ahead, _MM_HINT_T1);
    const __m512i w = _mm512_loadu_si512(line); /* a Q6_K panel of an odd number of super-blocks is not 64-aligned */
    __m512i c = _mm512_and_si512(i & 1 ? _mm512_srli_epi16(w, 4) : w, _mm512_set1_epi8(0xF));
    if (layout == NIBBLES_BIT5) {
        const uint8_t *bits = group + 512 + 8 * i;
        if (p.ahead && !(i & 7)) _mm_prefetch((const char *)bits + p.ahead, _MM_HINT_T1);
        uint64_t fifth;
        memcpy(&fifth, bits, 8);
        c = _mm512_mask_add_epi8(c, (__mmask64)fifth, c, _mm512_set1_epi8(16));
    } else if (layout == NIBBLES_BITS56) {
        const uint8_t *top = group + 512 + (i >> 2) * 64;
        if (p.ahead && !(i & 3)) _mm_prefetch((const char *)top + p.ahead, _MM_HINT_T1);
        const __m512i h = _mm512_srli_epi16(_mm512_loadu_si512(top), 2 * (i & 3));
        c = _mm512_or_si512(c, _mm512_slli_epi16(_mm512_and_si512(h, _mm512_set1_epi8(3)), 4));
    }
    return c;
}

/* A packed panel's codes, a byte a code, into `into` (an unpacked panel's buffer): more rows
 * than a tile read each code vector once a tile, and unpacking it each time cost more than
 * storing it once (Gemma 3's gate_up at 128 rows: 2.2 ms read packed, 1.2 expanded). */
static inline __attribute__((always_inline)) void expand(panel p, int layout, int64_t k, uint8_t *into) {
    for (int64_t g = 0; g < k / 64; g++) { /* a group's 16 vectors unrolled: their offsets are constants */
        const uint8_t *group = p.codes + g * group_bytes(layout);
        uint8_t *to = into + g * group_bytes(EXPANDED);
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++) _mm512_store_si512(to + i * 64, group_vector(p, layout, group, i));
    }
}

#define EXPAND_CASE(T, BLOCK, SHIFT, MIN, LAYOUT) case T_##T: expand(p, LAYOUT, k, into); break;

static void expand_any(int type, panel p, int64_t k, uint8_t *into) {
    switch (type) { FORMATS(EXPAND_CASE) }
}

/* Block blk of rows r0 .. r0+mr against a panel, its code vectors `first` .. of `group`, added
 * to acc: float(integer block sum) * (weight scale * activation scale) [+ Q4_K's minimum term]. */
static inline __attribute__((always_inline)) void multiply_block(panel p, int block, int shift, int with_min,
                                                                 int layout, int64_t k, acts x, int64_t r0, int mr,
                                                                 __m512 *acc, const uint8_t *group, int first,
                                                                 int64_t blk) {
    const int chunks = block / 4;
    __m512i s[MR];
    for (int r = 0; r < mr; r++) {
        const int32_t *s16 = x.s16 + (r0 + r) * (k / 16) + blk * block / 16;
        const int32_t total = block == 32 ? s16[0] + s16[1] : s16[0];
        s[r] = _mm512_set1_epi32(shift < 0 ? 0 : -(total << shift));
    }
    /* a few rows: two chains of dot products a block (integer sums: the same total) */
    const int split = mr <= 4;
    __m512i odd[MR];
    for (int r = 0; r < mr; r++) odd[r] = _mm512_setzero_si512();
    for (int i = 0; i < chunks; i++) {
        const __m512i w = group_vector(p, layout, group, first + i);
        for (int r = 0; r < mr; r++) {
            const __m512i four = _mm512_set1_epi32(*(const int32_t *)(x.q + (r0 + r) * k + blk * block + 4 * i));
            if (split && (i & 1)) odd[r] = _mm512_dpbusd_epi32(odd[r], w, four);
            else s[r] = _mm512_dpbusd_epi32(s[r], w, four);
        }
    }
    if (split)
        for (int r = 0; r < mr; r++) s[r] = _mm512_add_epi32(s[r], odd[r]);
    const __m512 scale = _mm512_load_ps(p.scale + blk * NC);
    for (int r = 0; r < mr; r++) {
        const float xd = x.d[(r0 + r) * (k / 32) + blk * block / 32];
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r]), _mm512_mul_ps(scale, _mm512_set1_ps(xd)), acc[r]);
        if (with_min)
            acc[r] = _mm512_fmadd_ps(_mm512_load_ps(p.low + blk * NC),
                                     _mm512_set1_ps(x.sum[(r0 + r) * (k / 32) + blk * block / 32]), acc[r]);
    }
}

/* Rows r0 .. r0+mr of x against a panel: out lane c of row r = sum over blocks, in order, of
 * float(integer block sum) * (weight scale * activation scale) [+ Q4_K's minimum term]. The
 * integer sums are exact, so this is the one rounding order of a (row, channel), whatever m.
 * At a few rows a 64-weight group's blocks are unrolled: where each code vector lies is then a
 * constant offset from the group (at one row, computing it had cost as much as the products:
 * Gemma 3's 72 layer matmuls at one row took 0.7x the time in cache, 0.79-0.94x from memory). */
static inline __attribute__((always_inline)) void multiply(panel p, int block, int shift, int with_min, int layout,
                                                           int64_t k, acts x, int64_t r0, int mr, __m512 *acc) {
    const int chunks = block / 4, per_group = 64 / block;
    for (int r = 0; r < mr; r++) acc[r] = _mm512_setzero_ps();
    if (mr > 4) { /* a tile of rows: the products dominate; a block at a time keeps the code small */
        for (int64_t blk = 0; blk < k / block; blk++)
            multiply_block(p, block, shift, with_min, layout, k, x, r0, mr, acc,
                           p.codes + blk / per_group * group_bytes(layout), (int)(blk % per_group) * chunks, blk);
        return;
    }
    for (int64_t g = 0; g < k / 64; g++) {
        const uint8_t *group = p.codes + g * group_bytes(layout);
        multiply_block(p, block, shift, with_min, layout, k, x, r0, mr, acc, group, 0, g * per_group);
        multiply_block(p, block, shift, with_min, layout, k, x, r0, mr, acc, group, chunks, g * per_group + 1);
        if (per_group == 4) { /* blocks of 16 (Q6_K) */
            multiply_block(p, block, shift, with_min, layout, k, x, r0, mr, acc, group, 2 * chunks, g * per_group + 2);
            multiply_block(p, block, shift, with_min, layout, k, x, r0, mr, acc, group, 3 * chunks, g * per_group + 3);
        }
    }
}

/* 16 fp32 -> bf16, round to nearest even (as bf16.h's store_bf16 a value) */
static inline __m256i to_bf16(__m512 v) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

/* Where a panel's results go: out's columns col .. col + 16 (`keep`: those that exist), + bias. */
typedef struct {
    void *out;
    int64_t stride, col;
    __m512 bias;
    __mmask16 keep;
    int bf16;
} sink;

static inline void store_rows(const __m512 *acc, int64_t r0, int mr, sink o) {
    for (int r = 0; r < mr; r++) {
        const __m512 v = _mm512_add_ps(acc[r], o.bias);
        const int64_t at = (r0 + r) * o.stride + o.col;
        if (o.bf16) _mm256_mask_storeu_epi16((uint16_t *)o.out + at, o.keep, to_bf16(v));
        else _mm512_mask_storeu_ps((float *)o.out + at, o.keep, v);
    }
}

/* Every row of x against a panel, MR rows at a time, in one call (the row loop inside: a call
 * per MR rows cost as much as the products at prefill sizes). */
static inline __attribute__((always_inline)) void multiply_rows(panel p, int block, int shift, int with_min,
                                                                int layout, int64_t k, acts x, int64_t m, sink o) {
    __m512 acc[MR];
    int64_t r0 = 0;
    for (; r0 + MR <= m; r0 += MR) {
        multiply(p, block, shift, with_min, layout, k, x, r0, MR, acc);
        store_rows(acc, r0, MR, o);
    }
    const int mr = (int)(m - r0);
    if (!mr) return;
    switch (mr) {
    case 7: multiply(p, block, shift, with_min, layout, k, x, r0, 7, acc); break;
    case 6: multiply(p, block, shift, with_min, layout, k, x, r0, 6, acc); break;
    case 5: multiply(p, block, shift, with_min, layout, k, x, r0, 5, acc); break;
    case 4: multiply(p, block, shift, with_min, layout, k, x, r0, 4, acc); break;
    case 3: multiply(p, block, shift, with_min, layout, k, x, r0, 3, acc); break;
    case 2: multiply(p, block, shift, with_min, layout, k, x, r0, 2, acc); break;
    default: multiply(p, block, shift, with_min, layout, k, x, r0, 1, acc); break;
    }
    store_rows(acc, r0, mr, o);
}

#define ROWS_CASE(T, BLOCK, SHIFT, MIN, LAYOUT)                                               \
    case T_##T:                                                                               \
        if (laid_out) multiply_rows(p, BLOCK, SHIFT, MIN, LAYOUT, k, x, m, o);                \
        else multiply_rows(p, BLOCK, SHIFT, MIN, EXPANDED, k, x, m, o);                       \
        break;

/* `laid_out`: p.codes are the panel's codes as `q8_panels` laid them out; else unpacked. */
static void multiply_rows_any(int type, int laid_out, panel p, int64_t k, acts x, int64_t m, sink o) {
    switch (type) { FORMATS(ROWS_CASE) }
}

#define LAYOUT_CASE(T, BLOCK, SHIFT, MIN, LAYOUT) case T_##T: return LAYOUT;

static inline int layout_of(int type) { /* how its laid-out panels hold the codes */
    switch (type) { FORMATS(LAYOUT_CASE) }
    return EXPANDED;
}

#define BLOCK_CASE(T, BLOCK, SHIFT, MIN, LAYOUT) case T_##T: return BLOCK;

static inline int block_of(int type) { /* weights a scale block */
    switch (type) { FORMATS(BLOCK_CASE) }
    return 32;
}

#if (defined(__AMX_TILE__) && defined(__AMX_INT8__)) || defined(TREESERVE_AMX_EMULATED)  /* amx_emulated.h */
#include "amx.h"
#define HAVE_AMX 1

/* 16 rows of activations as AMX wants them (the B operand): rows[k/4][16][4], 4 codes of each
 * row side by side; and, per block, the 16 rows' scales, code sums (of 16) and scale x sum. */
typedef struct {
    int8_t *q;
    int32_t *s16; /* [k/16][16] */
    float *d, *sum; /* [k/32][16] */
} act_tile;

static void tile_rows(acts x, int64_t r0, int64_t m, int64_t k, act_tile t) {
    for (int64_t g = 0; g < k / 64; g++) {
        __m512i r[16];
        for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512(x.q + (r0 + i) * k + 64 * g); /* padded rows: 0 */
        transpose16(r);
        for (int i = 0; i < 16; i++) _mm512_store_si512(t.q + (g * 16 + i) * 64, r[i]);
    }
    for (int i = 0; i < 16; i++) {
        const int64_t row = r0 + i;
        for (int64_t b = 0; b < k / 16; b++) t.s16[b * 16 + i] = row < m ? x.s16[row * (k / 16) + b] : 0;
        for (int64_t b = 0; b < k / 32; b++) {
            t.d[b * 16 + i] = row < m ? x.d[row * (k / 32) + b] : 0.0f;
            t.sum[b * 16 + i] = row < m ? x.sum[row * (k / 32) + b] : 0.0f;
        }
    }
}

/* Two sets of tiles, so one block's product runs while the last one's sums are scaled: C in
 * tiles 0 and 3 (16 channels x 16 rows, int32), A (16 channels' `block` codes) in 1 and 4, B
 * (the block's activations, 4 a row a tile row) in 2 and 5. */
static void configure_tiles(int block) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 6; t += 3) {
        cfg.rows[t] = NC, cfg.colsb[t] = 64;
        cfg.rows[t + 1] = NC, cfg.colsb[t + 1] = (uint16_t)block;
        cfg.rows[t + 2] = (uint8_t)(block / 4), cfg.colsb[t + 2] = 64;
    }
    _tile_loadconfig(&cfg);
}

#define PRODUCT(C, A, B, blk)                                                                 \
    do {                                                                                      \
        _tile_zero(C);                                                                        \
        _tile_loadd(A, p.codes + (blk) * block, k);                                           \
        _tile_loadd(B, t.q + (blk) * block * 16, 64);                                         \
        _tile_dpbusd(C, A, B);                                                                \
    } while (0)

/* One block's stored sums (16 channels x 16 rows) into the channels' accumulators. */
static inline __attribute__((always_inline)) void amx_block_sums(const int32_t sums[NC][16], panel p, int block,
                                                                 int shift, int with_min, act_tile t, int64_t blk,
                                                                 __m512 *acc) {
    __m512i total = _mm512_load_si512(t.s16 + blk * block / 16 * 16);
    if (block == 32) total = _mm512_add_epi32(total, _mm512_load_si512(t.s16 + (2 * blk + 1) * 16));
    const __m512i start = shift < 0 ? _mm512_setzero_si512()
                                    : _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(total, shift));
    const __m512 xd = _mm512_load_ps(t.d + blk * block / 32 * 16);
    for (int c = 0; c < NC; c++) {
        const __m512i s = _mm512_add_epi32(_mm512_load_si512(sums[c]), start);
        acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(xd, _mm512_set1_ps(p.scale[blk * NC + c])), acc[c]);
        if (with_min)
            acc[c] = _mm512_fmadd_ps(_mm512_set1_ps(p.low[blk * NC + c]), _mm512_load_ps(t.sum + blk * 16), acc[c]);
    }
}

/* `multiply` for AMX_ROWS rows at once, channels in tile rows and activation rows in lanes:
 * each block's integer sums come from one tile product (TDPBUSD: unsigned codes x signed
 * activations), then the same float steps as `multiply` (a product of two floats is the same
 * either way round). acc[c] holds channel c for the 16 rows: the caller transposes it.
 * Three blocks are in flight: block blk+1's product is issued, then block blk's sums are
 * stored and block blk-1's (stored a block ago) scaled, so no store waits on a product just
 * issued and no load on a store just made (at 128 rows: Gemma's gate_up 0.82 -> 0.68 ms;
 * `multiply_amx_q8_0_panel` runs the same pipeline: its head 72 -> 56-60 ms). */
static inline __attribute__((always_inline)) void multiply_amx(panel p, int block, int shift, int with_min, int64_t k,
                                                               act_tile t, __m512 *acc) {
    int32_t sums[2][NC][16] __attribute__((aligned(64)));
    const int64_t blocks = k / block;
    __m512 a[NC];
    for (int c = 0; c < NC; c++) a[c] = _mm512_setzero_ps();
    PRODUCT(0, 1, 2, 0);
    for (int64_t blk = 0; blk < blocks; blk++) {
        if (blk + 1 < blocks && ((blk + 1) & 1)) PRODUCT(3, 4, 5, blk + 1);
        if (blk + 1 < blocks && !((blk + 1) & 1)) PRODUCT(0, 1, 2, blk + 1);
        if (blk & 1) _tile_stored(3, sums[1], 64);
        else _tile_stored(0, sums[0], 64);
        if (blk > 0) amx_block_sums(sums[(blk - 1) & 1], p, block, shift, with_min, t, blk - 1, a);
    }
    amx_block_sums(sums[(blocks - 1) & 1], p, block, shift, with_min, t, blocks - 1, a);
    for (int c = 0; c < NC; c++) acc[c] = a[c];
}

/* A packed panel's codes as AMX's A operand, a channel's k codes a row (what `unpack_panel`
 * writes from the file's rows for AMX): each group's 16 code vectors transposed back. */
static inline __attribute__((always_inline)) void channel_rows(panel p, int layout, int64_t k, uint8_t *into) {
    for (int64_t g = 0; g < k / 64; g++) {
        const uint8_t *group = p.codes + g * group_bytes(layout);
        __m512i r[NC];
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++) r[i] = group_vector(p, layout, group, i);
        transpose16(r); /* r[c]: channel c's 64 codes of the group, in weight order */
        for (int c = 0; c < NC; c++) _mm512_store_si512(into + c * k + 64 * g, r[c]);
    }
}

#define CHANNEL_ROWS_CASE(T, BLOCK, SHIFT, MIN, LAYOUT) case T_##T: channel_rows(p, LAYOUT, k, into); break;

static void channel_rows_any(int type, panel p, int64_t k, uint8_t *into) {
    switch (type) { FORMATS(CHANNEL_ROWS_CASE) }
}

#define AMX_CASE(T, BLOCK, SHIFT, MIN, LAYOUT) case T_##T: multiply_amx(p, BLOCK, SHIFT, MIN, k, t, acc); break;

static void multiply_amx_any(int type, panel p, int64_t k, act_tile t, __m512 *acc) {
    switch (type) { FORMATS(AMX_CASE) }
}

/* `multiply` for 16 rows against a laid-out Q8_0 panel: its codes are the B operand as they
 * lie (4 weights of each of 16 channels a tile row) and the activation rows the A operand
 * (TDPBSUD: signed activations x unsigned codes), so acc[r] holds row r (no transposes); then
 * `multiply`'s float steps for Q8_0 (blocks of 32, codes offset by 128). Tiles as
 * `configure_tiles(32)` sets them. (The file's layouts and packed panels keep `multiply_amx`:
 * unpacked into this layout instead, the file's matmuls took 5-15% longer at 128-512 rows.) */
#define PANEL_PRODUCT(C, A, B, blk)                                                           \
    do {                                                                                      \
        _tile_zero(C);                                                                        \
        _tile_loadd(A, x.q + r0 * k + (blk) * 32, k);                                         \
        _tile_loadd(B, p.codes + (blk) * 32 * NC, 64);                                        \
        _tile_dpbsud(C, A, B);                                                                \
    } while (0)

/* One block's sums (16 rows x 16 channels, stored) into the rows' accumulators. */
static inline __attribute__((always_inline)) void panel_block_sums(const int32_t sums[AMX_ROWS][NC], panel p, int64_t k,
                                                                   acts x, int64_t r0, int64_t blk, __m512 *a) {
    const int64_t blocks = k / 32;
    const __m512 scale = _mm512_load_ps(p.scale + blk * NC);
    const int32_t *off = x.off + r0 * blocks + blk;
    const float *xd = x.d + r0 * blocks + blk;
#pragma GCC unroll 16
    for (int r = 0; r < AMX_ROWS; r++) {
        const __m512i s = _mm512_add_epi32(_mm512_load_si512(sums[r]), _mm512_set1_epi32(off[r * blocks]));
        a[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(scale, _mm512_set1_ps(xd[r * blocks])), a[r]);
    }
}

static void multiply_amx_q8_0_panel(panel p, int64_t k, acts x, int64_t r0, __m512 *acc) {
    int32_t sums[2][AMX_ROWS][NC] __attribute__((aligned(64)));
    const int64_t blocks = k / 32;
    __m512 a[AMX_ROWS]; /* all 16 rows, padded ones too (zero codes): a fixed count keeps them in registers */
    for (int r = 0; r < AMX_ROWS; r++) a[r] = _mm512_setzero_ps();
    PANEL_PRODUCT(0, 1, 2, 0);
    /* A pipeline of three: block blk+1's product is issued, block blk's sums stored, block
     * blk-1's sums (stored one block ago, not just now) scaled into the accumulators. */
    for (int64_t blk = 0; blk < blocks; blk++) {
        if (blk + 1 < blocks && ((blk + 1) & 1)) PANEL_PRODUCT(3, 4, 5, blk + 1);
        if (blk + 1 < blocks && !((blk + 1) & 1)) PANEL_PRODUCT(0, 1, 2, blk + 1);
        if (blk & 1) _tile_stored(3, sums[1], 64);
        else _tile_stored(0, sums[0], 64);
        if (blk > 0) panel_block_sums(sums[(blk - 1) & 1], p, k, x, r0, blk - 1, a);
    }
    panel_block_sums(sums[(blocks - 1) & 1], p, k, x, r0, blocks - 1, a);
    for (int r = 0; r < AMX_ROWS; r++) acc[r] = a[r];
}

#endif

/* Q8_0 rows w [n][k/32 blocks of 34 bytes] -> panels of NC channels, each its fp16 block scales
 * [k/32][NC] (k bytes) then k*NC unsigned codes in `multiply`'s order (codes[k/4][NC][4], code =
 * int8 weight ^ 0x80): 17k bytes a panel, the file's size. Channels past n: code 0x80 (weight 0),
 * scale 0. */
static void q8_0_panel(const uint8_t *w, int64_t n, int64_t k, int64_t pn, uint8_t *out) {
    uint16_t *half = (uint16_t *)out;
    uint8_t *codes = out + panel_scale_bytes(T_Q8_0, k);
    for (int c = 0; c < NC; c++) {
        const int64_t ch = pn * NC + c;
        for (int64_t blk = 0; blk < k / 32; blk++) {
            const uint8_t *b = w + (ch * (k / 32) + blk) * 34;
            uint16_t d = 0;
            if (ch < n) memcpy(&d, b, 2);
            half[blk * NC + c] = d;
            for (int i = 0; i < 8; i++) {
                uint32_t four = 0;
                if (ch < n) memcpy(&four, b + 2 + 4 * i, 4);
                four ^= 0x80808080u;
                memcpy(codes + ((blk * 8 + i) * NC + c) * 4, &four, 4);
            }
        }
    }
}

#define CODES_CASE(T, BLOCK, SHIFT, MIN, LAYOUT) case T_##T: return codes_##T(row, g);

static __m512i codes_any(int type, const uint8_t *row, int64_t g) {
    switch (type) { FORMATS(CODES_CASE) }
    abort();
}

/* A nibble format's panel (Q4_0, Q5_0, Q4_K, Q6_K; rows of `rb` bytes): for each 64-weight
 * group, its 16 code vectors (`group_vector`'s order) packed two a line, vector 2t in the low
 * nibbles of line t and 2t+1 in the high ones; Q5_0 then adds each vector's fifth bits as a
 * 64-bit mask (bit 4c+j: channel c's weight j of the vector), Q6_K four lines of two-bit tops
 * (line u, bits 2v, 2v+1 of a byte: vector 4u+v's). Before every group, the scales, a lane a
 * channel: Q4_0/Q5_0 fp16 d [k/32][NC]; Q4_K a super-block's d|dmin and scale dwords
 * [k/256][4][NC]; Q6_K a super-block's fp16 d [NC] then its int8 scales [16][NC]. The file's
 * size. Channels past n: codes and scales 0 (weight 0). */
static void nibble_panel(int type, const uint8_t *w, int64_t n, int64_t k, int64_t rb, int64_t pn, uint8_t *out) {
    const int layout = layout_of(type);
    const int np = (int)(n - pn * NC < NC ? n - pn * NC : NC);
    const uint8_t *rows[NC];
    for (int c = 0; c < NC; c++) rows[c] = c < np ? w + (pn * NC + c) * rb : NULL;
    const __m512i f = _mm512_set1_epi8(0xF);
    for (int64_t g = 0; g < k / 64; g++) {
        __m512i r[NC];
        for (int c = 0; c < NC; c++) r[c] = rows[c] ? codes_any(type, rows[c], g) : _mm512_setzero_si512();
        transpose16(r);
        uint8_t *group = out + panel_scale_bytes(type, k) + g * group_bytes(layout);
        for (int t = 0; t < 8; t++)
            _mm512_storeu_si512(group + 64 * t, _mm512_or_si512(_mm512_and_si512(r[2 * t], f),
                                                                _mm512_slli_epi16(_mm512_and_si512(r[2 * t + 1], f), 4)));
        if (layout == NIBBLES_BIT5)
            for (int i = 0; i < 16; i++) {
                const uint64_t fifth = _mm512_test_epi8_mask(r[i], _mm512_set1_epi8(16));
                memcpy(group + 512 + 8 * i, &fifth, 8);
            }
        if (layout == NIBBLES_BITS56)
            for (int u = 0; u < 4; u++) {
                __m512i top = _mm512_setzero_si512();
                for (int v = 0; v < 4; v++) {
                    const __m512i two = _mm512_and_si512(_mm512_srli_epi16(r[4 * u + v], 4), _mm512_set1_epi8(3));
                    top = _mm512_or_si512(top, _mm512_slli_epi16(two, 2 * v));
                }
                _mm512_storeu_si512(group + 512 + 64 * u, top);
            }
    }
    uint8_t *scales = out;
    for (int c = 0; c < NC; c++) {
        const uint8_t *row = rows[c];
        if (type == T_Q4_0 || type == T_Q5_0) {
            const int64_t bytes = rb / (k / 32); /* a block's */
            for (int64_t b = 0; b < k / 32; b++) {
                uint16_t d = 0;
                if (row) memcpy(&d, row + b * bytes, 2);
                memcpy(scales + (b * NC + c) * 2, &d, 2);
            }
        } else if (type == T_Q4_K) {
            for (int64_t sb = 0; sb < k / 256; sb++)
                for (int q = 0; q < 4; q++) {
                    uint32_t word = 0;
                    if (row) memcpy(&word, row + sb * 144 + 4 * q, 4);
                    memcpy(scales + sb * 256 + q * 64 + 4 * c, &word, 4);
                }
        } else { /* Q6_K */
            for (int64_t sb = 0; sb < k / 256; sb++) {
                uint8_t *at = scales + sb * 288;
                uint16_t d = 0;
                if (row) memcpy(&d, row + sb * 210 + 208, 2);
                memcpy(at + 2 * c, &d, 2);
                for (int j = 0; j < 16; j++) at[32 + j * NC + c] = row ? row[sb * 210 + 192 + j] : 0;
            }
        }
    }
}

/* Rows w [n][rb bytes] of `type` -> its panels of NC channels, NC * rb bytes each: Q8_0's
 * expanded codes (`q8_0_panel`) or a nibble format packed (`nibble_panel`). */
void q8_panels(int type, const uint8_t *w, int64_t n, int64_t k, int64_t rb, uint8_t *out, int threads) {
    const int64_t panels = (n + NC - 1) / NC;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t pn = 0; pn < panels; pn++) {
        if (type == T_Q8_0) q8_0_panel(w, n, k, pn, out + pn * NC * rb);
        else nibble_panel(type, w, n, k, rb, pn, out + pn * NC * rb);
    }
}

/* A laid-out panel's block scales (`scales`: its first bytes) into p.scale (and Q4_K's minimum
 * terms into p.low), each computed as the scales_T of the file's layout compute it. */
static void panel_scales(int type, const uint8_t *scales, int64_t k, panel p) {
    if (type == T_Q4_K) {
        for (int64_t sb = 0; sb < k / 256; sb++) {
            const uint8_t *at = scales + sb * 256;
            const __m512i dd = _mm512_loadu_si512(at), q0 = _mm512_loadu_si512(at + 64),
                          q4 = _mm512_loadu_si512(at + 128), q8 = _mm512_loadu_si512(at + 192);
            for (int g = 0; g < 4; g++) q4_k_scales(dd, q0, q4, q8, g, p.scale + (sb * 8 + 2 * g) * NC, p.low + (sb * 8 + 2 * g) * NC);
        }
    } else if (type == T_Q6_K) {
        for (int64_t sb = 0; sb < k / 256; sb++) {
            const uint8_t *at = scales + sb * 288;
            const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)at));
            for (int j = 0; j < 16; j++) {
                const __m512i sc = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(at + 32 + j * NC)));
                _mm512_store_ps(p.scale + (sb * 16 + j) * NC, _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc)));
            }
        }
    } else { /* Q8_0, Q4_0, Q5_0: fp16 d [k/32][NC] */
        const uint16_t *half = (const uint16_t *)scales;
        for (int64_t blk = 0; blk < k / 32; blk++)
            _mm512_store_ps(p.scale + blk * NC, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(half + blk * NC))));
    }
}

/* Rows `ids` of laid-out Q8_0 panels, fp32: scale * code, the dequantiser's values (lookups). */
void q8_panel_rows(const uint8_t *w, int64_t k, const int64_t *ids, int64_t count, float *out) {
    for (int64_t i = 0; i < count; i++) {
        const uint16_t *half = (const uint16_t *)(w + ids[i] / NC * 17 * k);
        const uint8_t *codes = (const uint8_t *)half + panel_scale_bytes(T_Q8_0, k);
        const int lane = (int)(ids[i] % NC);
        for (int64_t blk = 0; blk < k / 32; blk++) {
            const float d = _cvtsh_ss(half[blk * NC + lane]);
            for (int c = 0; c < 32; c++)
                out[i * k + blk * 32 + c] = d * (float)((int)codes[((blk * 8 + c / 4) * NC + lane) * 4 + c % 4] - 128);
        }
    }
}

#define MAX_PARTS 8
#ifndef PF_BYTES
#define PF_BYTES 4096
#endif
/* Laid-out panels stream as one run of bytes a thread, read in the order they lie (a panel's
 * scales, then its codes), with lines asked for 16 KB ahead into L2: each scale line, each line
 * of packed codes, and one line in 4 of Q8_0's codes. With the scales after the codes (read
 * first, then the codes from the panel's start) the hardware prefetcher did not follow the run,
 * and asking for every line kept the LM head at 0.75-0.85x a plain read of its bytes: scales
 * first and one line in 4 made it 0.80-0.84x as long, as fast as the plain read (the layers
 * 0.91x). Asking for one line in 2 or 4 of the packed codes made the layers 1.2-1.4x slower. */
#define PANEL_AHEAD 16384

/* Arguments as quant_kernels.c's qmatmul: W row-stacked from `parts` matrices in their formats. */
void q8_matmul(int parts, const int *types, const uint8_t *const *ws, const int64_t *row_bytes,
               const float *const *row_scales, const int64_t *part_rows, int64_t k, const void *xv, int64_t x_stride,
               int m, const float *bias, void *out, int64_t out_stride, int out_bf16, int x_bf16, int threads) {
    int64_t first_panel[MAX_PARTS + 1] = {0}, first_col[MAX_PARTS + 1] = {0};
    for (int j = 0; j < parts && j < MAX_PARTS; j++) {
        first_panel[j + 1] = first_panel[j] + (part_rows[j] + NC - 1) / NC;
        first_col[j + 1] = first_col[j] + part_rows[j];
    }
    const int64_t panels = first_panel[parts];
    int all_q8_0_panels = 1; /* then AMX reads the activation rows as they are (no act_tile) */
    for (int j = 0; j < parts; j++) all_q8_0_panels &= types[j] == PANELS + T_Q8_0;
#ifdef HAVE_AMX
    const int amx = m >= AMX_ROWS && amx_usable(); /* same sums, same float steps: the rows' bits agree */
    const int64_t padded = amx ? (m + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS : m; /* whole tiles of codes */
#else
    const int amx = 0;
    const int64_t padded = m;
#endif
    const size_t codes = ((size_t)padded * k + 63) / 64 * 64, blocks = ((size_t)padded * (k / 32) * 4 + 63) / 64 * 64;
    acts x = {aligned_alloc(64, codes), aligned_alloc(64, blocks), aligned_alloc(64, 2 * blocks),
              aligned_alloc(64, blocks), aligned_alloc(64, blocks)};
    const int elem = x_bf16 ? 2 : 4;
    memset(x.q + (int64_t)m * k, 0, (size_t)(padded - m) * k); /* rows past m: zero codes, scales and sums */
    memset(x.d + (int64_t)m * (k / 32), 0, (size_t)(padded - m) * (k / 32) * 4);
    memset(x.off + (int64_t)m * (k / 32), 0, (size_t)(padded - m) * (k / 32) * 4);
#ifdef HAVE_AMX
    const int tiled = amx && !all_q8_0_panels; /* parts `multiply_amx` takes: activations as act_tiles */
    const size_t tile_lanes = tiled ? sizeof(float) * padded * (k / 16) : 64;
    act_tile xt = {tiled ? aligned_alloc(64, codes) : NULL, aligned_alloc(64, tile_lanes), aligned_alloc(64, tile_lanes),
                   aligned_alloc(64, tile_lanes)};
#endif
    #pragma omp parallel num_threads(threads)
    {
        int tiles = 0; /* the block size the AMX tiles are configured for */
        (void)tiles;
        int primed = 0; /* this thread's run of laid-out panels asked for from its start */
        #pragma omp for schedule(static)
        for (int r = 0; r < m; r++)
            quantize_row((const char *)xv + (int64_t)r * x_stride * elem, x_bf16, k, x.q + (int64_t)r * k,
                         x.d + (int64_t)r * (k / 32), x.s16 + (int64_t)r * (k / 16), x.sum + (int64_t)r * (k / 32), x.off + (int64_t)r * (k / 32));
#ifdef HAVE_AMX
        if (tiled) { /* every thread takes this branch or none: `tiled` is shared */
            #pragma omp for schedule(static)
            for (int64_t r0 = 0; r0 < m; r0 += AMX_ROWS)
                tile_rows(x, r0, m, k, (act_tile){xt.q + r0 * k, xt.s16 + r0 * (k / 16), xt.d + r0 * (k / 32),
                                                  xt.sum + r0 * (k / 32)});
        }
#endif
        panel p = {aligned_alloc(64, (size_t)k * NC), aligned_alloc(64, sizeof(float) * NC * (k / 16)),
                   aligned_alloc(64, sizeof(float) * NC * (k / 16)), 0};
        #pragma omp for schedule(static)
        for (int64_t pn = 0; pn < panels; pn++) {
            int j = 0;
            while (pn >= first_panel[j + 1]) j++;
            const int64_t n = part_rows[j], rb = row_bytes[j], c0 = (pn - first_panel[j]) * NC;
            const int np = (int)(n - c0 < NC ? n - c0 : NC);
            const int laid_out = types[j] >= PANELS, type = laid_out ? types[j] - PANELS : types[j];
            panel q = p;
            if (laid_out) { /* the codes as they lie; the block scales to floats */
                q.codes = (uint8_t *)ws[j] + (pn - first_panel[j]) * rb;
                q.ahead = PANEL_AHEAD;
                if (!primed) /* the first PANEL_AHEAD bytes: later ones are asked for as the panels are read */
                    for (int64_t at = 0; at < PANEL_AHEAD; at += 64) _mm_prefetch((const char *)q.codes + at, _MM_HINT_T1);
                primed = 1;
                const int64_t scale_bytes = panel_scale_bytes(type, k);
                panel_scales(type, q.codes, k, q);
                for (int64_t at = 0; at < scale_bytes; at += 64) /* the codes' reads ask for the lines of codes only */
                    _mm_prefetch((const char *)q.codes + at + PANEL_AHEAD, _MM_HINT_T1);
                q.codes += scale_bytes;
            } else {
                const uint8_t *rows[NC];
                float scales[NC];
                for (int c = 0; c < NC; c++) { /* the last panel repeats its last channel; those results are dropped */
                    const int64_t ch = c0 + (c < np ? c : np - 1);
                    rows[c] = ws[j] + ch * rb;
                    scales[c] = row_scales[j] ? row_scales[j][ch] : 0.0f;
                }
                /* the bytes stream through once: ask for a later panel's rows as this one's are read */
                const int64_t panels_ahead = (PF_BYTES + NC * rb - 1) / (NC * rb);
                const int64_t ahead = c0 + (panels_ahead + 1) * NC <= n ? panels_ahead * NC * rb : 0;
                unpack_any(types[j], rows, scales, k, ahead, rb / (k / 64), amx, p);
            }
#ifdef HAVE_AMX
            if (amx && laid_out && type != T_Q8_0) /* packed: unpacked once into channel rows for all the rows */
                channel_rows_any(type, q, k, p.codes);
            const int block = block_of(type);
            if (amx && tiles != block) configure_tiles(tiles = block);
#endif
            const int64_t col = first_col[j] + c0;
            const __mmask16 keep = (__mmask16)((1u << np) - 1);
            const __m512 b = bias ? _mm512_maskz_loadu_ps(keep, bias + col) : _mm512_setzero_ps();
            const sink o = {out, out_stride, col, b, keep, out_bf16};
#ifdef HAVE_AMX
            if (amx) {
                __m512 acc[AMX_ROWS];
                for (int64_t r0 = 0; r0 < m; r0 += AMX_ROWS) {
                    const int mr = m - r0 < AMX_ROWS ? (int)(m - r0) : AMX_ROWS;
                    if (laid_out && type == T_Q8_0) {
                        multiply_amx_q8_0_panel(q, k, x, r0, acc);
                    } else {
                        multiply_amx_any(type, p, k, (act_tile){xt.q + r0 * k, xt.s16 + r0 * (k / 16),
                                                                    xt.d + r0 * (k / 32), xt.sum + r0 * (k / 32)}, acc);
                        transpose16((__m512i *)acc); /* [channel][row] -> [row][channel] */
                    }
                    store_rows(acc, r0, mr, o);
                }
                continue;
            }
#endif
            if (laid_out && layout_of(type) != EXPANDED && m > MR) { /* packed: unpacked once for many rows */
                expand_any(type, q, k, p.codes);
                q.codes = p.codes, q.ahead = 0;
                multiply_rows_any(type, 0, q, k, x, m, o);
            } else {
                multiply_rows_any(type, laid_out, q, k, x, m, o);
            }
        }
        free(p.codes);
        free(p.scale);
        free(p.low);
#ifdef HAVE_AMX
        if (tiles) _tile_release();
#endif
    }
    free(x.q);
    free(x.d);
    free(x.s16);
    free(x.sum);
    free(x.off);
#ifdef HAVE_AMX
    free(xt.q);
    free(xt.s16);
    free(xt.d);
    free(xt.sum);
#endif
}

#else
int q8_available(void) { return 0; }
void q8_panels(int type, const uint8_t *w, int64_t n, int64_t k, int64_t rb, uint8_t *out, int threads) { abort(); }
void q8_panel_rows(const uint8_t *w, int64_t k, const int64_t *ids, int64_t count, float *out) { abort(); }
void q8_matmul(int parts, const int *types, const uint8_t *const *ws, const int64_t *row_bytes,
               const float *const *row_scales, const int64_t *part_rows, int64_t k, const void *xv, int64_t x_stride,
               int m, const float *bias, void *out, int64_t out_stride, int out_bf16, int x_bf16, int threads) {
    abort(); /* quant.py never calls it where q8_available() is 0 */
}
#endif
