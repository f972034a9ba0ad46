/* Decode attention over a paged KV cache, read in place (hetero-pd, backends/paged_decode.py).
 *
 * One query token per sequence; a task per sequence. Its query heads read each K row of its
 * context once (one slot: every KV head, contiguous), take a softmax, then read each V row
 * once (weighted sum). No gathered copy of K/V is made; tasks run in parallel under torch's
 * OpenMP runtime (the library links the libgomp torch has already loaded).
 *
 *   k, v:  [num_slots, kv_heads, head_dim] float32 (paged_decode) or bfloat16 (_bf16)
 *   q:     [n, kv_heads * group, head_dim] of K's dtype;  out: the same shape, float32
 *          (bfloat16 caches may ask for it rounded to bfloat16 instead: out16)
 *   slots: [n, ctx] int64 cache slot of each context position; mask: [n, ctx] uint8 (1 = attend)
 *
 * bfloat16 accumulates in float32 and rounds the softmax's weights to bfloat16 before they
 * multiply V, as torch's CPU SDPA does (transformers' reference in bfloat16). Two paths:
 * AVX-512 BF16 (`vdpbf16ps` for the scores), compiled in by a target attribute and chosen by
 * the caller from the CPU's flags; and a portable one (bf16 -> fp32 by a shift), for any CPU.
 *
 * Returns 0; -1 when a slot lies outside [0, num_slots) (nothing is read then), -2 for more
 * than 256 query heads, -3 when scratch memory could not be had, -4 for a path not compiled in.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#define LANES 8
#define MAX_HEADS 256
#define AHEAD 4 /* context positions prefetched ahead (the per-score paths; V into L1) */
/* The blocked path's distances (positions): K rows for the scores, whole V rows for the
 * weighted sums, both two blocks of 16 ahead (see prefetch_rows). */
#define AHEAD_K 32
#define AHEAD_V 32

/* Bit i set: path i is compiled into this library. */
int paged_decode_paths(void) { return bf16_paths_compiled(); }

static inline uint32_t as_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

/* Round to nearest even, as torch does (a NaN stays a NaN). */
static inline float round_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        u |= 0x00400000u;
    else
        u += 0x7fffu + ((u >> 16) & 1u);
    u &= 0xffff0000u;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Asks for the row of context position t before it is needed: a sequence's slots run
 * through blocks scattered over the cache, across pages the hardware's prefetchers stop at.
 * Measured on a 2-vCPU AMD EPYC: 20-25% faster than without, at 2 to 4 positions ahead. */
