/* decode.c: the CPU decode step, every decoder layer of an INT4 Llama-family model for one
   new token of each of R sequences, in one call and one OpenMP parallel region.

   Why. At SmolLM2-135M sizes a decode step moves ~57 MB of INT4 weights, ~2 ms at this machine's
   bandwidth, but ran 14 ms as PyTorch ops and 120 kernel calls: each op and each call pays Python,
   dispatch and thread wake-up costs, and there are ~40 of them a layer. Here the whole body is one
   ctypes call; the two threads stay in one parallel region and meet at barriers (~1 us) between
   phases. The GEMVs are `gemv_rows` of `w4a16.c` (this file includes it: one translation unit,
   so they share its static kernels) over all R rows at once, so each weight is read once per
   step and dequantized once per chunk of rows; the rest (RMSNorm, RoPE, the KV write, attention
   over the cache, SiLU) is plain C on a few KB of activations.

   Layer, with x the residual stream [R][H] (fp32, updated in place), row r at cache row slot[r],
   position pos[r]:
     h = rmsnorm(x) ; qkv = W_qkv h ; rope(q), rope(k) ; cache[slot][pos] = k, v
     a = softmax(q k^T / sqrt(D)) v over positions 0..pos of its own cache row (GQA: q head h reads
         kv head h / (Hq/Hkv))
     x += W_o a ; h = rmsnorm(x) ; g, u = W_gate_up h ; x += W_down (silu(g) * u)
   What the other dense families add, each where the layer's or the dims' field is set (the
   Llama layer above when none is): an RMSNorm of each q and k head before rope (q_norm,
   k_norm: Qwen3, Gemma 3); an RMSNorm of W_o a and of the down projection's output before each
   residual add (attn_out_norm, ffn_out_norm: Gemma's sandwich norms; post_norm is then the
   MLP's input norm); a GELU gate (act); a q k^T scale (attn_scale) and soft-capped logits
   (attn_softcap: Gemma 2); sliding layers, which attend to the last d->window positions only;
   and several rope tables, of which each layer reads its own (`rope`: Gemma 3's local rope).
   Gemma's (1 + w) norm weights arrive as 1 + w.
   Each row attends to its own cache row's positions <= pos only, so it computes what it would
   alone (the causal mask of a right-padded or continuous batch). Rows may share a cache row at
   distinct positions: every row's K/V is written before any row attends, so R consecutive tokens
   of one sequence are a causal prefill. RoPE takes the cos/sin rows torch computed
   for each row's position (the HF rotate-half layout), so the rotation is exactly the PyTorch
   path's. row_invariant: every row's GEMVs run as in a one-row call (`row_chunk`), so each
   row's result is bit-identical to what it would be alone (the rest of a layer is per row
   already); speculative decoding's verification needs that. The cache may hold K/V as fp32,
   bf16, or int8 / fp8 e4m3 codes with a scale per head and position (`d->kv_dt`, attend.c).
   Return value: 0, 1 = unsupported group layout, 2 = the work buffer is too small, 3 = a slot or
   position outside the cache, 4 = an unknown cache format, 5 = a layer's rope table past
   d->ropes, 6 = a MoE layer with no experts or top_k not in 1..experts. */

/* The INT4 library's translation unit: the GEMV kernels (and through them `common.h` and
   `quantkit_kernels.h`, which declares qk_decoder_layer and qk_decoder_dims), then the step. */
#include "w4a16.c"

static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* Phase timers (`qk_decode_phases`): when on, thread 0 adds the wall time of each phase of each
   layer to phase_s, read at the phase's end, which every thread reaches together (each phase
   is an `omp for` and ends at its implicit barrier), so a phase's time includes the wait for
   its slowest thread. Off, the cost is one predictable branch per phase. */
enum { PH_NORM, PH_PERMUTE, PH_QKV, PH_ROPE_KV, PH_ATTENTION, PH_O, PH_GATE_UP, PH_SILU, PH_DOWN,
       PH_ROUTE, QK_PHASES };  /* out[] of qk_decode_phases, in this order (decode_cpu.PHASES) */
static double phase_s[QK_PHASES];
static int64_t phase_calls;
static int phases_on;

int qk_decode_phases(int on, double *out) {
    if (out)
        for (int p = 0; p < QK_PHASES; p++) out[p] = phase_s[p];
    int64_t calls = phase_calls;
    for (int p = 0; p < QK_PHASES; p++) phase_s[p] = 0.0;
    phase_calls = 0;
    phases_on = on;
    return (int)calls;
}

#define PHASE_END(p) \
    do { \
        if (timed) { \
            double now_ = omp_get_wtime(); \
            phase_s[p] += now_ - mark; \
            mark = now_; \
        } \
    } while (0)

/* A layer's MLP matmuls: gate_up and down, or (a MoE layer) its first expert's gate, up and
   down, which every expert's equal in shape and groups (the binding checks). */
static int64_t mlp_layers(const qk_decoder_layer *L, const qk_w4_layer **out) {
    if (!L->router) {
        out[0] = &L->gate_up, out[1] = &L->down, out[2] = NULL;
        return 2;
    }
    out[0] = L->experts, out[1] = L->experts + 1, out[2] = L->experts + 2;
    return 3;
}

static int64_t decode_gemv_scratch(const qk_decoder_layer *layers, int64_t n_layers, int64_t R) {
    int64_t gemv = 0;
    for (int64_t l = 0; l < n_layers; l++) {
        const qk_decoder_layer *L = layers + l;
        const qk_w4_layer *mlp[3];
        const int64_t n_mlp = mlp_layers(L, mlp);
        gemv = max64(gemv, gemv_scratch(&L->qkv, R));
        gemv = max64(gemv, gemv_scratch(&L->o, R));
        for (int64_t i = 0; i < n_mlp; i++) gemv = max64(gemv, gemv_scratch(mlp[i], R));
    }
    return gemv;
}

/* Floats a chosen expert of a one-row step takes (`moe_one_row`): its gate and up outputs, its
   down output, and its down input as int8 codes with their block scales and sums (`i8_parts`
   of one row, blocks of >= 32). */
