/* common.h: the C prelude shared by the CPU kernels (`w4a16.c`, `fp8.c`, `bf16_gemv.c`):
   headers, the dtype codes, exact fp16/bf16/fp8 e4m3 <-> fp32 conversions (as torch rounds),
   and the vector types and macros the GEMVs build on. Each library's translation unit includes
   it first (before any function, for the f16c pragma below), so the libraries stay independent
   while the helpers exist once. Everything here is static: nothing of it is exported.

   dtype codes: 0 = fp32, 1 = bf16, 2 = fp16 (activations, scales, bias, output). */

#ifndef QK_COMMON_H
#define QK_COMMON_H

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AVX2__) && !defined(__AVX512F__)
/* vcvtph2ps on 8 lanes is F16C, present on every AVX2 CPU; -mavx2 alone does not enable it. */
#pragma GCC target("f16c")
#endif

/* DT_I8 names int8 activations only (the INT4 GEMV's VNNI tile, `gemv_tile_i8`): a requested
   act_dt, never a tensor's dtype. */
enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2, DT_I8 = 3 };

static inline float bits_f(uint32_t b) { float f; memcpy(&f, &b, 4); return f; }
static inline uint32_t f_bits(float f) { uint32_t b; memcpy(&b, &f, 4); return b; }

static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
    if (exp == 0) {  /* zero or subnormal: man * 2^-24, exact in fp32 */
        float f = (float)man * 0x1p-24f;
        return sign ? -f : f;
    }
    if (exp == 31) return bits_f(sign | 0x7F800000 | (man << 13));
    return bits_f(sign | ((exp + 127 - 15) << 23) | (man << 13));
}

static uint16_t float_to_half(float f) {  /* round to nearest even, as torch does */
    uint32_t x = f_bits(f), sign = (x >> 16) & 0x8000, ax = x & 0x7FFFFFFF;
    if (ax >= 0x7F800000) return (uint16_t)(sign | 0x7C00 | (ax > 0x7F800000 ? 0x200 : 0));
    if (ax >= 0x477FF000) return (uint16_t)(sign | 0x7C00);  /* rounds to inf */
    if (ax < 0x38800000)  /* subnormal half (or zero): steps of 2^-24 */
        return (uint16_t)(sign | (uint32_t)__builtin_rintf(bits_f(ax) * 16777216.0f));
    uint32_t r = ax + 0xC8000FFF + ((ax >> 13) & 1);  /* rebias exponent, round to even */
    return (uint16_t)(sign | (r >> 13));
}

static inline float load_f(const void *p, int64_t i, int dt) {
    if (dt == DT_BF16) return bits_f((uint32_t)((const uint16_t *)p)[i] << 16);
    if (dt == DT_F16) return half_to_float(((const uint16_t *)p)[i]);
    return ((const float *)p)[i];
}

static inline void store_f(void *p, int64_t i, int dt, float v) {
    if (dt == DT_BF16) {
        uint32_t b = f_bits(v);
        if ((b & 0x7FFFFFFF) > 0x7F800000) b |= 0x00400000;  /* keep NaN a NaN */
        else b += 0x7FFF + ((b >> 16) & 1);
        ((uint16_t *)p)[i] = (uint16_t)(b >> 16);
    } else if (dt == DT_F16) {
        ((uint16_t *)p)[i] = float_to_half(v);
    } else {
        ((float *)p)[i] = v;
    }
}

/* e4m3 code -> fp32, exactly as torch converts float8_e4m3fn (NaN = sign | 0x7FF00000). */
static inline float fp8_to_float(uint8_t b) {
    uint32_t sign = (uint32_t)(b & 0x80) << 24, e = (b >> 3) & 0xF, m = b & 7;
    if ((b & 0x7F) == 0x7F) return bits_f(sign | 0x7FF00000);
    if (e == 0) {  /* subnormal or zero: m * 2^-9 */
        float f = (float)m * 0x1p-9f;
        return sign ? -f : f;
    }
    return bits_f(sign | ((e + 120) << 23) | (m << 20));
}

/* fp32 (finite, |f| <= 448 after the caller's clamp, or NaN) -> e4m3 code, round to nearest
   even, as torch's float -> float8_e4m3fn conversion. */
