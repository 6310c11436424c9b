/* quantkit_kernels.h: every function the CPU kernel libraries export, and the structs they take
   by pointer. This is the ABI the Python loaders call through ctypes: `cpu_abi.py` mirrors each
   prototype and struct, and tests/test_kernels_c_abi.py parses this file and holds the two to
   each other (types and names, in order), so keep to its plain style: one typedef'd struct or one
   prototype per declaration, named parameters, no macros.

   Libraries (`cpu_abi.LIBRARIES`): qk_w4a16_cpu is built from decode.c (which includes w4a16.c),
   qk_fp8_cpu from fp8.c, qk_bf16_gemv from bf16_gemv.c, qk_int8_cpu from int8.c; each
   translation unit includes this header, so gcc checks every definition against its prototype
   here.

   dtype codes (the *_dt arguments and fields): 0 = fp32, 1 = bf16, 2 = fp16; an act_dt may also
   be 3 = int8 activations. Pointers are to the
   tensors' data; strides are in elements. */

#ifndef QUANTKIT_KERNELS_H
#define QUANTKIT_KERNELS_H

#include <stdint.h>

/* ---- structs (all integers int64_t: no padding questions) ---- */

/* One INT4 layer's static arguments, bound once (`CpuInt4Layer`), so that a decode call passes 9
   arguments instead of 21: each ctypes argument conversion costs ~0.1-0.2 us. */
typedef struct {
    const int32_t *wq;
    int64_t N, K, wq_stride;
    const void *scale;
    int64_t s_dt, n_groups, s_stride;
    const int32_t *zp;
    int64_t zp_stride, group_size;
    const void *bias;
    int64_t b_dt;
    /* optional, NULL: the zero points unpacked, one byte (0..15) a row and group, [N][n_groups]
       contiguous; `tile_params` then reads them with a vector loop (see there) */
    const uint8_t *zq;
    /* optional, NULL: the int8 tile's copy of the layer (`gemv_rows_i8`), 16 rows interleaved.
       wr [ceil(N / 16)][K / 8][16]: word l of group j is row 16 t + l's packed word j; sr
       [ceil(N / 16)][n_groups][16] the scales (dtype s_dt), zr the same of zq (NULL with no
       zero points). Rows past N are zeros. */
    const int32_t *wr;
    const void *sr;
    const uint8_t *zr;
} qk_w4_layer;

/* One decoder layer of the decode step (decode.c). The optional parts are NULL or 0 where a
   family's layer lacks them (a Llama layer has none). */
typedef struct {
    qk_w4_layer qkv, o, gate_up, down;
    const float *in_norm, *post_norm;  /* [H]: the attention's and the MLP's input norms */
    void *k_cache, *v_cache;  /* this layer's cache: [cache_rows][Hkv][slots] heads (attend.c) */
    const float *q_norm, *k_norm;  /* [D]: RMSNorm of each q and k head before rope (Qwen3) */
    /* [H]: RMSNorm of the attention's and the MLP's outputs before each residual add (Gemma) */
    const float *attn_out_norm, *ffn_out_norm;
    int64_t sliding;  /* 1: each token attends to the last d->window positions only */
    int64_t rope;  /* the rotary table this layer reads, 0 .. d->ropes - 1 */
    /* A mixture of experts in place of gate_up / down (Mixtral, Qwen3-MoE), or NULL: the
       router [d->experts][H] (fp32), and each expert's gate, up and down layers in turn
       ([d->experts][3]). */
    const float *router;
    const qk_w4_layer *experts;
} qk_decoder_layer;

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, inter, slots, cache_rows, kv_dt;
    double eps;
    int64_t window;  /* the sliding layers' window (positions), 0 when no layer slides */
    int64_t ropes;  /* rotary tables: cos/sin hold ropes rows of D per token */
    int64_t act;  /* the MLP's gate activation: 0 = SiLU, 1 = GELU (tanh approximation) */
    double attn_scale;  /* the q k^T scale; 0: 1 / sqrt(D) */
    double attn_softcap;  /* cap * tanh(logits / cap) on the scaled logits; 0: none */
    /* The MoE layers': experts, how many each token runs (top_k), whether their softmax
       weights are renormalised to sum 1, and an expert's intermediate size; 0 without MoE. */
    int64_t experts, top_k, renormalize, expert_inter;
} qk_decoder_dims;

