/* A decoder layer's few-row forward in two calls, around its attention: for the rows of a
 * CPU decoding step (1 to a few), the operators between the products cost more in
 * dispatch than in arithmetic (~50 torch operators a layer, ~20 ms of a ~33 ms step at one
 * row on a two-core EPYC), so each side of the attention runs here, products included:
 *
 *   ts_attn_in:      s = x + d;  n = rms_norm(s) w;  y = n Wqkv^T (+ b);
 *                    q, k per head: (Qwen3) rms_norm(.) w_qk, then rotary embedding;
 *   ts_attn_out_mlp: s = x + a Wo^T;  n = rms_norm(s) w;  g|u = n Wgu^T;
 *                    m = (silu(g) u) Wdown^T.
 * Their non-product parts are also callable alone, for rows whose products run elsewhere (a
 * prefill's hundreds of rows, through oneDNN): ts_add_norm (s = x + d, rms_norm(s) w),
 * ts_qk_rope (the q/k norms and the rotation, in place) and ts_silu_rows (silu(g) u).
 *
 * The products are gemv.c's (float32 weights, or `half`: bfloat16 panels); everything else
 * runs a row at a time, over the threads from 8 rows (ROW_THREADS). The maths is the fused torch forward's
 * (treespark.kernels.layer_ops), in its order: RMSNorm is (x r) w with r = 1 / sqrt(mean(x^2)
 * + eps) as transformers computes it (the mean summed here in double, then rounded); the
 * rotary embedding is x cos + roll(x, D/2) (sin with its first half negated), each product
 * rounded (ISO C: no contraction into FMAs), so it is torch's to the bit; silu is
 * x / (1 + exp(-x)), e^x by exp8 where AVX2 is (~2 float ulps). Values are the torch
 * forward's to float rounding.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int ts_gemv(const float *x, const float *w, const float *b, float *y, long M, long N, long K, int threads);
int ts_gemv_panels(const float *x, const uint16_t *w, const float *b, float *y, long M, long N, long K, int threads);

static int product(const float *x, const void *w, const float *b, int half, float *y, long M, long N, long K,
                   int threads) {
    return half ? ts_gemv_panels(x, (const uint16_t *)w, b, y, M, N, K, threads)
                : ts_gemv(x, (const float *)w, b, y, M, N, K, threads);
}

/* y[j] = (x[j] r) w[j] over one row of D, r = 1 / sqrt(mean(x^2) + eps); the squares summed
 * in double in 8 interleaved partial sums (then added in a fixed order), so the loop
 * vectorises; the double sum rounds to the float the serial one gives but in a tie */
static void rms_row(const float *x, const float *w, float eps, float *y, long D) {
    double part[8] = {0.0};
    long j = 0;
    for (; j + 8 <= D; j += 8)
        for (int l = 0; l < 8; ++l) part[l] += (double)x[j + l] * x[j + l];
    double ss = ((part[0] + part[4]) + (part[1] + part[5])) + ((part[2] + part[6]) + (part[3] + part[7]));
    for (; j < D; ++j) ss += (double)x[j] * x[j];
    const float r = 1.0f / sqrtf((float)(ss / D) + eps);
    for (j = 0; j < D; ++j) y[j] = (x[j] * r) * w[j];
}

/* one head of D in place: x cos + roll(x, D/2) ssin (ssin: sin, its first half negated) */
static void rope_head(float *x, const float *cos, const float *ssin, long D) {
    float t[512];
    const long h = D / 2;
    for (long j = 0; j < D; ++j) t[j] = x[j];
    for (long j = 0; j < h; ++j) x[j] = t[j] * cos[j] + t[j + h] * ssin[j];
    for (long j = h; j < D; ++j) x[j] = t[j] * cos[j] + t[j - h] * ssin[j];
}

static void silu_mul(const float *g, const float *u, float *a, long I);

/* the threads a loop over M rows of a layer's elementwise work takes (each row's floats its
 * own, so the same values on any) */
#define ROW_THREADS(M, threads) ((M) >= 8 ? (threads) : 1)

/* x, d, x_out, normed: [M, D]: s = x + d into x_out, normed = rms_norm(s) norm_w. d NULL: no
 * residual (x_out untouched, the norm of x). Returns 0, or -1 for shapes it does not take. */
int ts_add_norm(const float *x, const float *d, const float *norm_w, float eps, float *x_out, float *normed, long M,
                long D, int threads) {
    if (M < 1 || D < 1) return -1;
    const int nt = ROW_THREADS(M, threads);
#pragma omp parallel for num_threads(nt) schedule(static)
    for (long m = 0; m < M; ++m) {
        const float *s = x + m * D;
        if (d) {
            float *o = x_out + m * D;
            for (long j = 0; j < D; ++j) o[j] = s[j] + d[m * D + j];
            s = o;
        }
        rms_row(s, norm_w, eps, normed + m * D, D);
    }
    return 0;
}