static inline uint8_t float_to_fp8(float f) {
    uint32_t x = f_bits(f), sign = (x >> 24) & 0x80, ax = x & 0x7FFFFFFF;
    if (ax > 0x7F800000) return (uint8_t)(sign | 0x7F);
    if (ax < (121u << 23)) {  /* below 2^-6: subnormal steps of 2^-9 (rint rounds to even) */
        return (uint8_t)(sign | (uint32_t)__builtin_rintf(bits_f(ax) * 512.0f));
    }
    uint32_t r = ax + 0x7FFFF + ((ax >> 20) & 1);  /* drop 20 mantissa bits, to even */
    return (uint8_t)(sign | ((r >> 20) - (120u << 3)));
}

/* T(mb) for a row count mb of 1..8 (8 for anything larger), each case a literal so that an
   always-inline tile is specialised per row count. */
#define QK_ROWS_1_TO_8(mb, T) \
    do {                       \
        switch (mb) {          \
        case 1: T(1); break;   \
        case 2: T(2); break;   \
        case 3: T(3); break;   \
        case 4: T(4); break;   \
        case 5: T(5); break;   \
        case 6: T(6); break;   \
        case 7: T(7); break;   \
        default: T(8); break;  \
        }                      \
    } while (0)

/* VEC fp32 lanes per vector (8 in the plain-C build, whose loops are scalar). */
#if defined(__AVX512F__)
#define VEC 16
typedef __m512 vf;
#define VF_ZERO() _mm512_setzero_ps()
#define VF_SET1(a) _mm512_set1_ps(a)
#define VF_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VF_ADD(a, b) _mm512_add_ps(a, b)
#define VF_LOAD(p) _mm512_loadu_ps(p)
#define VF_HSUM(a) _mm512_reduce_add_ps(a)
/* The sums of v[i]'s 16 lanes, i < 8 (v[q]'s in lane 4q, v[q + 4]'s in lane 4q + 2), by three
   rounds of shuffles over all 8 vectors at once (18 shuffles and adds in all, against ~8 ops
   each for 8 separate reductions). SmolLM2 linears, 2 threads, A/B in one run: M = 8 8.49 -> 7.78 ms, M = 40 37.9 -> 35.1 ms. */
static inline __m512 hsum8_tree(const __m512 *v) {
    __m512 u[4], w[2];
    for (int i = 0; i < 4; i++)  /* 512 -> 256: lanes 0-7 from v[2i], 8-15 from v[2i + 1] */
        u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int j = 0; j < 2; j++)  /* 256 -> 128: quarter q from v[4j + q] */
        w[j] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * j], u[2 * j + 1], 0x88),
                             _mm512_shuffle_f32x4(u[2 * j], u[2 * j + 1], 0xDD));
    /* 128 -> 32: quarter q holds v[q]'s sum in its lane 0 and v[q + 4]'s in its lane 2 */
    __m512 z = _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], 0x44),
                             _mm512_shuffle_ps(w[0], w[1], 0xEE));
    return _mm512_add_ps(z, _mm512_shuffle_ps(z, z, 0xB1));
}

static inline void hsum8_add(const __m512 *v, float *r) {
    float t[16];
    _mm512_storeu_ps(t, hsum8_tree(v));
    for (int q = 0; q < 4; q++) {
        r[q] += t[4 * q];
        r[q + 4] += t[4 * q + 2];
    }
}

/* r[i] = the sum of v[i]'s 16 lanes, i < 8: `hsum8_add`'s sums (the same shuffle tree),
   stored by one permute and one 8-lane store instead of added one by one (the attention's
   scores: 0 + s is s but for the sign of a zero, which no softmax output can show). 1B shape,
   a 4096-token prefill's attention, alternating: 4.0 -> 3.58 s. */
static inline void hsum8_store(const __m512 *v, float *r) {
    const __m512i at = _mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 0, 0, 0, 0, 0, 0, 0, 0);
    _mm256_storeu_ps(r, _mm512_castps512_ps256(_mm512_permutexvar_ps(at, hsum8_tree(v))));
}

/* A block of A (16, 32, ..., 128) fp32 values as the int8 GEMVs quantize them: t = absmax / 127,
   q = round(x * (1 / t)) to nearest even (vcvtps2dq), clamped to +-127 (t = 0: all codes 0).
   q[i] holds elements 16i..16i+15 as int32, *sum the sum of all codes; returns t. */
