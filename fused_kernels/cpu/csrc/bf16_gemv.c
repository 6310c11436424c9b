/* bf16_gemv.c: the CPU head GEMVs (`bf16_gemv_cpu`): y [M, N] = bf16(x) [M, K] @ W.T in fp32, for
   a bf16 weight W [N, K] and a few fp32 activation rows, and (`qk_i8_gemv`, at the end) the same
   for an int8 weight with a scale per row. They serve the lm_head of a quantized model, the
   largest single read of a decode step (SmolLM2-135M: 49152 x 576, 57 MB in bf16, 28 in int8).

   Why not oneDNN. torch's bf16 `F.linear` on the same operands ran 1.77 ms for one row and 2.34
   ms for 8 (2 threads, AVX512-BF16 EPYC): the 8-row call paid ~0.6 ms of compute over the one-row
   stream. Here each weight row is read once per call and multiplied into up to 8 activation rows
   (vdpbf16ps: 32 products a row per instruction, summed in fp32), two weight rows at a time so
   each activation vector loaded serves both. x is rounded to bf16 (to nearest even) once, as
   `x.to(torch.bfloat16)` does; the outputs stay fp32 where oneDNN's are rounded to bf16.

   Needs AVX512-BF16 (the `avx512` build on a CPU with avx512_bf16, see `cpu_build`); other
   builds return 4 and the caller keeps torch. Return value: 0, 2 = out of memory, 4 = not in
   this build. */

#include "common.h"
#include "quantkit_kernels.h"

#define ROWS_PER_TILE 64  /* weight rows a thread takes at a time: 72 KB at K = 576 in bf16 */
#define PF_ROWS 16  /* software prefetch distance, in weight rows */

/* The loop both kernels share: weight rows in tiles of ROWS_PER_TILE per thread, activation
   rows 8 at a time, weight rows in pairs (`PAIR(MB)`, defined by the caller over wa, wb and
   m0, giving ya and yb), each pair's sums times sa / sb (the row scales, or 1) into y. */
#define HEAD_ROWS(WT, sa, sb)                                                              \
    _Pragma("omp parallel for schedule(static) num_threads(n_threads)")                    \
    for (int64_t n0 = 0; n0 < N; n0 += ROWS_PER_TILE) {                                    \
        int64_t n1 = n0 + ROWS_PER_TILE < N ? n0 + ROWS_PER_TILE : N;                      \
        for (int64_t m0 = 0; m0 < M; m0 += 8) {                                            \
            int mb = M - m0 < 8 ? (int)(M - m0) : 8;                                       \
            for (int64_t n = n0; n < n1; n += 2) {                                         \
                int64_t nb = n + 1 < n1 ? n + 1 : n; /* an odd last row pairs with itself */ \
                float ya[8], yb[8];                                                        \
                const WT *wa = w + n * w_stride, *wb = w + nb * w_stride;                  \
                QK_ROWS_1_TO_8(mb, PAIR);                                                  \
                for (int m = 0; m < mb; m++) {                                             \
                    y[(m0 + m) * y_stride + n] = ya[m] * (sa);                             \
                    y[(m0 + m) * y_stride + nb] = yb[m] * (sb);                            \
                }                                                                          \
            }                                                                              \
        }                                                                                  \
    }

