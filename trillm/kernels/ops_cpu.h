/* The model's per-token ops on CPU, fp32: RMSNorm (alone and after the residual add), SiLU-and-mul,
 * the rotary embedding and the KV-cache write.
 *
 * Why compiled: each is a few passes of torch ops over the activations (RMSNorm alone is square,
 * mean, add, rsqrt and two multiplies), and on CPU a step spent about as much on those passes as
 * on the attention math: in a prefill, the passes over the activations, and at decode batch
 * sizes mostly the per-op cost, 150 ops a step for the KV writes alone. Here each op is one pass in one call, with
 * the GIL released. Their references are the torch twins (norm.py, activation.py, rotary.py,
 * cache.py); the sums and the exp may round differently in their last bits.
 *
 * Rows may be strided (row_stride floats apart, each row contiguous), so q and k are rotated in
 * place inside the fused q|k|v projection's output, as the twins do. Each op's *_pooled form cuts
 * its rows among the kernels' pool (shared_cpu.h's rows_run); every row is computed the same
 * whichever thread takes it.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "shared_cpu.h"

/* out[t] = x[t] * rsqrt(mean(x[t]^2) + eps) * weight, for T rows of `size`. When residual is not
 * NULL, x[t] + residual[t] is normed instead, and also written to sum_out (the next residual). */
TRILLM_MULTIVERSION
static void rms_norm_f32(float *restrict out, float *restrict sum_out, const float *restrict x,
                         const float *restrict residual, const float *restrict weight, int64_t T, int64_t size,
                         int64_t x_stride, float eps)
{
    for (int64_t t = 0; t < T; t++) {
        const float *xt = x + t * x_stride;
        float *ot = out + t * size;
        if (residual != NULL) {
            float *st = sum_out + t * size;
            const float *rt = residual + t * size;
#pragma omp simd
            for (int64_t i = 0; i < size; i++) st[i] = xt[i] + rt[i];
            xt = st;
        }
        float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
        for (int64_t i = 0; i < size; i++) squares += xt[i] * xt[i];
        const float rstd = 1.0f / sqrtf(squares / (float)size + eps);
#pragma omp simd
        for (int64_t i = 0; i < size; i++) ot[i] = xt[i] * rstd * weight[i];
    }
}

/* out[t][i] = silu(x[t][i]) * x[t][inter + i], x: [T, 2 * inter] holding gate | up. */
TRILLM_MULTIVERSION
static void silu_and_mul_f32(float *restrict out, const float *restrict x, int64_t T, int64_t inter)
{
    for (int64_t t = 0; t < T; t++) {
        const float *gate = x + t * 2 * inter, *up = gate + inter;
        float *ot = out + t * inter;
#pragma omp simd
        for (int64_t i = 0; i < inter; i++) ot[i] = gate[i] / (1.0f + exp_clamped(-gate[i])) * up[i];
    }
}

/* out[t][i] = gelu_tanh(x[t][i]) * x[t][inter + i], x: [T, 2 * inter] holding gate | up: GELU in
 * its tanh approximation, 0.5 g (1 + tanh(u)) = g sigmoid(2 u) with u = sqrt(2 / pi) (g + 0.044715
 * g^3), as the Triton kernel computes it (no tanh instruction). */
TRILLM_MULTIVERSION
static void gelu_tanh_and_mul_f32(float *restrict out, const float *restrict x, int64_t T, int64_t inter)
{
    for (int64_t t = 0; t < T; t++) {
        const float *gate = x + t * 2 * inter, *up = gate + inter;
        float *ot = out + t * inter;
#pragma omp simd
        for (int64_t i = 0; i < inter; i++) {
            const float g = gate[i], u = 0.7978845608028654f * (g + 0.044715f * g * g * g);
            ot[i] = g / (1.0f + exp_clamped(-2.0f * u)) * up[i];
        }
    }
}

/* Rotates the `heads` heads of token t (head_dim floats each, the token's row starting at
 * x + t * row_stride) by position positions[t]: cos_sin holds cos | sin, head_dim / 2 each, for
 * each position, which must be in the table (rotary_embedding_pooled checks). neox pairs element
 * i with i + head_dim / 2; otherwise (GPT-J) 2i with 2i + 1. */
