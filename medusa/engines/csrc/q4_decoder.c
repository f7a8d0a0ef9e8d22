/* The native decoder: one forward of M new tokens of one sequence through a Llama-family decoder whose linear
 * layers hold int4 group-wise codes, in fp32, or with each product's input rounded to int8 blocks (the VNNI products
 * below), or fp32 weights (the engine "native": the fp32 model itself, docs/engines.md); and the lm_head from a
 * GGUF's Q8_0 blocks or fp32 weights (medusa/engines/native.py drives it; docs/quantized.md).
 *
 * Weights: W[n, k] = q[n, k] * d[n, g] + m[n, g] (g = k / 32, q in 0..15; GGUF Q4_1's formula). codes: (N, K / 2)
 * bytes, byte j < 16 of group g holding q[32 g + j] (low nibble) and q[32 g + 16 + j] (high nibble); d, m: (N, K / 32).
 *
 * Row invariance (why Medusa through this decoder equals plain decoding through it): every value of row i (its
 * products, norms, rotary, attention over the keys it may see, in slot order) is computed by the same instructions
 * in the same order whatever the other rows are, how many there are, and which thread runs it. No reduction is
 * split across threads, and this file is compiled with -ffp-contract=off so the compiler fuses nothing by itself.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
/* Ask for the 64-byte line holding p to be brought into the L2 cache (a hint: it never faults, whatever p). The
 * products ask for their weights a few KB ahead of the pass: the hardware prefetcher alone did not keep ahead of
 * products with arithmetic to do per weight (docs/engines.md, "Several rows at the price of one"). */
#define ASK_L2(p) _mm_prefetch((const char *)(p), _MM_HINT_T1)
#endif

#if defined(__AVX2__) && defined(__FMA__)
/* The 8 lanes of a summed in one fixed order (the AVX2 products' last step). */
static inline float sum8(__m256 a) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}
#endif

#define ROWS 4     /* rows of a product computed together (the weights are unpacked once for them) */
#define CHANNELS 4 /* output channels computed together (independent accumulators) */
#define Q4_AHEAD 4096 /* bytes of the codes (a quarter of that of the scales) asked for ahead, into L2 */

#if defined(ASK_L2)
/* The four channels' codes, scales and offsets Q4_AHEAD bytes beyond group g, one request a 64-byte line: codes
 * every 4th group (16 bytes a group), scales and offsets every 16th (4 bytes). */
static inline __attribute__((always_inline)) void q4_ask_ahead(const uint8_t *codes, const float *d, const float *m,
                                                               int64_t groups, int64_t g) {
    if (g & 3) return;
    for (int c = 0; c < CHANNELS; c++) ASK_L2(codes + (c * groups + g) * 16 + Q4_AHEAD);
    if (g & 15) return;
    for (int c = 0; c < CHANNELS; c++) {
        ASK_L2(d + c * groups + g + Q4_AHEAD / 16);
        ASK_L2(m + c * groups + g + Q4_AHEAD / 16);
    }
}
#endif

const char *medusa_q4_isa(void) {
#if defined(__AVX512F__)
    return "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
    return "avx2";
#else
    return "scalar";
#endif
}

/* y[r, n + c] (= or +=) for rows [r0, r0 + rows) and channels [n, n + CHANNELS). */
static void q4_block(const float *x, int64_t K, const uint8_t *codes, const float *d, const float *m, float *y,
                     int64_t N, int64_t n, int64_t r0, int rows, int add) {
    const int64_t groups = K / 32;
    float out[ROWS][CHANNELS];
#if defined(__AVX512F__)
    __m512 acc[ROWS][CHANNELS];
    for (int i = 0; i < rows; i++)
        for (int c = 0; c < CHANNELS; c++) acc[i][c] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi32(15);
    for (int64_t g = 0; g < groups; g++) {
        __m512 w[CHANNELS][2];
        q4_ask_ahead(codes, d, m, groups, g);
        for (int c = 0; c < CHANNELS; c++) {
            __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(codes + (c * groups + g) * 16)));
            __m512 dg = _mm512_set1_ps(d[c * groups + g]), mg = _mm512_set1_ps(m[c * groups + g]);
            w[c][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(b, low)), dg, mg);
            w[c][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)), dg, mg);
        }
        const float *xg = x + r0 * K + g * 32;
        for (int i = 0; i < rows; i++) {
            __m512 x0 = _mm512_loadu_ps(xg + i * K), x1 = _mm512_loadu_ps(xg + i * K + 16);
            for (int c = 0; c < CHANNELS; c++) {
                acc[i][c] = _mm512_fmadd_ps(w[c][0], x0, acc[i][c]);
                acc[i][c] = _mm512_fmadd_ps(w[c][1], x1, acc[i][c]);
            }
        }
    }
    for (int i = 0; i < rows; i++)
        for (int c = 0; c < CHANNELS; c++) out[i][c] = _mm512_reduce_add_ps(acc[i][c]);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 acc[ROWS][CHANNELS];
    for (int i = 0; i < rows; i++)
        for (int c = 0; c < CHANNELS; c++) acc[i][c] = _mm256_setzero_ps();
    const __m256i low = _mm256_set1_epi32(15);
    for (int64_t g = 0; g < groups; g++) {
        q4_ask_ahead(codes, d, m, groups, g);
        for (int c = 0; c < CHANNELS; c++) {
            const uint8_t *b = codes + (c * groups + g) * 16;
            __m256 dg = _mm256_set1_ps(d[c * groups + g]), mg = _mm256_set1_ps(m[c * groups + g]);
            __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)b));
            __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(b + 8)));
            __m256 w0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b0, low)), dg, mg);
            __m256 w1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b1, low)), dg, mg);
            __m256 w2 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4)), dg, mg);
            __m256 w3 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4)), dg, mg);
            const float *xg = x + r0 * K + g * 32;
            for (int i = 0; i < rows; i++) {
                const float *xi = xg + i * K;
                __m256 a = acc[i][c];
                a = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xi), a);
                a = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xi + 8), a);
                a = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xi + 16), a);
                a = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xi + 24), a);
                acc[i][c] = a;
            }
        }
    }
    for (int i = 0; i < rows; i++)
        for (int c = 0; c < CHANNELS; c++) out[i][c] = sum8(acc[i][c]);
#else
    for (int i = 0; i < rows; i++)
        for (int c = 0; c < CHANNELS; c++) {
            float a = 0.0f;
            const float *xi = x + (r0 + i) * K;
            for (int64_t g = 0; g < groups; g++) {
                const uint8_t *b = codes + (c * groups + g) * 16;
                float dg = d[c * groups + g], mg = m[c * groups + g];
                for (int j = 0; j < 16; j++) {
                    a += ((float)(b[j] & 15) * dg + mg) * xi[g * 32 + j];
                    a += ((float)(b[j] >> 4) * dg + mg) * xi[g * 32 + 16 + j];
                }
            }
            out[i][c] = a;
        }
#endif
    for (int i = 0; i < rows; i++)
        for (int c = 0; c < CHANNELS; c++) {
            float *o = y + (r0 + i) * N + n + c;
            *o = add ? *o + out[i][c] : out[i][c];
        }
}

