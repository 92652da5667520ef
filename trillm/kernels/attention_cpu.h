/* Paged attention over the KV cache on CPU, for a step that mixes prompt chunks and decode rows:
 * fp32 queries and sums, the cache in fp32, fp16 or int8 with a scale per token and head (half
 * and about a quarter of the bytes to stream, which is the kernel's cost once a batch has long
 * contexts; trillm/kernels/cache.py has the layouts).
 *
 * Request b owns the query rows query_start_loc[b] .. query_start_loc[b + 1] - 1, the last at
 * position seq_lens[b] - 1; each row attends causally (and within the sliding window) to the
 * positions up to its own. The kernel reads the keys and values straight from their cache
 * blocks, whole token rows (every KV head) at a time, so nothing is gathered into a copy first:
 * with the gather, moving the context cost more than the attention math.
 *
 * A request's rows go in tiles of up to QUERY_TILE consecutive rows. Each key row is read (and
 * widened from fp16, or dequantized from int8) once per tile and used by every row of the tile that
 * sees it, where row by row a prompt of n tokens read its context n times: at a few thousand tokens
 * that re-reading, not the arithmetic, was the prefill's cost. Per row, two passes: scores for
 * every head, a softmax, then the weighted sum of values. Both passes take the queries that share
 * a KV head (the tile's rows times the heads of its group) up to QUERY_BLOCK at a time, so that
 * each key or value vector loaded serves every query of the block, and the scores four keys at a
 * time, so that each query vector loaded serves four keys: the dot products are independent
 * chains the CPU overlaps. A row's context is padded to a multiple of four with rows whose
 * probability is 0 (the tile's next keys, or copies of the last one), so there is no one-token
 * tail loop.
 *
 * What a row computes is the same sequence of operations whatever tile it is in: the same loops
 * over its own keys in the same order, its scores in a 64-byte-aligned stripe of their own. So
 * a prompt gives the same output to the bit whole, in chunks, after a prefix-cache hit or beside
 * other requests. With a sliding window, rows of one request do not share a first key, and each
 * row is a tile of its own.
 *
 * The tiles are shared among the threads of the kernels' pool (pool_cpu.h), the longest
 * contexts claimed first; each thread keeps its scratch between calls (thread_scratch).
 */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "shared_cpu.h"

#define QUERY_TILE 16
/* Rows ahead of the ones in use whose cache lines are requested: the blocks of a request sit
 * anywhere in the cache, so the hardware prefetcher cannot see the next one coming. */
#define PREFETCH_AHEAD 16

static inline void prefetch_row(const void *row, int64_t bytes)
{
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch((const char *)row + off);
}

/* Consecutive query rows of one request. */
struct attention_tile {
    int64_t seq, first_row, num_rows;
};

struct attention_job {
    float *out;
    const float *q;
    const void *k_cache, *v_cache;
    int kind;            /* enum kv_cache_kind */
    f16_widen_fn *widen;           /* how an fp16 cache's row is widened */
    kv_dequantize_fn *dequantize; /* how an int8 cache's row is */
    int64_t token_stride; /* cache elements per token: num_kv_heads * kv_row_width */
    const int32_t *block_tables, *seq_lens;
    const int32_t *query_start_loc; /* NULL: row b is request b's only query */
    int64_t num_heads, num_kv_heads, head_dim, block_size, max_blocks, window;
    const struct attention_tile *tiles;
    int64_t num_tiles;
    float scale;
    _Atomic int failed;
};

/* Scratch of the calling thread, kept for its next call (a step calls the kernel once per layer)
 * and freed when the thread exits: at least `bytes`, 64-byte aligned, NULL when out of memory. */
struct thread_scratch_buffer {
    size_t bytes;
    void *data;
};

static pthread_key_t thread_scratch_key;
static pthread_once_t thread_scratch_once = PTHREAD_ONCE_INIT;

static void thread_scratch_free(void *p)
{
    struct thread_scratch_buffer *s = p;
    free(s->data);
    free(s);
}

static void thread_scratch_make_key(void) { pthread_key_create(&thread_scratch_key, thread_scratch_free); }

