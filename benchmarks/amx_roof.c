/* The AMX tiles' int8 roof of one core: independent tdpbsud into four C tiles from one A and one
 * B tile, nothing loaded or stored in the loop, the tiles asked for and shaped as the integer
 * kernel does (trillm/kernels/quant_amx_cpu.h: 16 rows of 64 bytes each). Built and run by
 * bench_projections.py (gcc, x86-64 with AMX-INT8, Linux granting the tiles' state). Prints
 * GOP/s, one multiply and one add per byte product, or nothing (exit 1) where the tiles are
 * refused. */
#include <stdio.h>
#include <time.h>

#include "../trillm/kernels/quant_int8_cpu.h"

__attribute__((target("amx-tile,amx-int8"))) int main(void)
{
    if (!int8_amx_granted()) return 1;
    int8_amx_shape(INT8_AMX_ROWS, 2 * INT8_BLOCK); /* every tile 16 x 64 bytes: any serves as C, A or B */
    static int8_t ones[INT8_AMX_ROWS * 2 * INT8_BLOCK] __attribute__((aligned(64)));
    memset(ones, 1, sizeof(ones));
    _tile_loadd(INT8_AMX_B, ones, 2 * INT8_BLOCK);
    _tile_loadd(INT8_AMX_B_UPPER, ones, 2 * INT8_BLOCK);
    const long iterations = 10000000;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (long i = 0; i < iterations; i++) {
        _tile_dpbsud(INT8_AMX_C, INT8_AMX_B, INT8_AMX_B_UPPER);
        _tile_dpbsud(INT8_AMX_C_UPPER, INT8_AMX_B, INT8_AMX_B_UPPER);
        _tile_dpbsud(INT8_AMX_A, INT8_AMX_B, INT8_AMX_B_UPPER);
        _tile_dpbsud(INT8_AMX_A_UPPER, INT8_AMX_B, INT8_AMX_B_UPPER);
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    _tile_release();
    const double seconds = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) * 1e-9;
    printf("%.1f\n", (double)iterations * 4 * INT8_AMX_ROWS * INT8_TILE_N * 2 * INT8_BLOCK * 2 / seconds / 1e9);
    return 0;
}