/* y (M, N) = [y +] x (M, K) W^T, inside a parallel region (the channel blocks shared among its threads). */
static void q4_product(const float *x, int64_t M, int64_t K, const uint8_t *codes, const float *d, const float *m,
                       int64_t N, float *y, int add) {
    const int64_t groups = K / 32;
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; n += CHANNELS)
        for (int64_t r0 = 0; r0 < M; r0 += ROWS) {
            int rows = (int)(M - r0 < ROWS ? M - r0 : ROWS);
            q4_block(x, K, codes + n * groups * 16, d + n * groups, m + n * groups, y, N, n, r0, rows, add);
        }
}

/* The product alone, for tests and the profile: y (M, N) = x (M, K) W^T with `threads` threads. */
void medusa_q4_product(const float *x, int64_t M, int64_t K, const uint8_t *codes, const float *d, const float *m,
                       int64_t N, float *y, int threads) {
#pragma omp parallel num_threads(threads)
    q4_product(x, M, K, codes, d, m, N, y, 0);
}

/* ---- fp32 weights (the engine "native"): y (M, N) = [y +] x (M, K) W^T with W (N, K) fp32, row-major ------------
 * Every output y[r, n] is one sum: acc = fma(W[n, k:k+L], x[r, k:k+L], acc) for k = 0, L, 2L... (the tail masked to
 * zeros), then acc's L lanes added by the same reduction; so its bits are the same whatever M, the tile and the
 * thread (row invariance). The tiles differ only in how many weight rows one pass reads, one (a single stream of the
 * weights, which a CPU's prefetcher follows best) or four (each weight loaded once for four channels), and in whether
 * the pass asks for the weights F32_AHEAD bytes ahead into the L2 cache. One row alone reads one weight row a pass
 * and asks for nothing (four weight rows a pass with the request measured 9% slower plain decoding). Several rows
 * ask ahead: without it the products' arithmetic waited on the weights' reading instead of overlapping it, so 5 rows
 * cost 1.9x one row on an AVX-512 AMD EPYC; with it (and each loaded value kept in its register, below) 1 to 8 rows
 * cost about what one row does (studies/f32_products.py, docs/engines.md). With AVX-512 a pass reads four weight
 * rows from two rows up; the AVX2 path keeps one weight row a pass up to four rows, as before (its 16 registers
 * cannot hold a four-by-four tile's accumulators and operands: from five rows up that tile spills to the stack). */
#if defined(__AVX512F__)
#define F32_SMALL_M 1 /* at most this many rows read one weight row a pass */
#else
#define F32_SMALL_M 4
#endif
#define F32_AHEAD 16384 /* bytes of the weights asked for ahead of the pass, into L2 */
/* A value loaded once is not loaded again: without this GCC 12 loaded each weight again for every row and each
 * input again for every channel (28 memory reads in its 4 x 4 tile's loop for 16 multiply-adds, instead of 8), so
 * the many-row products waited on the loads. An empty asm the value passes through: the compiler can no longer
 * repeat the load from the weights or the input (it may still spill the value to the stack). */
#if defined(__GNUC__)
#define KEEP_IN_REGISTER(v) __asm__("" : "+v"(v))
#else
#define KEEP_IN_REGISTER(v) ((void)0)
#endif

static inline __attribute__((always_inline)) void f32_tile(const float *x, int64_t K, const float *w, float *y,
                                                           int64_t N, int64_t n, int64_t r0, const int rows,
                                                           const int channels, int add) {
    float out[4][4];
    const int ahead = rows > 1 || channels > 1; /* ask for the weights ahead, keep loaded values in registers */
#if defined(__AVX512F__)
    __m512 acc[4][4];
    for (int i = 0; i < rows; i++)
        for (int c = 0; c < channels; c++) acc[i][c] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        __m512 wv[4];
        for (int c = 0; c < channels; c++) {
            wv[c] = _mm512_loadu_ps(w + c * K + k);
            if (ahead) KEEP_IN_REGISTER(wv[c]);
        }
        if (ahead)
            for (int c = 0; c < channels; c++) ASK_L2(w + c * K + k + F32_AHEAD / 4);
        for (int i = 0; i < rows; i++) {
            __m512 xv = _mm512_loadu_ps(x + (r0 + i) * K + k);
            if (ahead) KEEP_IN_REGISTER(xv);
            for (int c = 0; c < channels; c++) acc[i][c] = _mm512_fmadd_ps(wv[c], xv, acc[i][c]);
        }
    }
    if (k < K) {
        const __mmask16 lanes = (__mmask16)((1u << (K - k)) - 1u);
        for (int i = 0; i < rows; i++) {
            __m512 xv = _mm512_maskz_loadu_ps(lanes, x + (r0 + i) * K + k);
            for (int c = 0; c < channels; c++)
                acc[i][c] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(lanes, w + c * K + k), xv, acc[i][c]);
        }
    }
    for (int i = 0; i < rows; i++)
        for (int c = 0; c < channels; c++) out[i][c] = _mm512_reduce_add_ps(acc[i][c]);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 acc[4][4];
    for (int i = 0; i < rows; i++)
        for (int c = 0; c < channels; c++) acc[i][c] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        __m256 wv[4];
        for (int c = 0; c < channels; c++) wv[c] = _mm256_loadu_ps(w + c * K + k);
        if (ahead && (k & 15) == 0) /* one request a 64-byte line */
            for (int c = 0; c < channels; c++) ASK_L2(w + c * K + k + F32_AHEAD / 4);
        for (int i = 0; i < rows; i++) {
            __m256 xv = _mm256_loadu_ps(x + (r0 + i) * K + k);
            for (int c = 0; c < channels; c++) acc[i][c] = _mm256_fmadd_ps(wv[c], xv, acc[i][c]);
        }
    }
    if (k < K) {
        const __m256i lanes = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(K - k)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        for (int i = 0; i < rows; i++) {
            __m256 xv = _mm256_maskload_ps(x + (r0 + i) * K + k, lanes);
            for (int c = 0; c < channels; c++)
                acc[i][c] = _mm256_fmadd_ps(_mm256_maskload_ps(w + c * K + k, lanes), xv, acc[i][c]);
        }
    }
    for (int i = 0; i < rows; i++)
        for (int c = 0; c < channels; c++) out[i][c] = sum8(acc[i][c]);
#else
    (void)ahead; /* no request or register hint without the vector paths */
    for (int i = 0; i < rows; i++)
        for (int c = 0; c < channels; c++) {
            float a = 0.0f;
            const float *xi = x + (r0 + i) * K, *wc = w + c * K;
            for (int64_t j = 0; j < K; j++) a += wc[j] * xi[j];
            out[i][c] = a;
        }
#endif
    for (int i = 0; i < rows; i++)
        for (int c = 0; c < channels; c++) {
            float *o = y + (r0 + i) * N + n + c;
            *o = add ? *o + out[i][c] : out[i][c];
        }
}

