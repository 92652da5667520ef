/* The arithmetic of an attention tile (attention_cpu.h), written once for a vector width: the
 * includer defines LANES (8 or 16) and TILE_TARGET (the instruction sets it is compiled for), and
 * gets attend_tile_<LANES>. Every lane's sums, and their order, are fixed by this source (GCC's
 * vector extension, no reduction the compiler may reorder), and the same for every row whatever
 * tile it is in; the two widths sum in different orders, so one CPU always runs the same one.
 */
#define TILE_NAME2(name, lanes) name##_##lanes
#define TILE_NAME(name, lanes) TILE_NAME2(name, lanes)
#define vf TILE_NAME(vf, LANES)
#define vi TILE_NAME(vi, LANES)
#define load_lanes TILE_NAME(load_lanes, LANES)
#define store_lanes TILE_NAME(store_lanes, LANES)
#define hsum TILE_NAME(hsum, LANES)
#define store_sums4 TILE_NAME(store_sums4, LANES)
#define dots4 TILE_NAME(dots4, LANES)
#define dots4_lanes TILE_NAME(dots4_lanes, LANES)
#define weigh_values4 TILE_NAME(weigh_values4, LANES)
#define weigh_values1 TILE_NAME(weigh_values1, LANES)
#define weigh_values_lane TILE_NAME(weigh_values_lane, LANES)
#define weigh_values TILE_NAME(weigh_values, LANES)
#define exp_and_sum TILE_NAME(exp_and_sum, LANES)
#define score_block TILE_NAME(score_block, LANES)
#define weigh_block TILE_NAME(weigh_block, LANES)
#define tile_pass TILE_NAME(tile_pass, LANES)
#define tile_pass_int8 TILE_NAME(tile_pass_int8, LANES)
#define tile_pass_as TILE_NAME(tile_pass_as, LANES)
#define load_row TILE_NAME(load_row, LANES)
#define head_offset TILE_NAME(head_offset, LANES)
#define row_scale TILE_NAME(row_scale, LANES)
#define attend_tile TILE_NAME(attend_tile, LANES)

typedef float vf __attribute__((vector_size(4 * LANES)));
typedef int32_t vi __attribute__((vector_size(4 * LANES))); /* shuffle masks, comparisons, exponent bits */

/* The 16-lane instance's helpers are compiled for its instruction set (load_row converts fp16
 * with AVX-512); the 8-lane instance's are inlined into each of its clones. */
#if LANES == 16
#define TILE_FN TILE_INLINE __attribute__((target("arch=x86-64-v4")))
#else
#define TILE_FN TILE_INLINE
#endif

TILE_FN vf load_lanes(const float *p)
{
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

TILE_FN void store_lanes(float *p, vf v) { memcpy(p, &v, sizeof v); }

/* LANES values of a cache row from element `off` (a byte for ROWS_INT8), read as `mode` says
 * (attention_cpu.h's enum row_mode). */
TILE_FN vf load_row(const float *row, int64_t off, const int mode)
{
#if LANES == 16
    if (mode == ROWS_FP16) {
        const __m512 wide = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)(const void *)row + off)));
        vf v;
        memcpy(&v, &wide, sizeof v);
        return v;
    }
    if (mode == ROWS_INT8) {
        const __m512 wide = _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)(const void *)row + off))));
        vf v;
        memcpy(&v, &wide, sizeof v);
        return v;
    }
#endif
    (void)mode;
    return load_lanes(row + off);
}

/* The scale of the int8 row of the head at byte `off` of a token's cache row (ROWS_INT8); 1 for
 * the other modes, whose values need none. */
TILE_FN float row_scale(const float *row, int64_t off, int64_t head_dim, const int mode)
{
    return mode == ROWS_INT8 ? kv_row_scale((const int8_t *)(const void *)row + off, head_dim) : 1.0f;
}

/* Where KV head g starts in a token's row as `mode` reads it: in values, or in the int8 cache's
 * bytes, each head's values followed by its scale. */
TILE_FN int64_t head_offset(const struct attention_job *job, int64_t g, const int mode)
{
    return g * (mode == ROWS_INT8 ? kv_row_width(KV_CACHE_I8, job->head_dim) : job->head_dim);
}