static void *thread_scratch(size_t bytes)
{
    pthread_once(&thread_scratch_once, thread_scratch_make_key);
    struct thread_scratch_buffer *s = pthread_getspecific(thread_scratch_key);
    if (s == NULL) {
        s = calloc(1, sizeof *s);
        if (s == NULL || pthread_setspecific(thread_scratch_key, s) != 0) {
            free(s);
            return NULL;
        }
    }
    if (s->bytes < bytes) {
        free(s->data);
        s->data = NULL;
        s->bytes = 0;
        const size_t want = (bytes + bytes / 4 + 63) / 64 * 64; /* room to grow a little without another call */
        if (posix_memalign(&s->data, 64, want) != 0) {
            s->data = NULL;
            return NULL;
        }
        s->bytes = want;
    }
    return s->data;
}

/* Eight lanes of fp32, as GCC's vector extension: the arithmetic below is written lane by lane,
 * so what each lane sums, and in which order, is fixed by this source (no reduction the compiler
 * may reorder), and the same for every row whatever tile it is in. */
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32))); /* shuffle masks, comparisons, exponent bits */

/* Inlined into each clone of attend_tile, so that they are compiled for its instruction set (an
 * out-of-line copy would be the baseline's: no FMA, two SSE halves per vector). */
#define TILE_INLINE static inline __attribute__((always_inline))

TILE_INLINE v8f load8(const float *p)
{
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}

TILE_INLINE void store8(float *p, v8f v) { memcpy(p, &v, sizeof v); }

/* A dot product's lanes, summed in one fixed order. */
TILE_INLINE float hsum8(v8f a) { return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7])); }

/* s[0..3] = hsum8(a0) .. hsum8(a3), each times scale: the same additions as hsum8, four dot
 * products' lanes added side by side in vector shuffles rather than one scalar chain each. */
TILE_INLINE void store_sums4(float *s, v8f a0, v8f a1, v8f a2, v8f a3, float scale)
{
    const v8i low = {0, 1, 2, 3, 8, 9, 10, 11}, high = {4, 5, 6, 7, 12, 13, 14, 15};
    const v8f u = __builtin_shuffle(a0, a1, low) + __builtin_shuffle(a0, a1, high);  /* a[i] + a[i + 4] */
    const v8f w = __builtin_shuffle(a2, a3, low) + __builtin_shuffle(a2, a3, high);
    const v8i even = {0, 1, 8, 9, 4, 5, 12, 13}, odd = {2, 3, 10, 11, 6, 7, 14, 15};
    const v8f e = __builtin_shuffle(u, w, even) + __builtin_shuffle(u, w, odd);      /* (a0 + a4) + (a2 + a6) .. */
    const v8i first = {0, 4, 2, 6, 0, 4, 2, 6}, second = {1, 5, 3, 7, 1, 5, 3, 7};
    const v8f sums = (__builtin_shuffle(e, first) + __builtin_shuffle(e, second)) * scale;
    s[0] = sums[0], s[1] = sums[1], s[2] = sums[2], s[3] = sums[3];
}

/* Key rows per block: read (widened) once into scratch and used by every row of the tile. */
#define KEY_BLOCK 32

/* Pointers to the fp32 values of cache rows rows[0 .. n-1] (offsets in cache elements): in place,
 * or widened or dequantized into `buf` ([KEY_BLOCK, num_kv_heads * head_dim]); the next block's
 * rows are requested meanwhile. */
TILE_INLINE void load_block(const struct attention_job *job, const void *cache, const int64_t *rows, int64_t n,
                            float *buf, const float **out)
{
    const int64_t values = job->num_kv_heads * job->head_dim, elem = kv_elem_bytes(job->kind);
    for (int64_t j = 0; j < PREFETCH_AHEAD; j++)
        prefetch_row((const char *)cache + rows[n + j] * elem, job->token_stride * elem);
    for (int64_t j = 0; j < n; j++) {
        if (job->kind == KV_CACHE_F32) {
            out[j] = (const float *)cache + rows[j];
            continue;
        }
        if (job->kind == KV_CACHE_F16)
            job->widen(buf + j * values, (const uint16_t *)cache + rows[j], values);
        else
            job->dequantize(buf + j * values, (const int8_t *)cache + rows[j], job->num_kv_heads, job->head_dim);
        out[j] = buf + j * values;
    }
}

