/* fp8.c: the CPU FP8 kernels, compiled once per machine by `cpu_build` (gcc + ctypes). The
   exported functions and the layer struct are declared in `quantkit_kernels.h`.

   The weights are read as compressed-tensors stores them: `weight` float8_e4m3fn [N, K] (one
   byte per weight, passed as uint8) and `weight_scale` [N, 1] (one scale per output row).

   - `qk_fp8_gemv`: y [M, N] = x [M, K] @ (w8 * s).T (+ bias) for small M (decode). Streams each
     weight row once per chunk of <= 4 activation rows; OpenMP over output rows. With `act_quant`
     (W8A8) each activation row is first rounded to fp8 with its own scale (row absmax / 448),
     bit-identical to `quantkit.format.packing.quantize_fp8_per_token`, and
     y = (x8 @ w8.T) * sx * sw.
   - `qk_fp8_gemv_layer`: the same with the layer's arguments in a struct bound once.
   - `qk_fp8_dequant`: rows [n0, n1) of w8 * s as fp32 (s = 1 when scale is NULL), bit-identical
     to `quantkit.format.packing.dequantize_fp8` (NaN codes included); the prefill path hands
     these to MKL.
   - `qk_fp8_quant_tokens`: the per-token activation quantization alone (codes and scales).
   - `qk_fp8_nan_rows`: flags the rows holding a NaN code (0x7F / 0xFF).

   e4m3 -> fp32 in registers, exactly. A code b (sign, 4 exponent bits with bias 7, 3 mantissa
   bits) sign-extended to 16 bits and shifted left by 7 puts the sign at bit 15, the exponent at
   bits 13..10 and the mantissa at bits 9..7; `& 0xBF80` clears bit 14. Read as IEEE fp16 (5
   exponent bits, bias 15) that is exactly b / 2^8, subnormals included (an e4m3 subnormal m * 2^-9
   becomes the fp16 subnormal m * 2^-17) and zero and -0 too; `vcvtph2ps` widens it to fp32
   exactly. So 16 weights cost a sign-extending load, a shift, an and and one conversion, no
   fp32 denormal is ever formed (the result does not depend on DAZ/FTZ), and the 2^8 folds into
   the row's scale (exact: a power of two). The one code this misreads is NaN (0x7F reads as
   480): the GEMV does not test for it per weight; a NaN code sets that row's scale to NaN
   instead (`qk_fp8_nan_rows`, at bind time), which gives the reference's NaN row. The dequantize
   path patches NaN lanes directly, so it is bit-exact for all 256 codes.

   dtype codes: 0 = fp32, 1 = bf16, 2 = fp16 (x, scales, bias, output). Return value: 0 on
   success, 2 = out of memory. */

#include "common.h"
#include "quantkit_kernels.h"

/* BLK codes (one 64-byte line with AVX-512) per inner step; VEC lanes per vector and the VF_*
   macros come from `common.h`. */
#if defined(__AVX512F__)
/* 32 codes -> two vectors of fp32 values, each code / 2^8 (see the comment at the top): one
   widening load, one shift and one and for both halves. Converting 16 at a time (a load, shift
   and and per vector) moved 39.9 instead of 41.2 GB/s at 4096x14336, M = 1, 2 threads. */
