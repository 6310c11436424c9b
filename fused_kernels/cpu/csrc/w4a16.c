/* w4a16.c: the CPU W4A16 kernels, compiled once per machine by `cpu_build` (gcc + ctypes); the
   library is built from `decode.c`, which includes this file (see there). The exported
   functions and the layer struct are declared in `quantkit_kernels.h`.

   The kernels read the compressed-tensors tensors exactly as stored (no repack):

   - `qk_w4a16_gemv`: y [M, N] = x [M, K] @ dequant(W).T (+ bias), for small M (decode). Streams
     each packed row once per chunk of activation rows (8 with AVX-512, else <= 4, see
     `row_chunk`); OpenMP over output rows.
   - `qk_w4a16_gemv_layer`: the same with the layer's arguments in a struct bound once.
   - `qk_w4_dequant`: rows [n0, n1) of dequant(W) as fp32 [n1 - n0, K], bit-identical to
     `quantkit.format.packing.int4_dequantize`; the prefill path hands these to MKL.

   Why the GEMV is fast. A 32-element block of a row is 4 int32 words (16 bytes). The kernel loads
   the 4 words once into every 128-bit lane of a vector register and shifts lane l of vector j by
   4 * ((VEC/4) * j + (l >> 2)): after `& 0xF` the nibbles come out in a fixed permutation of the
   block (lane l of vector j = element 8 * (l & 3) + (VEC/4) * j + (l >> 2)). Rather than permute
   4-bit weights on every call, the activations (a few KB) are permuted once per call to match, so
   the inner loop dequantizes (u * s - (8 + zp) * s, shared by all activation rows: with AVX-512
   a shift and a 16-entry table lookup, with AVX2 shift, and, int->float, one FMA) and does one
   FMA per activation row. Compiled for AVX-512 (16 lanes), AVX2 (8 lanes) or plain C, picked
   from the CPU's flags by `cpu_build`.

   Measured at N=14336, K=4096, g128, M=1, weights streamed from DRAM, one Zen 5 core (CPU
   time, the machine being shared): 15.9 GB/s of packed weight with AVX-512, 10.3 GB/s with AVX2,
   against 36-38 GB/s for a one-core 256 MB copy (read + write bytes). The AVX2 loop is bound by
   its ~5 vector ops per 8 weights, not by memory, so the op count per weight is what the layout
   and the loop structure minimise; the AVX-512 loop needs the software prefetch described below.

   dtype codes: 0 = fp32, 1 = bf16, 2 = fp16 (x, scales, bias, output). Return value: 0 on
   success, 1 = unsupported group layout (groups must be multiples of 32 or per channel), 2 = out
   of memory. */

#include "common.h"
#include "quantkit_kernels.h"

/* VEC (the fp32 lanes, `common.h`). A 32-element block (4 words) becomes NV vectors:
   lane l of vector j holds element 8 * (l & 3) + (VEC / 4) * j + (l >> 2) of the block. */
#if defined(__AVX512F__)
typedef __m512i vi;
#define VI_BCAST4(p) _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(p)))
#define VI_NIBBLE(w, sh) \
    _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srlv_epi32(w, sh), _mm512_set1_epi32(0xF)))
/* 32 zmm registers: 4 accumulators per activation row up to MB = 4, 2 at MB = 8 (16 chains) */
#define ACC_PER_ROW(MB) ((MB) <= 4 ? 4 : 2)
#define MAX_MB 8
#define INV_MB 3
/* Dequantize by table: a group's 16 possible weights u * s + c (u = 0..15, one FMA per group,
   the same FMA as below, so bit-identical) sit in one register, and vpermps picks lane l's
   weight by the low 4 bits of its shifted word (it ignores the rest: no mask). 2 ops per 16
   weights instead of 4 (shift, and, int->float, FMA), and none of them on the FMA pipes that
   the activation rows need: at 8 rows the old dequantization took 2 of every 10 FMA-pipe ops. */
typedef __m512 dq_t;
#define DQ_MAKE(s_, c_) _mm512_fmadd_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, \
    12, 13, 14, 15), _mm512_set1_ps(s_), _mm512_set1_ps(c_))
#define DQ_APPLY(wv, j, dq) _mm512_permutexvar_ps(_mm512_srlv_epi32(wv, VI_SHIFTS(j)), dq)
#define VI_SHIFTS(j) _mm512_setr_epi32(16 * (j), 16 * (j), 16 * (j), 16 * (j), \
    16 * (j) + 4, 16 * (j) + 4, 16 * (j) + 4, 16 * (j) + 4, \
    16 * (j) + 8, 16 * (j) + 8, 16 * (j) + 8, 16 * (j) + 8, \
    16 * (j) + 12, 16 * (j) + 12, 16 * (j) + 12, 16 * (j) + 12)
#elif defined(__AVX2__)
typedef __m256i vi;
#define VI_BCAST4(p) _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(p)))
#define VI_NIBBLE(w, sh) \
    _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(w, sh), _mm256_set1_epi32(0xF)))
/* 16 ymm registers: 4 accumulators at MB = 1, 2 per activation row above */
#define ACC_PER_ROW(MB) ((MB) == 1 ? 4 : 2)
#define MAX_MB 4
/* 8 lanes cannot index a 16-entry table: shift, and, int->float, one FMA with s and c. */
typedef struct { __m256 s, c; } dq_t;
#define DQ_MAKE(s_, c_) ((dq_t){_mm256_set1_ps(s_), _mm256_set1_ps(c_)})
#define DQ_APPLY(wv, j, dq) VF_FMA(VI_NIBBLE(wv, VI_SHIFTS(j)), (dq).s, (dq).c)
#define VI_SHIFTS(j) _mm256_setr_epi32(8 * (j), 8 * (j), 8 * (j), 8 * (j), \
    8 * (j) + 4, 8 * (j) + 4, 8 * (j) + 4, 8 * (j) + 4)
#else
#define MAX_MB 4
#endif
#define NV (32 / VEC)
#ifndef INV_MB
#define INV_MB 1
#endif

/* Activation rows are processed in chunks that share each dequantized weight: chunks of
   MAX_MB rows while that many remain, then (AVX-512) the 5-7 rows left as one chunk, or chunks
   of <= 4. A chunk of 8 (AVX-512) dequantizes each weight once for 8 rows instead of twice: at
   batch 8 the dequantization, not the memory, bounds the GEMV. As 4 + 1-3, 5-7 rows cost more
   than 8 (SmolLM2 INT4, bf16 activations, 2 threads: 19.7 / 21.8 / 24.0 ms against 20.3).
   `row_chunk` gives the first row and the size of the chunk holding row m.
   Row-invariant (`one_row`): chunks of INV_MB rows whose tiles keep a one-row call's
   accumulator count and K tiles (`gemv_rows`), so row m's sums run in exactly the order of a
   one-row call and its result is bit-identical whatever else the call holds. INV_MB is 3 where
   a row triple still fits a one-row call's 4 accumulators a row in registers (AVX-512: 24 of
   32), else 1; the weight tile is read from memory once and from L1/L2 for the other chunks,
   and what costs more than the chunked call is the dequantization, repeated per chunk. SmolLM2
   INT4, 2 threads, bf16 activations, against a one-row call, interleaved in one run: 3 rows
   1.39x as triples vs 1.66x as a pair and a single, 6 rows 2.34x vs 2.54x, 8 rows 3.02x vs
   3.27x (fp32 activations: 1.31 vs 1.58, 2.00 vs 2.38, 2.53 vs 2.98). Speculative decoding
   verifies drafts this way, so it reproduces plain decoding exactly. */
static inline void row_chunk(int64_t m, int64_t M, int one_row, int64_t *m0, int64_t *mb) {
    int64_t big = MAX_MB > 4 ? (M / MAX_MB) * MAX_MB : 0;
    if (one_row) {
        *m0 = m - m % INV_MB;
        *mb = M - *m0 < INV_MB ? M - *m0 : INV_MB;
    } else if (m < big) {
        *m0 = m - m % MAX_MB;
        *mb = MAX_MB;
    } else if (MAX_MB > 4 && M - big > 4) {
        *m0 = big;  /* 5-7 rows left: one chunk (4 + 1-3 dequantized every weight twice) */
        *mb = M - big;
    } else {
        *m0 = big + ((m - big) & ~(int64_t)3);
        *mb = M - *m0 < 4 ? M - *m0 : 4;
    }
}

static inline int perm_src(int j, int l) { return 8 * (l & 3) + (VEC / 4) * j + (l >> 2); }

/* The bf16 tile's order (`gemv_tile2_bf16`): 16-bit lane e of a block's 32 weights holds
   element 4 * (e % 8) + e / 8. */