/* Channels [n, n + channels) for every row, four rows at a time. */
static inline __attribute__((always_inline)) void f32_channels(const float *x, int64_t M, int64_t K, const float *W,
                                                               int64_t N, float *y, int64_t n, const int channels,
                                                               int add) {
    const float *w = W + n * K;
    for (int64_t r0 = 0; r0 < M; r0 += 4) {
        switch (M - r0 >= 4 ? 4 : (int)(M - r0)) {
        case 4: f32_tile(x, K, w, y, N, n, r0, 4, channels, add); break;
        case 3: f32_tile(x, K, w, y, N, n, r0, 3, channels, add); break;
        case 2: f32_tile(x, K, w, y, N, n, r0, 2, channels, add); break;
        default: f32_tile(x, K, w, y, N, n, r0, 1, channels, add); break;
        }
    }
}

/* y (M, N) = [y +] x (M, K) W^T, inside a parallel region (the channels shared among its threads). */
static void f32_product(const float *x, int64_t M, int64_t K, const float *W, int64_t N, float *y, int add) {
    if (M <= F32_SMALL_M) {
#pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n++) f32_channels(x, M, K, W, N, y, n, 1, add);
        return;
    }
    const int64_t blocks = N / 4;
#pragma omp for schedule(static)
    for (int64_t b = 0; b < blocks; b++) f32_channels(x, M, K, W, N, y, 4 * b, 4, add);
#pragma omp for schedule(static)
    for (int64_t n = 4 * blocks; n < N; n++) f32_channels(x, M, K, W, N, y, n, 1, add);
}

/* The product alone (the lm_head, the drafters' products, tests): y (M, N) = x (M, K) W^T with `threads` threads. */
void medusa_f32_product(const float *x, int64_t M, int64_t K, const float *W, int64_t N, float *y, int threads) {
#pragma omp parallel num_threads(threads)
    f32_product(x, M, K, W, N, y, 0);
}

/* ---- int8 activations (kernel "native-q8"): VNNI products, 16 output channels a block ----------------------------
 * Weights: blocks of 16 channels; per group g, 256 bytes: byte 64 v + 4 l + t holds q[channel l][4 v + t] in its low
 * nibble and q[channel l][4 (v + 4) + t] in its high nibble (v = 0..3); d, m: (N / 16, K / 32, 16) fp16.
 * Activations: per row and group of 32, s = max|x| / 127 and xq = round(x / s) in -127..127 (llama.cpp's Q8 blocks).
 * y[r, n] = sum over g of d s (q . xq) + m s (sum xq), in the same order for every row. */
#define Q8_BLOCK 16
#define Q8_ROWS 8
#define Q8_AHEAD 8192 /* bytes of a block's codes asked for ahead of the pass, into L2 (as F32_AHEAD) */

__attribute__((unused)) static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h >> 15) << 31, exponent = (h >> 10) & 31, mantissa = h & 1023, bits;
    if (exponent == 0) {
        float f = ldexpf((float)mantissa, -24);
        return sign ? -f : f;
    }
    bits = exponent == 31 ? sign | 0x7f800000u | (mantissa << 13) : sign | ((exponent + 112) << 23) | (mantissa << 13);
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

int medusa_q8_supported(void) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    return 1;
#else
    return 0;
#endif
}

/* xq (M, K) int8, s and ssum (M, K / 32): inside a parallel region */
static void quantize_rows(const float *x, int64_t M, int64_t K, int8_t *xq, float *s, float *ssum) {
    const int64_t groups = K / 32;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < M * groups; t++) {
        const float *xg = x + t * 32;
#if defined(__AVX512F__)
        float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(xg)),
                                                       _mm512_abs_ps(_mm512_loadu_ps(xg + 16))));
#else
        float top = 0.0f;
        for (int j = 0; j < 32; j++) top = fmaxf(top, fabsf(xg[j]));
#endif
        float scale = top / 127.0f, inv = top > 0.0f ? 127.0f / top : 0.0f;
        int sum = 0;
        for (int j = 0; j < 32; j++) {
            int q = (int)nearbyintf(xg[j] * inv);
            q = q > 127 ? 127 : (q < -127 ? -127 : q);
            xq[t * 32 + j] = (int8_t)q;
            sum += q;
        }
        s[t] = scale;
        ssum[t] = scale * (float)sum;
    }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* acc + w . (the 4 bytes at x, broadcast to every 32-bit lane): vpdpbusd with its broadcast folded into the memory
 * operand (compilers emit a separate vpbroadcastd for the intrinsic, one more instruction per product). */
static inline __m512i dpbusd_broadcast(__m512i acc, __m512i w, const int8_t *x) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t *)x));
    return acc;
}

/* One group of 32 int8 activations against 16 channels' codes (eight vectors, four features each): 16 int32 sums.
 * Two accumulators, so that the eight products form two dependency chains of four (integer sums: the same bits). */
static inline __m512i group_dot(const __m512i w[8], const int8_t *xg) {
    __m512i a0 = _mm512_setzero_si512(), a1 = _mm512_setzero_si512();
    for (int j = 0; j < 8; j += 2) {
        a0 = dpbusd_broadcast(a0, w[j], xg + 4 * j);
        a1 = dpbusd_broadcast(a1, w[j + 1], xg + 4 * j + 4);
    }
    return _mm512_add_epi32(a0, a1);
}

/* group_dot as one chain of intrinsics: the lm_head's blocks of up to eight rows (above four rows, the two chains
 * and the folded broadcasts measured slower there: registers run short). The same integer sums. */
static inline __m512i group_dot_chain(const __m512i w[8], const int8_t *xg) {
    __m512i iacc = _mm512_setzero_si512();
    for (int j = 0; j < 8; j++) {
        int32_t quad;
        memcpy(&quad, xg + 4 * j, 4);
        iacc = _mm512_dpbusd_epi32(iacc, w[j], _mm512_set1_epi32(quad));
    }
    return iacc;
}
#endif

/* Always inlined into a switch on the row count (q8_product), so that `rows` is a compile-time constant and the
 * accumulators stay in registers. */
static inline __attribute__((always_inline)) void q8_block(const int8_t *xq, const float *s, const float *ssum,
                                                           int64_t K, const uint8_t *codes, const uint16_t *d,
                                                           const uint16_t *m, float *y, int64_t N, int64_t n,
                                                           int64_t r0, const int rows, int add) {
    const int64_t groups = K / 32;
    float out[Q8_ROWS][Q8_BLOCK];
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    __m512 acc[Q8_ROWS];
    for (int i = 0; i < rows; i++) acc[i] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(15);
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *b = codes + g * 256;
        __m512i w[8];
        for (int v = 0; v < 4; v++) ASK_L2(b + Q8_AHEAD + 64 * v);
        if ((g & 1) == 0) { /* 32 bytes of scales a group: a line every second group */
            ASK_L2(d + g * 16 + Q8_AHEAD / 16);
            ASK_L2(m + g * 16 + Q8_AHEAD / 16);
        }
        for (int v = 0; v < 4; v++) {
            __m512i z = _mm512_loadu_si512((const void *)(b + 64 * v));
            w[v] = _mm512_and_si512(z, low);
            w[v + 4] = _mm512_and_si512(_mm512_srli_epi16(z, 4), low);
        }
        __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(d + g * 16)));
        __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(m + g * 16)));
        for (int i = 0; i < rows; i++) {
            __m512i iacc = group_dot(w, xq + (r0 + i) * K + g * 32);
            int64_t t = (r0 + i) * groups + g;
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc), _mm512_mul_ps(dv, _mm512_set1_ps(s[t])), acc[i]);
            acc[i] = _mm512_fmadd_ps(mv, _mm512_set1_ps(ssum[t]), acc[i]);
        }
    }
    for (int i = 0; i < rows; i++) _mm512_storeu_ps(out[i], acc[i]);
