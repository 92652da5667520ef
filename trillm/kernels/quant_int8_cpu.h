/* Linear layers on CPU as integer dot products: y = x W^T with W in the Q4_1, Q5_1 or Q8_0 layout
 * and x quantized, row by row, to 8-bit blocks of 32 inputs (as llama.cpp's Q8_1).
 *
 * Why: once a batch has a few rows, the fp32 kernel (quant_cpu.h) is bound by its multiply-adds,
 * 16 per instruction. `vpdpbusd` (AVX512-VNNI) does 64 byte products a instruction, summed in
 * int32, so the work per block of 32 inputs falls to a few integer instructions and one fp32
 * multiply-add at the block's scales.
 *
 * The arithmetic. Every weight is written unsigned, w = d * u + m: Q4_1 and Q5_1 as GGUF stores
 * them (u = 0..15, 0..31), Q8_0 as u = q + 128 with m = -128 d (exact, a power of two) plus
 * whatever mins the weight has of its own (quant.py's promoted shards). An activation block is
 * x ~ e * v, v = round(x / e) in -127..127 with e = max|x| / 127, and carries s = e * sum(v). Then
 *     sum_k w_k x_k ~ d e sum_k u_k v_k + m s,
 * where sum u v is exact in int32 and the only rounding beyond x's is fp32 at the block scales.
 * One form serves every format, and `vpdpbusd` (unsigned u times signed v) runs it as it is.
 * Where a format's m is a fixed multiple of d, u = q + z (Q8_0's z = 128, Q4_0's 8, Q5_0's 16,
 * Q6_K's 32 for each half block), that part is taken off in the integers instead: the dot starts
 * from -z sum v (`offsets`, summed beside v; with K-quant scales, z times x's block or half-block
 * sums) and sums exactly q v, so that m is neither stored nor multiplied. A decode step streams
 * no float for it, and the block's epilogue, which shares
 * the multiplier's pipes with `vpdpbusd` once a batch has a few rows, loses a multiply-add; the
 * sum is also nearer the exact one, since no two large fp32 products cancel.
 *
 * Layout: weights in tiles of 16 output rows, block by block, four inputs of one row in 32 bits,
 * so that one 64-byte register holds four inputs for all 16 rows (one 32-bit lane per row) and
 * meets a row of x as one broadcast 32-bit word of four v's: no horizontal sums. Q4_1: [N / 16,
 * K / 32, 4, 16, 4] bytes, byte c of group g holding GGUF's byte 4g + c (inputs 4g + c in the low
 * nibble, 16 + 4g + c in the high one); Q5_1: Q4_1's nibbles, and h, [N / 16, K / 32, 16, 4]
 * bytes laid out as one group's register, whose bit g in the byte of row i and column c is the
 * fifth bit of the value in the same byte of the g-th register the nibbles unpack into (groups
 * 0-3 the low nibbles, 4-7 the high ones): one load and, per group, a shift and a mask put it
 * in place, a bit a weight; Q8_0: [N / 16, K / 32, 8, 16, 4] bytes u, group g inputs 4g..4g + 3.
 * d and m: [N / 16, K / 32, 16] fp32, or each (dh, mh) the same in fp16 where every value is one
 * (a file's Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 blocks keep fp16 scales and mins): a decode step
 * streams half the bytes of them, widened in registers. Q4_0's and Q5_0's mins, -8 d and -16 d,
 * are not stored at all: m_of_d (-8, -16) makes the same fp32 products from d, so a Q4_0 or Q5_0
 * block streams the file's bytes. A weight from Q4_K / Q5_K blocks keeps its scales as the
 * file does instead (`sc` set, d and m NULL): sc and mn, [N / 16, K / 32, 16] bytes, each block's
 * 6-bit factors, and dk and mk, [N / 16, K / 256, 16] fp32, each super-block's d and -dmin (d =
 * dk sc and m = mk mn): a decode step streams 3 bytes of scales a block and row where fp32 d and
 * m take 8.
 * Q6_K keeps its own form too (bits 6): u = q, 0..63, w = d sc (q - 32), sc a signed 8-bit factor
 * for each half of a block (16 inputs) and d the super-block's. Its low nibbles as Q4_1's; h two
 * planes, [N / 16, K / 32, 2, 16, 4] bytes, plane p holding the top two bits of the values of
 * groups 4p..4p + 3 (the low nibbles' registers for p = 0, the high ones' for 1), group 4p + j's
 * at bits 2j and 2j + 1, so that a shift and a mask put them in place as Q5_1's fifth bits; sc
 * [N / 16, K / 32, 2, 16] int8 (each block's lower half, then its upper one); dk as above; d, m,
 * mn and mk NULL: 6.6 bits a weight, as the file's 6.6, where 8-bit blocks of the same values
 * would take 9.
 * The K-quant arithmetic (any weight with `sc`: Q4_K, Q5_K, Q6_K, and a Q4_K promoted to bytes).
 * x is quantized by super-blocks, one e for 256 inputs (llama.cpp's Q8_K), so that a block's
 * integer factor can multiply its dot in the integers: over a super-block, sum = sum_b sc_b
 * dot_b (Q6_K: sum over half blocks of sc (sum q v - 32 sum v)) and mins = sum_b mn_b sum_b v,
 * both exact in int32, and the super-block adds dk e sum + mk e mins in fp32, once. Every path
 * makes the same integers and the same fp32 operations on them, so the same floats. Where the
 * AVX2 path widens 16-bit pair sums with vpmaddwd anyway, the factor rides in it; a block then
 * adds one int32 register where the per-block fp32 epilogue (a conversion, a multiply, two
 * multiply-adds, sharing vpmaddubsw's pipes) bound the kernel.
 * Activations: v [M, K] int8, e [M, K / 32] (by super-blocks [M, K / 256]) and s [M, K / 32];
 * by blocks, for each weight with a z, offsets -z sum v [M, K / 32] int32; by super-blocks, sum v
 * by blocks and half blocks, int16.
 *
 * Four paths, chosen at run time, each checked against quant.py's twin: AMX tiles for more than
 * 8 rows (quant_amx_cpu.h: the AVX-512 path's integers and floats, by tile multiplies);
 * AVX512-VNNI; AVX2 (each 16-row register split in two 8-row halves, with AVX-VNNI's `vpdpbusd`
 * where the CPU has it, else `vpmaddubsw` + `vpmaddwd`, which saturates beyond 16-bit pairs, hence
 * Q8_0 as signed q by the sign trick, llama.cpp's way); and plain C.
 */
#ifndef TRILLM_QUANT_INT8_CPU_H
#define TRILLM_QUANT_INT8_CPU_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "shared_cpu.h"

#define INT8_BLOCK 32
#define INT8_TILE_N 16
#define INT8_ROWS 8   /* rows of x that share each block of weights in registers */
#define INT8_AMX_ROWS 16 /* on AMX (quant_amx_cpu.h): the rows of x a tile holds */
#define INT8_M_TILE 64 /* rows of x kept in cache while every tile of W passes */
#define INT8_SUPER_SHIFT 3 /* log2 of the blocks in a K-quant super-block */

enum int8_isa { INT8_AUTO = 0, INT8_GENERIC = 1, INT8_AVX2 = 2, INT8_AVXVNNI = 3, INT8_AVX512VNNI = 4, INT8_AMX = 5 };

struct int8_weight {
    /* 4: Q4_1's packed nibbles; 5: those and a plane of fifth bits (Q5_1); 6: those and two planes of
     * top bit pairs (Q6_K); 8: a byte per input (Q8_0) */
    int bits;
    int64_t tiles, blocks;
    const uint8_t *u, *h; /* h: the fifth bits or bit pairs, 5 and 6 bits only */
    const float *d, *m;   /* d: NULL with sc or dh; m: NULL without mins of the weight's own, with mh or m_of_d */
    const uint16_t *dh, *mh; /* fp16 d or m, in place of the fp32 one (each on its own; NULL with sc) */
    float m_of_d;            /* m = m_of_d d where not 0 (Q4_0's -8, Q5_0's -16: z), m and mh NULL */
    const uint8_t *sc, *mn; /* K-quant scales (above), or NULL; 6 bits: sc signed, mn NULL */
    const float *dk, *mk;
};

/* Whether the weight has mins of its own, taken as m s in fp32: Q4_1, Q5_1, Q4_K, Q5_K, a promoted Q8_0. */
static inline int int8_has_mins(const struct int8_weight *w)
{
    return w->m != NULL || w->mh != NULL || w->mn != NULL;
}

#define INT8_Q8_Z 128 /* Q8_0's z */
#define INT8_Q6_Z 32  /* Q6_K's */

/* log2 of the z (above) of a weight without K-quant scales, -1 where it has none. */
static inline int int8_offset_shift(const struct int8_weight *w)
{
    if (w->bits == 8) return 7;
    if (w->m_of_d == -8.0f) return 3;
    if (w->m_of_d == -16.0f) return 4;
    return -1;
}

