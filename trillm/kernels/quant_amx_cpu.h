/* The integer kernel (quant_int8_cpu.h) on AMX tiles, for more rows of x than the AVX-512 path
 * holds in registers (int8_linear gives fewer to that path).
 *
 * Why: with a prompt's or a batch's rows, the AVX-512 path is bound by vpdpbusd, 8 of them a row
 * and block. `tdpbsud` multiplies 16 rows of 64 signed bytes by 64 x 16 unsigned ones (16,384
 * products) in one instruction.
 *
 * How: the weight's layout is already the B tile's: a block's unpacked registers u[g], inputs
 * 4g..4g + 3 of the tile's 16 outputs in one 64-byte line, are the rows of a B tile; x's v,
 * rows of K bytes, is the A tile where it lies (stride K). What costs is around the multiply: a
 * tile's store to memory (1 KiB) is slow, and a block's dots need its own factor or scale before
 * they may be summed. So:
 *  - K-quant weights fold each block's factor into the weights (int8_amx_fold): sc u, exact in 16
 *    bits, as two planes of bytes, so that the C tiles sum a whole super-block of 256 inputs and
 *    are stored once, where a factor a block would take a store a block and a vpmulld a block and
 *    row. The fold is done once a call for all its rows (up to INT8_M_TILE, 16 at a time; x's v
 *    padded with rows of zeros to whole tiles).
 *  - The others (fp32 or fp16 scales a block) take a store a block, a span of blocks at a time,
 *    the dots kept in L1 for the AVX-512 path's epilogue.
 * Either way the next span's lines are made between this one's multiplies and its epilogue, so
 * that the tiles' stores finish meanwhile and the lines' stores before the tiles load them. The
 * integers are the AVX-512 path's, and the fp32 operations on them too: the same floats.
 *
 * Linux gives a process the tiles' state only when asked (arch_prctl ARCH_REQ_XCOMP_PERM,
 * process-wide): int8_amx_granted asks once, and where it is refused the path is not offered.
 * The tiles' shapes are per thread: a call reads them back and loads its own where they differ.
 */
#ifndef TRILLM_QUANT_AMX_CPU_H
#define TRILLM_QUANT_AMX_CPU_H

#include <sys/syscall.h>
#include <unistd.h>

/* the tiles: C, dots [rows, 16] int32; A, x's v [rows, inputs]; B, lines [inputs / 4, 64]; a
 * second set, so that two chains overlap, or for the folded planes' high bytes (numbers, not an
 * enum: the intrinsics paste them into the instruction) */
#define INT8_AMX_C 0
#define INT8_AMX_C_UPPER 1
#define INT8_AMX_A 2
#define INT8_AMX_A_UPPER 3
#define INT8_AMX_B 4
#define INT8_AMX_B_UPPER 5

/* Whether this process may use the tiles, asked of Linux once. */
static int int8_amx_granted(void)
{
    static int granted = -1;
    if (granted < 0) granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return granted;
}

struct int8_amx_shapes {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes[16]; /* a row's */
    uint8_t rows[16];
};

/* Sets this thread's tiles for `rows` rows of x and dots of `inputs` inputs (32: a block; 64: two
 * blocks, folded), unless they are set so. What is set is read back from the tiles themselves
 * (STTILECFG is cheap where LDTILECFG is not, so a call loads only a shape it lacks): a note of
 * the last shape set, kept per thread, would be one per compiled module that includes this
 * header (quant_cpu's and decoder_cpu's each kept their own, and each trusted a shape the other
 * had since replaced), and blind to any other library's tiles on the same thread. */
__attribute__((target("amx-tile"))) static void int8_amx_shape(int rows, int inputs)
{
    struct int8_amx_shapes want, have;
    memset(&want, 0, sizeof(want));
    want.palette = 1;
    for (int upper = 0; upper < 2; upper++) {
        want.rows[INT8_AMX_C + upper] = (uint8_t)rows;
        want.bytes[INT8_AMX_C + upper] = INT8_TILE_N * 4;
        want.rows[INT8_AMX_A + upper] = (uint8_t)rows;
        want.bytes[INT8_AMX_A + upper] = (uint16_t)inputs;
        want.rows[INT8_AMX_B + upper] = (uint8_t)(inputs / 4);
        want.bytes[INT8_AMX_B + upper] = INT8_TILE_N * 4;
    }
    _tile_storeconfig(&have); /* all zeros where this thread's tiles are not configured */
    /* GCC's tile-configuration intrinsics tell the compiler they touch 8 bytes: without these
     * barriers it would drop the stores to `want` beyond them as dead, and read `have` before
     * STTILECFG wrote all of it */
    __asm__ volatile("" : : "r"(&want), "r"(&have) : "memory");
    if (memcmp(&want, &have, sizeof(want)) != 0) _tile_loadconfig(&want);
}

