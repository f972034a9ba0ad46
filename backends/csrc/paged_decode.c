/* Decode attention over a paged KV cache, read in place (hetero-pd, backends/paged_decode.py).
 *
 * One query token per sequence; a task per sequence. Its query heads read each K row of its
 * context once (one slot: every KV head, contiguous), take a softmax, then read each V row
 * once (weighted sum). No gathered copy of K/V is made; tasks run in parallel under torch's
 * OpenMP runtime (the library links the libgomp torch has already loaded).
 *
 *   k, v:  [num_slots, kv_heads, head_dim] float32
 *   q:     [n, kv_heads * group, head_dim] float32;  out: the same shape, float32
 *   slots: [n, ctx] int64 cache slot of each context position; mask: [n, ctx] uint8 (1 = attend)
 *
 * Returns 0; -1 when a slot lies outside [0, num_slots) (nothing is read then), -2 for more
 * than 256 query heads, -3 when scratch memory could not be had.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 8
#define MAX_HEADS 256
#define AHEAD 4 /* context positions prefetched ahead */

/* Asks for the row of context position t before it is needed: a sequence's slots run
 * through blocks scattered over the cache, across pages the hardware's prefetchers stop at.
 * Measured on a 2-vCPU AMD EPYC: 20-25% faster than without, at 2 to 4 positions ahead. */
static inline void prefetch_row(const float *base, const int64_t *sl, const uint8_t *mk,
                                int64_t t, int64_t ctx, int64_t width) {
    if (t >= ctx || !mk[t]) return;
    const char *at = (const char *)(base + sl[t] * width);
    for (int64_t b = 0; b < width * (int64_t)sizeof(float); b += 64) __builtin_prefetch(at + b);
}

static inline float dot(const float *a, const float *b, int64_t d) {
    float acc[LANES] = {0};
    int64_t c = 0;
    for (; c + LANES <= d; c += LANES)
        for (int k = 0; k < LANES; k++) acc[k] += a[c + k] * b[c + k];
    float s = 0.0f;
    for (int k = 0; k < LANES; k++) s += acc[k];
    for (; c < d; c++) s += a[c] * b[c];
    return s;
}

int paged_decode(const float *q, const float *k, const float *v, const int64_t *slots,
                 const uint8_t *mask, float *out, int64_t n, int64_t ctx, int64_t kv_heads,
                 int64_t group, int64_t d, int64_t num_slots, float scale, int threads) {
    int64_t heads = kv_heads * group, width = kv_heads * d; /* width: one slot's K (or V) */
    if (heads > MAX_HEADS) return -2;
    if (n <= 0 || heads <= 0 || d <= 0) return 0;
    if (ctx <= 0) { /* nothing to attend to: zeros, as for a row with every position masked */
        memset(out, 0, sizeof(float) * (size_t)(n * heads * d));
        return 0;
    }
    for (int64_t t = 0; t < n * ctx; t++)
        if (mask[t] && (slots[t] < 0 || slots[t] >= num_slots)) return -1;
    if (threads < 1) threads = 1;
    int64_t kv_of[MAX_HEADS]; /* offset of query head j's KV head in a slot's row */
    for (int64_t j = 0; j < heads; j++) kv_of[j] = (j / group) * d;
    /* Per thread: every query head's scores. */
    int64_t per_thread = heads * ctx;
    float *scratch = malloc(sizeof(float) * (size_t)(per_thread * threads));
    if (!scratch) return -3;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t i = 0; i < n; i++) {
        float *p = scratch + per_thread * omp_get_thread_num(); /* p[head * ctx + t] */
        const float *qi = q + i * heads * d;
        float *oi = out + i * heads * d;
        const int64_t *sl = slots + i * ctx;
        const uint8_t *mk = mask + i * ctx;
        float mx[MAX_HEADS], sum[MAX_HEADS];
        for (int64_t j = 0; j < heads; j++) mx[j] = -INFINITY;
        /* Scores: each slot's K row (all KV heads, contiguous) is read once. */
        for (int64_t t = 0; t < ctx; t++) {
            if (!mk[t]) continue;
            prefetch_row(k, sl, mk, t + AHEAD, ctx, width);
            const float *row = k + sl[t] * width;
            for (int64_t j = 0; j < heads; j++) {
                float s = dot(qi + j * d, row + kv_of[j], d) * scale;
                p[j * ctx + t] = s;
                if (s > mx[j]) mx[j] = s;
            }
        }
        for (int64_t j = 0; j < heads; j++) {
            sum[j] = 0.0f;
            for (int64_t t = 0; t < ctx; t++) {
                float e = mk[t] ? expf(p[j * ctx + t] - mx[j]) : 0.0f;
                p[j * ctx + t] = e;
                sum[j] += e;
            }
        }
        memset(oi, 0, sizeof(float) * (size_t)(heads * d));
        /* Weighted sum: each slot's V row read once. */
        for (int64_t t = 0; t < ctx; t++) {
            if (!mk[t]) continue;
            prefetch_row(v, sl, mk, t + AHEAD, ctx, width);
            const float *row = v + sl[t] * width;
            for (int64_t j = 0; j < heads; j++) {
                float w = p[j * ctx + t];
                const float *vr = row + kv_of[j];
                float *o = oi + j * d;
                for (int64_t c = 0; c < d; c++) o[c] += w * vr[c];
            }
        }
        for (int64_t j = 0; j < heads; j++) {
            float inv = sum[j] > 0.0f ? 1.0f / sum[j] : 0.0f; /* no position attended: zeros */
            for (int64_t c = 0; c < d; c++) oi[j * d + c] *= inv;
        }
    }
    free(scratch);
    return 0;
}