TRILLM_MULTIVERSION
static void rotary_embedding_f32(float *restrict x, const int64_t *restrict positions, const float *restrict cos_sin,
                                 int64_t T, int64_t heads, int64_t head_dim, int64_t row_stride, int neox)
{
    const int64_t half = head_dim / 2;
    for (int64_t t = 0; t < T; t++) {
        const float *cos = cos_sin + positions[t] * head_dim, *sin = cos + half;
        for (int64_t h = 0; h < heads; h++) {
            float *xh = x + t * row_stride + h * head_dim;
            if (neox) {
                float *x1 = xh, *x2 = xh + half;
#pragma omp simd
                for (int64_t i = 0; i < half; i++) {
                    const float a = x1[i], b = x2[i];
                    x1[i] = a * cos[i] - b * sin[i];
                    x2[i] = b * cos[i] + a * sin[i];
                }
            } else {
                for (int64_t i = 0; i < half; i++) {
                    const float a = xh[2 * i], b = xh[2 * i + 1];
                    xh[2 * i] = a * cos[i] - b * sin[i];
                    xh[2 * i + 1] = b * cos[i] + a * sin[i];
                }
            }
        }
    }
}

/* The rows of token t (num_kv_heads * head_dim floats, at k + t * k_stride and v + t * v_stride)
 * into cache slot slots[t] of each cache ([num_slots, num_kv_heads, kv_row_width] of `kind`
 * (enum kv_cache_kind): fp32 copied, fp16 rounded to nearest even, int8 quantized per head, the
 * keys rotated first); a negative slot (padding) is skipped, and every other must be in the cache
 * (write_kv_pooled checks). */
static void write_kv(void *restrict k_cache, void *restrict v_cache, int kind, const float *restrict k,
                     const float *restrict v, const int64_t *restrict slots, int64_t T, int64_t num_kv_heads,
                     int64_t head_dim, int64_t k_stride, int64_t v_stride)
{
    f16_narrow_fn *narrow = kind == KV_CACHE_F16 ? pick_f16_narrow() : NULL;
    const int64_t row_size = num_kv_heads * head_dim, row_width = kv_row_width(kind, head_dim);
    float key[head_dim]; /* an int8 cache's key row, rotated (kv_rotate) before it is quantized */
    for (int64_t t = 0; t < T; t++) {
        if (slots[t] < 0) continue;
        if (kind == KV_CACHE_I8) {
            for (int64_t h = 0; h < num_kv_heads; h++) {
                const int64_t row = (slots[t] * num_kv_heads + h) * row_width;
                memcpy(key, k + t * k_stride + h * head_dim, sizeof(float) * (size_t)head_dim);
                kv_rotate(key, head_dim);
                kv_quantize_row((int8_t *)k_cache + row, key, head_dim);
                kv_quantize_row((int8_t *)v_cache + row, v + t * v_stride + h * head_dim, head_dim);
            }
        } else if (narrow != NULL) {
            narrow((uint16_t *)k_cache + slots[t] * row_size, k + t * k_stride, row_size);
            narrow((uint16_t *)v_cache + slots[t] * row_size, v + t * v_stride, row_size);
        } else {
            memcpy((float *)k_cache + slots[t] * row_size, k + t * k_stride, sizeof(float) * (size_t)row_size);
            memcpy((float *)v_cache + slots[t] * row_size, v + t * v_stride, sizeof(float) * (size_t)row_size);
        }
    }
}


struct rms_norm_args {
    float *out, *sum_out;
    const float *x, *residual, *weight;
    int64_t size, x_stride;
    float eps;
};

static void rms_norm_rows(const void *args, int64_t t0, int64_t t1)
{
    const struct rms_norm_args *a = args;
    rms_norm_f32(a->out + t0 * a->size, a->sum_out == NULL ? NULL : a->sum_out + t0 * a->size, a->x + t0 * a->x_stride,
                 a->residual == NULL ? NULL : a->residual + t0 * a->size, a->weight, t1 - t0, a->size, a->x_stride,
                 a->eps);
}

