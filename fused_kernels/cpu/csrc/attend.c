/* attend.c: the decode step's KV cache formats and its attention over them (decode.c includes
   this file after `dot`, `exp16` and `tail_mask`).

   Cache formats (`kv_dt`, the `quantkit.models.kv_cache` formats): one head's K (or V) for one
   position is E bytes (`kv_bytes`):
     KV_F32   D fp32 values;
     KV_BF16  D bf16 values (rounded to nearest even, as torch's .to(torch.bfloat16));
     KV_I8    D int8 codes, then the fp32 scale amax / 127: value = code * scale;
     KV_FP8   D e4m3 codes, then the fp32 scale amax / 448: value = e4m3(code) * scale.
   The scaled formats quantize each head of each token on its own (`kv_put`), with the same
   operations in the same order as the PyTorch path (`KVFormat.pack`): amax, scale = amax / qmax,
   code = round(x / max(scale, FLT_MIN)) to nearest even, clamped. So both paths write the same
   bytes for the same K/V. Reading, a key's scale multiplies its score (q . codes) and a value's
   scale multiplies its softmax weight: one multiply per position, not per element. */

enum { KV_F32 = 0, KV_BF16 = 1, KV_I8 = 2, KV_FP8 = 3 };

static inline int64_t kv_bytes(int kv, int64_t D) {
    return kv == KV_F32 ? 4 * D : kv == KV_BF16 ? 2 * D : D + 4;
}

/* One head's K or V for one position, D fp32 values x, stored at dst in format kv. */
static void kv_put(uint8_t *dst, const float *x, int64_t D, int kv) {
    if (kv == KV_F32) {
        memcpy(dst, x, (size_t)D * sizeof(float));
        return;
    }
    if (kv == KV_BF16) {
        for (int64_t e = 0; e < D; e++) store_f(dst, e, DT_BF16, x[e]);
        return;
    }
    float amax = 0.0f;
    for (int64_t e = 0; e < D; e++) amax = fmaxf(amax, fabsf(x[e]));
    const float qmax = kv == KV_I8 ? 127.0f : 448.0f, scale = amax / qmax;
    const float div = scale > FLT_MIN ? scale : FLT_MIN;
    for (int64_t e = 0; e < D; e++) {
        float q = x[e] / div;
        if (kv == KV_I8) {
            q = __builtin_rintf(q);
            ((int8_t *)dst)[e] = (int8_t)(q < -127.0f ? -127.0f : q > 127.0f ? 127.0f : q);
        } else {
            dst[e] = float_to_fp8(q < -448.0f ? -448.0f : q > 448.0f ? 448.0f : q);
        }
    }
    memcpy(dst + D, &scale, sizeof(float));
}

/* Element e of a stored head (its scale not applied), exactly. */
static inline float kv_get(int kv, const uint8_t *r, int64_t e) {
    if (kv == KV_F32) return ((const float *)r)[e];
    if (kv == KV_BF16) return load_f(r, e, DT_BF16);
    if (kv == KV_I8) return (float)((const int8_t *)r)[e];
    return fp8_to_float(r[e]);
}

/* A stored head's scale (1 for the unscaled formats). */
static inline float kv_scale(int kv, const uint8_t *r, int64_t D) {
    float s = 1.0f;
    if (kv >= KV_I8) memcpy(&s, r + D, sizeof(float));
    return s;
}

/* q . (a stored head, scale not applied), 16 partial sums as `dot`; fp32 is `dot` itself. */
static inline float kv_dot(int kv, const float *q, const uint8_t *r, int64_t D) {
    if (kv == KV_F32) return dot(q, (const float *)r, D);
    float acc[16] = {0};
    for (int64_t e = 0; e < D; e++) acc[e % 16] += q[e] * kv_get(kv, r, e);
    for (int w = 8; w; w >>= 1)
        for (int l = 0; l < w; l++) acc[l] += acc[l + w];
    return acc[0];
}

#if defined(__AVX512F__)
/* Elements 16c..16c+15 of a stored head as fp32, scale not applied. fp8 codes come out as
   e4m3 / 2^8 (the exact fp16 reading of fp8.c's `cvt_codes2`), so `kv_scale16` folds 2^8 in. */
static inline __attribute__((always_inline)) __m512 kv_load16(const int kv, const uint8_t *r,
                                                              int c) {
    if (kv == KV_BF16) {
        __m256i h = _mm256_loadu_si256((const __m256i *)(r + 32 * c));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    if (kv == KV_I8)
        return _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(r + 16 * c))));
    if (kv == KV_FP8) {
        __m256i h = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(r + 16 * c)));
        h = _mm256_and_si256(_mm256_slli_epi16(h, 7), _mm256_set1_epi16((short)0xBF80));
        return _mm512_cvtph_ps(h);
    }
    return _mm512_loadu_ps((const float *)r + 16 * c);
}

