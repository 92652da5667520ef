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
/* For code written once per vector width: the AVX-512 level alone, and the levels below it. */
#define TRILLM_X86_LEVELS 1
#define TRILLM_TARGET_V4 __attribute__((target("arch=x86-64-v4")))
#define TRILLM_MULTIVERSION_BELOW_V4 __attribute__((target_clones("arch=x86-64-v3", "default")))
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

/* What a KV cache row holds (trillm/kernels/cache.py): head_dim fp32 or fp16 values, or head_dim
 * int8 values and then their fp16 scale (KV_CACHE_I8: one scale per token and head; keys rotated
 * by kv_rotate first, and the queries that meet them too). */
enum kv_cache_kind { KV_CACHE_F32 = 0, KV_CACHE_F16 = 1, KV_CACHE_I8 = 2 };
#define KV_I8_SCALE_BYTES 2

/* Cache elements (bytes for KV_CACHE_I8) in the row of one token and head. */
static inline int64_t kv_row_width(int kind, int64_t head_dim)
{
    return kind == KV_CACHE_I8 ? head_dim + KV_I8_SCALE_BYTES : head_dim;
}

static inline int64_t kv_elem_bytes(int kind) { return kind == KV_CACHE_F32 ? 4 : kind == KV_CACHE_F16 ? 2 : 1; }

/* x[0 .. head_dim-1] times the normalized Walsh-Hadamard matrix, in place, as cache.rotate_rows:
 * the butterflies of stride 1, 2, 4, ... (x[j], x[j + h] -> their sum, their difference), then
 * one product with fp32(1 / sqrt(head_dim)); the same operations in the same order, so the same
 * bits. An orthogonal rotation, so q.k is unchanged, but a key's outlier channels are spread over
 * the row, whose one int8 scale then fits every value. A head_dim that is not a power of two is
 * left as it is. */
static inline void kv_rotate(float *x, int64_t head_dim)
{
    if (head_dim < 2 || (head_dim & (head_dim - 1)) != 0) return;
    for (int64_t h = 1; h < head_dim; h *= 2)
        for (int64_t i = 0; i < head_dim; i += 2 * h)
            for (int64_t j = i; j < i + h; j++) {
                const float a = x[j], b = x[j + h];
                x[j] = a + b;
                x[j + h] = a - b;
            }
    const float norm = (float)(1.0 / __builtin_sqrt((double)head_dim));
    for (int64_t d = 0; d < head_dim; d++) x[d] *= norm;
}

/* x[0 .. head_dim-1] as an int8 cache row, as cache.quantize_rows makes it: scale = fp16(absmax /
 * 127); each value x / scale (a division, as torch's), rounded to nearest even; 0 when scale is 0. */
static inline void kv_quantize_row(int8_t *dst, const float *x, int64_t head_dim)
{
    float amax = 0.0f;
    for (int64_t d = 0; d < head_dim; d++) {
        const float a = x[d] < 0 ? -x[d] : x[d];
        amax = a > amax ? a : amax;
    }
    const _Float16 half = (_Float16)(amax / 127.0f);
    const float scale = (float)half;
    for (int64_t d = 0; d < head_dim; d++) {
        float r = scale > 0.0f ? __builtin_nearbyintf(x[d] / scale) : 0.0f;
        r = r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r;
        dst[d] = (int8_t)r;
    }
    memcpy(dst + head_dim, &half, KV_I8_SCALE_BYTES);
}

/* An int8 cache's token row (num_kv_heads rows of head_dim values, each followed by its scale) as
 * fp32 values: each value times its row's scale, one product, as cache.dequantize_rows. GCC
 * turns the plain loop's int8 widening into scalar loads, so AVX2 gets its own body. */
typedef void kv_dequantize_fn(float *dst, const int8_t *src, int64_t num_kv_heads, int64_t head_dim);

static inline float kv_row_scale(const int8_t *row, int64_t head_dim)
{
    _Float16 half;
    memcpy(&half, row + head_dim, KV_I8_SCALE_BYTES);
    return (float)half;
}

