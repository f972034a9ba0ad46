/* Part of paged_decode.c, included there after the per-row paths (it uses their
 * helpers exp16, round16_bf16 and MAX_HEADS); kept apart for size. */
#ifndef HETERO_PD_PREFILL_GEMM_H
#define HETERO_PD_PREFILL_GEMM_H
#ifdef HAVE_AVX512_BF16

/* Causal prefill in GEMM form (bfloat16, head dim 64, AVX-512 BF16): where the per-row path
 * (paged_decode.c) scores each row as a decode query (a 16-lane horizontal sum per head and 16
 * positions), here the scores of a block of query vectors (GB rows x the KV head's query
 * heads) against 16 positions come out of vdpbf16ps with the positions in the lanes: K is
 * first laid out per (chunk, KV head) as pairs of dims x 16 positions, and V as pairs of
 * positions x dims, so both products take a broadcast pair of the other side (q's dims, the
 * weights' positions). Weights are rounded to bfloat16 before they multiply V, as SDPA's
 * are, and positions past a row's last (the causal mask) weigh 0. */
#define GB 16     /* query rows per task */
#define QV 8      /* query vectors scored together (accumulators in registers) */
#define OV 6      /* query vectors weighed together: 6 x 4 accumulators + 4 V vectors */

/* 16 float32 rounded to bfloat16 (nearest even; a NaN stays a quiet NaN), narrowed. */
TARGET_BF16 static inline __m256i narrow16_bf16(__m512 f) {
    __mmask16 nan = _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q);
    __m512i r = _mm512_castps_si512(round16_bf16(f));
    r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc00000));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

typedef struct {
    const bf16 *q, *k, *v;
    bf16 *out;
    uint32_t *kp, *vp; /* packed K and V of every (chunk, KV head), see pack_kv */
    int64_t tokens, kv_heads, group, tiles, pairs;
    float scale;
} gemm_t;

/* Chunk c, KV head h: kp[tile][32 dim pairs][16 positions], vp[position pairs][64 dims]. */
TARGET_BF16 static void pack_kv(const gemm_t *g, int64_t c, int64_t h) {
    const int64_t width = g->kv_heads * 64, T = g->tokens;
    const bf16 *k = g->k + c * T * width + h * 64, *v = g->v + c * T * width + h * 64;
    uint32_t *kp = g->kp + (c * g->kv_heads + h) * g->tiles * 16 * 32;
    uint32_t *vp = g->vp + (c * g->kv_heads + h) * g->pairs * 64;
    for (int64_t t = 0; t < g->tiles * 16; t++) {
        const uint32_t *row = (const uint32_t *)(k + t * width);
        for (int64_t p = 0; p < 32; p++) kp[((t / 16) * 32 + p) * 16 + t % 16] = t < T ? row[p] : 0;
    }
    for (int64_t t2 = 0; t2 < g->pairs; t2++) {
        const bf16 *a = v + 2 * t2 * width, *b = v + (2 * t2 + 1) * width;
        for (int64_t d = 0; d < 64; d++)
            vp[t2 * 64 + d] = (uint32_t)a[d] | (2 * t2 + 1 < T ? (uint32_t)b[d] << 16 : 0u);
    }
}

/* Rows i0.. i0+GB-1 of chunk c, query heads of KV head h; s: scratch of GB * group rows of
 * `ld` floats (scores, then the weights as bfloat16 in the same memory). */
