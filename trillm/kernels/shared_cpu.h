/* What the compiled CPU kernels share: their multiversioning, the thread pool's interface
 * (pool_cpu.pyx runs it; a kernel is handed its `pool_runner`), the tile loop of the quantized
 * linears, and an e^x in plain arithmetic the compiler vectorizes (a libm expf is a call per
 * element: in decode attention's softmax it was a fifth of the kernel's time).
 */
#ifndef TRILLM_SHARED_CPU_H
#define TRILLM_SHARED_CPU_H

#include <stdint.h>
#include <string.h>

#if defined(__GNUC__) && defined(__x86_64__) && !defined(__clang__)
/* One build runs on any x86-64; the loader picks the widest level this CPU has (x86-64-v3 and
 * v4 bring F16C, which the fp16 KV cache needs: without it each fp16 load is a library call). */
#define TRILLM_MULTIVERSION __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define TRILLM_MULTIVERSION
#endif

/* fp16 <-> fp32 for the KV cache, n values, rounding to nearest even (as torch's .to()): F16C's
 * vcvtph2ps / vcvtps2ph where the CPU has them. GCC 12 vectorizes no _Float16 conversion loop:
 * each value became a library call or a scalar instruction. fp16 values travel as uint16_t. */
typedef void f16_widen_fn(float *dst, const uint16_t *src, int64_t n);
typedef void f16_narrow_fn(uint16_t *dst, const float *src, int64_t n);

static inline void f16_widen_generic(float *dst, const uint16_t *src, int64_t n)
{
    for (int64_t i = 0; i < n; i++) {
        _Float16 h;
        memcpy(&h, src + i, sizeof(h));
        dst[i] = (float)h;
    }
}

static inline void f16_narrow_generic(uint16_t *dst, const float *src, int64_t n)
{
    for (int64_t i = 0; i < n; i++) {
        const _Float16 h = (_Float16)src[i];
        memcpy(dst + i, &h, sizeof(h));
    }
}

#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>

__attribute__((target("avx512f"))) static inline void f16_widen_avx512(float *dst, const uint16_t *src, int64_t n)
{
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + i))));
    f16_widen_generic(dst + i, src + i, n - i);
}

__attribute__((target("avx,f16c"))) static inline void f16_widen_f16c(float *dst, const uint16_t *src, int64_t n)
{
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
    f16_widen_generic(dst + i, src + i, n - i);
}

__attribute__((target("avx,f16c"))) static inline void f16_narrow_f16c(uint16_t *dst, const float *src, int64_t n)
{
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
    f16_narrow_generic(dst + i, src + i, n - i);
}

static inline f16_widen_fn *pick_f16_widen(void)
{
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return f16_widen_avx512;
    if (__builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c")) return f16_widen_f16c;
    return f16_widen_generic;
}

static inline f16_narrow_fn *pick_f16_narrow(void)
{
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c")) return f16_narrow_f16c;
    return f16_narrow_generic;
}
#else
static inline f16_widen_fn *pick_f16_widen(void) { return f16_widen_generic; }
static inline f16_narrow_fn *pick_f16_narrow(void) { return f16_narrow_generic; }
#endif

/* A job cut in `chunks` pieces: fn(ctx, c) for each c < chunks, on the caller and the pool's
 * helpers; returns when all are done (pool_cpu.h). */
typedef void pool_chunk_fn(void *ctx, int64_t chunk);
typedef void pool_runner(pool_chunk_fn *fn, void *ctx, int64_t chunks);

/* The loop of both quantized linears (quant_cpu.h, quant_int8_cpu.h): one chunk is a run of
 * output tiles of W against every row of x, whose rows are taken m_tile at a time (they stay in
 * cache while those tiles pass) and `rows` at a time over each tile. */
typedef void tile_rows_fn(const void *job, int rows, int64_t r0, int64_t t);

struct tile_loop {
    tile_rows_fn *call;
    const void *job;
    int64_t M, tiles, tiles_per_chunk, m_tile, rows;
};

static void tile_loop_chunk(void *ctx, int64_t c)
{
    const struct tile_loop *loop = ctx;
    const int64_t t0 = c * loop->tiles_per_chunk;
    const int64_t t1 = t0 + loop->tiles_per_chunk < loop->tiles ? t0 + loop->tiles_per_chunk : loop->tiles;
    for (int64_t m0 = 0; m0 < loop->M; m0 += loop->m_tile) {
        const int64_t m1 = m0 + loop->m_tile < loop->M ? m0 + loop->m_tile : loop->M;
        for (int64_t t = t0; t < t1; t++)
            for (int64_t r0 = m0; r0 < m1; r0 += loop->rows)
                loop->call(loop->job, m1 - r0 < loop->rows ? (int)(m1 - r0) : (int)loop->rows, r0, t);
    }
}

/* Runs the loop over all tiles in about `chunks` pieces. */
static inline void tile_loop_run(pool_runner *run, struct tile_loop *loop, int64_t chunks)
{
    loop->tiles_per_chunk = (loop->tiles + chunks - 1) / chunks;
    run(tile_loop_chunk, loop, (loop->tiles + loop->tiles_per_chunk - 1) / loop->tiles_per_chunk);
}

/* e^x within 2 ulp of expf on [-87, 88]; x is clamped there (below -87 the result would be
 * subnormal, which next to a softmax's largest term, e^0, or to SiLU's 1 is nothing).
 * x = n ln2 + r with |r| <= ln2 / 2, e^r by Cephes' degree-6 polynomial, 2^n put into the
 * exponent bits. */
static inline float exp_clamped(float x)
{
    x = x < -87.0f ? -87.0f : x > 88.0f ? 88.0f : x;
    /* round to nearest: adding and taking away 1.5 * 2^23 drops the fraction */
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const float er = p * r * r + r + 1.0f;
    const union { int32_t bits; float value; } scale = {.bits = ((int32_t)n + 127) << 23};
    return er * scale.value;
}

#endif