/* rms_norm_f32 on the pool (rows_run). */
static void rms_norm_pooled(pool_runner *run, int64_t chunks, float *out, float *sum_out, const float *x,
                            const float *residual, const float *weight, int64_t T, int64_t size, int64_t x_stride,
                            float eps)
{
    const struct rms_norm_args a = {out, sum_out, x, residual, weight, size, x_stride, eps};
    rows_run(run, chunks, rms_norm_rows, &a, T, size);
}

struct act_and_mul_args {
    float *out;
    const float *x;
    int64_t inter;
    int gelu;
};

static void act_and_mul_rows(const void *args, int64_t t0, int64_t t1)
{
    const struct act_and_mul_args *a = args;
    if (a->gelu)
        gelu_tanh_and_mul_f32(a->out + t0 * a->inter, a->x + t0 * 2 * a->inter, t1 - t0, a->inter);
    else
        silu_and_mul_f32(a->out + t0 * a->inter, a->x + t0 * 2 * a->inter, t1 - t0, a->inter);
}

/* silu_and_mul_f32, or gelu_tanh_and_mul_f32 where `gelu`, on the pool (rows_run). */
static void act_and_mul_pooled(pool_runner *run, int64_t chunks, float *out, const float *x, int64_t T, int64_t inter,
                               int gelu)
{
    const struct act_and_mul_args a = {out, x, inter, gelu};
    rows_run(run, chunks, act_and_mul_rows, &a, T, 3 * inter);
}

struct rotary_args {
    float *x;
    const int64_t *positions;
    const float *cos_sin;
    int64_t heads, head_dim, row_stride;
    int neox;
};

static void rotary_rows(const void *args, int64_t t0, int64_t t1)
{
    const struct rotary_args *a = args;
    rotary_embedding_f32(a->x + t0 * a->row_stride, a->positions + t0, a->cos_sin, t1 - t0, a->heads, a->head_dim,
                         a->row_stride, a->neox);
}

/* rotary_embedding_f32 on the pool (rows_run), the table holding max_positions positions.
 * Returns 0, or -1 (rotating nothing) when a position is past the table: every position is
 * checked before any piece runs. */
static int rotary_embedding_pooled(pool_runner *run, int64_t chunks, float *x, const int64_t *positions,
                                   const float *cos_sin, int64_t max_positions, int64_t T, int64_t heads,
                                   int64_t head_dim, int64_t row_stride, int neox)
{
    for (int64_t t = 0; t < T; t++)
        if (positions[t] < 0 || positions[t] >= max_positions) return -1;
    const struct rotary_args a = {x, positions, cos_sin, heads, head_dim, row_stride, neox};
    rows_run(run, chunks, rotary_rows, &a, T, heads * head_dim);
    return 0;
}

struct write_kv_args {
    void *k_cache, *v_cache;
    int kind;
    const float *k, *v;
    const int64_t *slots;
    int64_t num_kv_heads, head_dim, k_stride, v_stride;
};

static void write_kv_rows(const void *args, int64_t t0, int64_t t1)
{
    const struct write_kv_args *a = args;
    write_kv(a->k_cache, a->v_cache, a->kind, a->k + t0 * a->k_stride, a->v + t0 * a->v_stride, a->slots + t0, t1 - t0,
             a->num_kv_heads, a->head_dim, a->k_stride, a->v_stride);
}

/* write_kv on the pool (rows_run), each cache holding num_slots slots. Returns 0, or -1 (writing
 * nothing) when a slot is past the cache: every slot is checked before any piece runs. Rows go to
 * distinct slots (a negative one is skipped), so the pieces never write the same. */
static int write_kv_pooled(pool_runner *run, int64_t chunks, void *k_cache, void *v_cache, int kind, const float *k,
                           const float *v, const int64_t *slots, int64_t T, int64_t num_slots, int64_t num_kv_heads,
                           int64_t head_dim, int64_t k_stride, int64_t v_stride)
{
    for (int64_t t = 0; t < T; t++)
        if (slots[t] >= num_slots) return -1;
    const struct write_kv_args a = {k_cache, v_cache, kind, k, v, slots, num_kv_heads, head_dim, k_stride, v_stride};
    rows_run(run, chunks, write_kv_rows, &a, T, 2 * num_kv_heads * head_dim);
    return 0;
}