/* qkv: [M, (Hq + 2 Hkv) hd] in place: each row's Hq + Hkv q and k heads normed (qk_w: [Hq +
 * Hkv, hd], or NULL for none) and rotated (cos, ssin: [M, hd]); the values left as they are.
 * Returns 0, or -1 for shapes it does not take. */
int ts_qk_rope(float *qkv, const float *qk_w, float qk_eps, const float *cos, const float *ssin, long M, long Hq,
               long Hkv, long hd, int threads) {
    if (M < 1 || hd < 2 || hd % 2 || hd > 512 || Hq < 0 || Hkv < 1) return -1;
    const long N = (Hq + 2 * Hkv) * hd;
    const int nt = ROW_THREADS(M, threads);
#pragma omp parallel for num_threads(nt) schedule(static)
    for (long m = 0; m < M; ++m)
        for (long h = 0; h < Hq + Hkv; ++h) {
            float *head = qkv + m * N + h * hd;
            if (qk_w) rms_row(head, qk_w + h * hd, qk_eps, head, hd);
            rope_head(head, cos + m * hd, ssin + m * hd, hd);
        }
    return 0;
}

/* gu: [M, 2 I] each row's gate then up; act: [M, I] = silu(gate) up. Returns 0, or -1. */
int ts_silu_rows(const float *gu, float *act, long M, long I, int threads) {
    if (M < 1 || I < 1) return -1;
    const int nt = ROW_THREADS(M, threads);
#pragma omp parallel for num_threads(nt) schedule(static)
    for (long m = 0; m < M; ++m) silu_mul(gu + m * 2 * I, gu + m * 2 * I + I, act + m * I, I);
    return 0;
}

/* x, d, x_out, normed: [M, D]; w: [(Hq + 2 Hkv) hd, D] (+ b); qk_w: [Hq + Hkv, hd] or NULL
 * (Hq may be 0: keys and values alone, as the drafter's context is made);
 * cos, ssin: [M, hd]; qkv: [M, (Hq + 2 Hkv) hd] out, q and k normed and rotated. d NULL:
 * no residual (x_out untouched, the norm of x). Returns 0, or -1 for shapes it does not take. */
int ts_attn_in(const float *x, const float *d, const float *norm_w, float eps, const void *w, const float *b,
               int half, const float *qk_w, float qk_eps, const float *cos, const float *ssin, float *x_out,
               float *normed, float *qkv, long M, long D, long Hq, long Hkv, long hd, int threads) {
    if (M < 1 || D < 1 || hd < 2 || hd % 2 || hd > 512 || Hq < 0 || Hkv < 1) return -1;
    ts_add_norm(x, d, norm_w, eps, x_out, normed, M, D, threads);
    if (product(normed, w, b, half, qkv, M, (Hq + 2 * Hkv) * hd, D, threads)) return -1;
    return ts_qk_rope(qkv, qk_w, qk_eps, cos, ssin, M, Hq, Hkv, hd, threads);
}

/* a: [M, A] the attention's output; wo: [D, A]; x, x_out, normed: [M, D]; wgu: [2 I, D]
 * (gate rows, then up); wdown: [D, I]; gu: [M, 2 I] and act: [M, I] scratch; mlp: [M, D]
 * out. Biases may be NULL. Returns 0, or -1 for shapes it does not take. */
int ts_attn_out_mlp(const float *a, const void *wo, const float *bo, const float *x, const float *norm_w, float eps,
                    const void *wgu, const float *bgu, const void *wdown, const float *bdown, int half, float *x_out,
                    float *normed, float *gu, float *act, float *mlp, long M, long D, long A, long I, int threads) {
    if (M < 1 || D < 1 || A < 1 || I < 1) return -1;
    if (product(a, wo, bo, half, x_out, M, D, A, threads)) return -1;
    ts_add_norm(x_out, x, norm_w, eps, x_out, normed, M, D, threads);
    if (product(normed, wgu, bgu, half, gu, M, 2 * I, D, threads)) return -1;
    ts_silu_rows(gu, act, M, I, threads);
    return product(act, wdown, bdown, half, mlp, M, D, I, threads);
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include "vexp.h"

#define EXP8_ROUND(x) _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define EXP8_POW2(n) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), \
                                                                           _mm256_set1_epi32(127)), 23))
#define EXP8_ZERO_BELOW(x, lo, v) _mm256_andnot_ps(_mm256_cmp_ps(x, lo, _CMP_LT_OQ), v)
/* e^x for 8 floats (vexp.h) */
TS_VEXP(exp8, __m256, _mm256_set1_ps, _mm256_min_ps, _mm256_max_ps, _mm256_mul_ps, _mm256_fmadd_ps, _mm256_fnmadd_ps,
        EXP8_ROUND, EXP8_POW2, EXP8_ZERO_BELOW)

