/* Linear layers on CPU straight from GGUF's quantized blocks: y = x W^T with W in the Q4_1, Q5_1
 * or Q8_0 layout of trillm/kernels/quant.py.
 *
 * Why: a decode step streams every weight once, and on CPU that stream is the step's cost. The
 * GGUF weights are 4.5 to 8.5 bits each; dequantized to fp32 they are 32, so the same model reads
 * 4-7 times fewer bytes per step when the kernel dequantizes each block in registers, right
 * before it multiplies. The values are the ones gguf-py dequantizes to (Q4_1, Q5_1: d * q + m,
 * Q8_0: d * q; the multiply-add may be fused here, so a value can differ from gguf-py's in its
 * last bit), and the products are summed in fp32.
 *
 * Layout: a row of W is K / 32 blocks of 32 inputs. quant_cpu.pyx's QuantizedLinear regroups
 * GGUF's rows once into tiles of 16 output rows, block by block, so that one 16-byte load holds one input's quants
 * for all 16 rows (Q4_1: input j in the low nibbles and j + 16 in the high ones, as GGUF pairs
 * them; Q8_0: one input). quants: Q4_1 and Q5_1 [N / 16, K / 32, 16, 16] uint8, Q8_0 [N / 16,
 * K / 32, 32, 16] int8 (w = d q, or d q + m where mins are given); Q5_1's fifth bits, highs: [N / 16, K / 32, 16] 32-bit words, bit j of a
 * row's word its input j's (one load a block; each input shifts the next bit into place);
 * scales (d) and, for Q4_1 and Q5_1, mins (m): [N / 16, K / 32, 16] fp32.
 *
 * Why that layout: each dequantized register then holds one input's weights for 16 outputs, and
 * meets a row of x as one broadcast x value in one multiply-add, into a register of 16 outputs.
 * No horizontal sums, and up to ROWS rows of x share each dequantized register. The other way
 * round (16 inputs of one output per register), every output of every row ended in a horizontal
 * sum, and the kernel ran at half the rate. With 8 rows or fewer, each row keeps two accumulators
 * (inputs j and j + 16), so that enough multiply-add chains are in flight.
 *
 * Loops: x is cut into tiles of M_TILE rows, which stay in cache while every tile of W passes;
 * a tile of W stays in cache while every ROWS rows of the x tile pass (shared_cpu.h's tile loop,
 * whose chunks of tiles are shared among the pool's threads). GCC's vector extensions
 * widen bytes to ints one element at a time, hence intrinsics: AVX-512, AVX2 with FMA, and a
 * plain C loop for the rest.
 */
#include <stdint.h>
#include <stdlib.h>

#include "shared_cpu.h"

#define QUANT_Q4_1 0
#define QUANT_Q8_0 1
#define QUANT_Q5_1 2
#define QUANT_Q8_0_MIN 3 /* Q8_0 with mins (promoted Q4_1 or Q5_1 shards, quant.py's cat): chosen here, not by callers */
#define QUANT_NIBBLES(format) ((format) == QUANT_Q4_1 || (format) == QUANT_Q5_1)
#define BLOCK 32
#define TILE_N 16
#define ROWS 16
#define M_TILE 64
#define PREFETCH_TILES 2 /* how far ahead the next weights are requested (1 to 4 measured alike) */

/* The weight operand, in the tiled layout above. */
struct quantized_weight {
    int format;
    int64_t tiles; /* of TILE_N output rows */
    int64_t blocks_per_row;
    const void *quants;
    const float *scales;
    const float *mins;    /* Q4_1, Q5_1 and, where the weight has them, Q8_0 */
    const uint32_t *highs; /* Q5_1 only */
};

/* out[r * N + n] = x[r] . W[n] for r < rows and the 16 outputs n of tile t, where xt holds the
 * rows transposed: xt[k * ROWS + r] = x[r][k]. */
typedef void rows_kernel(int rows, float *out, const float *xt, int64_t N, const struct quantized_weight *w,
                         int64_t t);