/* One FP8 layer's static arguments, bound once (`CpuFp8Layer`): a decode call passes 9 arguments
   instead of 18 (each ctypes conversion costs ~0.1-0.2 us). */
typedef struct {
    const uint8_t *w;
    int64_t N, K, w_stride;
    const void *scale;
    int64_t s_dt, s_stride;
    const void *bias;
    int64_t b_dt, act_quant;
} qk_fp8_layer;

/* ---- w4a16.c (library qk_w4a16_cpu). Return value: 0, 1 = unsupported group layout,
   2 = out of memory. ---- */

/* 1 when this build has the bf16 tile (the CPU has AVX512-BF16), else 0. */
int qk_has_bf16_dot(void);

/* 1 when this build has the int8 tile (the CPU has AVX512-VNNI), else 0. */
int qk_has_int8_dot(void);

/* out [M, N] = x [M, K] @ dequant(W).T (+ bias), W the layer bound in L. act_dt: 1 (bf16) rounds
   x to bf16 for the bf16 tile, 3 (int8) quantizes it per block of 32-128 elements for the
   VNNI tile, where the build, the layer's groups and its interleaved copy (`wr`) allow, else
   fp32. */
int qk_w4a16_gemv_layer(const qk_w4_layer *L, const void *x, int x_dt, int64_t M,
                        int64_t x_stride, void *out, int o_dt, int64_t o_stride, int act_dt,
                        int n_threads);

/* The same with every argument passed (fp32 activations). */
int qk_w4a16_gemv(const void *x, int x_dt, int64_t M, int64_t K, int64_t x_stride,
                  const int32_t *wq, int64_t N, int64_t wq_stride,
                  const void *scale, int s_dt, int64_t n_groups, int64_t s_stride,
                  const int32_t *zp, int64_t zp_stride, int64_t group_size,
                  const void *bias, int b_dt, void *out, int o_dt, int64_t o_stride,
                  int n_threads);

/* Rows [n0, n1) of dequant(W) as fp32 [n1 - n0, K] into out. */
int qk_w4_dequant(const int32_t *wq, int64_t n0, int64_t n1, int64_t K, int64_t wq_stride,
                  const void *scale, int s_dt, int64_t n_groups, int64_t s_stride,
                  const int32_t *zp, int64_t zp_stride, float *out, int n_threads);

/* ---- decode.c (library qk_w4a16_cpu) ---- */

/* Floats of work buffer qk_decode_step needs for these layers, R rows and n_threads threads. */
int64_t qk_decode_work(const qk_decoder_layer *layers, int64_t n_layers,
                       const qk_decoder_dims *d, int64_t R, int n_threads);

/* Seconds spent in each phase by the steps since the last call into out[10] (unless NULL), in
   the order of a layer: norms and residual adds, the activations' rearrangement before each
   GEMV, qkv, rope + K/V write, attention, o, gate_up, silu, down, and the MoE layers' routing
   (router, top-k, gathering each expert's rows; their GEMVs count as gate_up and down);
   then zeroes them and turns the timers on or off. Returns how many steps ran timed. */
int qk_decode_phases(int on, double *out);

/* Every layer on x [R][H] in place; row_invariant: each row bit-identical to a one-row call.
   out_rows (0..R): the rows whose output is wanted, the last out_rows; the last layer writes
   every row's keys and values and computes the rest for those rows only (x's rows before them
   are left as the layer before the last wrote them). kv_dt in d: the cache format, 0 = fp32,
   1 = bf16, 2 = int8, 3 = fp8 e4m3 (decode.c's attend.c).
   Return value: 0, 1 = unsupported group layout, 2 = the work buffer is too small, 3 = a slot or
   position outside the cache, 4 = an unknown cache format, 5 = a layer's rope table past
   d->ropes, 6 = a MoE layer with no experts or top_k not in 1..experts, 7 = out_rows not in
   0..R. */