__attribute__((always_inline)) static inline void prefetch_row(const char *base,
                                                              const int64_t *sl,
                                                              const uint8_t *mk, int64_t t,
                                                              int64_t ctx, int64_t row_bytes) {
    if (t >= ctx || !mk[t]) return;
    const char *at = base + sl[t] * row_bytes;
    for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(at + b);
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

static inline void axpy(float *o, float w, const float *x, int64_t d) {
    for (int64_t c = 0; c < d; c++) o[c] += w * x[c];
}

static inline void widen(float *dst, const bf16 *src, int64_t count) {
    for (int64_t c = 0; c < count; c++) dst[c] = bf16_to_f32(src[c]);
}

/* What one sequence's task works on. */
typedef struct {
    const void *q, *k, *v; /* this sequence's query heads; the whole cache */
    float *out, *p;        /* its output heads; its scores p[head * ldp + t] */
    float *row;            /* scratch: one slot's row widened to float32 (bfloat16 caches);
                              zeros in the blocked path (the row of a masked position) */
    float *qf;             /* scratch: its query widened to float32 (bfloat16, portable) */
    const int64_t *sl, *kv_of;
    const uint8_t *mk;
    int64_t ctx, ldp, heads, d, width; /* ldp: p's row stride, ctx rounded up to 16 */
    float scale;
} seq_t;

/* p = softmax of the scores per head, in place; masked positions weigh 0. With `bf16` the
 * weights are rounded to bfloat16 (their sum is not, as in SDPA). Returns each head's 1/sum
 * in inv (0 where no position is attended: the output is zeros, not NaN). */
static void softmax(const seq_t *s, const float *mx, float *inv, int bf16) {
    for (int64_t j = 0; j < s->heads; j++) {
        float *pj = s->p + j * s->ldp, sum = 0.0f;
        for (int64_t t = 0; t < s->ctx; t++) {
            float e = s->mk[t] ? expf(pj[t] - mx[j]) : 0.0f;
            sum += e;
            pj[t] = bf16 ? round_to_bf16(e) : e;
        }
        inv[j] = sum > 0.0f ? 1.0f / sum : 0.0f;
    }
}

static void finish(const seq_t *s, const float *inv) {
    for (int64_t j = 0; j < s->heads; j++)
        for (int64_t c = 0; c < s->d; c++) s->out[j * s->d + c] *= inv[j];
}

/* One sequence, written once for every path: T is the cache's element type, Q its query,
 * ROW(p) the K or V row at p as DOT and AXPY read it (as is, or widened into scratch). K rows
 * are read once each for the scores, then V rows once each for the weighted sum. */
#define SEQ_BODY(T, Q, ROW, DOT, AXPY, ROUND)                                                 \
    const T *k = s->k, *v = s->v;                                                             \
    int64_t bytes = s->width * (int64_t)sizeof(T);                                            \
    float mx[MAX_HEADS], inv[MAX_HEADS];                                                      \
    for (int64_t j = 0; j < s->heads; j++) mx[j] = -INFINITY;                                 \
    for (int64_t t = 0; t < s->ctx; t++) {                                                    \
        if (!s->mk[t]) continue;                                                              \
        prefetch_row((const char *)k, s->sl, s->mk, t + AHEAD, s->ctx, bytes);                \
        const __typeof__(*(Q)) *row = ROW(k + s->sl[t] * s->width);                           \
        for (int64_t j = 0; j < s->heads; j++) {                                              \
            float sc = DOT((Q) + j * s->d, row + s->kv_of[j], s->d) * s->scale;               \
            s->p[j * s->ldp + t] = sc;                                                        \
            if (sc > mx[j]) mx[j] = sc;                                                       \
        }                                                                                     \
    }                                                                                         \
    softmax(s, mx, inv, ROUND);                                                               \
    memset(s->out, 0, sizeof(float) * (size_t)(s->heads * s->d));                             \
    for (int64_t t = 0; t < s->ctx; t++) {                                                    \
        if (!s->mk[t]) continue;                                                              \
        prefetch_row((const char *)v, s->sl, s->mk, t + AHEAD, s->ctx, bytes);                \
        const __typeof__(*(Q)) *row = ROW(v + s->sl[t] * s->width);                           \
        for (int64_t j = 0; j < s->heads; j++)                                                \
            AXPY(s->out + j * s->d, s->p[j * s->ldp + t], row + s->kv_of[j], s->d);           \
    }                                                                                         \
    finish(s, inv);

#define AS_IS(row) (row)
#define WIDENED(row) widened(s, row)

/* A bfloat16 row widened into the task's float32 scratch. */
static inline const float *widened(const seq_t *s, const bf16 *row) {
    widen(s->row, row, s->width);
    return s->row;
}

static void seq_f32(const seq_t *s) { SEQ_BODY(float, (const float *)s->q, AS_IS, dot, axpy, 0) }

/* bfloat16, portable: the query and each slot's row widened once, then as float32. */
static void seq_bf16_portable(const seq_t *s) {
    widen(s->qf, s->q, s->heads * s->d);
    SEQ_BODY(bf16, (const float *)s->qf, WIDENED, dot, axpy, 1)
}

#ifdef HAVE_AVX512_BF16
/* q . k over d bfloat16 values, 32 at a time by vdpbf16ps (pairs of products summed into
 * float32 lanes); a tail shorter than 32 is loaded under a mask (zeros add nothing). */
TARGET_BF16 static inline float dot_bf16(const bf16 *a, const bf16 *b, int64_t d) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t c = 0; c < d; c += 32) {
        __mmask32 m = d - c >= 32 ? (__mmask32)~0u : (((__mmask32)1 << (d - c)) - 1);
        __m512i x = _mm512_maskz_loadu_epi16(m, a + c), y = _mm512_maskz_loadu_epi16(m, b + c);
        acc = _mm512_dpbf16_ps(acc, (__m512bh)x, (__m512bh)y);
    }
    return _mm512_reduce_add_ps(acc);
}

