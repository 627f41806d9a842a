/* layer_stack_bf16: a step through every decoder layer of a model in one call.
 *
 * A step of a small model on a CPU is ~20 kernel calls a layer, and at a few rows each costs
 * more in Python, PyTorch dispatch and ctypes than in arithmetic (~0.3 ms a layer: a PRM's
 * scoring step of two 20-token chunks paid more for it than for its matmuls). This runs the same
 * kernels in the same order from C: the matmuls (q8_kernels.c's 8-bit one, amx_linear.c's bf16
 * tiles or bf16_panels.c's dense panels, whichever the plans picked), RMSNorm, rope, the KV
 * store, and paged attention (cpu_kernels.c's decode kernel for the step's decode group, its
 * prefill kernel for the chunks of its prefill group), reached through the function pointers in
 * `stack` (those libraries are built with their own flags). What PyTorch ops did
 * between them is done here with PyTorch's roundings: residual adds and the activation's
 * product in fp32 rounded once to bf16, and the activation itself read from a table of
 * bf16 act(x) for all 65536 bf16 inputs that PyTorch's own kernel filled. So every row
 * gets the bits the per-op path gives it, whatever the batch.
 *
 * The layer: x += post_attn(attn(rope(qk_norm(split(qkv(input_norm(x))))))); x += post_mlp(
 * down(act(gate) * up)) with gate|up = gate_up(pre_mlp(x)). Gemma 3 has every norm (fp32
 * gains); Llama/Qwen2/Mistral only the input and pre-MLP ones (bf16 weights): a norm the layer
 * lacks is skipped. A matrix's bias (Qwen2's q/k/v) goes to the matmul, as the per-layer path
 * passes it.
 * Tokens are the step's rows, in the engine's two attention groups (engine/attention.py): the
 * decode group, one query a sequence (speculative rows are sequences of their own, as in the
 * engine), its rows named by `decode_rows` (NULL: rows 0 .. decode_batch - 1 in order); and the
 * prefill group, chunks of rows q_starts[b] .. q_starts[b] + q_lens[b] - 1, each attending to its
 * sequence's cached pages and causally within itself. Each group calls the kernel the per-layer
 * path calls for it, on the same rows, so it gets the same bits. Each row's rope rows are the
 * fp32 tables' rows at its position rounded to bf16 (as the per-layer path's lookup rounds
 * them), and after the last layer the model's final norm writes `out`.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

typedef void (*matmul_fn)(int parts, const int *types, const uint8_t *const *ws, const int64_t *row_bytes,
                          const float *const *row_scales, const int64_t *part_rows, int64_t k, const void *x,
                          int64_t x_stride, int m, const float *bias, void *out, int64_t out_stride, int out_bf16,
                          int x_bf16, int threads);
typedef void (*norm_fn)(const bf16 *x, int64_t rows, int dim, const float *gain, const bf16 *weight, float eps,
                        bf16 *out, int threads);
typedef void (*rope_fn)(const bf16 *x, int64_t row_stride, int64_t tokens, int heads, int dim, const bf16 *cos,
                        const bf16 *sin, bf16 *out, int threads);
typedef void (*store_fn)(const char *k, int64_t k_stride, const char *v, int64_t v_stride, int64_t tokens,
                         int64_t width, int elem, char *k_cache, int64_t page_stride, int64_t token_stride,
                         int64_t v_offset, const int64_t *pages, const int64_t *offsets);
typedef void (*attend_fn)(const bf16 *q, const bf16 *k_cache, int64_t page_stride, int64_t v_offset,
                          const int64_t *tables, int64_t table_stride, const int64_t *ctx_lens, int batch,
                          int q_heads, int kv_heads, int head_dim, int page_size, float scale, int64_t window,
                          int threads, bf16 *out);
typedef void (*prefill_fn)(const bf16 *q, const bf16 *k_cache, int64_t page_stride, int64_t v_offset,
                           const int64_t *tables, int64_t table_stride, const int64_t *q_starts, const int64_t *q_lens,
                           const int64_t *ctx_lens, int batch, int q_heads, int kv_heads, int head_dim, int page_size,
                           float scale, int64_t window, int tiles, int threads, bf16 *out);
typedef void (*gated_fn)(const bf16 *gate_up, int64_t rows, int64_t inter, const bf16 *table, bf16 *out, int threads);
typedef void (*rows_fn)(const uint8_t *table, int64_t k, const int64_t *ids, int64_t count, float *out);

typedef struct { /* a quantised matrix: q8_matmul's first seven arguments, its output width and bias */
    int parts;
    const int *types;
    const uint8_t *const *ws;
    const int64_t *row_bytes;
    const float *const *row_scales;
    const int64_t *part_rows;
    int64_t k, n;
    const float *bias; /* fp32 [n], or NULL */
} matrix;

