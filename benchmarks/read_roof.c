/* The memory read roof a decode step streams its weights against: each OpenMP thread sums its
 * half (its share) of a buffer larger than every cache, with 32-byte loads, the best of N passes.
 * Build and run: gcc -O2 -mavx2 -fopenmp benchmarks/read_roof.c -o /tmp/read_roof &&
 * OMP_NUM_THREADS=2 OMP_PROC_BIND=true /tmp/read_roof [MiB] [passes]. Prints GB/s. */
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double seconds(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv)
{
    const size_t bytes = (size_t)(argc > 1 ? atol(argv[1]) : 1024) << 20;
    const int passes = argc > 2 ? atoi(argv[2]) : 20;
    char *buffer = aligned_alloc(64, bytes);
    if (buffer == NULL) return 1;
    memset(buffer, 1, bytes); /* every page resident before the first pass */
    double best = 1e30;
    long sink = 0;
    for (int pass = 0; pass < passes; pass++) {
        const double start = seconds();
#pragma omp parallel reduction(+ : sink)
        {
            const size_t share = bytes / omp_get_num_threads() / 128 * 128;
            const char *p = buffer + omp_get_thread_num() * share;
            __m256i a = _mm256_setzero_si256(), b = a, c = a, d = a; /* four chains: loads, not adds, bound it */
            for (size_t k = 0; k < share; k += 128) {
                a = _mm256_add_epi32(a, _mm256_load_si256((const __m256i *)(p + k)));
                b = _mm256_add_epi32(b, _mm256_load_si256((const __m256i *)(p + k + 32)));
                c = _mm256_add_epi32(c, _mm256_load_si256((const __m256i *)(p + k + 64)));
                d = _mm256_add_epi32(d, _mm256_load_si256((const __m256i *)(p + k + 96)));
            }
            int lanes[8];
            _mm256_storeu_si256((__m256i *)lanes, _mm256_add_epi32(_mm256_add_epi32(a, b), _mm256_add_epi32(c, d)));
            for (int i = 0; i < 8; i++) sink += lanes[i];
        }
        const double spent = seconds() - start;
        if (spent < best) best = spent;
    }
    printf("%zu MiB, %d threads: %.2f GB/s (%.2f ms a pass; sum %ld)\n", bytes >> 20, omp_get_max_threads(),
           bytes / best / 1e9, best * 1e3, sink);
    free(buffer);
    return 0;
}