static inline int bf16_src(int e) { return 4 * (e % 8) + e / 8; }

#if defined(__AVX512F__)
/* bf16_src(e) for the 32 word lanes, as a vpermw index. */
static inline __m512i bf16_perm_index(void) {
    return _mm512_set_epi16(31, 27, 23, 19, 15, 11, 7, 3, 30, 26, 22, 18, 14, 10, 6, 2,
                            29, 25, 21, 17, 13, 9, 5, 1, 28, 24, 20, 16, 12, 8, 4, 0);
}

/* perm_src(j, l) for the 16 lanes: the vpermt2ps index that gathers vector j of a block. */
static inline __m512i perm_index(int j) {
    return _mm512_setr_epi32(4 * j, 8 + 4 * j, 16 + 4 * j, 24 + 4 * j, 1 + 4 * j, 9 + 4 * j,
                             17 + 4 * j, 25 + 4 * j, 2 + 4 * j, 10 + 4 * j, 18 + 4 * j,
                             26 + 4 * j, 3 + 4 * j, 11 + 4 * j, 19 + 4 * j, 27 + 4 * j);
}
#endif

static inline int zero_of(const int32_t *zp, int64_t zp_stride, int64_t n, int64_t g) {
    if (!zp) return 0;
    return (int)(((uint32_t)zp[(n >> 3) * zp_stride + g] >> (4 * (n & 7))) & 0xF) - 8;
}

/* Rows [n0, n1)'s per-group dequantization constants: s [rows][G] and c = -(8 + zp) * s
   [rows][G] (8 + zp is the stored zero-point nibble). Plain loops per dtype, over the whole
   tile when its scales are contiguous, so gcc vectorises them: a per-row dtype switch made this
   prologue cost 20% of a 576x576 GEMV. The nibbles come from zq (one byte each, contiguous:
   one vector loop over the tile) where the layer has it, else from the packed zp (8 rows a
   word: a short loop per row, which took ~0.55 ms of a 7.3 ms SmolLM2 batch-1 step). */
static void tile_params(const void *scale, int s_dt, int64_t s_stride, const int32_t *zp,
                        int64_t zp_stride, const uint8_t *zq, int64_t n0, int64_t n1, int64_t G,
                        float *s, float *c)
{
    int64_t rows = n1 - n0, len = s_stride == G ? rows * G : G;
    for (int64_t r = 0; r < (s_stride == G ? 1 : rows); r++) {
        int64_t off = (n0 + r) * s_stride;
        float *d = s + r * G;
        if (s_dt == DT_BF16) {
            const uint16_t *p = (const uint16_t *)scale + off;
            for (int64_t i = 0; i < len; i++) {
                uint32_t b = (uint32_t)p[i] << 16;
                memcpy(d + i, &b, 4);
            }
        } else if (s_dt == DT_F16) {
            const uint16_t *p = (const uint16_t *)scale + off;
            for (int64_t i = 0; i < len; i++) d[i] = half_to_float(p[i]);
        } else {
            memcpy(d, (const float *)scale + off, (size_t)len * sizeof(float));
        }
    }
    if (!zp) {
        for (int64_t i = 0; i < rows * G; i++) c[i] = -8.0f * s[i];
        return;
    }
    if (zq) {
        const uint8_t *z = zq + n0 * G;
        for (int64_t i = 0; i < rows * G; i++) c[i] = -(float)z[i] * s[i];
        return;
    }
    for (int64_t r = 0; r < rows; r++) {
        int64_t n = n0 + r;
        const uint32_t *z = (const uint32_t *)zp + (n >> 3) * zp_stride;
        int shift = 4 * (int)(n & 7);
        float *cr = c + r * G;
        const float *sr = s + r * G;
        for (int64_t g = 0; g < G; g++) cr[g] = -(float)((z[g] >> shift) & 0xF) * sr[g];
    }
}

/* Blocks per K tile, for all MB activation rows together: 256 blocks = 32 KB of fp32 x stay
   in L1 while the tile's weight rows stream past. Without K tiles x falls out of L1 once
   MB * K * 4 bytes pass ~32 KB: 4096x14336 at M = 1 ran at half the bytes/s of 14336x4096
   (3.8 vs 1.7 ms on one Zen 5 core). Short tiles hurt too: 1024-element tiles (512-byte runs
   per weight row) halved the bytes/s at M = 1, the prefetchers want long runs. */
#define KT_BLOCKS 256

/* res[m] += sum over blocks [b0, b1) of x[m, block] . W[n, block] for MB (1..8) activation
   rows and one weight row. xc holds the chunk's activations as [block][MB][32] (permuted).
   Each nibble u is dequantized once, w = u * s + c (`DQ_APPLY`), then used for every row.
   Accumulator indices are compile-time constants (a runtime index spills them to memory) and
   FMA latency wants >= 8 independent chains, so blocks go in pairs (alt = 0, 1).
   Every 64 bytes of weights it prefetches the line `pf` bytes ahead into L2 (the distance is
   chosen by the caller, see `gemv_rows`). The K tiles visit each row in 4 KB runs, which the
   hardware prefetchers follow badly (2.3x slower at 14336x4096, M = 1, before the software
   prefetch). */
static inline __attribute__((always_inline)) void gemv_tile(
    int MB, const float *xc, int64_t b0, int64_t b1, int64_t g0, int64_t bpg, int gsh,
    const int32_t *wrow, int64_t words, const float *s, const float *c, int64_t pf, float *res)
{
#ifdef VI_NIBBLE
    vf acc[MAX_MB][4];
    const int nacc = ACC_PER_ROW(MB);
    for (int m = 0; m < MB; m++)
        for (int a = 0; a < 4; a++) acc[m][a] = VF_ZERO();
#define GEMV_BLOCK(wv_expr, bi, alt, dq)                                          \
    do {                                                                          \
        vi wv = (wv_expr);                                                        \
        const float *xb = xc + (bi) * 32 * MB;                                    \
        _Pragma("GCC unroll 4") for (int j = 0; j < NV; j++) {                    \
            vf w = DQ_APPLY(wv, j, dq);                                           \
            int a = (j + NV * (alt)) % nacc;                                      \
            _Pragma("GCC unroll 8") for (int m = 0; m < MB; m++)                  \
                acc[m][a] = VF_FMA(w, VF_LOAD(xb + m * 32 + j * VEC), acc[m][a]); \
        }                                                                         \
    } while (0)
    int64_t blk = b0, nfull = words / 4;  /* only a per-channel row has a partial block */
    if (gsh >= 0) {
        /* 2^gsh blocks per group (g32/64/128): one flat loop over block pairs, each block
           broadcasting its group's s and c (a load each). A loop per group cost ~10 cycles
           a group: 576x576 g64 took 21 us instead of 15 on one core. */
        for (; blk + 1 < b1; blk += 2) {
            if (!(blk & 3)) __builtin_prefetch((const char *)(wrow + blk * 4) + pf, 0, 2);
            dq_t d0 = DQ_MAKE(s[blk >> gsh], c[blk >> gsh]);
            dq_t d1 = DQ_MAKE(s[(blk + 1) >> gsh], c[(blk + 1) >> gsh]);
            GEMV_BLOCK(VI_BCAST4(wrow + blk * 4), blk, 0, d0);
            GEMV_BLOCK(VI_BCAST4(wrow + blk * 4 + 4), blk + 1, 1, d1);
        }
        if (blk < b1) {
            dq_t d0 = DQ_MAKE(s[blk >> gsh], c[blk >> gsh]);
            GEMV_BLOCK(VI_BCAST4(wrow + blk * 4), blk, 0, d0);
        }
    } else {  /* per channel (one group, maybe a partial last block) or other group sizes */
        for (int64_t g = g0; blk < b1; g++) {  /* g0 = b0 / bpg: no division per group */
            int64_t gend = (g + 1) * bpg < b1 ? (g + 1) * bpg : b1;
            int64_t fend = gend < nfull ? gend : nfull;
            dq_t dg = DQ_MAKE(s[g], c[g]);
            for (; blk + 1 < fend; blk += 2) {
                if (!(blk & 3)) __builtin_prefetch((const char *)(wrow + blk * 4) + pf, 0, 2);
                GEMV_BLOCK(VI_BCAST4(wrow + blk * 4), blk, 0, dg);
                GEMV_BLOCK(VI_BCAST4(wrow + blk * 4 + 4), blk + 1, 1, dg);
            }
            if (blk < fend) {
                GEMV_BLOCK(VI_BCAST4(wrow + blk * 4), blk, 0, dg);
                blk++;
            }
            if (blk < gend) {  /* the tail: pad the missing words with zeros */
                int32_t tmp[4] = {0, 0, 0, 0};
                for (int64_t t = blk * 4; t < words; t++) tmp[t - blk * 4] = wrow[t];
                GEMV_BLOCK(VI_BCAST4(tmp), blk, 0, dg);
                blk++;
            }
        }
    }
#undef GEMV_BLOCK
    for (int m = 0; m < MB; m++) {
        vf t = acc[m][0];
        for (int a = 1; a < nacc; a++) t = VF_ADD(t, acc[m][a]);
        res[m] += VF_HSUM(t);
    }
#else
    float acc[MAX_MB] = {0};
    for (int64_t blk = b0; blk < b1; blk++) {
        float sg = s[blk / bpg], cg = c[blk / bpg];
        for (int j = 0; j < NV; j++)
            for (int l = 0; l < VEC; l++) {
                int64_t w = blk * 4 + (l & 3);
                uint32_t word = w < words ? (uint32_t)wrow[w] : 0u;
                float q = (float)((word >> (4 * ((VEC / 4) * j + (l >> 2)))) & 0xF) * sg + cg;
                for (int m = 0; m < MB; m++) acc[m] += q * xc[(blk * MB + m) * 32 + j * VEC + l];
            }
    }
    for (int m = 0; m < MB; m++) res[m] += acc[m];
#endif
}

