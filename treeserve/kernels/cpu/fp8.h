/* FP8 e4m3fn (torch.float8_e4m3fn: 1 sign, 4 exponent bits of bias 7, 3 mantissa bits, no
 * infinities, 0x7f/0xff NaN) as the FP8 KV cache stores it, in portable C.
 *
 * store_fp8: fp32 -> e4m3 rounded to nearest even, saturated at +-448 (inf too), NaN to NaN:
 *   the bits torch's `.to(torch.float8_e4m3fn)` gives (c10's conversion, which saturates).
 * load_fp8: e4m3 -> fp32, exact, from a 256-entry table filled when the library loads.
 */
#ifndef TREESERVE_FP8_H
#define TREESERVE_FP8_H
#include <stdint.h>

typedef uint8_t fp8;

static float fp8_table[256];

static inline float fp8_bits_to_f32(uint32_t u) {
    union { uint32_t u; float f; } v;
    v.u = u;
    return v.f;
}

__attribute__((constructor)) static void fill_fp8_table(void) {
    for (int x = 0; x < 256; x++) {
        const int exponent = (x >> 3) & 0xf, mantissa = x & 7;
        float f;
        if ((x & 0x7f) == 0x7f)
            f = fp8_bits_to_f32(0x7fc00000u); /* NaN */
        else if (exponent == 0)
            f = (float)mantissa * (1.0f / 512.0f); /* subnormal: m x 2^-9 */
        else
            f = fp8_bits_to_f32((uint32_t)(exponent + 120) << 23 | (uint32_t)mantissa << 20);
        fp8_table[x] = x & 0x80 ? -f : f;
    }
}

static inline float load_fp8(fp8 x) { return fp8_table[x]; }

static inline fp8 store_fp8(float f) {
    union { uint32_t u; float f; } v;
    v.f = f;
    const uint32_t sign = (v.u >> 24) & 0x80u;
    uint32_t bits = v.u & 0x7fffffffu;
    uint32_t code;
    if (bits > 0x7f800000u)
        code = 0x7f; /* NaN */
    else if (bits >= 0x43e00000u)
        code = 0x7e; /* 448 and above: the largest finite value */
    else if (bits < (121u << 23)) {
        /* below 2^-6, the subnormals' range: the multiple of 2^-9 nearest (ties to even), in integers
         * (GCC's -ffast-math broke the float version, adding 2^14 and taking the low bits) */
        const uint32_t exponent = bits >> 23, mantissa = (bits & 0x7fffffu) | (exponent ? 0x800000u : 0);
        const uint32_t shift = 141u - exponent < 31u ? 141u - exponent : 31u; /* value = mantissa >> shift x 2^-9 */
        const uint32_t rest = mantissa & ((1u << shift) - 1u), half = 1u << (shift - 1u);
        code = mantissa >> shift;
        code += (rest > half) | ((rest == half) & code & 1u);
    } else {
        bits += ((uint32_t)(7 - 127) << 23) + 0x7ffffu + ((bits >> 20) & 1u); /* round to nearest even */
        code = bits >> 20;
    }
    return (fp8)(code | sign);
}
#endif
