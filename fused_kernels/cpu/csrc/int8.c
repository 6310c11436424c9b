/* int8.c: the W8A8 INT8 linear (`cpu.int8`): y [M, N] = (q(x) [M, K] @ W8 [N, K].T) * sx * sw
   (+ bias), for the compressed-tensors `int-quantized` format: int8 weights with a scale per
   output row, activations quantized per token at run time.

   The activations (`qk_w8a8_quant_tokens`): per row, sx = absmax / 127 and q = round(x / sx)
   to nearest even, clamped to +-127 (sx = 0: all codes 0). The division, not a multiply by
   1 / sx: bit-identical to `quantkit.format.packing.int8_absmax`, the reference's rule.

   The products (`qk_w8a8_gemm`): the weights as the int8 head holds them (`qk_i8i8_gemv`,
   `bf16_gemv.c`): W8 + 128 as unsigned bytes, 16 rows interleaved, so one 64-byte load is 4
   elements of 16 rows and one vpdpbusd per activation row multiplies them by that row's 4
   codes broadcast to all lanes. Each lane sums the integers of a whole row (K <= 132k keeps
   |sum| < 2^31, exactly), the + 128 is undone once per row (acc - 128 sum(q)), and the fp32
   work is one convert and two multiplies per output: float(acc) * sx * sw, in this order, then
   + bias, as the reference does them, so the result is the reference's bit for bit whatever
   the row count or thread split (integer sums do not depend on order). Lane l of a tile is
   output row 16 t + l: no horizontal sums. Unlike the head's GEMV there is one activation
   scale per row (per token), not per block, so any M works: decode rows and prefill alike.

   A tile of 16 weight rows is read once per 8 activation rows (from L1 for K up to ~2k);
   threads split the tiles. Needs AVX512-VNNI (the `avx512` build on a CPU with avx512_vnni);
   other builds return 4 and the caller keeps the reference. Return value: 0, 1 = a bad
   argument, 2 = out of memory, 4 = not in this build. */

#include "common.h"
#include "quantkit_kernels.h"

#define W8A8_MB 8  /* activation rows a tile call takes */

int qk_w8a8_available(void) {
#if defined(__AVX512VNNI__)
    return 1;
#else
    return 0;
#endif
}

/* Twelve accumulators: enough independent vpdpbusd chains to cover the instruction's latency
   at two a cycle (a Zen 5 core: 1233 GOPS one thread, 2458 two). The operand is passed
   through an empty asm each round so that the compiler cannot fold the loop. */
#define PEAK_ACC 12
int64_t qk_int8_peak_ops(int64_t rounds, int n_threads) {
#if defined(__AVX512VNNI__)
    if (n_threads < 1) n_threads = 1;
    int64_t total = 0;
    #pragma omp parallel num_threads(n_threads) reduction(+ : total)
    {
        __m512i a[PEAK_ACC];
        for (int i = 0; i < PEAK_ACC; i++) a[i] = _mm512_set1_epi32(i);
        __m512i x = _mm512_set1_epi32(0x01020304 + omp_get_thread_num());
        const __m512i y = _mm512_set1_epi32(0x05060708);
        for (int64_t r = 0; r < rounds; r++) {
            _Pragma("GCC unroll 12") for (int i = 0; i < PEAK_ACC; i++)
                a[i] = _mm512_dpbusd_epi32(a[i], x, y);
            __asm__ volatile("" : "+v"(x));
        }
        __m512i s = a[0];
        for (int i = 1; i < PEAK_ACC; i++) s = _mm512_add_epi32(s, a[i]);
        volatile int32_t sink = _mm512_reduce_add_epi32(s);  /* keeps the sums live */
        (void)sink;
        total += rounds * PEAK_ACC * 64 * 2;
    }
    return total;
#else
    (void)rounds;
    (void)n_threads;
    return 0;
#endif
}

#if defined(__AVX512VNNI__)
/* Row m of x (K fp32 values) -> Kp codes (zeros past K), returns sx; *sum = sum of codes. */
static void quant_row(const float *x, int64_t K, int64_t Kp, int8_t *q, float *sx, int32_t *sum)
{
    __m512 amax = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16)
        amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_maskz_loadu_ps(tail_mask(K - k), x + k)));
    const float t = _mm512_reduce_max_ps(amax) / 127.0f;
    /* torch: x / scale.clamp_min(tiny), rounded half to even (vcvtps2dq), clamped */
    const __m512 d = _mm512_set1_ps(t > FLT_MIN ? t : FLT_MIN);
    const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
    __m512i s = _mm512_setzero_si512();
    for (int64_t k = 0; k < Kp; k += 16) {
        const __mmask16 m = tail_mask(K - k);
        __m512i c = _mm512_cvtps_epi32(_mm512_div_ps(_mm512_maskz_loadu_ps(m, x + k), d));
        c = _mm512_maskz_mov_epi32(m, _mm512_min_epi32(_mm512_max_epi32(c, lo), hi));
        s = _mm512_add_epi32(s, c);
        _mm_mask_storeu_epi8(q + k, tail_mask(Kp - k), _mm512_cvtepi32_epi8(c));
    }
    *sx = t;
    *sum = _mm512_reduce_add_epi32(s);
}

/* acc[m] (16 lanes: rows 16 t + l) = sum over the W words of tile w (Kp = 4 W) of the MB
   activation rows' codes xq (row stride Kp) times the tile's bytes. Small MB keeps NA
   accumulators a row (vpdpbusd's latency), summed at the end. */