#if defined(__AVX512BF16__)
/* y[m][na], y[m][nb] for the MB (<= 8) rows of xb (bf16, kv vectors of 32 each, zero-padded). */
static inline __attribute__((always_inline)) void row_pair(
    int MB, const uint16_t *xb, int64_t K, int64_t kv, const uint16_t *wa, const uint16_t *wb,
    int64_t pf, float *ya, float *yb)
{
    __m512 acc[2][8];
    for (int m = 0; m < 8; m++) acc[0][m] = acc[1][m] = _mm512_setzero_ps();
    for (int64_t v = 0; v < kv; v++) {
        __builtin_prefetch(wa + v * 32 + pf, 0, 2);
        __builtin_prefetch(wb + v * 32 + pf, 0, 2);
        __mmask32 k = v * 32 + 32 <= K ? 0xFFFFFFFFu : (__mmask32)((1ull << (K - v * 32)) - 1);
        __m512bh a = (__m512bh)_mm512_maskz_loadu_epi16(k, wa + v * 32);
        __m512bh b = (__m512bh)_mm512_maskz_loadu_epi16(k, wb + v * 32);
        _Pragma("GCC unroll 8") for (int m = 0; m < MB; m++) {
            __m512bh xv = (__m512bh)_mm512_loadu_si512(xb + (m * kv + v) * 32);
            acc[0][m] = _mm512_dpbf16_ps(acc[0][m], a, xv);
            acc[1][m] = _mm512_dpbf16_ps(acc[1][m], b, xv);
        }
    }
    float ra[8] = {0}, rb[8] = {0};
    hsum8_add(acc[0], ra);
    hsum8_add(acc[1], rb);
    for (int m = 0; m < MB; m++) ya[m] = ra[m], yb[m] = rb[m];
}
#endif

/* 1 when this build has the kernel (AVX512-BF16), else 0. */
int qk_bf16_gemv_available(void) {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

/* y [M, N] (fp32, row stride y_stride) = bf16(x) [M, K] (fp32, row stride x_stride) @ W.T,
   W bf16 [N, K] (row stride w_stride). */
int qk_bf16_gemv(const float *x, int64_t M, int64_t K, int64_t x_stride, const uint16_t *w,
                 int64_t N, int64_t w_stride, float *y, int64_t y_stride, int n_threads)
{
#if !defined(__AVX512BF16__)
    (void)x; (void)M; (void)K; (void)x_stride; (void)w; (void)N; (void)w_stride; (void)y;
    (void)y_stride; (void)n_threads;
    return 4;
#else
    const int64_t kv = (K + 31) / 32, pf = PF_ROWS * w_stride;
    uint16_t *xb = (uint16_t *)aligned_alloc(64, (size_t)(M * kv * 64 + 64));
    if (!xb) return 2;
    for (int64_t m = 0; m < M; m++)
        for (int64_t v = 0; v < kv; v++) {
            const float *src = x + m * x_stride + v * 32;
            int64_t left = K - v * 32;
            __m512 lo = _mm512_maskz_loadu_ps(tail_mask(left), src);
            __m512 hi = _mm512_maskz_loadu_ps(tail_mask(left - 16), src + 16);
            _mm512_storeu_si512(xb + (m * kv + v) * 32, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
#define PAIR(MB) row_pair(MB, xb + m0 * kv * 32, K, kv, wa, wb, pf, ya, yb)
    HEAD_ROWS(uint16_t, 1.0f, 1.0f);
#undef PAIR
    free(xb);
    return 0;
#endif
}

/* ---- int8 weights: y [M, N] = x [M, K] @ (W8 * scale[:, None]).T, all in fp32 ----

   For `--head-dtype int8`: the head's rows rounded to int8 with a scale per row (absmax / 127),
   half the bytes of bf16. x stays fp32; each weight is widened to fp32 (vpmovsxbd + vcvtdq2ps)
   and multiplied into up to 8 activation rows, two weight rows at a time so each activation
   vector loaded serves both, and the row's scale multiplies the sum once. Needs AVX-512F. */

#if defined(__AVX512F__)
static inline __attribute__((always_inline)) __m512 i8_load16(const int8_t *p, __mmask16 k) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(k, p)));
}

