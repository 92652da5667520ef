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
 * contexts claimed first; each thread keeps its scratch between calls (thread_scratch). A step
 * of fewer tiles than the pieces the pool wants (one stream decoding: one tile) cuts each tile's
 * KV heads in parts, one piece each: a head's queries meet only its own keys and values, so a
 * part computes what the whole tile computes for those heads, in the same order, and the other
 * threads stream the rest of the cache rather than wait.
 */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "shared_cpu.h"

#define QUERY_TILE 16
/* Rows past a block whose lines are requested while the block is worked on: the blocks of a
 * request sit anywhere in the cache, so the hardware prefetcher cannot see the next one coming.
 * The next block whole and half of the one after it, since a decode step's contexts come from
 * memory (the other layers' rows and the weights evict them between steps) and a block's work is
 * too short to wait for them. Requested a KV head at a time, as the block's work goes from head
 * to head (tile_pass): asked all at once as the block started, the rows of a model with many KV
 * heads made one long burst of requests, and the core waited on them. */
#define PREFETCH_AHEAD 48

/* The lines of bytes at p requested into L2 (prefetcht2), as quant_int8_cpu.h's decode weights
 * are: a decode tile reads each row once, and a line asked into L1 holds one of the core's few
 * L1 miss buffers until it arrives, which caps the lines on their way from memory at a time (the
 * prefetches themselves then stalled the core). From L2 the loads that use them are short. */
static inline void prefetch_span(const void *p, int64_t bytes)
{
    const uintptr_t end = (uintptr_t)p + (uintptr_t)bytes;
    for (uintptr_t line = (uintptr_t)p & ~(uintptr_t)63; line < end; line += 64)
        __builtin_prefetch((const void *)line, 0, 1);
}

/* Consecutive query rows of one request, for its KV heads first_kv_head .. end_kv_head - 1 (and
 * the query heads of their groups). */
struct attention_tile {
    int64_t seq, first_row, num_rows, first_kv_head, end_kv_head;
};

struct attention_job;
/* A tile's rows from its request's context, with the calling thread's scratch (attend_chunk). */
typedef void attend_tile_fn(const struct attention_job *job, const struct attention_tile *t, float *scores,
                            int64_t stride, int64_t *rows, float *block, const float **ptrs);

