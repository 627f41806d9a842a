/* The GGUF block formats' dequantisers, one 32-weight chunk at a time: deq_T(row, c, row_scale,
 * w) writes weights c*32 .. c*32+31 of a row (llama.cpp's layouts, ggml-common.h; int8 rows
 * scaled by `row_scale`) as fp32 into w[32]: the reference values every quantised kernel is
 * tested against, computed once here for quant_kernels.c and amx_linear.c. AVX-512 (BW)
 * versions where the compiler targets it, portable loops otherwise. */
#ifndef TREESERVE_DEQUANT_H
#define TREESERVE_DEQUANT_H
#include <stdint.h>
#include <string.h>

enum { T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14,
       T_I8 = 1000 };

#if defined(__F16C__)
#include <immintrin.h>
static inline float fp16_to_f32(const uint8_t *p) { return _cvtsh_ss((unsigned short)(p[0] | (p[1] << 8))); }
#else
static inline float fp16_to_f32(const uint8_t *p) {
    uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (mant << 13);
    } else if (mant == 0) {
        bits = sign;
    } else { /* subnormal: normalise */
        exp = 113;
        while (!(mant & 0x400)) { mant <<= 1; exp--; }
        bits = sign | (exp << 23) | ((mant & 0x3ff) << 13);
    }
    union { uint32_t u; float f; } v = {bits};
    return v.f;
}
#endif

/* Sub-block j's scale and min in a Q4_K/Q5_K super-block b (d, dmin, then 6-bit scales[12]):
 * d * sc and dmin * mn, both exact in fp32. */
static inline void k_scale_min(const uint8_t *b, int j, float *d, float *m) {
    const uint8_t *q = b + 4;
    int sc, mn;
    if (j < 4) {
        sc = q[j] & 63;
        mn = q[j + 4] & 63;
    } else {
        sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
    *d = fp16_to_f32(b) * sc;
    *m = fp16_to_f32(b + 2) * mn;
}

/* deq_T: weights c*32 .. c*32+31 of a row into w[32]. With AVX-512 (BW) the common formats
 * unpack 32 weights into two 16-lane vectors; the portable loops below are the fallback. */
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define HAVE_AVX512_DEQUANT 1

static inline void store32(float *w, __m512i lo, __m512i hi, __m512 d) {
    _mm512_store_ps(w, _mm512_mul_ps(_mm512_cvtepi32_ps(lo), d));
    _mm512_store_ps(w + 16, _mm512_mul_ps(_mm512_cvtepi32_ps(hi), d));
}

static inline void deq_Q8_0(const uint8_t *row, int64_t c, float row_scale, float *restrict w) {
    const uint8_t *b = row + c * 34;
    const __m512 d = _mm512_set1_ps(fp16_to_f32(b));
    store32(w, _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 2))),
            _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 18))), d);
}

static inline void deq_I8(const uint8_t *row, int64_t c, float row_scale, float *restrict w) {
    const uint8_t *b = row + c * 32;
    store32(w, _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)b)),
            _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 16))), _mm512_set1_ps(row_scale));
}

static inline void deq_Q4_0(const uint8_t *row, int64_t c, float row_scale, float *restrict w) {
    const uint8_t *b = row + c * 18;
    const __m128i q = _mm_loadu_si128((const __m128i *)(b + 2)), low4 = _mm_set1_epi8(0xF);
    const __m512i eight = _mm512_set1_epi32(8);
    store32(w, _mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm_and_si128(q, low4)), eight),
            _mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(q, 4), low4)), eight),
            _mm512_set1_ps(fp16_to_f32(b)));
}