int qk_decode_step(const qk_decoder_layer *layers, int64_t n_layers, const qk_decoder_dims *d,
                   float *x, int64_t R, const int64_t *slot, const int64_t *pos,
                   const float *cos_, const float *sin_, int act_dt, int row_invariant,
                   int64_t out_rows, float *work, int64_t work_floats, int n_threads);

/* ---- fp8.c (library qk_fp8_cpu). Return value: 0, 2 = out of memory. ---- */

/* out [M, N] = x [M, K] @ (w8 * s).T (+ bias); act_quant: W8A8 (x rounded to fp8 per row). */
int qk_fp8_gemv(const void *x, int x_dt, int64_t M, int64_t K, int64_t x_stride, int act_quant,
                const uint8_t *w, int64_t N, int64_t w_stride, const void *scale, int s_dt,
                int64_t s_stride, const void *bias, int b_dt, void *out, int o_dt,
                int64_t o_stride, int n_threads);

/* The same with the layer's arguments bound in L. */
int qk_fp8_gemv_layer(const qk_fp8_layer *L, const void *x, int x_dt, int64_t M,
                      int64_t x_stride, void *out, int o_dt, int64_t o_stride, int n_threads);

/* Rows [n0, n1) of w8 * s as fp32 (s = 1 when scale is NULL). */
int qk_fp8_dequant(const uint8_t *w, int64_t n0, int64_t n1, int64_t K, int64_t w_stride,
                   const void *scale, int s_dt, int64_t s_stride, float *out, int n_threads);

/* x [M, K] -> fp8 codes [M, K] and one fp32 scale per row. */
int qk_fp8_quant_tokens(const void *x, int x_dt, int64_t M, int64_t K, int64_t x_stride,
                        uint8_t *codes, float *scales);

/* flags[n] = 1 where row n holds a NaN code (0x7F / 0xFF); returns how many rows do. */
int64_t qk_fp8_nan_rows(const uint8_t *w, int64_t N, int64_t K, int64_t w_stride,
                        uint8_t *flags);

/* ---- bf16_gemv.c (library qk_bf16_gemv). Return value: 0, 2 = out of memory, 4 = not in
   this build. ---- */

/* 1 when this build has the kernel (AVX512-BF16), else 0. */
int qk_bf16_gemv_available(void);

/* y [M, N] (fp32) = bf16(x) [M, K] (fp32) @ W.T, W bf16 [N, K]. */
int qk_bf16_gemv(const float *x, int64_t M, int64_t K, int64_t x_stride, const uint16_t *w,
                 int64_t N, int64_t w_stride, float *y, int64_t y_stride, int n_threads);

/* 1 when this build has the int8 kernel (AVX-512F), else 0. */
int qk_i8_gemv_available(void);

/* y [M, N] (fp32) = x [M, K] (fp32) @ (W8 * scale[:, None]).T, W8 int8 [N, K], scale fp32 [N]. */
int qk_i8_gemv(const float *x, int64_t M, int64_t K, int64_t x_stride, const int8_t *w,
               const float *scale, int64_t N, int64_t w_stride, float *y, int64_t y_stride,
               int n_threads);

/* 1 when this build has the int8 x int8 kernel (AVX512-VNNI), else 0. */
int qk_i8i8_gemv_available(void);

/* y [M, N] (fp32) = q(x) [M, K] @ (W8 * scale[:, None]).T with x quantized to int8 per block
   of `block` elements (32, 64 or 128, dividing K) and W8 held as wr: uint8 W8 + 128, 16 rows
   interleaved, [ceil(N / 16)][K / 4][16] words (word j of lane l: row 16 t + l's elements
   4j..4j+3), scale fp32 [ceil(N / 16) * 16]. M <= 16. best: NULL, or [M][QK_TOP] (QK_TOP = 8,
   common.h) set to each row's QK_TOP best columns as y holds them, in numpy's arg-max order
   (larger first, the lower column among equal values), -1 from the first whose value is not
   finite, and all -1 where a row holds a NaN or its largest value is infinite; kept as the
   tiles are stored. */
