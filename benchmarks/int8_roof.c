/* The int8 roof of one core: independent vpdpbusd on registers only, nothing loaded or stored.
 * Built and run by bench_quant_cpu.py (gcc, x86-64 with AVX512-VNNI). Prints GOP/s, one
 * multiply and one add per byte product. */
#include <stdio.h>
#include <time.h>

int main(void)
{
    const long iterations = 100000000;
    long n = iterations;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    __asm__ volatile(
        "vpternlogd $0xff, %%zmm14, %%zmm14, %%zmm14\n"
        "vpternlogd $0xff, %%zmm15, %%zmm15, %%zmm15\n"
        "1:\n"
        "vpdpbusd %%zmm14, %%zmm15, %%zmm0\n vpdpbusd %%zmm14, %%zmm15, %%zmm1\n"
        "vpdpbusd %%zmm14, %%zmm15, %%zmm2\n vpdpbusd %%zmm14, %%zmm15, %%zmm3\n"
        "vpdpbusd %%zmm14, %%zmm15, %%zmm4\n vpdpbusd %%zmm14, %%zmm15, %%zmm5\n"
        "vpdpbusd %%zmm14, %%zmm15, %%zmm6\n vpdpbusd %%zmm14, %%zmm15, %%zmm7\n"
        "vpdpbusd %%zmm14, %%zmm15, %%zmm8\n vpdpbusd %%zmm14, %%zmm15, %%zmm9\n"
        "vpdpbusd %%zmm14, %%zmm15, %%zmm10\n vpdpbusd %%zmm14, %%zmm15, %%zmm11\n"
        "dec %0\n jnz 1b\n"
        : "+r"(n)::"xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10",
          "xmm11", "xmm14", "xmm15", "cc");
    clock_gettime(CLOCK_MONOTONIC, &t1);
    const double seconds = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) * 1e-9;
    printf("%.1f\n", (double)iterations * 12 * 64 * 2 / seconds / 1e9);
    return 0;
}
