/* bf16 as the kernels store it (the upper half of an fp32), and the scalar conversions every
 * kernel that rounds to bf16 one value at a time uses: PyTorch's round to nearest even. */
#ifndef TREESERVE_BF16_H
#define TREESERVE_BF16_H
#include <stdint.h>

typedef uint16_t bf16;

static inline float load_bf16(bf16 x) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)x << 16;
    return v.f;
}

static inline bf16 store_bf16(float f) {
    union { uint32_t u; float f; } v;
    v.f = f;
    v.u += 0x7fffu + ((v.u >> 16) & 1u); /* round to nearest even */
    return (bf16)(v.u >> 16);
}
#endif