static inline void deq_Q5_0(const uint8_t *row, int64_t c, float row_scale, float *restrict w) {
    const uint8_t *b = row + c * 22;
    uint32_t qh;
    memcpy(&qh, b + 2, 4);
    const __m128i q = _mm_loadu_si128((const __m128i *)(b + 6)), low4 = _mm_set1_epi8(0xF);
    const __m512i sixteen = _mm512_set1_epi32(16);
    __m512i lo = _mm512_cvtepu8_epi32(_mm_and_si128(q, low4));
    __m512i hi = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(q, 4), low4));
    lo = _mm512_mask_or_epi32(lo, (__mmask16)(qh & 0xFFFF), lo, sixteen);
    hi = _mm512_mask_or_epi32(hi, (__mmask16)(qh >> 16), hi, sixteen);
    store32(w, _mm512_sub_epi32(lo, sixteen), _mm512_sub_epi32(hi, sixteen), _mm512_set1_ps(fp16_to_f32(b)));
}

static inline void deq_Q4_K(const uint8_t *row, int64_t c, float row_scale, float *restrict w) {
    const uint8_t *b = row + (c >> 3) * 144;
    const int s = (int)(c & 7);
    float ds, ms;
    k_scale_min(b, s, &ds, &ms);
    const __m512 d = _mm512_set1_ps(ds), m = _mm512_set1_ps(ms);
    __m256i q = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * (s >> 1)));
    if (s & 1) q = _mm256_srli_epi16(q, 4);
    q = _mm256_and_si256(q, _mm256_set1_epi8(0xF));
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(q)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(q, 1)));
    _mm512_store_ps(w, _mm512_sub_ps(_mm512_mul_ps(d, lo), m));
    _mm512_store_ps(w + 16, _mm512_sub_ps(_mm512_mul_ps(d, hi), m));
}

static inline void deq_Q6_K(const uint8_t *row, int64_t c, float row_scale, float *restrict w) {
    const uint8_t *b = row + (c >> 3) * 210;
    const int half = (int)(c & 7) >> 2, quarter = (int)(c & 3);
    const int8_t *sc = (const int8_t *)(b + 192) + 8 * half + 2 * quarter;
    const float d = fp16_to_f32(b + 208);
    __m256i ql = _mm256_loadu_si256((const __m256i *)(b + 64 * half + 32 * (quarter & 1)));
    __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * half));
    if (quarter >> 1) ql = _mm256_srli_epi16(ql, 4);
    qh = _mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * quarter));
    const __m256i q = _mm256_or_si256(_mm256_and_si256(ql, _mm256_set1_epi8(0xF)),
                                      _mm256_slli_epi16(_mm256_and_si256(qh, _mm256_set1_epi8(3)), 4));
    const __m512i thirty_two = _mm512_set1_epi32(32);
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(q)), thirty_two));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(q, 1)), thirty_two));
    _mm512_store_ps(w, _mm512_mul_ps(_mm512_set1_ps(d * sc[0]), lo));
    _mm512_store_ps(w + 16, _mm512_mul_ps(_mm512_set1_ps(d * sc[1]), hi));
}
#endif

#ifndef HAVE_AVX512_DEQUANT
static inline void deq_Q8_0(const uint8_t *row, int64_t c, float row_scale, float *restrict w) {
    const uint8_t *b = row + c * 34;
    const float d = fp16_to_f32(b);
    const int8_t *q = (const int8_t *)(b + 2);
    for (int l = 0; l < 32; l++) w[l] = d * q[l];
}
#endif

#ifndef HAVE_AVX512_DEQUANT
static inline void deq_Q4_0(const uint8_t *row, int64_t c, float row_scale, float *restrict w) {
    const uint8_t *b = row + c * 18;
    const float d = fp16_to_f32(b);
    for (int l = 0; l < 16; l++) {
        w[l] = d * ((b[2 + l] & 0xF) - 8);
        w[l + 16] = d * ((b[2 + l] >> 4) - 8);
    }
}
#endif

static inline void deq_Q4_1(const uint8_t *row, int64_t c, float row_scale, float *restrict w) {
    const uint8_t *b = row + c * 20;
    const float d = fp16_to_f32(b), m = fp16_to_f32(b + 2);
    for (int l = 0; l < 16; l++) {
        w[l] = d * (b[4 + l] & 0xF) + m;
        w[l + 16] = d * (b[4 + l] >> 4) + m;
    }
}