/* o += w * x over d values, x widened 16 at a time (a bfloat16 is a float32's high half). */
TARGET_BF16 static inline void axpy_bf16(float *o, float w, const bf16 *x, int64_t d) {
    __m512 ww = _mm512_set1_ps(w);
    for (int64_t c = 0; c < d; c += 16) {
        __mmask16 m = d - c >= 16 ? (__mmask16)0xffff : (((__mmask16)1 << (d - c)) - 1);
        __m256i h = _mm256_maskz_loadu_epi16(m, x + c);
        __m512 xf = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
        __m512 acc = _mm512_maskz_loadu_ps(m, o + c);
        _mm512_mask_storeu_ps(o + c, m, _mm512_fmadd_ps(ww, xf, acc));
    }
}

/* Head dims other than the blocked path's (below): a horizontal sum per score. */
TARGET_BF16 static void seq_bf16_avx512_any(const seq_t *s) {
    SEQ_BODY(bf16, (const bf16 *)s->q, AS_IS, dot_bf16, axpy_bf16, 1)
}

/* The blocked path, for head dims of 64 and 128 (nearly every model's). What the per-score
 * path above spends its time on is not reading K/V (2 vCPUs of a Zen 5 EPYC read 9 of their
 * 30 GB/s through it) but, per (position, head), a horizontal sum of 16 lanes, a scalar
 * expf, and an output row loaded and stored again for every position. Here: scores of 16
 * positions at a time, their 16 sums in one transposing tree (sum16); the softmax over 16
 * weights at a time (exp16); and a query head's output kept in registers across the whole
 * context, the V row widened once for every query head of its KV head. The weighted sum
 * adds in the same order as the per-score path (bit-equal there); scores and exp round
 * within float32's last bits of it. */

/* Lane i: the sum of v[i]'s 16 lanes. */
TARGET_BF16 static inline __m512 sum16(const __m512 *v) {
    __m512 a[8], c[4], e[2];
    for (int i = 0; i < 8; i++) /* per 128-bit lane: [v2i(0+2), v2i+1(0+2), v2i(1+3), ..] */
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) /* per 128-bit lane: v4i..v4i+3, each over that lane */
        c[i] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int i = 0; i < 2; i++) /* 128-bit lanes summed in pairs */
        e[i] = _mm512_add_ps(
            _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
            _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(e[0], e[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(e[0], e[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/* exp(x) for x <= 0, 16 at a time: Cephes' expf (range reduction by ln 2 in two parts, a
 * degree-6 polynomial, 2^n by vscalefps), within 2 ulp of libm's. Lanes below -104 give 0. */
TARGET_BF16 static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(y, n);
}

/* Round to bfloat16 (nearest even; the weights are finite), kept as float32. */
TARGET_BF16 static inline __m512 round16_bf16(__m512 f) {
    __m512i u = _mm512_castps_si512(f);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
    return _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32((int)0xffff0000u)));
}

TARGET_BF16 static inline __m512 widen16(const bf16 *x) {
    __m256i h = _mm256_loadu_si256((const __m256i *)x);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* The rows (K or V, `base`) of positions t0.. t0+count-1, before they are needed.
 *
 * How the blocked path prefetches, measured on a 2-vCPU Zen 5 EPYC with a cache per layer
 * as a decode step reads it (30 layers' K/V of 64 sequences x 300 positions, 442 MB, from
 * DRAM; scripts/bench_decode_attention.py --layers 30): asking for a whole block's K and V
 * (192 lines) at once before scoring it read 14-16 GB/s, no faster than no prefetching at
 * all (the core keeps few misses in flight; the rest were dropped), where a plain gather
 * of the same rows reads 23-26. Spread over the block's query heads, K rows two blocks
 * ahead, and whole V rows two blocks ahead of the first KV head's weighted sum (the others
 * find them in cache), it reads 21-23 GB/s: 1.6x. */
__attribute__((always_inline)) static inline void prefetch_rows(const char *base,
                                                               const seq_t *s, int64_t t0,
                                                               int64_t count, int64_t bytes) {
    for (int64_t t = t0; t < t0 + count; t++) prefetch_row(base, s->sl, s->mk, t, s->ctx, bytes);
}

/* Scores of positions t0.. t0+15 (those past ctx or masked: -inf) for every query head,
 * into p; mx[j] the running maxima. F32: float32 K and q (else bfloat16); D the head dim. */
__attribute__((always_inline)) TARGET_BF16 static inline void scores16(
    const seq_t *s, int64_t t0, __m512 *mx, const int D, const int F32) {
    const int ES = F32 ? 4 : 2; /* bytes per element */
    const char *k = s->k, *rows[16];
    int64_t nb = s->ctx - t0 < 16 ? s->ctx - t0 : 16, bytes = s->width * ES;
    __mmask16 in = (__mmask16)((1u << nb) - 1);
    __m128i m8 = _mm_maskz_loadu_epi8(in, s->mk + t0);
    __mmask16 attend = _mm_test_epi8_mask(m8, m8) & in;
    for (int i = 0; i < 16; i++)
        rows[i] = attend >> i & 1 ? k + s->sl[t0 + i] * bytes : (const char *)s->row;
    int64_t per = (16 + s->heads - 1) / s->heads; /* K rows prefetched per query head */
    __m512 scale = _mm512_set1_ps(s->scale), ninf = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < s->heads; j++) {
        int64_t r0 = j * per < 16 ? j * per : 16, r1 = r0 + per < 16 ? r0 + per : 16;
        prefetch_rows(k, s, t0 + AHEAD_K + r0, r1 - r0, bytes);
        const char *qj = (const char *)s->q + j * s->d * ES;
        __m512 acc[16];
        if (F32) { /* 16 floats a vector: D / 16 fused multiply-adds */
            __m512 qv[8];
            for (int c = 0; c < D / 16; c++) qv[c] = _mm512_loadu_ps((const float *)qj + 16 * c);
            for (int i = 0; i < 16; i++) {
                const float *kr = (const float *)rows[i] + s->kv_of[j];
                __m512 a = _mm512_setzero_ps();
                for (int c = 0; c < D / 16; c++)
                    a = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(kr + 16 * c), a);
                acc[i] = a;
            }
        } else { /* 32 bfloat16 a vector, in pairs: D / 32 vdpbf16ps */
            __m512i qv[4];
            for (int c = 0; c < D / 32; c++)
                qv[c] = _mm512_loadu_si512((const bf16 *)qj + 32 * c);
            for (int i = 0; i < 16; i++) {
                const bf16 *kr = (const bf16 *)rows[i] + s->kv_of[j];
                __m512 a = _mm512_setzero_ps();
                for (int c = 0; c < D / 32; c++)
                    a = _mm512_dpbf16_ps(a, (__m512bh)qv[c],
                                         (__m512bh)_mm512_loadu_si512(kr + 32 * c));
                acc[i] = a;
            }
        }
        __m512 sc = _mm512_mask_blend_ps(attend, ninf, _mm512_mul_ps(sum16(acc), scale));
        _mm512_storeu_ps(s->p + j * s->ldp + t0, sc);
        mx[j] = _mm512_max_ps(mx[j], sc);
    }
}

