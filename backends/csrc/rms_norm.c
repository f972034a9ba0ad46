/* RMSNorm, and residual add + RMSNorm, in one pass per row (hetero-pd, backends/rms_norm.py).
 *
 * The formula is transformers' LlamaRMSNorm with its roundings, in this order:
 *   xf = float32(x); r = 1 / sqrt(sum(xf * xf) / dim + eps)
 *   y  = round_to_dtype(xf * r); out = round_to_dtype(float32(weight) * float32(y))
 * For bfloat16 the float32 values live only in registers: no float32 copy of the rows is
 * written, where torch (eager, or inductor's loops) writes one or reads the row three
 * times around casts. float32 rows take the same code with rounding a no-op.
 * The sum of squares runs in LANES float32 partial sums (then summed in order), so its
 * order differs from torch's: r may differ from torch's by a reduction-order ulp.
 *
 * add: s = round_to_dtype(float32(a) + float32(res)) is written to `sum_out` first (it may
 * be `a` itself, as torch's a.add_(res)), and s is what is normalised.
 *
 * Rows run in parallel under torch's OpenMP runtime only when there are enough of them to
 * pay for a parallel region (on a busy machine a region waits for every thread to be
 * scheduled; a decode step's few rows run on the calling thread).
 *
 * Two paths: a portable one (bf16 <-> fp32 by shifts, rounding to nearest even as torch;
 * the compiler vectorises it for the CPU it was built on), and AVX-512 BF16
 * (`vcvtneps2bf16` rounds, same results bit for bit), compiled in by a target attribute
 * and chosen by the caller from the CPU's flags. Returns 0, or -4 for a path not compiled in.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#define LANES 16
#define PARALLEL_ELEMENTS (1 << 16) /* rows x dim below which one thread runs them all */

/* Bit i set: path i is compiled into this library. */
int rms_norm_paths(void) { return bf16_paths_compiled(); }

/* Round to nearest even, as torch does (a NaN stays a quiet NaN). */
static inline bf16 narrow(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 0x0040u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
}

static inline float finish(float sumsq, int64_t dim, float eps) {
    return 1.0f / sqrtf(sumsq / (float)dim + eps);
}

/* ---- bfloat16, portable ---- */

static void row_bf16(const bf16 *a, const bf16 *res, bf16 *sum_out, const bf16 *w, bf16 *out,
                     int64_t dim, float eps) {
    float acc[LANES] = {0};
    const bf16 *x = a;
    if (res) { /* s = a + res, rounded, written before it is read back */
        int64_t i = 0;
        for (; i + LANES <= dim; i += LANES)
            for (int l = 0; l < LANES; l++) {
                bf16 s = narrow(bf16_to_f32(a[i + l]) + bf16_to_f32(res[i + l]));
                sum_out[i + l] = s;
                float f = bf16_to_f32(s);
                acc[l] += f * f;
            }
        for (; i < dim; i++) {
            bf16 s = narrow(bf16_to_f32(a[i]) + bf16_to_f32(res[i]));
            sum_out[i] = s;
            acc[0] += bf16_to_f32(s) * bf16_to_f32(s);
        }
        x = sum_out;
    } else {
        int64_t i = 0;
        for (; i + LANES <= dim; i += LANES)
            for (int l = 0; l < LANES; l++) {
                float f = bf16_to_f32(x[i + l]);
                acc[l] += f * f;
            }
        for (; i < dim; i++) acc[0] += bf16_to_f32(x[i]) * bf16_to_f32(x[i]);
    }
    float total = 0.0f;
    for (int l = 0; l < LANES; l++) total += acc[l];
    float r = finish(total, dim, eps);
    for (int64_t i = 0; i < dim; i++) out[i] = narrow(bf16_to_f32(w[i]) * bf16_to_f32(narrow(bf16_to_f32(x[i]) * r)));
}

#ifdef HAVE_AVX512_BF16
/* ---- bfloat16, AVX-512 BF16: the same sums in the same order, rounded by the CPU ---- */