static int64_t moe_codes_floats(const qk_decoder_dims *d) {
    return d->expert_inter / 4 + 2 * (d->expert_inter / 32) + 16;
}

static int64_t moe_row_floats(const qk_decoder_dims *d) {
    return 2 * d->expert_inter + d->hidden + moe_codes_floats(d) + 16;
}

/* Floats of the MoE layers' buffers: the gathered rows and the experts' sum [R][H] each, the
   router's probabilities [R][E], each row's top-k weights [R][k], each expert's rows' weights
   [E][R], then 8-byte integers (2 floats each): each row's experts [R][k], each expert's rows
   [E][R] and counts [E]. */
static int64_t moe_floats(const qk_decoder_dims *d, int64_t R) {
    const int64_t E = d->experts, K = d->top_k;
    if (E <= 0) return 0;
    return 2 * R * d->hidden + R * E + R * K + E * R + 2 * (R * K + E * R + E) + 2
           + K * moe_row_floats(d);
}

/* The MLP buffer's floats a row: gate and up outputs side by side, of the dense MLP or of an
   expert, whichever is wider. */
static int64_t gu_floats(const qk_decoder_dims *d) {
    return 2 * max64(d->inter, d->experts > 0 ? d->expert_inter : 0);
}

/* Long rows' attention is split over chunks of positions (flash-decoding): a row whose context
   spans >= 2 chunks becomes one work unit per (KV head, chunk), all its query heads together,
   each a partial that `attend_merge` combines. Chunks of 512 positions (at most 16 a row). A
   row at batch 1 otherwise has only its 9 query heads to share between the threads (SmolLM2),
   each head reads its KV head's whole cache for itself, and one thread may get 5 heads of 9.
   Shorter rows keep the per-head units and compute exactly what they did. */
static int64_t split_chunk(int64_t S) { return max64(512, (S + 15) / 16); }

/* Chunks of `split_chunk(S)` positions that n positions take (a row splits at >= 2). */
static int64_t chunks_of(int64_t n, int64_t S) {
    return (n + split_chunk(S) - 1) / split_chunk(S);
}

/* Work units of one step's attention (`attention_units`): a row, its first query head, how
   many heads, the positions [j0, j1), and the partial slot (-1: the row is not split). */
typedef struct { int64_t r, i0, nh, j0, j1, part; } attend_unit;

/* Rows of S attention scores a thread keeps: one a head of the heads `attend_heads` takes at
   once (HEADS_AT_ONCE, at most 4). */
#define SCORE_ROWS 4

/* Floats of work buffer `qk_decode_step` needs for these layers, R rows and n_threads threads
   (the attention scores are SCORE_ROWS rows of S per thread, not one per row and head: a
   1024-token prefill of a 32-head model over 8192 slots would otherwise need 1 GB), with the
   split rows' partials and the unit table. */
int64_t qk_decode_work(const qk_decoder_layer *layers, int64_t n_layers,
                       const qk_decoder_dims *d, int64_t R, int n_threads) {
    int64_t qkv = (d->heads + 2 * d->kv_heads) * d->head_dim;
    const int64_t nch = chunks_of(d->slots, d->slots);
    const int64_t units = 2 * (R * d->heads + R * d->kv_heads * nch);  /* full, sliding */
    return decode_gemv_scratch(layers, n_layers, R)
           + R * (d->hidden * 2 + qkv + d->heads * d->head_dim + gu_floats(d))
           + moe_floats(d, R)
           + (int64_t)(n_threads > 0 ? n_threads : 1) * d->slots * SCORE_ROWS
           + R * d->heads * nch * (d->head_dim + 2)                            /* partials */
           + units * (int64_t)(sizeof(attend_unit) / sizeof(float)) + 64;
}

/* The first position a token at position p attends to: 0, or in a sliding layer the first of
   the last `window` (transformers' rule: slot > p - window). */
static int64_t first_key(const qk_decoder_dims *d, int64_t p, int64_t sliding) {
    return sliding && d->window > 0 && p - d->window + 1 > 0 ? p - d->window + 1 : 0;
}

/* The units of this step for the full layers (sliding 0) or the sliding ones (1), the same for
   every such layer, long rows' first; returns how many and sets *split when any row is split.
   Ordered by KV head (and chunk), then row: in a prefill the rows that follow one another read
   the same keys and values, so a thread's next unit finds them in its L2 (by row first, every
   unit read its 256 KB of K/V again from L3). Llama-3.2-1B shape, 2 threads, alternating: the
   attention of a 4096-token prefill 4.8 -> 4.0 s, of a 512-token one 71 -> 56 ms. */
static int64_t attention_units(const qk_decoder_dims *d, int64_t R, const int64_t *pos,
                               int64_t sliding, int64_t per_unit, attend_unit *units,
                               int *split) {
    const int64_t Hq = d->heads, Hkv = d->kv_heads, group = Hq / Hkv;
    const int64_t ch = split_chunk(d->slots), nch_max = chunks_of(d->slots, d->slots);
    int64_t n = 0;
    *split = 0;
    for (int64_t g = 0; g < Hkv; g++)
        for (int64_t c = 0; c < nch_max; c++)
            for (int64_t r = 0; r < R; r++) {
                const int64_t lo = first_key(d, pos[r], sliding), end = pos[r] + 1;
                const int64_t nch = chunks_of(end - lo, d->slots);
                if (nch < 2 || c >= nch) continue;
                *split = 1;
                const int64_t j1 = lo + (c + 1) * ch < end ? lo + (c + 1) * ch : end;
                units[n++] = (attend_unit){r, g * group, group, lo + c * ch, j1,
                                           (r * Hq + g * group) * nch_max + c};
            }
    for (int64_t i0 = 0; i0 < Hq; i0 += per_unit)
        for (int64_t r = 0; r < R; r++) {
            const int64_t lo = first_key(d, pos[r], sliding), end = pos[r] + 1;
            if (chunks_of(end - lo, d->slots) < 2)
                units[n++] = (attend_unit){r, i0, per_unit, lo, end, -1};
        }
    return n;
}