#else
    for (int i = 0; i < rows; i++)
        for (int l = 0; l < Q8_BLOCK; l++) {
            float a = 0.0f;
            for (int64_t g = 0; g < groups; g++) {
                const uint8_t *b = codes + g * 256;
                const int8_t *xg = xq + (r0 + i) * K + g * 32;
                int isum = 0;
                for (int j = 0; j < 8; j++)
                    for (int t = 0; t < 4; t++) {
                        uint8_t byte = b[64 * (j % 4) + 4 * l + t];
                        int q = j < 4 ? (byte & 15) : (byte >> 4);
                        isum += q * xg[4 * j + t];
                    }
                int64_t t = (r0 + i) * groups + g;
                float dg = half_to_float(d[g * 16 + l]), mg = half_to_float(m[g * 16 + l]);
                a = fmaf((float)isum, dg * s[t], a);
                a = fmaf(mg, ssum[t], a);
            }
            out[i][l] = a;
        }
#endif
    for (int i = 0; i < rows; i++)
        for (int l = 0; l < Q8_BLOCK; l++) {
            float *o = y + (r0 + i) * N + n + l;
            *o = add ? *o + out[i][l] : out[i][l];
        }
}

/* y (M, N) = [y +] q8(x) W^T inside a parallel region; xq, s, ssum: scratch of M K bytes and M K / 32 floats */
static void q8_product(const float *x, int64_t M, int64_t K, const uint8_t *codes, const uint16_t *d,
                       const uint16_t *m, int64_t N, float *y, int add, int8_t *xq, float *s, float *ssum) {
    const int64_t groups = K / 32;
    quantize_rows(x, M, K, xq, s, ssum);
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; n += Q8_BLOCK)
        for (int64_t r0 = 0; r0 < M; r0 += Q8_ROWS) {
            int rows = (int)(M - r0 < Q8_ROWS ? M - r0 : Q8_ROWS);
            int64_t blk = n / Q8_BLOCK;
            const uint8_t *cb = codes + blk * groups * 256;
            const uint16_t *db = d + blk * groups * 16, *mb = m + blk * groups * 16;
            switch (rows) {
#define BLOCK_ROWS(r) case r: q8_block(xq, s, ssum, K, cb, db, mb, y, N, n, r0, r, add); break;
            BLOCK_ROWS(1) BLOCK_ROWS(2) BLOCK_ROWS(3) BLOCK_ROWS(4) BLOCK_ROWS(5) BLOCK_ROWS(6) BLOCK_ROWS(7)
            default: BLOCK_ROWS(8)
#undef BLOCK_ROWS
            }
        }
}

void medusa_q8_product(const float *x, int64_t M, int64_t K, const uint8_t *codes, const uint16_t *d,
                       const uint16_t *m, int64_t N, float *y, int threads) {
    int8_t *xq = malloc((size_t)M * K);
    float *s = malloc(sizeof(float) * M * (K / 32)), *ssum = malloc(sizeof(float) * M * (K / 32));
    if (xq && s && ssum) {
#pragma omp parallel num_threads(threads)
        q8_product(x, M, K, codes, d, m, N, y, 0, xq, s, ssum);
    }
    free(xq); free(s); free(ssum);
}

/* One channel of the head for ROWS rows (a compile-time count, so the accumulators stay in registers). */
static inline __attribute__((always_inline)) void head_channel(const float *x, int64_t K, const int8_t *q,
                                                               const float *dc, float *y, int64_t V, const int rows) {
    const int64_t groups = K / 32;
#if defined(__AVX512F__)
    __m512 acc[4];
    for (int i = 0; i < rows; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512 q0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + g * 32))));
        __m512 q1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + g * 32 + 16))));
        __m512 dg = _mm512_set1_ps(dc[g]);
        for (int i = 0; i < rows; i++) {
            const float *xi = x + i * K + g * 32;
            __m512 part = _mm512_mul_ps(q0, _mm512_loadu_ps(xi));
            part = _mm512_fmadd_ps(q1, _mm512_loadu_ps(xi + 16), part);
            acc[i] = _mm512_fmadd_ps(part, dg, acc[i]);
        }
    }
    for (int i = 0; i < rows; i++) y[i * V] = _mm512_reduce_add_ps(acc[i]);
#else
    for (int i = 0; i < rows; i++) {
        const float *xi = x + i * K;
        float acc = 0.0f;
        for (int64_t g = 0; g < groups; g++) {
            float part = 0.0f;
            for (int j = 0; j < 32; j++) part += (float)q[g * 32 + j] * xi[g * 32 + j];
            acc += part * dc[g];
        }
        y[i * V] = acc;
    }
#endif
}

/* ---- the lm_head from a GGUF's Q8_0 blocks, fp32 activations: y (M, V) = x (M, K) W^T, W = d q ------------------
 * codes (V, K) int8, d (V, K / 32) fp32; each channel's weights unpacked once for up to four rows, each (row,
 * channel) summed in the same order whatever the rows are. */
int medusa_q8_0_head(const float *x, int64_t M, int64_t K, const int8_t *codes, const float *d, int64_t V,
                     float *y, int threads) {
    const int64_t groups = K / 32;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t n = 0; n < V; n++) {
        const int8_t *q = codes + n * K;
        const float *dc = d + n * groups;
        for (int64_t r0 = 0; r0 < M; r0 += 4) {
            const float *xr = x + r0 * K;
            float *yr = y + r0 * V + n;
            switch (M - r0 < 4 ? M - r0 : 4) {
            case 1: head_channel(xr, K, q, dc, yr, V, 1); break;
            case 2: head_channel(xr, K, q, dc, yr, V, 2); break;
            case 3: head_channel(xr, K, q, dc, yr, V, 3); break;
            default: head_channel(xr, K, q, dc, yr, V, 4); break;
            }
        }
    }
    return 0;
}

/* ---- the Q8_0 lm_head with int8 activations (kernel "native-q8"), VNNI: W = d q, q int8 stored as q + 128 (u8) ----
 * codes: blocks of 16 channels; per group g, 512 bytes: byte 64 j + 4 l + t holds q[channel l][4 j + t] + 128 (j =
 * 0..7); d: (V / 16, K / 32, 16) fp32. y[r, n] = sum over g of d (s (sum (q + 128) xq) - 128 s (sum xq)). */
/* Up to Q8_ROWS rows of one block of 16 vocabulary channels; `rows` a compile-time constant where inlined into the
 * switch below, so that the accumulators stay in registers. */
