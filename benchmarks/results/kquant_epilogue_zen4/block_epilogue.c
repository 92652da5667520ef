/* What a K-quant block's epilogue costs beside its eight vpdpbusd: one row's dot halves added,
 * times the block's factors (vpmulld; vpmaddwd and an fp32 convert and fma for comparison), added
 * to its sum; and Q6_K's, each half times its own factor (two vpmulld; two converts and fmas for
 * comparison). Prints ns a loop. */
#include <stdio.h>
#include <time.h>
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
/* one timed loop: eight independent vpdpbusd, then EPILOGUE (asm text, may be empty) */
#define TIMED(LABEL, EPILOGUE) do { \
  long n = it; const double t0 = now(); \
  __asm__ volatile("vpternlogd $0xff,%%zmm14,%%zmm14,%%zmm14\n vpternlogd $0xff,%%zmm15,%%zmm15,%%zmm15\n1:\n" \
    "vpdpbusd %%zmm14,%%zmm15,%%zmm0\n vpdpbusd %%zmm14,%%zmm15,%%zmm1\n vpdpbusd %%zmm14,%%zmm15,%%zmm2\n vpdpbusd %%zmm14,%%zmm15,%%zmm3\n" \
    "vpdpbusd %%zmm14,%%zmm15,%%zmm4\n vpdpbusd %%zmm14,%%zmm15,%%zmm5\n vpdpbusd %%zmm14,%%zmm15,%%zmm6\n vpdpbusd %%zmm14,%%zmm15,%%zmm7\n" \
    EPILOGUE "dec %0\n jnz 1b\n" : "+r"(n) :: "xmm0","xmm1","xmm2","xmm3","xmm4","xmm5","xmm6","xmm7","xmm8","xmm9","xmm10","xmm11","xmm12","xmm14","xmm15","cc"); \
  printf("%-26s %.2f ns/iter\n", LABEL ":", (now() - t0) / it * 1e9); } while (0)
int main(void){
  const long it=50000000;
  TIMED("8 dpbusd", "");
  TIMED("8 dpbusd + add,mulld,add", "vpaddd %%zmm14,%%zmm15,%%zmm8\n vpmulld %%zmm14,%%zmm8,%%zmm9\n vpaddd %%zmm9,%%zmm10,%%zmm10\n");
  TIMED("8 dpbusd + add,maddwd,add", "vpaddd %%zmm14,%%zmm15,%%zmm8\n vpmaddwd %%zmm14,%%zmm8,%%zmm9\n vpaddd %%zmm9,%%zmm10,%%zmm10\n");
  TIMED("8 dpbusd + add,cvt,fma", "vpaddd %%zmm14,%%zmm15,%%zmm8\n vcvtdq2ps %%zmm8,%%zmm9\n vfmadd231ps %%zmm9,%%zmm14,%%zmm10\n");
  TIMED("8 dpbusd + 2 mulld,2 add", "vpmulld %%zmm14,%%zmm15,%%zmm8\n vpmulld %%zmm15,%%zmm14,%%zmm9\n"
        "vpaddd %%zmm8,%%zmm9,%%zmm8\n vpaddd %%zmm8,%%zmm10,%%zmm10\n");
  /* two sums, one a half, as a kernel of eight rows would have them in flight */
  TIMED("8 dpbusd + 2 cvt,2 fma", "vcvtdq2ps %%zmm14,%%zmm8\n vcvtdq2ps %%zmm15,%%zmm11\n"
        "vfmadd231ps %%zmm8,%%zmm15,%%zmm10\n vfmadd231ps %%zmm11,%%zmm14,%%zmm12\n");
  return 0;
}
