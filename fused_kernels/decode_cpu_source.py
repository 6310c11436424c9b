"""C source of the CPU decode step: every decoder layer of an INT4 Llama-family model for one
token of one sequence, in one call and one OpenMP parallel region.

Why. At SmolLM2-135M sizes a decode step moves ~57 MB of INT4 weights, ~2 ms at this machine's
bandwidth, but ran 14 ms as PyTorch ops and 120 kernel calls: each op and each call pays Python,
dispatch and thread wake-up costs, and there are ~40 of them a layer. Here the whole body is one
ctypes call; the two threads stay in one parallel region and meet at barriers (~1 us) between
phases. The GEMVs are `gemv_rows` of `w4a16_cpu_source` (appended to that source, so they share
its kernels); the rest (RMSNorm, RoPE, the KV write, attention over the cache, SiLU) is plain C
on a few KB of activations.

Layer, with x the residual stream [H] (fp32, updated in place):
  h = rmsnorm(x) ; qkv = W_qkv h ; rope(q), rope(k) ; cache[pos] = k, v
  a = softmax(q k^T / sqrt(D)) v over slots 0..pos (GQA: q head h reads kv head h / (Hq/Hkv))
  x += W_o a ; h = rmsnorm(x) ; g, u = W_gate_up h ; x += W_down (silu(g) * u)
RoPE takes the cos/sin rows torch computed for this position (the HF rotate-half layout), so
the rotation is exactly the PyTorch path's. Return value: 0, 1 = unsupported group layout,
2 = the work buffer is too small.
"""

from __future__ import annotations