TARGET_BF16 static inline __m512 load16(const bf16 *p) {
    __m256i v = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

TARGET_BF16 static inline __m256i round16(__m512 f) {
    return (__m256i)_mm512_cvtneps_pbh(f);
}

TARGET_BF16 static void row_bf16_avx512(const bf16 *a, const bf16 *res, bf16 *sum_out,
                                        const bf16 *w, bf16 *out, int64_t dim, float eps) {
    __m512 acc = _mm512_setzero_ps();
    float lanes[LANES];
    const bf16 *x = a;
    int64_t full = dim - dim % LANES, i;
    if (res) {
        for (i = 0; i < full; i += LANES) {
            __m256i s = round16(_mm512_add_ps(load16(a + i), load16(res + i)));
            _mm256_storeu_si256((__m256i *)(sum_out + i), s);
            __m512 f = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(s), 16));
            acc = _mm512_add_ps(acc, _mm512_mul_ps(f, f));
        }
        _mm512_storeu_ps(lanes, acc);
        for (; i < dim; i++) {
            bf16 s = narrow(bf16_to_f32(a[i]) + bf16_to_f32(res[i]));
            sum_out[i] = s;
            lanes[0] += bf16_to_f32(s) * bf16_to_f32(s);
        }
        x = sum_out;
    } else {
        for (i = 0; i < full; i += LANES) {
            __m512 f = load16(x + i);
            acc = _mm512_add_ps(acc, _mm512_mul_ps(f, f));
        }
        _mm512_storeu_ps(lanes, acc);
        for (; i < dim; i++) lanes[0] += bf16_to_f32(x[i]) * bf16_to_f32(x[i]);
    }
    float total = 0.0f;
    for (int l = 0; l < LANES; l++) total += lanes[l];
    float r = finish(total, dim, eps);
    __m512 vr = _mm512_set1_ps(r);
    for (i = 0; i < full; i += LANES) {
        __m256i y = round16(_mm512_mul_ps(load16(x + i), vr));
        __m512 yf = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(y), 16));
        _mm256_storeu_si256((__m256i *)(out + i), round16(_mm512_mul_ps(load16(w + i), yf)));
    }
    for (; i < dim; i++) out[i] = narrow(bf16_to_f32(w[i]) * bf16_to_f32(narrow(bf16_to_f32(x[i]) * r)));
}
#endif

/* ---- float32 ---- */

static void row_f32(const float *a, const float *res, float *sum_out, const float *w,
                    float *out, int64_t dim, float eps) {
    float acc[LANES] = {0};
    const float *x = a;
    int64_t i = 0;
    if (res) {
        for (i = 0; i < dim; i++) sum_out[i] = a[i] + res[i];
        x = sum_out;
    }
    for (i = 0; i + LANES <= dim; i += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += x[i + l] * x[i + l];
    for (; i < dim; i++) acc[0] += x[i] * x[i];
    float total = 0.0f;
    for (int l = 0; l < LANES; l++) total += acc[l];
    float r = finish(total, dim, eps);
    for (i = 0; i < dim; i++) out[i] = w[i] * (x[i] * r);
}

/* x, res, sum_out, out: [rows, dim] with row strides (elements); res NULL: no add.
 * bf16: nonzero for bfloat16 rows and weight, else float32. */
int rms_norm(const void *x, const void *res, void *sum_out, const void *w, void *out,
             int64_t rows, int64_t dim, int64_t x_stride, int64_t res_stride,
             int64_t sum_stride, int64_t out_stride, float eps, int threads, int bf16_rows,
             int path) {
#ifndef HAVE_AVX512_BF16
    if (path == PATH_AVX512_BF16) return -4;
#endif
    int nt = rows * dim >= PARALLEL_ELEMENTS ? (threads > 0 ? threads : 1) : 1;
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int64_t r = 0; r < rows; r++) {
        if (bf16_rows) {
            const bf16 *a = (const bf16 *)x + r * x_stride;
            const bf16 *rs = res ? (const bf16 *)res + r * res_stride : NULL;
            bf16 *s = res ? (bf16 *)sum_out + r * sum_stride : NULL;
            bf16 *o = (bf16 *)out + r * out_stride;
#ifdef HAVE_AVX512_BF16
            if (path == PATH_AVX512_BF16) {
                row_bf16_avx512(a, rs, s, (const bf16 *)w, o, dim, eps);
                continue;
            }
#endif
            row_bf16(a, rs, s, (const bf16 *)w, o, dim, eps);
        } else {
            const float *a = (const float *)x + r * x_stride;
            const float *rs = res ? (const float *)res + r * res_stride : NULL;
            float *s = res ? (float *)sum_out + r * sum_stride : NULL;
            row_f32(a, rs, s, (const float *)w, (float *)out + r * out_stride, dim, eps);
        }
    }
    return 0;
}