static void rows_generic(int rows, float *out, const float *xt, int64_t N, const struct quantized_weight *w,
                         int64_t t)
{
    float acc[ROWS][TILE_N] = {{0}};
    for (int64_t b = 0; b < w->blocks_per_row; b++) {
        const int64_t block = t * w->blocks_per_row + b;
        const float *d = w->scales + block * TILE_N;
        for (int j = 0; j < BLOCK; j++) {
            float wj[TILE_N];
            if (QUANT_NIBBLES(w->format)) {
                const uint8_t *q = (const uint8_t *)w->quants + (block * (BLOCK / 2) + j % 16) * TILE_N;
                const float *m = w->mins + block * TILE_N;
                for (int i = 0; i < TILE_N; i++) {
                    uint32_t u = j < 16 ? q[i] & 15 : q[i] >> 4;
                    if (w->format == QUANT_Q5_1) u |= ((w->highs[block * TILE_N + i] >> j) & 1) << 4;
                    wj[i] = d[i] * (float)u + m[i];
                }
            } else {
                const int8_t *q = (const int8_t *)w->quants + (block * BLOCK + j) * TILE_N;
                for (int i = 0; i < TILE_N; i++)
                    wj[i] = w->mins ? fmaf(d[i], (float)q[i], w->mins[block * TILE_N + i]) : d[i] * (float)q[i];
            }
            for (int r = 0; r < rows; r++)
                for (int i = 0; i < TILE_N; i++) acc[r][i] += wj[i] * xt[(b * BLOCK + j) * ROWS + r];
        }
    }
    for (int r = 0; r < rows; r++)
        for (int i = 0; i < TILE_N; i++) out[r * N + t * TILE_N + i] = acc[r][i];
}

#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>

/* Block `block` (counted across tiles) requested from memory: the bodies ask for the block of a
 * tile ahead while this one computes, since a decode step reads every weight once and with the
 * hardware prefetcher alone the stream and the multiply-adds took turns. */
static inline __attribute__((always_inline)) void prefetch_block(const struct quantized_weight *w, int format,
                                                                 int64_t block)
{
    const int64_t quant_bytes = (QUANT_NIBBLES(format) ? BLOCK / 2 : BLOCK) * TILE_N;
    for (int64_t off = 0; off < quant_bytes; off += 64)
        __builtin_prefetch((const uint8_t *)w->quants + block * quant_bytes + off);
    __builtin_prefetch(w->scales + block * TILE_N);
    if (format != QUANT_Q8_0) __builtin_prefetch(w->mins + block * TILE_N);
    if (format == QUANT_Q5_1) __builtin_prefetch(w->highs + block * TILE_N);
}

/* `rows` and `format` are constants at every call site, so each pair compiles to its own loop
 * with the accumulators in registers. */
