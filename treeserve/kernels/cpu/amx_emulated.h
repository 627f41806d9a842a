/* AMX's tile instructions in plain C, for proving the AMX kernels' logic on a CPU without AMX.
 *
 * Built in only with TREESERVE_AMX_EMULATED=1 (`build` then adds -DTREESERVE_AMX_EMULATED; amx.h
 * includes this instead of asking Linux for tile state), as TRITON_INTERPRET=1 runs the GPU
 * kernels on a CPU: the kernels' layouts, offsets, tails, partial tiles and threads then run
 * here, slowly, through the same code an AMX Xeon runs. Each thread has its own 8 tiles and
 * configuration, as each core has. TDPBF16PS follows the pseudo-code of Intel's manual (each
 * pair's two exact products added to the fp32 sum in order, rounded to nearest even, denormal
 * inputs and results flushed to zero); what this cannot prove is that the silicon rounds the
 * same way. The integer products (TDPBUSD, TDPBSUD) are exact either way.
 * The intrinsics are macros here (GCC's immintrin.h defines them for a target with AMX); each
 * name is redefined after it. */
#ifndef TREESERVE_AMX_EMULATED_H
#define TREESERVE_AMX_EMULATED_H
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    uint8_t rows, data[16][64]; /* data past a tile's configured rows and bytes stays zero */
    uint16_t colsb;
} emulated_tile;

static __thread emulated_tile emulated_tiles[8];

static inline void emulated_loadconfig(const void *config) {
    const tile_config *cfg = (const tile_config *)config;
    for (int t = 0; t < 8; t++) {
        emulated_tiles[t].rows = cfg->rows[t];
        emulated_tiles[t].colsb = cfg->colsb[t];
        memset(emulated_tiles[t].data, 0, sizeof emulated_tiles[t].data);
    }
}

static inline void emulated_loadd(int t, const void *base, int64_t stride) {
    emulated_tile *tile = &emulated_tiles[t];
    for (int r = 0; r < tile->rows; r++) memcpy(tile->data[r], (const uint8_t *)base + r * stride, tile->colsb);
}

static inline void emulated_stored(int t, void *base, int64_t stride) {
    const emulated_tile *tile = &emulated_tiles[t];
    for (int r = 0; r < tile->rows; r++) memcpy((uint8_t *)base + r * stride, tile->data[r], tile->colsb);
}

static inline float emulated_bf16(const uint8_t *at) { /* a denormal reads as zero */
    uint32_t bits = (uint32_t)(at[0] | at[1] << 8) << 16;
    if ((bits & 0x7f800000u) == 0) bits &= 0x80000000u;
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

static inline float emulated_flush(float value) { /* a denormal result becomes zero */
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    if ((bits & 0x7f800000u) == 0) bits &= 0x80000000u;
    memcpy(&value, &bits, sizeof value);
    return value;
}

/* TDPBF16PS: c[m][n] += a[m] pair k . b[k] pair n over the pairs of a row of a (fp32 lanes of c). */
static inline void emulated_dpbf16ps(int c, int a, int b) {
    emulated_tile *dst = &emulated_tiles[c];
    const emulated_tile *x = &emulated_tiles[a], *y = &emulated_tiles[b];
    for (int m = 0; m < dst->rows; m++)
        for (int k = 0; k < x->colsb / 4; k++)
            for (int n = 0; n < dst->colsb / 4; n++) {
                float sum;
                memcpy(&sum, dst->data[m] + 4 * n, sizeof sum);
                for (int i = 0; i < 4; i += 2) /* the pair's two products, in order */
                    sum = emulated_flush(sum + emulated_bf16(x->data[m] + 4 * k + i) *
                                                   emulated_bf16(y->data[k] + 4 * n + i));
                memcpy(dst->data[m] + 4 * n, &sum, sizeof sum);
            }
}

/* TDPBUSD / TDPBSUD: c[m][n] += the 4 byte products of a[m] dword k and b[k] dword n (int32, wrapping);
 * `a_signed`: a's bytes are int8 and b's uint8 (BSUD), else the other way round (BUSD). */
static inline void emulated_dpb(int c, int a, int b, int a_signed) {
    emulated_tile *dst = &emulated_tiles[c];
    const emulated_tile *x = &emulated_tiles[a], *y = &emulated_tiles[b];
    for (int m = 0; m < dst->rows; m++)
        for (int k = 0; k < x->colsb / 4; k++)
            for (int n = 0; n < dst->colsb / 4; n++) {
                int32_t sum;
                memcpy(&sum, dst->data[m] + 4 * n, sizeof sum);
                for (int i = 0; i < 4; i++) {
                    const uint8_t p = x->data[m][4 * k + i], q = y->data[k][4 * n + i];
                    const int32_t product =
                        a_signed ? (int32_t)(int8_t)p * (int32_t)q : (int32_t)p * (int32_t)(int8_t)q;
                    sum = (int32_t)((uint32_t)sum + (uint32_t)product);
                }
                memcpy(dst->data[m] + 4 * n, &sum, sizeof sum);
            }
}

#undef _tile_loadd
#undef _tile_stored
#undef _tile_zero
#undef _tile_dpbf16ps
#undef _tile_dpbusd
#undef _tile_dpbsud
#define _tile_loadconfig(config) emulated_loadconfig(config)
#define _tile_release() ((void)0)
#define _tile_loadd(t, base, stride) emulated_loadd(t, base, stride)
#define _tile_stored(t, base, stride) emulated_stored(t, base, stride)
#define _tile_zero(t) memset(emulated_tiles[t].data, 0, sizeof emulated_tiles[t].data)
#define _tile_dpbf16ps(c, a, b) emulated_dpbf16ps(c, a, b)
#define _tile_dpbusd(c, a, b) emulated_dpb(c, a, b, 0)
#define _tile_dpbsud(c, a, b) emulated_dpb(c, a, b, 1)

/* Tiles "usable" unless TREESERVE_AMX=0 turns them off, as on an AMX CPU. */
static int amx_usable(void) {
    const char *setting = getenv("TREESERVE_AMX");
    return !(setting && setting[0] == '0' && setting[1] == 0);
}
#endif