static inline __attribute__((always_inline)) void q8_0_head_block(const int8_t *xq, const float *s, const float *ssum,
                                                                  int64_t K, const uint8_t *cb, const float *db,
                                                                  float *y, int64_t V, int64_t n, int64_t r0,
                                                                  const int rows) {
    const int64_t groups = K / 32;
    float out[Q8_ROWS][16];
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    __m512 acc[Q8_ROWS];
    for (int i = 0; i < rows; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512i w[8];
        for (int j = 0; j < 8; j++) ASK_L2(cb + g * 512 + Q8_AHEAD + 64 * j);
        ASK_L2(db + g * 16 + Q8_AHEAD / 32); /* 64 bytes of scales a group of 512 bytes of codes */
        for (int j = 0; j < 8; j++) w[j] = _mm512_loadu_si512((const void *)(cb + g * 512 + 64 * j));
        __m512 dv = _mm512_loadu_ps(db + g * 16);
        for (int i = 0; i < rows; i++) {
            __m512i iacc = group_dot_chain(w, xq + (r0 + i) * K + g * 32);
            int64_t t = (r0 + i) * groups + g;
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc), _mm512_mul_ps(dv, _mm512_set1_ps(s[t])), acc[i]);
            acc[i] = _mm512_fmadd_ps(dv, _mm512_set1_ps(-128.0f * ssum[t]), acc[i]);
        }
    }
    for (int i = 0; i < rows; i++) _mm512_storeu_ps(out[i], acc[i]);
#else
    for (int i = 0; i < rows; i++)
        for (int l = 0; l < 16; l++) {
            float a = 0.0f;
            for (int64_t g = 0; g < groups; g++) {
                const int8_t *xg = xq + (r0 + i) * K + g * 32;
                int isum = 0;
                for (int j = 0; j < 8; j++)
                    for (int t = 0; t < 4; t++) isum += (int)cb[g * 512 + 64 * j + 4 * l + t] * xg[4 * j + t];
                int64_t t = (r0 + i) * groups + g;
                float dg = db[g * 16 + l];
                a = fmaf((float)isum, dg * s[t], a);
                a = fmaf(dg, -128.0f * ssum[t], a);
            }
            out[i][l] = a;
        }
#endif
    for (int i = 0; i < rows; i++)
        for (int l = 0; l < 16; l++) y[(r0 + i) * V + n + l] = out[i][l];
}

/* Returns 0, or -1 when scratch memory could not be allocated (nothing written to y then). */
int medusa_q8_0_head_q8(const float *x, int64_t M, int64_t K, const uint8_t *codes, const float *d, int64_t V,
                        float *y, int threads) {
    const int64_t groups = K / 32;
    int8_t *xq = malloc((size_t)M * K);
    float *s = malloc(sizeof(float) * M * groups), *ssum = malloc(sizeof(float) * M * groups);
    if (xq && s && ssum) {
#pragma omp parallel num_threads(threads)
        {
            quantize_rows(x, M, K, xq, s, ssum);
#pragma omp for schedule(static)
            for (int64_t n = 0; n < V; n += 16) {
                const uint8_t *cb = codes + (n / 16) * groups * 512;
                const float *db = d + (n / 16) * groups * 16;
                for (int64_t r0 = 0; r0 < M; r0 += Q8_ROWS) {
                    switch (M - r0 < Q8_ROWS ? M - r0 : Q8_ROWS) {
#define HEAD_ROWS(r) case r: q8_0_head_block(xq, s, ssum, K, cb, db, y, V, n, r0, r); break;
                    HEAD_ROWS(1) HEAD_ROWS(2) HEAD_ROWS(3) HEAD_ROWS(4) HEAD_ROWS(5) HEAD_ROWS(6) HEAD_ROWS(7)
                    default: HEAD_ROWS(8)
#undef HEAD_ROWS
                    }
                }
            }
        }
    }
    int ok = xq && s && ssum;
    free(xq); free(s); free(ssum);
    return ok ? 0 : -1;
}

#if defined(__AVX512F__)
/* e^x for x <= 0 (scores minus their maximum), 16 lanes: 2^n e^r with r = x - n ln 2, |r| <= ln2 / 2, and a
 * degree-6 polynomial for e^r (relative error about 2e-7); lanes below -87 give 0. */
static __m512 exp_nonpositive(__m512 x) {
    const __m512 lowest = _mm512_set1_ps(-87.0f);
    __mmask16 keep = _mm512_cmp_ps_mask(x, lowest, _CMP_GE_OQ);
    x = _mm512_max_ps(x, lowest);
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_maskz_mov_ps(keep, _mm512_scalef_ps(p, n));
}
#endif

/* act (M, I) = silu(gate) * up, gu (M, 2 I) = [gate | up], inside a parallel region: the threads share chunks of 16
 * values of every row (one row is a token: a single-token forward spreads its activation over all threads). With
 * AVX-512, silu(g) = g * sigmoid(g), the sigmoid from e = exp(-|g|) (exp_nonpositive): 1 / (1 + e) for g >= 0, e / (1 +
 * e) below; elsewhere g / (1 + expf(-g)). Each value is computed by the same instructions whatever the other rows
 * are (a row's chunks start at multiples of 16, its tail masked alike). */
static void silu_gate(const float *gu, int64_t M, int64_t I, float *act) {
    const int64_t chunks = (I + 15) / 16;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < M * chunks; t++) {
        const int64_t i = t / chunks, j0 = (t % chunks) * 16, n = I - j0 < 16 ? I - j0 : 16;
        const float *g = gu + i * 2 * I + j0, *u = g + I;
        float *a = act + i * I + j0;
#if defined(__AVX512F__)
        const __mmask16 lanes = (__mmask16)((1u << n) - 1u);
        const __m512 one = _mm512_set1_ps(1.0f);
        __m512 gv = _mm512_maskz_loadu_ps(lanes, g), uv = _mm512_maskz_loadu_ps(lanes, u);
        __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(gv)));
        __m512 r = _mm512_div_ps(one, _mm512_add_ps(one, e));
        __mmask16 negative = _mm512_cmp_ps_mask(gv, _mm512_setzero_ps(), _CMP_LT_OQ);
        __m512 sig = _mm512_mask_mul_ps(r, negative, e, r);
        _mm512_mask_storeu_ps(a, lanes, _mm512_mul_ps(_mm512_mul_ps(gv, sig), uv));
#else
        for (int64_t j = 0; j < n; j++) a[j] = g[j] / (1.0f + expf(-g[j])) * u[j];
#endif
    }
}

static float dot(const float *a, const float *b, int64_t n) {
#if defined(__AVX512F__)
    if (n % 16 == 0) {
        __m512 s = _mm512_setzero_ps();
        for (int64_t j = 0; j < n; j += 16) s = _mm512_fmadd_ps(_mm512_loadu_ps(a + j), _mm512_loadu_ps(b + j), s);
        return _mm512_reduce_add_ps(s);
    }
#endif
    float s = 0.0f;
    for (int64_t j = 0; j < n; j++) s += a[j] * b[j];
    return s;
}

#if defined(__AVX512F__)
/* Lane t of the result: the sum of the 16 lanes of a[t], in the same order for every t (pairs of lanes two apart,
 * then neighbours, then the four 128-bit quarters as (0 + 1) + (2 + 3)): sixteen dot products' last step in 45
 * instructions instead of a horizontal sum each. */
static inline __m512 sum_lanes16(const __m512 a[16]) {
    __m512 t[8], u[4];
    for (int i = 0; i < 8; i++)
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        __m512d x = _mm512_castps_pd(t[2 * i]), y = _mm512_castps_pd(t[2 * i + 1]);
        u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    __m512 v0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
    __m512 v1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(v0, v1, 0x88), _mm512_shuffle_f32x4(v0, v1, 0xDD));
}