__attribute__((target("avx512f"), always_inline)) static inline void rows_avx512_body(
    int rows, int format, float *out, const float *xt, int64_t N, const struct quantized_weight *w, int64_t t)
{
    const int64_t blocks_per_row = w->blocks_per_row;
    const int hi_acc = rows <= 8; /* few rows: a second accumulator each, for more chains in flight */
    __m512 acc[ROWS][2];
    _Pragma("GCC unroll 16") for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const int prefetch = t + PREFETCH_TILES < w->tiles;
    for (int64_t b = 0; b < blocks_per_row; b++) {
        const int64_t block = t * blocks_per_row + b;
        const __m512 d = _mm512_loadu_ps(w->scales + block * TILE_N);
        const float *xb = xt + b * BLOCK * ROWS;
        if (prefetch) prefetch_block(w, format, block + PREFETCH_TILES * blocks_per_row);
        if (QUANT_NIBBLES(format)) {
            const __m512 m = _mm512_loadu_ps(w->mins + block * TILE_N);
            const uint8_t *q = (const uint8_t *)w->quants + block * (BLOCK / 2) * TILE_N;
            const __m512i sixteen = _mm512_set1_epi32(16);
            /* Q5_1: input j's fifth bit at bit 0 and input j + 16's at bit 16 after j shifts */
            __m512i h = format == QUANT_Q5_1 ? _mm512_loadu_si512(w->highs + block * TILE_N) : _mm512_setzero_si512();
            for (int j = 0; j < BLOCK / 2; j++) {
                const __m512i qj = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + j * TILE_N)));
                __m512i ql = _mm512_and_si512(qj, _mm512_set1_epi32(15)), qh = _mm512_srli_epi32(qj, 4);
                if (format == QUANT_Q5_1) {
                    ql = _mm512_or_si512(ql, _mm512_and_si512(_mm512_slli_epi32(h, 4), sixteen));
                    qh = _mm512_or_si512(qh, _mm512_and_si512(_mm512_srli_epi32(h, 12), sixteen));
                    h = _mm512_srli_epi32(h, 1);
                }
                const __m512 lo = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(ql), m);
                const __m512 hi = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(qh), m);
                _Pragma("GCC unroll 16") for (int r = 0; r < rows; r++) {
                    acc[r][0] = _mm512_fmadd_ps(lo, _mm512_set1_ps(xb[j * ROWS + r]), acc[r][0]);
                    acc[r][hi_acc] = _mm512_fmadd_ps(hi, _mm512_set1_ps(xb[(j + 16) * ROWS + r]), acc[r][hi_acc]);
                }
            }
        } else {
            const int8_t *q = (const int8_t *)w->quants + block * BLOCK * TILE_N;
            const __m512 m = format == QUANT_Q8_0_MIN ? _mm512_loadu_ps(w->mins + block * TILE_N) : _mm512_setzero_ps();
            for (int j = 0; j < BLOCK / 2; j++) {
                const __m512 ql = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + j * TILE_N))));
                const __m512 qh = _mm512_cvtepi32_ps(
                    _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + (j + 16) * TILE_N))));
                const __m512 lo = format == QUANT_Q8_0_MIN ? _mm512_fmadd_ps(d, ql, m) : _mm512_mul_ps(d, ql);
                const __m512 hi = format == QUANT_Q8_0_MIN ? _mm512_fmadd_ps(d, qh, m) : _mm512_mul_ps(d, qh);
                _Pragma("GCC unroll 16") for (int r = 0; r < rows; r++) {
                    acc[r][0] = _mm512_fmadd_ps(lo, _mm512_set1_ps(xb[j * ROWS + r]), acc[r][0]);
                    acc[r][hi_acc] = _mm512_fmadd_ps(hi, _mm512_set1_ps(xb[(j + 16) * ROWS + r]), acc[r][hi_acc]);
                }
            }
        }
    }
    _Pragma("GCC unroll 16") for (int r = 0; r < rows; r++) _mm512_storeu_ps(out + r * N + t * TILE_N, _mm512_add_ps(acc[r][0], acc[r][1]));
}

__attribute__((target("avx512f"))) static void rows_avx512(
    int rows, float *out, const float *xt, int64_t N, const struct quantized_weight *w, int64_t t)
{
#define ROWS_CASE(R)                                                                                       \
    case R:                                                                                                \
        switch (w->format) {                                                                               \
        case QUANT_Q4_1: rows_avx512_body(R, QUANT_Q4_1, out, xt, N, w, t); break;                         \
        case QUANT_Q5_1: rows_avx512_body(R, QUANT_Q5_1, out, xt, N, w, t); break;                         \
        case QUANT_Q8_0_MIN: rows_avx512_body(R, QUANT_Q8_0_MIN, out, xt, N, w, t); break;                 \
        default: rows_avx512_body(R, QUANT_Q8_0, out, xt, N, w, t);                                        \
        }                                                                                                  \
        break;
    switch (rows) {
        ROWS_CASE(1) ROWS_CASE(2) ROWS_CASE(3) ROWS_CASE(4) ROWS_CASE(5) ROWS_CASE(6) ROWS_CASE(7) ROWS_CASE(8)
        ROWS_CASE(9) ROWS_CASE(10) ROWS_CASE(11) ROWS_CASE(12) ROWS_CASE(13) ROWS_CASE(14) ROWS_CASE(15) ROWS_CASE(16)
    }
#undef ROWS_CASE
}

/* AVX2: 16 outputs are two registers, so a row's accumulators take four (inputs j and j + 16
 * in chains of their own, whatever the number of rows: a row's sums never depend on its
 * neighbours) and rows go two at a time, each pair dequantizing the block again. */