static inline float int8_half_at(const uint16_t *h, int64_t at)
{
    float value;
    f16_widen_generic(&value, h + at, 1);
    return value;
}

/* Row i's scale and min of block `block` (no K-quant scales). */
static inline float int8_d_at(const struct int8_weight *w, int64_t block, int i)
{
    return w->dh != NULL ? int8_half_at(w->dh, block * INT8_TILE_N + i) : w->d[block * INT8_TILE_N + i];
}
static inline float int8_m_at(const struct int8_weight *w, int64_t block, int i)
{
    if (w->mh != NULL) return int8_half_at(w->mh, block * INT8_TILE_N + i);
    return w->m != NULL ? w->m[block * INT8_TILE_N + i] : 0.0f;
}

struct int8_rows {
    int64_t K, blocks;
    const int8_t *v;
    const float *e, *s; /* e [M, blocks], or by super-blocks (for a weight with `sc`) [M, blocks / 8]; s [M, blocks] */
    const int16_t *sums, *halves; /* by super-blocks only: sum v by block [M, blocks] and half block [M, blocks, 2] */
    const int32_t *offsets; /* by blocks: -z sum v for the weight's z, [M, blocks]; NULL: no z */
    int once;         /* every tile of the weight passes once: at most a call's rows (int8_prefetch_next_tile) */
};

/* x's rows' offsets (above) for a weight's z = 2^shift, from their quantized v, by blocks. */
static void int8_offsets(const int8_t *v, int64_t M, int64_t K, int shift, int32_t *offsets)
{
    for (int64_t block = 0; block < M * K / INT8_BLOCK; block++) {
        int32_t sum = 0;
        for (int k = 0; k < INT8_BLOCK; k++) sum += v[block * INT8_BLOCK + k];
        offsets[block] = -sum * (1 << shift);
    }
}

/* max |x| over a block of 32. */
static float int8_block_amax_generic(const float *xb)
{
    float amax = 0.0f;
    for (int k = 0; k < INT8_BLOCK; k++) amax = fmaxf(amax, fabsf(xb[k]));
    return amax;
}

/* v = round-half-even(x * inv) for a block of 32; halves: the sums of v over its inputs 0-15 and 16-31. */
static void int8_block_quantize_generic(const float *xb, float inv, int8_t *v, int32_t halves[2])
{
    halves[0] = halves[1] = 0;
    for (int k = 0; k < INT8_BLOCK; k++) {
        const int32_t q = (int32_t)nearbyintf(xb[k] * inv);
        v[k] = (int8_t)q;
        halves[k / 16] += q;
    }
}

typedef float int8_block_amax_fn(const float *xb);
typedef void int8_block_quantize_fn(const float *xb, float inv, int8_t *v, int32_t halves[2]);

/* Quantizes x [M, K] fp32 (K a multiple of 32 << shift) into v, e and s, as the twin does, by
 * spans of 32 << shift inputs (shift 0: blocks; INT8_SUPER_SHIFT: super-blocks): e = max|x| / 127
 * over the span, v = round-half-even(x * (1 / e)) (0 where e is 0), and for each block of 32
 * s = e * sum(v). Where `sums` is not NULL, also each block's sum v into sums [M, K / 32] and its
 * halves' into halves [M, K / 16] (in int16: at most 32 * 127 in magnitude). */
static void int8_quantize_rows_by(int8_block_amax_fn *amax_of, int8_block_quantize_fn *quantize, const float *x,
                                  int64_t M, int64_t K, int shift, int8_t *v, float *e, float *s, int16_t *sums,
                                  int16_t *halves)
{
    const int64_t blocks = K / INT8_BLOCK, per = (int64_t)1 << shift;
    for (int64_t r = 0; r < M; r++)
        for (int64_t span = 0; span < blocks / per; span++) {
            const float *xs = x + r * K + span * per * INT8_BLOCK;
            float amax = amax_of(xs);
            for (int64_t j = 1; j < per; j++) amax = fmaxf(amax, amax_of(xs + j * INT8_BLOCK));
            const float eb = amax / 127.0f;
            const float inv = eb != 0.0f ? 1.0f / eb : 0.0f;
            e[r * (blocks / per) + span] = eb;
            for (int64_t j = 0; j < per; j++) {
                const int64_t b = span * per + j;
                int32_t half[2];
                quantize(xs + j * INT8_BLOCK, inv, v + r * K + b * INT8_BLOCK, half);
                s[r * blocks + b] = eb * (float)(half[0] + half[1]);
                if (sums == NULL) continue;
                sums[r * blocks + b] = (int16_t)(half[0] + half[1]);
                halves[(r * blocks + b) * 2] = (int16_t)half[0];
                halves[(r * blocks + b) * 2 + 1] = (int16_t)half[1];
            }
        }
}

/* out[r * N + 16 t + i] for `rows` rows from r0 and the 16 outputs of tile t. */
typedef void int8_rows_kernel(int rows, float *out, int64_t N, const struct int8_rows *x, int64_t r0,
                              const struct int8_weight *w, int64_t t);

/* 64-byte lines of quants a block and tile: 8 for bytes, 4 for nibbles */
static inline int int8_weight_groups(const struct int8_weight *w) { return w->bits == 8 ? 8 : 4; }

/* u of input k of output row i in block `block` (a tile's blocks follow each other). */
static inline int32_t int8_weight_at(const struct int8_weight *w, int64_t block, int i, int k)
{
    const int64_t base = block * int8_weight_groups(w) * INT8_TILE_N * 4;
    if (w->bits == 8) return w->u[base + ((k / 4) * INT8_TILE_N + i) * 4 + k % 4];
    const int j = k % 16;
    const uint8_t byte = w->u[base + ((j / 4) * INT8_TILE_N + i) * 4 + j % 4];
    const int32_t nibble = k < 16 ? byte & 15 : byte >> 4;
    if (w->bits == 4) return nibble;
    const int group = j / 4 + (k < 16 ? 0 : 4); /* the register the nibble unpacks into */
    if (w->bits == 6) {
        const uint8_t pairs = w->h[((block * 2 + group / 4) * INT8_TILE_N + i) * 4 + k % 4];
        return nibble | ((pairs >> (2 * (group % 4))) & 3) << 4;
    }
    return nibble | ((w->h[block * INT8_TILE_N * 4 + i * 4 + k % 4] >> group) & 1) << 4;
}

/* Row i's sum of factors times dots over super-block sb of tile t (the K-quant arithmetic above),
 * and into *by_mins its mins' sum mn sum v (4, 5 and 8 bits). */
static int32_t int8_kquant_sum_generic(const struct int8_weight *w, const struct int8_rows *x, int64_t row, int64_t t,
                                       int64_t sb, int i, int32_t *by_mins)
{
    int32_t sum = 0;
    *by_mins = 0;
    for (int j = 0; j < 1 << INT8_SUPER_SHIFT; j++) {
        const int64_t b = (sb << INT8_SUPER_SHIFT) + j, block = t * w->blocks + b, at = row * x->blocks + b;
        const int8_t *v = x->v + row * x->K + b * INT8_BLOCK;
        if (w->bits == 6) {
            for (int h = 0; h < 2; h++) {
                int32_t dot = -INT8_Q6_Z * x->halves[2 * at + h];
                for (int k = 16 * h; k < 16 * h + 16; k++) dot += int8_weight_at(w, block, i, k) * v[k];
                sum += ((const int8_t *)w->sc)[(block * 2 + h) * INT8_TILE_N + i] * dot;
            }
            continue;
        }
        int32_t dot = w->bits == 8 ? -INT8_Q8_Z * x->sums[at] : 0;
        for (int k = 0; k < INT8_BLOCK; k++) dot += int8_weight_at(w, block, i, k) * v[k];
        sum += w->sc[block * INT8_TILE_N + i] * dot;
        *by_mins += w->mn[block * INT8_TILE_N + i] * x->sums[at];
    }
    return sum;
}

static void int8_rows_generic(int rows, float *out, int64_t N, const struct int8_rows *x, int64_t r0,
                              const struct int8_weight *w, int64_t t)
{
    for (int r = 0; r < rows; r++) {
        float acc[INT8_TILE_N] = {0};
        const int8_t *v = x->v + (r0 + r) * x->K;
        if (w->sc != NULL) {
            const int64_t supers = w->blocks >> INT8_SUPER_SHIFT;
            for (int64_t sb = 0; sb < supers; sb++) {
                const float e = x->e[(r0 + r) * supers + sb];
                for (int i = 0; i < INT8_TILE_N; i++) {
                    int32_t by_mins;
                    const int32_t sum = int8_kquant_sum_generic(w, x, r0 + r, t, sb, i, &by_mins);
                    acc[i] = fmaf(w->dk[(t * supers + sb) * INT8_TILE_N + i] * e, (float)sum, acc[i]);
                    if (w->bits == 6) continue;
                    acc[i] = fmaf(w->mk[(t * supers + sb) * INT8_TILE_N + i] * e, (float)by_mins, acc[i]);
                }
            }
        }
        for (int64_t b = 0; b < w->blocks && w->sc == NULL; b++) {
            const int64_t block = t * w->blocks + b;
            const float e = x->e[(r0 + r) * x->blocks + b], s = x->s[(r0 + r) * x->blocks + b];
            for (int i = 0; i < INT8_TILE_N; i++) {
                int32_t dot = x->offsets != NULL ? x->offsets[(r0 + r) * x->blocks + b] : 0;
                for (int k = 0; k < INT8_BLOCK; k++) dot += int8_weight_at(w, block, i, k) * v[b * INT8_BLOCK + k];
                acc[i] = fmaf(int8_d_at(w, block, i) * e, (float)dot, acc[i]);
                if (int8_has_mins(w)) acc[i] = fmaf(int8_m_at(w, block, i), s, acc[i]);
            }
        }
        memcpy(out + (r0 + r) * N + t * INT8_TILE_N, acc, sizeof(acc));
    }
}