static inline void cvt_codes2(const uint8_t *p, __m512 *lo, __m512 *hi) {
    __m512i h = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)p));
    h = _mm512_and_si512(_mm512_slli_epi16(h, 7), _mm512_set1_epi16((short)0xBF80));
    *lo = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
    *hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
}
/* The same, and NaN codes patched to torch's NaN (0x3FF00000 | 0x40000000 = 0x7FF00000). */
static inline __m512 cvt_codes_exact(const uint8_t *p) {
    __m256i h = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
    h = _mm256_and_si256(_mm256_slli_epi16(h, 7), _mm256_set1_epi16((short)0xBF80));
    __m512i v = _mm512_castps_si512(_mm512_cvtph_ps(h));
    __mmask16 nan = _mm256_cmpeq_epi16_mask(
        _mm256_and_si256(h, _mm256_set1_epi16(0x3F80)), _mm256_set1_epi16(0x3F80));
    v = _mm512_mask_or_epi32(v, nan, v, _mm512_set1_epi32(0x40000000));
    return _mm512_castsi512_ps(v);
}
#define ACC_PER_ROW(MB) 4
#elif defined(__AVX2__)
static inline void cvt_codes2(const uint8_t *p, __m256 *lo, __m256 *hi) {
    __m256i h = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
    h = _mm256_and_si256(_mm256_slli_epi16(h, 7), _mm256_set1_epi16((short)0xBF80));
    *lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
    *hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
}
static inline __m256 cvt_codes_exact(const uint8_t *p) {
    __m128i h = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)p));
    h = _mm_and_si128(_mm_slli_epi16(h, 7), _mm_set1_epi16((short)0xBF80));
    __m256i v = _mm256_castps_si256(_mm256_cvtph_ps(h));
    __m128i nan = _mm_cmpeq_epi16(_mm_and_si128(h, _mm_set1_epi16(0x3F80)),
                                  _mm_set1_epi16(0x3F80));
    __m256i fix = _mm256_and_si256(_mm256_cvtepi16_epi32(nan), _mm256_set1_epi32(0x40000000));
    return _mm256_castsi256_ps(_mm256_or_si256(v, fix));
}
/* 16 ymm registers: 4 accumulators at MB = 1, 2 per activation row above */
#define ACC_PER_ROW(MB) ((MB) == 1 ? 4 : 2)
#endif
#define BLK 64

/* Activation floats per K tile, for all MB rows together: 8192 floats = 32 KB stay in L1
   while a tile of weight rows streams past (as in the INT4 GEMV: without K tiles x falls out
   of L1 at K = 14336). */
#define KT_FLOATS 8192
/* Weight rows per scheduling unit (as in the INT4 GEMV). */
#define RT 32

/* res[m] += x[m, k0:k1] . w[k0:k1] / 2^8 for MB (1..4) rows; xc[m] = row m of the fp32
   activations (K padded with zeros to a multiple of BLK); k0, k1 multiples of BLK except that
   k1 may be the padded end, in which case the row's last partial block is read through a
   zero-padded copy (the row is never read past K). Prefetches `pf` bytes ahead every line. */
static inline __attribute__((always_inline)) void gemv_tile(
    int MB, const float *xc, int64_t kp, int64_t k0, int64_t k1, const uint8_t *wrow,
    int64_t K, int64_t pf, float *res)
{
#if defined(__AVX512F__) || defined(__AVX2__)
    vf acc[4][4];
    const int nacc = ACC_PER_ROW(MB);
    for (int m = 0; m < MB; m++)
        for (int a = 0; a < 4; a++) acc[m][a] = VF_ZERO();
#define FP8_BLOCK(codes, k)                                                         \
    do {                                                                            \
        _Pragma("GCC unroll 4") for (int j = 0; j < BLK / VEC; j += 2) {            \
            vf w[2];                                                                \
            cvt_codes2((codes) + j * VEC, &w[0], &w[1]);                            \
            _Pragma("GCC unroll 2") for (int h = 0; h < 2; h++) {                   \
                int a = (j + h) % nacc;                                             \
                const float *xk = xc + (k) + (j + h) * VEC;                         \
                _Pragma("GCC unroll 4") for (int m = 0; m < MB; m++)                \
                    acc[m][a] = VF_FMA(w[h], VF_LOAD(xk + m * kp), acc[m][a]);      \
            }                                                                       \
        }                                                                           \
    } while (0)
    int64_t kfull = K & ~(int64_t)(BLK - 1), kend = k1 < kfull ? k1 : kfull, k = k0;
    for (; k < kend; k += BLK) {
        __builtin_prefetch(wrow + k + pf, 0, 2);
        FP8_BLOCK(wrow + k, k);
    }
    if (k < k1 && k < K) {  /* the row's partial last block */
        uint8_t tmp[BLK] = {0};
        memcpy(tmp, wrow + k, (size_t)(K - k));
        FP8_BLOCK(tmp, k);
    }
#undef FP8_BLOCK
    for (int m = 0; m < MB; m++) {
        vf t = acc[m][0];
        for (int a = 1; a < nacc; a++) t = VF_ADD(t, acc[m][a]);
        res[m] += VF_HSUM(t);
    }
#else
    float acc[4] = {0, 0, 0, 0};
    int64_t kend = k1 < K ? k1 : K;
    for (int64_t k = k0; k < kend; k++) {
        float w = fp8_to_float(wrow[k]) * 0x1p-8f;  /* code / 2^8, as the vector path */
        for (int m = 0; m < MB; m++) acc[m] += w * xc[m * kp + k];
    }
    for (int m = 0; m < MB; m++) res[m] += acc[m];
    (void)pf;
#endif
}