/* p[j] = exp(score - max) (0 where masked; a NaN score stays NaN), rounded to bfloat16 with
 * `round`, inv[j] = 1 / the unrounded sum (0 where nothing is attended), every query head. */
TARGET_BF16 static void softmax16(const seq_t *s, const __m512 *mx, float *inv, int round) {
    for (int64_t j = 0; j < s->heads; j++) {
        float *pj = s->p + j * s->ldp, m = _mm512_reduce_max_ps(mx[j]);
        if (m == -INFINITY) {
            memset(pj, 0, sizeof(float) * (size_t)s->ldp);
            inv[j] = 0.0f;
            continue;
        }
        __m512 sum = _mm512_setzero_ps(), mm = _mm512_set1_ps(m), ninf = _mm512_set1_ps(-INFINITY);
        for (int64_t t = 0; t < s->ldp; t += 16) {
            __m512 x = _mm512_loadu_ps(pj + t);
            __mmask16 live = _mm512_cmp_ps_mask(x, ninf, _CMP_NEQ_UQ);
            __m512 e = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(x, mm)));
            sum = _mm512_add_ps(sum, e);
            _mm512_storeu_ps(pj + t, round ? round16_bf16(e) : e);
        }
        inv[j] = 1.0f / _mm512_reduce_add_ps(sum);
    }
}

/* out[j] = inv[j] * sum over attended t of p[j][t] * V[t] for QB query heads j0.. of one KV
 * head, D / 16 vectors of 16 each, held in registers across the context. */