static inline float dot(const float *a, const float *b, int64_t n);

static void rmsnorm(const float *x, const float *w, int64_t n, float eps, float *out) {
    float r = 1.0f / sqrtf(dot(x, x, n) / (float)n + eps);  /* 16 partial sums, not one chain */
    for (int64_t i = 0; i < n; i++) out[i] = x[i] * r * w[i];
}

/* a . b with 16 independent partial sums: gcc vectorises the lane loop (a plain running sum
   is one dependent chain of n FMAs, ~4 cycles each: the attention scores took ~7 ms of a
   batch-8 SmolLM2 step that way). */
static inline float dot(const float *a, const float *b, int64_t n) {
    float acc[16] = {0};
    int64_t e = 0;
    for (; e + 16 <= n; e += 16)
        for (int l = 0; l < 16; l++) acc[l] += a[e + l] * b[e + l];
    for (int l = 0; e < n && l < 16; e++, l++) acc[l] += a[e] * b[e];  /* l < 16 always */
    for (int w = 8; w; w >>= 1)
        for (int l = 0; l < w; l++) acc[l] += acc[l + w];
    return acc[0];
}

#if defined(__AVX512F__)
/* exp of 16 lanes: n = round(x / ln 2), r = x - n ln 2 (in two parts), a degree-7 polynomial
   for e^r on [-ln2/2, ln2/2] (the Cephes expf coefficients, ~1 ulp), times 2^n by vscalefps
   (which also gives 0 far below -87). glibc's scalar expf, called per element, was the SiLU's
   and the softmax's whole cost: ~0.5 M calls in a batch-8 SmolLM2 step. */
static inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.0f)), _mm512_set1_ps(88.72f));
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
    return _mm512_scalef_ps(p, n);
}

#endif

#if defined(__AVX512F__)
/* silu(g) * u and gelu(g) * u (GELU's tanh approximation, Gemma's GeGLU:
   0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))), tanh(y) = 1 - 2 / (1 + e^(2y))) of 16
   lanes: the one definition `glu_mul` and the prefill's fused gate_up (`gate_up_glu`) share,
   so both give the same bits. */
static inline __m512 silu_mul16(__m512 gv, __m512 uv) {
    __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
    __m512 silu = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
    return _mm512_mul_ps(silu, uv);
}

static inline __m512 gelu_mul16(__m512 gv, __m512 uv) {
    const __m512 one = _mm512_set1_ps(1.0f), two = _mm512_set1_ps(2.0f);
    __m512 inner = _mm512_mul_ps(_mm512_set1_ps(0.7978845608028654f),
        _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(0.044715f), gv), _mm512_mul_ps(gv, gv), gv));
    __m512 e = exp16(_mm512_mul_ps(two, inner));
    __m512 th = _mm512_sub_ps(one, _mm512_div_ps(two, _mm512_add_ps(one, e)));
    __m512 gelu = _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), gv), _mm512_add_ps(one, th));
    return _mm512_mul_ps(gelu, uv);
}
#endif

/* g[i] = act(g[i]) * u[i] for i < n: act SiLU (0) or GELU's tanh approximation (1). */
static void glu_mul(float *g, const float *u, int64_t n, int act) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i < n; i += 16) {
        __mmask16 k = tail_mask(n - i);
        __m512 gv = _mm512_maskz_loadu_ps(k, g + i), uv = _mm512_maskz_loadu_ps(k, u + i);
        _mm512_mask_storeu_ps(g + i, k, act == 1 ? gelu_mul16(gv, uv) : silu_mul16(gv, uv));
    }
#endif
    const float c0 = 0.7978845608028654f, c1 = 0.044715f;
    for (; i < n; i++)
        g[i] = act == 1 ? 0.5f * g[i] * (1.0f + tanhf(c0 * (g[i] + c1 * g[i] * g[i] * g[i]))) * u[i]
                        : g[i] / (1.0f + expf(-g[i])) * u[i];
}

/* gu holds `rows` rows of gate | up (I each, the row 2I wide): each gate half becomes
   act(gate) * up, in 256-wide chunks (a vector loop) over the team (an orphaned `omp for`). */
static void glu_rows(float *gu, int64_t rows, int64_t I, int act) {
    const int64_t n_chunks = (I + 255) / 256;
    #pragma omp for schedule(static)
    for (int64_t rc = 0; rc < rows * n_chunks; rc++) {
        float *g = gu + (rc / n_chunks) * 2 * I;
        int64_t i0 = (rc % n_chunks) * 256, i1 = i0 + 256 < I ? i0 + 256 : I;
        glu_mul(g + i0, g + I + i0, i1 - i0, act);
    }
}

/* a[j] += t[j] * w for j < n: a chosen expert's output added to its row's sum, in one place
   so that the per-expert loop and `moe_one_row` compile the same operations. */
static inline void add_scaled(float *a, const float *t, float w, int64_t n) {
    for (int64_t j = 0; j < n; j++) a[j] += t[j] * w;
}

/* Whether a prefill's norm can go straight to Q's int8 codes (`norm_row_i8`): int8 rows in
   the prefill tile's chunks (not row-invariant, I8_GEMM_ROWS rows or more) over Q's whole
   input; never in a build without the int8 tile. */
static int norm_to_i8(const qk_w4_layer *Q, int xq_dt, int64_t M, int64_t H, int row_invariant) {
#if defined(__AVX512VNNI__)
    return xq_dt == DT_I8 && !row_invariant && M >= I8_GEMM_ROWS && Q->K == H &&
           i8_block(Q) <= 128;
#else
    (void)Q, (void)xq_dt, (void)M, (void)H, (void)row_invariant;
    return 0;
#endif
}

#if defined(__AVX512VNNI__)

/* Row m of M: rmsnorm(x, w) rounded straight to Q's int8 codes at xp (`i8_parts(xp, M, H,
   A)`), a block at a time on the stack: the values `rmsnorm` writes, then the codes
   `quantize_x_i8` makes of them, so the same bits without the normed rows written out and
   read back (a prefill's qkv and gate_up input). 512-token prefill, alternating in one
   process: the norm and rounding phases 15.6 -> 12.3 ms (1B shape, median ratio 0.995),
   74.1 -> 56.8 ms (Qwen3-8B shape, 1.000). */