/* Row m of x -> fp32 into xr (padded with zeros to kp). With quant (W8A8): rounded to fp8 with
   one scale per row exactly as quantize_fp8_per_token (absmax / 448, at least 1e-10; x / s,
   clamped to +-448, rounded to even), xr = the fp8 values, codes (if not NULL) = the codes;
   returns the scale (1 without quant). */
static float load_row(const void *x, int x_dt, int64_t row_off, int64_t K, int64_t kp,
                      int quant, float *xr, uint8_t *codes)
{
    for (int64_t k = 0; k < K; k++) xr[k] = load_f(x, row_off + k, x_dt);
    for (int64_t k = K; k < kp; k++) xr[k] = 0.0f;
    if (!quant) return 1.0f;
    float amax = 0.0f;
    int nan = 0;
    for (int64_t k = 0; k < K; k++) {
        float a = bits_f(f_bits(xr[k]) & 0x7FFFFFFF);
        if (a != a) nan = 1;
        else if (a > amax) amax = a;
    }
    if (nan) amax = bits_f(0x7FC00000);  /* torch's amax propagates NaN */
    float s = amax / 448.0f;
    if (s < 1e-10f) s = 1e-10f;  /* the same fp32 constant as clamp(min=1e-10) */
    for (int64_t k = 0; k < K; k++) {
        float v = xr[k] / s;
        v = v > 448.0f ? 448.0f : v < -448.0f ? -448.0f : v;
        uint8_t c = float_to_fp8(v);
        if (codes) codes[k] = c;
        xr[k] = fp8_to_float(c);
    }
    return s;
}

int qk_fp8_gemv(
    const void *x, int x_dt, int64_t M, int64_t K, int64_t x_stride, int act_quant,
    const uint8_t *w, int64_t N, int64_t w_stride, const void *scale, int s_dt,
    int64_t s_stride, const void *bias, int b_dt, void *out, int o_dt, int64_t o_stride,
    int n_threads)
{
    int64_t kp = (K + BLK - 1) / BLK * BLK;
    float *xp = (float *)aligned_alloc(64, (size_t)(M * kp + 16) * sizeof(float));
    float *xs = (float *)malloc((size_t)(M + 1) * sizeof(float));
    if (!xp || !xs) { free(xp); free(xs); return 2; }
    for (int64_t m = 0; m < M; m++)
        xs[m] = load_row(x, x_dt, m * x_stride, K, kp, act_quant, xp + m * kp, NULL);
    /* Dynamic chunks: with other processes on the cores a static split waits for the
       descheduled thread (as measured for the INT4 GEMV). */
    #pragma omp parallel for num_threads(n_threads) schedule(dynamic, 1)
    for (int64_t n0 = 0; n0 < N; n0 += RT) {
        int64_t n1 = n0 + RT < N ? n0 + RT : N;
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
            int64_t mb = M - m0 < 4 ? M - m0 : 4;
            float res[RT][4] = {{0}};
            int64_t kt = (KT_FLOATS / mb) & ~(int64_t)(BLK - 1);
            /* One K tile per row: the tile's rows are one contiguous run, fetch the same spot
               of the next row tile; several K tiles: fetch the next-but-one row (the INT4
               GEMV's measured choice). */
            int64_t pf = (kp > kt ? 2 : RT) * w_stride;
            const float *xc = xp + m0 * kp;
            for (int64_t k0 = 0; k0 < kp; k0 += kt) {
                int64_t k1 = k0 + kt < kp ? k0 + kt : kp;
                for (int64_t n = n0; n < n1; n++) {
                    const uint8_t *wrow = w + n * w_stride;
                    float *r = res[n - n0];
#define TILE(MB) gemv_tile(MB, xc, kp, k0, k1, wrow, K, pf, r)
                    if (mb == 1) TILE(1);
                    else if (mb == 2) TILE(2);
                    else if (mb == 3) TILE(3);
                    else TILE(4);
#undef TILE
                }
            }
            for (int64_t n = n0; n < n1; n++) {
                /* (acc * 2^8) * sx * sw: the reference's order, (x8 @ w8.T) * sx * sw */
                float sw = load_f(scale, n * s_stride, s_dt);
                float bn = bias ? load_f(bias, n, b_dt) : 0.0f;
                for (int64_t t = 0; t < mb; t++) {
                    float v = res[n - n0][t] * 256.0f;
                    v = act_quant ? v * xs[m0 + t] * sw : v * sw;
                    store_f(out, (m0 + t) * o_stride + n, o_dt, v + bn);
                }
            }
        }
    }
    free(xp);
    free(xs);
    return 0;
}