__attribute__((always_inline)) TARGET_BF16 static inline void weigh(
    const seq_t *s, const float *inv, int64_t j0, const int QB, const int D, const int F32) {
    const int NO = D / 16, ES = F32 ? 4 : 2;
    __m512 acc[6][8];
    for (int h = 0; h < QB; h++)
        for (int c = 0; c < NO; c++) acc[h][c] = _mm512_setzero_ps();
    const char *v = (const char *)s->v + s->kv_of[j0] * ES;
    const float *p = s->p + j0 * s->ldp;
    for (int64_t t = 0; t < s->ctx; t++) {
        if (!s->mk[t]) continue;
        if (j0 == 0) /* the first KV head's pass: whole rows, for the other heads too */
            prefetch_row(s->v, s->sl, s->mk, t + AHEAD_V, s->ctx, s->width * ES);
        else if (t + AHEAD < s->ctx && s->mk[t + AHEAD]) /* into L1 from where it is */
            for (int c = 0; c < NO * 16 * ES; c += 64) /* a cache line at a time */
                __builtin_prefetch(v + s->sl[t + AHEAD] * s->width * ES + c);
        const char *vr = v + s->sl[t] * s->width * ES;
        __m512 vv[8];
        for (int c = 0; c < NO; c++)
            vv[c] = F32 ? _mm512_loadu_ps((const float *)vr + 16 * c)
                        : widen16((const bf16 *)vr + 16 * c);
        for (int h = 0; h < QB; h++) {
            __m512 w = _mm512_set1_ps(p[h * s->ldp + t]);
            for (int c = 0; c < NO; c++) acc[h][c] = _mm512_fmadd_ps(w, vv[c], acc[h][c]);
        }
    }
    for (int h = 0; h < QB; h++) {
        __m512 iv = _mm512_set1_ps(inv[j0 + h]);
        for (int c = 0; c < NO; c++)
            _mm512_storeu_ps(s->out + (j0 + h) * s->d + 16 * c, _mm512_mul_ps(acc[h][c], iv));
    }
}

/* The query heads sharing a KV head, at most 24 / (D / 16) at a time (their accumulators
 * and the V row fit the 32 vector registers). */
#define WEIGH_CASE(QB, D, F32) \
    case QB:                   \
        weigh(s, inv, j, QB, D, F32); \
        break;

__attribute__((always_inline)) TARGET_BF16 static inline void seq_blocked(const seq_t *s,
                                                                          const int D,
                                                                          const int F32) {
    const int most = 24 / (D / 16), ES = F32 ? 4 : 2;
    __m512 mx[MAX_HEADS];
    float inv[MAX_HEADS];
    for (int64_t j = 0; j < s->heads; j++) mx[j] = _mm512_set1_ps(-INFINITY);
    memset(s->row, 0, sizeof(float) * (size_t)s->width); /* masked positions' row */
    prefetch_rows(s->k, s, 0, AHEAD_K, s->width * ES); /* scores16 asks for the next */
    for (int64_t t = 0; t < s->ctx; t += 16) scores16(s, t, mx, D, F32);
    prefetch_rows(s->v, s, 0, AHEAD_V, s->width * ES); /* weigh asks for the next */
    softmax16(s, mx, inv, !F32);
    int64_t group = s->heads / (s->width / s->d);
    for (int64_t j = 0; j < s->heads;) {
        int64_t left = group - j % group, qb = left < most ? left : most;
        if (D == 64) {
            switch (qb) { WEIGH_CASE(1, 64, F32) WEIGH_CASE(2, 64, F32) WEIGH_CASE(3, 64, F32)
                          WEIGH_CASE(4, 64, F32) WEIGH_CASE(5, 64, F32) WEIGH_CASE(6, 64, F32) }
        } else {
            switch (qb) { WEIGH_CASE(1, 128, F32) WEIGH_CASE(2, 128, F32) WEIGH_CASE(3, 128, F32) }
        }
        j += qb;
    }
}

TARGET_BF16 static void seq_bf16_avx512(const seq_t *s) {
    if (s->d == 64)
        seq_blocked(s, 64, 0);
    else if (s->d == 128)
        seq_blocked(s, 128, 0);
    else
        seq_bf16_avx512_any(s);
}

/* float32 on the same blocked path (compiled with the same target, so taken only where the
 * CPU has AVX-512 BF16 too); other head dims as the portable path. */
TARGET_BF16 static void seq_f32_avx512(const seq_t *s) {
    if (s->d == 64)
        seq_blocked(s, 64, 1);
    else if (s->d == 128)
        seq_blocked(s, 128, 1);
    else
        seq_f32(s);
}
#endif

#include "prefill_gemm.h" /* prefill_gemm_bf16 (AVX-512 BF16 only) */