static inline float quantize_block_i8(const float *x, int A, __m512i *q, int32_t *sum) {
    __m512 v[8], amax = _mm512_setzero_ps();
    for (int i = 0; i < A / 16; i++) {
        v[i] = _mm512_loadu_ps(x + 16 * i);
        amax = _mm512_max_ps(amax, _mm512_abs_ps(v[i]));
    }
    const float t = _mm512_reduce_max_ps(amax) / 127.0f, inv = t > 0.0f ? 1.0f / t : 0.0f;
    const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
    __m512i s = _mm512_setzero_si512();
    for (int i = 0; i < A / 16; i++) {
        q[i] = _mm512_cvtps_epi32(_mm512_mul_ps(v[i], _mm512_set1_ps(inv)));
        q[i] = _mm512_min_epi32(_mm512_max_epi32(q[i], lo), hi);
        s = _mm512_add_epi32(s, q[i]);
    }
    *sum = _mm512_reduce_add_epi32(s);
    return t;
}

/* Rows per chunk of the head GEMVs' int8 activation layout (`head_rows_i8`). */
#define HEAD_MB 8

/* x [M, K] (rows x_stride apart) as the head GEMVs (`qk_i8i8_gemv`, `qk_i6i8_gemv`) read it:
   each block of `block` elements quantized by `quantize_block_i8`, the codes laid out
   [chunk of <= HEAD_MB rows][word j][row][4] at xq, and per chunk, block and row {t,
   off * t * sum(q)} at xt: off is the offset of the weight's unsigned codes (W8 + 128, the
   6-bit C + 32), undone per block as t (acc - off sum(q)). An orphaned `omp for` over blocks
   x rows (block-major, so each thread writes one run). */
static inline void head_rows_i8(const float *x, int64_t M, int64_t K, int64_t x_stride,
                                int64_t block, float off, int8_t *xq, float *xt) {
    const int64_t nb = K / block;
    #pragma omp for schedule(static)
    for (int64_t bm = 0; bm < nb * M; bm++) {
        const int64_t b = bm / M, m = bm % M, m0 = m - m % HEAD_MB;
        const int64_t mb = M - m0 < HEAD_MB ? M - m0 : HEAD_MB;
        __m512i q[8];
        int32_t sum;
        const float t = quantize_block_i8(x + m * x_stride + b * block, (int)block, q, &sum);
        int8_t *dst = xq + m0 * K + (m - m0) * 4;
        for (int i = 0; i < block / 16; i++) {
            int32_t words[4];
            _mm_storeu_si128((__m128i *)words, _mm512_cvtepi32_epi8(q[i]));
            for (int u = 0; u < 4; u++) {  /* 4 words of 4 codes */
                const int64_t j = b * (block / 4) + 4 * i + u;
                memcpy(dst + j * mb * 4, &words[u], 4);
            }
        }
        float *o = xt + (m0 * nb + b * mb + (m - m0)) * 2;
        o[0] = t;
        o[1] = off * t * (float)sum;
    }
}

/* `head_rows_i8`'s buffers for M rows of K elements in nb blocks (sizes rounded up to whole
   64-byte lines, as aligned_alloc asks); 0, or 2 with neither allocated. */
static inline int head_rows_alloc(int64_t M, int64_t K, int64_t nb, int8_t **xq, float **xt) {
    *xq = (int8_t *)aligned_alloc(64, (size_t)((M * K + 63) / 64 * 64 + 64));
    *xt = (float *)aligned_alloc(64, (size_t)((M * nb * 2 * 4 + 63) / 64 * 64 + 64));
    if (*xq && *xt) return 0;
    free(*xq);
    free(*xt);
    return 2;
}