/* Query vectors sharing one KV head, taken up to QUERY_BLOCK at a time: each key (or value)
 * vector loaded serves all of them, where a pair of queries left the loads, not the multiply-adds,
 * the bound. The block functions take their count nq as a constant (FOR_COUNT), so that each
 * count's loops unroll and its sums stay in registers. */
#define QUERY_BLOCK 4
#define FOR_COUNT(nq, call)                \
    do {                                   \
        switch (nq) {                      \
        case 1: { enum { NQ = 1 }; call; break; } \
        case 2: { enum { NQ = 2 }; call; break; } \
        case 3: { enum { NQ = 3 }; call; break; } \
        default: { enum { NQ = 4 }; call; break; } \
        }                                  \
    } while (0)
_Static_assert(QUERY_BLOCK == 4, "FOR_COUNT spells out every count up to QUERY_BLOCK");

/* Queries q[0 .. nq-1] against four keys k[0..3] at head offset off: s[a][at .. at+3] = the dot
 * products times scale. Each dot product is eight lanes, each summing every eighth element in order, then
 * hsum8's fixed tree: the same for a query whatever block it is in. */
TILE_INLINE void dots4(const int nq, const float *const q[QUERY_BLOCK], const float *const k[4], int64_t off,
                       int64_t head_dim, float scale, float *const s[QUERY_BLOCK], int64_t at)
{
    v8f acc[QUERY_BLOCK][4];
    for (int a = 0; a < nq; a++) acc[a][0] = acc[a][1] = acc[a][2] = acc[a][3] = (v8f){0};
    int64_t d = 0;
    for (; d + 8 <= head_dim; d += 8) {
        const v8f k0 = load8(k[0] + off + d), k1 = load8(k[1] + off + d);
        const v8f k2 = load8(k[2] + off + d), k3 = load8(k[3] + off + d);
        for (int a = 0; a < nq; a++) {
            const v8f x = load8(q[a] + d);
            acc[a][0] += x * k0;
            acc[a][1] += x * k1;
            acc[a][2] += x * k2;
            acc[a][3] += x * k3;
        }
    }
    for (int64_t l = 0; d < head_dim; d++, l++) /* a head_dim that is not a multiple of 8 */
        for (int a = 0; a < nq; a++)
            for (int t = 0; t < 4; t++) acc[a][t][l] += q[a][d] * k[t][off + d];
    for (int a = 0; a < nq; a++) store_sums4(s[a] + at, acc[a][0], acc[a][1], acc[a][2], acc[a][3], scale);
}

/* o[a][d0 + d] += p[a][j] * v[j][off + d0 + d] for j in 0 .. n-1, in that order, for d in [0, 8 * W),
 * for each query a < nq of a block. The sums stay in registers over the block's keys. */
#define WEIGH_VALUES(W)                                                                                       \
    TILE_INLINE void weigh_values##W(const int nq, float *const o[QUERY_BLOCK], const float *const p[QUERY_BLOCK], \
                                     const float *const *v, int64_t off, int64_t d0, int64_t n)               \
    {                                                                                                       \
        v8f acc[QUERY_BLOCK][W];                                                                            \
        for (int a = 0; a < nq; a++)                                                                        \
            for (int t = 0; t < W; t++) acc[a][t] = load8(o[a] + d0 + 8 * t);                               \
        for (int64_t j = 0; j < n; j++)                                                                     \
            for (int t = 0; t < W; t++) {                                                                   \
                const v8f x = load8(v[j] + off + d0 + 8 * t);                                               \
                for (int a = 0; a < nq; a++) acc[a][t] += p[a][j] * x;                                      \
            }                                                                                               \
        for (int a = 0; a < nq; a++)                                                                        \
            for (int t = 0; t < W; t++) store8(o[a] + d0 + 8 * t, acc[a][t]);                               \
    }
WEIGH_VALUES(4)
WEIGH_VALUES(1)