__attribute__((target("avx2,fma"), always_inline)) static inline void rows_avx2_body(
    int rows, int format, float *out, const float *xt, int64_t N, const struct quantized_weight *w, int64_t t)
{
    const int64_t blocks_per_row = w->blocks_per_row;
    __m256 acc[2][2][2]; /* [row][half of the 16 outputs][chain: inputs j, j + 16] */
    _Pragma("GCC unroll 2") for (int r = 0; r < rows; r++) acc[r][0][0] = acc[r][0][1] = acc[r][1][0] =
        acc[r][1][1] = _mm256_setzero_ps();
    const int prefetch = t + PREFETCH_TILES < w->tiles;
    const __m256i low = _mm256_set1_epi32(15), sixteen = _mm256_set1_epi32(16);
    for (int64_t b = 0; b < blocks_per_row; b++) {
        const int64_t block = t * blocks_per_row + b;
        const __m256 d0 = _mm256_loadu_ps(w->scales + block * TILE_N), d1 = _mm256_loadu_ps(w->scales + block * TILE_N + 8);
        const float *xb = xt + b * BLOCK * ROWS;
        if (prefetch) prefetch_block(w, format, block + PREFETCH_TILES * blocks_per_row);
        /* Q5_1: as in the AVX-512 body, the fifth bits shifted into place one input at a time */
        __m256i h0 = _mm256_setzero_si256(), h1 = _mm256_setzero_si256();
        if (format == QUANT_Q5_1) {
            h0 = _mm256_loadu_si256((const __m256i *)(w->highs + block * TILE_N));
            h1 = _mm256_loadu_si256((const __m256i *)(w->highs + block * TILE_N + 8));
        }
        for (int j = 0; j < BLOCK / 2; j++) {
            __m256 lo0, lo1, hi0, hi1;
            if (QUANT_NIBBLES(format)) {
                const uint8_t *q = (const uint8_t *)w->quants + (block * (BLOCK / 2) + j) * TILE_N;
                const __m256 m0 = _mm256_loadu_ps(w->mins + block * TILE_N), m1 = _mm256_loadu_ps(w->mins + block * TILE_N + 8);
                const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)q));
                const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8)));
                __m256i ql0 = _mm256_and_si256(b0, low), ql1 = _mm256_and_si256(b1, low);
                __m256i qh0 = _mm256_srli_epi32(b0, 4), qh1 = _mm256_srli_epi32(b1, 4);
                if (format == QUANT_Q5_1) {
                    ql0 = _mm256_or_si256(ql0, _mm256_and_si256(_mm256_slli_epi32(h0, 4), sixteen));
                    ql1 = _mm256_or_si256(ql1, _mm256_and_si256(_mm256_slli_epi32(h1, 4), sixteen));
                    qh0 = _mm256_or_si256(qh0, _mm256_and_si256(_mm256_srli_epi32(h0, 12), sixteen));
                    qh1 = _mm256_or_si256(qh1, _mm256_and_si256(_mm256_srli_epi32(h1, 12), sixteen));
                    h0 = _mm256_srli_epi32(h0, 1);
                    h1 = _mm256_srli_epi32(h1, 1);
                }
                lo0 = _mm256_fmadd_ps(d0, _mm256_cvtepi32_ps(ql0), m0);
                lo1 = _mm256_fmadd_ps(d1, _mm256_cvtepi32_ps(ql1), m1);
                hi0 = _mm256_fmadd_ps(d0, _mm256_cvtepi32_ps(qh0), m0);
                hi1 = _mm256_fmadd_ps(d1, _mm256_cvtepi32_ps(qh1), m1);
            } else {
                const int8_t *q = (const int8_t *)w->quants + block * BLOCK * TILE_N;
#define BYTES_AT(offset) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + (offset)))))
                const __m256 ql0 = BYTES_AT(j * TILE_N), ql1 = BYTES_AT(j * TILE_N + 8);
                const __m256 qh0 = BYTES_AT((j + 16) * TILE_N), qh1 = BYTES_AT((j + 16) * TILE_N + 8);
#undef BYTES_AT
                if (format == QUANT_Q8_0_MIN) {
                    const __m256 m0 = _mm256_loadu_ps(w->mins + block * TILE_N), m1 = _mm256_loadu_ps(w->mins + block * TILE_N + 8);
                    lo0 = _mm256_fmadd_ps(d0, ql0, m0), lo1 = _mm256_fmadd_ps(d1, ql1, m1);
                    hi0 = _mm256_fmadd_ps(d0, qh0, m0), hi1 = _mm256_fmadd_ps(d1, qh1, m1);
                } else {
                    lo0 = _mm256_mul_ps(d0, ql0), lo1 = _mm256_mul_ps(d1, ql1);
                    hi0 = _mm256_mul_ps(d0, qh0), hi1 = _mm256_mul_ps(d1, qh1);
                }
            }
            _Pragma("GCC unroll 2") for (int r = 0; r < rows; r++) {
                const __m256 xl = _mm256_set1_ps(xb[j * ROWS + r]), xh = _mm256_set1_ps(xb[(j + 16) * ROWS + r]);
                acc[r][0][0] = _mm256_fmadd_ps(lo0, xl, acc[r][0][0]);
                acc[r][1][0] = _mm256_fmadd_ps(lo1, xl, acc[r][1][0]);
                acc[r][0][1] = _mm256_fmadd_ps(hi0, xh, acc[r][0][1]);
                acc[r][1][1] = _mm256_fmadd_ps(hi1, xh, acc[r][1][1]);
            }
        }
    }
    _Pragma("GCC unroll 2") for (int r = 0; r < rows; r++) {
        _mm256_storeu_ps(out + r * N + t * TILE_N, _mm256_add_ps(acc[r][0][0], acc[r][0][1]));
        _mm256_storeu_ps(out + r * N + t * TILE_N + 8, _mm256_add_ps(acc[r][1][0], acc[r][1][1]));
    }
}