#ifdef VI_NIBBLE
/* ra[m] += the sum of acc[0][m][0..nacc) over all lanes, rb[m] likewise from acc[1], m < MB
   (8 rows: one shuffle tree for all of them, `hsum8_add`). */
static inline __attribute__((always_inline)) void reduce_pair(
    int MB, int nacc, vf acc[2][MAX_MB][4], float *ra, float *rb)
{
    vf t0[MAX_MB], t1[MAX_MB];
    for (int m = 0; m < MB; m++) {
        t0[m] = acc[0][m][0], t1[m] = acc[1][m][0];
        for (int a = 1; a < nacc; a++) {
            t0[m] = VF_ADD(t0[m], acc[0][m][a]);
            t1[m] = VF_ADD(t1[m], acc[1][m][a]);
        }
    }
#if defined(__AVX512F__)
    if (MB == 8) {
        hsum8_add(t0, ra);
        hsum8_add(t1, rb);
        return;
    }
#endif
    for (int m = 0; m < MB; m++) {
        ra[m] += VF_HSUM(t0[m]);
        rb[m] += VF_HSUM(t1[m]);
    }
}

/* gemv_tile for two weight rows at once (power-of-two groups, whole blocks): each activation
   vector loaded is used by both rows' FMAs (with one row, every FMA carried its own load of
   x). Over the SmolLM2 linears (30 layers, streamed, 2 threads), against one row at a time
   in the same run: M = 1 2.41 vs 2.83 ms, M = 4 4.39 vs 4.67 ms, M = 8 no change (9.99 vs
   9.94 ms: ~125 GMAC/s L2-resident, half the two cores' FMA peak of ~240 measured with a
   register-only loop, so the loads were not the M = 8 bound). Accumulators: 4 chains per
   activation row at MB = 1, 2 up to MB = 4, 1 at MB = 8 (>= 8 chains, <= 16 registers);
   NACC > 0 (a literal) overrides that: the row-invariant triples keep MB = 1's 4 (`row_chunk`). */
static inline __attribute__((always_inline)) void gemv_tile2(
    int MB, int NACC, const float *xc, int64_t b0, int64_t b1, int gsh, const int32_t *wa,
    const int32_t *wb, const float *sa, const float *ca, const float *sb, const float *cb,
    int64_t pf, float *ra, float *rb)
{
    vf acc[2][MAX_MB][4];
    const int nacc = NACC ? NACC : (MB == 1 ? 4 : (MB <= 4 ? 2 : 1));
    for (int m = 0; m < MB; m++)
        for (int a = 0; a < 4; a++) acc[0][m][a] = acc[1][m][a] = VF_ZERO();
#define GEMV_BLOCK2(bi, alt)                                                         \
    do {                                                                             \
        dq_t da = DQ_MAKE(sa[(bi) >> gsh], ca[(bi) >> gsh]);                         \
        dq_t db = DQ_MAKE(sb[(bi) >> gsh], cb[(bi) >> gsh]);                         \
        vi wva = VI_BCAST4(wa + (bi) * 4), wvb = VI_BCAST4(wb + (bi) * 4);           \
        const float *xb = xc + (bi) * 32 * MB;                                       \
        _Pragma("GCC unroll 4") for (int j = 0; j < NV; j++) {                       \
            vf w0 = DQ_APPLY(wva, j, da), w1 = DQ_APPLY(wvb, j, db);                 \
            int a = (j + NV * (alt)) % nacc;                                         \
            _Pragma("GCC unroll 8") for (int m = 0; m < MB; m++) {                   \
                vf xv = VF_LOAD(xb + m * 32 + j * VEC);                              \
                acc[0][m][a] = VF_FMA(w0, xv, acc[0][m][a]);                         \
                acc[1][m][a] = VF_FMA(w1, xv, acc[1][m][a]);                         \
            }                                                                        \
        }                                                                            \
    } while (0)
    int64_t blk = b0;
    for (; blk + 1 < b1; blk += 2) {
        if (!(blk & 3)) {
            __builtin_prefetch((const char *)(wa + blk * 4) + pf, 0, 2);
            __builtin_prefetch((const char *)(wb + blk * 4) + pf, 0, 2);
        }
        GEMV_BLOCK2(blk, 0);
        GEMV_BLOCK2(blk + 1, 1);
    }
    if (blk < b1) GEMV_BLOCK2(blk, 0);
#undef GEMV_BLOCK2
    reduce_pair(MB, nacc, acc, ra, rb);
}
#endif

#if defined(__AVX512BF16__)
/* gemv_tile2 with bf16 activations (`permute_x` to DT_BF16). A group's 16 possible weights
   u * s + c (the fp32 FMA of `DQ_MAKE`) are rounded once to bf16 and sit twice in one
   register (32 words); a block's 4 words, broadcast to every 128-bit lane and shifted by
   4 * lane in each 16-bit half (vpsrlvw), give 32 nibbles that vpermw looks up (it reads the
   low 5 bits: the table's copy makes bit 4 harmless). Word lane e then holds element
   4 * (e % 8) + e / 8 (`bf16_src`), the order `permute_x` gives the bf16 activations. One
   vdpbf16ps per activation row multiplies and adds the 32 pairs into 16 fp32 lanes: 2 ops
   dequantize 32 weights (fp32 tile: 5), and each row takes half the FMA-pipe instructions and
   half the activation bytes. Only the operands are rounded; the sums stay fp32.
   What bounds it (one Zen 5 core, L1-resident microbenchmarks): 64-byte loads, ~0.65 a cycle,
   not vdpbf16ps (peak 236 GMAC/s). 8 rows x 2 weight rows ran 137 GMAC/s, the same with the
   activations held in registers 232, 8 x 3 weight rows 204; but in the decode step the 3-row
   tile ran 3-5% slower than this one (A/B in one run), so the pair stays. */
#define DQB_MAKE(s_, c_) ({ __m512 t_ = DQ_MAKE(s_, c_); (__m512i)_mm512_cvtne2ps_pbh(t_, t_); })
#define DQB_APPLY(wv, tbl) \
    (__m512bh)_mm512_permutexvar_epi16(_mm512_srlv_epi16(wv, bf16_shifts), tbl)