#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>

static inline int32_t int8_word(const int8_t *p)
{
    int32_t word;
    memcpy(&word, p, sizeof(word));
    return word;
}

/* As int8_block_amax_generic and int8_block_quantize_generic, a block in two registers
 * (vcvtps2dq rounds half to even). */
__attribute__((target("avx512f,avx512bw"))) static float int8_block_amax_avx512(const float *xb)
{
    return _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(xb)), _mm512_abs_ps(_mm512_loadu_ps(xb + 16))));
}
__attribute__((target("avx512f,avx512bw"))) static void int8_block_quantize_avx512(const float *xb, float inv, int8_t *v,
                                                                                  int32_t halves[2])
{
    const __m512 scale = _mm512_set1_ps(inv);
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb), scale));
    const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb + 16), scale));
    _mm_storeu_si128((__m128i *)v, _mm512_cvtepi32_epi8(q0));
    _mm_storeu_si128((__m128i *)(v + 16), _mm512_cvtepi32_epi8(q1));
    halves[0] = _mm512_reduce_add_epi32(q0);
    halves[1] = _mm512_reduce_add_epi32(q1);
}

/* The same, a block in four registers. */
__attribute__((target("avx2"))) static float int8_block_amax_avx2(const float *xb)
{
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    __m256 xs[4];
    for (int i = 0; i < 4; i++) xs[i] = _mm256_and_ps(_mm256_loadu_ps(xb + 8 * i), magnitude);
    const __m256 top = _mm256_max_ps(_mm256_max_ps(xs[0], xs[1]), _mm256_max_ps(xs[2], xs[3]));
    __m128 half = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
    half = _mm_max_ps(half, _mm_movehl_ps(half, half));
    half = _mm_max_ss(half, _mm_shuffle_ps(half, half, 1));
    return _mm_cvtss_f32(half);
}
__attribute__((target("avx2"))) static inline int32_t int8_sum_avx2(__m256i q)
{
    __m128i sum = _mm_add_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
    sum = _mm_add_epi32(sum, _mm_shuffle_epi32(sum, 0x4E));
    sum = _mm_add_epi32(sum, _mm_shuffle_epi32(sum, 0xB1));
    return _mm_cvtsi128_si32(sum);
}
__attribute__((target("avx2"))) static void int8_block_quantize_avx2(const float *xb, float inv, int8_t *v,
                                                                    int32_t halves[2])
{
    const __m256 scale = _mm256_set1_ps(inv);
    __m256i q[4];
    for (int i = 0; i < 4; i++) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + 8 * i), scale));
    /* int32 -> int8 in order: the packs work within 128-bit lanes, the permute restores it */
    const __m256i words = _mm256_packs_epi32(q[0], q[1]), words2 = _mm256_packs_epi32(q[2], q[3]);
    const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(words, words2),
                                                      _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)v, bytes);
    halves[0] = int8_sum_avx2(_mm256_add_epi32(q[0], q[1]));
    halves[1] = int8_sum_avx2(_mm256_add_epi32(q[2], q[3]));
}

/* A fifth-bit plane's bit g (the layout above) moved to bit 4 of every byte, alone: the
 * 16-bit shifts carry bits across bytes only into places the mask clears. */
#define INT8_FIFTH_BITS(SLLI, SRLI, AND, plane, g, sixteen)                                               \
    AND((g) <= 4 ? SLLI(plane, 4 - (g)) : SRLI(plane, (g) - 4), sixteen)
/* A bit-pair plane's pair j (bits 2j, 2j + 1) moved to bits 4 and 5 of every byte, alone (top =
 * 0x30 in every byte), the same way. */
#define INT8_BIT_PAIRS(SLLI, SRLI, AND, plane, j, top)                                                    \
    AND((j) <= 2 ? SLLI(plane, 4 - 2 * (j)) : SRLI(plane, 2 * (j) - 4), top)

/* Asks for the same block of the next tile while this one computes. A step streams every weight
 * once, and without this the kernel waits for memory at each tile (measured: the hardware's
 * prefetchers alone leave a batch's pass a quarter slower). A prefetch never faults, so the last
 * tile's, past the end, is harmless. Where each tile passes once (`once`: a decode step's few rows)
 * the kernel is bound by memory, and the lines are asked into L2 only (prefetcht2): asked into L1,
 * each holds one of the core's few L1 miss buffers until it arrives, which caps how many lines
 * are on their way from memory at a time. Where several row groups pass each tile (a prompt's
 * rows) the kernel is bound by its multiplies, and the next tile is asked into L1, where all the
 * groups read it. */
#define INT8_PREFETCH(once, p) ((once) ? __builtin_prefetch((p), 0, 1) : __builtin_prefetch((p), 0, 3))
static inline void int8_prefetch_next_tile(const struct int8_weight *w, int bits, int64_t block, int once)
{
    const int64_t ahead = block + w->blocks;
    const int lines = int8_weight_groups(w);
    for (int g = 0; g < lines; g++) INT8_PREFETCH(once, w->u + (ahead * lines + g) * 64);
    if (bits == 5) INT8_PREFETCH(once, w->h + ahead * 64);
    if (bits == 6) {
        INT8_PREFETCH(once, w->h + ahead * 128);
        INT8_PREFETCH(once, w->h + ahead * 128 + 64);
        INT8_PREFETCH(once, w->sc + ahead * 2 * INT8_TILE_N);
        INT8_PREFETCH(once, w->dk + (ahead / 8) * INT8_TILE_N);
        return;
    }
    if (w->sc != NULL) { /* the block's bytes; the super-block's d and -dmin share lines with neighbours' */
        INT8_PREFETCH(once, w->sc + ahead * INT8_TILE_N);
        INT8_PREFETCH(once, w->mn + ahead * INT8_TILE_N);
        INT8_PREFETCH(once, w->dk + (ahead / 8) * INT8_TILE_N);
        INT8_PREFETCH(once, w->mk + (ahead / 8) * INT8_TILE_N);
        return;
    }
    if (w->dh != NULL)
        INT8_PREFETCH(once, w->dh + ahead * INT8_TILE_N);
    else
        INT8_PREFETCH(once, w->d + ahead * INT8_TILE_N);
    if (w->mh != NULL) INT8_PREFETCH(once, w->mh + ahead * INT8_TILE_N);
    if (w->m != NULL) INT8_PREFETCH(once, w->m + ahead * INT8_TILE_N);
}

/* A block's values u[g] for the whole tile: nibbles, with their fifth bits or top bit pairs put
 * in place, or bytes. */
__attribute__((target("avx512f,avx512bw"), always_inline)) static inline void int8_unpack_avx512(
    int bits, const struct int8_weight *w, int64_t block, __m512i u[8])
{
    if (bits == 8) {
        const uint8_t *q = w->u + block * 8 * 64;
        _Pragma("GCC unroll 8") for (int g = 0; g < 8; g++) u[g] = _mm512_loadu_si512(q + g * 64);
        return;
    }
    const __m512i low = _mm512_set1_epi8(15);
    const uint8_t *q = w->u + block * 4 * 64;
    _Pragma("GCC unroll 4") for (int g = 0; g < 4; g++) {
        const __m512i packed = _mm512_loadu_si512(q + g * 64);
        u[g] = _mm512_and_si512(packed, low);
        u[g + 4] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
    }
    if (bits == 5) {
        const __m512i plane = _mm512_loadu_si512(w->h + block * 64), sixteen = _mm512_set1_epi8(16);
        _Pragma("GCC unroll 8") for (int g = 0; g < 8; g++) u[g] = _mm512_or_si512(
            u[g], INT8_FIFTH_BITS(_mm512_slli_epi16, _mm512_srli_epi16, _mm512_and_si512, plane, g, sixteen));
    }
    if (bits == 6) {
        const __m512i top = _mm512_set1_epi8(0x30);
        _Pragma("GCC unroll 2") for (int p = 0; p < 2; p++) {
            const __m512i plane = _mm512_loadu_si512(w->h + block * 128 + p * 64);
            _Pragma("GCC unroll 4") for (int j = 0; j < 4; j++) u[4 * p + j] = _mm512_or_si512(
                u[4 * p + j], INT8_BIT_PAIRS(_mm512_slli_epi16, _mm512_srli_epi16, _mm512_and_si512, plane, j, top));
        }
    }
}