/* A task's view of its thread's scratch (`scratch_floats` of them): every query head's
 * scores (row stride ldp), a widened row, a widened query, and an output for rounding. */
static int64_t scratch_floats(int64_t heads, int64_t ldp, int64_t width, int64_t d) {
    return heads * ldp + width + 2 * heads * d;
}

static void use_scratch(seq_t *s, float *mine, int64_t ldp, int64_t width) {
    s->p = mine;
    s->row = mine + s->heads * ldp;
    s->qf = s->row + width;
    if (!s->out) s->out = s->qf + s->heads * s->d;
}

/* A task's float32 output rounded to bfloat16 into dst, as torch's cast rounds it. */
static void store_bf16(bf16 *dst, const float *src, int64_t count) {
    for (int64_t e = 0; e < count; e++) dst[e] = (bf16)(as_bits(round_to_bf16(src[e])) >> 16);
}

static void head_offsets(int64_t *kv_of, int64_t heads, int64_t group, int64_t d) {
    for (int64_t j = 0; j < heads; j++) kv_of[j] = (j / group) * d; /* its KV head's, in a row */
}

/* The loop over sequences shared by both dtypes; `elem` is the byte size of q, K and V. */
static int run(const void *q, const void *k, const void *v, const int64_t *slots,
               const uint8_t *mask, float *out, bf16 *out16, int64_t n, int64_t ctx,
               int64_t kv_heads, int64_t group, int64_t d, int64_t num_slots, float scale,
               int threads, size_t elem, void (*seq)(const seq_t *)) {
    int64_t heads = kv_heads * group, width = kv_heads * d; /* width: one slot's K (or V) */
    if (heads > MAX_HEADS) return -2;
    if (n <= 0 || heads <= 0 || d <= 0) return 0;
    if (ctx <= 0) { /* nothing to attend to: zeros, as for a row with every position masked */
        if (out16)
            memset(out16, 0, sizeof(bf16) * (size_t)(n * heads * d));
        else
            memset(out, 0, sizeof(float) * (size_t)(n * heads * d));
        return 0;
    }
    for (int64_t t = 0; t < n * ctx; t++)
        if (mask[t] && (slots[t] < 0 || slots[t] >= num_slots)) return -1;
    if (threads < 1) threads = 1;
    int64_t kv_of[MAX_HEADS];
    head_offsets(kv_of, heads, group, d);
    int64_t ldp = (ctx + 15) / 16 * 16, per_thread = scratch_floats(heads, ldp, width, d);
    float *scratch = malloc(sizeof(float) * (size_t)(per_thread * threads));
    if (!scratch) return -3;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t i = 0; i < n; i++) {
        seq_t s = {
            .q = (const char *)q + (size_t)(i * heads * d) * elem,
            .k = k,
            .v = v,
            .out = out16 ? NULL : out + i * heads * d, /* NULL: the scratch's (use_scratch) */
            .sl = slots + i * ctx,
            .kv_of = kv_of,
            .mk = mask + i * ctx,
            .ctx = ctx,
            .ldp = ldp,
            .heads = heads,
            .d = d,
            .width = width,
            .scale = scale,
        };
        use_scratch(&s, scratch + per_thread * omp_get_thread_num(), ldp, width);
        seq(&s);
        if (out16) store_bf16(out16 + i * heads * d, s.out, heads * d);
    }
    free(scratch);
    return 0;
}

/* The sequence function of `path` for float32 (f32) or bfloat16; NULL for a path that is
 * not compiled in or not known. */
static void (*pick(int path, int f32))(const seq_t *) {
    if (path == PATH_PORTABLE) return f32 ? seq_f32 : seq_bf16_portable;
#ifdef HAVE_AVX512_BF16
    if (path == PATH_AVX512_BF16) return f32 ? seq_f32_avx512 : seq_bf16_avx512;
#endif
    return NULL;
}

/* path: as for bfloat16 below (PATH_AVX512_BF16 takes the blocked AVX-512 loops). */
int paged_decode(const float *q, const float *k, const float *v, const int64_t *slots,
                 const uint8_t *mask, float *out, int64_t n, int64_t ctx, int64_t kv_heads,
                 int64_t group, int64_t d, int64_t num_slots, float scale, int threads,
                 int path) {
    void (*seq)(const seq_t *) = pick(path, 1);
    if (!seq) return -4;
    return run(q, k, v, slots, mask, out, NULL, n, ctx, kv_heads, group, d, num_slots, scale,
               threads, sizeof(float), seq);
}