#ifndef HAVE_AVX512_DEQUANT
static inline void deq_Q5_0(const uint8_t *row, int64_t c, float row_scale, float *restrict w) {
    const uint8_t *b = row + c * 22;
    const float d = fp16_to_f32(b);
    uint32_t qh;
    memcpy(&qh, b + 2, 4);
    for (int l = 0; l < 16; l++) {
        const int h0 = ((qh >> l) << 4) & 0x10, h1 = (qh >> (l + 12)) & 0x10;
        w[l] = d * (((b[6 + l] & 0xF) | h0) - 16);
        w[l + 16] = d * (((b[6 + l] >> 4) | h1) - 16);
    }
}
#endif

static inline void deq_Q5_1(const uint8_t *row, int64_t c, float row_scale, float *restrict w) {
    const uint8_t *b = row + c * 24;
    const float d = fp16_to_f32(b), m = fp16_to_f32(b + 2);
    uint32_t qh;
    memcpy(&qh, b + 4, 4);
    for (int l = 0; l < 16; l++) {
        const int h0 = ((qh >> l) << 4) & 0x10, h1 = (qh >> (l + 12)) & 0x10;
        w[l] = d * ((b[8 + l] & 0xF) | h0) + m;
        w[l + 16] = d * ((b[8 + l] >> 4) | h1) + m;
    }
}

#ifndef HAVE_AVX512_DEQUANT
/* d, dmin, scales[12], qs[128]; sub-block s of 8 uses nibble s%2 of qs[32*(s/2)..] */
static inline void deq_Q4_K(const uint8_t *row, int64_t c, float row_scale, float *restrict w) {
    const uint8_t *b = row + (c >> 3) * 144;
    const int s = (int)(c & 7);
    float d, m;
    k_scale_min(b, s, &d, &m);
    const uint8_t *q = b + 16 + 32 * (s >> 1);
    const int shift = 4 * (s & 1);
    for (int l = 0; l < 32; l++) w[l] = d * ((q[l] >> shift) & 0xF) - m;
}
#endif

/* d, dmin, scales[12], qh[32], qs[128]; the 5th bit of sub-block s is bit s of qh[l] */
static inline void deq_Q5_K(const uint8_t *row, int64_t c, float row_scale, float *restrict w) {
    const uint8_t *b = row + (c >> 3) * 176;
    const int s = (int)(c & 7);
    float d, m;
    k_scale_min(b, s, &d, &m);
    const uint8_t *qh = b + 16, *q = b + 48 + 32 * (s >> 1);
    const int shift = 4 * (s & 1);
    for (int l = 0; l < 32; l++) w[l] = d * (((q[l] >> shift) & 0xF) | (((qh[l] >> s) & 1) << 4)) - m;
}

#ifndef HAVE_AVX512_DEQUANT
/* ql[128], qh[64], int8 scales[16], d; halves of 128, quarters of 32 */
static inline void deq_Q6_K(const uint8_t *row, int64_t c, float row_scale, float *restrict w) {
    const uint8_t *b = row + (c >> 3) * 210;
    const int half = (int)(c & 7) >> 2, quarter = (int)(c & 3);
    const uint8_t *ql = b + 64 * half + 32 * (quarter & 1), *qh = b + 128 + 32 * half;
    const int8_t *sc = (const int8_t *)(b + 192) + 8 * half + 2 * quarter;
    const float d = fp16_to_f32(b + 208);
    const int lshift = 4 * (quarter >> 1), hshift = 2 * quarter;
    const float d0 = d * sc[0], d1 = d * sc[1];
    for (int l = 0; l < 32; l++) {
        const int q = (((ql[l] >> lshift) & 0xF) | (((qh[l] >> hshift) & 3) << 4)) - 32;
        w[l] = (l < 16 ? d0 : d1) * q;
    }
}
#endif

#ifndef HAVE_AVX512_DEQUANT
static inline void deq_I8(const uint8_t *row, int64_t c, float row_scale, float *restrict w) {
    const int8_t *q = (const int8_t *)row + c * 32;
    for (int l = 0; l < 32; l++) w[l] = row_scale * q[l];
}
#endif

#endif
