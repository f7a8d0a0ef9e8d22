/* How many 512-bit VNNI products (vpdpbusd zmm) and fp32 multiply-adds (vfmadd231ps zmm) one core retires a
 * nanosecond: 12 independent accumulators, so the rate is the units' throughput, not a dependency chain's latency
 * (the instructions are written out: a compiler may fold a loop of intrinsics). One thread; an x86-64 CPU with
 * AVX-512 VNNI.
 *
 *     gcc -O2 -march=native studies/vnni_rate.c -o /tmp/vnni_rate && /tmp/vnni_rate
 *
 * Figures: docs/quantized.md ("What a verified row costs"). */
#include <stdio.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

#define TWELVE(op)                                                                                            \
    op " %%zmm30,%%zmm31,%%zmm0\n\t" op " %%zmm30,%%zmm31,%%zmm1\n\t" op " %%zmm30,%%zmm31,%%zmm2\n\t"           \
    op " %%zmm30,%%zmm31,%%zmm3\n\t" op " %%zmm30,%%zmm31,%%zmm4\n\t" op " %%zmm30,%%zmm31,%%zmm5\n\t"           \
    op " %%zmm30,%%zmm31,%%zmm6\n\t" op " %%zmm30,%%zmm31,%%zmm7\n\t" op " %%zmm30,%%zmm31,%%zmm8\n\t"           \
    op " %%zmm30,%%zmm31,%%zmm9\n\t" op " %%zmm30,%%zmm31,%%zmm10\n\t" op " %%zmm30,%%zmm31,%%zmm11\n\t"
#define CLOBBER "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11"

int main(void) {
    const long n = 100000000;
    long chain = 0;
    double t = now();
    for (long i = 0; i < n; i++)
        __asm__ volatile("add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0" : "+r"(chain));
    const double add_ns = (now() - t) / (n * 4.0) * 1e9; /* one dependent add a cycle: the clock */
    t = now();
    for (long i = 0; i < n; i++) __asm__ volatile(TWELVE("vpdpbusd") ::: CLOBBER);
    const double dp_ns = (now() - t) / (n * 12.0) * 1e9;
    t = now();
    for (long i = 0; i < n; i++) __asm__ volatile(TWELVE("vfmadd231ps") ::: CLOBBER);
    const double fma_ns = (now() - t) / (n * 12.0) * 1e9;
    printf("clock about %.2f GHz (dependent adds)\n", 1.0 / add_ns);
    printf("vpdpbusd zmm: %.3f ns each, %.2f cycles\n", dp_ns, dp_ns / add_ns);
    printf("vfmadd231ps zmm: %.3f ns each, %.2f cycles\n", fma_ns, fma_ns / add_ns);
    return 0;
}