/* A dot product's lanes, summed in one fixed order (16 lanes: first folded onto 8). */
#if LANES == 16
TILE_FN float hsum(vf a)
{
    float h[8];
    for (int i = 0; i < 8; i++) h[i] = a[i] + a[i + 8];
    return ((h[0] + h[4]) + (h[2] + h[6])) + ((h[1] + h[5]) + (h[3] + h[7]));
}
#else
TILE_FN float hsum(vf a) { return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7])); }
#endif

/* s[0..3] = hsum(a0) .. hsum(a3), each times scale: the same additions as hsum, four dot
 * products' lanes added side by side in vector shuffles rather than one scalar chain each. */
#if LANES == 16
TILE_FN void store_sums4(float *s, vf a0, vf a1, vf a2, vf a3, float scale)
{
    const vi low = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const vi high = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    const vf u = __builtin_shuffle(a0, a1, low) + __builtin_shuffle(a0, a1, high); /* h of a0 | h of a1 */
    const vf w = __builtin_shuffle(a2, a3, low) + __builtin_shuffle(a2, a3, high);
    const vi low4 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
    const vi high4 = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
    const vf e = __builtin_shuffle(u, w, low4) + __builtin_shuffle(u, w, high4); /* h[i] + h[i + 4], four each */
    const vi i0 = {0, 4, 8, 12}, i1 = {1, 5, 9, 13}, i2 = {2, 6, 10, 14}, i3 = {3, 7, 11, 15}; /* the rest 0 */
    const vf sums = ((__builtin_shuffle(e, i0) + __builtin_shuffle(e, i2)) +
                     (__builtin_shuffle(e, i1) + __builtin_shuffle(e, i3))) * scale;
    s[0] = sums[0], s[1] = sums[1], s[2] = sums[2], s[3] = sums[3];
}
#else
TILE_FN void store_sums4(float *s, vf a0, vf a1, vf a2, vf a3, float scale)
{
    const vi low = {0, 1, 2, 3, 8, 9, 10, 11}, high = {4, 5, 6, 7, 12, 13, 14, 15};
    const vf u = __builtin_shuffle(a0, a1, low) + __builtin_shuffle(a0, a1, high);  /* a[i] + a[i + 4] */
    const vf w = __builtin_shuffle(a2, a3, low) + __builtin_shuffle(a2, a3, high);
    const vi even = {0, 1, 8, 9, 4, 5, 12, 13}, odd = {2, 3, 10, 11, 6, 7, 14, 15};
    const vf e = __builtin_shuffle(u, w, even) + __builtin_shuffle(u, w, odd);      /* (a0 + a4) + (a2 + a6) .. */
    const vi first = {0, 4, 2, 6, 0, 4, 2, 6}, second = {1, 5, 3, 7, 1, 5, 3, 7};
    const vf sums = (__builtin_shuffle(e, first) + __builtin_shuffle(e, second)) * scale;
    s[0] = sums[0], s[1] = sums[1], s[2] = sums[2], s[3] = sums[3];
}
#endif

/* acc[a][t] += the LANES values of q[a] from d times those of key t, for each query a < nq. */
TILE_FN void dots4_lanes(const int nq, vf acc[QUERY_BLOCK][4], const float *const q[QUERY_BLOCK], int64_t d,
                         const vf k0, const vf k1, const vf k2, const vf k3)
{
    for (int a = 0; a < nq; a++) {
        const vf x = load_lanes(q[a] + d);
        acc[a][0] += x * k0;
        acc[a][1] += x * k1;
        acc[a][2] += x * k2;
        acc[a][3] += x * k3;
    }
}

/* Queries q[0 .. nq-1] against four keys k[0..3] at head offset off: s[a][at .. at+3] = the dot
 * products times scale. Each dot product is LANES lanes, each summing every LANES-th element in
 * order, then hsum's fixed tree: the same for a query whatever block it is in. */