/* One (row, query head) of the attention, head size 16 dv (dv a compile-time constant where inlined below): the
 * query q against the visible slots (the first `length`, then the row's own `own` slots base + index[j]) of the
 * key and value rows kb, vb, into o (16 dv values). Scores 16 slots at a time (each a product of 16 dv terms, then
 * sum_lanes16), the softmax over 16-slot blocks, the weighted values in two accumulators (even and odd slots). Every
 * step is blocked by slot number, never by the rows of the forward, so a row's bits do not depend on the others. */
static inline __attribute__((always_inline)) void attend(const float *q, const float *kb, const float *vb,
                                                         int64_t length, int64_t base, const int32_t *index,
                                                         int64_t own, float scaling, float *mine, float *o,
                                                         const int dv) {
    const int64_t D = 16 * dv, seen = length + own;
    __m512 qv[8], topv = _mm512_set1_ps(-INFINITY);
    for (int j = 0; j < dv; j++) qv[j] = _mm512_loadu_ps(q + 16 * j);
    for (int64_t s0 = 0; s0 < seen; s0 += 16) {
        const int n = seen - s0 >= 16 ? 16 : (int)(seen - s0);
        const __mmask16 lanes = n == 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1u);
        __m512 acc[16];
        for (int t = 0; t < 16; t++) {
            if (t >= n) {
                acc[t] = _mm512_setzero_ps();
                continue;
            }
            const int64_t slot = s0 + t < length ? s0 + t : base + index[s0 + t - length];
            const float *k = kb + slot * D;
            __m512 a = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k));
            for (int j = 1; j < dv; j++) a = _mm512_fmadd_ps(qv[j], _mm512_loadu_ps(k + 16 * j), a);
            acc[t] = a;
        }
        const __m512 scores = _mm512_mul_ps(sum_lanes16(acc), _mm512_set1_ps(scaling));
        _mm512_mask_storeu_ps(mine + s0, lanes, scores);
        topv = _mm512_mask_max_ps(topv, lanes, topv, scores);
    }
    const __m512 top16 = _mm512_set1_ps(_mm512_reduce_max_ps(topv));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t s0 = 0; s0 < seen; s0 += 16) {
        const __mmask16 lanes = seen - s0 >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (seen - s0)) - 1u);
        __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, mine + s0), top16));
        e = _mm512_maskz_mov_ps(lanes, e);
        _mm512_mask_storeu_ps(mine + s0, lanes, e);
        sum = _mm512_add_ps(sum, e);
    }
    __m512 even[8], odd[8];
    for (int j = 0; j < dv; j++) even[j] = odd[j] = _mm512_setzero_ps();
    int64_t s = 0;
    for (; s + 1 < seen; s += 2) {
        const int64_t a = s < length ? s : base + index[s - length];
        const int64_t b = s + 1 < length ? s + 1 : base + index[s + 1 - length];
        const __m512 pa = _mm512_set1_ps(mine[s]), pb = _mm512_set1_ps(mine[s + 1]);
        for (int j = 0; j < dv; j++) {
            even[j] = _mm512_fmadd_ps(pa, _mm512_loadu_ps(vb + a * D + 16 * j), even[j]);
            odd[j] = _mm512_fmadd_ps(pb, _mm512_loadu_ps(vb + b * D + 16 * j), odd[j]);
        }
    }
    if (s < seen) {
        const int64_t a = s < length ? s : base + index[s - length];
        const __m512 pa = _mm512_set1_ps(mine[s]);
        for (int j = 0; j < dv; j++) even[j] = _mm512_fmadd_ps(pa, _mm512_loadu_ps(vb + a * D + 16 * j), even[j]);
    }
    const __m512 total = _mm512_set1_ps(_mm512_reduce_add_ps(sum));
    for (int j = 0; j < dv; j++) _mm512_storeu_ps(o + 16 * j, _mm512_div_ps(_mm512_add_ps(even[j], odd[j]), total));
}
#endif

/* out (H) = weight * (x * 1 / sqrt(mean(x^2) + eps)), transformers' Llama RMSNorm in fp32. */
static void rms_norm(const float *x, const float *weight, int64_t H, float eps, float *out) {
    float sum = 0.0f;
    for (int64_t j = 0; j < H; j++) sum += x[j] * x[j];
    float inv = 1.0f / sqrtf(sum / (float)H + eps);
    for (int64_t j = 0; j < H; j++) out[j] = weight[j] * (x[j] * inv);
}

typedef struct {
    int64_t hidden, q_heads, kv_heads, head_dim, intermediate, layers;
    float eps, scaling;
    int64_t format; /* 0: int4 codes, fp32 activations (q4 layout); 1: the VNNI products (q8 layout, fp16 d and m);
                     * 2: fp32 weights (codes[j] an (N, K) fp32 matrix; d and m not read) */
    /* per layer: [qkv, o, gate_up, down] codes, d, m (layers * 4 each); norms: 2 per layer, then the final one */
    const uint8_t *const *codes;
    const float *const *d;
    const float *const *m;
    const float *const *norms;
} medusa_q4_model;

#define PRODUCT(in, K, j, N, out, add)                                                                        \
    do {                                                                                                       \
        if (w->format == 1)                                                                                    \
            q8_product(in, M, K, c[j], (const uint16_t *)dd[j], (const uint16_t *)mm[j], N, out, add, xq, xs,   \
                       xsum);                                                                                  \
        else if (w->format == 2)                                                                               \
            f32_product(in, M, K, (const float *)c[j], N, out, add);                                           \
        else                                                                                                   \
            q4_product(in, M, K, c[j], dd[j], mm[j], N, out, add);                                             \
    } while (0)

/* One forward of B rows of N new tokens each (M = B N, row-major), each row's tokens written at slots
 * [length, length + N) of its own cache.
 *
 * x (M, hidden): the tokens' embeddings in, the hidden states after the final norm out.
 * cos, sin (M, head_dim): the rotary tables at the tokens' positions.
 * cached (B): the slots 0 .. cached[b]-1 row b attends to before its step tokens (<= length: a shorter row's
 *   slots between cached[b] and length are holes, never read).
 * capacity: the cache's slots per row and layer.
 * visible: CSR over the step's M tokens; token i of row b attends to slots 0 .. cached[b]-1, then to its row's step
 *   tokens index[offsets[i] .. offsets[i+1]) (indices 0 .. N-1 within the row, ascending, itself last), in that
 *   order.
 * keys, values: per layer (B, kv_heads, capacity, head_dim), written at the step's slots.
 * kept: per layer, NULL or (M, hidden) receiving the residual stream after that layer.
 * Every sum runs over one token's own values in an order set by slot numbers alone, so a token's bits do not depend
 * on the other rows or tokens of the forward. Returns 0, or -1 when scratch memory could not be allocated (nothing
 * written to x then).
 */
