/* Decode attention over the paged KV cache on CPU, fp32.
 *
 * One query row per request, at position seq_lens[b] - 1. The kernel reads each request's keys and
 * values straight from their cache blocks, whole token rows (every KV head) at a time, so nothing is
 * gathered into a copy first: with the gather, moving the context cost more than the attention
 * math. Two passes per request: scores for every head, a softmax, then the weighted sum of values.
 * Both passes take four tokens at a time, so the four dot products (or the four value rows added
 * into the output) are independent chains the CPU overlaps, and each q (or output) vector loaded
 * serves four rows; one token at a time, every dot product waited on its own horizontal sum. A
 * context is padded to a multiple of four with copies of its last row whose probability is 0, so
 * there is no one-token tail loop.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "shared_cpu.h"

/* Rows ahead of the ones in use whose cache lines are requested: the blocks of a request sit
 * anywhere in the cache, so the hardware prefetcher cannot see the next one coming. */
#define PREFETCH_AHEAD 16

static inline void prefetch_row(const float *row, int64_t floats)
{
    for (int64_t off = 0; off < floats; off += 64 / (int64_t)sizeof(float)) __builtin_prefetch(row + off);
}

/* q, out: [num_seqs, num_heads, head_dim]; k_cache, v_cache: [num_blocks, block_size,
 * num_kv_heads, head_dim]; block_tables: [num_seqs, max_blocks]; seq_lens: [num_seqs], each >= 1.
 * window <= 0 means no sliding window. Returns 0, or -1 when out of memory. */
TRILLM_MULTIVERSION
static int paged_decode_attention_f32(
    float *restrict out, const float *restrict q, const float *restrict k_cache,
    const float *restrict v_cache, const int32_t *restrict block_tables,
    const int32_t *restrict seq_lens, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, int64_t block_size, int64_t max_blocks, float scale, int64_t window)
{
    const int64_t group = num_heads / num_kv_heads;
    const int64_t token_stride = num_kv_heads * head_dim;
    const int64_t block_stride = block_size * token_stride;
    int64_t max_len = 1;
    for (int64_t b = 0; b < num_seqs; b++)
        if (seq_lens[b] > max_len) max_len = seq_lens[b];
    const int64_t max_padded = (max_len + 3) / 4 * 4;
    /* scores: [num_heads, padded]; rows: the cache offset of each context token's row, [padded],
     * then copies of the last one for padding and prefetching */
    float *scores = malloc(sizeof(float) * (size_t)(num_heads * max_padded));
    int64_t *rows = malloc(sizeof(int64_t) * (size_t)(max_padded + PREFETCH_AHEAD));
    if (scores == NULL || rows == NULL) {
        free(scores);
        free(rows);
        return -1;
    }
    for (int64_t b = 0; b < num_seqs; b++) {
        const int64_t len = seq_lens[b];
        const int64_t first = (window > 0 && len > window) ? len - window : 0;
        const int64_t n = len - first, padded = (n + 3) / 4 * 4;
        const int32_t *table = block_tables + b * max_blocks;
        const float *qb = q + b * num_heads * head_dim;
        float *ob = out + b * num_heads * head_dim;
        for (int64_t i = 0; i < n; i++) {
            const int64_t pos = first + i;
            rows[i] = table[pos / block_size] * block_stride + (pos % block_size) * token_stride;
        }
        for (int64_t i = n; i < padded + PREFETCH_AHEAD; i++) rows[i] = rows[n - 1];

        for (int64_t i = 0; i < padded; i += 4) {
            const float *k0 = k_cache + rows[i], *k1 = k_cache + rows[i + 1];
            const float *k2 = k_cache + rows[i + 2], *k3 = k_cache + rows[i + 3];
            for (int64_t a = 0; a < 4; a++) prefetch_row(k_cache + rows[i + PREFETCH_AHEAD + a], token_stride);
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
            const float *v0 = v_cache + rows[i], *v1 = v_cache + rows[i + 1];
            const float *v2 = v_cache + rows[i + 2], *v3 = v_cache + rows[i + 3];
            for (int64_t a = 0; a < 4; a++) prefetch_row(v_cache + rows[i + PREFETCH_AHEAD + a], token_stride);
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
    free(scores);
    free(rows);
    return 0;
}