TILE_FN void dots4(const int nq, const float *const q[QUERY_BLOCK], const float *const k[4], int64_t off,
                   int64_t head_dim, float scale, float *const s[QUERY_BLOCK], int64_t at, const int mode)
{
    vf acc[QUERY_BLOCK][4];
    for (int a = 0; a < nq; a++) acc[a][0] = acc[a][1] = acc[a][2] = acc[a][3] = (vf){0};
    int64_t d = 0;
    /* int8: the loop below, each key's values times its row's scale. Apart, not one loop with the
     * product inside a condition: that made the fp16 mode's code 8% slower. */
    if (mode == ROWS_INT8) {
        const float s0 = row_scale(k[0], off, head_dim, mode), s1 = row_scale(k[1], off, head_dim, mode);
        const float s2 = row_scale(k[2], off, head_dim, mode), s3 = row_scale(k[3], off, head_dim, mode);
        for (; d + LANES <= head_dim; d += LANES) {
            const vf k0 = load_row(k[0], off + d, mode) * s0, k1 = load_row(k[1], off + d, mode) * s1;
            const vf k2 = load_row(k[2], off + d, mode) * s2, k3 = load_row(k[3], off + d, mode) * s3;
            dots4_lanes(nq, acc, q, d, k0, k1, k2, k3);
        }
    }
    for (; d + LANES <= head_dim; d += LANES) {
        const vf k0 = load_row(k[0], off + d, mode), k1 = load_row(k[1], off + d, mode);
        const vf k2 = load_row(k[2], off + d, mode), k3 = load_row(k[3], off + d, mode);
        dots4_lanes(nq, acc, q, d, k0, k1, k2, k3);
    }
    for (int64_t l = 0; d < head_dim; d++, l++) /* a head_dim that is not a multiple of LANES */
        for (int a = 0; a < nq; a++)
            for (int t = 0; t < 4; t++) acc[a][t][l] += q[a][d] * k[t][off + d];
    for (int a = 0; a < nq; a++) store_sums4(s[a] + at, acc[a][0], acc[a][1], acc[a][2], acc[a][3], scale);
}

/* o[a][d0 + d] += p[a][j] * v[j][off + d0 + d] for j in 0 .. n-1, in that order, for d in
 * [0, LANES * W), for each query a < nq of a block. The sums stay in registers over the block's
 * keys. */
#define WEIGH_VALUES(W)                                                                                  \
    TILE_FN void weigh_values##W(const int nq, float *const o[QUERY_BLOCK], const float *const p[QUERY_BLOCK], \
                                 const float *const *v, int64_t off, int64_t d0, int64_t n, int64_t head_dim, \
                                 const int mode)                                                       \
    {                                                                                                  \
        vf acc[QUERY_BLOCK][W];                                                                        \
        for (int a = 0; a < nq; a++)                                                                   \
            for (int t = 0; t < W; t++) acc[a][t] = load_lanes(o[a] + d0 + LANES * t);                 \
        if (mode == ROWS_INT8) /* the loop below, each value times its row's scale */                  \
            for (int64_t j = 0; j < n; j++) {                                                          \
                const float sj = row_scale(v[j], off, head_dim, mode);                                 \
                for (int t = 0; t < W; t++) {                                                          \
                    const vf x = load_row(v[j], off + d0 + LANES * t, mode) * sj;                      \
                    for (int a = 0; a < nq; a++) acc[a][t] += p[a][j] * x;                             \
                }                                                                                      \
            }                                                                                          \
        else                                                                                           \
            for (int64_t j = 0; j < n; j++)                                                            \
                for (int t = 0; t < W; t++) {                                                          \
                    const vf x = load_row(v[j], off + d0 + LANES * t, mode);                           \
                    for (int a = 0; a < nq; a++) acc[a][t] += p[a][j] * x;                             \
                }                                                                                      \
        for (int a = 0; a < nq; a++)                                                                   \
            for (int t = 0; t < W; t++) store_lanes(o[a] + d0 + LANES * t, acc[a][t]);                 \
    }
WEIGH_VALUES(4)
WEIGH_VALUES(1)

/* The same for one lane at d (a head_dim that is not a multiple of LANES). */
TILE_FN void weigh_values_lane(const int nq, float *const o[QUERY_BLOCK], const float *const p[QUERY_BLOCK],
                                   const float *const *v, int64_t off, int64_t d, int64_t n)
{
    float acc[QUERY_BLOCK];
    for (int a = 0; a < nq; a++) acc[a] = o[a][d];
    for (int64_t j = 0; j < n; j++)
        for (int a = 0; a < nq; a++) acc[a] += p[a][j] * v[j][off + d];
    for (int a = 0; a < nq; a++) o[a][d] = acc[a];
}