/* A block's dots for the 16 rows, as two chains of four (each vpdpbusd waits on the one before it
 * in its chain): dot[0] of the lower 16 inputs from start0, dot[1] of the upper from start1. */
__attribute__((target("avx512f,avx512bw,avx512vnni"), always_inline)) static inline void int8_dots_avx512(
    const __m512i u[8], const int8_t *v, __m512i start0, __m512i start1, __m512i dot[2])
{
    dot[0] = start0;
    dot[1] = start1;
    _Pragma("GCC unroll 4") for (int g = 0; g < 4; g++) {
        dot[0] = _mm512_dpbusd_epi32(dot[0], u[g], _mm512_set1_epi32(int8_word(v + 4 * g)));
        dot[1] = _mm512_dpbusd_epi32(dot[1], u[g + 4], _mm512_set1_epi32(int8_word(v + 16 + 4 * g)));
    }
}

/* Block `block`'s scales d and mins m for the tile's 16 rows, each kept in fp16 or fp32 (m zero
 * where the weight has no mins of its own). */
__attribute__((target("avx512f,avx512bw"), always_inline)) static inline void int8_scales_avx512(
    const struct int8_weight *w, int64_t block, __m512 *d, __m512 *m)
{
    *d = w->dh != NULL ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w->dh + block * INT8_TILE_N)))
                       : _mm512_loadu_ps(w->d + block * INT8_TILE_N);
    *m = w->mh != NULL  ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w->mh + block * INT8_TILE_N)))
         : w->m != NULL ? _mm512_loadu_ps(w->m + block * INT8_TILE_N)
                        : _mm512_setzero_ps();
}

/* acc plus a block's terms for row `at` of x's blocks: d e dot, then m s where the weight has mins. */
__attribute__((target("avx512f,avx512bw"), always_inline)) static inline __m512 int8_block_acc_avx512(
    __m512 acc, __m512 d, __m512 m, int mins, const struct int8_rows *x, int64_t at, __m512i dot)
{
    acc = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(x->e[at])), _mm512_cvtepi32_ps(dot), acc);
    return mins ? _mm512_fmadd_ps(m, _mm512_set1_ps(x->s[at]), acc) : acc;
}

/* `rows`, `bits` and `z` (the weight's u carries a z: its dots start from x's offsets; always for
 * 8 bits) are constants at each call site, so each compiles to its own loop with the
 * accumulators in registers. A 4- or 5-bit weight without a z has mins of its own. */
__attribute__((target("avx512f,avx512bw,avx512vnni"), always_inline)) static inline void int8_rows_avx512_body(
    int rows, int bits, int z, float *out, int64_t N, const struct int8_rows *x, int64_t r0, const struct int8_weight *w,
    int64_t t)
{
    __m512 acc[INT8_ROWS];
    _Pragma("GCC unroll 8") for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    const int mins = bits == 8 ? int8_has_mins(w) : !z;
    for (int64_t b = 0; b < w->blocks; b++) {
        const int64_t block = t * w->blocks + b;
        int8_prefetch_next_tile(w, bits, block, x->once);
        __m512 d, m;
        int8_scales_avx512(w, block, &d, &m);
        __m512i u[8];
        int8_unpack_avx512(bits, w, block, u);
        _Pragma("GCC unroll 8") for (int r = 0; r < rows; r++) {
            const int64_t at = (r0 + r) * x->blocks + b;
            __m512i dot[2];
            int8_dots_avx512(u, x->v + (r0 + r) * x->K + b * INT8_BLOCK,
                             z ? _mm512_set1_epi32(x->offsets[at]) : _mm512_setzero_si512(), _mm512_setzero_si512(), dot);
            acc[r] = int8_block_acc_avx512(acc[r], d, m, mins, x, at, _mm512_add_epi32(dot[0], dot[1]));
        }
    }
    _Pragma("GCC unroll 8") for (int r = 0; r < rows; r++) _mm512_storeu_ps(out + (r0 + r) * N + t * INT8_TILE_N, acc[r]);
}

/* The mins' integer sum of super-block sb of tile t for a row, sum_b mn_b sum_b v (the K-quant
 * arithmetic above), as vpdpwssd over pairs of blocks: the mins of blocks 2k and 2k + 1 widened
 * to 16 bits and interleaved (int8_factor_pairs_avx512, once a super-block for all rows), so that
 * each row's lane pairs them with x's two block sums, adjacent int16 in memory, in one broadcast
 * word. Exact in int32, so the same sum as block by block; done once a super-block, it keeps no
 * register live across the blocks' dots. */
#define INT8_MIN_PAIRS (1 << (INT8_SUPER_SHIFT - 1))
/* `factors`: the weight's mn, or where another sum of factors times x's block sums is wanted, sc. */
__attribute__((target("avx512f,avx512bw,avx512vnni"), always_inline)) static inline void int8_factor_pairs_avx512(
    const uint8_t *factors, const struct int8_weight *w, int64_t t, int64_t sb, __m512i pairs[INT8_MIN_PAIRS])
{
    const int64_t first_block = t * w->blocks + (sb << INT8_SUPER_SHIFT);
    /* word 2i of a pair's register is the lower block's min for row i, word 2i + 1 the upper's */
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                                22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    _Pragma("GCC unroll 4") for (int k = 0; k < INT8_MIN_PAIRS; k++) pairs[k] = _mm512_permutexvar_epi16(
        interleave, _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(factors + (first_block + 2 * k) * INT8_TILE_N))));
}
__attribute__((target("avx512f,avx512bw,avx512vnni"), always_inline)) static inline __m512i int8_mins_row_avx512(
    const __m512i pairs[INT8_MIN_PAIRS], const struct int8_rows *x, int64_t row, int64_t sb)
{
    const int16_t *sums = x->sums + row * x->blocks + (sb << INT8_SUPER_SHIFT);
    __m512i by_mins = _mm512_setzero_si512();
    _Pragma("GCC unroll 4") for (int k = 0; k < INT8_MIN_PAIRS; k++) by_mins =
        _mm512_dpwssd_epi32(by_mins, pairs[k], _mm512_set1_epi32(int8_word((const int8_t *)(sums + 2 * k))));
    return by_mins;
}

/* A K-quant weight (`sc` set) on AVX-512: the K-quant arithmetic above, each block's dots
 * times its factors by vpmulld, the mins a super-block at a time (int8_mins_row_avx512). */
__attribute__((target("avx512f,avx512bw,avx512vnni"), always_inline)) static inline void int8_rows_avx512_kquant_body(
    int rows, int bits, float *out, int64_t N, const struct int8_rows *x, int64_t r0, const struct int8_weight *w,
    int64_t t)
{
    const int64_t supers = w->blocks >> INT8_SUPER_SHIFT;
    __m512 acc[INT8_ROWS];
    _Pragma("GCC unroll 8") for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t sb = 0; sb < supers; sb++) {
        __m512i sum[INT8_ROWS];
        _Pragma("GCC unroll 8") for (int r = 0; r < rows; r++) sum[r] = _mm512_setzero_si512();
        for (int j = 0; j < 1 << INT8_SUPER_SHIFT; j++) {
            const int64_t b = (sb << INT8_SUPER_SHIFT) + j, block = t * w->blocks + b;
            int8_prefetch_next_tile(w, bits, block, x->once);
            __m512i factor, upper; /* 6 bits: the lower 16 inputs' sc, the upper's */
            if (bits == 6) {
                const int8_t *sc = (const int8_t *)w->sc + block * 2 * INT8_TILE_N;
                factor = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)sc));
                upper = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(sc + INT8_TILE_N)));
            } else {
                factor = upper = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(w->sc + block * INT8_TILE_N)));
            }
            __m512i u[8];
            int8_unpack_avx512(bits, w, block, u);
            _Pragma("GCC unroll 8") for (int r = 0; r < rows; r++) {
                const int64_t at = (r0 + r) * x->blocks + b;
                const int8_t *v = x->v + (r0 + r) * x->K + b * INT8_BLOCK;
                __m512i dot[2];
                if (bits == 6) {
                    int8_dots_avx512(u, v, _mm512_set1_epi32(-INT8_Q6_Z * x->halves[2 * at]),
                                     _mm512_set1_epi32(-INT8_Q6_Z * x->halves[2 * at + 1]), dot);
                    sum[r] = _mm512_add_epi32(sum[r], _mm512_add_epi32(_mm512_mullo_epi32(dot[0], factor),
                                                                       _mm512_mullo_epi32(dot[1], upper)));
                    continue;
                }
                int8_dots_avx512(u, v, bits == 8 ? _mm512_set1_epi32(-INT8_Q8_Z * x->sums[at]) : _mm512_setzero_si512(),
                                 _mm512_setzero_si512(), dot);
                sum[r] = _mm512_add_epi32(sum[r], _mm512_mullo_epi32(_mm512_add_epi32(dot[0], dot[1]), factor));
            }
        }
        __m512i by_mins[INT8_ROWS], pairs[INT8_MIN_PAIRS];
        if (bits != 6) {
            int8_factor_pairs_avx512(w->mn, w, t, sb, pairs);
            _Pragma("GCC unroll 8") for (int r = 0; r < rows; r++) by_mins[r] = int8_mins_row_avx512(pairs, x, r0 + r, sb);
        }
        const __m512 dk = _mm512_loadu_ps(w->dk + (t * supers + sb) * INT8_TILE_N);
        const __m512 mk = bits == 6 ? dk : _mm512_loadu_ps(w->mk + (t * supers + sb) * INT8_TILE_N);
        _Pragma("GCC unroll 8") for (int r = 0; r < rows; r++) {
            const __m512 e = _mm512_set1_ps(x->e[(r0 + r) * supers + sb]);
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dk, e), _mm512_cvtepi32_ps(sum[r]), acc[r]);
            if (bits != 6) acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(mk, e), _mm512_cvtepi32_ps(by_mins[r]), acc[r]);
        }
    }
    _Pragma("GCC unroll 8") for (int r = 0; r < rows; r++) _mm512_storeu_ps(out + (r0 + r) * N + t * INT8_TILE_N, acc[r]);
}

