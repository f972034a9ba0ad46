/* What hetero-pd's C kernels share about bfloat16 (backends/native.py builds each kernel;
 * a change here rebuilds them all): the AVX-512 BF16 path, compiled in by a target
 * attribute on any x86-64 whose compiler knows it and called only where the CPU has it,
 * and bf16 -> float32 by a shift. */
#ifndef HETERO_PD_BF16_H
#define HETERO_PD_BF16_H

#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__clang__) ? __clang_major__ >= 11 : __GNUC__ >= 10)
#define HAVE_AVX512_BF16 1
#include <immintrin.h>
#define TARGET_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#endif

typedef uint16_t bf16;

enum { PATH_PORTABLE = 0, PATH_AVX512_BF16 = 1 };

/* Bit i set: path i is compiled into this library. */
static inline int bf16_paths_compiled(void) {
#ifdef HAVE_AVX512_BF16
    return (1 << PATH_PORTABLE) | (1 << PATH_AVX512_BF16);
#else
    return 1 << PATH_PORTABLE;
#endif
}

static inline float bf16_to_f32(bf16 x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

#endif
