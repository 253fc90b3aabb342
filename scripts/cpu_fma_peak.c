/* This CPU's float32 FMA peak: the hardware's ceiling on any dot, to hold the measured dense
 * dots (and a training step's FLOP rate) against. Each thread runs 12 independent chains of
 * fused multiply-adds on full vector registers, enough to cover the FMA latency on every
 * pipe of an AVX2 or AVX-512 core, and touches no memory; the figure is FLOP/s (an FMA is 2).
 * Where the CPU has AVX512-BF16 (and -march=native sees it) it then measures the bfloat16 dot
 * peak the same way: chains of VDPBF16PS, each adding two bfloat16 products into every float32
 * lane (4 FLOP per lane), the ceiling on a bfloat16 x bfloat16 -> float32 matmul.
 *
 *   cc -O2 -march=native -pthread scripts/cpu_fma_peak.c -o /tmp/cpu_fma_peak && /tmp/cpu_fma_peak
 *
 * -march=native picks the widest vectors the host exposes (AVX-512 where the guest sees it,
 * else AVX2 + FMA). Arguments: [threads (default: the online CPUs)] [iterations (400000000)].
 * Prints one thread alone, then all threads at once, three rounds; the best round counts.
 * docs/performance.md records what it read on the 2-core hosts this project runs on. */
#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#if defined(__AVX512F__)
typedef __m512 vec;
#define LANES 16
#define SET1 _mm512_set1_ps
#define FMA _mm512_fmadd_ps
#define ISA "AVX-512"
#elif defined(__FMA__)
typedef __m256 vec;
#define LANES 8
#define SET1 _mm256_set1_ps
#define FMA _mm256_fmadd_ps
#define ISA "AVX2+FMA"
#else
#error "needs FMA: compile with -march=native on an x86-64 CPU with FMA (or -mavx2 -mfma)"
#endif

#define CHAINS 12

static long iterations = 400000000L;

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}

/* Keeps the chains live after their loop: the compiler must not drop it. */
static void keep_live(const vec acc[CHAINS]) {
  float sink[LANES] __attribute__((aligned(64)));
  float total = 0.0f;
  for (int i = 0; i < CHAINS; i++) {
    *(vec *)sink = acc[i];
    total += sink[0];
  }
  if (total == 12345.0f) puts("");
}

/* GFLOP/s of one thread's FMA chains. */
static double chains(void) {
  vec acc[CHAINS];
  const vec mul = SET1(0.999f), add = SET1(0.001f);
  for (int i = 0; i < CHAINS; i++) acc[i] = SET1((float)i);
  const double t0 = now();
  for (long k = 0; k < iterations; k++) {
#pragma GCC unroll 12
    for (int i = 0; i < CHAINS; i++) acc[i] = FMA(acc[i], mul, add);
  }
  const double dt = now() - t0;
  keep_live(acc);
  return (double)iterations * CHAINS * LANES * 2 / dt / 1e9;
}

#if defined(__AVX512BF16__)
/* GFLOP/s of one thread's bfloat16 dot-product chains (VDPBF16PS). AVX512-BF16 implies
 * AVX-512F, so `vec` is __m512 here. */
static double bf16_chains(void) {
  vec acc[CHAINS];
  const __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80), b = (__m512bh)_mm512_set1_epi16(0x3a83);
  for (int i = 0; i < CHAINS; i++) acc[i] = SET1((float)i);
  const double t0 = now();
  for (long k = 0; k < iterations; k++) {
#pragma GCC unroll 12
    for (int i = 0; i < CHAINS; i++) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
  }
  const double dt = now() - t0;
  keep_live(acc);
  return (double)iterations * CHAINS * LANES * 4 / dt / 1e9;
}
#endif

static double (*kernel)(void) = chains;

static void *thread_main(void *out) {
  *(double *)out = kernel();
  return NULL;
}

/* Three rounds of one thread alone, then all at once; prints each and the best of both. */
static void measure(const char *what, long threads, pthread_t *ids, double *rates) {
  double best_one = 0, best_all = 0;
  for (int round = 0; round < 3; round++) {
    const double one = kernel();
    for (long i = 0; i < threads; i++) pthread_create(&ids[i], NULL, thread_main, &rates[i]);
    double all = 0;
    for (long i = 0; i < threads; i++) {
      pthread_join(ids[i], NULL);
      all += rates[i];
    }
    printf("round %d: 1 thread %.1f GFLOP/s, all %ld at once %.1f GFLOP/s\n", round + 1, one,
           threads, all);
    if (one > best_one) best_one = one;
    if (all > best_all) best_all = all;
  }
  printf("%s peak: 1 thread %.1f GFLOP/s, all %ld at once %.1f GFLOP/s\n", what, best_one,
         threads, best_all);
}

int main(int argc, char **argv) {
  if (argc > 3) {
    fprintf(stderr, "usage: %s [threads] [iterations]; got %d arguments\n", argv[0], argc - 1);
    return 2;
  }
  long threads = sysconf(_SC_NPROCESSORS_ONLN);
  if (argc > 1) threads = strtol(argv[1], NULL, 10);
  if (argc > 2) iterations = strtol(argv[2], NULL, 10);
  if (threads < 1 || threads > 1024 || iterations < 1) {
    fprintf(stderr, "usage: %s [threads 1..1024] [iterations >= 1]; got threads=%ld "
            "iterations=%ld\n", argv[0], threads, iterations);
    return 2;
  }
  pthread_t *ids = malloc(threads * sizeof *ids);
  double *rates = malloc(threads * sizeof *rates);
  printf("%s, %d float32 lanes, %d chains per thread\n", ISA, LANES, CHAINS);
  measure("fma", threads, ids, rates);
#if defined(__AVX512BF16__)
  printf("AVX512-BF16 VDPBF16PS, 16 float32 lanes, %d chains per thread\n", CHAINS);
  kernel = bf16_chains;
  measure("bf16 dot", threads, ids, rates);
#else
  puts("this build has no AVX512-BF16 (not in -march=native here): no bf16 dot peak");
#endif
  free(ids);
  free(rates);
  return 0;
}