static inline __attribute__((always_inline)) void gemv_tile2_bf16(
    int MB, int NACC, const uint16_t *xc, int64_t b0, int64_t b1, int gsh, const int32_t *wa,
    const int32_t *wb, const float *sa, const float *ca, const float *sb, const float *cb,
    int64_t pf, float *ra, float *rb)
{
    __m512 acc[2][MAX_MB][4];
    const int nacc = NACC ? NACC : (MB == 1 ? 4 : (MB <= 4 ? 2 : 1));
    const __m512i bf16_shifts = _mm512_set_epi16(12, 12, 12, 12, 12, 12, 12, 12, 8, 8, 8, 8,
        8, 8, 8, 8, 4, 4, 4, 4, 4, 4, 4, 4, 0, 0, 0, 0, 0, 0, 0, 0);
    for (int m = 0; m < MB; m++)
        for (int a = 0; a < 4; a++) acc[0][m][a] = acc[1][m][a] = _mm512_setzero_ps();
#define TABLES(bi) __m512i ta = DQB_MAKE(sa[(bi) >> gsh], ca[(bi) >> gsh]),         \
                           tb = DQB_MAKE(sb[(bi) >> gsh], cb[(bi) >> gsh])
#define GEMV_BLOCK2_BF16(bi, alt, ta, tb)                                            \
    do {                                                                             \
        __m512bh w0 = DQB_APPLY(VI_BCAST4(wa + (bi) * 4), ta);                       \
        __m512bh w1 = DQB_APPLY(VI_BCAST4(wb + (bi) * 4), tb);                       \
        const uint16_t *xb = xc + (bi) * 32 * MB;                                    \
        const int a = (alt) % nacc;                                                  \
        _Pragma("GCC unroll 8") for (int m = 0; m < MB; m++) {                       \
            __m512bh xv = (__m512bh)_mm512_loadu_si512(xb + m * 32);                  \
            acc[0][m][a] = _mm512_dpbf16_ps(acc[0][m][a], w0, xv);                   \
            acc[1][m][a] = _mm512_dpbf16_ps(acc[1][m][a], w1, xv);                   \
        }                                                                            \
    } while (0)
    int64_t blk = b0;
    for (; blk + 3 < b1; blk += 4) {
        __builtin_prefetch((const char *)(wa + blk * 4) + pf, 0, 2);
        __builtin_prefetch((const char *)(wb + blk * 4) + pf, 0, 2);
        if (gsh >= 1) {  /* blocks 0-1 and 2-3 share a group (blk is a multiple of 4) */
            TABLES(blk);
            GEMV_BLOCK2_BF16(blk, 0, ta, tb);
            GEMV_BLOCK2_BF16(blk + 1, 1, ta, tb);
            {
                TABLES(blk + 2);
                GEMV_BLOCK2_BF16(blk + 2, 2, ta, tb);
                GEMV_BLOCK2_BF16(blk + 3, 3, ta, tb);
            }
        } else {
            for (int i = 0; i < 4; i++) {
                TABLES(blk + i);
                GEMV_BLOCK2_BF16(blk + i, i, ta, tb);
            }
        }
    }
    for (int alt = 0; blk < b1; blk++, alt++) {
        TABLES(blk);
        GEMV_BLOCK2_BF16(blk, alt, ta, tb);
    }
#undef GEMV_BLOCK2_BF16
#undef TABLES
    reduce_pair(MB, nacc, acc, ra, rb);
}
#endif

#if defined(__AVX512VNNI__)
/* 16 scales (dtype dt: fp32, bf16 or fp16) as fp32. */
static inline __m512 load16_f(const void *p, int dt) {
    if (dt == DT_BF16)
        return _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
    if (dt == DT_F16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_loadu_ps(p);
}

/* The 16 rows' 8 + zero point of group g as floats (`qk_w4_layer.zr`: one byte a row and
   group, 16 rows interleaved), 8 for all without zero points (symmetric). */
static inline __m512 zero16(const uint8_t *zr, int64_t g) {
    if (!zr) return _mm512_set1_ps(8.0f);
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(zr + g * 16))));
}

/* The int8 tile (VNNI): res[m] lane l = sum over k of x[m, k] w[16 t + l, k] for the 16 weight
   rows of tile t (`qk_w4_layer.wr`: lane l of word j holds row 16 t + l's elements 8j..8j+7)
   and MB (1..8) activation rows quantized per block of A elements (`quantize_x_i8`).
   Per word j: one 64-byte load, `& 0xF` and `>> 4 & 0xF` give each lane's even and odd
   elements as 4 unsigned bytes, and per activation row two vpdpbusd against its 4 even and 4
   odd codes broadcast to every lane. Each lane sums integers over a whole block (A / 8 words),
   so the fp32 work is per block, not per word: res += s (t_b acc - z xs_b), with s and z the
   16 rows' scale and 8 + zero point of the block's group, t_b the block's activation scale
   and xs_b = t_b sum(q) (`quantize_x_i8`). No horizontal sums: lane l is row l's result.
   Integer sums are exact, so the accumulator count (more at small MB, for latency) does not
   change a row's result: each row's result is the same whatever MB is (row-invariant). */
static inline __attribute__((always_inline)) void gemv_tile_i8(
    int MB, const int32_t *w, const int8_t *xq, const float *ta, const float *xs,
    const char *sr, int s_dt, int64_t s_bytes, const uint8_t *zr, int64_t W, int64_t cpb,
    int64_t bpg, __m512 *res)
{
    const __m512i nib = _mm512_set1_epi8(0x0F);
    enum { NA = 4 };  /* accumulators a row: 4 at MB = 1, 2 up to MB = 4, else 1 (a literal) */
    const int na = MB == 1 ? 4 : MB <= 4 ? 2 : 1;
    for (int m = 0; m < MB; m++) res[m] = _mm512_setzero_ps();
    for (int64_t j0 = 0, b = 0; j0 < W; j0 += cpb, b++) {
        __m512i acc[MAX_MB][NA];
        for (int m = 0; m < MB; m++)
            for (int a = 0; a < na; a++) acc[m][a] = _mm512_setzero_si512();
#define GEMV_WORD_I8(j, u)                                                                    \
    do {                                                                                      \
        __m512i wv = _mm512_loadu_si512((const void *)(w + (j) * 16));                        \
        __m512i lo = _mm512_and_si512(wv, nib);                                               \
        __m512i hi = _mm512_and_si512(_mm512_srli_epi16(wv, 4), nib);                         \
        const int8_t *xj = xq + (j) * MB * 8;                                                 \
        const int ae = na == 4 ? 2 * (u) : 0, ao = na >= 2 ? ae + 1 : 0;                      \
        _Pragma("GCC unroll 8") for (int m = 0; m < MB; m++) {                                \
            acc[m][ae] = _mm512_dpbusd_epi32(acc[m][ae], lo, bcast_i32(xj + m * 8));          \
            acc[m][ao] = _mm512_dpbusd_epi32(acc[m][ao], hi, bcast_i32(xj + m * 8 + 4));      \
        }                                                                                     \
    } while (0)
        for (int64_t j = j0; j < j0 + cpb; j += 2) {  /* cpb = A / 8: 4, 8 or 16 */
            prefetch_words(w, j);
            prefetch_words(w, j + 1);
            GEMV_WORD_I8(j, 0);
            GEMV_WORD_I8(j + 1, 1);
        }
#undef GEMV_WORD_I8
        const int64_t g = b / bpg;
        const __m512 s = load16_f(sr + g * 16 * s_bytes, s_dt);
        const __m512 z = zero16(zr, g);
        _Pragma("GCC unroll 8") for (int m = 0; m < MB; m++) {
            __m512i a = acc[m][0];
            for (int k = 1; k < na; k++) a = _mm512_add_epi32(a, acc[m][k]);
            __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(a), _mm512_set1_ps(ta[b * MB + m]));
            f = _mm512_fnmadd_ps(z, _mm512_set1_ps(xs[b * MB + m]), f);
            res[m] = _mm512_fmadd_ps(f, s, res[m]);
        }
    }
}

/* Tile t of `wr` (16 interleaved weight rows): its words, scales and zero-point bytes, how many
   of its 16 rows exist (nl), and their bias (0 past nl or without one), made once a tile. */
typedef struct {
    int64_t t, nl;
    const int32_t *w;
    const char *sr;
    const uint8_t *zr;
    __m512 bias;
} i8_tile;

static inline i8_tile i8_tile_at(const qk_w4_layer *L, int64_t t, int64_t s_bytes) {
    const int64_t W = L->K / 8, G = L->n_groups, nl = L->N - 16 * t < 16 ? L->N - 16 * t : 16;
    float bias[16] = {0};
    for (int64_t l = 0; L->bias && l < nl; l++) bias[l] = load_f(L->bias, 16 * t + l, (int)L->b_dt);
    return (i8_tile){t, nl, L->wr + t * W * 16, (const char *)L->sr + t * G * 16 * s_bytes,
                     L->zr ? L->zr + t * G * 16 : NULL, _mm512_loadu_ps(bias)};
}

/* The prefill tile: two 16-row tiles of `wr` (T0, T1: 32 output rows) against MB (1..I8_MR)
   activation rows. `gemv_tile_i8` broadcasts a row's 4 codes from memory for each vpdpbusd;
   here each broadcast is loaded once into a register and used for both tiles. One Zen 5 core,
   K = 2048 with everything in L1, against a 2458 GOPS vpdpbusd peak for two cores: 1 tile x 8
   rows 609 GOPS, 2 x 6 1090, 3 x 4 1070, 2 x 8 904, 3 x 6 930, 4 x 4 900 (register pressure).
   Each row's integer sums and its per-block fp32 work (in block order) are exactly
   `gemv_tile_i8`'s, so the results are the same bits whichever tile computed them.
   128-element blocks (g128's) run their 16 words unrolled: gcc then renames the accumulators
   instead of copying all 12 at each word (43 instructions per 24 vpdpbusd against 73-87);
   a 512-token 1B prefill's matmuls 588-685 -> 552-578 ms, alternating. */
