/* The grouped LoRA multiply on CPU, fp32: y[t] += B[s] (A[s] x[t]) for each row t whose slot s
 * is >= 0 (trillm/kernels/lora.py is the reference).
 *
 * A row at a time: the shrink h = A[s] x[t] reads A's K rows against one x row, then the expand
 * adds B[s] h to the row of y, each output a dot product over the K (small) columns of B. Both
 * inner loops run along contiguous memory and vectorize (`omp simd`). Rows are shared among the
 * pool's threads; each output is one row's own sum, so results do not depend on the threads.
 */
#ifndef TRILLM_LORA_CPU_H
#define TRILLM_LORA_CPU_H

#include <stdint.h>

#include "shared_cpu.h"

#define LORA_MAX_K 1024 /* the shrink's output lives on the stack */

static inline float lora_dot(const float *a, const float *b, int64_t n)
{
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; i++)
        sum += a[i] * b[i];
    return sum;
}

struct lora_job {
    float *y;
    const float *x, *a, *b;
    const int64_t *slots;
    int64_t T, n_in, n_out, K, x_stride, y_stride, rows_per_chunk;
};

static void lora_rows(void *ctx, int64_t chunk)
{
    const struct lora_job *job = ctx;
    const int64_t t0 = chunk * job->rows_per_chunk;
    const int64_t t1 = t0 + job->rows_per_chunk < job->T ? t0 + job->rows_per_chunk : job->T;
    float h[LORA_MAX_K];
    for (int64_t t = t0; t < t1; t++) {
        const int64_t s = job->slots[t];
        if (s < 0)
            continue;
        const float *x = job->x + t * job->x_stride;
        const float *a = job->a + s * job->K * job->n_in;
        const float *b = job->b + s * job->n_out * job->K;
        for (int64_t k = 0; k < job->K; k++)
            h[k] = lora_dot(a + k * job->n_in, x, job->n_in);
        float *y = job->y + t * job->y_stride;
        for (int64_t n = 0; n < job->n_out; n++)
            y[n] += lora_dot(b + n * job->K, h, job->K);
    }
}

/* Returns 0, or -1 when K is above LORA_MAX_K. */
static int lora_add_f32(float *y, const float *x, const float *a, const float *b, const int64_t *slots, int64_t T,
                        int64_t n_in, int64_t n_out, int64_t K, int64_t x_stride, int64_t y_stride, pool_runner *run,
                        int64_t chunks)
{
    if (K > LORA_MAX_K)
        return -1;
    if (T == 0)
        return 0;
    struct lora_job job = {y, x, a, b, slots, T, n_in, n_out, K, x_stride, y_stride, 0};
    job.rows_per_chunk = (T + chunks - 1) / chunks;
    run(lora_rows, &job, (T + job.rows_per_chunk - 1) / job.rows_per_chunk);
    return 0;
}

#endif