/* A switch's cases for a call's rows, 1 to 8 (16: AMX's), each a constant for BODY. */
#define INT8_CASES_8(CASE, BODY)                                                                           \
    CASE(BODY, 1) CASE(BODY, 2) CASE(BODY, 3) CASE(BODY, 4) CASE(BODY, 5) CASE(BODY, 6) CASE(BODY, 7)      \
    CASE(BODY, 8)
#define INT8_CASES_16(CASE, BODY)                                                                          \
    INT8_CASES_8(CASE, BODY) CASE(BODY, 9) CASE(BODY, 10) CASE(BODY, 11) CASE(BODY, 12) CASE(BODY, 13)     \
    CASE(BODY, 14) CASE(BODY, 15) CASE(BODY, 16)
#define INT8_ROWS_SWITCH(CASES, BODY)                                                                      \
    switch (rows) {                                                                                        \
        CASES(INT8_ROWS_CASE, BODY)                                                                        \
    }
#define INT8_ROWS_CASE(BODY, R)                                                                            \
    case R:                                                                                                \
        if (w->bits == 4 && x->offsets != NULL)                                                            \
            BODY(R, 4, 1, out, N, x, r0, w, t);                                                            \
        else if (w->bits == 4)                                                                             \
            BODY(R, 4, 0, out, N, x, r0, w, t);                                                            \
        else if (w->bits == 5 && x->offsets != NULL)                                                       \
            BODY(R, 5, 1, out, N, x, r0, w, t);                                                            \
        else if (w->bits == 5)                                                                             \
            BODY(R, 5, 0, out, N, x, r0, w, t);                                                            \
        else                                                                                               \
            BODY(R, 8, 1, out, N, x, r0, w, t);                                                            \
        break;

#define INT8_KQUANT_CASE(BODY, R)                                                                          \
    case R:                                                                                                \
        if (w->bits == 4)                                                                                  \
            BODY(R, 4, out, N, x, r0, w, t);                                                               \
        else if (w->bits == 5)                                                                             \
            BODY(R, 5, out, N, x, r0, w, t);                                                               \
        else if (w->bits == 6)                                                                             \
            BODY(R, 6, out, N, x, r0, w, t);                                                               \
        else                                                                                               \
            BODY(R, 8, out, N, x, r0, w, t);                                                               \
        break;
/* Dispatches a K-quant weight to BODY and returns. */
#define INT8_KQUANT_SWITCH(CASES, BODY)                                                                    \
    if (w->sc != NULL) {                                                                                   \
        switch (rows) {                                                                                    \
            CASES(INT8_KQUANT_CASE, BODY)                                                                  \
        }                                                                                                  \
        return;                                                                                            \
    }

__attribute__((target("avx512f,avx512bw,avx512vnni"))) static void int8_rows_avx512vnni(
    int rows, float *out, int64_t N, const struct int8_rows *x, int64_t r0, const struct int8_weight *w, int64_t t)
{
    INT8_KQUANT_SWITCH(INT8_CASES_8, int8_rows_avx512_kquant_body)
    INT8_ROWS_SWITCH(INT8_CASES_8, int8_rows_avx512_body)
}

/* The AVX2 body for weights without K-quant scales, once with AVX-VNNI's vpdpbusd and once with
 * vpmaddubsw + vpmaddwd (DOT_NIBBLES: a block's dot of unsigned values below 16; DOT_FIVES: below
 * 32; DOT_BYTES: of any u, a Q8_0 byte; BYTES_DOT_Q: 1 when DOT_BYTES sums q v (q = u - 128)
 * rather than u v, so that Q8_0's offset is not added). `half` there is a tile's lower or upper 8
 * rows. The loop over x's rows is unrolled by two only: AVX2 has 16 registers, and unrolled by
 * eight, the rows' accumulators (two each) beside the block's eight u registers spilled every one
 * of them on every row; by two, u stays in registers, each accumulator makes one trip to L1 a
 * block, and two rows' dots overlap. */
#define INT8_DEFINE_AVX2_BODY(NAME, TARGET, DOT_NIBBLES, DOT_FIVES, DOT_BYTES, BYTES_DOT_Q)                \
    __attribute__((target(TARGET), always_inline)) static inline void NAME(                                \
        int rows, int bits, int z, float *out, int64_t N, const struct int8_rows *x, int64_t r0,             \
        const struct int8_weight *w, int64_t t)                                                            \
    {                                                                                                      \
        __m256 acc[INT8_ROWS][2];                                                                          \
        _Pragma("GCC unroll 8") for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps(); \
        const __m256i low = _mm256_set1_epi8(15), sixteen = _mm256_set1_epi8(16);                          \
        const int32_t *offsets = x->offsets;                                                               \
        const int mins = bits == 8 ? int8_has_mins(w) : !z;                                                \
        for (int64_t b = 0; b < w->blocks; b++) {                                                          \
            const int64_t block = t * w->blocks + b;                                                       \
            int8_prefetch_next_tile(w, bits, block, x->once);                                              \
            for (int half = 0; half < 2; half++) {                                                         \
                const int64_t at8 = block * INT8_TILE_N + 8 * half;                                        \
                /* each of d and m in fp16 or fp32 */                                                      \
                const __m256 d = w->dh != NULL ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w->dh + at8))) \
                                               : _mm256_loadu_ps(w->d + at8);                              \
                const __m256 m = w->mh != NULL  ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w->mh + at8))) \
                                 : w->m != NULL ? _mm256_loadu_ps(w->m + at8)                              \
                                                : _mm256_setzero_ps();                                     \
                __m256i u[8];                                                                              \
                int8_unpack_avx2(bits, w, block, half, low, sixteen, u);                                   \
                _Pragma("GCC unroll 2") for (int r = 0; r < rows; r++) {                                   \
                    const int8_t *v = x->v + (r0 + r) * x->K + b * INT8_BLOCK;                             \
                    const int64_t at = (r0 + r) * x->blocks + b;                                           \
                    __m256i dot = bits == 4 ? DOT_NIBBLES(u, v) : bits == 5 ? DOT_FIVES(u, v) : DOT_BYTES(u, v); \
                    if (z && !(bits == 8 && BYTES_DOT_Q)) dot = _mm256_add_epi32(dot, _mm256_set1_epi32(offsets[at])); \
                    acc[r][half] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(x->e[at])),             \
                                                   _mm256_cvtepi32_ps(dot), acc[r][half]);                 \
                    if (mins) acc[r][half] = _mm256_fmadd_ps(m, _mm256_set1_ps(x->s[at]), acc[r][half]);   \
                }                                                                                          \
            }                                                                                              \
        }                                                                                                  \
        int8_store_avx2(rows, out, N, r0, t, acc);                                                         \
    }

/* A block's sum u v per 32-bit lane (one output row), for the eight groups of four inputs u[g]
 * against the block's 32 activations v. */
__attribute__((target("avx2"), always_inline)) static inline __m256i int8_group(const int8_t *v, int g)
{
    return _mm256_set1_epi32(int8_word(v + 4 * g));
}

/* The rows' accumulators (each tile half's register) into their outputs of tile t. */
__attribute__((target("avx2"), always_inline)) static inline void int8_store_avx2(int rows, float *out, int64_t N,
                                                                                 int64_t r0, int64_t t,
                                                                                 __m256 acc[][2])
{
    _Pragma("GCC unroll 8") for (int r = 0; r < rows; r++) {
        _mm256_storeu_ps(out + (r0 + r) * N + t * INT8_TILE_N, acc[r][0]);
        _mm256_storeu_ps(out + (r0 + r) * N + t * INT8_TILE_N + 8, acc[r][1]);
    }
}