int medusa_q4_forward_rows(const medusa_q4_model *w, float *x, int64_t M, int64_t N, const float *cos,
                           const float *sin, const int32_t *offsets, const int32_t *index, const int64_t *cached,
                           int64_t length, int64_t capacity, float *const *keys, float *const *values,
                           float *const *kept, int threads) {
    const int64_t H = w->hidden, D = w->head_dim, Hq = w->q_heads, Hkv = w->kv_heads, I = w->intermediate;
    const int64_t QKV = (Hq + 2 * Hkv) * D, cap = capacity, group = Hq / Hkv;
    const int64_t most_seen = length + N;
    float *h = malloc(sizeof(float) * M * H), *qkv = malloc(sizeof(float) * M * QKV);
    float *att = malloc(sizeof(float) * M * Hq * D), *gu = malloc(sizeof(float) * M * 2 * I);
    float *act = malloc(sizeof(float) * M * I);
    float *scores = malloc(sizeof(float) * (size_t)threads * most_seen);
    const int64_t widest = I > H ? (I > Hq * D ? I : Hq * D) : (H > Hq * D ? H : Hq * D);
    int8_t *xq = malloc((size_t)M * widest);
    float *xs = malloc(sizeof(float) * M * (widest / 32)), *xsum = malloc(sizeof(float) * M * (widest / 32));
    int ok = h && qkv && att && gu && act && scores && xq && xs && xsum;
    if (ok) {
#pragma omp parallel num_threads(threads)
        {
            float *mine = scores + (size_t)omp_get_thread_num() * most_seen;
            for (int64_t l = 0; l < w->layers; l++) {
                const uint8_t *const *c = w->codes + 4 * l;
                const float *const *dd = w->d + 4 * l, *const *mm = w->m + 4 * l;
                float *kc = keys[l], *vc = values[l];
#pragma omp for schedule(static)
                for (int64_t i = 0; i < M; i++) rms_norm(x + i * H, w->norms[2 * l], H, w->eps, h + i * H);
                PRODUCT(h, H, 0, QKV, qkv, 0);
                /* rotary on queries and keys (transformers' rotate_half), then the keys and values into the cache */
#pragma omp for schedule(static)
                for (int64_t i = 0; i < M; i++) {
                    const float *ci = cos + i * D, *si = sin + i * D;
                    for (int64_t head = 0; head < Hq + Hkv; head++) {
                        float *v = qkv + i * QKV + head * D;
                        for (int64_t j = 0; j < D / 2; j++) {
                            float a = v[j], b = v[j + D / 2];
                            v[j] = a * ci[j] + (-b) * si[j];
                            v[j + D / 2] = b * ci[j + D / 2] + a * si[j + D / 2];
                        }
                    }
                    const int64_t row = i / N, slot = length + i % N;
                    for (int64_t head = 0; head < Hkv; head++) {
                        memcpy(kc + ((row * Hkv + head) * cap + slot) * D, qkv + i * QKV + (Hq + head) * D,
                               sizeof(float) * D);
                        memcpy(vc + ((row * Hkv + head) * cap + slot) * D, qkv + i * QKV + (Hq + Hkv + head) * D,
                               sizeof(float) * D);
                    }
                }
                /* attention: each (row, query head) alone over its visible slots, in slot order (with AVX-512 and a
                 * head size of 16-128, attend() above: blocks of 16 slots); the tasks ordered by key-value head, so
                 * that the threads share out the cached keys and values rather than each reading all of them */
#pragma omp for schedule(static)
                for (int64_t t = 0; t < M * Hq; t++) {
                    int64_t kv = t / (M * group), i = t % (M * group) / group, head = kv * group + t % group;
                    const float *q = qkv + i * QKV + head * D;
                    const int64_t row = i / N, before = cached[row];
                    const float *kb = kc + (row * Hkv + kv) * cap * D, *vb = vc + (row * Hkv + kv) * cap * D;
                    int64_t own = offsets[i + 1] - offsets[i], seen = before + own;
#if defined(__AVX512F__)
                    switch (D) {
#define ATTEND(dv) attend(q, kb, vb, before, length, index + offsets[i], own, w->scaling, mine, \
                          att + i * Hq * D + head * D, dv); continue;
                    case 16: ATTEND(1)
                    case 32: ATTEND(2)
                    case 64: ATTEND(4)
                    case 128: ATTEND(8)
#undef ATTEND
                    default: break;
                    }
#endif
                    float top = -INFINITY;
                    for (int64_t s = 0; s < seen; s++) {
                        int64_t slot = s < before ? s : length + index[offsets[i] + s - before];
                        float score = dot(q, kb + slot * D, D) * w->scaling;
                        mine[s] = score;
                        if (score > top) top = score;
                    }
                    float total = 0.0f;
                    float *o = att + i * Hq * D + head * D;
#if defined(__AVX512F__)
                    if (D % 16 == 0 && D <= 256) {
                        __m512 sum = _mm512_setzero_ps(), top16 = _mm512_set1_ps(top);
                        for (int64_t s = 0; s < seen; s += 16) {
                            __mmask16 lanes = seen - s >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (seen - s)) - 1);
                            __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, mine + s), top16));
                            e = _mm512_maskz_mov_ps(lanes, e);
                            _mm512_mask_storeu_ps(mine + s, lanes, e);
                            sum = _mm512_add_ps(sum, e);
                        }
                        total = _mm512_reduce_add_ps(sum);
                        __m512 acc[16];
                        for (int64_t j = 0; j < D / 16; j++) acc[j] = _mm512_setzero_ps();
                        for (int64_t s = 0; s < seen; s++) {
                            int64_t slot = s < before ? s : length + index[offsets[i] + s - before];
                            const float *v = vb + slot * D;
                            __m512 p = _mm512_set1_ps(mine[s]);
                            for (int64_t j = 0; j < D / 16; j++)
                                acc[j] = _mm512_fmadd_ps(p, _mm512_loadu_ps(v + 16 * j), acc[j]);
                        }
                        __m512 inv = _mm512_set1_ps(total);
                        for (int64_t j = 0; j < D / 16; j++) _mm512_storeu_ps(o + 16 * j, _mm512_div_ps(acc[j], inv));
                        continue;
                    }
#endif
                    for (int64_t s = 0; s < seen; s++) {
                        mine[s] = expf(mine[s] - top);
                        total += mine[s];
                    }
                    for (int64_t j = 0; j < D; j++) o[j] = 0.0f;
                    for (int64_t s = 0; s < seen; s++) {
                        int64_t slot = s < before ? s : length + index[offsets[i] + s - before];
                        const float *v = vb + slot * D;
                        float p = mine[s];
                        for (int64_t j = 0; j < D; j++) o[j] += p * v[j];
                    }
                    for (int64_t j = 0; j < D; j++) o[j] = o[j] / total;
                }
                PRODUCT(att, Hq * D, 1, H, x, 1); /* x += attention @ o_proj */
#pragma omp for schedule(static)
                for (int64_t i = 0; i < M; i++) rms_norm(x + i * H, w->norms[2 * l + 1], H, w->eps, h + i * H);
                PRODUCT(h, H, 2, 2 * I, gu, 0);
                silu_gate(gu, M, I, act);
                PRODUCT(act, I, 3, H, x, 1); /* x += mlp */
                if (kept[l] != NULL) {
#pragma omp for schedule(static)
                    for (int64_t i = 0; i < M; i++) memcpy(kept[l] + i * H, x + i * H, sizeof(float) * H);
                }
            }