__attribute__((target("avx2,fma"))) static void rows_avx2(
    int rows, float *out, const float *xt, int64_t N, const struct quantized_weight *w, int64_t t)
{
#define PAIR_CASE(FORMAT)                                                                                  \
    case FORMAT:                                                                                           \
        if (pair)                                                                                          \
            rows_avx2_body(2, FORMAT, out + r * N, xt + r, N, w, t);                                       \
        else                                                                                               \
            rows_avx2_body(1, FORMAT, out + r * N, xt + r, N, w, t);                                       \
        break;
    for (int r = 0; r < rows; r += 2) {
        const int pair = rows - r >= 2;
        switch (w->format) { PAIR_CASE(QUANT_Q4_1) PAIR_CASE(QUANT_Q5_1) PAIR_CASE(QUANT_Q8_0_MIN) PAIR_CASE(QUANT_Q8_0) }
    }
#undef PAIR_CASE
}

static rows_kernel *pick_rows_kernel(void)
{
    if (__builtin_cpu_supports("avx512f")) return rows_avx512;
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? rows_avx2 : rows_generic;
}
#else
static rows_kernel *pick_rows_kernel(void) { return rows_generic; }
#endif

struct f32_job {
    rows_kernel *rows_of;
    float *out;
    const float *xt;
    int64_t K, N;
    struct quantized_weight w;
};

static void f32_rows(const void *ctx, int rows, int64_t r0, int64_t t)
{
    const struct f32_job *job = ctx;
    job->rows_of(rows, job->out + r0 * job->N, job->xt + r0 * job->K, job->N, &job->w, t);
}

/* out: [M, N]; x: [M, K], both fp32 and contiguous; K a multiple of 32, N of 16. The output tiles
 * are cut in about `chunks` pieces for `run` (shared_cpu.h). Returns 0, or -1 when out of memory. */
static int quantized_linear_f32(
    float *out, const float *x, int64_t M, int64_t K, int64_t N, int format, const void *quants,
    const float *scales, const float *mins, const uint32_t *highs, pool_runner *run, int64_t chunks)
{
    if (format == QUANT_Q8_0 && mins != NULL) format = QUANT_Q8_0_MIN;
    struct f32_job job = {pick_rows_kernel(), out, NULL, K, N,
                          {format, N / TILE_N, K / BLOCK, quants, scales, mins, highs}};
    /* the rows transposed ROWS at a time, so that the kernel finds every row's value of input k
     * at one address plus a constant */
    float *xt = malloc(sizeof(float) * (size_t)(((M + ROWS - 1) / ROWS) * ROWS * K));
    if (xt == NULL) return -1;
    for (int64_t r0 = 0; r0 < M; r0 += ROWS)
        for (int64_t r = r0; r < r0 + ROWS && r < M; r++)
            for (int64_t k = 0; k < K; k++) xt[r0 * K + k * ROWS + (r - r0)] = x[r * K + k];
    job.xt = xt;
    struct tile_loop loop = {f32_rows, &job, M, job.w.tiles, 0, M_TILE, ROWS};
    tile_loop_run(run, &loop, chunks);
    free(xt);
    return 0;
}