/* 4 int8 codes (one int32) broadcast to the 16 lanes, for vpdpbusd. */
static inline __m512i bcast_i32(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* The int8 tiles' weights, 16 rows interleaved, are one contiguous stream of 64-byte words per
   thread: fetch word j + PF_WORDS (8 KB ahead) as word j is read. The hardware prefetchers
   alone kept the stream short of the bandwidth. SmolLM2 INT4 on a 2-core Zen 5, `generate`
   rounds of 128 tokens in one process, the builds' order rotated each round, medians of 8:
   8 KB ahead +31% and +21% tok/s at batch 1 (two runs), +24% at batch 8; 4 KB +14% and
   16 KB +13% at batch 1; a 62-token prefill no slower. The hint (NTA, T0, T2) made no
   difference; T0 keeps the lines in L2 too, where a large layer's tile (16 rows x K int4
   outgrows L1) is read again for each 8 activation rows. Prefetches never fault, so the last
   words of a thread's run fetch past it harmlessly. (`__builtin_prefetch`: gcc 12 emitted no
   instruction for `_mm_prefetch` in this helper.) */
#define PF_WORDS 128
static inline void prefetch_words(const int32_t *w, int64_t j) {
    __builtin_prefetch(w + (j + PF_WORDS) * 16, 0, 3);
}

/* The lanes of a 16-lane load or store that hold elements, with `left` elements to go. */
static inline __mmask16 tail_mask(int64_t left) {
    if (left <= 0) return 0;
    return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u);
}

/* The best tokens a head GEMV keeps per row (`cpu_abi.QK_TOP`: tests hold the two equal). */
#define QK_TOP 8

/* The best tokens of the logits a head GEMV stores, kept as it stores them (`best`), so that a
   greedy step need not read the whole row back from memory afterwards (the weights streamed
   since have evicted it: ~25 us for 49152 logits on a 2-core Zen 5, against none here). The
   QK_TOP largest values of a row in numpy's arg-max order (larger first, the lower column
   among equal values): the arg-max, and the next best a grammar's greedy step asks about
   where the best is refused. Per thread and row: the QK_TOP best so far, sorted, and whether
   a NaN went by. A tile's 16 values are compared with the last kept one at once, and only a
   value above it is inserted (a few dozen a row in all), so a tile costs one compare: the
   int8 head's call (49152 x 576, 2 threads, alternating in one process with the arg-max-only
   build: 1 row 298 -> 295 and 317 -> 300 us, 4 rows 352 -> 347 and 341 -> 335 us; per-lane
   lists of 8, tried first, cost 9% at 4 rows). A thread's columns come in increasing order,
   so a later equal value goes after the earlier (`>` strictly). `best_merge` merges the
   threads, two lists at a time. A row is -1 throughout where a NaN was stored or its largest
   value is infinite (the caller reads the whole row then), and -1 from the first value that
   is not finite, so a kept token's value is always finite. */
typedef struct { float v[QK_TOP]; int64_t col[QK_TOP]; int nan; } best16;

static inline void best16_init(best16 *b) {
    for (int k = 0; k < QK_TOP; k++) b->v[k] = -INFINITY, b->col[k] = -1;
    b->nan = 0;
}

/* Take the 16 values y of columns n0 .. n0 + 15 (the lanes in `valid`). */
static inline void best16_put(best16 *b, __m512 y, int64_t n0, __mmask16 valid) {
    b->nan |= _mm512_mask_cmp_ps_mask(valid, y, y, _CMP_UNORD_Q) != 0;
    __mmask16 in = _mm512_mask_cmp_ps_mask(valid, y, _mm512_set1_ps(b->v[QK_TOP - 1]),
                                           _CMP_GT_OQ);
    if (!in) return;
    float x[16];
    _mm512_storeu_ps(x, y);
    for (; in; in &= (__mmask16)(in - 1)) {
        const int l = __builtin_ctz(in);
        if (!(x[l] > b->v[QK_TOP - 1])) continue;  /* an earlier lane raised the bar */
        int at = QK_TOP - 1;
        for (; at > 0 && x[l] > b->v[at - 1]; at--) {
            b->v[at] = b->v[at - 1];
            b->col[at] = b->col[at - 1];
        }
        b->v[at] = x[l];
        b->col[at] = n0 + l;
    }
}

/* The per-thread rows `best_merge` reads, for a GEMV asked for its best tokens (best not
   NULL): [threads][M], each "nothing yet" (cols -1, as a thread that takes no tile leaves it);
   *parts NULL where not asked. 0, or 2 out of memory. */
