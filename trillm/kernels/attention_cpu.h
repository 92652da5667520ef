/* Decode attention over the paged KV cache on CPU: fp32 queries and sums, the cache in fp32 or
 * fp16 (half the bytes to stream, which is the kernel's cost once a batch has long contexts).
 *
 * One query row per request, at position seq_lens[b] - 1. The kernel reads each request's keys and
 * values straight from their cache blocks, whole token rows (every KV head) at a time, so nothing is
 * gathered into a copy first: with the gather, moving the context cost more than the attention
 * math. Two passes per request: scores for every head, a softmax, then the weighted sum of values.
 * Both passes take four tokens at a time, so the four dot products (or the four value rows added
 * into the output) are independent chains the CPU overlaps, and each q (or output) vector loaded
 * serves four rows; one token at a time, every dot product waited on its own horizontal sum. A
 * context is padded to a multiple of four with copies of its last row whose probability is 0, so
 * there is no one-token tail loop. The requests are shared among the threads of the kernels'
 * pool (pool_cpu.h), each with scratch of its own.
 */
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>

#include "shared_cpu.h"

/* Rows ahead of the ones in use whose cache lines are requested: the blocks of a request sit
 * anywhere in the cache, so the hardware prefetcher cannot see the next one coming. */
#define PREFETCH_AHEAD 16

static inline void prefetch_row(const void *row, int64_t bytes)
{
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch((const char *)row + off);
}

struct decode_job {
    float *out;
    const float *q;
    const void *k_cache, *v_cache;
    f16_widen_fn *widen; /* NULL: an fp32 cache, read in place; else how an fp16 row is widened */
    const int32_t *block_tables, *seq_lens;
    int64_t num_seqs, num_heads, num_kv_heads, head_dim, block_size, max_blocks, window, max_padded, per_chunk;
    float scale;
    _Atomic int failed;
};

/* The fp32 values of the cache row at `offset` (elements): in place, or widened into `wide`. */
static inline const float *cache_row(const struct decode_job *job, const void *cache, int64_t offset, float *wide)
{
    if (job->widen == NULL) return (const float *)cache + offset;
    job->widen(wide, (const uint16_t *)cache + offset, job->num_kv_heads * job->head_dim);
    return wide;
}

/* The four cache rows rows[0..3] as fp32 (r[a]), with the rows PREFETCH_AHEAD on requested. */
static inline void cache_rows4(const struct decode_job *job, const void *cache, const int64_t *rows, float *wide,
                               const float *r[4])
{
    const int64_t token_stride = job->num_kv_heads * job->head_dim;
    const int64_t elem = job->widen == NULL ? (int64_t)sizeof(float) : (int64_t)sizeof(uint16_t);
    for (int64_t a = 0; a < 4; a++) prefetch_row((const char *)cache + rows[PREFETCH_AHEAD + a] * elem, token_stride * elem);
    for (int64_t a = 0; a < 4; a++) r[a] = cache_row(job, cache, rows[a], wide + a * token_stride);
}

/* Request b's output rows from its context. Scratch, the caller's: scores [num_heads,
 * max_padded], rows [max_padded + PREFETCH_AHEAD], wide [4, num_kv_heads * head_dim]. */