static inline float kv_scale16(const int kv, const uint8_t *r, int64_t D) {
    return kv == KV_FP8 ? kv_scale(kv, r, D) * 256.0f : kv_scale(kv, r, D);
}
#endif

#if defined(__AVX512F__)
/* GH query heads that share their keys and values (a GQA group's, or part of it) at once, each
   as `attend_nv` does one (its AVX-512 loop is this with GH = 1): the scores 8 keys at a time
   reduced together (hsum8_store), each 8-key block of K read once for all GH heads (a head at
   a time over all keys read every key's row GH times from L2), each head's softmax (with cap
   > 0 each scaled logit becomes cap * tanh(logit / cap) first), then one pass over the values
   for all GH heads, each value vector loaded once and the GH heads' o kept in registers: a
   lone head's values loop is one FMA chain per vector of o, GH heads give GH chains. Each
   head's operations and their order do not depend on GH, so o is the same bits at any GH.
   q: GH heads D apart; sc: GH * npos floats of scratch; o: GH heads' outputs os apart, each
   followed, when `partial`, by its {max, sum} and left unnormalised. D = 16 NV16, NV16 <= 16. */
static inline __attribute__((always_inline)) void attend_nv_heads(
    const int NV16, const int KV, const int GH, const float *q, const uint8_t *kc,
    const uint8_t *vc, int64_t npos, int64_t D, float scale, float cap, float *sc, float *o,
    int64_t os, int partial) {
    const int64_t E = kv_bytes(KV, D);
    float total[4], top[4];
    /* the scores, 8 keys at a time for every head: the block's keys come from memory once
       and from L1 for the other heads (a head at a time over all keys read each key's row
       GH times from L2) */
    __m512 qv[4][16];
    for (int h = 0; h < GH; h++)
        for (int c = 0; c < NV16; c++) qv[h][c] = _mm512_loadu_ps(q + h * D + 16 * c);
    int64_t j = 0;
    for (; j + 8 <= npos; j += 8)
        for (int h = 0; h < GH; h++) {
            __m512 a[8];
            for (int k = 0; k < 8; k++) {
                const uint8_t *kr = kc + (j + k) * E;
                a[k] = _mm512_mul_ps(qv[h][0], kv_load16(KV, kr, 0));
                for (int c = 1; c < NV16; c++)
                    a[k] = _mm512_fmadd_ps(qv[h][c], kv_load16(KV, kr, c), a[k]);
                if (KV >= KV_I8) a[k] = _mm512_mul_ps(a[k], _mm512_set1_ps(kv_scale16(KV, kr, D)));
            }
            hsum8_store(a, sc + h * npos + j);
        }
    for (int h = 0; h < GH; h++) {
        const float *qh = q + h * D;
        float *sh = sc + h * npos;
        for (int64_t i = j; i < npos; i++)
            sh[i] = kv_dot(KV, qh, kc + i * E, D) * kv_scale(KV, kc + i * E, D);
        __m512 sv = _mm512_set1_ps(scale);
        if (cap > 0.0f) {  /* soft-capped: the scores become the final logits */
            for (int64_t i = 0; i < npos; i++) sh[i] = tanhf(sh[i] * scale / cap) * cap;
            sv = _mm512_set1_ps(1.0f);
        }
        __m512 mv = _mm512_set1_ps(-INFINITY), tot = _mm512_setzero_ps();
        for (int64_t i = 0; i < npos; i += 16) {
            __mmask16 k = tail_mask(npos - i);
            __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, sh + i), sv);
            mv = _mm512_mask_max_ps(mv, k, mv, v);
        }
        const __m512 mx16 = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
        for (int64_t i = 0; i < npos; i += 16) {
            __mmask16 k = tail_mask(npos - i);
            __m512 v = _mm512_fmsub_ps(_mm512_maskz_loadu_ps(k, sh + i), sv, mx16);
            __m512 e = _mm512_maskz_mov_ps(k, exp16(v));
            _mm512_mask_storeu_ps(sh + i, k, e);
            tot = _mm512_add_ps(tot, e);
        }
        total[h] = _mm512_reduce_add_ps(tot);
        top[h] = _mm512_reduce_max_ps(mv);
    }
    __m512 acc[4][16];
    for (int h = 0; h < GH; h++)
        for (int c = 0; c < NV16; c++) acc[h][c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < npos; j++) {
        const uint8_t *vr = vc + j * E;
        __m512 v[16];
        for (int c = 0; c < NV16; c++) v[c] = kv_load16(KV, vr, c);
        for (int h = 0; h < GH; h++) {
            const float sj = sc[h * npos + j];
            const __m512 p = _mm512_set1_ps(KV >= KV_I8 ? sj * kv_scale16(KV, vr, D) : sj);
            for (int c = 0; c < NV16; c++) acc[h][c] = _mm512_fmadd_ps(p, v[c], acc[h][c]);
        }
    }
    for (int h = 0; h < GH; h++) {
        float *oh = o + h * os;
        if (partial) {  /* as attend_nv's ml: the max, the sum, o unnormalised */
            oh[D] = top[h];
            oh[D + 1] = total[h];
            for (int c = 0; c < NV16; c++) _mm512_storeu_ps(oh + 16 * c, acc[h][c]);
            continue;
        }
        const __m512 inv = _mm512_set1_ps(1.0f / total[h]);
        for (int c = 0; c < NV16; c++) _mm512_storeu_ps(oh + 16 * c, _mm512_mul_ps(acc[h][c], inv));
    }
}

