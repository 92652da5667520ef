/* Sampling on CPU: a token per row of logits, drawn from the row's softmax by inverse CDF, or
 * the row's largest (greedy).
 *
 * Why compiled: the torch twin (sampler.inverse_cdf over a softmax) makes a softmax, a float64
 * copy and its cumulative sum, each a fresh array of the whole batch's vocabulary, and at a batch
 * of 32 over a 49k vocabulary that was a tenth of a served decode step. Here a row is two passes
 * over its logits and nothing of its size is written: its maximum, then e^(x - max) summed in
 * float64 per block of 64 tokens; the target u * total is found among the blocks' sums, and only
 * that block's weights are made again, summed one by one until they pass it.
 *
 * The weights are softmax's up to the normalisation, which the target scales instead. A token
 * masked to -inf weighs exactly 0, so it is never drawn; e^ is exp_clamped (shared_cpu.h), so a
 * token more than 87 below the row's maximum weighs e^-87 rather than less, which next to the
 * maximum's 1 is nothing. The twin's float32 softmax rounds differently in the last bits, so the
 * two can part only where u lands within rounding of a boundary between two tokens.
 */
#ifndef TRILLM_SAMPLING_CPU_H
#define TRILLM_SAMPLING_CPU_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "shared_cpu.h"

#define SAMPLE_BLOCK 64

static inline float sample_weight(float x, float max)
{
    const float e = exp_clamped(x - max); /* computed either way, so the loops stay branch-free */
    return x == -INFINITY ? 0.0f : e;
}

static inline float row_max(const float *x, int64_t V)
{
    float max = -INFINITY;
#pragma omp simd reduction(max : max)
    for (int64_t i = 0; i < V; i++) max = x[i] > max ? x[i] : max;
    return max;
}

/* out[r] for each of R rows of V logits (row r at logits + r * stride): the first token whose
 * cumulative weight exceeds uniform[r] (in [0, 1)) times the row's total. A row with every logit
 * -inf has no weight, and gets token 0. Returns 0, or -1 when out of memory. */
TRILLM_MULTIVERSION
static int sample_rows_f32(int64_t *out, const float *logits, const double *uniform, int64_t R, int64_t V,
                           int64_t stride)
{
    const int64_t blocks = (V + SAMPLE_BLOCK - 1) / SAMPLE_BLOCK;
    double *sums = malloc(sizeof(double) * (size_t)blocks);
    if (sums == NULL) return -1;
    for (int64_t r = 0; r < R; r++) {
        const float *x = logits + r * stride;
        const float max = row_max(x, V);
        out[r] = 0;
        if (max == -INFINITY) continue;
        double total = 0.0;
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t end = (b + 1) * SAMPLE_BLOCK < V ? (b + 1) * SAMPLE_BLOCK : V;
            /* the weights, then their sum: in one loop the compiler leaves the float64 sum scalar */
            float w[SAMPLE_BLOCK];
#pragma omp simd
            for (int64_t i = b * SAMPLE_BLOCK; i < end; i++) w[i - b * SAMPLE_BLOCK] = sample_weight(x[i], max);
            double sum = 0.0;
#pragma omp simd reduction(+ : sum)
            for (int64_t i = 0; i < end - b * SAMPLE_BLOCK; i++) sum += (double)w[i];
            sums[b] = sum;
            total += sum;
        }
        /* The blocks are walked in the order total was summed, so the walk reaches total, which
         * is above the target: some block passes it (the last, at the latest). */
        const double target = uniform[r] * total;
        double below = 0.0;
        int64_t b = 0;
        while (b < blocks - 1 && below + sums[b] <= target) below += sums[b++];
        /* Within the block the sum runs one by one and may round below the block's vector sum:
         * then the block's last token of any weight is the one. */
        const int64_t end = (b + 1) * SAMPLE_BLOCK < V ? (b + 1) * SAMPLE_BLOCK : V;
        for (int64_t i = b * SAMPLE_BLOCK; i < end; i++) {
            const float w = sample_weight(x[i], max);
            if (w == 0.0f) continue;
            out[r] = i;
            below += (double)w;
            if (below > target) break;
        }
    }
    free(sums);
    return 0;
}

/* out[r]: the first token of row r's largest logit, as torch's argmax (rows as above; NaN is
 * not looked for). Why: torch's argmax over a batch of 49k-token rows took as long as a draw. */
TRILLM_MULTIVERSION
static void argmax_rows_f32(int64_t *out, const float *logits, int64_t R, int64_t V, int64_t stride)
{
    for (int64_t r = 0; r < R; r++) {
        const float *x = logits + r * stride;
        const float max = row_max(x, V);
        int64_t i = 0;
        while (i < V - 1 && x[i] != max) i++;
        out[r] = i;
    }
}

#endif