/* The same for one lane at d (a head_dim that is not a multiple of 8). */
TILE_INLINE void weigh_values_lane(const int nq, float *const o[QUERY_BLOCK], const float *const p[QUERY_BLOCK],
                                   const float *const *v, int64_t off, int64_t d, int64_t n)
{
    float acc[QUERY_BLOCK];
    for (int a = 0; a < nq; a++) acc[a] = o[a][d];
    for (int64_t j = 0; j < n; j++)
        for (int a = 0; a < nq; a++) acc[a] += p[a][j] * v[j][off + d];
    for (int a = 0; a < nq; a++) o[a][d] = acc[a];
}

/* The weighted values of a block's queries (as weigh_values##W), across head_dim. */
TILE_INLINE void weigh_values(const int nq, float *const o[QUERY_BLOCK], const float *const p[QUERY_BLOCK],
                              const float *const *v, int64_t off, int64_t n, int64_t head_dim)
{
    int64_t d = 0;
    for (; d + 32 <= head_dim; d += 32) weigh_values4(nq, o, p, v, off, d, n);
    for (; d + 8 <= head_dim; d += 8) weigh_values1(nq, o, p, v, off, d, n);
    for (; d < head_dim; d++) weigh_values_lane(nq, o, p, v, off, d, n);
}

/* s[j] = exp(s[j] - mx) for j < len, returning their sum: eight lanes at a time (the exponential
 * of shared_cpu.h's exp_clamped, lane by lane), the last len % 8 one by one, in a fixed order. */
TILE_INLINE float exp_and_sum(float *s, int64_t len, float mx)
{
    const v8f lo = {-87.0f, -87.0f, -87.0f, -87.0f, -87.0f, -87.0f, -87.0f, -87.0f};
    const v8f hi = {88.0f, 88.0f, 88.0f, 88.0f, 88.0f, 88.0f, 88.0f, 88.0f};
    const v8f shifter = {12582912.0f, 12582912.0f, 12582912.0f, 12582912.0f,
                         12582912.0f, 12582912.0f, 12582912.0f, 12582912.0f};
    v8f acc = {0};
    int64_t j = 0;
    for (; j + 8 <= len; j += 8) {
        v8f x = load8(s + j) - mx;
        v8i m = x < lo;
        x = (v8f)(((v8i)x & ~m) | ((v8i)lo & m));
        m = x > hi;
        x = (v8f)(((v8i)x & ~m) | ((v8i)hi & m));
        const v8f n = (x * 1.44269504088896341f + shifter) - shifter;
        const v8f r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
        v8f p = r * 1.9875691500e-4f + 1.3981999507e-3f;
        p = p * r + 8.3334519073e-3f;
        p = p * r + 4.1665795894e-2f;
        p = p * r + 1.6666665459e-1f;
        p = p * r + 5.0000001201e-1f;
        const v8f er = p * r * r + r + 1.0f;
        const v8i bits = (__builtin_convertvector(n, v8i) + 127) << 23;
        const v8f e = er * (v8f)bits;
        store8(s + j, e);
        acc += e;
    }
    float sum = hsum8(acc);
    for (; j < len; j++) {
        s[j] = exp_clamped(s[j] - mx);
        sum += s[j];
    }
    return sum;
}

static inline int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

/* One past the last query row of request b. */
static inline int64_t rows_end(const struct attention_job *job, int64_t b)
{
    return job->query_start_loc == NULL ? b + 1 : job->query_start_loc[b + 1];
}

/* The index (row * num_heads + head) of the y-th query of KV head g among the tile's rows from
 * r_lo on: rows ascending, and within a row the group of heads that share g. */
static inline int64_t query_index(int64_t r_lo, int64_t y, int64_t g, int64_t group, int64_t num_heads)
{
    return (r_lo + y / group) * num_heads + g * group + y % group;
}

/* The tile's output rows from its request's context. Scratch: scores [num_rows, num_heads,
 * stride] (stride a multiple of 16 floats, so each row's and head's stripe is 64-byte aligned),
 * rows [padded + PREFETCH_AHEAD], block [KEY_BLOCK, num_kv_heads * head_dim], pointers
 * [KEY_BLOCK]. Rows r_lo .. m - 1 of the tile see a block's keys: their contexts ascend. */