/* A block's values u[g] for one half (8 rows) of the tile: nibbles, with their fifth bits or
 * top bit pairs put in place, or bytes. */
__attribute__((target("avx2"), always_inline)) static inline void int8_unpack_avx2(
    int bits, const struct int8_weight *w, int64_t block, int half, __m256i low, __m256i sixteen, __m256i u[8])
{
    if (bits == 8) {
        const uint8_t *q = w->u + block * 8 * 64 + 32 * half;
        for (int g = 0; g < 8; g++) u[g] = _mm256_loadu_si256((const __m256i *)(q + g * 64));
        return;
    }
    const uint8_t *q = w->u + block * 4 * 64 + 32 * half;
    for (int g = 0; g < 4; g++) {
        const __m256i packed = _mm256_loadu_si256((const __m256i *)(q + g * 64));
        u[g] = _mm256_and_si256(packed, low);
        u[g + 4] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
    }
    if (bits == 5) {
        const __m256i plane = _mm256_loadu_si256((const __m256i *)(w->h + block * 64 + 32 * half));
        _Pragma("GCC unroll 8") for (int g = 0; g < 8; g++) u[g] = _mm256_or_si256(
            u[g], INT8_FIFTH_BITS(_mm256_slli_epi16, _mm256_srli_epi16, _mm256_and_si256, plane, g, sixteen));
    }
    if (bits == 6) {
        const __m256i top = _mm256_set1_epi8(0x30);
        for (int p = 0; p < 2; p++) {
            const __m256i plane = _mm256_loadu_si256((const __m256i *)(w->h + block * 128 + p * 64 + 32 * half));
            _Pragma("GCC unroll 4") for (int j = 0; j < 4; j++) u[4 * p + j] = _mm256_or_si256(
                u[4 * p + j], INT8_BIT_PAIRS(_mm256_slli_epi16, _mm256_srli_epi16, _mm256_and_si256, plane, j, top));
        }
    }
}

/* Nibbles: a vpmaddubsw pair sum is at most 2 * 15 * 127 = 3810 in magnitude, so the eight groups'
 * pair sums add up in 16 bits (at most 30480) and one vpmaddwd a block widens them: one multiply
 * a group instead of two, where the multiplies are what bounds the kernel. */
__attribute__((target("avx2"), always_inline)) static inline __m256i int8_block_nibbles_maddubs(const __m256i u[8],
                                                                                                 const int8_t *v)
{
    __m256i pairs = _mm256_maddubs_epi16(u[0], int8_group(v, 0));
    for (int g = 1; g < 8; g++) pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(u[g], int8_group(v, g)));
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

/* Fifth bits: a pair sum is at most 2 * 31 * 127 = 7874, so four groups still add up in 16 bits
 * (31496) and two vpmaddwd a block widen them. */
__attribute__((target("avx2"), always_inline)) static inline __m256i int8_block_fives_maddubs(const __m256i u[8],
                                                                                               const int8_t *v)
{
    __m256i dot = _mm256_setzero_si256();
    for (int half = 0; half < 2; half++) {
        __m256i pairs = _mm256_maddubs_epi16(u[4 * half], int8_group(v, 4 * half));
        for (int g = 4 * half + 1; g < 4 * half + 4; g++)
            pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(u[g], int8_group(v, g)));
        dot = _mm256_add_epi32(dot, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
    }
    return dot;
}

/* sum q v for Q8_0 bytes u = q + 128, by the sign trick: |q| (0x80 reads as 128 unsigned) against
 * v with q's sign; |q| <= 128 and |v| <= 127, so a 16-bit pair sum cannot saturate, but two of
 * them could: each group is widened on its own. */
__attribute__((target("avx2"), always_inline)) static inline __m256i int8_block_bytes_maddubs(const __m256i u[8],
                                                                                               const int8_t *v)
{
    __m256i dot = _mm256_setzero_si256();
    for (int g = 0; g < 8; g++) {
        const __m256i q = _mm256_xor_si256(u[g], _mm256_set1_epi8((char)0x80));
        const __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(int8_group(v, g), q));
        dot = _mm256_add_epi32(dot, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
    }
    return dot;
}

__attribute__((target("avx2,avxvnni"), always_inline)) static inline __m256i int8_block_avxvnni(const __m256i u[8],
                                                                                                 const int8_t *v)
{
    __m256i dot = _mm256_setzero_si256();
    for (int g = 0; g < 8; g++) dot = _mm256_dpbusd_avx_epi32(dot, u[g], int8_group(v, g));
    return dot;
}

__attribute__((target("avx2,avxvnni"), always_inline)) static inline __m256i int8_half_avxvnni(const __m256i u[8],
                                                                                                const int8_t *v, int p)
{
    __m256i dot = _mm256_setzero_si256();
    for (int g = 4 * p; g < 4 * p + 4; g++) dot = _mm256_dpbusd_avx_epi32(dot, u[g], int8_group(v, g));
    return dot;
}

INT8_DEFINE_AVX2_BODY(int8_rows_avx2_body, "avx2,fma,f16c", int8_block_nibbles_maddubs, int8_block_fives_maddubs,
                      int8_block_bytes_maddubs, 1)
INT8_DEFINE_AVX2_BODY(int8_rows_avxvnni_body, "avx2,fma,f16c,avxvnni", int8_block_avxvnni, int8_block_avxvnni,
                      int8_block_avxvnni, 0)

/* K-quant weights (`sc` set: the K-quant arithmetic above) on AVX2. A block's factors for 8
 * rows, `f`: without VNNI, each lane's factor in both of its 16-bit halves, for the vpmaddwd that
 * widens the 16-bit pair sums (6 bits: the lower and the upper 16 inputs', then (-32 sc0, -32
 * sc1), at most 4096 in magnitude; 8 bits: the factor in 32 bits, for vpmulld); with VNNI, in 32
 * bits for vpmulld (6 bits: lower, upper, then the same pairs). Q6_K's -32 (sc0 sum0 v + sc1 sum1
 * v) comes from x's half-block sums by one vpmaddwd of those pairs. */
__attribute__((target("avx2"), always_inline)) static inline void int8_kquant_factors(
    int bits, int widened, const struct int8_weight *w, int64_t block, int half, __m256i f[3])
{
    if (bits == 6) {
        const int8_t *sc = (const int8_t *)w->sc + block * 2 * INT8_TILE_N + 8 * half;
        const __m128i sc0 = _mm_loadl_epi64((const __m128i *)sc), sc1 = _mm_loadl_epi64((const __m128i *)(sc + INT8_TILE_N));
        f[0] = widened ? _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(sc0, sc0)) : _mm256_cvtepi8_epi32(sc0);
        f[1] = widened ? _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(sc1, sc1)) : _mm256_cvtepi8_epi32(sc1);
        f[2] = _mm256_mullo_epi16(_mm256_cvtepi8_epi16(_mm_unpacklo_epi8(sc0, sc1)), _mm256_set1_epi16(-INT8_Q6_Z));
        return;
    }
    const __m128i sc = _mm_loadl_epi64((const __m128i *)(w->sc + block * INT8_TILE_N + 8 * half));
    f[0] = f[1] = f[2] = widened && bits != 8 ? _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(sc, sc)) : _mm256_cvtepu8_epi32(sc);
}

/* Q6_K's offsets times the factors: -32 (sc0 sum0 v + sc1 sum1 v), from row `at`'s half-block sums. */
__attribute__((target("avx2"), always_inline)) static inline __m256i int8_q6_offsets(const __m256i f[3],
                                                                                   const struct int8_rows *x, int64_t at)
{
    return _mm256_madd_epi16(f[2], _mm256_set1_epi32(int8_word((const int8_t *)(x->halves + 2 * at))));
}

/* A block's (8 rows') sum of its factors times dots, without VNNI: pair sums added in 16 bits as
 * far as they cannot overflow (a 6-bit pair sum is at most 2 * 63 * 127 = 16002, so two groups;
 * 5 bits four, 4 bits all eight, as int8_block_fives_maddubs and int8_block_nibbles_maddubs say),
 * then widened times the factor. A super-block's sum stays below 2^26 in magnitude for Q5_K (8
 * blocks of 63 * 32 * 31 * 127) and 2^28 for Q6_K (16 halves of 128 * 16 * 32 * 127, each
 * block's parts below 2^25); the mins' 8 products of 63 and 32 * 127 below 2^22. */