enum { INPUT_NORM, Q_NORM, K_NORM, POST_ATTN_NORM, PRE_MLP_NORM, POST_MLP_NORM, NORMS };

typedef struct { /* one decoder layer: its matrices, norms, window and rope table */
    matrix qkv, o, gate_up, down;
    const float *gain[NORMS];  /* Gemma's norms: fp32 1 + w */
    const bf16 *weight[NORMS]; /* Llama's: bf16 w (a norm with neither is not in the layer) */
    int64_t window;            /* 0: global attention */
    int rope;                  /* which of the step's cos/sin rows: 0 global, 1 local */
} layer;

typedef struct { /* the model's shapes and the kernels the layers call */
    int hidden, q_heads, kv_heads, head_dim, intermediate;
    float eps;
    const bf16 *act; /* act(x) for every bf16 bit pattern x */
    matmul_fn matmul;
    norm_fn norm;
    rope_fn rope;
    store_fn store;
    attend_fn attend;
    prefill_fn prefill; /* NULL: no prefill kernel built (steps with a prefill group are not taken) */
    gated_fn gated; /* act(gate) * up from the table */
    const float *final_gain;  /* the model's final norm: Gemma's fp32 1 + w ... */
    const bf16 *final_weight; /* ... or Llama's bf16 w */
    rows_fn embed;            /* the table's fp32 rows (q8_panel_rows, bf16_panel_rows), or NULL: rows come as x */
    const uint8_t *embed_table;
    int64_t embed_rows;
    float embed_scale;        /* what the rows are multiplied by in bf16 (Gemma's sqrt(hidden)); 0: nothing */
} stack;

typedef struct { /* one step: rows, their positions, KV slots and pages, its attention groups */
    int64_t tokens;
    const int64_t *positions;
    const float *cos[2], *sin[2]; /* fp32 rope tables [positions, head_dim]: 0 global, 1 local */
    const int64_t *slot_pages, *slot_offsets;
    int decode_batch;            /* the decode group: its sequences (0: none) ... */
    const int64_t *decode_rows;  /* ... their rows (NULL: the step's first rows, in order) ... */
    const int64_t *tables, *context_lens; /* ... page tables [decode_batch, table_stride], tokens seen */
    int64_t table_stride;
    int prefill_batch;           /* the prefill group: its chunks (0: none) ... */
    const int64_t *prefill_tables, *q_starts, *q_lens, *prefill_context_lens; /* ... as paged_prefill_bf16 reads */
    int64_t prefill_table_stride;
    bf16 *k_cache;         /* layer 0's K pages; layer l's at k_cache + l * layer_stride */
    int64_t layer_stride, page_stride, v_offset;
    int page_size;
    float scale;
    int threads;
} step;

static void residual_add(bf16 *x, const bf16 *y, int64_t count) {
    for (int64_t i = 0; i < count; i++) x[i] = store_bf16(load_bf16(x[i]) + load_bf16(y[i]));
}

static void matmul(const stack *s, const matrix *w, const bf16 *x, int64_t m, bf16 *out, int threads) {
    s->matmul(w->parts, w->types, w->ws, w->row_bytes, w->row_scales, w->part_rows, w->k, x, w->k, (int)m, w->bias,
              out, w->n, 1, 1, threads);
}