static void norm_row_i8(const float *x, const float *w, int64_t H, float eps,
                        const qk_w4_layer *Q, int64_t M, int64_t m, float *xp) {
    const int64_t A = i8_block(Q);
    int8_t *xq;
    float *ta, *xs;
    i8_parts(xp, M, H, A, &xq, &ta, &xs);
    const float r = 1.0f / sqrtf(dot(x, x, H) / (float)H + eps);  /* as `rmsnorm` */
    float v[128] __attribute__((aligned(64)));
    for (int64_t b = 0; b < H / A; b++) {
        for (int64_t e = 0; e < A; e++) v[e] = x[b * A + e] * r * w[b * A + e];
        quantize_block_i8_from(v, H, A, M, xq, ta, xs, b, m, 0);
    }
}
#endif

/* Row m of M normed: rounded straight to Q's int8 codes at xp where `to_i8` (`norm_to_i8`),
   else written to out (`rmsnorm`). */
static inline void norm_row(const float *x, const float *w, int64_t H, float eps, int to_i8,
                            const qk_w4_layer *Q, int64_t M, int64_t m, float *xp, float *out) {
#if defined(__AVX512VNNI__)
    if (to_i8) {
        norm_row_i8(x, w, H, eps, Q, M, m, xp);
        return;
    }
#else
    (void)to_i8, (void)Q, (void)M, (void)m, (void)xp;
#endif
    rmsnorm(x, w, H, eps, out);
}

#if defined(__AVX512VNNI__)
/* Row chunks of a prefill's fused gate_up with the down's quantization (`gate_up_glu`) taken
   together: each tile pair's weights go once over their rows. 1B shape, 512 tokens, in-process
   A/B against the unfused pass (median per-round ratio of 8-12 rounds): 4 chunks 0.983-0.987,
   1 chunk 0.986-0.992, 8 0.998, 16 0.995. */
#define GLU_CHUNKS 4
/* A prefill's gate_up (int8 activations, I8_GEMM_ROWS rows or more) with the activation in
   the tile's epilogue: gate tile u is paired with up tile u + I / 16 (`gemm_tile_i8` takes any
   two), and act(gate + bias) * (up + bias) goes to out[m][16u ..] (the gate half of a [M][2I]
   row, stride o_stride), where `gemv_rows` + `glu_mul` write both halves and read them back.
   The same operations on the same values: the same bits. 0 (nothing done) where it does not
   apply: the caller runs the two passes.
   With Dn (the down projection, int8 activations: xd_dt DT_I8) it goes one step further and
   returns 2: the pairs are taken A / 16 at a time (A = `i8_block(Dn)`, one block of the down's
   input), and the products of GLU_CHUNKS row chunks, kept on the stack, are quantized as
   `quantize_x_i8` would (`quantize_block_i8_from`: the same codes) into the down's
   activations at dq (`i8_parts(dq, M, I, A)`). The products are never written out nor read
   back, and the down's own quantization pass is skipped. */
static int gate_up_glu(const qk_w4_layer *L, const float *xp, int xp_dt, int64_t M, float *out,
                       int64_t o_stride, int act, const qk_w4_layer *Dn, int xd_dt, float *dq) {
    if (xp_dt != DT_I8 || M < I8_GEMM_ROWS || L->N % 32) return 0;
    const int64_t K = L->K, G = L->n_groups, A = i8_block(L), nb = K / A, half = L->N / 32;
    const int64_t W = K / 8, cpb = A / 8, bpg = G == 1 ? nb : L->group_size / A;
    const int s_dt = (int)L->s_dt;
    const int64_t s_bytes = s_dt == DT_F32 ? 4 : 2;
    int8_t *xq;
    float *ta, *xs;
    i8_parts((float *)xp, M, K, A, &xq, &ta, &xs);
    const int64_t Ad = Dn && xd_dt == DT_I8 && Dn->K == 16 * half ? i8_block(Dn) : 0;
    if (Ad >= 16 && Ad <= 128 && half % (Ad / 16) == 0) {
        const int64_t P = Ad / 16;
        int8_t *dxq;
        float *dta, *dxs;
        i8_parts(dq, M, Dn->K, Ad, &dxq, &dta, &dxs);
        #pragma omp for schedule(static)
        for (int64_t b = 0; b < half / P; b++) {
            i8_tile T0[8], T1[8];
            for (int64_t p = 0; p < P; p++) {
                T0[p] = i8_tile_at(L, b * P + p, s_bytes);
                T1[p] = i8_tile_at(L, b * P + p + half, s_bytes);
            }
            /* GLU_CHUNKS row chunks at a time (chunks start at multiples of I8_MR), each pair's
               weights once over them */
            for (int64_t g0 = 0; g0 < M; g0 += GLU_CHUNKS * I8_MR) {
                const int64_t g1 = g0 + GLU_CHUNKS * I8_MR < M ? g0 + GLU_CHUNKS * I8_MR : M;
                float blk[GLU_CHUNKS * I8_MR][128] __attribute__((aligned(64)));
                for (int64_t p = 0; p < P; p++) {
                    for (int64_t m0 = g0, mb; m0 < g1; m0 += mb) {
                        i8_chunk(m0, M, 0, &m0, &mb);
                        __m512 r0[I8_MR], r1[I8_MR];
                        gemm_pair_i8(mb, m0, T0 + p, T1 + p, xq, ta, xs, K, nb, s_dt, s_bytes,
                                     W, cpb, bpg, r0, r1);
                        for (int64_t i = 0; i < mb; i++) {
                            const __m512 g = _mm512_add_ps(r0[i], T0[p].bias);
                            const __m512 v = _mm512_add_ps(r1[i], T1[p].bias);
                            _mm512_store_ps(blk[m0 - g0 + i] + 16 * p,
                                            act == 1 ? gelu_mul16(g, v) : silu_mul16(g, v));
                        }
                    }
                }
                for (int64_t m = g0; m < g1; m++)
                    quantize_block_i8_from(blk[m - g0], Dn->K, Ad, M, dxq, dta, dxs, b, m, 0);
            }
        }
        return 2;
    }
    #pragma omp for schedule(static)
    for (int64_t u = 0; u < half; u++) {
        const i8_tile T = i8_tile_at(L, u, s_bytes), T1 = i8_tile_at(L, u + half, s_bytes);
        for (int64_t m0 = 0, mb; m0 < M; m0 += mb) {
            i8_chunk(m0, M, 0, &m0, &mb);
            __m512 r0[I8_MR], r1[I8_MR];
            gemm_pair_i8(mb, m0, &T, &T1, xq, ta, xs, K, nb, s_dt, s_bytes, W, cpb, bpg, r0, r1);
            for (int64_t i = 0; i < mb; i++) {
                const __m512 g = _mm512_add_ps(r0[i], T.bias), v = _mm512_add_ps(r1[i], T1.bias);
                _mm512_storeu_ps(out + (m0 + i) * o_stride + 16 * u,
                                 act == 1 ? gelu_mul16(g, v) : silu_mul16(g, v));
            }
        }
    }
    return 1;
}