/* out16 not NULL: the output rounded to bfloat16 there (as torch's cast rounds it; out is
 * not written), in the same pass: no float32 output for a separate cast to read back. */
int paged_decode_bf16(const bf16 *q, const bf16 *k, const bf16 *v, const int64_t *slots,
                      const uint8_t *mask, float *out, int64_t n, int64_t ctx, int64_t kv_heads,
                      int64_t group, int64_t d, int64_t num_slots, float scale, int threads,
                      int path, bf16 *out16) {
    void (*seq)(const seq_t *) = pick(path, 0);
    if (!seq) return -4;
    return run(q, k, v, slots, mask, out, out16, n, ctx, kv_heads, group, d, num_slots, scale,
               threads, sizeof(bf16), seq);
}

/* Causal attention within prefill chunks, each row as a decode query over the rows before
 * it: `size` chunks of `tokens` rows, back to back in q [size * tokens, kv_heads * group, d]
 * and k, v [size * tokens, kv_heads, d], all float32 (f32) or all bfloat16; row i of a chunk
 * attends to its rows 0..i. out [size * tokens, heads, d] in their dtype (bfloat16 rounded
 * as SDPA's output is). Only the rows a row attends to are computed (SDPA's blocks also
 * score the masked half), and K/V of a chunk stay in cache across its rows. bfloat16 with
 * head dim 64 on the AVX-512 BF16 path runs in GEMM form instead (prefill_gemm_bf16: 1.5x
 * the per-row loops on 8 x 256 tokens). Returns 0, or -2, -3, -4 as above. */
int prefill_causal(const void *q, const void *k, const void *v, void *out, int64_t size,
                   int64_t tokens, int64_t kv_heads, int64_t group, int64_t d, float scale,
                   int threads, int path, int f32) {
    void (*seq)(const seq_t *) = pick(path, f32);
    if (!seq) return -4;
    int64_t heads = kv_heads * group, width = kv_heads * d, rows = size * tokens;
    size_t elem = f32 ? sizeof(float) : sizeof(bf16);
    if (heads > MAX_HEADS) return -2;
    if (rows <= 0 || heads <= 0 || d <= 0) return 0;
    if (threads < 1) threads = 1;
#ifdef HAVE_AVX512_BF16
    if (!f32 && path == PATH_AVX512_BF16 && d == 64 && group <= 32)
        return prefill_gemm_bf16(q, k, v, out, size, tokens, kv_heads, group, scale, threads);
#endif
    int64_t kv_of[MAX_HEADS];
    head_offsets(kv_of, heads, group, d);
    int64_t ldp = (tokens + 15) / 16 * 16, per_thread = scratch_floats(heads, ldp, width, d);
    float *scratch = malloc(sizeof(float) * (size_t)(per_thread * threads));
    int64_t *sl = malloc(sizeof(int64_t) * (size_t)tokens); /* a chunk's rows are its slots */
    uint8_t *mk = malloc((size_t)tokens);
    if (!scratch || !sl || !mk) {
        free(scratch), free(sl), free(mk);
        return -3;
    }
    for (int64_t t = 0; t < tokens; t++) sl[t] = t, mk[t] = 1;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t r = 0; r < rows; r++) {
        /* The longest rows first (each chunk's last), so that the short ones fill the end. */
        int64_t c = (rows - 1 - r) % size, i = tokens - 1 - (r / size), row = c * tokens + i;
        seq_t s = {
            .q = (const char *)q + (size_t)(row * heads * d) * elem,
            .k = (const char *)k + (size_t)(c * tokens * width) * elem,
            .v = (const char *)v + (size_t)(c * tokens * width) * elem,
            .out = f32 ? (float *)out + row * heads * d : NULL,
            .sl = sl,
            .kv_of = kv_of,
            .mk = mk,
            .ctx = i + 1,
            .ldp = (i + 1 + 15) / 16 * 16,
            .heads = heads,
            .d = d,
            .width = width,
            .scale = scale,
        };
        use_scratch(&s, scratch + per_thread * omp_get_thread_num(), ldp, width);
        seq(&s);
        if (!f32) store_bf16((bf16 *)out + row * heads * d, s.out, heads * d);
    }
    free(scratch), free(sl), free(mk);
    return 0;
}