#define I8_MR 6
static inline __attribute__((always_inline)) void gemm_tile_i8(
    int MB, const i8_tile *T0, const i8_tile *T1, const int8_t *xq, const float *ta,
    const float *xs, int s_dt, int64_t s_bytes, int64_t W, int64_t cpb, int64_t bpg, int pf,
    __m512 *res0, __m512 *res1)
{
    const __m512i nib = _mm512_set1_epi8(0x0F);
    const int32_t *w0 = T0->w, *w1 = T1->w;
    for (int m = 0; m < MB; m++) res0[m] = res1[m] = _mm512_setzero_ps();
    /* g: the group of block b, counted rather than divided (gb: b's place in it) */
    for (int64_t j0 = 0, b = 0, g = 0, gb = 0; j0 < W; j0 += cpb, b++) {
        __m512i a0[I8_MR], a1[I8_MR];
        for (int m = 0; m < MB; m++) a0[m] = a1[m] = _mm512_setzero_si512();
        /* one word j of both tiles against the MB rows */
#define TILE_WORD(j)                                                                        \
    do {                                                                                    \
        const __m512i u = _mm512_loadu_si512((const void *)(w0 + (j) * 16));                \
        const __m512i v = _mm512_loadu_si512((const void *)(w1 + (j) * 16));                \
        const __m512i ulo = _mm512_and_si512(u, nib);                                       \
        const __m512i uhi = _mm512_and_si512(_mm512_srli_epi16(u, 4), nib);                 \
        const __m512i vlo = _mm512_and_si512(v, nib);                                       \
        const __m512i vhi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);                 \
        const int8_t *xj = xq + (j) * MB * 8;                                               \
        _Pragma("GCC unroll 6") for (int m = 0; m < MB; m++) {                              \
            const __m512i xe = bcast_i32(xj + m * 8), xo = bcast_i32(xj + m * 8 + 4);       \
            a0[m] = _mm512_dpbusd_epi32(a0[m], ulo, xe);                                    \
            a1[m] = _mm512_dpbusd_epi32(a1[m], vlo, xe);                                    \
            a0[m] = _mm512_dpbusd_epi32(a0[m], uhi, xo);                                    \
            a1[m] = _mm512_dpbusd_epi32(a1[m], vhi, xo);                                    \
        }                                                                                   \
    } while (0)
        if (pf) {  /* the first row chunk streams the tiles from memory */
            for (int64_t j = j0; j < j0 + cpb; j++) {
                __builtin_prefetch(w0 + (j + PF_WORDS) * 16, 0, 3);
                __builtin_prefetch(w1 + (j + PF_WORDS) * 16, 0, 3);
                TILE_WORD(j);
            }
        } else if (cpb == 16) {  /* 128-element blocks: unrolled, the accumulators renamed */
            _Pragma("GCC unroll 16") for (int64_t jj = 0; jj < 16; jj++) TILE_WORD(j0 + jj);
        } else {
            for (int64_t j = j0; j < j0 + cpb; j++) TILE_WORD(j);
        }
#undef TILE_WORD
        const __m512 s0 = load16_f(T0->sr + g * 16 * s_bytes, s_dt);
        const __m512 s1 = load16_f(T1->sr + g * 16 * s_bytes, s_dt);
        const __m512 z0 = zero16(T0->zr, g), z1 = zero16(T1->zr, g);
        _Pragma("GCC unroll 6") for (int m = 0; m < MB; m++) {
            const __m512 t = _mm512_set1_ps(ta[b * MB + m]), x = _mm512_set1_ps(xs[b * MB + m]);
            __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(a0[m]), t);
            res0[m] = _mm512_fmadd_ps(_mm512_fnmadd_ps(z0, x, f), s0, res0[m]);
            f = _mm512_mul_ps(_mm512_cvtepi32_ps(a1[m]), t);
            res1[m] = _mm512_fmadd_ps(_mm512_fnmadd_ps(z1, x, f), s1, res1[m]);
        }
        if (++gb == bpg) g++, gb = 0;
    }
}

/* Rows m0 .. m0 + mb (1..I8_MR) of tiles T0 and T1 into r0 and r1: `gemm_tile_i8` with the
   row count a constant (its row loops unrolled); the first row chunk streams the tiles. */
static inline __attribute__((always_inline)) void gemm_pair_i8(
    int64_t mb, int64_t m0, const i8_tile *T0, const i8_tile *T1, const int8_t *xq,
    const float *ta, const float *xs, int64_t K, int64_t nb, int s_dt, int64_t s_bytes,
    int64_t W, int64_t cpb, int64_t bpg, __m512 *r0, __m512 *r1)
{
#define TILE_GEMM(MB) gemm_tile_i8(MB, T0, T1, xq + m0 * K, ta + m0 * nb, xs + m0 * nb, s_dt, \
                                   s_bytes, W, cpb, bpg, m0 == 0, r0, r1)
    switch (mb) {
    case 1: TILE_GEMM(1); break;
    case 2: TILE_GEMM(2); break;
    case 3: TILE_GEMM(3); break;
    case 4: TILE_GEMM(4); break;
    case 5: TILE_GEMM(5); break;
    default: TILE_GEMM(I8_MR); break;
    }
#undef TILE_GEMM
}
#endif

/* Weight rows per scheduling unit: their per-group constants and partial sums live on the
   stack, and a tile of them streams past each K tile of x. 32 rows moved 27.5 GB/s at
   4096x4096, M = 1, 2 threads, against 24.5 with 16 and 22 with 8 (longer contiguous runs). */
#define RT 32

/* qk_w4_layer, one layer's static arguments bound once: `quantkit_kernels.h`. */

/* Blocks per group and log2 of it (-1 when not a power of two); 1 for an unsupported layout. */
static int group_layout(const qk_w4_layer *L, int64_t *bpg, int *gsh) {
    int64_t nblk = (L->K + 31) / 32;
    if (L->n_groups == 1) *bpg = nblk;
    else if (L->group_size % 32 == 0 && L->group_size * L->n_groups == L->K)
        *bpg = L->group_size / 32;
    else return 1;
    *gsh = -1;
    for (int t = 0; L->n_groups > 1 && t < 30; t++)
        if (*bpg == ((int64_t)1 << t)) *gsh = t;
    return 0;
}