int qk_i8i8_gemv(const float *x, int64_t M, int64_t K, int64_t x_stride, const uint8_t *wr,
                 const float *scale, int64_t N, int64_t block, float *y, int64_t y_stride,
                 int n_threads, int64_t *best);

/* ---- i6_gemv.c (library qk_i6_gemv): the 6-bit lm_head. Return value: 0, 1 = a bad
   argument, 2 = out of memory, 4 = not in this build. ---- */

/* 1 when this build has the kernel (AVX512-VNNI), else 0. */
int qk_i6i8_gemv_available(void);

/* y [M, N] (fp32) = q(x) [M, K] @ (C * s).T with x quantized to int8 per block of 32 and the
   weight held as w: 6-bit codes u = C + 32 of 16 interleaved rows, [ceil(N / 16)][K / 32][384]
   bytes (i6_gemv.c's layout), scale fp16 [ceil(N / 16)][K / 32][16]. M <= 16, K % 32 == 0.
   best: as `qk_i8i8_gemv`'s. */
int qk_i6i8_gemv(const float *x, int64_t M, int64_t K, int64_t x_stride, const uint8_t *w,
                 const uint16_t *scale, int64_t N, float *y, int64_t y_stride, int n_threads,
                 int64_t *best);

/* ---- int8.c (library qk_int8_cpu): the W8A8 INT8 linear. Return value: 0, 1 = a bad
   argument, 2 = out of memory, 4 = not in this build. ---- */

/* 1 when this build has the kernel (AVX512-VNNI), else 0. */
int qk_w8a8_available(void);

/* The vpdpbusd peak: n_threads threads each run `rounds` rounds of 12 independent 512-bit
   vpdpbusd (64 u8 x s8 products each); returns the int8 operations done (a product and its add
   are 2), or 0 where this build has no AVX512-VNNI. The caller times the call. */
int64_t qk_int8_peak_ops(int64_t rounds, int n_threads);

/* x [M, K] (fp32) -> codes int8 [M, Kp] (zeros past K), and per row scales[m] = absmax / 127
   and sums[m] = the sum of its codes: round(x / scale) to nearest even, clamped to +-127. */
int qk_w8a8_quant_tokens(const float *x, int64_t M, int64_t K, int64_t x_stride, int8_t *codes,
                         int64_t Kp, float *scales, int32_t *sums, int n_threads);

/* y [M, N] (fp32) = (q(x) [M, K] @ W8.T) * sx * scale (+ bias), x quantized per row as
   qk_w8a8_quant_tokens does; W8 held as wr: uint8 W8 + 128, 16 rows interleaved,
   [ceil(N / 16)][Kp / 4][16] words (Kp = K rounded up to a multiple of 4, zero columns past
   K); scale and bias (NULL: none) fp32 [ceil(N / 16) * 16]. */
int qk_w8a8_gemm(const float *x, int64_t M, int64_t K, int64_t x_stride, const uint8_t *wr,
                 int64_t Kp, const float *scale, const float *bias, int64_t N, float *y,
                 int64_t y_stride, int n_threads);

/* ---- logit_mask.c (library qk_logit_mask): a grammar's bitmask on a step's logits. ---- */

/* out [rows, vocab] = logits where bit v of the row's mask (bits [rows, words] uint32, bit v % 32
   of word v / 32) is set, else -inf. Strides in floats. Returns 0, 1 = a bad argument
   (words * 32 < vocab). */
int qk_mask_logits(const float *logits, int64_t in_stride, float *out, int64_t out_stride,
                   const uint32_t *bits, int64_t words, int64_t rows, int64_t vocab);

#endif /* QUANTKIT_KERNELS_H */