static inline int best_parts_alloc(const int64_t *best, int threads, int64_t M, best16 **parts) {
    *parts = NULL;
    if (!best) return 0;
    *parts = (best16 *)malloc(sizeof(best16) * (size_t)(threads * M));
    if (!*parts) return 2;
    for (int64_t i = 0; i < threads * M; i++) best16_init(&(*parts)[i]);
    return 0;
}

/* This thread's rows into `parts` (nothing where NULL), once its tiles are stored. */
static inline void best_parts_put(best16 *parts, const best16 *seen, int64_t M) {
    for (int64_t m = 0; parts && m < M; m++) parts[omp_get_thread_num() * M + m] = seen[m];
}

/* a and b (each sorted in arg-max order) merged into a: the first QK_TOP of both. */
static inline void best16_merge(best16 *a, const best16 *b) {
    best16 r;
    int i = 0, j = 0;
    for (int k = 0; k < QK_TOP; k++) {
        const int take_b = b->col[j] >= 0 && (a->col[i] < 0 || b->v[j] > a->v[i] ||
                                              (b->v[j] == a->v[i] && b->col[j] < a->col[i]));
        r.v[k] = take_b ? b->v[j] : a->v[i];
        r.col[k] = take_b ? b->col[j++] : a->col[i++];
    }
    r.nan = a->nan | b->nan;
    *a = r;
}

/* The threads' rows (`parts`, [threads][M], each sorted; threads that took no tile hold cols
   -1) into best [M][QK_TOP]: merged in arg-max order, -1 from the first value that is not
   finite, and a whole row -1 where a NaN was stored or its largest value is infinite. Kept
   values are never -inf or NaN (only a value above the last kept one goes in), so a list is
   its finite values, then +inf or nothing only where +inf is its first. */
static inline void best_merge(const best16 *parts, int threads, int64_t M, int64_t *best) {
    for (int64_t m = 0; m < M; m++) {
        best16 all = parts[m];
        for (int t = 1; t < threads; t++) best16_merge(&all, parts + t * M + m);
        int64_t *row = best + m * QK_TOP;
        for (int k = 0; k < QK_TOP; k++) row[k] = isfinite(all.v[k]) ? all.col[k] : -1;
        if (all.nan || row[0] < 0)
            for (int k = 0; k < QK_TOP; k++) row[k] = -1;
    }
}

/* What a head GEMV (`qk_i8i8_gemv`, `qk_i6i8_gemv`) allocates: the activations' codes and block
   terms (`head_rows_alloc`) and, where its arg-max is asked for (best not NULL), the threads'
   rows (`best_parts_alloc`). 0, or 2 out of memory with nothing left allocated. */
typedef struct { int8_t *xq; float *xt; best16 *parts; } head_work;

static inline int head_work_alloc(int64_t M, int64_t K, int64_t nb, const int64_t *best,
                                  int threads, head_work *h) {
    h->parts = NULL;
    if (head_rows_alloc(M, K, nb, &h->xq, &h->xt)) return 2;
    if (best_parts_alloc(best, threads, M, &h->parts)) {
        free(h->xq);
        free(h->xt);
        return 2;
    }
    return 0;
}

/* The threads' best tokens into best (where asked), and the buffers freed. */
static inline void head_work_end(head_work *h, int threads, int64_t M, int64_t *best) {
    if (best) best_merge(h->parts, threads, M, best);
    free(h->parts);
    free(h->xq);
    free(h->xt);
}

/* A row's 16 results of the tile at column n0 into y_row (the lanes short of N), and into the
   row's best tokens where they are kept (seen not NULL). */
static inline void head_store16(float *y_row, int64_t n0, int64_t N, __m512 v, best16 *seen) {
    const __mmask16 k = tail_mask(N - n0);
    _mm512_mask_storeu_ps(y_row + n0, k, v);
    if (seen) best16_put(seen, v, n0, k);
}
#elif defined(__AVX2__)
#define VEC 8
typedef __m256 vf;
#define VF_ZERO() _mm256_setzero_ps()
#define VF_SET1(a) _mm256_set1_ps(a)
#define VF_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VF_ADD(a, b) _mm256_add_ps(a, b)
#define VF_LOAD(p) _mm256_loadu_ps(p)
static inline float VF_HSUM(__m256 a) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}
#else
#define VEC 8
#endif

#endif /* QK_COMMON_H */