/* 1 when this build has the bf16 tile (the CPU has AVX512-BF16), else 0. */
int qk_has_bf16_dot(void) {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

/* 1 when this build has the int8 tile (the CPU has AVX512-VNNI), else 0. */
int qk_has_int8_dot(void) {
#if defined(__AVX512VNNI__)
    return 1;
#else
    return 0;
#endif
}

/* The int8 tile's activation block (`quantize_x_i8`): the largest of 128, 64 and 32 elements
   that divides the group size (K with one group per row), so a block lies in one group; 0 when
   none does. */
static int64_t i8_block(const qk_w4_layer *L) {
    const int64_t g = L->n_groups == 1 ? L->K : L->group_size;
    for (int64_t a = 128; a >= 32; a /= 2)
        if (g % a == 0 && L->K % a == 0) return a;
    return 0;
}

/* The dtype `permute_x` should give the activations of a GEMV over L: DT_BF16 or DT_I8 when the
   caller asks for it and that tile applies (this build has it; power-of-two groups for bf16;
   for int8 the layer's interleaved copy `wr` and groups of a multiple of 32), else DT_F32. */
static int gemv_x_dt(const qk_w4_layer *L, int want) {
    int64_t bpg;
    int gsh;
    if (group_layout(L, &bpg, &gsh)) return DT_F32;
    if (want == DT_BF16 && qk_has_bf16_dot() && gsh >= 0) return DT_BF16;
    if (want == DT_I8 && qk_has_int8_dot() && L->wr && i8_block(L)) return DT_I8;
    return DT_F32;
}

/* Where `quantize_x_i8` puts M rows' codes (K bytes a row), block scales and block sums, from
   xp on (A: `i8_block`). */
static inline void i8_parts(float *xp, int64_t M, int64_t K, int64_t A, int8_t **xq, float **ta,
                            float **xs) {
    *xq = (int8_t *)xp;
    *ta = xp + M * K / 4;
    *xs = *ta + M * (K / A);
}

/* The int8 path's row chunks: `row_chunk`'s, except for a call of I8_GEMM_ROWS rows or more
   (not row-invariant), which `gemm_tile_i8` takes in chunks of I8_MR rows (the last holds what
   is left). */
#define I8_GEMM_ROWS 16
static inline void i8_chunk(int64_t m, int64_t M, int one_row, int64_t *m0, int64_t *mb) {
#if defined(__AVX512VNNI__)
    if (!one_row && M >= I8_GEMM_ROWS) {
        *m0 = m - m % I8_MR;
        *mb = M - *m0 < I8_MR ? M - *m0 : I8_MR;
        return;
    }
#endif
    row_chunk(m, M, one_row, m0, mb);
}

/* Floats at the start of the scratch for the activations: the permuted fp32 (or bf16) x; the
   int8 form (`i8_parts`: K / 4 + 2 K / A floats a row, A >= 32) fits in the same. The
   per-tile constants follow. */
static int64_t xp_floats(const qk_w4_layer *L, int64_t M) {
    return M * ((L->K + 31) / 32) * 32;
}

/* Floats of scratch a GEMV over L needs: the permuted x (M rows, `permute_x`) and after it the
   per-tile constants (`gemv_rows`). */
static int64_t gemv_scratch(const qk_w4_layer *L, int64_t M) {
    return xp_floats(L, M) + (L->N + RT) * 2 * L->n_groups + 16;
}

#if defined(__AVX512F__)
/* The A fp32 values at src as block b of row m (of M) of `quantize_x_i8`: codes, scale and sum
   where that call puts them (xq, ta, xs: `i8_parts`). A / 16 vectors, no scalar pass. */
static inline void quantize_block_i8_from(const float *src, int64_t K, int64_t A, int64_t M,
                                          int8_t *xq, float *ta, float *xs, int64_t b,
                                          int64_t m, int one_row) {
    int64_t m0, mb;
    i8_chunk(m, M, one_row, &m0, &mb);
    int8_t *dst = xq + m0 * K + (m - m0) * 8 + b * (A / 8) * mb * 8;  /* + word * mb * 8 */
    const int64_t at = m0 * (K / A) + b * mb + (m - m0);
    __m512i q[8];
    int32_t sum;
    const float t = quantize_block_i8(src, (int)A, q, &sum);
    /* two words' codes, each as its 4 even then its 4 odd elements */
    const __m512i order = _mm512_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13,
                                            15);
    for (int i = 0; i < A / 16; i++) {
        __m128i bytes = _mm512_cvtepi32_epi8(_mm512_permutexvar_epi32(order, q[i]));
        _mm_storel_epi64((__m128i *)(dst + (2 * i) * mb * 8), bytes);
        _mm_storeh_pd((double *)(dst + (2 * i + 1) * mb * 8), _mm_castsi128_pd(bytes));
    }
    ta[at] = t;
    xs[at] = t * (float)sum;
}
#endif

/* Block b of row m (of M) of `quantize_x_i8`: its codes, scale and sum where that call puts
   them (xq, ta, xs: `i8_parts`). */
static inline void quantize_block_i8_at(const void *x, int x_dt, int64_t K, int64_t A,
                                        int64_t M, int64_t x_stride, int8_t *xq, float *ta,
                                        float *xs, int64_t b, int64_t m, int one_row) {
#if defined(__AVX512F__)
    if (x_dt == DT_F32) {  /* the decode step's case */
        quantize_block_i8_from((const float *)x + m * x_stride + b * A, K, A, M, xq, ta, xs, b,
                               m, one_row);
        return;
    }
#endif
    const int64_t nb = K / A;
    int64_t m0, mb;
    i8_chunk(m, M, one_row, &m0, &mb);
    int8_t *dst = xq + m0 * K + (m - m0) * 8 + b * (A / 8) * mb * 8;  /* + word * mb * 8 */
    const int64_t at = m0 * nb + b * mb + (m - m0);
    float v[128], amax = 0.0f;
    for (int64_t e = 0; e < A; e++) {
        v[e] = load_f(x, m * x_stride + b * A + e, x_dt);
        amax = fmaxf(amax, fabsf(v[e]));
    }
    const float t = amax / 127.0f, inv = t > 0.0f ? 1.0f / t : 0.0f;
    int32_t sum = 0;
    for (int64_t e = 0; e < A; e++) {
        int q = (int)__builtin_rintf(v[e] * inv);
        q = q < -127 ? -127 : q > 127 ? 127 : q;
        dst[(e / 8) * mb * 8 + (e & 1) * 4 + (e % 8) / 2] = (int8_t)q;
        sum += q;
    }
    ta[at] = t;
    xs[at] = t * (float)sum;
}

/* x -> the int8 tile's activations at xp (`i8_parts`): per row, blocks of A = `i8_block(L)`
   elements each quantized on its own, t = absmax / 127 and q = round(x * (1 / t)) to nearest
   even, clamped to +-127 (t = 0: all codes 0). The codes of each 8 elements j (one word of the
   weights) are stored as the 4 even-indexed then the 4 odd-indexed ones, so that `vpdpbusd`
   broadcasts each half; per block, t and t * sum(q) (the zero points' term). Each row chunk
   (`row_chunk`: rows m0..m0 + mb) keeps its rows together: row m's codes of word j at
   (m0 K / 8 + j mb + m - m0) * 8 bytes, its block b's t and sum at m0 nb + b mb + m - m0.
   An orphaned `omp for`, as `permute_x`. */
static void quantize_x_i8(const void *x, int x_dt, const qk_w4_layer *L, int64_t M,
                          int64_t x_stride, float *xp, int one_row) {
    const int64_t K = L->K, A = i8_block(L), nb = K / A;
    int8_t *xq;
    float *ta, *xs;
    i8_parts(xp, M, K, A, &xq, &ta, &xs);
    /* block-major: each thread writes one run of words and scales (row-major, the threads'
       writes shared cache lines: at batch 8 the quantization took 5x as long) */
    #pragma omp for schedule(static)
    for (int64_t bm = 0; bm < nb * M; bm++)
        quantize_block_i8_at(x, x_dt, K, A, M, x_stride, xq, ta, xs, bm / M, bm % M, one_row);
}

/* x -> xp_dt (DT_F32, or DT_BF16 rounded to nearest even for `gemv_tile2_bf16`; DT_I8 is
   `quantize_x_i8`), each
   32-element block permuted to the order the shifts produce, K padded with zeros, the rows of
   each chunk (`row_chunk`) interleaved per block: [chunk][block][row][32].
   An orphaned `omp for` over (row, block), like `gemv_rows`: inside a parallel region the team
   shares it (with one thread the other would wait at the next barrier), outside one the
   calling thread does it all. */
static void permute_x(const void *x, int x_dt, const qk_w4_layer *L, int64_t M,
                      int64_t x_stride, float *xp, int xp_dt, int one_row) {
    if (xp_dt == DT_I8) {
        quantize_x_i8(x, x_dt, L, M, x_stride, xp, one_row);
        return;
    }
    const int64_t K = L->K, nblk = (K + 31) / 32, kp = nblk * 32;
    #pragma omp for schedule(static)
    for (int64_t mb_i = 0; mb_i < M * nblk; mb_i++) {
        int64_t m = mb_i / nblk, b = mb_i % nblk, m0, mb;
        row_chunk(m, M, one_row, &m0, &mb);
        int64_t at = m0 * kp + (b * mb + (m - m0)) * 32;  /* in elements of xp_dt */
#if defined(__AVX512F__)
        if (x_dt == DT_F32) {  /* two loads and two lane permutes a block, not 32 scalars */
            const float *src = (const float *)x + m * x_stride + b * 32;
            int64_t left = K - b * 32;
            __m512 lo = _mm512_maskz_loadu_ps(tail_mask(left), src);
            __m512 hi = _mm512_maskz_loadu_ps(tail_mask(left - 16), src + 16);
#if defined(__AVX512BF16__)
            if (xp_dt == DT_BF16) {  /* round to bf16 in block order, then one word permute */
                __m512i v = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
                _mm512_storeu_si512((uint16_t *)xp + at,
                                    _mm512_permutexvar_epi16(bf16_perm_index(), v));
                continue;
            }
#endif
            __m512 p0 = _mm512_permutex2var_ps(lo, perm_index(0), hi);
            __m512 p1 = _mm512_permutex2var_ps(lo, perm_index(1), hi);
            if (xp_dt == DT_F32) {
                _mm512_storeu_ps(xp + at, p0);
                _mm512_storeu_ps(xp + at + 16, p1);
                continue;
            }
        }
#endif
        for (int e = 0; e < 32; e++) {
            int64_t k = b * 32 + (xp_dt == DT_BF16 ? bf16_src(e) : perm_src(e / VEC, e % VEC));
            store_f(xp, at + e, xp_dt, k < K ? load_f(x, m * x_stride + k, x_dt) : 0.0f);
        }
    }
}

