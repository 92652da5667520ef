/* The AMX tiles' int8 roof of one core: independent tdpbsud into four C tiles from one A and one
 * B tile, nothing loaded or stored in the loop. Built and run by bench_projections.py (gcc,
 * x86-64 with AMX-INT8, Linux granting the tiles' state). Prints GOP/s, one multiply and one
 * add per byte product, or nothing (exit 1) where the tiles are refused. */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

struct shapes {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes[16];
    uint8_t rows[16];
};

__attribute__((target("amx-tile,amx-int8"))) int main(void)
{
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) != 0) return 1;
    struct shapes shapes;
    memset(&shapes, 0, sizeof(shapes));
    shapes.palette = 1;
    for (int tile = 0; tile < 6; tile++) shapes.rows[tile] = 16, shapes.bytes[tile] = 64;
    _tile_loadconfig(&shapes);
    static int8_t ones[16 * 64] __attribute__((aligned(64)));
    memset(ones, 1, sizeof(ones));
    _tile_loadd(4, ones, 64);
    _tile_loadd(5, ones, 64);
    const long iterations = 10000000;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (long i = 0; i < iterations; i++) {
        _tile_dpbsud(0, 4, 5);
        _tile_dpbsud(1, 4, 5);
        _tile_dpbsud(2, 4, 5);
        _tile_dpbsud(3, 4, 5);
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    _tile_release();
    const double seconds = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) * 1e-9;
    printf("%.1f\n", (double)iterations * 4 * 16 * 16 * 64 * 2 / seconds / 1e9);
    return 0;
}