/* qk_fp8_layer, one layer's static arguments bound once: `quantkit_kernels.h`. */
int qk_fp8_gemv_layer(const qk_fp8_layer *L, const void *x, int x_dt, int64_t M,
                      int64_t x_stride, void *out, int o_dt, int64_t o_stride, int n_threads)
{
    return qk_fp8_gemv(x, x_dt, M, L->K, x_stride, (int)L->act_quant, L->w, L->N, L->w_stride,
                       L->scale, (int)L->s_dt, L->s_stride, L->bias, (int)L->b_dt, out, o_dt,
                       o_stride, n_threads);
}

int qk_fp8_dequant(const uint8_t *w, int64_t n0, int64_t n1, int64_t K, int64_t w_stride,
                   const void *scale, int s_dt, int64_t s_stride, float *out, int n_threads)
{
    #pragma omp parallel for num_threads(n_threads) schedule(static)
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *wrow = w + n * w_stride;
        float *orow = out + (n - n0) * K;
        float s = scale ? load_f(scale, n * s_stride, s_dt) : 1.0f;  /* NULL: unit scale */
        int64_t k = 0;
        /* (code / 2^8) * (2^8 * s) rounds once, like torch's w8.float() * s: bit-identical */
#if defined(__AVX512F__)
        __m512 sv = _mm512_set1_ps(s * 256.0f);
        for (; k + VEC <= K; k += VEC)
            _mm512_storeu_ps(orow + k, _mm512_mul_ps(cvt_codes_exact(wrow + k), sv));
#elif defined(__AVX2__)
        __m256 sv = _mm256_set1_ps(s * 256.0f);
        for (; k + VEC <= K; k += VEC)
            _mm256_storeu_ps(orow + k, _mm256_mul_ps(cvt_codes_exact(wrow + k), sv));
#endif
        for (; k < K; k++) orow[k] = fp8_to_float(wrow[k]) * s;
    }
    return 0;
}

int qk_fp8_quant_tokens(const void *x, int x_dt, int64_t M, int64_t K, int64_t x_stride,
                        uint8_t *codes, float *scales)
{
    float *row = (float *)malloc((size_t)(K + 1) * sizeof(float));
    if (!row) return 2;
    for (int64_t m = 0; m < M; m++)
        scales[m] = load_row(x, x_dt, m * x_stride, K, K, 1, row, codes + m * K);
    free(row);
    return 0;
}

int64_t qk_fp8_nan_rows(const uint8_t *w, int64_t N, int64_t K, int64_t w_stride,
                        uint8_t *flags)
{
    int64_t count = 0;
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *wrow = w + n * w_stride;
        uint8_t hit = 0;
        for (int64_t k = 0; k < K; k++) hit |= (uint8_t)((wrow[k] & 0x7F) == 0x7F);
        flags[n] = hit;
        count += hit;
    }
    return count;
}