static inline __attribute__((always_inline)) void i8_row_pair(
    int MB, const float *x, int64_t x_stride, int64_t K, const int8_t *wa, const int8_t *wb,
    int64_t pf, float *ya, float *yb)
{
    __m512 acc[2][8];
    for (int m = 0; m < 8; m++) acc[0][m] = acc[1][m] = _mm512_setzero_ps();
#define I8_STEP(k0, k)                                                                \
    do {                                                                              \
        __m512 a = i8_load16(wa + (k0), k), b = i8_load16(wb + (k0), k);              \
        _Pragma("GCC unroll 8") for (int m = 0; m < MB; m++) {                        \
            __m512 xv = _mm512_maskz_loadu_ps(k, x + m * x_stride + (k0));            \
            acc[0][m] = _mm512_fmadd_ps(a, xv, acc[0][m]);                            \
            acc[1][m] = _mm512_fmadd_ps(b, xv, acc[1][m]);                            \
        }                                                                             \
    } while (0)
    int64_t k0 = 0;
    for (; k0 + 64 <= K; k0 += 64) {  /* a line of each row a step, no masks */
        __builtin_prefetch(wa + k0 + pf, 0, 2);
        __builtin_prefetch(wb + k0 + pf, 0, 2);
        I8_STEP(k0, 0xFFFF);
        I8_STEP(k0 + 16, 0xFFFF);
        I8_STEP(k0 + 32, 0xFFFF);
        I8_STEP(k0 + 48, 0xFFFF);
    }
    for (; k0 < K; k0 += 16) I8_STEP(k0, tail_mask(K - k0));
#undef I8_STEP
    float ra[8] = {0}, rb[8] = {0};
    hsum8_add(acc[0], ra);
    hsum8_add(acc[1], rb);
    for (int m = 0; m < MB; m++) ya[m] = ra[m], yb[m] = rb[m];
}
#endif