#define INT8_AMX_SPAN 8 /* blocks of a weight without K-quant factors a phase takes: their dots stay in L1 */

/* The lines of a span's blocks' u, from block `first` on, as B tiles' rows: unpacked into u
 * (64-aligned, 512 bytes a block), unless they lie in the weight so (bytes). */
__attribute__((target("avx512f,avx512bw"), always_inline)) static inline const uint8_t *int8_amx_unpack(
    int bits, const struct int8_weight *w, int64_t first, int64_t count, int once, uint8_t *u)
{
    for (int64_t b = 0; b < count; b++) int8_prefetch_next_tile(w, bits, first + b, once);
    if (bits == 8) return w->u + first * 8 * 64;
    for (int64_t b = 0; b < count; b++) {
        __m512i lines[8];
        int8_unpack_avx512(bits, w, first + b, lines);
        _Pragma("GCC unroll 8") for (int g = 0; g < 8; g++) _mm512_store_si512(u + (b * 8 + g) * 64, lines[g]);
    }
    return u;
}

/* The blocks of a span from block b0 on. */
static inline int64_t int8_amx_count(const struct int8_weight *w, int64_t b0)
{
    return w->blocks - b0 < INT8_AMX_SPAN ? w->blocks - b0 : INT8_AMX_SPAN;
}

/* The dots of `count` blocks' lines against the configured rows of x from v (row stride K), into
 * dots [count, rows, 16] int32. Consecutive blocks go to the two sets of tiles in turn, so that
 * one's multiply and store overlap the other's. */
__attribute__((target("amx-tile,amx-int8"), always_inline)) static inline void int8_amx_dots(
    int rows, const uint8_t *lines, int64_t count, const int8_t *v, int64_t K, int32_t *dots)
{
    for (int64_t b = 0; b < count; b += 2) {
        _tile_loadd(INT8_AMX_B, lines + b * 8 * 64, 64);
        _tile_loadd(INT8_AMX_A, v + b * INT8_BLOCK, K);
        _tile_zero(INT8_AMX_C);
        _tile_dpbsud(INT8_AMX_C, INT8_AMX_A, INT8_AMX_B);
        if (b + 1 < count) {
            _tile_loadd(INT8_AMX_B_UPPER, lines + (b + 1) * 8 * 64, 64);
            _tile_loadd(INT8_AMX_A_UPPER, v + (b + 1) * INT8_BLOCK, K);
            _tile_zero(INT8_AMX_C_UPPER);
            _tile_dpbsud(INT8_AMX_C_UPPER, INT8_AMX_A_UPPER, INT8_AMX_B_UPPER);
        }
        _tile_stored(INT8_AMX_C, dots + b * rows * INT8_TILE_N, INT8_TILE_N * 4);
        if (b + 1 < count) _tile_stored(INT8_AMX_C_UPPER, dots + (b + 1) * rows * INT8_TILE_N, INT8_TILE_N * 4);
    }
}