/* `out` = norm `which` of the layer over x's rows, or x itself when the layer has no such norm */
static const bf16 *norm(const stack *s, const layer *ly, int which, const bf16 *x, int64_t rows, int dim, bf16 *out,
                        int threads) {
    if (!ly->gain[which] && !ly->weight[which]) return x;
    s->norm(x, rows, dim, ly->gain[which], ly->weight[which], s->eps, out, threads);
    return out;
}

/* Scratch that outlives the call, one per thread (tensor-parallel ranks may run stacks at once),
 * grown when a step needs more, up to SCRATCH_KEPT: a buffer of a step's size, allocated and
 * freed every call, was mmap'd fresh each time, and zeroing its new (huge) pages cost ~10% of a
 * served search's engine time. A larger step (a long prefill) allocates its own and frees it. */
#define SCRATCH_KEPT ((size_t)32 << 20)

static char *scratch(size_t bytes) {
    static _Thread_local char *buf = NULL;
    static _Thread_local size_t size = 0;
    if (bytes > size) {
        free(buf);
        size = bytes + bytes / 2;
        buf = (char *)aligned_alloc(64, (size + 63) / 64 * 64);
    }
    return buf;
}

/* attention of the step's decode group (gathered from and scattered to its rows where they are not
 * the first ones in order: the per-layer path's `out[index] = paged_decode(q[index])`) into att */
static void attend_decodes(const stack *s, const step *st, const layer *ly, const char *k_cache, const bf16 *q,
                           bf16 *qd, bf16 *od, bf16 *att, int threads) {
    const int64_t width = (int64_t)s->q_heads * s->head_dim, b = st->decode_batch;
    if (st->decode_rows)
        for (int64_t i = 0; i < b; i++) memcpy(qd + i * width, q + st->decode_rows[i] * width, width * sizeof(bf16));
    s->attend(st->decode_rows ? qd : q, (const bf16 *)k_cache, st->page_stride, st->v_offset, st->tables,
              st->table_stride, st->context_lens, (int)b, s->q_heads, s->kv_heads, s->head_dim, st->page_size,
              st->scale, ly->window, threads, st->decode_rows ? od : att);
    if (st->decode_rows)
        for (int64_t i = 0; i < b; i++) memcpy(att + st->decode_rows[i] * width, od + i * width, width * sizeof(bf16));
}