TRILLM_MULTIVERSION static void decode_one(const struct decode_job *job, int64_t b, float *scores, int64_t *rows,
                                           float *wide)
{
    const int64_t num_heads = job->num_heads, head_dim = job->head_dim, block_size = job->block_size;
    const int64_t group = num_heads / job->num_kv_heads;
    const int64_t token_stride = job->num_kv_heads * head_dim, block_stride = block_size * token_stride;
    const float scale = job->scale;
    const int64_t len = job->seq_lens[b];
    const int64_t first = (job->window > 0 && len > job->window) ? len - job->window : 0;
    const int64_t n = len - first, padded = (n + 3) / 4 * 4;
    const int32_t *table = job->block_tables + b * job->max_blocks;
    const float *qb = job->q + b * num_heads * head_dim;
    float *ob = job->out + b * num_heads * head_dim;
    for (int64_t i = 0; i < n; i++) {
        const int64_t pos = first + i;
        rows[i] = table[pos / block_size] * block_stride + (pos % block_size) * token_stride;
    }
    for (int64_t i = n; i < padded + PREFETCH_AHEAD; i++) rows[i] = rows[n - 1];

    for (int64_t i = 0; i < padded; i += 4) {
        const float *k[4];
        cache_rows4(job, job->k_cache, rows + i, wide, k);
        const float *k0 = k[0], *k1 = k[1], *k2 = k[2], *k3 = k[3];
        for (int64_t h = 0; h < num_heads; h++) {
            const float *qh = qb + h * head_dim;
            const int64_t off = (h / group) * head_dim;
            float d0 = 0.0f, d1 = 0.0f, d2 = 0.0f, d3 = 0.0f;
#pragma omp simd reduction(+ : d0, d1, d2, d3)
            for (int64_t d = 0; d < head_dim; d++) {
                const float x = qh[d];
                d0 += x * k0[off + d];
                d1 += x * k1[off + d];
                d2 += x * k2[off + d];
                d3 += x * k3[off + d];
            }
            float *s = scores + h * padded + i;
            s[0] = d0 * scale, s[1] = d1 * scale, s[2] = d2 * scale, s[3] = d3 * scale;
        }
    }

    for (int64_t h = 0; h < num_heads; h++) {
        float *s = scores + h * padded, m = -INFINITY, sum = 0.0f;
#pragma omp simd reduction(max : m)
        for (int64_t j = 0; j < n; j++) m = s[j] > m ? s[j] : m;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < n; j++) {
            s[j] = exp_clamped(s[j] - m);
            sum += s[j];
        }
        const float inv = 1.0f / sum;
        for (int64_t j = 0; j < n; j++) s[j] *= inv;
        for (int64_t j = n; j < padded; j++) s[j] = 0.0f;
    }

    for (int64_t x = 0; x < num_heads * head_dim; x++) ob[x] = 0.0f;
    for (int64_t i = 0; i < padded; i += 4) {
        const float *v[4];
        cache_rows4(job, job->v_cache, rows + i, wide, v);
        const float *v0 = v[0], *v1 = v[1], *v2 = v[2], *v3 = v[3];
        for (int64_t h = 0; h < num_heads; h++) {
            const float *s = scores + h * padded + i;
            const float p0 = s[0], p1 = s[1], p2 = s[2], p3 = s[3];
            const int64_t off = (h / group) * head_dim;
            float *oh = ob + h * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; d++)
                oh[d] += p0 * v0[off + d] + p1 * v1[off + d] + p2 * v2[off + d] + p3 * v3[off + d];
        }
    }
}

/* Requests [c * per_chunk, ...), with scratch of their own. */
static void decode_chunk(void *ctx, int64_t c)
{
    struct decode_job *job = ctx;
    float *scores = malloc(sizeof(float) * (size_t)(job->num_heads * job->max_padded));
    int64_t *rows = malloc(sizeof(int64_t) * (size_t)(job->max_padded + PREFETCH_AHEAD));
    float *wide = malloc(sizeof(float) * (size_t)(4 * job->num_kv_heads * job->head_dim));
    if (scores == NULL || rows == NULL || wide == NULL)
        atomic_store(&job->failed, 1);
    else
        for (int64_t b = c * job->per_chunk; b < (c + 1) * job->per_chunk && b < job->num_seqs; b++)
            decode_one(job, b, scores, rows, wide);
    free(scores);
    free(rows);
    free(wide);
}

/* q, out: [num_seqs, num_heads, head_dim] fp32; k_cache, v_cache: [num_blocks, block_size,
 * num_kv_heads, head_dim], fp32 or (f16) fp16; block_tables: [num_seqs, max_blocks]; seq_lens:
 * [num_seqs], each >= 1. window <= 0 means no sliding window. The requests are cut in about
 * `chunks` pieces for `run` (shared_cpu.h). Returns 0, or -1 when out of memory. */
static int paged_decode_attention(
    float *out, const float *q, const void *k_cache, const void *v_cache, int f16, const int32_t *block_tables,
    const int32_t *seq_lens, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t block_size, int64_t max_blocks, float scale, int64_t window, pool_runner *run, int64_t chunks)
{
    int64_t max_len = 1;
    for (int64_t b = 0; b < num_seqs; b++)
        if (seq_lens[b] > max_len) max_len = seq_lens[b];
    struct decode_job job = {out, q, k_cache, v_cache, f16 ? pick_f16_widen() : NULL, block_tables, seq_lens, num_seqs,
                             num_heads, num_kv_heads, head_dim, block_size, max_blocks, window, (max_len + 3) / 4 * 4,
                             0, scale, 0};
    job.per_chunk = (num_seqs + chunks - 1) / chunks;
    run(decode_chunk, &job, (num_seqs + job.per_chunk - 1) / job.per_chunk);
    return atomic_load(&job.failed) ? -1 : 0;
}