/* s[t] = e^(s[t] - top) over n floats; returns their sum */
static float exp_shift(float *s, long n, float top) {
    __m256 acc = _mm256_setzero_ps();
    const __m256 m = _mm256_set1_ps(top);
    long t = 0;
    for (; t + 8 <= n; t += 8) {
        __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), m));
        _mm256_storeu_ps(s + t, p);
        acc = _mm256_add_ps(acc, p);
    }
    float part[8], sum = 0.0f;
    _mm256_storeu_ps(part, acc);
    for (int j = 0; j < 8; ++j) sum += part[j];
    for (; t < n; ++t) sum += (s[t] = expf(s[t] - top));
    return sum;
}

/* a = silu(g) u = g / (1 + e^-g) u over one row of I, 8 at a time (exp8: the values expf's
 * to ~2 float ulps) */
static void silu_mul(const float *g, const float *u, float *a, long I) {
    const __m256 one = _mm256_set1_ps(1.0f);
    long j = 0;
    for (; j + 8 <= I; j += 8) {
        const __m256 gv = _mm256_loadu_ps(g + j);
        const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
        _mm256_storeu_ps(a + j, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + j)));
    }
    for (; j < I; ++j) a[j] = (g[j] / (1.0f + expf(-g[j]))) * u[j];
}

/* Scores of one query against SV keys at a time: each key's dot product as SV-wide partial
 * sums (one FMA chain over the head dimension, in order), then the SV partial vectors summed
 * into one vector of SV scores by a fixed tree of unpacks, shuffles and adds (the same tree
 * for every lane, so a score's float never depends on the keys or queries beside it), where
 * a dot product a score ends in its own horizontal sum. */
#if defined(__AVX512F__)
#define SV 16
typedef __m512 vsc;
#define V_ZERO() _mm512_setzero_ps()
#define V_LOAD(p) _mm512_loadu_ps(p)
#define V_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define V_UNPACKLO(a, b) _mm512_unpacklo_ps(a, b)
#define V_UNPACKHI(a, b) _mm512_unpackhi_ps(a, b)
#define V_SHUFFLE(a, b, imm) _mm512_shuffle_ps(a, b, imm)
#define V_SET1(x) _mm512_set1_ps(x)
#define V_ADD(a, b) _mm512_add_ps(a, b)
#define V_MUL(a, b) _mm512_mul_ps(a, b)
#define V_STORE(p, v) _mm512_storeu_ps(p, v)
#else
#define SV 8
typedef __m256 vsc;
#define V_ZERO() _mm256_setzero_ps()
#define V_LOAD(p) _mm256_loadu_ps(p)
#define V_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define V_UNPACKLO(a, b) _mm256_unpacklo_ps(a, b)
#define V_UNPACKHI(a, b) _mm256_unpackhi_ps(a, b)
#define V_SHUFFLE(a, b, imm) _mm256_shuffle_ps(a, b, imm)
#define V_SET1(x) _mm256_set1_ps(x)
#define V_ADD(a, b) _mm256_add_ps(a, b)
#define V_MUL(a, b) _mm256_mul_ps(a, b)
#define V_STORE(p, v) _mm256_storeu_ps(p, v)
#endif

/* Four vectors a[0..3] to one: in each 128-bit lane, position i holds the sum of a[i]'s
 * four floats in that lane (the first step of lane_sums, the same in either width). */
static inline vsc quad_sum(const vsc *a) {
    const vsc s0 = V_ADD(V_UNPACKLO(a[0], a[1]), V_UNPACKHI(a[0], a[1]));
    const vsc s1 = V_ADD(V_UNPACKLO(a[2], a[3]), V_UNPACKHI(a[2], a[3]));
    return V_ADD(V_SHUFFLE(s0, s1, 0x44), V_SHUFFLE(s0, s1, 0xEE));
}