#endif

/* One query head over its cache row: o = softmax(q k^T * scale) v over keys 0..npos-1 (with
   cap > 0 each scaled logit becomes cap * tanh(logit / cap) first: Gemma 2's soft-cap), the
   keys and values in format KV, E bytes apart; sc [npos] is scratch. The portable loop below
   does one dot product per key (16 partial sums reduced per key) and accumulates o through
   memory. With AVX-512 and D a multiple of 16 (up to 256): `attend_nv_heads` for one head.
   ml: {max, sum} at o + D (callers put it there), o unnormalised. SmolLM2 batch-8 step, A/B in
   one run: 10.90 -> 10.58 ms p50 (what remains is mostly reading the fp32 cache: ~26 MB a step
   at context ~70). */
static inline __attribute__((always_inline)) void attend_nv(
    const int NV16, const int KV, const float *q, const uint8_t *kc, const uint8_t *vc,
    int64_t npos, int64_t D, float scale, float cap, float *sc, float *o, float *ml) {
    const int64_t E = kv_bytes(KV, D);
    float mx = -INFINITY, sum = 0.0f;
#if defined(__AVX512F__)
    if (NV16 > 0) {
        attend_nv_heads(NV16, KV, 1, q, kc, vc, npos, D, scale, cap, sc, o, D, ml != NULL);
        return;
    }
#endif
    for (int64_t j = 0; j < npos; j++) {
        const uint8_t *kr = kc + j * E;
        sc[j] = KV >= KV_I8 ? kv_dot(KV, q, kr, D) * kv_scale(KV, kr, D) * scale
                            : kv_dot(KV, q, kr, D) * scale;
        if (cap > 0.0f) sc[j] = tanhf(sc[j] / cap) * cap;
        mx = sc[j] > mx ? sc[j] : mx;
    }
    for (int64_t j = 0; j < npos; j++) sc[j] = expf(sc[j] - mx);
    for (int64_t j = 0; j < npos; j++) sum += sc[j];
    for (int64_t e = 0; e < D; e++) o[e] = 0.0f;
    const float norm = ml ? 1.0f : sum;  /* a partial stays unnormalised */
    for (int64_t j = 0; j < npos; j++) {
        const uint8_t *vr = vc + j * E;
        float p = KV >= KV_I8 ? sc[j] / norm * kv_scale(KV, vr, D) : sc[j] / norm;
        for (int64_t e = 0; e < D; e++) o[e] += p * kv_get(KV, vr, e);
    }
    if (ml) ml[0] = mx, ml[1] = sum;
}

#if defined(__AVX512F__)
/* The most heads a pass takes at a head size: 4 at D = 64 (16 accumulators; 2 or 3 left go
   together too) and at D = 128 (32 vectors of q and o: gcc keeps some on the stack, and a
   group of 4 still reads its keys and values once instead of twice: the attention of a
   512-token Qwen3-8B-shape prefill 309-329 -> 276-287 ms, 3 alternating runs, the same
   bits); 0: one at a time. */
#define HEADS_AT_ONCE(D) ((D) == 64 ? 4 : (D) == 128 ? 4 : 0)
#define ATTEND_HEADS_FORMAT(KV, NV, GH) \
    attend_nv_heads(NV, KV, GH, q, kc, vc, npos, D, scale, cap, sc, o, os, partial)
#endif

/* nh query heads of one row sharing their keys and values, o their outputs os apart (each
   with its {max, sum} after it when `partial`: a chunk of a split row), sc HEADS_AT_ONCE(D) *
   npos floats (or npos where that is 0): in passes of up to HEADS_AT_ONCE(D) heads
   (`attend_nv_heads`) where AVX-512 and D allow; a head left alone by itself. */
static void attend_heads(int kv, const float *q, int64_t nh, const uint8_t *kc,
                         const uint8_t *vc, int64_t npos, int64_t D, float scale, float cap,
                         float *sc, float *o, int64_t os, int partial);