/* 1 when this build has the int8 kernel (AVX-512F), else 0. */
int qk_i8_gemv_available(void) {
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

/* y [M, N] (fp32, row stride y_stride) = x [M, K] (fp32, row stride x_stride) @ (W8 * s).T,
   W8 int8 [N, K] (row stride w_stride), s fp32 [N]. */
int qk_i8_gemv(const float *x, int64_t M, int64_t K, int64_t x_stride, const int8_t *w,
               const float *scale, int64_t N, int64_t w_stride, float *y, int64_t y_stride,
               int n_threads)
{
#if !defined(__AVX512F__)
    (void)x; (void)M; (void)K; (void)x_stride; (void)w; (void)scale; (void)N; (void)w_stride;
    (void)y; (void)y_stride; (void)n_threads;
    return 4;
#else
    const int64_t pf = 2 * PF_ROWS * w_stride;  /* the same bytes ahead as the bf16 kernel */
#define PAIR(MB) i8_row_pair(MB, x + m0 * x_stride, x_stride, K, wa, wb, pf, ya, yb)
    HEAD_ROWS(int8_t, scale[n], scale[nb]);
#undef PAIR
    return 0;
#endif
}

/* ---- int8 x int8: y [M, N] = q(x) [M, K] @ (W8 * scale[:, None]).T (`qk_i8i8_gemv`) ----

   The int8 head on VNNI: x quantized to int8 per block (t = absmax / 127, q = round(x / t) to
   nearest even, clamped to +-127), W8 + 128 as unsigned bytes with 16 rows interleaved, so one
   64-byte load is 4 elements of 16 rows and one vpdpbusd per activation row multiplies them by
   its 4 codes broadcast to all lanes. Each lane sums integers over a block; per block the fp32
   work is t (acc - 128 sum(q)) (the + 128 undone), and the row scales multiply once at the end.
   No horizontal sums: lane l is row l's result. A row's result does not depend on the others
   in the call (integer sums are exact, the fp32 work is per row), so it is row-invariant. */

#define I8I8_MAX_M 16
#define I8I8_MB HEAD_MB

int qk_i8i8_gemv_available(void) {
#if defined(__AVX512VNNI__)
    return 1;
#else
    return 0;
#endif
}

#if defined(__AVX512VNNI__)
static inline __attribute__((always_inline)) void i8i8_tile(
    int MB, const int32_t *w, const int8_t *xq, const float *xt, int64_t W, int64_t wpb,
    __m512 *res)
{
    enum { NA = 2 };
    const int na = MB <= 4 ? 2 : 1;  /* accumulators a row (latency at small MB) */
    for (int m = 0; m < MB; m++) res[m] = _mm512_setzero_ps();
    for (int64_t j0 = 0, b = 0; j0 < W; j0 += wpb, b++) {
        __m512i acc[I8I8_MB][NA];
        for (int m = 0; m < MB; m++) acc[m][0] = acc[m][1] = _mm512_setzero_si512();
        for (int64_t j = j0; j < j0 + wpb; j += 2) {  /* wpb = block / 4: 8, 16 or 32 */
            prefetch_words(w, j);
            prefetch_words(w, j + 1);
            __m512i w0 = _mm512_loadu_si512((const void *)(w + j * 16));
            __m512i w1 = _mm512_loadu_si512((const void *)(w + (j + 1) * 16));
            _Pragma("GCC unroll 8") for (int m = 0; m < MB; m++) {
                acc[m][0] = _mm512_dpbusd_epi32(acc[m][0], w0, bcast_i32(xq + (j * MB + m) * 4));
                acc[m][na - 1] = _mm512_dpbusd_epi32(acc[m][na - 1], w1,
                                                     bcast_i32(xq + ((j + 1) * MB + m) * 4));
            }
        }
        _Pragma("GCC unroll 8") for (int m = 0; m < MB; m++) {
            __m512i a = na == 2 ? _mm512_add_epi32(acc[m][0], acc[m][1]) : acc[m][0];
            /* t acc - 128 t sum(q): xt holds t and 128 t sum(q) per block and row */
            res[m] = _mm512_add_ps(res[m], _mm512_fmsub_ps(
                _mm512_cvtepi32_ps(a), _mm512_set1_ps(xt[(b * MB + m) * 2]),
                _mm512_set1_ps(xt[(b * MB + m) * 2 + 1])));
        }
    }
}
#endif

int qk_i8i8_gemv(const float *x, int64_t M, int64_t K, int64_t x_stride, const uint8_t *wr,
                 const float *scale, int64_t N, int64_t block, float *y, int64_t y_stride,
                 int n_threads, int64_t *best)
{
#if !defined(__AVX512VNNI__)
    (void)x; (void)M; (void)K; (void)x_stride; (void)wr; (void)scale; (void)N; (void)block;
    (void)y; (void)y_stride; (void)n_threads; (void)best;
    return 4;
#else
    if (M < 1 || M > I8I8_MAX_M || K % block || block % 32 || block > 128 || n_threads < 1)
        return 1;
    const int64_t nb = K / block, W = K / 4, wpb = block / 4;
    /* the activations' codes and per block {t, 128 t sum(q)}: `head_rows_i8` */
    head_work h;
    if (head_work_alloc(M, K, nb, best, n_threads, &h)) return 2;
    #pragma omp parallel num_threads(n_threads)
    {
        best16 seen[I8I8_MAX_M];  /* the best tokens as stored, when asked (`best16`) */
        for (int64_t m = 0; best && m < M; m++) best16_init(&seen[m]);
        head_rows_i8(x, M, K, x_stride, block, 128.0f, h.xq, h.xt);
        #pragma omp for schedule(static)
        for (int64_t tl = 0; tl < (N + 15) / 16; tl++) {
            const int32_t *w = (const int32_t *)wr + tl * W * 16;
            const __m512 s = _mm512_loadu_ps(scale + tl * 16);
            for (int64_t m0 = 0; m0 < M; m0 += I8I8_MB) {
                const int64_t mb = M - m0 < I8I8_MB ? M - m0 : I8I8_MB;
                __m512 res[I8I8_MB];
                const int8_t *xc = h.xq + m0 * K;
                const float *tc = h.xt + m0 * nb * 2;
#define TILE(MB) i8i8_tile(MB, w, xc, tc, W, wpb, res)
                QK_ROWS_1_TO_8(mb, TILE);
#undef TILE
                /* a row's 16 results straight into y, one masked store (as the INT4 tile) */
                const int64_t n0 = tl * 16;
                for (int64_t i = 0; i < mb; i++)
                    head_store16(y + (m0 + i) * y_stride, n0, N, _mm512_mul_ps(res[i], s),
                                 best ? &seen[m0 + i] : NULL);
            }
        }
        best_parts_put(h.parts, seen, M);
    }
    head_work_end(&h, n_threads, M, best);
    return 0;
#endif
}