#if defined(__AVX512VNNI__)
/* Rows m0..m0 + mb of out, tile T's columns: res[i] + its bias. A row's 16 results are
   contiguous in out: one (masked) store for fp32; scalar stores of them read back from a
   vector store stalled the loads (at 64 rows a fifth of the GEMV's time on a Zen 5). */
static inline void store_tile_i8(const __m512 *res, int64_t mb, int64_t m0, const i8_tile *T,
                                 void *out, int o_dt, int64_t o_stride) {
    for (int64_t i = 0; i < mb; i++) {
        const __m512 v = _mm512_add_ps(res[i], T->bias);
        const int64_t at = (m0 + i) * o_stride + 16 * T->t;
        if (o_dt == DT_F32) {
            _mm512_mask_storeu_ps((float *)out + at, tail_mask(T->nl), v);
            continue;
        }
        float r[16];
        _mm512_storeu_ps(r, v);
        for (int64_t l = 0; l < T->nl; l++) store_f(out, at + l, o_dt, r[l]);
    }
}

/* A prefill's tile pairs (`gemm_tile_i8`) go PAIR_BLOCK pairs a unit, each unit over
   CHUNK_GROUP row chunks at a time: the group's activations stay in L2 while the unit's pairs
   go over them, where a pair over all the rows in turn read every row's (1 MB at 512 rows of
   2048, 6 MB of 12288) from L3 again for each pair. Each row's operations are the same: the
   same bits. 512-token prefill, the two orders alternating in one process (median per-round
   ratio): Llama-3.2-1B shape 1.011 (qkv 65.1 -> 62.8 ms, o 40.6 -> 39.5, down 152.9 ->
   150.3), Qwen3-8B shape 1.026 (qkv 578 -> 542, o 383 -> 353, down 1086 -> 1058); 8 pairs x
   8 chunks 1.013 and 1.004, 2 x 4 1.011 (1B). */
#define PAIR_BLOCK 4
#define CHUNK_GROUP 4

/* gemv_rows for int8 activations (`quantize_x_i8` at xp): the 16-row tiles of `wr` split
   statically over the team (an orphaned `omp for`), each tile against every row chunk in turn
   (its weights stay in L1/L2 after the first). A call of I8_GEMM_ROWS rows or more (a prefill)
   takes the tiles in pairs (`gemm_tile_i8`), PAIR_BLOCK pairs a unit, an odd last one alone. */
static void gemv_rows_i8(const qk_w4_layer *L, float *xp, int64_t M, void *out, int o_dt,
                         int64_t o_stride, int one_row) {
    const int64_t K = L->K, N = L->N, G = L->n_groups, A = i8_block(L), nb = K / A;
    const int64_t W = K / 8, cpb = A / 8, bpg = G == 1 ? nb : L->group_size / A;
    const int s_dt = (int)L->s_dt;
    const int64_t s_bytes = s_dt == DT_F32 ? 4 : 2, tiles = (N + 15) / 16;
    const int gemm = !one_row && M >= I8_GEMM_ROWS;
    const int64_t pairs = tiles / 2, blocks = (pairs + PAIR_BLOCK - 1) / PAIR_BLOCK;
    const int64_t group = CHUNK_GROUP * I8_MR;
    int8_t *xq;
    float *ta, *xs;
    i8_parts(xp, M, K, A, &xq, &ta, &xs);
    #pragma omp for schedule(static)
    for (int64_t u = 0; u < (gemm ? blocks + tiles % 2 : tiles); u++) {
        if (gemm && u < blocks) {
            const int64_t p0 = u * PAIR_BLOCK;
            const int64_t np = pairs - p0 < PAIR_BLOCK ? pairs - p0 : PAIR_BLOCK;
            i8_tile T0[PAIR_BLOCK], T1[PAIR_BLOCK];
            for (int64_t p = 0; p < np; p++) {
                T0[p] = i8_tile_at(L, 2 * (p0 + p), s_bytes);
                T1[p] = i8_tile_at(L, 2 * (p0 + p) + 1, s_bytes);
            }
            for (int64_t g0 = 0; g0 < M; g0 += group) {
                const int64_t g1 = g0 + group < M ? g0 + group : M;
                for (int64_t p = 0; p < np; p++)
                    for (int64_t m0 = g0, mb; m0 < g1; m0 += mb) {
                        i8_chunk(m0, M, 0, &m0, &mb);
                        __m512 r0[I8_MR], r1[I8_MR];
                        gemm_pair_i8(mb, m0, T0 + p, T1 + p, xq, ta, xs, K, nb, s_dt, s_bytes, W,
                                     cpb, bpg, r0, r1);
                        store_tile_i8(r0, mb, m0, T0 + p, out, o_dt, o_stride);
                        store_tile_i8(r1, mb, m0, T1 + p, out, o_dt, o_stride);
                    }
            }
            continue;
        }
        const i8_tile T = i8_tile_at(L, gemm ? tiles - 1 : u, s_bytes);
        for (int64_t m0 = 0, mb; m0 < M; m0 += mb) {
            i8_chunk(m0, M, one_row, &m0, &mb);
            __m512 res[MAX_MB];
#define TILE_I8(MB) gemv_tile_i8(MB, T.w, xq + m0 * K, ta + m0 * nb, xs + m0 * nb, T.sr, s_dt, \
                                 s_bytes, T.zr, W, cpb, bpg, res)
            QK_ROWS_1_TO_8(mb, TILE_I8);  /* MAX_MB is 8 with AVX-512 */
#undef TILE_I8
            store_tile_i8(res, mb, m0, &T, out, o_dt, o_stride);
        }
    }
}
#endif

/* out [M, N] = xp (permuted, see permute_x) @ dequant(W).T (+ bias). The row-tile loop is an
   orphaned `omp for`: inside a parallel region the team shares it (and meets at its implicit
   barrier), outside one it runs on the calling thread. xp is the start of `gemv_scratch(L, M)`
   floats: the permuted x, then (N + RT) * 2 * G floats of per-tile constants. The caller has
   checked the group layout. */