__attribute__((target("avx2"), always_inline)) static inline __m256i int8_kquant_dot_maddubs(
    int bits, const __m256i u[8], const int8_t *v, const __m256i f[3], const struct int8_rows *x, int64_t at)
{
    if (bits == 8) return _mm256_mullo_epi32(int8_block_bytes_maddubs(u, v), f[0]);
    __m256i pairs[8];
    for (int g = 0; g < 8; g++) pairs[g] = _mm256_maddubs_epi16(u[g], int8_group(v, g));
    const __m256i lower = _mm256_add_epi16(pairs[0], pairs[1]), lower2 = _mm256_add_epi16(pairs[2], pairs[3]);
    const __m256i upper = _mm256_add_epi16(pairs[4], pairs[5]), upper2 = _mm256_add_epi16(pairs[6], pairs[7]);
    if (bits == 4)
        return _mm256_madd_epi16(_mm256_add_epi16(_mm256_add_epi16(lower, lower2), _mm256_add_epi16(upper, upper2)), f[0]);
    if (bits == 5)
        return _mm256_add_epi32(_mm256_madd_epi16(_mm256_add_epi16(lower, lower2), f[0]),
                                _mm256_madd_epi16(_mm256_add_epi16(upper, upper2), f[0]));
    const __m256i dot = _mm256_add_epi32(_mm256_add_epi32(_mm256_madd_epi16(lower, f[0]), _mm256_madd_epi16(lower2, f[0])),
                                         _mm256_add_epi32(_mm256_madd_epi16(upper, f[1]), _mm256_madd_epi16(upper2, f[1])));
    return _mm256_add_epi32(dot, int8_q6_offsets(f, x, at));
}

/* The same with AVX-VNNI's vpdpbusd (8 bits: u = q + 128, the dot started from -128 sum v). */
__attribute__((target("avx2,avxvnni"), always_inline)) static inline __m256i int8_kquant_dot_avxvnni(
    int bits, const __m256i u[8], const int8_t *v, const __m256i f[3], const struct int8_rows *x, int64_t at)
{
    if (bits == 6)
        return _mm256_add_epi32(_mm256_add_epi32(_mm256_mullo_epi32(int8_half_avxvnni(u, v, 0), f[0]),
                                                 _mm256_mullo_epi32(int8_half_avxvnni(u, v, 1), f[1])),
                                int8_q6_offsets(f, x, at));
    __m256i dot = int8_block_avxvnni(u, v);
    if (bits == 8) dot = _mm256_add_epi32(dot, _mm256_set1_epi32(-INT8_Q8_Z * x->sums[at]));
    return _mm256_mullo_epi32(dot, f[0]);
}

/* `rows` and `bits` are constants at each call site. The tile's 16 rows in two halves of 8, a
 * block's factors times dots summed in int32 over each super-block, then its d e (and mk e times
 * the mins' sum, made at its end from pairs of blocks' mn against x's block sums) in fp32. */
#define INT8_DEFINE_AVX2_KQUANT_BODY(NAME, TARGET, WIDENED, KQUANT_DOT)                                    \
    __attribute__((target(TARGET), always_inline)) static inline void NAME(                                \
        int rows, int bits, float *out, int64_t N, const struct int8_rows *x, int64_t r0,                    \
        const struct int8_weight *w, int64_t t)                                                            \
    {                                                                                                      \
        const int64_t supers = w->blocks >> INT8_SUPER_SHIFT;                                              \
        const __m256i low = _mm256_set1_epi8(15), sixteen = _mm256_set1_epi8(16);                          \
        __m256 acc[INT8_ROWS][2];                                                                          \
        _Pragma("GCC unroll 8") for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps(); \
        for (int64_t sb = 0; sb < supers; sb++) {                                                          \
            __m256i sum[INT8_ROWS][2];                                                                     \
            _Pragma("GCC unroll 8") for (int r = 0; r < rows; r++) sum[r][0] = sum[r][1] = _mm256_setzero_si256(); \
            for (int j = 0; j < 1 << INT8_SUPER_SHIFT; j++) {                                              \
                const int64_t b = (sb << INT8_SUPER_SHIFT) + j, block = t * w->blocks + b;                 \
                int8_prefetch_next_tile(w, bits, block, x->once);                                          \
                for (int half = 0; half < 2; half++) {                                                     \
                    __m256i u[8], f[3];                                                                    \
                    int8_unpack_avx2(bits, w, block, half, low, sixteen, u);                               \
                    int8_kquant_factors(bits, WIDENED, w, block, half, f);                                 \
                    _Pragma("GCC unroll 2") for (int r = 0; r < rows; r++) {                               \
                        const int64_t at = (r0 + r) * x->blocks + b;                                       \
                        sum[r][half] = _mm256_add_epi32(                                                   \
                            sum[r][half], KQUANT_DOT(bits, u, x->v + (r0 + r) * x->K + b * INT8_BLOCK, f, x, at)); \
                    }                                                                                      \
                }                                                                                          \
            }                                                                                              \
            for (int half = 0; half < 2; half++) {                                                         \
                const int64_t super = (t * supers + sb) * INT8_TILE_N + 8 * half;                          \
                const __m256 dk = _mm256_loadu_ps(w->dk + super);                                          \
                __m256 mk = dk;                                                                            \
                __m256i mins[4]; /* lane i: (mn of block 2 k, of block 2 k + 1) of row 8 half + i */       \
                if (bits != 6) {                                                                           \
                    mk = _mm256_loadu_ps(w->mk + super);                                                   \
                    const uint8_t *mn = w->mn + (t * w->blocks + (sb << INT8_SUPER_SHIFT)) * INT8_TILE_N + 8 * half; \
                    for (int k = 0; k < 4; k++)                                                            \
                        mins[k] = _mm256_cvtepu8_epi16(                                                    \
                            _mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i *)(mn + 2 * k * INT8_TILE_N)),     \
                                              _mm_loadl_epi64((const __m128i *)(mn + (2 * k + 1) * INT8_TILE_N)))); \
                }                                                                                          \
                _Pragma("GCC unroll 8") for (int r = 0; r < rows; r++) {                                   \
                    const __m256 e = _mm256_set1_ps(x->e[(r0 + r) * supers + sb]);                        \
                    acc[r][half] = _mm256_fmadd_ps(_mm256_mul_ps(dk, e), _mm256_cvtepi32_ps(sum[r][half]), acc[r][half]); \
                    if (bits == 6) continue;                                                               \
                    const int8_t *sums = (const int8_t *)(x->sums + (r0 + r) * x->blocks + (sb << INT8_SUPER_SHIFT)); \
                    __m256i by_mins = _mm256_madd_epi16(mins[0], _mm256_set1_epi32(int8_word(sums)));      \
                    for (int k = 1; k < 4; k++)                                                            \
                        by_mins = _mm256_add_epi32(                                                        \
                            by_mins, _mm256_madd_epi16(mins[k], _mm256_set1_epi32(int8_word(sums + 4 * k)))); \
                    acc[r][half] = _mm256_fmadd_ps(_mm256_mul_ps(mk, e), _mm256_cvtepi32_ps(by_mins), acc[r][half]); \
                }                                                                                          \
            }                                                                                              \
        }                                                                                                  \
        int8_store_avx2(rows, out, N, r0, t, acc);                                                         \
    }

INT8_DEFINE_AVX2_KQUANT_BODY(int8_rows_avx2_kquant_body, "avx2,fma,f16c", 1, int8_kquant_dot_maddubs)
INT8_DEFINE_AVX2_KQUANT_BODY(int8_rows_avxvnni_kquant_body, "avx2,fma,f16c,avxvnni", 0, int8_kquant_dot_avxvnni)




__attribute__((target("avx2,fma,f16c"))) static void int8_rows_avx2(
    int rows, float *out, int64_t N, const struct int8_rows *x, int64_t r0, const struct int8_weight *w, int64_t t)
{
    INT8_KQUANT_SWITCH(INT8_CASES_8, int8_rows_avx2_kquant_body)
    INT8_ROWS_SWITCH(INT8_CASES_8, int8_rows_avx2_body)
}

__attribute__((target("avx2,fma,f16c,avxvnni"))) static void int8_rows_avxvnni(
    int rows, float *out, int64_t N, const struct int8_rows *x, int64_t r0, const struct int8_weight *w, int64_t t)
{
    INT8_KQUANT_SWITCH(INT8_CASES_8, int8_rows_avxvnni_kquant_body)
    INT8_ROWS_SWITCH(INT8_CASES_8, int8_rows_avxvnni_body)
}

#include "quant_amx_cpu.h"

static int int8_isa_supported(int isa);

/* Whether the CPU has AMX's integer tiles beside the AVX-512 path the AMX one leans on (granted
 * or not: int8_amx_granted). */
static int int8_amx_present(void)
{
    return int8_isa_supported(INT8_AVX512VNNI) && __builtin_cpu_supports("amx-tile") &&
           __builtin_cpu_supports("amx-int8");
}

static int int8_isa_supported(int isa)
{
    __builtin_cpu_init();
    switch (isa) {
    case INT8_GENERIC: return 1;
    case INT8_AVX2:
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    case INT8_AVXVNNI:
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") &&
               __builtin_cpu_supports("avxvnni");
    case INT8_AVX512VNNI:
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vnni");
    case INT8_AMX:
        return int8_amx_present() && int8_amx_granted();
    }
    return 0;
}