/* int8_rows_avx512_body's arithmetic (int8_block_acc_avx512), the dots from the tiles. */
__attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vnni"), always_inline)) static inline void
int8_rows_amx_body(int rows, int bits, int z, float *out, int64_t N, const struct int8_rows *x, int64_t r0,
                   const struct int8_weight *w, int64_t t)
{
    uint8_t u[2][INT8_AMX_SPAN * 8 * 64] __attribute__((aligned(64))); /* this span's lines, the next's */
    int32_t dots[INT8_AMX_SPAN * INT8_AMX_ROWS * INT8_TILE_N] __attribute__((aligned(64)));
    int8_amx_shape(rows, INT8_BLOCK);
    __m512 acc[INT8_AMX_ROWS];
    _Pragma("GCC unroll 16") for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    const int mins = bits == 8 ? int8_has_mins(w) : !z;
    const uint8_t *lines = int8_amx_unpack(bits, w, t * w->blocks, int8_amx_count(w, 0), x->once, u[0]);
    for (int64_t b0 = 0; b0 < w->blocks; b0 += INT8_AMX_SPAN) {
        const int64_t count = int8_amx_count(w, b0);
        int8_amx_dots(rows, lines, count, x->v + r0 * x->K + b0 * INT8_BLOCK, x->K, dots);
        /* the next span's lines before this one's epilogue: the tiles' stores of the dots finish
         * meanwhile, and the lines' stores before the next span's tiles load them */
        if (b0 + INT8_AMX_SPAN < w->blocks)
            lines = int8_amx_unpack(bits, w, t * w->blocks + b0 + INT8_AMX_SPAN, int8_amx_count(w, b0 + INT8_AMX_SPAN),
                                    x->once, u[(b0 / INT8_AMX_SPAN + 1) % 2]);
        for (int64_t b = b0; b < b0 + count; b++) {
            const int64_t block = t * w->blocks + b;
            __m512 d, m;
            int8_scales_avx512(w, block, &d, &m);
            const int32_t *block_dots = dots + (b - b0) * rows * INT8_TILE_N;
            _Pragma("GCC unroll 16") for (int r = 0; r < rows; r++) {
                const int64_t at = (r0 + r) * x->blocks + b;
                __m512i dot = _mm512_load_si512(block_dots + r * INT8_TILE_N);
                if (z) dot = _mm512_add_epi32(dot, _mm512_set1_epi32(x->offsets[at]));
                acc[r] = int8_block_acc_avx512(acc[r], d, m, mins, x, at, dot);
            }
        }
    }
    _Pragma("GCC unroll 16") for (int r = 0; r < rows; r++) _mm512_storeu_ps(out + (r0 + r) * N + t * INT8_TILE_N, acc[r]);
}

/* A super-block's lines with each block's factor folded in, as two planes of bytes: sum_b sc_b
 * dot_b = sum v (sc u), exact in 16 bits (sc u at most 63 x 255; Q6_K's sc (q - 32) within
 * -4064..4096, its z folded in too), split into lo, the products' low bytes (unsigned), and hi,
 * their high bytes (signed), so that sum v (sc u) = sum v lo + 256 sum v hi. Then the C tiles
 * sum a whole super-block, stored once, where a factor a block would need a store a block and
 * a vpmulld a block and row. lo and hi: 512 bytes a block, 64-aligned. */
__attribute__((target("avx512f,avx512bw"), always_inline)) static inline void int8_amx_fold(
    int bits, const struct int8_weight *w, int64_t first, int once, uint8_t *lo, uint8_t *hi)
{
    /* word i of a line holds inputs of output i / 2 (four bytes an output) */
    const __m512i spread = _mm512_set_epi16(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8, 7, 7, 6, 6, 5,
                                            5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i low_byte = _mm512_set1_epi16(0x00FF), z = _mm512_set1_epi16(bits == 6 ? INT8_Q6_Z : 0);
    const __mmask64 odd = 0xAAAAAAAAAAAAAAAAull;
    for (int j = 0; j < 1 << INT8_SUPER_SHIFT; j++) {
        const int64_t block = first + j;
        int8_prefetch_next_tile(w, bits, block, once);
        __m512i u[8], factor[2]; /* 6 bits: the lower 16 inputs' sc, the upper's */
        int8_unpack_avx512(bits, w, block, u);
        if (bits == 6) {
            const int8_t *sc = (const int8_t *)w->sc + block * 2 * INT8_TILE_N;
            _Pragma("GCC unroll 2") for (int h = 0; h < 2; h++) factor[h] = _mm512_permutexvar_epi16(
                spread, _mm512_castsi256_si512(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(sc + h * INT8_TILE_N)))));
        } else {
            factor[0] = factor[1] = _mm512_permutexvar_epi16(
                spread, _mm512_castsi256_si512(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(w->sc + block * INT8_TILE_N)))));
        }
        _Pragma("GCC unroll 8") for (int g = 0; g < 8; g++) {
            const __m512i even = _mm512_mullo_epi16(_mm512_sub_epi16(_mm512_and_si512(u[g], low_byte), z), factor[g / 4]);
            const __m512i odd_ = _mm512_mullo_epi16(_mm512_sub_epi16(_mm512_srli_epi16(u[g], 8), z), factor[g / 4]);
            _mm512_store_si512(lo + (j * 8 + g) * 64, _mm512_mask_blend_epi8(odd, even, _mm512_slli_epi16(odd_, 8)));
            _mm512_store_si512(hi + (j * 8 + g) * 64, _mm512_mask_blend_epi8(odd, _mm512_srli_epi16(even, 8), odd_));
        }
    }
}