/* Tile t of L (16 output rows) against one row of int8 activations (codes xq, block scales ta
   and sums xs, as `i8_parts` lays out one row) into out[16t ..]: what `gemv_rows_i8` does for
   that tile in a one-row call, so the same bits. */
static inline void i8_row_tile(const qk_w4_layer *L, int64_t t, const int8_t *xq,
                               const float *ta, const float *xs, float *out) {
    const int64_t K = L->K, G = L->n_groups, A = i8_block(L), nb = K / A;
    const int64_t W = K / 8, cpb = A / 8, bpg = G == 1 ? nb : L->group_size / A;
    const int s_dt = (int)L->s_dt;
    const int64_t s_bytes = s_dt == DT_F32 ? 4 : 2;
    const i8_tile T = i8_tile_at(L, t, s_bytes);
    __m512 res[MAX_MB];
    gemv_tile_i8(1, T.w, xq, ta, xs, T.sr, s_dt, s_bytes, T.zr, W, cpb, bpg, res);
    store_tile_i8(res, 1, 0, &T, out, DT_F32, 0);
}

/* A one-row step's MoE layer, its chosen experts' matmuls together: every chosen expert's gate
   and up tiles in one `omp for`, their activations in one, their down inputs quantized in one,
   their down tiles in one, then x += the experts' weighted sum. The per-expert loop beside it
   meets at ~8 barriers an expert (64 a layer at top-8), each GEMV a short stream. Each tile,
   block and sum is computed as that loop computes it, and the sum adds the experts in index
   order as it does: the same bits. h: the layer's normed row; buf: `moe_row_floats` a chosen
   expert. */
static void moe_one_row(const qk_decoder_layer *L, const qk_decoder_dims *d, const float *h,
                        float *x, float *acc, float *xp, const int64_t *sel, const float *wt,
                        float *buf,
                        int act, int timed, double *markp) {
    double mark = *markp;
    const int64_t H = d->hidden, EI = d->expert_inter, TK = d->top_k;
    int64_t ord[64];
    float w[64];
    for (int64_t k = 0; k < TK; k++) ord[k] = sel[k], w[k] = wt[k];
    for (int64_t k = 1; k < TK; k++)  /* the chosen experts in index order */
        for (int64_t j = k; j > 0 && ord[j - 1] > ord[j]; j--) {
            const int64_t e = ord[j]; ord[j] = ord[j - 1]; ord[j - 1] = e;
            const float v = w[j]; w[j] = w[j - 1]; w[j - 1] = v;
        }
    const qk_w4_layer *E0 = L->experts + 3 * ord[0];
    const int64_t tg = (EI + 15) / 16, td = (H + 15) / 16;
    float *gu = buf, *t = buf + TK * 2 * EI, *codes = t + TK * H;
    int8_t *xq;
    float *ta, *xs;
    quantize_x_i8(h, DT_F32, E0, 1, H, xp, 0);
    i8_parts(xp, 1, H, i8_block(E0), &xq, &ta, &xs);
    PHASE_END(PH_PERMUTE);
    #pragma omp for schedule(static)
    for (int64_t f = 0; f < TK * 2 * tg; f++) {
        const int64_t k = f / (2 * tg), which = f % (2 * tg) / tg, tile = f % tg;
        i8_row_tile(L->experts + 3 * ord[k] + which, tile, xq, ta, xs, gu + k * 2 * EI + which * EI);
    }
    PHASE_END(PH_GATE_UP);
    glu_rows(gu, TK, EI, act);
    PHASE_END(PH_SILU);
    /* chosen expert k's down input: one row as `i8_parts` lays it out, at codes + k * cf */
    const int64_t Ad = i8_block(E0 + 2), nbd = EI / Ad, cf = moe_codes_floats(d);
    int8_t *q;
    float *s, *z;
    #pragma omp for schedule(static)
    for (int64_t kb = 0; kb < TK * nbd; kb++) {
        i8_parts(codes + kb / nbd * cf, 1, EI, Ad, &q, &s, &z);
        quantize_block_i8_at(gu + kb / nbd * 2 * EI, DT_F32, EI, Ad, 1, 2 * EI, q, s, z, kb % nbd,
                             0, 0);
    }
    PHASE_END(PH_PERMUTE);
    #pragma omp for schedule(static)
    for (int64_t f = 0; f < TK * td; f++) {
        i8_parts(codes + f / td * cf, 1, EI, Ad, &q, &s, &z);
        i8_row_tile(L->experts + 3 * ord[f / td] + 2, f % td, q, s, z, t + f / td * H);
    }
    PHASE_END(PH_DOWN);
    /* acc = the experts' outputs weighted, added in index order from 0, then x += acc: the
       per-expert loop's additions, in 256-wide chunks over the threads */
    const int64_t h_chunks = (H + 255) / 256;
    #pragma omp for schedule(static)
    for (int64_t c = 0; c < h_chunks; c++) {
        const int64_t j0 = c * 256, n = j0 + 256 < H ? 256 : H - j0;
        for (int64_t j = j0; j < j0 + n; j++) acc[j] = 0.0f;
        for (int64_t k = 0; k < TK; k++) add_scaled(acc + j0, t + k * H + j0, w[k], n);
        for (int64_t j = j0; j < j0 + n; j++) x[j] += acc[j];
    }
    PHASE_END(PH_NORM);
    *markp = mark;
}
#endif