static inline void kv_dequantize_generic(float *dst, const int8_t *src, int64_t num_kv_heads, int64_t head_dim)
{
    for (int64_t h = 0; h < num_kv_heads; h++, src += head_dim + KV_I8_SCALE_BYTES, dst += head_dim) {
        const float scale = kv_row_scale(src, head_dim);
        for (int64_t d = 0; d < head_dim; d++) dst[d] = (float)src[d] * scale;
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

__attribute__((target("avx2,f16c"))) static inline void kv_dequantize_avx2(float *dst, const int8_t *src,
                                                                           int64_t num_kv_heads, int64_t head_dim)
{
    for (int64_t h = 0; h < num_kv_heads; h++, src += head_dim + KV_I8_SCALE_BYTES, dst += head_dim) {
        const float scale = kv_row_scale(src, head_dim);
        const __m256 s = _mm256_set1_ps(scale);
        int64_t d = 0;
        for (; d + 16 <= head_dim; d += 16) {
            const __m128i b = _mm_loadu_si128((const __m128i *)(src + d));
            _mm256_storeu_ps(dst + d, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), s));
            _mm256_storeu_ps(dst + d + 8,
                             _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8))), s));
        }
        for (; d < head_dim; d++) dst[d] = (float)src[d] * scale;
    }
}

static inline kv_dequantize_fn *pick_kv_dequantize(void)
{
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c")) return kv_dequantize_avx2;
    return kv_dequantize_generic;
}
#else
static inline f16_widen_fn *pick_f16_widen(void) { return f16_widen_generic; }
static inline f16_narrow_fn *pick_f16_narrow(void) { return f16_narrow_generic; }
static inline kv_dequantize_fn *pick_kv_dequantize(void) { return kv_dequantize_generic; }
#endif

/* A job cut in `chunks` pieces: fn(ctx, c) for each c < chunks, on the caller and the pool's
 * helpers; returns when all are done (pool_cpu.h). */
typedef void pool_chunk_fn(void *ctx, int64_t chunk);
typedef void pool_runner(pool_chunk_fn *fn, void *ctx, int64_t chunks);

/* An op over rows t0 .. t1 - 1 of a job whose rows are independent of each other (a norm, an
 * activation, the rotary embedding, the KV write, the activations' quantization); `args` holds the
 * rest. */
typedef void rows_fn(const void *args, int64_t t0, int64_t t1);

struct rows_job {
    rows_fn *op;
    const void *args;
    int64_t rows, per_chunk;
};

static void rows_chunk(void *ctx, int64_t c)
{
    const struct rows_job *job = ctx;
    const int64_t t0 = c * job->per_chunk;
    job->op(job->args, t0, t0 + job->per_chunk < job->rows ? t0 + job->per_chunk : job->rows);
}

/* Elements a piece of a row op gets at least: a pass over fewer takes less time than a helper
 * takes to join. */
#define ROWS_CHUNK_ELEMENTS 16384

/* op over rows 0 .. rows - 1 (of `width` elements each), in up to `chunks` pieces on run's threads
 * where the rows hold enough elements (ROWS_CHUNK_ELEMENTS a piece), else on the caller alone: a
 * prompt's rows are otherwise one thread's pass while the pool's helpers wait for the next
 * projection. */
static inline void rows_run(pool_runner *run, int64_t chunks, rows_fn *op, const void *args, int64_t rows,
                            int64_t width)
{
    int64_t pieces = rows * width / ROWS_CHUNK_ELEMENTS;
    if (pieces > chunks) pieces = chunks;
    if (pieces > rows) pieces = rows;
    if (pieces < 2) {
        op(args, 0, rows);
        return;
    }
    struct rows_job job = {op, args, rows, (rows + pieces - 1) / pieces};
    run(rows_chunk, &job, (rows + job.per_chunk - 1) / job.per_chunk);
}

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