/* Whether the CPU has AMX's integer tiles and Linux refused this process their state: a slower
 * path runs, which the start-up line says. */
static int int8_amx_refused(void)
{
    return int8_amx_present() && !int8_amx_granted();
}

static int8_rows_kernel *int8_kernel_of(int isa)
{
    switch (isa) {
    case INT8_AVX2: return int8_rows_avx2;
    case INT8_AVXVNNI: return int8_rows_avxvnni;
    case INT8_AVX512VNNI: return int8_rows_avx512vnni;
    case INT8_AMX: return int8_rows_amx;
    }
    return int8_rows_generic;
}
static void int8_quantize_rows(int isa, const float *x, int64_t M, int64_t K, int shift, int8_t *v, float *e, float *s,
                               int16_t *sums, int16_t *halves)
{
    if (isa == INT8_AVX512VNNI || isa == INT8_AMX)
        int8_quantize_rows_by(int8_block_amax_avx512, int8_block_quantize_avx512, x, M, K, shift, v, e, s, sums, halves);
    else if (isa == INT8_AVX2 || isa == INT8_AVXVNNI)
        int8_quantize_rows_by(int8_block_amax_avx2, int8_block_quantize_avx2, x, M, K, shift, v, e, s, sums, halves);
    else
        int8_quantize_rows_by(int8_block_amax_generic, int8_block_quantize_generic, x, M, K, shift, v, e, s, sums,
                              halves);
}
#else
static int int8_isa_supported(int isa) { return isa == INT8_GENERIC; }
static int int8_amx_refused(void) { return 0; }
static void int8_quantize_rows(int isa, const float *x, int64_t M, int64_t K, int shift, int8_t *v, float *e, float *s,
                               int16_t *sums, int16_t *halves)
{
    int8_quantize_rows_by(int8_block_amax_generic, int8_block_quantize_generic, x, M, K, shift, v, e, s, sums, halves);
}
static int8_rows_kernel *int8_kernel_of(int isa) { return int8_rows_generic; }
#endif

/* The rows of x a kernel call takes: on AMX, every row a tile of W meets while in cache. */
static inline int int8_rows_of(int isa)
{
    return isa == INT8_AMX ? INT8_M_TILE : INT8_ROWS;
}

/* The widest path this CPU runs. */
static int int8_best_isa(void)
{
    for (int isa = INT8_AMX; isa > INT8_GENERIC; isa--)
        if (int8_isa_supported(isa)) return isa;
    return INT8_GENERIC;
}

struct int8_quantize_args {
    int isa;
    const float *x;
    int64_t K;
    int shift;
    int8_t *v;
    float *e, *s;
    int16_t *sums, *halves;
};

static void int8_quantize_row_range(const void *args, int64_t t0, int64_t t1)
{
    const struct int8_quantize_args *a = args;
    const int64_t blocks = a->K / INT8_BLOCK;
    int8_quantize_rows(a->isa, a->x + t0 * a->K, t1 - t0, a->K, a->shift, a->v + t0 * a->K,
                       a->e + t0 * (blocks >> a->shift), a->s + t0 * blocks, a->sums ? a->sums + t0 * blocks : NULL,
                       a->halves ? a->halves + t0 * 2 * blocks : NULL);
}

/* A projection's output rows may come in parts of different layouts (a fused q|k|v whose v a
 * K-quant file keeps in more bits than q and k): each part its own weight, of its own tiles. */
#define INT8_MAX_PARTS 4

struct int8_job {
    int8_rows_kernel *kernel;
    float *out;
    int64_t N;
    struct int8_rows x[INT8_MAX_PARTS]; /* each part's: x's rows with that part's offsets */
    int parts;
    struct int8_weight w[INT8_MAX_PARTS];
    int64_t first_tile[INT8_MAX_PARTS + 1];
};

static void int8_rows(const void *ctx, int rows, int64_t r0, int64_t t)
{
    const struct int8_job *job = ctx;
    int p = 0;
    while (t >= job->first_tile[p + 1]) p++;
    const int64_t first = job->first_tile[p];
    job->kernel(rows, job->out + first * INT8_TILE_N, job->N, &job->x[p], r0, &job->w[p], t - first);
}

/* out [M, N] = x [M, K] W^T, fp32, contiguous; K a multiple of 32 (of 256 with K-quant scales),
 * N of 16; W in `parts` (1 to INT8_MAX_PARTS) weights stacked by rows, each's bits, arrays and
 * scales in the layout above (h NULL unless 5 or 6), its tiles set and together N / 16 (their
 * blocks are set here); `isa` one this CPU runs (int8_isa_supported). x is quantized once by
 * blocks where a part has no K-quant scales, once by super-blocks where one has, with the offsets
 * of each z the parts have; then every part's output tiles are cut in about `chunks` pieces for
 * `run` (shared_cpu.h). AMX takes more rows than AVX-512 holds in registers (INT8_ROWS); fewer
 * would not share the weights it makes ready for its tiles, and AVX-512 takes them. Returns 0,
 * or -1 when out of memory. */
static int int8_linear(float *out, const float *x, int64_t M, int64_t K, int64_t N, const struct int8_weight *weights,
                       int parts, int isa, pool_runner *run, int64_t chunks)
{
    if (isa == INT8_AMX && M <= INT8_ROWS) isa = INT8_AVX512VNNI;
    const int64_t blocks = K / INT8_BLOCK;
    int by_block = 0, by_super = 0;
    for (int p = 0; p < parts; p++) {
        by_block |= weights[p].sc == NULL;
        by_super |= weights[p].sc != NULL;
    }
    /* per kind: v [M, K] (rows of zeros after them, up to a whole tile's, where AMX's tiles read
     * 16 rows at a time), s and e [M, blocks]; then room for every part's offsets; then, by
     * super-blocks, sums and halves (K is a multiple of 32: each array stays aligned for its type) */
    const int64_t v_rows = isa == INT8_AMX ? (M + INT8_AMX_ROWS - 1) / INT8_AMX_ROWS * INT8_AMX_ROWS : M;
    const size_t kind_bytes = (size_t)(v_rows * K) + sizeof(float) * (size_t)(2 * M * blocks);
    const size_t offset_bytes = sizeof(int32_t) * (size_t)(M * blocks * parts);
    const size_t sum_bytes = sizeof(int16_t) * (size_t)(3 * M * blocks);
    int8_t *memory = malloc((by_block + by_super) * kind_bytes + offset_bytes + by_super * sum_bytes);
    if (memory == NULL) return -1;
    int32_t *spare = (int32_t *)(memory + (by_block + by_super) * kind_bytes); /* room for every part's offsets */
    int16_t *sums = (int16_t *)((int8_t *)spare + offset_bytes), *halves = sums + M * blocks;
    struct int8_rows kinds[2]; /* by blocks, by super-blocks */
    for (int kind = 0, at = 0; kind < 2; kind++) {
        if (!(kind ? by_super : by_block)) continue;
        const int shift = kind ? INT8_SUPER_SHIFT : 0;
        int8_t *v = memory + at++ * kind_bytes;
        memset(v + M * K, 0, (size_t)((v_rows - M) * K));
        float *s = (float *)(v + v_rows * K), *e = s + M * blocks;
        int16_t *by_sums = kind ? sums : NULL, *by_halves = kind ? halves : NULL;
        const struct int8_quantize_args quantize = {isa, x, K, shift, v, e, s, by_sums, by_halves};
        rows_run(run, chunks, int8_quantize_row_range, &quantize, M, K);
        kinds[kind] = (struct int8_rows){K, blocks, v, e, s, by_sums, by_halves, NULL, M <= int8_rows_of(isa)};
    }
    struct int8_job job = {.kernel = int8_kernel_of(isa), .out = out, .N = N, .parts = parts};
    job.first_tile[0] = 0;
    for (int p = 0; p < parts; p++) {
        job.w[p] = weights[p];
        job.w[p].blocks = blocks;
        job.first_tile[p + 1] = job.first_tile[p] + weights[p].tiles;
        job.x[p] = kinds[weights[p].sc != NULL];
        if (weights[p].sc != NULL) continue; /* its offsets come from x's sums */
        const int shift = int8_offset_shift(&weights[p]);
        for (int q = 0; q < p && shift >= 0; q++) /* a fused q|k|v's parts often share their z */
            if (weights[q].sc == NULL && int8_offset_shift(&weights[q]) == shift) job.x[p].offsets = job.x[q].offsets;
        if (shift >= 0 && job.x[p].offsets == NULL) {
            int8_offsets(job.x[p].v, M, K, shift, spare);
            job.x[p].offsets = spare;
            spare += M * blocks;
        }
    }
    struct tile_loop loop = {int8_rows, &job, M, job.first_tile[parts], 0, INT8_M_TILE, int8_rows_of(isa)};
    tile_loop_run(run, &loop, chunks);
    free(memory);
    return 0;
}

#endif