/* The weighted values of a block's queries (as weigh_values##W), across head_dim. */
TILE_FN void weigh_values(const int nq, float *const o[QUERY_BLOCK], const float *const p[QUERY_BLOCK],
                          const float *const *v, int64_t off, int64_t n, int64_t head_dim, const int mode)
{
    int64_t d = 0;
    for (; d + 4 * LANES <= head_dim; d += 4 * LANES) weigh_values4(nq, o, p, v, off, d, n, head_dim, mode);
    for (; d + LANES <= head_dim; d += LANES) weigh_values1(nq, o, p, v, off, d, n, head_dim, mode);
    for (; d < head_dim; d++) weigh_values_lane(nq, o, p, v, off, d, n);
}

/* s[j] = exp(s[j] - mx) for j < len, returning their sum: LANES at a time (the exponential of
 * shared_cpu.h's exp_clamped, lane by lane), the last len % LANES one by one, in a fixed order. */
TILE_FN float exp_and_sum(float *s, int64_t len, float mx)
{
    const vf lo = (vf){0} - 87.0f, hi = (vf){0} + 88.0f, shifter = (vf){0} + 12582912.0f;
    vf acc = {0};
    int64_t j = 0;
    for (; j + LANES <= len; j += LANES) {
        vf x = load_lanes(s + j) - mx;
        vi m = x < lo;
        x = (vf)(((vi)x & ~m) | ((vi)lo & m));
        m = x > hi;
        x = (vf)(((vi)x & ~m) | ((vi)hi & m));
        const vf n = (x * 1.44269504088896341f + shifter) - shifter;
        const vf r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
        vf p = r * 1.9875691500e-4f + 1.3981999507e-3f;
        p = p * r + 8.3334519073e-3f;
        p = p * r + 4.1665795894e-2f;
        p = p * r + 1.6666665459e-1f;
        p = p * r + 5.0000001201e-1f;
        const vf er = p * r * r + r + 1.0f;
        const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
        const vf e = er * (vf)bits;
        store_lanes(s + j, e);
        acc += e;
    }
    float sum = hsum(acc);
    for (; j < len; j++) {
        s[j] = exp_clamped(s[j] - mx);
        sum += s[j];
    }
    return sum;
}

/* Queries x[0 .. nq-1] (of KV head g) against the block's keys up to `end` (the contexts padded
 * to four: a context's last keys are the tile's later ones, or copies of its last, and get
 * probability 0), four keys at a time. A shorter row's extra scores land in its stripe beyond
 * its context, and nothing reads them. */
TILE_FN void score_block(const struct tile_rows *t, int nq, const int64_t x[QUERY_BLOCK], int64_t end, int64_t i0,
                         int64_t g, const int mode)
{
    const int64_t head_dim = t->job->head_dim, off = head_offset(t->job, g, mode);
    const float scale = t->job->scale;
    const float *const *keys = t->ptrs;
    const float *qs[QUERY_BLOCK];
    float *ss[QUERY_BLOCK];
    for (int a = 0; a < nq; a++) {
        qs[a] = t->q + x[a] * head_dim;
        ss[a] = t->scores + x[a] * t->stride + i0;
    }
    FOR_COUNT(nq, for (int64_t j = 0; j < end; j += 4) dots4(NQ, qs, keys + j, off, head_dim, scale, ss, j, mode));
}

/* The block's values weighed into the outputs of queries x[0 .. nq-1] (of KV head g), each over
 * the keys its own context holds (ends[a], ascending with the rows): all of them over the keys
 * the first sees, then the later rows' further keys (at the diagonal) with the rows that see
 * them. */
TILE_FN void weigh_block(const struct tile_rows *t, int nq, const int64_t x[QUERY_BLOCK],
                         const int64_t ends[QUERY_BLOCK], int64_t i0, int64_t g, const int mode)
{
    const int64_t head_dim = t->job->head_dim;
    float *os[QUERY_BLOCK];
    const float *ps[QUERY_BLOCK];
    for (int a = 0; a < nq; a++) {
        os[a] = t->out + x[a] * head_dim;
        ps[a] = t->scores + x[a] * t->stride + i0;
    }
    int64_t done = 0;
    for (int a = 0; a < nq; a++) {
        if (ends[a] <= done) continue;
        const float *pa[QUERY_BLOCK];
        for (int b = a; b < nq; b++) pa[b - a] = ps[b] + done;
        FOR_COUNT(nq - a, weigh_values(NQ, os + a, pa, t->ptrs + done, head_offset(t->job, g, mode), ends[a] - done,
                                       head_dim, mode));
        done = ends[a];
    }
}