TARGET_BF16 static void gemm_task(const gemm_t *g, int64_t c, int64_t h, int64_t i0, float *s,
                                  int64_t ld) {
    const int64_t T = g->tokens, G = g->group, heads = g->kv_heads * G;
    const int64_t rows = T - i0 < GB ? T - i0 : GB, M = rows * G, len = i0 + rows;
    const int64_t tiles = (len + 15) / 16;
    const uint32_t *kp = g->kp + (c * g->kv_heads + h) * g->tiles * 16 * 32;
    const uint32_t *vp = g->vp + (c * g->kv_heads + h) * g->pairs * 64;
    float mxs[GB * 32], inv[GB * 32];
    /* query vector m: row i0 + m / G, head h * G + m % G */
#define QROW(m) ((const uint32_t *)(g->q + ((c * T + i0 + (m) / G) * heads + h * G + (m) % G) * 64))
    for (int64_t m0 = 0; m0 < M; m0 += QV) {
        int64_t mb = M - m0 < QV ? M - m0 : QV;
        const uint32_t *qr[QV];
        __m512 mx[QV];
        for (int64_t m = 0; m < QV; m++) { /* vectors past the last: a copy, not stored */
            qr[m] = QROW(m0 + (m < mb ? m : 0));
            mx[m] = _mm512_set1_ps(-INFINITY);
        }
        for (int64_t tile = 0; tile < tiles; tile++) {
            __m512 acc[QV];
            for (int m = 0; m < QV; m++) acc[m] = _mm512_setzero_ps();
            const uint32_t *kt = kp + tile * 32 * 16;
            for (int p = 0; p < 32; p++) {
                __m512i kv = _mm512_loadu_si512(kt + p * 16);
                for (int m = 0; m < QV; m++)
                    acc[m] = _mm512_dpbf16_ps(acc[m], (__m512bh)_mm512_set1_epi32((int)qr[m][p]),
                                              (__m512bh)kv);
            }
            for (int64_t m = 0; m < mb; m++) {
                int64_t last = i0 + (m0 + m) / G; /* the row attends to positions 0..last */
                int64_t n = last - tile * 16 + 1;
                __mmask16 live = n >= 16  ? (__mmask16)0xffff
                                 : n <= 0 ? (__mmask16)0
                                          : (__mmask16)((1u << n) - 1);
                __m512 sc = _mm512_mask_blend_ps(live, _mm512_set1_ps(-INFINITY),
                                                 _mm512_mul_ps(acc[m], _mm512_set1_ps(g->scale)));
                _mm512_storeu_ps(s + (m0 + m) * ld + tile * 16, sc);
                mx[m] = _mm512_max_ps(mx[m], sc);
            }
        }
        for (int64_t m = 0; m < mb; m++) mxs[m0 + m] = _mm512_reduce_max_ps(mx[m]);
    }
    /* Softmax per query vector; the weights rounded to bfloat16, stored over the scores. */
    for (int64_t m = 0; m < M; m++) {
        float *sm = s + m * ld;
        bf16 *pm = (bf16 *)sm;
        __m512 sum = _mm512_setzero_ps(), mm = _mm512_set1_ps(mxs[m]);
        for (int64_t t = 0; t < tiles * 16; t += 16) {
            __m512 x = _mm512_loadu_ps(sm + t);
            __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_NEQ_UQ);
            __m512 e = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(x, mm)));
            sum = _mm512_add_ps(sum, e);
            _mm256_storeu_si256((__m256i *)(pm + t), narrow16_bf16(e));
        }
        float total = _mm512_reduce_add_ps(sum);
        inv[m] = total > 0.0f ? 1.0f / total : 0.0f;
    }
    /* out = weights x V, OV query vectors at a time, 64 dims in 4 vectors each. */
    for (int64_t m0 = 0; m0 < M; m0 += OV) {
        int64_t mb = M - m0 < OV ? M - m0 : OV;
        __m512 acc[OV][4];
        const uint32_t *pr[OV];
        for (int m = 0; m < OV; m++) {
            pr[m] = (const uint32_t *)(s + (m0 + (m < mb ? m : 0)) * ld);
            for (int d = 0; d < 4; d++) acc[m][d] = _mm512_setzero_ps();
        }
        /* the pairs of positions the last row attends to, all within its tiles (a row's
         * weights past its last position are 0) */
        int64_t stop = (i0 + (m0 + mb - 1) / G + 2) / 2;
        for (int64_t t2 = 0; t2 < stop; t2++) {
            __m512i vv[4];
            for (int d = 0; d < 4; d++) vv[d] = _mm512_loadu_si512(vp + t2 * 64 + 16 * d);
            for (int m = 0; m < OV; m++) {
                __m512bh w = (__m512bh)_mm512_set1_epi32((int)pr[m][t2]);
                for (int d = 0; d < 4; d++)
                    acc[m][d] = _mm512_dpbf16_ps(acc[m][d], w, (__m512bh)vv[d]);
            }
        }
        for (int64_t m = 0; m < mb; m++) {
            int64_t mv = m0 + m, row = c * T + i0 + mv / G, head = h * G + mv % G;
            bf16 *o = g->out + (row * heads + head) * 64;
            __m512 iv = _mm512_set1_ps(inv[mv]);
            for (int d = 0; d < 4; d++) {
                __m256i r = narrow16_bf16(_mm512_mul_ps(acc[m][d], iv));
                _mm256_storeu_si256((__m256i *)(o + 16 * d), r);
            }
        }
    }
#undef QROW
}

/* prefill_causal's bfloat16 path for head dim 64 and at most 32 query heads per KV head. */
TARGET_BF16 static int prefill_gemm_bf16(const bf16 *q, const bf16 *k, const bf16 *v, bf16 *out,
                                         int64_t size, int64_t tokens, int64_t kv_heads,
                                         int64_t group, float scale, int threads) {
    gemm_t g = {q, k, v, out, NULL, NULL, tokens, kv_heads, group, (tokens + 15) / 16,
                (tokens + 1) / 2, scale};
    int64_t units = size * kv_heads, ld = g.tiles * 16 + 16;
    int64_t blocks = (tokens + GB - 1) / GB, tasks = units * blocks;
    size_t per_thread = (size_t)(GB * group * ld);
    g.kp = malloc(sizeof(uint32_t) * (size_t)(units * g.tiles * 16 * 32));
    g.vp = malloc(sizeof(uint32_t) * (size_t)(units * g.pairs * 64));
    float *scratch = malloc(sizeof(float) * per_thread * (size_t)threads);
    if (!g.kp || !g.vp || !scratch) {
        free(g.kp), free(g.vp), free(scratch);
        return -3;
    }
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(dynamic, 1)
        for (int64_t u = 0; u < units; u++) pack_kv(&g, u / kv_heads, u % kv_heads);
#pragma omp for schedule(dynamic, 1)
        for (int64_t r = 0; r < tasks; r++) {
            /* the longest blocks (each chunk's last) first, so that short ones fill the end */
            int64_t b = blocks - 1 - r / units, u = r % units;
            gemm_task(&g, u / kv_heads, u % kv_heads, b * GB,
                      scratch + per_thread * (size_t)omp_get_thread_num(), ld);
        }
    }
    free(g.kp), free(g.vp), free(scratch);
    return 0;
}
#endif /* HAVE_AVX512_BF16 */
#endif
