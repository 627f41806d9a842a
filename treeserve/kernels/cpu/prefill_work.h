/* The work list both paged prefill kernels (cpu_kernels.c, prefill_avx2.c) split a call into: an
 * item is (sequence, KV head, first row) with up to `item_rows` rows, a row being (query, query
 * head of the KV head's group); with threads, longest first, so the last items taken are short. */
#ifndef TREESERVE_PREFILL_WORK_H
#define TREESERVE_PREFILL_WORK_H
#include <stdint.h>
#include <stdlib.h>

typedef struct {
    int64_t cost, seq, kv_head, row; /* its rows x the keys its last row sees */
} prefill_work;

static inline int longest_first(const void *a, const void *b) {
    const prefill_work *x = (const prefill_work *)a, *y = (const prefill_work *)b;
    if (x->cost != y->cost) return x->cost > y->cost ? -1 : 1;
    if (x->seq != y->seq) return x->seq < y->seq ? -1 : 1;
    if (x->row != y->row) return x->row < y->row ? -1 : 1;
    return (x->kv_head > y->kv_head) - (x->kv_head < y->kv_head);
}

/* How many items a call has with up to `item_rows` rows an item. */
static inline int64_t prefill_item_count(const int64_t *q_lens, int batch, int group, int kv_heads, int item_rows) {
    int64_t items = 0;
    for (int b = 0; b < batch; b++) items += (q_lens[b] * group + item_rows - 1) / item_rows * kv_heads;
    return items;
}

/* The items of a call (malloc'd, *count of them) and the longest context, into *max_ctx. */
static inline prefill_work *prefill_work_list(const int64_t *q_lens, const int64_t *ctx_lens, int batch, int group,
                                              int kv_heads, int item_rows, int64_t window, int threads, int64_t *count,
                                              int64_t *max_ctx) {
    const int64_t items = prefill_item_count(q_lens, batch, group, kv_heads, item_rows);
    *max_ctx = 0;
    for (int b = 0; b < batch; b++) *max_ctx = ctx_lens[b] > *max_ctx ? ctx_lens[b] : *max_ctx;
    prefill_work *work = (prefill_work *)malloc(sizeof(prefill_work) * (items + 1));
    int64_t n = 0;
    for (int b = 0; b < batch; b++)
        for (int h = 0; h < kv_heads; h++)
            for (int64_t r = 0; r < q_lens[b] * group; r += item_rows) {
                const int64_t rows = q_lens[b] * group - r < item_rows ? q_lens[b] * group - r : item_rows;
                const int64_t keys = ctx_lens[b] - q_lens[b] + (r + rows) / group;
                work[n++] = (prefill_work){rows * (window > 0 && keys > window ? window : keys), b, h, r};
            }
    if (threads > 1) qsort(work, n, sizeof(prefill_work), longest_first);
    *count = n;
    return work;
}
#endif
