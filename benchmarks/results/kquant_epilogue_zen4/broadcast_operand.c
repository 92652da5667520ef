/* Does x's broadcast cost the int8 dot products a slot? Eight independent vpdpbusd a loop on
 * registers, after a vpbroadcastd from memory each (what gcc emits for the kernel's
 * _mm512_set1_epi32 operand), and with the broadcast embedded ({1to16}). Prints GOP/s. */
#include <stdio.h>
#include <stdint.h>
#include <time.h>
static int32_t words[64] __attribute__((aligned(64)));
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
#define R8(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7)
int main(void){
  const long it=50000000; long n; double t0,t; const int32_t *p=words;
  /* a: register operands */
  n=it; t0=now();
  __asm__ volatile("vpternlogd $0xff,%%zmm14,%%zmm14,%%zmm14\n vpternlogd $0xff,%%zmm15,%%zmm15,%%zmm15\n1:\n"
#define A(i) "vpdpbusd %%zmm14,%%zmm15,%%zmm" #i "\n"
    R8(A) "dec %0\n jnz 1b\n" : "+r"(n) :: "xmm0","xmm1","xmm2","xmm3","xmm4","xmm5","xmm6","xmm7","xmm14","xmm15","cc");
  t=now()-t0; printf("register:        %.1f GOP/s\n", it*8*128/t/1e9);
  /* b: vpbroadcastd from memory, then register vpdpbusd */
  n=it; t0=now();
  __asm__ volatile("vpternlogd $0xff,%%zmm15,%%zmm15,%%zmm15\n1:\n"
    "vpbroadcastd 0(%1),%%zmm16\n vpdpbusd %%zmm16,%%zmm15,%%zmm0\n"
    "vpbroadcastd 4(%1),%%zmm17\n vpdpbusd %%zmm17,%%zmm15,%%zmm1\n"
    "vpbroadcastd 8(%1),%%zmm18\n vpdpbusd %%zmm18,%%zmm15,%%zmm2\n"
    "vpbroadcastd 12(%1),%%zmm19\n vpdpbusd %%zmm19,%%zmm15,%%zmm3\n"
    "vpbroadcastd 16(%1),%%zmm20\n vpdpbusd %%zmm20,%%zmm15,%%zmm4\n"
    "vpbroadcastd 20(%1),%%zmm21\n vpdpbusd %%zmm21,%%zmm15,%%zmm5\n"
    "vpbroadcastd 24(%1),%%zmm22\n vpdpbusd %%zmm22,%%zmm15,%%zmm6\n"
    "vpbroadcastd 28(%1),%%zmm23\n vpdpbusd %%zmm23,%%zmm15,%%zmm7\n"
    "dec %0\n jnz 1b\n" : "+r"(n) : "r"(p) : "xmm0","xmm1","xmm2","xmm3","xmm4","xmm5","xmm6","xmm7","xmm15","xmm16","xmm17","xmm18","xmm19","xmm20","xmm21","xmm22","xmm23","cc","memory");
  t=now()-t0; printf("broadcast, then: %.1f GOP/s\n", it*8*128/t/1e9);
  /* c: embedded broadcast */
  n=it; t0=now();
  __asm__ volatile("vpternlogd $0xff,%%zmm15,%%zmm15,%%zmm15\n1:\n"
#define C(i) "vpdpbusd " #i "*4(%1)%{1to16%},%%zmm15,%%zmm" #i "\n"
    R8(C) "dec %0\n jnz 1b\n" : "+r"(n) : "r"(p) : "xmm0","xmm1","xmm2","xmm3","xmm4","xmm5","xmm6","xmm7","xmm15","cc","memory");
  t=now()-t0; printf("embedded {1to16}: %.1f GOP/s\n", it*8*128/t/1e9);
  return 0;
}