struct attention_job {
    attend_tile_fn *attend; /* the instance for this CPU's vector width */
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

/* Inlined into each instance and clone of attend_tile, so that they are compiled for its
 * instruction set (an out-of-line copy would be the baseline's: no FMA, two SSE halves per vector). */
#define TILE_INLINE static inline __attribute__((always_inline))

/* Key rows per block: read (widened) once into scratch and used by every row of the tile. */
#define KEY_BLOCK 32

/* How a tile reads cache rows (attend_tile): ROWS_FP32 through fp32 pointers (an fp32 cache, or
 * rows widened or dequantized into scratch); in place, 16 lanes only, ROWS_FP16 converting fp16
 * values as they are read and ROWS_INT8 int8 values, which the tile then multiplies by their
 * row's scale: the same values a widened or dequantized copy would hold (int8: one product). */
enum row_mode { ROWS_FP32 = 0, ROWS_FP16 = 1, ROWS_INT8 = 2 };

/* Pointers to the fp32 values of cache rows rows[0 .. n-1] (offsets in cache elements): in place,
 * or, for the KV heads first_head .. end_head - 1, widened or dequantized into `buf` ([KEY_BLOCK,
 * num_kv_heads * head_dim], each head at its own place). With `mode` ROWS_FP16 or ROWS_INT8 an
 * fp16 or int8 cache's rows stay in place too (their pointers are to the cache's own values,
 * which the tile converts as it reads them). */
TILE_INLINE void load_block(const struct attention_job *job, const void *cache, const int64_t *rows, int64_t n,
                            int64_t first_head, int64_t end_head, float *buf, const float **out, const int mode)
{
    const int64_t values = job->num_kv_heads * job->head_dim, skip = first_head * job->head_dim;
    const int64_t heads = end_head - first_head;
    for (int64_t j = 0; j < n; j++) {
        if (job->kind == KV_CACHE_F32) {
            out[j] = (const float *)cache + rows[j];
            continue;
        }
        if (mode == ROWS_FP16) {
            out[j] = (const float *)(const void *)((const uint16_t *)cache + rows[j]);
            continue;
        }
        if (mode == ROWS_INT8) {
            out[j] = (const float *)(const void *)((const int8_t *)cache + rows[j]);
            continue;
        }
        if (job->kind == KV_CACHE_F16)
            job->widen(buf + j * values + skip, (const uint16_t *)cache + rows[j] + skip, heads * job->head_dim);
        else
            job->dequantize(buf + j * values + skip,
                            (const int8_t *)cache + rows[j] + first_head * kv_row_width(KV_CACHE_I8, job->head_dim),
                            heads, job->head_dim);
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

static inline int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

/* One past the last query row of request b. */
static inline int64_t rows_end(const struct attention_job *job, int64_t b)
{
    return job->query_start_loc == NULL ? b + 1 : job->query_start_loc[b + 1];
}

/* What both passes over a tile's keys share (attention_tile_cpu.h's tile_pass): its m rows'
 * contexts n[] (and padded to four, padded[]), its KV heads, the cache offsets of its keys
 * (rows), the calling thread's scratch (block, ptrs, scores of `stride` floats a row and head),
 * its queries and outputs. */
struct tile_rows {
    const struct attention_job *job;
    int64_t m, group, stride, first_kv_head, end_kv_head;
    const int64_t *rows;
    float *block;
    const float **ptrs;
    const float *q;
    float *out, *scores;
    const int64_t *n, *padded;
};

/* The tile's arithmetic in 16 lanes where the CPU has AVX-512, in 8 elsewhere (AVX2 or the
 * baseline): a wider vector halves the multiply-adds' instructions, and on AVX2 its sums would
 * not fit the registers. */
#ifdef TRILLM_X86_LEVELS
#define LANES 16
#define TILE_TARGET TRILLM_TARGET_V4
#include "attention_tile_cpu.h"
#undef LANES
#undef TILE_TARGET
#define TILE_TARGET TRILLM_MULTIVERSION_BELOW_V4
#else
#define TILE_TARGET
#endif
#define LANES 8
#include "attention_tile_cpu.h"
#undef LANES
#undef TILE_TARGET

/* Whether this CPU runs the tile in `lanes` lanes (8 or 16). */
static int attention_lanes_supported(int lanes)
{
    if (lanes == 8) return 1;
#ifdef TRILLM_X86_LEVELS
    __builtin_cpu_init();
    if (lanes == 16) return __builtin_cpu_supports("x86-64-v4");
#endif
    return 0;
}

/* The tile in `lanes` lanes; 0: the widest this CPU has. */
static attend_tile_fn *pick_attend_tile(int lanes)
{
#ifdef TRILLM_X86_LEVELS
    if (lanes == 16 || (lanes == 0 && attention_lanes_supported(16))) return attend_tile_16;
#endif
    return attend_tile_8;
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
    job->attend(job, t, (float *)scratch, stride, (int64_t *)(scratch + score_bytes),
                (float *)(scratch + score_bytes + row_bytes), (const float **)(scratch + score_bytes + row_bytes + block_bytes));
}

/* q, out: [num_rows, num_heads, head_dim] fp32; k_cache, v_cache: [num_blocks, block_size,
 * num_kv_heads, kv_row_width(kind, head_dim)] of `kind` (enum kv_cache_kind); block_tables:
 * [num_seqs, max_blocks]; seq_lens: [num_seqs]; query_start_loc: [num_seqs + 1], from 0 to
 * num_rows, or NULL when every request has one row (a decode step: num_rows == num_seqs). window <=
 * 0 means no sliding window. lanes: the tile's vector width, one attention_lanes_supported() takes
 * (0: the widest). chunks: the pieces `run` would have a job cut into; tiles fewer than that are
 * cut by KV heads (1: never). Returns 0; -1 when out of memory; -2 when a request has no rows or more rows
 * than its context (nothing is read then); -3 when the CPU has no such width. */
static int paged_attention(
    float *out, const float *q, const void *k_cache, const void *v_cache, int kind, const int32_t *block_tables,
    const int32_t *seq_lens, const int32_t *query_start_loc, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, int64_t block_size, int64_t max_blocks, float scale, int64_t window, int lanes, pool_runner *run,
    int64_t chunks)
{
    if (lanes != 0 && !attention_lanes_supported(lanes)) return -3;
    const int64_t tile_rows = window > 0 ? 1 : QUERY_TILE;
    int64_t num_tiles = 0;
    for (int64_t b = 0; b < num_seqs; b++) {
        const int64_t start = query_start_loc == NULL ? b : query_start_loc[b];
        const int64_t end = query_start_loc == NULL ? b + 1 : query_start_loc[b + 1];
        if (end <= start || end - start > seq_lens[b]) return -2;
        num_tiles += (end - start + tile_rows - 1) / tile_rows;
    }
    int64_t parts = num_tiles > 0 && num_tiles < chunks ? (chunks + num_tiles - 1) / num_tiles : 1;
    if (parts > num_kv_heads) parts = num_kv_heads;
    num_tiles *= parts;
    struct attention_tile *tiles = malloc(sizeof(struct attention_tile) * (size_t)(num_tiles > 0 ? num_tiles : 1));
    if (tiles == NULL) return -1;
    float *rotated = NULL; /* an int8 cache's keys are rotated (kv_rotate): the queries meet them so */
    if (kind == KV_CACHE_I8) {
        const int64_t rows = (query_start_loc == NULL ? num_seqs : query_start_loc[num_seqs]) * num_heads;
        rotated = malloc(sizeof(float) * (size_t)(rows > 0 ? rows * head_dim : 1));
        if (rotated == NULL) {
            free(tiles);
            return -1;
        }
        memcpy(rotated, q, sizeof(float) * (size_t)(rows * head_dim));
        for (int64_t r = 0; r < rows; r++) kv_rotate(rotated + r * head_dim, head_dim);
        q = rotated;
    }
    int64_t c = 0;
    for (int64_t b = 0; b < num_seqs; b++) {
        const int64_t start = query_start_loc == NULL ? b : query_start_loc[b];
        const int64_t end = query_start_loc == NULL ? b + 1 : query_start_loc[b + 1];
        for (int64_t row = start; row < end; row += tile_rows)
            for (int64_t p = 0; p < parts; p++)
                tiles[c++] = (struct attention_tile){b, row, end - row < tile_rows ? end - row : tile_rows,
                                                     p * num_kv_heads / parts, (p + 1) * num_kv_heads / parts};
    }
    struct attention_job job = {pick_attend_tile(lanes), out, q, k_cache, v_cache, kind, kind == KV_CACHE_F16 ? pick_f16_widen() : NULL,
                                kind == KV_CACHE_I8 ? pick_kv_dequantize() : NULL,
                                num_kv_heads * kv_row_width(kind, head_dim), block_tables, seq_lens, query_start_loc,
                                num_heads, num_kv_heads, head_dim, block_size, max_blocks, window, tiles, num_tiles,
                                scale, 0};
    if (num_tiles > 0) run(attend_chunk, &job, num_tiles);
    free(tiles);
    free(rotated);
    return atomic_load(&job.failed) ? -1 : 0;
}