TRILLM_MULTIVERSION static void attend_tile(const struct attention_job *job, const struct attention_tile *t,
                                            float *scores, int64_t stride, int64_t *rows, float *block,
                                            const float **ptrs)
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

    /* scores, four keys at a time (a context padded to a multiple of four: its last keys are the
     * tile's later ones, or copies of its last, and get probability 0). The queries of a KV head
     * that see the block go in blocks, rows ascending, to the block's longest context (a shorter
     * row's extra scores land in its stripe beyond its context, and nothing reads them). */
    int64_t r_lo = 0;
    for (int64_t i0 = 0; i0 < padded_max; i0 += KEY_BLOCK) {
        const int64_t nk = padded_max - i0 < KEY_BLOCK ? padded_max - i0 : KEY_BLOCK;
        while (padded[r_lo] <= i0) r_lo++;
        load_block(job, job->k_cache, rows + i0, nk, block, ptrs);
        const int64_t count = (m - r_lo) * group;
        for (int64_t g = 0; g < num_kv_heads; g++)
            for (int64_t c = 0; c < count; c += QUERY_BLOCK) {
                const int nq = count - c < QUERY_BLOCK ? (int)(count - c) : QUERY_BLOCK;
                const float *qs[QUERY_BLOCK];
                float *ss[QUERY_BLOCK];
                for (int a = 0; a < nq; a++) {
                    const int64_t x = query_index(r_lo, c + a, g, group, num_heads);
                    qs[a] = q + x * head_dim;
                    ss[a] = scores + x * stride + i0;
                }
                const int64_t r_last = r_lo + (c + nq - 1) / group;
                const int64_t end = (padded[r_last] < i0 + nk ? padded[r_last] : i0 + nk) - i0;
                for (int64_t j = 0; j < end; j += 4)
                    FOR_COUNT(nq, dots4(NQ, qs, ptrs + j, g * head_dim, head_dim, job->scale, ss, j));
            }
    }

    for (int64_t x = 0; x < m * num_heads; x++) {
        float *s = scores + x * stride, mx = -INFINITY;
        const int64_t len = n[x / num_heads];
#pragma omp simd reduction(max : mx)
        for (int64_t j = 0; j < len; j++) mx = s[j] > mx ? s[j] : mx;
        const float inv = 1.0f / exp_and_sum(s, len, mx);
        for (int64_t j = 0; j < len; j++) s[j] *= inv;
    }
    for (int64_t x = 0; x < m * num_heads * head_dim; x++) out[x] = 0.0f;

    /* the weighted values, over each row's own keys only, 32 output lanes at a time: a block of
     * queries together over the keys its first row sees, then the later rows' further keys (at
     * the diagonal) with the rows that see them */
    r_lo = 0;
    for (int64_t i0 = 0; i0 < n_max; i0 += KEY_BLOCK) {
        const int64_t nk = n_max - i0 < KEY_BLOCK ? n_max - i0 : KEY_BLOCK;
        while (n[r_lo] <= i0) r_lo++;
        load_block(job, job->v_cache, rows + i0, nk, block, ptrs);
        const int64_t count = (m - r_lo) * group;
        for (int64_t g = 0; g < num_kv_heads; g++)
            for (int64_t c = 0; c < count; c += QUERY_BLOCK) {
                const int nq = count - c < QUERY_BLOCK ? (int)(count - c) : QUERY_BLOCK;
                float *os[QUERY_BLOCK];
                const float *ps[QUERY_BLOCK];
                int64_t ends[QUERY_BLOCK];
                for (int a = 0; a < nq; a++) {
                    const int64_t x = query_index(r_lo, c + a, g, group, num_heads), r = x / num_heads;
                    os[a] = out + x * head_dim;
                    ps[a] = scores + x * stride + i0;
                    ends[a] = (n[r] < i0 + nk ? n[r] : i0 + nk) - i0;
                }
                int64_t done = 0;
                for (int a = 0; a < nq; a++) { /* ends ascend with the rows */
                    if (ends[a] <= done) continue;
                    const float *pa[QUERY_BLOCK];
                    for (int b = a; b < nq; b++) pa[b - a] = ps[b] + done;
                    FOR_COUNT(nq - a, weigh_values(NQ, os + a, pa, ptrs + done, g * head_dim, ends[a] - done, head_dim));
                    done = ends[a];
                }
            }
    }
}