/* One pass over the tile's cache rows, KEY_BLOCK at a time, with the queries of each KV head that
 * see the block QUERY_BLOCK at a time (rows ascending, a row's heads of the group in order): the
 * scores (values 0, over the contexts padded to four) or the weighted values (values 1, over the
 * contexts). The rows that see a block are r_lo .. m - 1: their contexts ascend. */
TILE_FN void tile_pass(const struct tile_rows *t, const int values, const int mode)
{
    const struct attention_job *job = t->job;
    const int64_t *const len = values ? t->n : t->padded; /* each row's keys in this pass */
    const int64_t total = len[t->m - 1], num_heads = job->num_heads;
    const char *cache = values ? job->v_cache : job->k_cache;
    const int64_t elem = kv_elem_bytes(job->kind), head_bytes = kv_row_width(job->kind, job->head_dim) * elem;
    /* the first block's rows asked for all at once, rather than met one load at a time; each
     * later block's as the one before it is worked on */
    for (int64_t j = 0; j < KEY_BLOCK; j++)
        prefetch_span(cache + t->rows[j] * elem + t->first_kv_head * head_bytes,
                      (t->end_kv_head - t->first_kv_head) * head_bytes);
    int64_t r_lo = 0;
    for (int64_t i0 = 0; i0 < total; i0 += KEY_BLOCK) {
        const int64_t nk = total - i0 < KEY_BLOCK ? total - i0 : KEY_BLOCK;
        while (len[r_lo] <= i0) r_lo++;
        load_block(job, cache, t->rows + i0, nk, t->first_kv_head, t->end_kv_head, t->block, t->ptrs, mode);
        const int64_t count = (t->m - r_lo) * t->group;
        for (int64_t g = t->first_kv_head; g < t->end_kv_head; g++) {
            for (int64_t j = i0 + KEY_BLOCK; j < i0 + KEY_BLOCK + PREFETCH_AHEAD; j++)
                prefetch_span(cache + t->rows[j] * elem + g * head_bytes, head_bytes);
            int64_t row = r_lo, head = 0; /* the next query's row, and its head within g's group */
            for (int64_t c = 0; c < count; c += QUERY_BLOCK) {
                const int nq = count - c < QUERY_BLOCK ? (int)(count - c) : QUERY_BLOCK;
                int64_t x[QUERY_BLOCK], ends[QUERY_BLOCK] = {0}; /* the queries; the keys of the block each sees */
                for (int a = 0; a < nq; a++) {
                    x[a] = row * num_heads + g * t->group + head;
                    ends[a] = (len[row] < i0 + nk ? len[row] : i0 + nk) - i0;
                    if (++head == t->group) head = 0, row++;
                }
                if (values)
                    weigh_block(t, nq, x, ends, i0, g, mode);
                else
                    score_block(t, nq, x, ends[nq - 1], i0, g, mode);
            }
        }
    }
}

/* tile_pass reading an int8 cache in place, a function of its own: inlined beside the other two
 * modes, it made the fp16 mode's code slower (the same source, 5-8% more time). */
static __attribute__((noinline)) TILE_TARGET void tile_pass_int8(const struct tile_rows *t, const int values)
{
    if (values)
        tile_pass(t, 1, ROWS_INT8);
    else
        tile_pass(t, 0, ROWS_INT8);
}

/* tile_pass reading rows as the tile can: in place (`in_place`: the queries of a KV head make one
 * block) as the cache's kind says, else through fp32 pointers. */
TILE_FN void tile_pass_as(const struct tile_rows *t, const int values, const int in_place)
{
    if (in_place && t->job->kind == KV_CACHE_F16)
        tile_pass(t, values, ROWS_FP16);
    else if (in_place)
        tile_pass_int8(t, values);
    else
        tile_pass(t, values, ROWS_FP32);
}

