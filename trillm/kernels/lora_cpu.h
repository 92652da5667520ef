/* The grouped LoRA multiply on CPU, fp32: y[t] += (A[s] x[t]) B[s] for each row t whose slot s
 * is >= 0 (trillm/kernels/lora.py is the reference).
 *
 * Rows are first grouped by slot (a counting sort), so that each adapter's A and B are read once
 * per call, not once per row. The shrink h = A[s] x takes two rows of A against four rows of
 * its group at once (eight sums in registers from six loads). The expand adds h B[s] (B stored
 * [K, out]) to each row, a tile of LORA_TILE outputs at a time whose sums stay in registers
 * while the K rows of B pass (K is small: a dot product over it would be mostly reduction),
 * skipping B's zero blocks (each part of a fused projection reads only its own share of h).
 * The shrink is shared among the pool's threads by pairs of A's rows, the expand by tiles of
 * outputs; every output's sum runs in the same order on any number of threads. Inner loops run
 * along contiguous memory and vectorize (`omp simd`).
 */
#ifndef TRILLM_LORA_CPU_H
#define TRILLM_LORA_CPU_H

#include <stdint.h>
#include <stdlib.h>

#include "shared_cpu.h"

#define LORA_TILE 32 /* outputs summed in registers at once by the expand */

static inline float lora_dot(const float *a, const float *b, int64_t n)
{
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; i++)
        sum += a[i] * b[i];
    return sum;
}

struct lora_job {
    float *y, *h;               /* h: [rows with a slot, K], in `order` */
    const float *x, *a, *b;
    const int64_t *order;       /* the rows with a slot, grouped by slot */
    const int64_t *group_start; /* slot s's rows are order[group_start[s] .. group_start[s + 1]) */
    const int64_t *out_offsets; /* part p's outputs are [out_offsets[p], out_offsets[p + 1]) */
    int64_t S, parts, n_in, n_out, K, x_stride, y_stride, per_chunk;
};

TRILLM_MULTIVERSION static void lora_shrink(void *ctx, int64_t chunk)
{
    const struct lora_job *job = ctx;
    const int64_t k0 = chunk * job->per_chunk;
    const int64_t k1 = k0 + job->per_chunk < job->K ? k0 + job->per_chunk : job->K;
    const int64_t n_in = job->n_in, K = job->K;
    for (int64_t s = 0; s < job->S; s++) {
        const int64_t end = job->group_start[s + 1];
        int64_t k = k0;
        for (; k + 2 <= k1; k += 2) { /* two rows of A against four rows of x: six loads feed eight sums */
            const float *a0 = job->a + (s * K + k) * n_in, *a1 = a0 + n_in;
            int64_t i = job->group_start[s];
            for (; i + 4 <= end; i += 4) {
                const float *x0 = job->x + job->order[i] * job->x_stride, *x1 = job->x + job->order[i + 1] * job->x_stride;
                const float *x2 = job->x + job->order[i + 2] * job->x_stride, *x3 = job->x + job->order[i + 3] * job->x_stride;
                float s00 = 0.0f, s01 = 0.0f, s02 = 0.0f, s03 = 0.0f, s10 = 0.0f, s11 = 0.0f, s12 = 0.0f, s13 = 0.0f;
#pragma omp simd reduction(+ : s00, s01, s02, s03, s10, s11, s12, s13)
                for (int64_t j = 0; j < n_in; j++) {
                    s00 += a0[j] * x0[j], s01 += a0[j] * x1[j], s02 += a0[j] * x2[j], s03 += a0[j] * x3[j];
                    s10 += a1[j] * x0[j], s11 += a1[j] * x1[j], s12 += a1[j] * x2[j], s13 += a1[j] * x3[j];
                }
                float *h = job->h + i * K + k;
                h[0] = s00, h[K] = s01, h[2 * K] = s02, h[3 * K] = s03;
                h[1] = s10, h[K + 1] = s11, h[2 * K + 1] = s12, h[3 * K + 1] = s13;
            }
            for (; i < end; i++) {
                const float *xi = job->x + job->order[i] * job->x_stride;
                job->h[i * K + k] = lora_dot(a0, xi, n_in);
                job->h[i * K + k + 1] = lora_dot(a1, xi, n_in);
            }
        }
        for (; k < k1; k++)
            for (int64_t i = job->group_start[s]; i < end; i++)
                job->h[i * K + k] = lora_dot(job->a + (s * K + k) * n_in, job->x + job->order[i] * job->x_stride, n_in);
    }
}

/* y[0:w] += sum_k h[k] bt[k * stride + 0:w]; the full tile's width is a constant, so its sums stay
 * in registers. */
