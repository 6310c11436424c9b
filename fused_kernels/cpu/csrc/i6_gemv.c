/* i6_gemv.c: the lm_head in 6 bits (`quantkit.runtime.head.Int6Head`, `--head-dtype int6`):
   y [M, N] = q(x) [M, K] @ (C * s).T for up to 16 activation rows, C the weight's 6-bit codes
   (-31..31) and s one fp16 scale per row and group of 32 elements (absmax / 31). 6.5 bits a
   weight where the int8 head (`qk_i8i8_gemv`) reads 8 and a scale per row: the head is the
   largest single read of a decode step (SmolLM2-135M: 28 of 98 MB; a 128k-vocabulary 1B: a
   third), and decode at batch 1 runs at the memory's pace. Held-out perplexity of the
   embedded INT4 model: +0.40% over the int8 head (both with int8 activations); a scale per
   row instead of per 32 elements cost 1.8%.

   x is quantized to int8 per block of 32 as the int8 GEMVs do it (`quantize_block_i8`: t =
   absmax / 127, q = round(x / t)); a group's integer sum goes through vpdpbusd with the codes
   offset to u = C + 32 (0..63, unsigned bytes), then t (acc - 32 sum(q)) * s in fp32.

   Layout (`I6Weight`): 16 weight rows interleaved as the int8 head's words (word j of tile t:
   elements 4j..4j+3 of rows 16t..16t+15, byte 4l + e = row l's element 4j + e), a group's 8
   words as two quads of 3 vectors: the low 4 bits of words 0 and 1 (low and high nibble of
   each byte), of words 2 and 3, then the top 2 bits of all four (bits 2k..2k+1: word k). So a
   group of a tile is 384 bytes (16 x 32 x 6 bits), its scales 16 fp16 values.

   A row's result depends on that row only (integer sums are exact, the fp32 work is per row):
   logits of one row are the same bits in any call. Needs AVX512-VNNI; other builds return 4.
   Return value: 0, 1 = bad arguments, 2 = out of memory, 4 = not in this build. */

#include "common.h"
#include "quantkit_kernels.h"

#define I6_GROUP 32
#define I6_GROUP_BYTES 384
#define I6_MAX_M 16
#define I6_MB HEAD_MB
#define I6_PF_GROUPS 6  /* software prefetch distance: 2.3 KB ahead in the tile's stream */

int qk_i6i8_gemv_available(void) {
#if defined(__AVX512VNNI__)
    return 1;
#else
    return 0;
#endif
}

#if defined(__AVX512VNNI__)
/* The 16 rows of one tile against MB activation rows: res[m] lane l = row 16t + l. */
static inline __attribute__((always_inline)) void i6_tile(
    int MB, const uint8_t *w, const uint16_t *sc, const int8_t *xq, const float *xt, int64_t G,
    __m512 *res)
{
    const __m512i nib = _mm512_set1_epi8(0x0F), top = _mm512_set1_epi8(0x30);
    for (int m = 0; m < MB; m++) res[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const uint8_t *p = w + g * I6_GROUP_BYTES;
        for (int c = 0; c < I6_GROUP_BYTES; c += 64)
            __builtin_prefetch(p + I6_PF_GROUPS * I6_GROUP_BYTES + c, 0, 3);
        __m512i acc[I6_MB];
        for (int m = 0; m < MB; m++) acc[m] = _mm512_setzero_si512();
        for (int h = 0; h < 2; h++) {
            const __m512i a = _mm512_loadu_si512((const void *)(p + 192 * h));
            const __m512i b = _mm512_loadu_si512((const void *)(p + 192 * h + 64));
            const __m512i c = _mm512_loadu_si512((const void *)(p + 192 * h + 128));
            /* u = low 4 bits | top 2 bits << 4: (x & nib) | y by one vpternlogd (0xEA) */
            __m512i u[4];
            u[0] = _mm512_ternarylogic_epi32(a, nib, _mm512_and_si512(_mm512_slli_epi16(c, 4), top), 0xEA);
            u[1] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(a, 4), nib,
                                             _mm512_and_si512(_mm512_slli_epi16(c, 2), top), 0xEA);
            u[2] = _mm512_ternarylogic_epi32(b, nib, _mm512_and_si512(c, top), 0xEA);
            u[3] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(b, 4), nib,
                                             _mm512_and_si512(_mm512_srli_epi16(c, 2), top), 0xEA);
            const int64_t j = 8 * g + 4 * h;
            for (int k = 0; k < 4; k++) {
                _Pragma("GCC unroll 8") for (int m = 0; m < MB; m++)
                    acc[m] = _mm512_dpbusd_epi32(acc[m], u[k], bcast_i32(xq + ((j + k) * MB + m) * 4));
            }
        }
        const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sc + g * 16)));
        _Pragma("GCC unroll 8") for (int m = 0; m < MB; m++) {
            /* t acc - 32 t sum(q): xt holds t and 32 t sum(q) per group and row */
            const __m512 v = _mm512_fmsub_ps(_mm512_cvtepi32_ps(acc[m]),
                                             _mm512_set1_ps(xt[(g * MB + m) * 2]),
                                             _mm512_set1_ps(xt[(g * MB + m) * 2 + 1]));
            res[m] = _mm512_fmadd_ps(v, s, res[m]);
        }
    }
}
#endif

int qk_i6i8_gemv(const float *x, int64_t M, int64_t K, int64_t x_stride, const uint8_t *w,
                 const uint16_t *scale, int64_t N, float *y, int64_t y_stride, int n_threads,
                 int64_t *best)
{
#if !defined(__AVX512VNNI__)
    (void)x; (void)M; (void)K; (void)x_stride; (void)w; (void)scale; (void)N; (void)y;
    (void)y_stride; (void)n_threads; (void)best;
    return 4;
#else
    if (M < 1 || M > I6_MAX_M || K < I6_GROUP || K % I6_GROUP || N < 1 || n_threads < 1)
        return 1;
    const int64_t G = K / I6_GROUP;
    /* the activations' codes and per group {t, 32 t sum(q)}: `head_rows_i8` */
    head_work h;
    if (head_work_alloc(M, K, G, best, n_threads, &h)) return 2;
    #pragma omp parallel num_threads(n_threads)
    {
        best16 seen[I6_MAX_M];  /* the best tokens as stored, when asked (`best16`) */
        for (int64_t m = 0; best && m < M; m++) best16_init(&seen[m]);
        head_rows_i8(x, M, K, x_stride, I6_GROUP, 32.0f, h.xq, h.xt);
        #pragma omp for schedule(static)
        for (int64_t tl = 0; tl < (N + 15) / 16; tl++) {
            const uint8_t *wt = w + tl * G * I6_GROUP_BYTES;
            const uint16_t *st = scale + tl * G * 16;
            for (int64_t m0 = 0; m0 < M; m0 += I6_MB) {
                const int64_t mb = M - m0 < I6_MB ? M - m0 : I6_MB;
                __m512 res[I6_MB];
                const int8_t *xc = h.xq + m0 * K;
                const float *tc = h.xt + m0 * G * 2;
#define TILE(MB) i6_tile(MB, wt, st, xc, tc, G, res)
                QK_ROWS_1_TO_8(mb, TILE);
#undef TILE
                const int64_t n0 = tl * 16;
                for (int64_t i = 0; i < mb; i++)
                    head_store16(y + (m0 + i) * y_stride, n0, N, res[i],
                                 best ? &seen[m0 + i] : NULL);
            }
        }
        best_parts_put(h.parts, seen, M);
    }
    head_work_end(&h, n_threads, M, best);
    return 0;
#endif
}
