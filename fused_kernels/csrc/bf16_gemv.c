/* bf16_gemv.c: the CPU bf16 GEMV (`bf16_gemv_cpu`): y [M, N] = bf16(x) [M, K] @ W.T in fp32, for
   a bf16 weight W [N, K] and a few fp32 activation rows. It serves the lm_head of a quantized
   model, the largest single read of a decode step (SmolLM2-135M: 49152 x 576, 57 MB in bf16).

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

#if defined(__AVX512BF16__)
#define ROWS_PER_TILE 64  /* weight rows a thread takes at a time: 72 KB at K = 576 */
#define PF_ROWS 16  /* software prefetch distance, in weight rows */

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
    #pragma omp parallel for schedule(static) num_threads(n_threads)
    for (int64_t n0 = 0; n0 < N; n0 += ROWS_PER_TILE) {
        int64_t n1 = n0 + ROWS_PER_TILE < N ? n0 + ROWS_PER_TILE : N;
        for (int64_t m0 = 0; m0 < M; m0 += 8) {
            int mb = M - m0 < 8 ? (int)(M - m0) : 8;
            const uint16_t *xc = xb + m0 * kv * 32;
            for (int64_t n = n0; n < n1; n += 2) {
                int64_t nb = n + 1 < n1 ? n + 1 : n;  /* an odd last row pairs with itself */
                float ya[8], yb[8];
                const uint16_t *wa = w + n * w_stride, *wb = w + nb * w_stride;
#define PAIR(MB) row_pair(MB, xc, K, kv, wa, wb, pf, ya, yb)
                switch (mb) {
                    case 1: PAIR(1); break;
                    case 2: PAIR(2); break;
                    case 3: PAIR(3); break;
                    case 4: PAIR(4); break;
                    case 5: PAIR(5); break;
                    case 6: PAIR(6); break;
                    case 7: PAIR(7); break;
                    default: PAIR(8); break;
                }
#undef PAIR
                for (int m = 0; m < mb; m++) {
                    y[(m0 + m) * y_stride + n] = ya[m];
                    y[(m0 + m) * y_stride + nb] = yb[m];
                }
            }
        }
    }
    free(xb);
    return 0;
#endif
}