/* Tile c of the job, counted from the last: a request's later tiles have the longer contexts,
 * and claimed first they leave the short ones to even out the threads' shares. */
static void attend_chunk(void *ctx, int64_t c)
{
    struct attention_job *job = ctx;
    const struct attention_tile *t = &job->tiles[job->num_tiles - 1 - c];
    const int64_t b = t->seq;
    const int64_t last_pos = job->seq_lens[b] - (rows_end(job, b) - t->first_row - t->num_rows + 1);
    const int64_t n_max = job->window > 0 && last_pos + 1 > job->window ? job->window : last_pos + 1;
    const int64_t stride = round_up(n_max, 16);
    const size_t score_bytes = sizeof(float) * (size_t)(t->num_rows * job->num_heads * stride);
    const size_t row_bytes = (size_t)round_up(sizeof(int64_t) * (size_t)(stride + KEY_BLOCK + PREFETCH_AHEAD), 64);
    const size_t block_bytes = sizeof(float) * (size_t)(KEY_BLOCK * job->num_kv_heads * job->head_dim);
    char *scratch = thread_scratch(score_bytes + row_bytes + block_bytes + sizeof(float *) * KEY_BLOCK);
    if (scratch == NULL) {
        atomic_store(&job->failed, 1);
        return;
    }
    attend_tile(job, t, (float *)scratch, stride, (int64_t *)(scratch + score_bytes),
                (float *)(scratch + score_bytes + row_bytes), (const float **)(scratch + score_bytes + row_bytes + block_bytes));
}

/* q, out: [num_rows, num_heads, head_dim] fp32; k_cache, v_cache: [num_blocks, block_size,
 * num_kv_heads, kv_row_width(kind, head_dim)] of `kind` (enum kv_cache_kind); block_tables:
 * [num_seqs, max_blocks]; seq_lens: [num_seqs]; query_start_loc: [num_seqs + 1], from 0 to
 * num_rows, or NULL when every request has one row (a decode step: num_rows == num_seqs). window <=
 * 0 means no sliding window. Returns 0; -1 when out of memory; -2 when a request has no rows or
 * more rows than its context (nothing is read then). */
static int paged_attention(
    float *out, const float *q, const void *k_cache, const void *v_cache, int kind, const int32_t *block_tables,
    const int32_t *seq_lens, const int32_t *query_start_loc, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, int64_t block_size, int64_t max_blocks, float scale, int64_t window, pool_runner *run)
{
    const int64_t tile_rows = window > 0 ? 1 : QUERY_TILE;
    int64_t num_tiles = 0;
    for (int64_t b = 0; b < num_seqs; b++) {
        const int64_t start = query_start_loc == NULL ? b : query_start_loc[b];
        const int64_t end = query_start_loc == NULL ? b + 1 : query_start_loc[b + 1];
        if (end <= start || end - start > seq_lens[b]) return -2;
        num_tiles += (end - start + tile_rows - 1) / tile_rows;
    }
    struct attention_tile *tiles = malloc(sizeof(struct attention_tile) * (size_t)(num_tiles > 0 ? num_tiles : 1));
    if (tiles == NULL) return -1;
    int64_t c = 0;
    for (int64_t b = 0; b < num_seqs; b++) {
        const int64_t start = query_start_loc == NULL ? b : query_start_loc[b];
        const int64_t end = query_start_loc == NULL ? b + 1 : query_start_loc[b + 1];
        for (int64_t row = start; row < end; row += tile_rows)
            tiles[c++] = (struct attention_tile){b, row, end - row < tile_rows ? end - row : tile_rows};
    }
    struct attention_job job = {out, q, k_cache, v_cache, kind, kind == KV_CACHE_F16 ? pick_f16_widen() : NULL,
                                kind == KV_CACHE_I8 ? pick_kv_dequantize() : NULL,
                                num_kv_heads * kv_row_width(kind, head_dim), block_tables, seq_lens, query_start_loc,
                                num_heads, num_kv_heads, head_dim, block_size, max_blocks, window, tiles, num_tiles,
                                scale, 0};
    if (num_tiles > 0) run(attend_chunk, &job, num_tiles);
    free(tiles);
    return atomic_load(&job.failed) ? -1 : 0;
}