#pragma omp for schedule(static)
            for (int64_t i = 0; i < M; i++) {
                rms_norm(x + i * H, w->norms[2 * w->layers], H, w->eps, h + i * H);
                memcpy(x + i * H, h + i * H, sizeof(float) * H);
            }
        }
    }
    free(h); free(qkv); free(att); free(gu); free(act); free(scores); free(xq); free(xs); free(xsum);
    return ok ? 0 : -1;
}

/* One forward of M new tokens of one sequence written at cache slots [length, length + M): medusa_q4_forward_rows
 * with one row (the same arithmetic, so the same bits). visible: CSR over the M tokens as there; keys, values: per
 * layer (kv_heads, capacity, head_dim). */
int medusa_q4_forward(const medusa_q4_model *w, float *x, int64_t M, const float *cos, const float *sin,
                      const int32_t *offsets, const int32_t *index, int64_t length, int64_t capacity,
                      float *const *keys, float *const *values, float *const *kept, int threads) {
    return medusa_q4_forward_rows(w, x, M, M, cos, sin, offsets, index, &length, length, capacity, keys, values,
                                  kept, threads);
}

/* ---- one Hydra head level for P tree nodes in one call (drafting beside the native decoder) ----------------------
 * Hydra head k (Ankner et al. 2024, section 3) at node p reads [h_p ; n(e(t_p0)) ; ... ; n(e(t_pk))] (T = k + 1
 * path tokens, n the weightless RMS norm of the base's input embedding row, eps as given), then
 *   f = h + silu(W_in x + b),  then for each of its `blocks` ResBlocks in order  f = f + silu(W_j f + b_j),
 *   logits = W_proj f  (the head vocabulary's Vh rows),
 * and each node's top_k head-vocabulary ids by logit with their softmax probabilities, best first (ties: the lower
 * id first). W_in (H, (T + 1) H) and W_proj (Vh, H) are Q8_0 blocks in the layout of medusa_q8_0_head (fp32
 * activations) or medusa_q8_0_head_q8 (int8 activations: int8_activations = 1), so the products are those of the
 * drafter products the heads use otherwise; so are the ResBlocks' W_j (H, H) (block_codes[j], block_d[j], with their
 * biases block_bias[j] (H,)). Draft values only: the verify decides what is emitted.
 * hidden: (P, H); tokens: (P, T) int64; embed: (V, H) fp32; logits: (P, Vh) out; ids (P, top_k) int64 and probs
 * (P, top_k) fp32 out; V: the embedding table's rows. Returns 0; -1 when scratch memory could not be allocated
 * (outputs then undefined); -2 when a path token is not an embedding row, -3 when top_k is not in 1..Vh (nothing
 * written then). */
int medusa_hydra_level(const float *hidden, int64_t P, int64_t H, const int64_t *tokens, int64_t T,
                       const float *embed, int64_t V, float eps, const void *in_codes, const float *in_d,
                       const float *in_bias, int64_t blocks, const void *const *block_codes,
                       const float *const *block_d, const float *const *block_bias, const void *proj_codes,
                       const float *proj_d, int64_t Vh, int int8_activations, float *logits, int64_t top_k,
                       int64_t *ids, float *probs, int threads) {
    const int64_t K = (T + 1) * H;
    if (top_k < 1 || top_k > Vh) return -3;
    for (int64_t i = 0; i < P * T; i++)
        if (tokens[i] < 0 || tokens[i] >= V) return -2;
    /* x: the input layer's rows, then (K >= 2 H) each ResBlock's product */
    float *x = malloc(sizeof(float) * P * K), *f = malloc(sizeof(float) * P * H);
    if (!x || !f) { free(x); free(f); return -1; }
    for (int64_t p = 0; p < P; p++) {
        float *xp = x + p * K;
        memcpy(xp, hidden + p * H, sizeof(float) * H);
        for (int64_t t = 0; t < T; t++) {
            const float *e = embed + tokens[p * T + t] * H;
            float sum = 0.0f;
            for (int64_t j = 0; j < H; j++) sum += e[j] * e[j];
            float inv = 1.0f / sqrtf(sum / (float)H + eps);
            for (int64_t j = 0; j < H; j++) xp[(t + 1) * H + j] = e[j] * inv;
        }
    }
    int failed = int8_activations ? medusa_q8_0_head_q8(x, P, K, (const uint8_t *)in_codes, in_d, H, f, threads)
                                  : medusa_q8_0_head(x, P, K, (const int8_t *)in_codes, in_d, H, f, threads);
    if (failed) { free(x); free(f); return -1; }
    for (int64_t p = 0; p < P; p++)
        for (int64_t j = 0; j < H; j++) {
            float g = f[p * H + j] + in_bias[j];
            f[p * H + j] = hidden[p * H + j] + g / (1.0f + expf(-g));
        }
    for (int64_t b = 0; b < blocks; b++) {  /* Hydra++'s deeper MLP: f = f + silu(W_b f + b_b), in order */
        failed = int8_activations ? medusa_q8_0_head_q8(f, P, H, (const uint8_t *)block_codes[b], block_d[b], H, x, threads)
                                  : medusa_q8_0_head(f, P, H, (const int8_t *)block_codes[b], block_d[b], H, x, threads);
        if (failed) { free(x); free(f); return -1; }
        for (int64_t p = 0; p < P; p++)
            for (int64_t j = 0; j < H; j++) {
                float g = x[p * H + j] + block_bias[b][j];
                f[p * H + j] += g / (1.0f + expf(-g));
            }
    }
    failed = int8_activations ? medusa_q8_0_head_q8(f, P, H, (const uint8_t *)proj_codes, proj_d, Vh, logits, threads)
                              : medusa_q8_0_head(f, P, H, (const int8_t *)proj_codes, proj_d, Vh, logits, threads);
    if (failed) { free(x); free(f); return -1; }
    for (int64_t p = 0; p < P; p++) {
        const float *l = logits + p * Vh;
        int64_t *best = ids + p * top_k;
        float *bp = probs + p * top_k;
        int64_t have = 0;
        float top = -INFINITY;
        for (int64_t v = 0; v < Vh; v++) {
            float value = l[v];
            if (value > top) top = value;
            if (have == top_k && !(value > l[best[top_k - 1]])) continue;
            int64_t i = have < top_k ? have++ : top_k - 1;
            while (i > 0 && value > l[best[i - 1]]) { best[i] = best[i - 1]; i--; }
            best[i] = v;
        }
        float total = 0.0f;
#if defined(__AVX512F__)
        {  /* the softmax's denominator 16 logits at a time (exp_nonpositive: about 2e-7 relative error) */
            const __m512 top16 = _mm512_set1_ps(top);
            __m512 sum = _mm512_setzero_ps();
            for (int64_t v = 0; v < Vh; v += 16) {
                const __mmask16 lanes = Vh - v >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (Vh - v)) - 1u);
                __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, l + v), top16));
                sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(lanes, e));
            }
            total = _mm512_reduce_add_ps(sum);
        }
#else
        for (int64_t v = 0; v < Vh; v++) total += expf(l[v] - top);
#endif
        for (int64_t i = 0; i < have; i++) bp[i] = expf(l[best[i]] - top) / total;
        for (int64_t i = have; i < top_k; i++) { best[i] = 0; bp[i] = 0.0f; }
    }
    free(x); free(f);
    return 0;
}