/* A super-block's sums for the configured rows (tiles of 64 inputs: two blocks a multiply) from
 * v (row stride K): sum v lo into dots [rows, 16], sum v hi into dots + rows x 16. */
__attribute__((target("amx-tile,amx-int8"), always_inline)) static inline void int8_amx_fold_dots(
    int rows, const uint8_t *lo, const uint8_t *hi, const int8_t *v, int64_t K, int32_t *dots)
{
    _tile_zero(INT8_AMX_C);
    _tile_zero(INT8_AMX_C_UPPER);
    for (int j = 0; j < 1 << INT8_SUPER_SHIFT; j += 4) { /* two pairs of blocks, on the two A and B tiles in turn */
        _tile_loadd(INT8_AMX_A, v + j * INT8_BLOCK, K);
        _tile_loadd(INT8_AMX_B, lo + j * 512, 64);
        _tile_loadd(INT8_AMX_B_UPPER, hi + j * 512, 64);
        _tile_dpbsud(INT8_AMX_C, INT8_AMX_A, INT8_AMX_B);
        _tile_dpbssd(INT8_AMX_C_UPPER, INT8_AMX_A, INT8_AMX_B_UPPER);
        _tile_loadd(INT8_AMX_A_UPPER, v + (j + 2) * INT8_BLOCK, K);
        _tile_loadd(INT8_AMX_B, lo + (j + 2) * 512, 64);
        _tile_loadd(INT8_AMX_B_UPPER, hi + (j + 2) * 512, 64);
        _tile_dpbsud(INT8_AMX_C, INT8_AMX_A_UPPER, INT8_AMX_B);
        _tile_dpbssd(INT8_AMX_C_UPPER, INT8_AMX_A_UPPER, INT8_AMX_B_UPPER);
    }
    _tile_stored(INT8_AMX_C, dots, INT8_TILE_N * 4);
    _tile_stored(INT8_AMX_C_UPPER, dots + rows * INT8_TILE_N, INT8_TILE_N * 4);
}

/* int8_rows_avx512_kquant_body's integers and fp32 operations, the factors folded into the
 * weights (int8_amx_fold) once for all `rows` (up to INT8_M_TILE; x's v padded to whole tiles of
 * rows): a super-block's tiles for every 16 rows, then the next one's folding while their sums
 * are stored, then its epilogue. 8 bits' z: -128 sum_b sc_b sum_b v, as the mins are. */
__attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vnni"), always_inline)) static inline void
int8_rows_amx_kquant_body(int rows, int bits, float *out, int64_t N, const struct int8_rows *x, int64_t r0,
                          const struct int8_weight *w, int64_t t)
{
    enum { PLANE = (1 << INT8_SUPER_SHIFT) * 8 * 64, GROUPS = INT8_M_TILE / INT8_AMX_ROWS };
    uint8_t planes[2][2][PLANE] __attribute__((aligned(64))); /* this super-block's lo and hi, the next's */
    int32_t dots[GROUPS][2 * INT8_AMX_ROWS * INT8_TILE_N] __attribute__((aligned(64)));
    float acc[INT8_M_TILE * INT8_TILE_N] __attribute__((aligned(64)));
    const int groups = (rows + INT8_AMX_ROWS - 1) / INT8_AMX_ROWS;
    int8_amx_shape(INT8_AMX_ROWS, 2 * INT8_BLOCK);
    const int64_t supers = w->blocks >> INT8_SUPER_SHIFT;
    for (int r = 0; r < rows; r++) _mm512_store_ps(acc + r * INT8_TILE_N, _mm512_setzero_ps());
    int8_amx_fold(bits, w, t * w->blocks, x->once, planes[0][0], planes[0][1]);
    for (int64_t sb = 0; sb < supers; sb++) {
        uint8_t(*plane)[PLANE] = planes[sb % 2];
        for (int g = 0; g < groups; g++)
            int8_amx_fold_dots(INT8_AMX_ROWS, plane[0], plane[1],
                               x->v + (r0 + g * INT8_AMX_ROWS) * x->K + (sb << INT8_SUPER_SHIFT) * INT8_BLOCK, x->K, dots[g]);
        if (sb + 1 < supers)
            int8_amx_fold(bits, w, t * w->blocks + ((sb + 1) << INT8_SUPER_SHIFT), x->once, planes[(sb + 1) % 2][0],
                          planes[(sb + 1) % 2][1]);
        __m512i mins[INT8_MIN_PAIRS], zs[INT8_MIN_PAIRS];
        if (bits != 6) int8_factor_pairs_avx512(w->mn, w, t, sb, mins);
        if (bits == 8) int8_factor_pairs_avx512(w->sc, w, t, sb, zs);
        const __m512 dk = _mm512_loadu_ps(w->dk + (t * supers + sb) * INT8_TILE_N);
        const __m512 mk = bits == 6 ? dk : _mm512_loadu_ps(w->mk + (t * supers + sb) * INT8_TILE_N);
        for (int r = 0; r < rows; r++) {
            const int32_t *group = dots[r / INT8_AMX_ROWS] + (r % INT8_AMX_ROWS) * INT8_TILE_N;
            __m512i sum = _mm512_add_epi32(_mm512_load_si512(group),
                                           _mm512_slli_epi32(_mm512_load_si512(group + INT8_AMX_ROWS * INT8_TILE_N), 8));
            if (bits == 8) sum = _mm512_sub_epi32(sum, _mm512_slli_epi32(int8_mins_row_avx512(zs, x, r0 + r, sb), 7));
            const __m512 e = _mm512_set1_ps(x->e[(r0 + r) * supers + sb]);
            __m512 a = _mm512_fmadd_ps(_mm512_mul_ps(dk, e), _mm512_cvtepi32_ps(sum), _mm512_load_ps(acc + r * INT8_TILE_N));
            if (bits != 6)
                a = _mm512_fmadd_ps(_mm512_mul_ps(mk, e), _mm512_cvtepi32_ps(int8_mins_row_avx512(mins, x, r0 + r, sb)), a);
            _mm512_store_ps(acc + r * INT8_TILE_N, a);
        }
    }
    for (int r = 0; r < rows; r++) _mm512_storeu_ps(out + (r0 + r) * N + t * INT8_TILE_N, _mm512_load_ps(acc + r * INT8_TILE_N));
}

/* Up to 16 rows without K-quant scales. */
__attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vnni"))) static void int8_rows_amx_tile(
    int rows, float *out, int64_t N, const struct int8_rows *x, int64_t r0, const struct int8_weight *w, int64_t t)
{
    INT8_ROWS_SWITCH(INT8_CASES_16, int8_rows_amx_body)
}

__attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vnni"))) static void int8_rows_amx(
    int rows, float *out, int64_t N, const struct int8_rows *x, int64_t r0, const struct int8_weight *w, int64_t t)
{
    if (w->sc != NULL) {
        switch (w->bits) {
        case 4: int8_rows_amx_kquant_body(rows, 4, out, N, x, r0, w, t); break;
        case 5: int8_rows_amx_kquant_body(rows, 5, out, N, x, r0, w, t); break;
        case 6: int8_rows_amx_kquant_body(rows, 6, out, N, x, r0, w, t); break;
        default: int8_rows_amx_kquant_body(rows, 8, out, N, x, r0, w, t);
        }
        return;
    }
    for (int g = 0; g < rows; g += INT8_AMX_ROWS)
        int8_rows_amx_tile(rows - g < INT8_AMX_ROWS ? rows - g : INT8_AMX_ROWS, out, N, x, r0 + g, w, t);
}

#endif