/* The tile's output rows from its request's context. Scratch: scores [num_rows, num_heads,
 * stride] (stride a multiple of 16 floats, so each row's and head's stripe is 64-byte aligned),
 * rows [padded + KEY_BLOCK + PREFETCH_AHEAD], block [KEY_BLOCK, num_kv_heads * head_dim], pointers
 * [KEY_BLOCK]. The scores (tile_pass), a softmax per row and head, then the weighted values. */
TILE_TARGET static void attend_tile(const struct attention_job *job, const struct attention_tile *t, float *scores,
                                    int64_t stride, int64_t *rows, float *block, const float **ptrs)
{
    const int64_t num_heads = job->num_heads, head_dim = job->head_dim, block_size = job->block_size;
    const int64_t num_kv_heads = job->num_kv_heads, group = num_heads / num_kv_heads;
    const int64_t token_stride = job->token_stride, block_stride = block_size * token_stride;
    const int64_t m = t->num_rows, b = t->seq;
    /* row i of the request sits at position seq_len - (end - i); its context ends there */
    const int64_t last_pos = job->seq_lens[b] - (rows_end(job, b) - t->first_row - m + 1);
    const int64_t first = (job->window > 0 && last_pos + 1 > job->window) ? last_pos + 1 - job->window : 0;
    const int64_t n_max = last_pos + 1 - first, padded_max = round_up(n_max, 4);
    int64_t n[QUERY_TILE], padded[QUERY_TILE];
    for (int64_t r = 0; r < m; r++) {
        n[r] = n_max - (m - 1 - r);
        padded[r] = round_up(n[r], 4);
    }
    const int32_t *table = job->block_tables + b * job->max_blocks;
    for (int64_t i = 0; i < n_max; i++) {
        const int64_t pos = first + i;
        rows[i] = table[pos / block_size] * block_stride + (pos % block_size) * token_stride;
    }
    for (int64_t i = n_max; i < padded_max + KEY_BLOCK + PREFETCH_AHEAD; i++) rows[i] = rows[n_max - 1];
    const float *q = job->q + t->first_row * num_heads * head_dim;
    float *out = job->out + t->first_row * num_heads * head_dim;

    const struct tile_rows tile = {job, m, group, stride, t->first_kv_head, t->end_kv_head, rows, block, ptrs, q, out,
                                   scores, n, padded};
    /* A tile whose queries of a KV head make one block reads each key and value once: an fp16 or
     * int8 cache's rows are then converted as they are read, not widened or dequantized into
     * scratch for that single use; the same values, so the same bits. */
    const int in_place = LANES == 16 && job->kind != KV_CACHE_F32 && m * group <= QUERY_BLOCK && head_dim % LANES == 0;
    /* the query heads of the tile's KV heads, in each row */
    const int64_t first_head = t->first_kv_head * group, end_head = t->end_kv_head * group;
    tile_pass_as(&tile, 0, in_place);
    for (int64_t r = 0; r < m; r++)
        for (int64_t x = r * num_heads + first_head; x < r * num_heads + end_head; x++) {
            float *s = scores + x * stride, mx = -INFINITY;
            const int64_t len = n[r];
#pragma omp simd reduction(max : mx)
            for (int64_t j = 0; j < len; j++) mx = s[j] > mx ? s[j] : mx;
            const float inv = 1.0f / exp_and_sum(s, len, mx);
            for (int64_t j = 0; j < len; j++) s[j] *= inv;
        }
    for (int64_t r = 0; r < m; r++)
        memset(out + (r * num_heads + first_head) * head_dim, 0, sizeof(float) * (size_t)((end_head - first_head) * head_dim));
    tile_pass_as(&tile, 1, in_place);
}

#undef WEIGH_VALUES
#undef vf
#undef vi
#undef load_lanes
#undef store_lanes
#undef hsum
#undef store_sums4
#undef dots4
#undef dots4_lanes
#undef weigh_values4
#undef weigh_values1
#undef weigh_values_lane
#undef weigh_values
#undef exp_and_sum
#undef score_block
#undef weigh_block
#undef tile_pass
#undef tile_pass_int8
#undef tile_pass_as
#undef load_row
#undef head_offset
#undef row_scale
#undef TILE_FN
#undef attend_tile
#undef TILE_NAME
#undef TILE_NAME2