static inline void lora_expand_tile(float *y, const float *h, const float *bt, int64_t K, int64_t stride, int64_t w)
{
    float acc[LORA_TILE];
    if (w == LORA_TILE) {
#pragma omp simd
        for (int j = 0; j < LORA_TILE; j++)
            acc[j] = y[j];
        for (int64_t k = 0; k < K; k++) {
            const float hk = h[k];
            const float *bk = bt + k * stride;
#pragma omp simd
            for (int j = 0; j < LORA_TILE; j++)
                acc[j] += hk * bk[j];
        }
#pragma omp simd
        for (int j = 0; j < LORA_TILE; j++)
            y[j] = acc[j];
        return;
    }
    for (int64_t j = 0; j < w; j++)
        acc[j] = y[j];
    for (int64_t k = 0; k < K; k++)
        for (int64_t j = 0; j < w; j++)
            acc[j] += h[k] * bt[k * stride + j];
    for (int64_t j = 0; j < w; j++)
        y[j] = acc[j];
}

TRILLM_MULTIVERSION static void lora_expand(void *ctx, int64_t chunk)
{
    const struct lora_job *job = ctx;
    const int64_t n0 = chunk * job->per_chunk;
    const int64_t n1 = n0 + job->per_chunk < job->n_out ? n0 + job->per_chunk : job->n_out;
    const int64_t Kp = job->K / job->parts; /* part p's outputs read only h[p Kp, (p + 1) Kp): B is block-diagonal */
    for (int64_t s = 0; s < job->S; s++) {
        const float *bt = job->b + s * job->K * job->n_out;
        for (int64_t i = job->group_start[s]; i < job->group_start[s + 1]; i++) {
            float *y = job->y + job->order[i] * job->y_stride;
            for (int64_t p = 0; p < job->parts; p++) {
                const int64_t lo = job->out_offsets[p] > n0 ? job->out_offsets[p] : n0;
                const int64_t hi = job->out_offsets[p + 1] < n1 ? job->out_offsets[p + 1] : n1;
                const float *h = job->h + i * job->K + p * Kp, *bp = bt + p * Kp * job->n_out;
                for (int64_t n = lo; n < hi; n += LORA_TILE)
                    lora_expand_tile(y + n, h, bp + n, Kp, job->n_out, hi - n < LORA_TILE ? hi - n : LORA_TILE);
            }
        }
    }
}

/* Cuts `total` items into about `chunks` runs of a multiple of `unit` items; returns how many. */
static inline int64_t lora_split(struct lora_job *job, int64_t total, int64_t chunks, int64_t unit)
{
    job->per_chunk = ((total + chunks - 1) / chunks + unit - 1) / unit * unit;
    return (total + job->per_chunk - 1) / job->per_chunk;
}

/* `out_offsets` (parts + 1 entries, from 0 to n_out): where each part of a fused projection's
 * outputs starts; B is block-diagonal over them (part p's rows of B are [p K / parts, (p + 1) K /
 * parts)), and the expand skips the zero blocks. Returns 0, -1 without memory for the grouping,
 * -2 for a slot outside [-1, S). */
static int lora_add_f32(float *y, const float *x, const float *a, const float *b, const int64_t *slots, int64_t T,
                        int64_t S, int64_t n_in, int64_t n_out, int64_t K, int64_t x_stride, int64_t y_stride,
                        const int64_t *out_offsets, int64_t parts, pool_runner *run, int64_t chunks)
{
    if (T == 0 || K == 0)
        return 0;
    for (int64_t p = 0; p < parts; p++)
        if (out_offsets[p] < 0 || out_offsets[p] > out_offsets[p + 1] || out_offsets[p + 1] > n_out)
            return -2;
    int64_t *group_start = calloc(S + 1, sizeof(int64_t));
    int64_t *order = malloc(T * sizeof(int64_t));
    if (!group_start || !order) {
        free(group_start), free(order);
        return -1;
    }
    for (int64_t t = 0; t < T; t++) {
        if (slots[t] >= S || slots[t] < -1) {
            free(group_start), free(order);
            return -2;
        }
        if (slots[t] >= 0)
            group_start[slots[t] + 1]++;
    }
    for (int64_t s = 0; s < S; s++)
        group_start[s + 1] += group_start[s];
    const int64_t rows = group_start[S];
    float *h = rows ? malloc(rows * K * sizeof(float)) : NULL;
    int64_t *next = malloc((S + 1) * sizeof(int64_t));
    if ((rows && !h) || !next) {
        free(group_start), free(order), free(h), free(next);
        return -1;
    }
    for (int64_t s = 0; s < S; s++)
        next[s] = group_start[s];
    for (int64_t t = 0; t < T; t++)
        if (slots[t] >= 0)
            order[next[slots[t]]++] = t;
    if (rows) {
        struct lora_job job = {y, h, x, a, b, order, group_start, out_offsets, S, parts, n_in, n_out, K,
                               x_stride, y_stride, 0};
        run(lora_shrink, &job, lora_split(&job, K, chunks, 2));
        run(lora_expand, &job, lora_split(&job, n_out, chunks, LORA_TILE));
    }
    free(group_start), free(order), free(h), free(next);
    return 0;
}

#endif