#include "attend.c"

static void rope(float *v, const float *cos_, const float *sin_, int64_t D) {
    int64_t h = D / 2;
    for (int64_t i = 0; i < h; i++) {
        float a = v[i], b = v[i + h];
        v[i] = a * cos_[i] - b * sin_[i];
        v[i + h] = b * cos_[i + h] + a * sin_[i + h];
    }
}

/* Row r: x [r][H], its token at cache row slot[r] and position pos[r], cos/sin [r][D].
   act_dt: the activations' dtype inside the GEMVs, DT_F32 or DT_BF16 (where `gemv_x_dt`
   allows it; the rest of the layer is fp32 either way). */
int qk_decode_step(const qk_decoder_layer *layers, int64_t n_layers, const qk_decoder_dims *d,
                   float *x, int64_t R, const int64_t *slot, const int64_t *pos,
                   const float *cos_, const float *sin_, int act_dt, int row_invariant,
                   int64_t out_rows, float *work, int64_t work_floats, int n_threads) {
    const int64_t H = d->hidden, Hq = d->heads, Hkv = d->kv_heads, D = d->head_dim;
    const int64_t I = d->inter, S = d->slots, group = Hq / Hkv, QKV = (Hq + 2 * Hkv) * D;
    const int kv = (int)d->kv_dt;
    const int64_t E = kv_bytes(kv, D), row_stride = Hkv * S * E;  /* bytes: a position, a row */
    const float eps = (float)d->eps, cap = (float)d->attn_softcap;
    const float scale = d->attn_scale > 0.0 ? (float)d->attn_scale : 1.0f / sqrtf((float)D);
    const int64_t ropes = d->ropes > 0 ? d->ropes : 1;
    if (n_threads < 1) n_threads = 1;
    if (work_floats < qk_decode_work(layers, n_layers, d, R, n_threads)) return 2;
    if (kv < KV_F32 || kv > KV_FP8) return 4;
    if (out_rows < 0 || out_rows > R) return 7;
    for (int64_t l = 0; l < n_layers; l++)
        if (layers[l].rope < 0 || layers[l].rope >= ropes) return 5;
    for (int64_t r = 0; r < R; r++)
        if (pos[r] < 0 || pos[r] >= S || slot[r] < 0 || slot[r] >= d->cache_rows) return 3;
    for (int64_t l = 0; l < n_layers; l++) {
        int64_t bpg;
        int gsh;
        const qk_decoder_layer *L = layers + l;
        if (group_layout(&L->qkv, &bpg, &gsh) || group_layout(&L->o, &bpg, &gsh)) return 1;
        const int64_t n_mlp = L->router ? 3 * d->experts : 2;
        const qk_w4_layer *mlp = L->router ? L->experts : NULL;
        for (int64_t i = 0; i < n_mlp; i++)
            if (group_layout(mlp ? mlp + i : i ? &L->down : &L->gate_up, &bpg, &gsh)) return 1;
        if (L->router && (d->experts < 1 || d->top_k < 1 || d->top_k > d->experts)) return 6;
    }
    /* work: xp + params (the GEMV scratch; xp first) | h [R][H] | t [R][H] | qkv [R][QKV] |
       att [R][Hq * D] | gu [R][gu_floats] | scores [n_threads][S] | partials | the MoE
       buffers (moe_floats) | the attention units */
    float *xp = work, *h = work + decode_gemv_scratch(layers, n_layers, R), *t = h + R * H;
    float *qkv = t + R * H, *att = qkv + R * QKV, *gu = att + R * Hq * D;
    float *scores = gu + R * gu_floats(d), *parts = scores + (int64_t)n_threads * S * SCORE_ROWS;
    const int64_t nch_max = chunks_of(S, S);
    const int64_t NE = d->experts, TK = d->top_k, EI = d->expert_inter;
    float *xe = parts + R * Hq * nch_max * (D + 2), *acc = xe + R * H, *probs = acc + R * H;
    float *wt = probs + R * NE, *w_of = wt + R * TK;  /* w_of [NE][R]: an expert's rows' weights */
    int64_t *sel = (int64_t *)(((uintptr_t)(w_of + NE * R) + 7) & ~(uintptr_t)7);
    int64_t *rows_of = sel + R * TK, *count = rows_of + NE * R;
    float *moe_row = (float *)(count + NE);  /* `moe_one_row`'s buffers */
    (void)moe_row;  /* unused without AVX512-VNNI */
    attend_unit *units = (attend_unit *)(((uintptr_t)(xe + moe_floats(d, R)) + 7) & ~(uintptr_t)7);
    /* the sliding layers' table after the full layers' (the most units one table takes) */
    attend_unit *units_sliding = units + R * Hq + R * Hkv * nch_max;
    /* Attention work units: a row's whole GQA group of query heads, which then reads its K/V
       once from memory and again from L1/L2, when that leaves >= 4 units a thread; else one
       head (batch 1: 3 groups would leave a thread idle). Heads handed out one at a time sent
       a group's heads to both threads, and each thread read every K/V row from memory.
       SmolLM2, 2 threads, A/B in one run: R=8 (context 61-110) 9.33 -> 8.48 ms, a 40-token
       prefill 32.3 -> 31.7 ms, R=1 unchanged. */
    const int64_t per_unit = R * Hkv >= 4 * n_threads ? group : 1;
    int splits[2] = {0, 0};
    int64_t n_units_of[2] = {0, 0};
    for (int64_t l = 0; l < n_layers; l++) {  /* the tables the layers read, once each */
        const int64_t sl = layers[l].sliding != 0;
        if (n_units_of[sl] == 0)
            n_units_of[sl] = attention_units(d, R, pos, sl, per_unit, sl ? units_sliding : units,
                                             &splits[sl]);
    }

    if (phases_on) phase_calls++;
    #pragma omp parallel num_threads(n_threads)
    {
    const int timed = phases_on && omp_get_thread_num() == 0;
    double mark = timed ? omp_get_wtime() : 0.0;
    for (int64_t l = 0; l < n_layers; l++) {
        const qk_decoder_layer *L = layers + l;
        const int xq = gemv_x_dt(&L->qkv, act_dt), xo = gemv_x_dt(&L->o, act_dt);
        const qk_w4_layer *mlp[3];
        mlp_layers(L, mlp);
        const int xg = gemv_x_dt(mlp[0], act_dt);
        const int xd = gemv_x_dt(L->router ? mlp[2] : mlp[1], act_dt);
        const int64_t sl = L->sliding != 0, n_units = n_units_of[sl];
        const attend_unit *lunits = sl ? units_sliding : units;
        /* The rows whose output is wanted from the attention on: r0 .. R, all but in the last
           layer with out_rows < R (a prefill wants its last row's state; the layer writes
           every row's keys and values). Each row's attention and norms are the same operations
           whatever other rows a call holds, and so are its int8 GEMVs (integer sums): with int8
           activations those rows come out the same bits; fp32 and bf16 GEMVs keep more
           accumulators for fewer rows (rounding apart). */
        const int64_t r0 = l == n_layers - 1 ? R - out_rows : 0, Rl = R - r0;
        float *xl = x + r0 * H;
        /* the norm rounded straight to the qkv's int8 codes */
        const int norm_i8 = norm_to_i8(&L->qkv, xq, R, H, row_invariant);
        #pragma omp for schedule(static)
        for (int64_t r = 0; r < R; r++)
            norm_row(x + r * H, L->in_norm, H, eps, norm_i8, &L->qkv, R, r, xp, h + r * H);
        PHASE_END(PH_NORM);
        if (!norm_i8) permute_x(h, DT_F32, &L->qkv, R, H, xp, xq, row_invariant);
        PHASE_END(PH_PERMUTE);
        gemv_rows(&L->qkv, xp, xq, R, qkv, DT_F32, QKV, row_invariant);
        PHASE_END(PH_QKV);
        #pragma omp for schedule(static)
        for (int64_t r = 0; r < R; r++) {
            float *q = qkv + r * QKV, *k = q + Hq * D, *v = k + Hkv * D;
            const int64_t at = (r * ropes + L->rope) * D;  /* this layer's table, row r */
            const float *c = cos_ + at, *sn = sin_ + at;
            uint8_t *kc = (uint8_t *)L->k_cache + slot[r] * row_stride;
            uint8_t *vc = (uint8_t *)L->v_cache + slot[r] * row_stride;
            for (int64_t i = 0; i < Hq; i++) {
                if (L->q_norm) rmsnorm(q + i * D, L->q_norm, D, eps, q + i * D);
                rope(q + i * D, c, sn, D);
            }
            for (int64_t i = 0; i < Hkv; i++) {
                if (L->k_norm) rmsnorm(k + i * D, L->k_norm, D, eps, k + i * D);
                rope(k + i * D, c, sn, D);
                kv_put(kc + (i * S + pos[r]) * E, k + i * D, D, kv);
                kv_put(vc + (i * S + pos[r]) * E, v + i * D, D, kv);
            }
        }
        PHASE_END(PH_ROPE_KV);
        if (Rl == 0) break;  /* the last layer's keys and values were all that was wanted */
        #pragma omp for schedule(dynamic, 1)
        for (int64_t u = 0; u < n_units; u++) {
            const attend_unit U = lunits[u];
            if (U.r < r0) continue;  /* a row whose output is not wanted */
            const int64_t off = slot[U.r] * row_stride + ((U.i0 / group) * S + U.j0) * E;
            /* the unit's heads (a row's whole group, a chunk of it, or one head); a chunk's
               partials lie nch_max apart a head */
            const int partial = U.part >= 0;
            attend_heads(kv, qkv + U.r * QKV + U.i0 * D, U.nh, (const uint8_t *)L->k_cache + off,
                         (const uint8_t *)L->v_cache + off, U.j1 - U.j0, D, scale, cap,
                         scores + omp_get_thread_num() * S * SCORE_ROWS,
                         partial ? parts + U.part * (D + 2) : att + (U.r * Hq + U.i0) * D,
                         partial ? nch_max * (D + 2) : D, partial);
        }
        if (splits[sl]) {
            #pragma omp for schedule(static)
            for (int64_t ri = r0 * Hq; ri < R * Hq; ri++) {
                const int64_t p = pos[ri / Hq], nch = chunks_of(p + 1 - first_key(d, p, sl), S);
                if (nch >= 2) attend_merge(parts + ri * nch_max * (D + 2), nch, D, att + ri * D);
            }
        }
        PHASE_END(PH_ATTENTION);
        permute_x(att + r0 * Hq * D, DT_F32, &L->o, Rl, Hq * D, xp, xo, row_invariant);
        PHASE_END(PH_PERMUTE);
        gemv_rows(&L->o, xp, xo, Rl, t, DT_F32, H, row_invariant);
        PHASE_END(PH_O);
        /* the norm rounded straight to the gate_up's int8 codes (a mixture of experts' router
           reads the normed rows) */
        const int mlp_i8 = !L->router && norm_to_i8(&L->gate_up, xg, Rl, H, row_invariant);
        #pragma omp for schedule(static)
        for (int64_t r = 0; r < Rl; r++) {
            if (L->attn_out_norm) rmsnorm(t + r * H, L->attn_out_norm, H, eps, t + r * H);
            for (int64_t i = r * H; i < (r + 1) * H; i++) xl[i] += t[i];
            norm_row(xl + r * H, L->post_norm, H, eps, mlp_i8, &L->gate_up, Rl, r, xp,
                     h + r * H);
        }
        PHASE_END(PH_NORM);
        if (L->router) {  /* a mixture of experts, then on to the next layer */
            /* the router's softmax probabilities, each row's top_k and their weights */
            #pragma omp for schedule(static)
            for (int64_t re = 0; re < Rl * NE; re++)
                probs[re] = dot(h + (re / NE) * H, L->router + (re % NE) * H, H);
            #pragma omp for schedule(static)
            for (int64_t r = 0; r < Rl; r++) {
                float *p = probs + r * NE, mx = -INFINITY, sum = 0.0f, kept = 0.0f;
                for (int64_t e = 0; e < NE; e++) mx = fmaxf(mx, p[e]);
                for (int64_t e = 0; e < NE; e++) sum += (p[e] = expf(p[e] - mx));
                for (int64_t e = 0; e < NE; e++) p[e] /= sum;
                for (int64_t k = 0; k < TK; k++) {  /* the largest left, the lowest index first */
                    int64_t best = -1;
                    for (int64_t e = 0; e < NE; e++) {
                        int taken = 0;
                        for (int64_t j = 0; j < k; j++) taken |= sel[r * TK + j] == e;
                        if (!taken && (best < 0 || p[e] > p[best])) best = e;
                    }
                    sel[r * TK + k] = best;
                    kept += (wt[r * TK + k] = p[best]);
                }
                for (int64_t k = 0; d->renormalize && k < TK; k++) wt[r * TK + k] /= kept;
            }
            #pragma omp single
            {  /* each expert's rows, in row order */
                for (int64_t e = 0; e < NE; e++) count[e] = 0;
                for (int64_t r = 0; r < Rl; r++)
                    for (int64_t k = 0; k < TK; k++) {
                        const int64_t e = sel[r * TK + k], c = count[e]++;
                        rows_of[e * Rl + c] = r;
                        w_of[e * Rl + c] = wt[r * TK + k];
                    }
            }
            #pragma omp for schedule(static)
            for (int64_t i = 0; i < Rl * H; i++) acc[i] = 0.0f;
            PHASE_END(PH_ROUTE);
#if defined(__AVX512VNNI__)
            /* one row, int8 activations for the experts' gate/up and down (the per-expert loop
               takes expert 0's for every expert too), at most 64 experts a token */
            if (Rl == 1 && TK <= 64 && xg == DT_I8 && xd == DT_I8) {
                moe_one_row(L, d, h, xl, acc, xp, sel, wt, moe_row, (int)d->act, timed, &mark);
                continue;
            }
#endif
            /* each chosen expert on its rows: acc[r] += w * down(act(gate(h_r)) * up(h_r)), in
               expert order, then x += acc (the PyTorch block's order of additions) */
            for (int64_t e = 0; e < NE; e++) {
                const int64_t n = count[e];
                if (n == 0) continue;
                const qk_w4_layer *G = L->experts + 3 * e;
                #pragma omp for schedule(static)
                for (int64_t i = 0; i < n; i++)
                    memcpy(xe + i * H, h + rows_of[e * Rl + i] * H, (size_t)H * sizeof(float));
                PHASE_END(PH_ROUTE);
                permute_x(xe, DT_F32, G, n, H, xp, xg, row_invariant);
                PHASE_END(PH_PERMUTE);
                gemv_rows(G, xp, xg, n, gu, DT_F32, 2 * EI, row_invariant);
                gemv_rows(G + 1, xp, xg, n, gu + EI, DT_F32, 2 * EI, row_invariant);
                PHASE_END(PH_GATE_UP);
                glu_rows(gu, n, EI, (int)d->act);
                PHASE_END(PH_SILU);
                permute_x(gu, DT_F32, G + 2, n, 2 * EI, xp, xd, row_invariant);
                PHASE_END(PH_PERMUTE);
                gemv_rows(G + 2, xp, xd, n, t, DT_F32, H, row_invariant);
                PHASE_END(PH_DOWN);
                #pragma omp for schedule(static)
                for (int64_t i = 0; i < n; i++) {  /* an expert's rows are distinct rows */
                    const float w = w_of[e * Rl + i];
                    add_scaled(acc + rows_of[e * Rl + i] * H, t + i * H, w, H);
                }
                PHASE_END(PH_NORM);
            }
            #pragma omp for schedule(static)
            for (int64_t i = 0; i < Rl * H; i++) xl[i] += acc[i];
            PHASE_END(PH_NORM);
            continue;
        }
        if (!mlp_i8) permute_x(h, DT_F32, &L->gate_up, Rl, H, xp, xg, row_invariant);
        PHASE_END(PH_PERMUTE);
        int fused = 0;
#if defined(__AVX512VNNI__)
        /* 2: the down's int8 activations are in gu already (`gate_up_glu`) */
        if (!row_invariant)
            fused = gate_up_glu(&L->gate_up, xp, xg, Rl, gu, 2 * I, d->act, &L->down, xd, gu);
#endif
        if (!fused) {
            gemv_rows(&L->gate_up, xp, xg, Rl, gu, DT_F32, 2 * I, row_invariant);
            PHASE_END(PH_GATE_UP);
            glu_rows(gu, Rl, I, (int)d->act);
        } else {
            PHASE_END(PH_GATE_UP);
        }
        PHASE_END(PH_SILU);
        float *xdn = fused == 2 ? gu : xp;
        if (fused != 2) permute_x(gu, DT_F32, &L->down, Rl, 2 * I, xp, xd, row_invariant);
        PHASE_END(PH_PERMUTE);
        gemv_rows(&L->down, xdn, xd, Rl, t, DT_F32, H, row_invariant);
        PHASE_END(PH_DOWN);
        if (L->ffn_out_norm) {
            #pragma omp for schedule(static)
            for (int64_t r = 0; r < Rl; r++) {
                rmsnorm(t + r * H, L->ffn_out_norm, H, eps, t + r * H);
                for (int64_t i = r * H; i < (r + 1) * H; i++) xl[i] += t[i];
            }
        } else {
            #pragma omp for schedule(static)
            for (int64_t i = 0; i < Rl * H; i++) xl[i] += t[i];
        }
        PHASE_END(PH_NORM);
    }
    }
    return 0;
}