#if defined(__AVX512F__)
static inline __m512 lane_sums(const __m512 *a) {
    __m512 q[4];
    for (int i = 0; i < 4; ++i) q[i] = quad_sum(a + 4 * i);
    const __m512 u01 = _mm512_add_ps(_mm512_shuffle_f32x4(q[0], q[1], 0x44), _mm512_shuffle_f32x4(q[0], q[1], 0xEE));
    const __m512 u23 = _mm512_add_ps(_mm512_shuffle_f32x4(q[2], q[3], 0x44), _mm512_shuffle_f32x4(q[2], q[3], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_f32x4(u01, u23, 0x88), _mm512_shuffle_f32x4(u01, u23, 0xDD));
}
#else
static inline __m256 lane_sums(const __m256 *a) {
    const __m256 q0 = quad_sum(a), q1 = quad_sum(a + 4);
    return _mm256_add_ps(_mm256_permute2f128_ps(q0, q1, 0x20), _mm256_permute2f128_ps(q0, q1, 0x31));
}
#endif

/* s[r W + t] = q_r . k_t scale where query r may see key t (t < lim and ms[r][t]), -inf
 * elsewhere, for the n keys of a span (key t at kc + at[t]) and R queries (query r at
 * qs[r]); mx[r] their maxima. hd a multiple of SV. */
static void span_scores(const float *const *qs, const float *kc, const long *at, long n, long R, long hd, long W,
                        const uint8_t *const *ms, long lim, float scale, float *s, float *mx) {
    for (long r = 0; r < R; ++r) mx[r] = -INFINITY;
    for (long t0 = 0; t0 < n; t0 += SV) {
        const float *k[SV];
        for (int j = 0; j < SV; ++j) k[j] = kc + at[t0 + j < n ? t0 + j : t0];   /* past n: any key, unused */
        for (long r = 0; r < R; ++r) {
            const float *qr = qs[r];
            vsc acc[SV];
            for (int j = 0; j < SV; ++j) acc[j] = V_ZERO();
            for (long c = 0; c < hd; c += SV) {
                const vsc qv = V_LOAD(qr + c);
                _Pragma("GCC unroll 16")
                for (int j = 0; j < SV; ++j) acc[j] = V_FMA(qv, V_LOAD(k[j] + c), acc[j]);
            }
            float dot[SV];
            V_STORE(dot, lane_sums(acc));
            const uint8_t *mr = ms[r];
            float m = mx[r];
            for (int j = 0; j < SV && t0 + j < n; ++j) {
                const long t = t0 + j;
                const float v = t < lim && mr[t] ? dot[j] * scale : -INFINITY;
                s[r * W + t] = v;
                if (v > m) m = v;
            }
            mx[r] = m;
        }
    }
}

/* o[r] = sum over the n keys, in order, of p_r[t] v_t (each product rounded, then added:
 * the scalar loop's floats) for R queries, p_r = s + r W (0 where masked), the values at
 * vc + at[t]; up to 4 vectors of the head a pass kept in registers over the keys. hd a
 * multiple of SV; a query whose keys are all masked (mx -inf) gets zeros. */
static void span_values(const float *s, const float *vc, const long *at, long n, long R, long hd, long W,
                        const float *mx, float *o) {
    for (long r = 0; r < R; ++r) {
        const float *pr = s + r * W;
        float *orow = o + r * hd;
        for (long c0 = 0; c0 < hd; c0 += 4 * SV) {
            const int nv = hd - c0 >= 4 * SV ? 4 : (int)((hd - c0) / SV);
            vsc acc[4] = {V_ZERO(), V_ZERO(), V_ZERO(), V_ZERO()};
            if (mx[r] != -INFINITY)
                for (long t = 0; t < n; ++t) {
                    const float p = pr[t];
                    if (p == 0.0f) continue;
                    const vsc pv = V_SET1(p);
                    for (int i = 0; i < nv; ++i) acc[i] = V_ADD(acc[i], V_MUL(pv, V_LOAD(vc + at[t] + c0 + i * SV)));
                }
            for (int i = 0; i < nv; ++i) V_STORE(orow + c0 + i * SV, acc[i]);
        }
    }
}
#else
static float exp_shift(float *s, long n, float top) {
    float sum = 0.0f;
    for (long t = 0; t < n; ++t) sum += (s[t] = expf(s[t] - top));
    return sum;
}

static void silu_mul(const float *g, const float *u, float *a, long I) {
    for (long j = 0; j < I; ++j) a[j] = (g[j] / (1.0f + expf(-g[j]))) * u[j];
}
#endif

/* exp_shift for waves.c */
float ts_exp_shift(float *s, long n, float top) { return exp_shift(s, n, top); }

/* Attention of a few query tokens a row over a paged store, read in place through the
 * block table (no gathered copy): out = softmax(q k^T scale, over the keys the mask lets a
 * token see) v per query head, over
 * the KV head it groups under (query head h reads KV head h / G). Split-K: each (row, KV
 * head) pair's keys are cut into spans of `span` blocks from the first, each span's softmax
 * computed apart (its max, its sum, its unnormalised output) and merged after in order;
 * the spans fall at the same keys whatever the batch's width, so a row's output does not
 * depend on the other rows (a span past its keys is all masked and adds nothing).
 * Where the head size is a multiple of the vector width (SV: 16 floats on AVX-512, 8 on
 * AVX2), the scores take SV keys at a time (span_scores) and the weighted values keep the
 * output in registers over the keys (span_values: the scalar loop's floats); a query's
 * floats never depend on the queries beside it. Against a dot product a score and the
 * output updated in memory a key, on the default target's heads (9 over 3, hd 64), two
 * threads, AVX-512 Xeon: one query 0.56-0.70 of the time, 4 and 8 queries 0.41-0.51, at
 * 128-2,048 keys.
 * q: [B, H, K, hd]; kc, vc: [slots, kvh, hd] one layer's keys and values; table: [B, nb]
 * block ids (block_size bs); mask: [B, K, mT] bytes, nonzero where token k of row b may
 * see key t (every query head alike; keys from mT on are masked): what grouped_attention's
 * bias is built from, read as it stands (1 byte a key and token, where the bias is 4 a
 * key, token and query head). Masked keys are skipped, and a query with every key masked
 * gets zeros. scratch: at least B kvh ceil(nb / span) (G K (span bs + hd + 2)) floats;
 * out: [B, H, K, hd]. Returns 0, or -1 for shapes it does not take. */
int ts_paged_attention(const float *q, const float *kc, const float *vc, const int64_t *table, long nb, long bs,
                       const uint8_t *mask, long mT, float scale, float *scratch, float *out, long B, long H, long kvh, long K,
                       long hd, long span, int threads) {
    if (B < 1 || H < 1 || kvh < 1 || H % kvh || K < 1 || hd < 1 || nb < 1 || bs < 1 || span < 1) return -1;
    const long splits = (nb + span - 1) / span;
    const long G = H / kvh, R = G * K, T = nb * bs, items = B * kvh * splits;
    const long W = span * bs, per = R * (W + hd + 2);       /* a span's keys; scratch floats an item */
    const int nt = items > 1 && B * H * K * T * hd >= (1L << 15) ? threads : 1;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (long it = 0; it < items; ++it) {
        const long b = it / (kvh * splits), g = (it / splits) % kvh, sp = it % splits;
        const long j0 = sp * span, j1 = j0 + span < nb ? j0 + span : nb, n = (j1 - j0) * bs;
        float *s = scratch + it * per, *o = s + R * W, *mx = o + R * hd, *sm = mx + R;
        /* each query's mask row from the span's first key, and the keys it has there */
        const uint8_t *ms[R];
        for (long r = 0; r < R; ++r) ms[r] = mask + (b * K + r % K) * mT + j0 * bs;
        const long lim = mT - j0 * bs;
#if defined(SV)
        /* the span's keys and values: where each key's head starts in kc, and its value's in vc */
        long at[hd % SV == 0 ? span * bs : 1];
        if (hd % SV == 0) {                                   /* scores, SV keys at a time */
            const float *qs[R];
            for (long r = 0; r < R; ++r) qs[r] = q + ((b * H + g * G + r / K) * K + r % K) * hd;
            for (long j = j0, t = 0; j < j1; ++j)           /* block by block: no division a key */
                for (long off = 0, base = table[b * nb + j] * bs; off < bs; ++off, ++t)
                    at[t] = ((base + off) * kvh + g) * hd;
            span_scores(qs, kc, at, n, R, hd, W, ms, lim, scale, s, mx);
        } else
#endif
        {
        for (long r = 0; r < R; ++r) mx[r] = -INFINITY;
        for (long j = j0; j < j1; ++j) {                      /* scores, block by block */
            const long base = table[b * nb + j] * bs;
            for (long off = 0; off < bs; ++off) {
                const long t = (j - j0) * bs + off;
                const float *kt = kc + ((base + off) * kvh + g) * hd;
                for (long r = 0; r < R; ++r) {
                    if (!(t < lim && ms[r][t])) { s[r * W + t] = -INFINITY; continue; }
                    const float *qr = q + ((b * H + g * G + r / K) * K + r % K) * hd;
                    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                    for (long d = 0; d < hd; ++d) dot += qr[d] * kt[d];
                    const float v = dot * scale;
                    s[r * W + t] = v;
                    if (v > mx[r]) mx[r] = v;
                }
            }
        }
        }
        for (long r = 0; r < R; ++r) {   /* a whole span's width each, its tail masked: the same sums at any n */
            for (long t = n; t < W; ++t) s[r * W + t] = -INFINITY;
            sm[r] = mx[r] == -INFINITY ? 0.0f : exp_shift(s + r * W, W, mx[r]);
        }
#if defined(SV)
        if (hd % SV == 0) {                                   /* the weighted values, in registers */
            span_values(s, vc, at, n, R, hd, W, mx, o);
            continue;
        }
#endif
        for (long x = 0; x < R * hd; ++x) o[x] = 0.0f;
        for (long j = j0; j < j1; ++j) {                      /* the weighted values */
            const long base = table[b * nb + j] * bs;
            for (long off = 0; off < bs; ++off) {
                const long t = (j - j0) * bs + off;
                const float *vt = vc + ((base + off) * kvh + g) * hd;
                for (long r = 0; r < R; ++r) {
                    if (mx[r] == -INFINITY) continue;
                    const float p = s[r * W + t];
                    if (p == 0.0f) continue;
                    float *orow = o + r * hd;
                    for (long d = 0; d < hd; ++d) orow[d] += p * vt[d];
                }
            }
        }
    }
    /* merge each query's spans: their outputs and sums rescaled to the largest max */
    for (long b = 0; b < B; ++b)
        for (long g = 0; g < kvh; ++g)
            for (long r = 0; r < R; ++r) {
                const float *first = scratch + ((b * kvh + g) * splits) * per;
                float top = -INFINITY, total = 0.0f;
                for (long sp = 0; sp < splits; ++sp) {
                    const float m = (first + sp * per + R * (W + hd))[r];
                    if (m > top) top = m;
                }
                float *dst = out + ((b * H + g * G + r / K) * K + r % K) * hd;
                for (long d = 0; d < hd; ++d) dst[d] = 0.0f;
                if (top == -INFINITY) continue;
                for (long sp = 0; sp < splits; ++sp) {
                    const float *item = first + sp * per, *o = item + R * W;
                    const float m = item[R * (W + hd) + r], l = item[R * (W + hd) + R + r];
                    if (m == -INFINITY) continue;
                    const float w = expf(m - top);
                    total += w * l;
                    for (long d = 0; d < hd; ++d) dst[d] += w * o[r * hd + d];
                }
                const float inv = 1.0f / total;
                for (long d = 0; d < hd; ++d) dst[d] *= inv;
            }
    return 0;
}

/* One decoder layer's weights and its KV store, for ts_layers (treespark.kernels.blocks.Layer
 * mirrors it): the input norm, q|k|v (+ bias), Qwen3's per-head q/k norm weight or NULL, o (+
 * bias), the post-attention norm, gate|up (+ bias), down (+ bias); kc, vc: this layer's
 * paged keys and values [slots, kvh, hd]. */
typedef struct {
    const float *in_norm;
    const void *wqkv;
    const float *bqkv;
    const float *qk_norm;
    const void *wo;
    const float *bo;
    const float *post_norm;
    const void *wgu;
    const float *bgu;
    const void *wdown;
    const float *bdown;
    float *kc;
    float *vc;
    float in_eps, qk_eps, post_eps;
} ts_layer;

int ts_chunk_attention(const float *q, const float *kc, const float *vc, const int64_t *tables, long nb, long bs,
                       const int64_t *spans, long C, float scale, float *out, long H, long kvh, long N, long hd,
                       int threads);

/* A few-row forward's whole layer stack in one call: per layer ts_attn_in, the new keys and
 * values written at their slots, the attention, ts_attn_out_mlp; what the per-layer calls
 * do, in their order, on the same functions: the same floats. Its M = B K + N tokens are
 * B rows of K tree tokens (row b's K together; B may be 0), attended by ts_paged_attention
 * over the block table [B, nb] under the mask [B, K, mT], then N packed prefill tokens (N
 * may be 0), attended by ts_chunk_attention over their chunks' tables [C, cnb] and spans
 * [C, 3] (chunks.c). ids: [M] the tokens, whose rows of the embedding table embed [V, D] x
 * starts from; x: [M, D] the last layer's output out (its residual
 * stream plus its MLP's output, one float add, as torch's); taps: [M, n D], the output of
 * layer tapped[j] in columns j D .. (j < n) of each row (a row's taps side by side, in the
 * order the caller concatenates them; a layer may come twice); cos, ssin: the rotary tables
 * [P, hd] (ssin: rope_sign applied) read at pos [M], each token's position; slots: [M]
 * each token's slot. A block of the drafter's (no chunks):
 * slots NULL, each token written at its position pos[m] of its row's table, and mask NULL
 * with lens [B]: every token of row b sees the keys below lens[b] (mT = nb bs). Returns 0,
 * -1 for shapes it does not take, -2 when out of memory, -3 for a position past the tables. */
/* out[m] = the row idx[m] of tab (rows of `width` floats), m < M */
static void rows_at(const float *tab, const int64_t *idx, long M, long width, float *out) {
    for (long m = 0; m < M; ++m) memcpy(out + m * width, tab + idx[m] * width, (size_t)width * sizeof(float));
}

int ts_layers(const ts_layer *layers, long L, int half, float *x, const int64_t *ids, const float *embed, long V,
              float *taps, long n_taps, const long *tapped, const float *cos_tab, const float *ssin_tab, const int64_t *pos,
              long P, const int64_t *slots, const int64_t *table, long nb, long bs,
              const uint8_t *mask, const int64_t *lens, long mT, float scale, long B, long K, long N, const int64_t *ctables, long cnb,
              const int64_t *spans, long C, float cscale, long D, long Hq, long Hkv, long hd, long I, long span,
              int threads) {
    if (L < 1 || B < 0 || K < 0 || N < 0 || B * K + N < 1 || Hq < 1 || Hkv < 1 || Hq % Hkv || bs < 1 || span < 1)
        return -1;
    if ((B * K > 0 && nb < 1) || (N > 0 && (C < 1 || cnb < 1))) return -1;
    const long T = B * K, M = T + N, NQ = (Hq + 2 * Hkv) * hd, A = Hq * hd;
    const long splits = T ? (nb + span - 1) / span : 0, R = (Hq / Hkv) * K;
    const long att_scratch = B * Hkv * splits * R * (span * bs + hd + 2);
    for (long m = 0; m < M; ++m)
        if (pos[m] < 0 || pos[m] >= P || ids[m] < 0 || ids[m] >= V) return pos[m] >= P ? -3 : -1;
    if ((!slots && N) || (T && !mask && !lens)) return -1;
    if (!mask && T) mT = nb * bs;
    const long made = 2 * M * hd + (slots ? 0 : 2 * M + 1) + (mask || !T ? 0 : (T * mT + 3) / 4);
    const long total = M * D * 3 + M * NQ + M * A * 3 + M * 3 * I + att_scratch + made;
    float *buf = (float *)malloc((size_t)total * sizeof(float));
    if (!buf) return -2;
    float *mlp = buf, *other = mlp + M * D, *normed = other + M * D, *qkv = normed + M * D, *q = qkv + M * NQ;
    float *att = q + M * A;
    float *a = att + M * A, *gu = a + M * A, *act = gu + M * 2 * I, *ascratch = act + M * I;
    float *cos = ascratch + att_scratch, *ssin = cos + M * hd, *rest = ssin + M * hd;
    rows_at(cos_tab, pos, M, hd, cos);   /* each token's rotation, from the tables */
    rows_at(ssin_tab, pos, M, hd, ssin);
    if (!slots) {   /* each token at its position in its row's blocks */
        rest += (rest - buf) % 2;   /* (8-byte aligned) */
        int64_t *at = (int64_t *)rest;
        for (long m = 0; m < M; ++m) {
            const long p = pos[m];
            if (p / bs >= nb) { free(buf); return -1; }
            at[m] = table[(m / K) * nb + p / bs] * bs + p % bs;
        }
        slots = at;
        rest += M * 2;   /* (an int64 takes two floats' room) */
    }
    if (T && !mask) {   /* every token of row b sees the keys below lens[b] */
        uint8_t *made_mask = (uint8_t *)rest;
        for (long m = 0; m < T; ++m)
            for (long j = 0; j < mT; ++j) made_mask[m * mT + j] = j < lens[m / K];
        mask = made_mask;
    }
    rows_at(embed, ids, M, D, x);
    float *xa = x, *xb = other;
    int rc = 0;
    for (long i = 0; i < L && rc == 0; ++i) {
        const ts_layer *ly = layers + i;
        /* the residual add in place (x_out = x), the norm, q|k|v, q/k norms, rotation */
        rc = ts_attn_in(xa, i ? mlp : NULL, ly->in_norm, ly->in_eps, ly->wqkv, ly->bqkv, half, ly->qk_norm,
                        ly->qk_eps, cos, ssin, xa, normed, qkv, M, D, Hq, Hkv, hd, threads);
        if (rc) break;
        for (long j = 0; j < n_taps && i; ++j)   /* the residual stream entering layer i: layer i - 1's output */
            if (tapped[j] == i - 1)
                for (long m = 0; m < M; ++m) memcpy(taps + (m * n_taps + j) * D, xa + m * D, (size_t)D * sizeof(float));
        for (long m = 0; m < M; ++m) {
            const float *row = qkv + m * NQ;
            memcpy(ly->kc + slots[m] * Hkv * hd, row + Hq * hd, (size_t)(Hkv * hd) * sizeof(float));
            memcpy(ly->vc + slots[m] * Hkv * hd, row + (Hq + Hkv) * hd, (size_t)(Hkv * hd) * sizeof(float));
            /* the queries [B, Hq, K, hd] of the trees, then [Hq, N, hd] of the chunks */
            const long b = m < T ? m / K : 0, t = m < T ? m % K : m - T, w = m < T ? K : N;
            float *qs = m < T ? q : q + T * A;
            for (long h = 0; h < Hq; ++h) memcpy(qs + ((b * Hq + h) * w + t) * hd, row + h * hd, (size_t)hd * sizeof(float));
        }
        if (T) rc = ts_paged_attention(q, ly->kc, ly->vc, table, nb, bs, mask, mT, scale, ascratch, att, B, Hq, Hkv, K,
                                       hd, span, threads);
        if (rc == 0 && N)
            rc = ts_chunk_attention(q + T * A, ly->kc, ly->vc, ctables, cnb, bs, spans, C, cscale, att + T * A, Hq, Hkv,
                                    N, hd, threads);
        if (rc) break;
        for (long m = 0; m < M; ++m) {
            const long b = m < T ? m / K : 0, t = m < T ? m % K : m - T, w = m < T ? K : N;
            const float *as = m < T ? att : att + T * A;
            for (long h = 0; h < Hq; ++h) memcpy(a + m * A + h * hd, as + ((b * Hq + h) * w + t) * hd, (size_t)hd * sizeof(float));
        }
        rc = ts_attn_out_mlp(a, ly->wo, ly->bo, xa, ly->post_norm, ly->post_eps, ly->wgu, ly->bgu, ly->wdown,
                             ly->bdown, half, xb, normed, gu, act, mlp, M, D, A, I, threads);
        float *t = xa;
        xa = xb;
        xb = t;
    }
    if (rc == 0) {
        for (long j = 0; j < M * D; ++j) x[j] = xa[j] + mlp[j];
        for (long j = 0; j < n_taps; ++j)
            if (tapped[j] == L - 1)
                for (long m = 0; m < M; ++m) memcpy(taps + (m * n_taps + j) * D, x + m * D, (size_t)D * sizeof(float));
    }
    free(buf);
    return rc;
}

/* The drafter's context for M committed positions, written into its paged store in one call:
 * x [M, D] the rows (before the hidden norm), norm_w its weight; w: every layer's k products
 * then every layer's v products [2 L Hkv hd, D] (or their bfloat16 panels, `half`); k_norm
 * [L Hkv, hd] per-head k norm weights or NULL; cos_tab, ssin_tab: [P, hd] the rotary tables
 * (ssin: rope_sign applied), read at pos [M]; the keys and values go to slots [M] of kc, vc
 * [L, S, Hkv, hd]. What ts_attn_in with no query heads gives, then the writes. Returns 0, -1
 * for shapes it does not take, -2 when out of memory, -3 for a position past the tables. */
int ts_context_write(const float *x, const float *norm_w, float eps, const void *w, int half, const float *k_norm,
                     float k_eps, const float *cos_tab, const float *ssin_tab, long P, const int64_t *pos,
                     const int64_t *slots, float *kc, float *vc, long S, long M, long D, long L, long Hkv, long hd,
                     int threads) {
    if (M < 1 || L < 1 || Hkv < 1 || hd < 2 || S < 1) return -1;
    for (long m = 0; m < M; ++m)
        if (pos[m] < 0 || pos[m] >= P) return -3;
    const long HK = L * Hkv, N = 2 * HK * hd;
    float *buf = (float *)malloc((size_t)(2 * M * hd + M * D + M * N) * sizeof(float));
    if (!buf) return -2;
    float *cos = buf, *ssin = cos + M * hd, *normed = ssin + M * hd, *y = normed + M * D;
    rows_at(cos_tab, pos, M, hd, cos);
    rows_at(ssin_tab, pos, M, hd, ssin);
    int rc = ts_attn_in(x, NULL, norm_w, eps, w, NULL, half, k_norm, k_eps, cos, ssin, (float *)x, normed, y, M, D, 0,
                        HK, hd, threads);
    for (long m = 0; m < M && rc == 0; ++m)
        for (long l = 0; l < L; ++l) {
            const size_t at = (size_t)((l * S + slots[m]) * Hkv * hd), n = (size_t)(Hkv * hd);
            memcpy(kc + at, y + m * N + l * Hkv * hd, n * sizeof(float));
            memcpy(vc + at, y + m * N + (HK + l * Hkv) * hd, n * sizeof(float));
        }
    free(buf);
    return rc;
}

/* y = (rms_norm(x) norm_w) W^T (+ b) over M rows x [M, D], W [N, D] (or its bfloat16 panels,
 * `half`): ts_add_norm, then the product, in one call (a forward's final norm and LM head).
 * y: [M, N]. Returns 0, -1 for shapes it does not take, -2 when out of memory. */
int ts_norm_linear(const float *x, const float *norm_w, float eps, const void *w, const float *b, int half, float *y,
                   long M, long D, long N, int threads) {
    if (M < 1 || D < 1 || N < 1) return -1;
    float *normed = (float *)malloc((size_t)(M * D) * sizeof(float));
    if (!normed) return -2;
    int rc = ts_add_norm(x, NULL, norm_w, eps, NULL, normed, M, D, threads);
    if (rc == 0) rc = product(normed, w, b, half, y, M, N, D, threads);
    free(normed);
    return rc;
}