static inline __attribute__((always_inline)) void w8a8_tile(
    int MB, const int32_t *w, const int8_t *xq, int64_t Kp, int64_t W, __m512i *acc)
{
    enum { NA = 4 };
    const int na = MB <= 2 ? 4 : MB <= 4 ? 2 : 1;
    __m512i a[W8A8_MB][NA];
    for (int m = 0; m < MB; m++)
        for (int i = 0; i < NA; i++) a[m][i] = _mm512_setzero_si512();
    int64_t j = 0;
    for (; j + 4 <= W; j += 4) {
        prefetch_words(w, j);
        prefetch_words(w, j + 2);
        _Pragma("GCC unroll 4") for (int u = 0; u < 4; u++) {
            const __m512i wv = _mm512_loadu_si512((const void *)(w + (j + u) * 16));
            const int i = na == 4 ? u : na == 2 ? (u & 1) : 0;
            _Pragma("GCC unroll 8") for (int m = 0; m < MB; m++)
                a[m][i] = _mm512_dpbusd_epi32(a[m][i], wv, bcast_i32(xq + m * Kp + (j + u) * 4));
        }
    }
    for (; j < W; j++) {
        const __m512i wv = _mm512_loadu_si512((const void *)(w + j * 16));
        for (int m = 0; m < MB; m++)
            a[m][0] = _mm512_dpbusd_epi32(a[m][0], wv, bcast_i32(xq + m * Kp + j * 4));
    }
    for (int m = 0; m < MB; m++) {
        __m512i s = a[m][0];
        for (int i = 1; i < na; i++) s = _mm512_add_epi32(s, a[m][i]);
        acc[m] = s;
    }
}
#endif

int qk_w8a8_quant_tokens(const float *x, int64_t M, int64_t K, int64_t x_stride, int8_t *codes,
                         int64_t Kp, float *scales, int32_t *sums, int n_threads)
{
#if !defined(__AVX512VNNI__)
    (void)x; (void)M; (void)K; (void)x_stride; (void)codes; (void)Kp; (void)scales; (void)sums;
    (void)n_threads;
    return 4;
#else
    if (M < 0 || K < 1 || Kp < K || Kp % 4) return 1;
    #pragma omp parallel for schedule(static) num_threads(n_threads) if (M * K > 65536)
    for (int64_t m = 0; m < M; m++)
        quant_row(x + m * x_stride, K, Kp, codes + m * Kp, scales + m, sums + m);
    return 0;
#endif
}

int qk_w8a8_gemm(const float *x, int64_t M, int64_t K, int64_t x_stride, const uint8_t *wr,
                 int64_t Kp, const float *scale, const float *bias, int64_t N, float *y,
                 int64_t y_stride, int n_threads)
{
#if !defined(__AVX512VNNI__)
    (void)x; (void)M; (void)K; (void)x_stride; (void)wr; (void)Kp; (void)scale; (void)bias;
    (void)N; (void)y; (void)y_stride; (void)n_threads;
    return 4;
#else
    if (M < 0 || N < 1 || K < 1 || Kp < K || Kp % 4 || Kp - K >= 4) return 1;
    if (M == 0) return 0;
    const int64_t W = Kp / 4, tiles = (N + 15) / 16;
    int8_t *xq = (int8_t *)aligned_alloc(64, (size_t)((M * Kp + 63) / 64 * 64 + 64));
    float *sx = (float *)aligned_alloc(64, (size_t)((M * 4 + 63) / 64 * 64 + 64));
    int32_t *sq = (int32_t *)aligned_alloc(64, (size_t)((M * 4 + 63) / 64 * 64 + 64));
    if (!xq || !sx || !sq) {
        free(xq);
        free(sx);
        free(sq);
        return 2;
    }
    #pragma omp parallel num_threads(n_threads)
    {
        #pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++)
            quant_row(x + m * x_stride, K, Kp, xq + m * Kp, sx + m, sq + m);
        #pragma omp for schedule(static)
        for (int64_t tl = 0; tl < tiles; tl++) {
            const int32_t *w = (const int32_t *)wr + tl * W * 16;
            const int64_t n0 = tl * 16;
            const __m512 s = _mm512_loadu_ps(scale + n0);
            const __m512 b = bias ? _mm512_loadu_ps(bias + n0) : _mm512_setzero_ps();
            const __mmask16 keep = tail_mask(N - n0);
            for (int64_t m0 = 0; m0 < M; m0 += W8A8_MB) {
                const int64_t mb = M - m0 < W8A8_MB ? M - m0 : W8A8_MB;
                __m512i acc[W8A8_MB];
                const int8_t *xc = xq + m0 * Kp;
#define TILE(MB) w8a8_tile(MB, w, xc, Kp, W, acc)
                QK_ROWS_1_TO_8(mb, TILE);
#undef TILE
                for (int64_t i = 0; i < mb; i++) {
                    const int64_t m = m0 + i;
                    const __m512i exact = _mm512_sub_epi32(acc[i], _mm512_set1_epi32(128 * sq[m]));
                    /* (float(acc) * sx) * sw, then + bias: separate roundings, never an FMA
                       (the _round forms are not contracted) */
                    __m512 v = _mm512_mul_round_ps(_mm512_cvtepi32_ps(exact), _mm512_set1_ps(sx[m]),
                                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                    v = _mm512_mul_round_ps(v, s, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                    if (bias) v = _mm512_add_round_ps(v, b, _MM_FROUND_TO_NEAREST_INT |
                                                            _MM_FROUND_NO_EXC);
                    _mm512_mask_storeu_ps(y + m * y_stride + n0, keep, v);
                }
            }
        }
    }
    free(xq);
    free(sx);
    free(sq);
    return 0;
#endif
}