DECODE_SOURCE = r"""
#include <math.h>

typedef struct {
    qk_w4_layer qkv, o, gate_up, down;
    const float *in_norm, *post_norm;  /* [H] */
    float *k_cache, *v_cache;          /* this layer's cache, row 0: [Hkv][slots][D] */
} qk_decoder_layer;

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, inter, slots;
    double eps;
} qk_decoder_dims;

static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* Floats of work buffer `qk_decode_step` needs for these layers. */
int64_t qk_decode_work(const qk_decoder_layer *layers, int64_t n_layers,
                       const qk_decoder_dims *d) {
    int64_t gemv = 0;
    for (int64_t l = 0; l < n_layers; l++) {
        const qk_decoder_layer *L = layers + l;
        gemv = max64(gemv, gemv_scratch(&L->qkv, 1));
        gemv = max64(gemv, gemv_scratch(&L->o, 1));
        gemv = max64(gemv, gemv_scratch(&L->gate_up, 1));
        gemv = max64(gemv, gemv_scratch(&L->down, 1));
    }
    int64_t qkv = (d->heads + 2 * d->kv_heads) * d->head_dim;
    return gemv + d->hidden * 2 + qkv + d->heads * d->head_dim + d->heads * d->slots
           + 2 * d->inter + 64;
}

static void rmsnorm(const float *x, const float *w, int64_t n, float eps, float *out) {
    float ss = 0.0f;
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    float r = 1.0f / sqrtf(ss / (float)n + eps);
    for (int64_t i = 0; i < n; i++) out[i] = x[i] * r * w[i];
}

static void rope(float *v, const float *cos_, const float *sin_, int64_t D) {
    int64_t h = D / 2;
    for (int64_t i = 0; i < h; i++) {
        float a = v[i], b = v[i + h];
        v[i] = a * cos_[i] - b * sin_[i];
        v[i + h] = b * cos_[i + h] + a * sin_[i + h];
    }
}

int qk_decode_step(const qk_decoder_layer *layers, int64_t n_layers, const qk_decoder_dims *d,
                   float *x, int64_t pos, const float *cos_, const float *sin_, float *work,
                   int64_t work_floats, int n_threads) {
    const int64_t H = d->hidden, Hq = d->heads, Hkv = d->kv_heads, D = d->head_dim;
    const int64_t I = d->inter, S = d->slots, group = Hq / Hkv;
    const float eps = (float)d->eps, scale = 1.0f / sqrtf((float)D);
    if (work_floats < qk_decode_work(layers, n_layers, d) || pos >= S) return 2;
    for (int64_t l = 0; l < n_layers; l++) {
        int64_t bpg;
        int gsh;
        const qk_decoder_layer *L = layers + l;
        if (group_layout(&L->qkv, &bpg, &gsh) || group_layout(&L->o, &bpg, &gsh) ||
            group_layout(&L->gate_up, &bpg, &gsh) || group_layout(&L->down, &bpg, &gsh))
            return 1;
    }
    int64_t gemv = 0;
    for (int64_t l = 0; l < n_layers; l++) {
        gemv = max64(gemv, gemv_scratch(&layers[l].qkv, 1));
        gemv = max64(gemv, gemv_scratch(&layers[l].o, 1));
        gemv = max64(gemv, gemv_scratch(&layers[l].gate_up, 1));
        gemv = max64(gemv, gemv_scratch(&layers[l].down, 1));
    }
    /* work: xp + params (the GEMV scratch; xp first) | h [H] | t [H] | qkv | att | scores | gu */
    float *xp = work, *h = work + gemv, *t = h + H, *qkv = t + H;
    float *att = qkv + (Hq + 2 * Hkv) * D, *scores = att + Hq * D, *gu = scores + Hq * S;
    const int64_t npos = pos + 1;

    #pragma omp parallel num_threads(n_threads)
    for (int64_t l = 0; l < n_layers; l++) {
        const qk_decoder_layer *L = layers + l;
        float *params;
        #pragma omp single
        {
            rmsnorm(x, L->in_norm, H, eps, h);
            permute_x(h, DT_F32, 1, H, H, xp);
        }
        params = xp + ((L->qkv.K + 31) / 32) * 32;
        gemv_rows(&L->qkv, xp, 1, params, qkv, DT_F32, L->qkv.N);
        #pragma omp single
        {
            float *q = qkv, *k = qkv + Hq * D, *v = k + Hkv * D;
            for (int64_t i = 0; i < Hq; i++) rope(q + i * D, cos_, sin_, D);
            for (int64_t i = 0; i < Hkv; i++) {
                rope(k + i * D, cos_, sin_, D);
                memcpy(L->k_cache + (i * S + pos) * D, k + i * D, (size_t)D * sizeof(float));
                memcpy(L->v_cache + (i * S + pos) * D, v + i * D, (size_t)D * sizeof(float));
            }
        }
        #pragma omp for schedule(static)
        for (int64_t i = 0; i < Hq; i++) {
            const float *q = qkv + i * D;
            const float *kc = L->k_cache + (i / group) * S * D;
            const float *vc = L->v_cache + (i / group) * S * D;
            float *sc = scores + i * S, *o = att + i * D, mx = -INFINITY, sum = 0.0f;
            for (int64_t j = 0; j < npos; j++) {
                float dot = 0.0f;
                for (int64_t e = 0; e < D; e++) dot += q[e] * kc[j * D + e];
                sc[j] = dot * scale;
                mx = sc[j] > mx ? sc[j] : mx;
            }
            for (int64_t j = 0; j < npos; j++) { sc[j] = expf(sc[j] - mx); sum += sc[j]; }
            for (int64_t e = 0; e < D; e++) o[e] = 0.0f;
            for (int64_t j = 0; j < npos; j++) {
                float p = sc[j] / sum;
                for (int64_t e = 0; e < D; e++) o[e] += p * vc[j * D + e];
            }
        }
        #pragma omp single
        permute_x(att, DT_F32, 1, Hq * D, Hq * D, xp);
        params = xp + ((L->o.K + 31) / 32) * 32;
        gemv_rows(&L->o, xp, 1, params, t, DT_F32, H);
        #pragma omp single
        {
            for (int64_t i = 0; i < H; i++) x[i] += t[i];
            rmsnorm(x, L->post_norm, H, eps, h);
            permute_x(h, DT_F32, 1, H, H, xp);
        }
        params = xp + ((L->gate_up.K + 31) / 32) * 32;
        gemv_rows(&L->gate_up, xp, 1, params, gu, DT_F32, 2 * I);
        #pragma omp single
        {
            for (int64_t i = 0; i < I; i++) {
                float g = gu[i];
                gu[i] = g / (1.0f + expf(-g)) * gu[I + i];
            }
            permute_x(gu, DT_F32, 1, I, I, xp);
        }
        params = xp + ((L->down.K + 31) / 32) * 32;
        gemv_rows(&L->down, xp, 1, params, t, DT_F32, H);
        #pragma omp single
        for (int64_t i = 0; i < H; i++) x[i] += t[i];
    }
    return 0;
}
"""