void layer_stack_bf16(const stack *s, const layer *layers, int count, const step *st, bf16 *x, bf16 *out) {
    const int64_t t = st->tokens, hidden = s->hidden, dim = s->head_dim;
    const int64_t q_size = (int64_t)s->q_heads * dim, kv_size = (int64_t)s->kv_heads * dim;
    const int64_t qkv_width = q_size + 2 * kv_size, inter = s->intermediate;
    const int threads = st->threads;
    /* scratch rows, each run starting on a 64-byte line (what torch.empty gives the per-op path) */
    const int64_t widths[16] = {hidden, hidden, qkv_width, q_size, q_size, q_size, kv_size, kv_size, 2 * inter, inter,
                                dim, dim, dim, dim, q_size, q_size};
    size_t offsets[17] = {0};
    for (int i = 0; i < 16; i++) offsets[i + 1] = offsets[i] + ((size_t)t * widths[i] * sizeof(bf16) + 63) / 64 * 64;
    const int kept = offsets[16] <= SCRATCH_KEPT;
    char *buf = kept ? scratch(offsets[16]) : (char *)aligned_alloc(64, offsets[16]);
    bf16 *run[16];
    for (int i = 0; i < 16; i++) run[i] = (bf16 *)(buf + offsets[i]);
    bf16 *h = run[0], *y = run[1], *qkv = run[2], *qn = run[3], *q = run[4], *att = run[5], *kn = run[6], *k = run[7],
         *gu = run[8], *mix = run[9], *qd = run[14], *od = run[15];
    bf16 *cos[2] = {run[10], run[11]}, *sin[2] = {run[12], run[13]};
    const int tables = st->cos[1] == st->cos[0] && st->sin[1] == st->sin[0] ? 1 : 2; /* Llama: one table for both */
    if (tables == 1) cos[1] = cos[0], sin[1] = sin[0];
    for (int table = 0; table < tables; table++) /* each row's cos/sin at its position, rounded as `.to(bfloat16)` */
        for (int64_t r = 0; r < t; r++) {
            const float *c = st->cos[table] + st->positions[r] * dim, *sn = st->sin[table] + st->positions[r] * dim;
            for (int64_t d = 0; d < dim; d++) {
                cos[table][r * dim + d] = store_bf16(c[d]);
                sin[table][r * dim + d] = store_bf16(sn[d]);
            }
        }
    for (int l = 0; l < count; l++) {
        const layer *ly = &layers[l];
        /* attention */
        matmul(s, &ly->qkv, norm(s, ly, INPUT_NORM, x, t, hidden, h, threads), t, qkv, threads);
        for (int64_t r = 0; r < t; r++) { /* the split's q and k rows, contiguous (as .contiguous()) */
            memcpy(qn + r * q_size, qkv + r * qkv_width, q_size * sizeof(bf16));
            memcpy(kn + r * kv_size, qkv + r * qkv_width + q_size, kv_size * sizeof(bf16));
        }
        const bf16 *qh = norm(s, ly, Q_NORM, qn, t * s->q_heads, dim, qn, threads);
        const bf16 *kh = norm(s, ly, K_NORM, kn, t * s->kv_heads, dim, kn, threads);
        s->rope(qh, q_size, t, s->q_heads, dim, cos[ly->rope], sin[ly->rope], q, threads);
        s->rope(kh, kv_size, t, s->kv_heads, dim, cos[ly->rope], sin[ly->rope], k, threads);
        char *k_cache = (char *)(st->k_cache + l * st->layer_stride);
        s->store((const char *)k, kv_size, (const char *)(qkv + q_size + kv_size), qkv_width, t, kv_size,
                 sizeof(bf16), k_cache, st->page_stride, kv_size, st->v_offset, st->slot_pages, st->slot_offsets);
        if (st->decode_batch) attend_decodes(s, st, ly, k_cache, q, qd, od, att, threads);
        if (st->prefill_batch)
            s->prefill(q, (const bf16 *)k_cache, st->page_stride, st->v_offset, st->prefill_tables,
                       st->prefill_table_stride, st->q_starts, st->q_lens, st->prefill_context_lens,
                       st->prefill_batch, s->q_heads, s->kv_heads, (int)dim, st->page_size, st->scale, ly->window,
                       1, threads, att); /* AMX tiles where the CPU has them */
        matmul(s, &ly->o, att, t, y, threads);
        residual_add(x, norm(s, ly, POST_ATTN_NORM, y, t, hidden, h, threads), t * hidden);
        /* MLP */
        matmul(s, &ly->gate_up, norm(s, ly, PRE_MLP_NORM, x, t, hidden, h, threads), t, gu, threads);
        s->gated(gu, t, inter, s->act, mix, threads);
        matmul(s, &ly->down, mix, t, y, threads);
        residual_add(x, norm(s, ly, POST_MLP_NORM, y, t, hidden, h, threads), t * hidden);
    }
    s->norm(x, t, (int)hidden, s->final_gain, s->final_weight, s->eps, out, threads);
    if (!kept) free(buf);
}

/* The step from its token ids: the embedding table's rows (fp32, as the lookup gives them)
 * rounded to bf16, times the model's bf16 scale rounded again (the per-op path's cast and
 * product), into x; then every layer and the final norm. -1: an id outside the table, nothing
 * run. */
int layer_stack_from_ids(const stack *s, const layer *layers, int count, const step *st, const int64_t *ids, bf16 *x,
                          bf16 *out) {
    const int64_t t = st->tokens, hidden = s->hidden;
    for (int64_t r = 0; r < t; r++)
        if (ids[r] < 0 || ids[r] >= s->embed_rows) return -1;
    float *rows = (float *)malloc(sizeof(float) * t * hidden);
    s->embed(s->embed_table, hidden, ids, t, rows);
    for (int64_t i = 0; i < t * hidden; i++) {
        const bf16 v = store_bf16(rows[i]);
        x[i] = s->embed_scale != 0.0f ? store_bf16(load_bf16(v) * s->embed_scale) : v;
    }
    free(rows);
    layer_stack_bf16(s, layers, count, st, x, out);
    return 0;
}
