/* What the compiled CPU kernels (attention_cpu.h, ops_cpu.h) share: their multiversioning, and
 * an e^x in plain arithmetic the compiler vectorizes (a libm expf is a call per element: in
 * decode attention's softmax it was a fifth of the kernel's time).
 */
#ifndef TRILLM_SHARED_CPU_H
#define TRILLM_SHARED_CPU_H

#include <stdint.h>

#if defined(__GNUC__) && defined(__x86_64__) && !defined(__clang__)
/* One build runs on any x86-64; the loader picks the widest vector unit this CPU has. */
#define TRILLM_MULTIVERSION __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define TRILLM_MULTIVERSION
#endif

/* e^x within 2 ulp of expf on [-87, 88]; x is clamped there (below -87 the result would be
 * subnormal, which next to a softmax's largest term, e^0, or to SiLU's 1 is nothing).
 * x = n ln2 + r with |r| <= ln2 / 2, e^r by Cephes' degree-6 polynomial, 2^n put into the
 * exponent bits. */
static inline float exp_clamped(float x)
{
    x = x < -87.0f ? -87.0f : x > 88.0f ? 88.0f : x;
    /* round to nearest: adding and taking away 1.5 * 2^23 drops the fraction */
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const float er = p * r * r + r + 1.0f;
    const union { int32_t bits; float value; } scale = {.bits = ((int32_t)n + 127) << 23};
    return er * scale.value;
}

#endif