/* attend_nv with the vector count (NV16 = D / 16, or 0 for the portable loop) and the cache
   format compile-time constants for the common head sizes: with a runtime count gcc kept qv
   and acc in memory, and 64-byte loads are what this loop is short of. SmolLM2 (D = 64), bf16
   activations, A/B in one run: R=8 4.73 -> 4.45 ms, R=1 2.10 -> 2.05 ms; bit-identical. */
#define ATTEND_FORMAT(KV)                                                                   \
    do {                                                                                    \
        if (D == 64) attend_nv(4, KV, q, kc, vc, npos, D, scale, cap, sc, o, ml);                \
        else if (D == 128) attend_nv(8, KV, q, kc, vc, npos, D, scale, cap, sc, o, ml);          \
        else if (D % 16 == 0 && D <= 256)                                                   \
            attend_nv((int)(D / 16), KV, q, kc, vc, npos, D, scale, cap, sc, o, ml);             \
        else attend_nv(0, KV, q, kc, vc, npos, D, scale, cap, sc, o, ml);                        \
    } while (0)

/* ml NULL: o = the attention output. ml set: a partial over these keys only (a chunk of a
   split row, `attend_merge`): ml = {max scaled score, sum of exponentials}, o unnormalised. */
static void attend(int kv, const float *q, const uint8_t *kc, const uint8_t *vc, int64_t npos,
                   int64_t D, float scale, float cap, float *sc, float *o, float *ml) {
    switch (kv) {
    case KV_BF16: ATTEND_FORMAT(KV_BF16); break;
    case KV_I8: ATTEND_FORMAT(KV_I8); break;
    case KV_FP8: ATTEND_FORMAT(KV_FP8); break;
    default: ATTEND_FORMAT(KV_F32); break;
    }
}
#undef ATTEND_FORMAT

/* o = the attention output from n partials (`attend` with ml) over consecutive chunks of one
   row's keys: part[c] holds D unnormalised values then {max, sum}. One partial gives exactly
   what `attend` without ml gives (its weight is expf(0) = 1, then one multiply by 1 / sum). */
static void attend_merge(const float *part, int64_t n, int64_t D, float *o) {
    float mx = -INFINITY, total = 0.0f;
    for (int64_t c = 0; c < n; c++) mx = fmaxf(mx, part[c * (D + 2) + D]);
    for (int64_t e = 0; e < D; e++) o[e] = 0.0f;
    for (int64_t c = 0; c < n; c++) {
        const float *p = part + c * (D + 2), w = expf(p[D] - mx);
        total += p[D + 1] * w;
        for (int64_t e = 0; e < D; e++) o[e] += p[e] * w;
    }
    const float inv = 1.0f / total;
    for (int64_t e = 0; e < D; e++) o[e] *= inv;
}

static void attend_heads(int kv, const float *q, int64_t nh, const uint8_t *kc,
                         const uint8_t *vc, int64_t npos, int64_t D, float scale, float cap,
                         float *sc, float *o, int64_t os, int partial) {
    int64_t i = 0;
#if defined(__AVX512F__)
#define HEADS_ANY_FORMAT(NV, GH)                                     \
    do {                                                             \
        switch (kv) {                                                \
        case KV_BF16: ATTEND_HEADS_FORMAT(KV_BF16, NV, GH); break;   \
        case KV_I8: ATTEND_HEADS_FORMAT(KV_I8, NV, GH); break;       \
        case KV_FP8: ATTEND_HEADS_FORMAT(KV_FP8, NV, GH); break;     \
        default: ATTEND_HEADS_FORMAT(KV_F32, NV, GH); break;         \
        }                                                            \
    } while (0)
    const int most = HEADS_AT_ONCE(D);
    while (most > 0 && nh - i >= 2) {
        /* passes of `most` heads, then (D = 64) the 2 or 3 left together */
        const int gh = nh - i >= most ? most : (int)(nh - i);
        if (D == 64 && gh == 4) HEADS_ANY_FORMAT(4, 4);
        else if (D == 64 && gh == 3) HEADS_ANY_FORMAT(4, 3);
        else if (D == 64) HEADS_ANY_FORMAT(4, 2);
        else if (gh == 4) HEADS_ANY_FORMAT(8, 4);
        else if (gh == 3) HEADS_ANY_FORMAT(8, 3);
        else HEADS_ANY_FORMAT(8, 2);
        i += gh, q += gh * D, o += gh * os;
    }
#undef HEADS_ANY_FORMAT
#endif
    for (; i < nh; i++, q += D, o += os)
        attend(kv, q, kc, vc, npos, D, scale, cap, sc, o, partial ? o + D : NULL);
}
