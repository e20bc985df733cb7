/* A decoder layer's few-row forward in two calls, around its attention: for the rows of a
 * CPU decoding step (1 to a few), the operators between the products cost more in
 * dispatch than in arithmetic (~50 torch operators a layer, ~20 ms of a ~33 ms step at one
 * row on a two-core EPYC), so each side of the attention runs here, products included:
 *
 *   ts_attn_in:      s = x + d;  n = rms_norm(s) w;  y = n Wqkv^T (+ b);
 *                    q, k per head: (Qwen3) rms_norm(.) w_qk, then rotary embedding;
 *   ts_attn_out_mlp: s = x + a Wo^T;  n = rms_norm(s) w;  g|u = n Wgu^T;
 *                    m = (silu(g) u) Wdown^T.
 *
 * The products are gemv.c's (float32 or bfloat16 weights, `half`); everything else is
 * single-threaded (a few thousand floats). The maths is the fused torch forward's
 * (treespark.kernels.layer_ops), in its order: RMSNorm is (x r) w with r = 1 / sqrt(mean(x^2)
 * + eps) as transformers computes it (the mean summed here in double, then rounded); the
 * rotary embedding is x cos + roll(x, D/2) (sin with its first half negated), each product
 * rounded (ISO C: no contraction into FMAs), so it is torch's to the bit; silu is
 * x / (1 + exp(-x)). Values are the torch forward's to float rounding.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

int ts_gemv(const float *x, const float *w, const float *b, float *y, long M, long N, long K, int threads);
int ts_gemv_bf16(const float *x, const uint16_t *w, const float *b, float *y, long M, long N, long K, int threads);

static int product(const float *x, const void *w, const float *b, int half, float *y, long M, long N, long K,
                   int threads) {
    return half ? ts_gemv_bf16(x, (const uint16_t *)w, b, y, M, N, K, threads)
                : ts_gemv(x, (const float *)w, b, y, M, N, K, threads);
}

/* y[j] = (x[j] r) w[j] over one row of D, r = 1 / sqrt(mean(x^2) + eps) */
static void rms_row(const float *x, const float *w, float eps, float *y, long D) {
    double ss = 0.0;
    for (long j = 0; j < D; ++j) ss += (double)x[j] * x[j];
    const float r = 1.0f / sqrtf((float)(ss / D) + eps);
    for (long j = 0; j < D; ++j) y[j] = (x[j] * r) * w[j];
}

/* one head of D in place: x cos + roll(x, D/2) ssin (ssin: sin, its first half negated) */
static void rope_head(float *x, const float *cos, const float *ssin, long D) {
    float t[512];
    const long h = D / 2;
    for (long j = 0; j < D; ++j) t[j] = x[j];
    for (long j = 0; j < D; ++j) {
        const float c = t[j] * cos[j], s = t[(j + h) % D] * ssin[j];
        x[j] = c + s;
    }
}

/* x, d, x_out, normed: [M, D]; w: [(Hq + 2 Hkv) hd, D] (+ b); qk_w: [Hq + Hkv, hd] or NULL;
 * cos, ssin: [M, hd]; qkv: [M, (Hq + 2 Hkv) hd] out, q and k normed and rotated. d NULL:
 * no residual (x_out untouched, the norm of x). Returns 0, or -1 for shapes it does not take. */
int ts_attn_in(const float *x, const float *d, const float *norm_w, float eps, const void *w, const float *b,
               int half, const float *qk_w, float qk_eps, const float *cos, const float *ssin, float *x_out,
               float *normed, float *qkv, long M, long D, long Hq, long Hkv, long hd, int threads) {
    if (M < 1 || D < 1 || hd < 2 || hd % 2 || hd > 512 || Hq < 1 || Hkv < 1) return -1;
    const long N = (Hq + 2 * Hkv) * hd;
    for (long m = 0; m < M; ++m) {
        const float *s = x + m * D;
        if (d) {
            float *o = x_out + m * D;
            for (long j = 0; j < D; ++j) o[j] = s[j] + d[m * D + j];
            s = o;
        }
        rms_row(s, norm_w, eps, normed + m * D, D);
    }
    if (product(normed, w, b, half, qkv, M, N, D, threads)) return -1;
    for (long m = 0; m < M; ++m)
        for (long h = 0; h < Hq + Hkv; ++h) {
            float *head = qkv + m * N + h * hd;
            if (qk_w) rms_row(head, qk_w + h * hd, qk_eps, head, hd);
            rope_head(head, cos + m * hd, ssin + m * hd, hd);
        }
    return 0;
}

/* a: [M, A] the attention's output; wo: [D, A]; x, x_out, normed: [M, D]; wgu: [2 I, D]
 * (gate rows, then up); wdown: [D, I]; gu: [M, 2 I] and act: [M, I] scratch; mlp: [M, D]
 * out. Biases may be NULL. Returns 0, or -1 for shapes it does not take. */
int ts_attn_out_mlp(const float *a, const void *wo, const float *bo, const float *x, const float *norm_w, float eps,
                    const void *wgu, const float *bgu, const void *wdown, const float *bdown, int half, float *x_out,
                    float *normed, float *gu, float *act, float *mlp, long M, long D, long A, long I, int threads) {
    if (M < 1 || D < 1 || A < 1 || I < 1) return -1;
    if (product(a, wo, bo, half, x_out, M, D, A, threads)) return -1;
    for (long m = 0; m < M; ++m) {
        float *s = x_out + m * D;
        for (long j = 0; j < D; ++j) s[j] = s[j] + x[m * D + j];
        rms_row(s, norm_w, eps, normed + m * D, D);
    }
    if (product(normed, wgu, bgu, half, gu, M, 2 * I, D, threads)) return -1;
    for (long m = 0; m < M; ++m)
        for (long j = 0; j < I; ++j) {
            const float g = gu[m * 2 * I + j];
            act[m * I + j] = (g / (1.0f + expf(-g))) * gu[m * 2 * I + I + j];
        }
    return product(act, wdown, bdown, half, mlp, M, D, I, threads);
}