static void gemv_rows(const qk_w4_layer *L, float *xp, int xp_dt, int64_t M, void *out,
                      int o_dt, int64_t o_stride, int one_row) {
    const int64_t K = L->K, N = L->N, n_groups = L->n_groups, wq_stride = L->wq_stride;
    const int32_t *wq = L->wq;
    int64_t nblk = (K + 31) / 32, kp = nblk * 32, words = (K + 7) / 8, bpg = 1;
    float *params = xp + xp_floats(L, M);
    int gsh = -1;
    group_layout(L, &bpg, &gsh);
#if defined(__AVX512VNNI__)
    if (xp_dt == DT_I8) {
        gemv_rows_i8(L, xp, M, out, o_dt, o_stride, one_row);
        return;
    }
#endif
    /* Static split: each thread streams one contiguous run of row tiles, which the hardware
       prefetchers follow and the software prefetch (the next row tile) serves. Against
       schedule(dynamic, 1), alternated 3 times in one quiet session (M = 1, 2 threads): SmolLM2
       linears 5.06-5.57 vs 7.29-8.26 ms a token, 14336x4096 0.90-0.97 vs 1.14-1.67 ms (p20-p80).
       The price: a thread descheduled by another process stalls the call (dynamic chunks let
       the other thread take over; 4 ms stalls were seen that way on a loaded machine). */
    #pragma omp for schedule(static)
    for (int64_t n0 = 0; n0 < N; n0 += RT) {
        int64_t n1 = n0 + RT < N ? n0 + RT : N;
        float *s = params + n0 * 2 * n_groups, *c = s + RT * n_groups;
        tile_params(L->scale, (int)L->s_dt, L->s_stride, L->zp, L->zp_stride, L->zq, n0, n1,
                    n_groups, s, c);
        for (int64_t m0 = 0, mb; m0 < M; m0 += mb) {
            row_chunk(m0, M, one_row, &m0, &mb);
            float res[RT][MAX_MB] = {{0}};
            /* any group layout: handled per block; row-invariant chunks keep one row's tiles */
            int64_t kt = one_row ? KT_BLOCKS : (KT_BLOCKS / mb) & ~(int64_t)3;
            /* Prefetch distance. One K tile per row: the row tile is one contiguous run, and the
               same spot of the next row tile is fetched. Several K tiles: each row is visited in
               4 KB runs, and the row 4 ahead in the same K tile is fetched. At 4096x14336,
               M = 1, 2 threads, static split, alternated in one session: 2 rows ahead 18.7-20.5
               GB/s, 4 rows 24.3-26.9, 6-12 rows 24.5-27.6 (and 20.8 before any K-tile prefetch;
               with dynamic chunks 2 rows had measured best). */
            int64_t pf = (nblk > kt ? 4 : RT) * wq_stride * 4;
            for (int64_t b0 = 0; b0 < nblk; b0 += kt) {
                int64_t b1 = b0 + kt < nblk ? b0 + kt : nblk, g0 = b0 / bpg;
                const float *xc = xp + m0 * kp;
                int64_t n = n0;
#if defined(__AVX512BF16__)
                /* bf16 activations (`gemv_x_dt`: power-of-two groups): rows in pairs, an odd
                   last row paired with itself and its second result dropped */
                const uint16_t *xcb = (const uint16_t *)xp + m0 * kp;  /* the same, bf16 */
                for (; xp_dt == DT_BF16 && n < n1; n += 2) {
                    const int64_t nb = n + 1 < n1 ? n + 1 : n;
                    const int32_t *wa = wq + n * wq_stride, *wb = wq + nb * wq_stride;
                    const float *sa = s + (n - n0) * n_groups, *ca = c + (n - n0) * n_groups;
                    const float *sb = s + (nb - n0) * n_groups, *cb = c + (nb - n0) * n_groups;
                    float spare[MAX_MB] = {0};
                    float *rb = nb > n ? res[nb - n0] : spare;
#define TILE2B(MB, NACC) gemv_tile2_bf16(MB, NACC, xcb, b0, b1, gsh, wa, wb, sa, ca, sb, \
                                         cb, pf, res[n - n0], rb)
                    if (mb == 1) TILE2B(1, 0);
                    else if (mb == 2 && one_row) TILE2B(2, 4);
                    else if (mb == 3 && one_row) TILE2B(3, 4);
                    else if (mb == 2) TILE2B(2, 0);
                    else if (mb == 3) TILE2B(3, 0);
                    else if (mb == 4) TILE2B(4, 0);
                    else if (mb == 5) TILE2B(5, 0);
                    else if (mb == 6) TILE2B(6, 0);
                    else if (mb == 7) TILE2B(7, 0);
                    else TILE2B(MAX_MB, 0);
#undef TILE2B
                }
#endif
#ifdef VI_NIBBLE
                for (; gsh >= 0 && n + 1 < n1; n += 2) {  /* rows in pairs, see gemv_tile2 */
                    const int32_t *wa = wq + n * wq_stride;
                    const float *sa = s + (n - n0) * n_groups, *ca = c + (n - n0) * n_groups;
#define TILE2(MB, NACC) gemv_tile2(MB, NACC, xc, b0, b1, gsh, wa, wa + wq_stride, sa, ca, \
                                   sa + n_groups, ca + n_groups, pf, res[n - n0], \
                                   res[n + 1 - n0])
                    if (mb == 1) TILE2(1, 0);
#if INV_MB > 1
                    else if (mb == 2 && one_row) TILE2(2, 4);
                    else if (mb == 3 && one_row) TILE2(3, 4);
#endif
                    else if (mb == 2) TILE2(2, 0);
                    else if (mb == 3) TILE2(3, 0);
                    else if (mb == 4) TILE2(4, 0);
#if MAX_MB > 4
                    else if (mb == 5) TILE2(5, 0);
                    else if (mb == 6) TILE2(6, 0);
                    else if (mb == 7) TILE2(7, 0);
                    else TILE2(MAX_MB, 0);
#endif
#undef TILE2
                }
#endif
                for (; n < n1; n++) {
                    const int32_t *wrow = wq + n * wq_stride;
                    const float *sn = s + (n - n0) * n_groups, *cn = c + (n - n0) * n_groups;
                    float *r = res[n - n0];
                    /* a literal MB per call, so each case is specialised */
#define TILE(MB) gemv_tile(MB, xc, b0, b1, g0, bpg, gsh, wrow, words, sn, cn, pf, r)
                    if (mb == 1) TILE(1);
                    else if (mb == 2) TILE(2);
                    else if (mb == 3) TILE(3);
                    else if (mb == 4) TILE(4);
#if MAX_MB > 4
                    else if (mb == 5) TILE(5);
                    else if (mb == 6) TILE(6);
                    else if (mb == 7) TILE(7);
                    else TILE(MAX_MB);
#endif
#undef TILE
                }
            }
            for (int64_t n = n0; n < n1; n++) {
                float bn = L->bias ? load_f(L->bias, n, (int)L->b_dt) : 0.0f;
                for (int64_t t = 0; t < mb; t++)
                    store_f(out, (m0 + t) * o_stride + n, o_dt, res[n - n0][t] + bn);
            }
        }
    }
}

/* act_dt: DT_BF16 rounds x to bf16 for the bf16 tile, DT_I8 quantizes it for the int8 tile,
   where `gemv_x_dt` allows, else fp32. */
int qk_w4a16_gemv_layer(const qk_w4_layer *L, const void *x, int x_dt, int64_t M,
                        int64_t x_stride, void *out, int o_dt, int64_t o_stride, int act_dt,
                        int n_threads)
{
    int64_t bpg;
    int gsh;
    if (group_layout(L, &bpg, &gsh)) return 1;
    float *work = (float *)aligned_alloc(64, (size_t)gemv_scratch(L, M) * sizeof(float));
    if (!work) return 2;
    const int xp_dt = gemv_x_dt(L, act_dt);
    #pragma omp parallel num_threads(n_threads)
    {
        permute_x(x, x_dt, L, M, x_stride, work, xp_dt, 0);
        gemv_rows(L, work, xp_dt, M, out, o_dt, o_stride, 0);
    }
    free(work);
    return 0;
}

int qk_w4a16_gemv(
    const void *x, int x_dt, int64_t M, int64_t K, int64_t x_stride,
    const int32_t *wq, int64_t N, int64_t wq_stride,
    const void *scale, int s_dt, int64_t n_groups, int64_t s_stride,
    const int32_t *zp, int64_t zp_stride, int64_t group_size,
    const void *bias, int b_dt, void *out, int o_dt, int64_t o_stride, int n_threads)
{
    qk_w4_layer L = {wq, N, K, wq_stride, scale, s_dt, n_groups, s_stride, zp, zp_stride,
                     group_size, bias, b_dt, NULL, NULL, NULL, NULL};
    return qk_w4a16_gemv_layer(&L, x, x_dt, M, x_stride, out, o_dt, o_stride, DT_F32,
                               n_threads);
}

int qk_w4_dequant(
    const int32_t *wq, int64_t n0, int64_t n1, int64_t K, int64_t wq_stride,
    const void *scale, int s_dt, int64_t n_groups, int64_t s_stride,
    const int32_t *zp, int64_t zp_stride, float *out, int n_threads)
{
    int64_t gs = K / n_groups;
    if (gs * n_groups != K) return 1;
    #pragma omp parallel for num_threads(n_threads) schedule(static)
    for (int64_t n = n0; n < n1; n++) {
        const int32_t *wrow = wq + n * wq_stride;
        float *orow = out + (n - n0) * K;
        for (int64_t g = 0; g < n_groups; g++) {
            /* (u - (8 + zp)) is exact in fp32 and one multiply follows, as in
               quantkit.format.packing.int4_dequantize: the result is bit-identical to it. */
            float s = load_f(scale, n * s_stride + g, s_dt);
            float z = (float)(zero_of(zp, zp_stride, n, g) + 8);
            int64_t k = g * gs, kend = k + gs;
#ifdef __AVX2__
            const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
            const __m256 zv = _mm256_set1_ps(z), sv = _mm256_set1_ps(s);
            for (; k + 8 <= kend && (k & 7) == 0; k += 8) {
                __m256i wv = _mm256_set1_epi32(wrow[k >> 3]);
                __m256 q = _mm256_cvtepi32_ps(
                    _mm256_and_si256(_mm256_srlv_epi32(wv, shifts), _mm256_set1_epi32(0xF)));
                _mm256_storeu_ps(orow + k, _mm256_mul_ps(_mm256_sub_ps(q, zv), sv));
            }
#endif
            for (; k < kend; k++) {
                float q = (float)(((uint32_t)wrow[k >> 3] >> (4 * (k & 7))) & 0xF);
                orow[k] = (q - z) * s;
            }
        }
    }
    return 0;
}
