/* Causal attention of a prefill's packed prompt chunks over a paged store, read in place.
 *
 * A prefill step packs its chunks into one row of N tokens; chunk c holds the prompt's
 * positions start_c .. start_c + size_c - 1 at offset_c .. offset_c + size_c - 1 of the row,
 * its keys and values already written at their slots, and its query at position p attends
 * the keys of positions 0 .. p through the chunk's block table. The torch path gathers each
 * chunk's blocks into a dense copy, builds an additive mask over them and calls SDPA's flash
 * kernel, which at small heads (16 floats) spends more on its blocking than on arithmetic
 * and computes the masked upper triangle of the chunk's own keys.
 *
 * Here the vector lanes are QL queries of one head (16 on AVX-512, 8 on AVX2), not the head
 * dimension, so any head size vectorises and a score takes one FMA a dimension:
 *   - the tile's queries transposed once, qt[d][lane], times the scale;
 *   - per KB keys: scores s_j[lane] = sum_d qt[d] k_j[d] (one FMA chain a key, the key's
 *     float broadcast), keys past a lane's position -inf (only near the diagonal);
 *   - online softmax over the keys in blocks of KB from position 0, in log2 units (log2 e
 *     folded into the scale, so a weight is 2^(s - m): vexp.h's TS_VEXP2, ~2 float ulps):
 *     the running maximum m, sum l and output o[d][lane], rescaled by 2^(m - m') only in
 *     a block where some lane's maximum moves (after the first few blocks, rarely; where it
 *     does not, the factor would be exactly 1);
 *   - o[d] += p_j v_j[d], the value's float broadcast.
 * A key's slot is found by stepping through the chunk's blocks (no division a key). Keys
 * past the tile's last position are never read. A lane's floats depend only on its query and
 * the keys at or before it, in blocks that start at position 0: the same values whatever the
 * chunking, the tile-mates or the threads; they are the flash kernel's to float rounding.
 */
#include <math.h>
#include <stdint.h>

#include "vexp.h"

#define KB 8     /* keys a block */
#define DC 4     /* output dimensions kept in registers at a time */
#define NV 2     /* vectors of queries a tile */
#define MAX_HD 256

#if defined(__AVX512F__)
#include <immintrin.h>
#define QL 16
typedef __m512 vq;
typedef __m512i vqi;
#define Q_ZERO() _mm512_setzero_ps()
#define Q_SET1(x) _mm512_set1_ps(x)
#define Q_LOAD(p) _mm512_loadu_ps(p)
#define Q_STORE(p, v) _mm512_storeu_ps(p, v)
#define Q_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define Q_MUL(a, b) _mm512_mul_ps(a, b)
#define Q_ADD(a, b) _mm512_add_ps(a, b)
#define Q_SUB(a, b) _mm512_sub_ps(a, b)
#define Q_MAX(a, b) _mm512_max_ps(a, b)
#define Q_ROUND(x) _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
/* p 2^n where x >= lo, else 0: one scalef under a zeroing mask */
#define Q_SCALE(p, n, x, lo) _mm512_maskz_scalef_ps(_mm512_cmp_ps_mask(x, lo, _CMP_GE_OQ), p, n)
/* x where keep (a < b lane-wise is false), else y */
#define Q_WHERE_LT(a, b, y, x) _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, b, _CMP_LT_OQ), x, y)
/* whether a and b are equal in every lane */
#define Q_SAME(a, b) (_mm512_cmp_ps_mask(a, b, _CMP_NEQ_UQ) == 0)
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define QL 8
typedef __m256 vq;
#define Q_ZERO() _mm256_setzero_ps()
#define Q_SET1(x) _mm256_set1_ps(x)
#define Q_LOAD(p) _mm256_loadu_ps(p)
#define Q_STORE(p, v) _mm256_storeu_ps(p, v)
#define Q_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define Q_MUL(a, b) _mm256_mul_ps(a, b)
#define Q_ADD(a, b) _mm256_add_ps(a, b)
#define Q_SUB(a, b) _mm256_sub_ps(a, b)
#define Q_MAX(a, b) _mm256_max_ps(a, b)
#define Q_ROUND(x) _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define Q_POW2(n) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), \
                                                                         _mm256_set1_epi32(127)), 23))
#define Q_SCALE(p, n, x, lo) _mm256_andnot_ps(_mm256_cmp_ps(x, lo, _CMP_LT_OQ), _mm256_mul_ps(p, Q_POW2(n)))
#define Q_WHERE_LT(a, b, y, x) _mm256_blendv_ps(x, y, _mm256_cmp_ps(a, b, _CMP_LT_OQ))
#define Q_SAME(a, b) (_mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_NEQ_UQ)) == 0)
#endif

#if defined(QL)
#define TL (NV * QL)   /* queries a tile */

/* 2^x lane-wise for x <= 0 (vexp.h) */
TS_VEXP2(q_exp2, vq, Q_SET1, Q_SUB, Q_FMA, Q_ROUND, Q_SCALE)

/* One tile: queries i0 .. i0 + n - 1 (n <= TL) of chunk c, query head h, over KV head g;
 * NV vectors of QL lanes, each key's floats broadcast once for all of them. */
static void tile(const float *q, const float *kc, const float *vc, const int64_t *table, long bs, long offset,
                 long start, long i0, long n, long h, long g, float scale, float *out, long N, long kvh, long hd) {
    float qt[MAX_HD * TL], ot[MAX_HD * TL], pos[TL];
    const float scale2 = scale * 1.44269504088896341f;   /* scores in log2 units */
    for (long x = 0; x < TL; ++x) {                 /* a tail tile repeats its last query in the spare lanes */
        const long i = i0 + (x < n ? x : n - 1);
        const float *src = q + (h * N + offset + i) * hd;
        pos[x] = (float)(start + i);
        for (long d = 0; d < hd; ++d) qt[d * TL + x] = src[d] * scale2;
    }
    for (long x = 0; x < hd * TL; ++x) ot[x] = 0.0f;
    const long first = start + i0, last = start + i0 + n - 1;
    const vq ninf = Q_SET1(-INFINITY);
    vq at[NV], m[NV], l[NV];
    for (int v = 0; v < NV; ++v) { at[v] = Q_LOAD(pos + v * QL); m[v] = ninf; l[v] = Q_ZERO(); }
    long blk = 0, off = 0;                          /* key t0's block in the table and slot in it */
    for (long t0 = 0; t0 <= last; t0 += KB) {
        const float *kp[KB], *vp[KB];
        for (long j = 0; j < KB; ++j) {             /* past the last key: key t0 again, masked below */
            if (t0 + j <= last) {
                const long slot = table[blk] * bs + off;
                kp[j] = kc + (slot * kvh + g) * hd;
                vp[j] = vc + (slot * kvh + g) * hd;
                if (++off == bs) { off = 0; ++blk; }
            } else {
                kp[j] = kp[0];
                vp[j] = vp[0];
            }
        }
        vq s[KB][NV];
        _Pragma("GCC unroll 8")
        for (long j = 0; j < KB; ++j)
            for (int v = 0; v < NV; ++v) s[j][v] = Q_ZERO();
        for (long d = 0; d < hd; ++d) {
            vq qd[NV];
            for (int v = 0; v < NV; ++v) qd[v] = Q_LOAD(qt + d * TL + v * QL);
            _Pragma("GCC unroll 8")
            for (long j = 0; j < KB; ++j) {
                const vq kd = Q_SET1(kp[j][d]);
                for (int v = 0; v < NV; ++v) s[j][v] = Q_FMA(qd[v], kd, s[j][v]);
            }
        }
        if (t0 + KB - 1 > first)                    /* near the diagonal: keys past a lane's position */
            for (long j = 0; j < KB; ++j) {
                const vq key = Q_SET1((float)(t0 + j));
                for (int v = 0; v < NV; ++v) s[j][v] = Q_WHERE_LT(at[v], key, ninf, s[j][v]);
            }
        vq top[NV];
        int same = 1;
        for (int v = 0; v < NV; ++v) {
            top[v] = m[v];
            for (long j = 0; j < KB; ++j) top[v] = Q_MAX(top[v], s[j][v]);
            same &= Q_SAME(top[v], m[v]);
        }
        if (!same)                                  /* a maximum moved: rescale by 2^(m - m') (0 from -inf) */
            for (int v = 0; v < NV; ++v) {
                const vq alpha = q_exp2(Q_SUB(m[v], top[v]));
                l[v] = Q_MUL(l[v], alpha);
                for (long d = 0; d < hd; ++d)
                    Q_STORE(ot + d * TL + v * QL, Q_MUL(Q_LOAD(ot + d * TL + v * QL), alpha));
                m[v] = top[v];
            }
        for (int v = 0; v < NV; ++v)
            for (long j = 0; j < KB; ++j) {
                s[j][v] = q_exp2(Q_SUB(s[j][v], m[v]));
                l[v] = Q_ADD(l[v], s[j][v]);
            }
        for (long d0 = 0; d0 < hd; d0 += DC) {
            const long nd = hd - d0 < DC ? hd - d0 : DC;
            vq o[DC][NV];
            for (long dd = 0; dd < nd; ++dd)
                for (int v = 0; v < NV; ++v) o[dd][v] = Q_LOAD(ot + (d0 + dd) * TL + v * QL);
            for (long j = 0; j < KB; ++j)
                for (long dd = 0; dd < nd; ++dd) {
                    const vq vd = Q_SET1(vp[j][d0 + dd]);
                    for (int v = 0; v < NV; ++v) o[dd][v] = Q_FMA(s[j][v], vd, o[dd][v]);
                }
            for (long dd = 0; dd < nd; ++dd)
                for (int v = 0; v < NV; ++v) Q_STORE(ot + (d0 + dd) * TL + v * QL, o[dd][v]);
        }
    }
    float sums[TL];
    for (int v = 0; v < NV; ++v) Q_STORE(sums + v * QL, l[v]);
    for (long i = 0; i < n; ++i) {
        float *dst = out + (h * N + offset + i0 + i) * hd;
        const float inv = 1.0f / sums[i];
        for (long d = 0; d < hd; ++d) dst[d] = ot[d * TL + i] * inv;
    }
}
#endif

/* The lanes a tile takes: 0 where this build has no vector form (the caller keeps SDPA). */
long ts_chunk_lanes(void) {
#if defined(QL)
    return QL;
#else
    return 0;
#endif
}

/* q: [H, N, hd] the packed row's queries; kc, vc: [slots, kvh, hd] one layer's keys and
 * values; tables: [C, nb] each chunk's blocks (block size bs); spans: [C, 3] each chunk's
 * (offset, size, start); out: [H, N, hd] (tokens no chunk covers are left as they are).
 * Query head h reads KV head h / (H / kvh). Returns 0, or -1 for shapes it does not take. */
int ts_chunk_attention(const float *q, const float *kc, const float *vc, const int64_t *tables, long nb, long bs,
                       const int64_t *spans, long C, float scale, float *out, long H, long kvh, long N, long hd,
                       int threads) {
#if defined(QL)
    if (C < 1 || H < 1 || kvh < 1 || H % kvh || N < 1 || hd < 1 || hd > MAX_HD || nb < 1 || bs < 1) return -1;
    long tiles = 0;
    for (long c = 0; c < C; ++c) {
        const long offset = spans[3 * c], size = spans[3 * c + 1], start = spans[3 * c + 2];
        if (size < 1 || offset < 0 || offset + size > N || start < 0 || start + size > nb * bs) return -1;
        tiles += (size + TL - 1) / TL;
    }
    const long G = H / kvh, items = tiles * H;
    const int nt = items > 1 ? threads : 1;
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
    for (long it = 0; it < items; ++it) {
        long k = it % tiles, c = 0;                  /* head by head (its keys stay in cache), tile k of the chunks */
        const long h = it / tiles;
        for (;; ++c) {
            const long nt_c = (spans[3 * c + 1] + TL - 1) / TL;
            if (k < nt_c) break;
            k -= nt_c;
        }
        const long offset = spans[3 * c], size = spans[3 * c + 1], start = spans[3 * c + 2];
        const long i0 = k * TL, n = size - i0 < TL ? size - i0 : TL;
        tile(q, kc, vc, tables + c * nb, bs, offset, start, i0, n, h, h / G, scale, out, N, kvh, hd);
    }
    return 0;
#else
    (void)q; (void)kc; (void)vc; (void)tables; (void)nb; (void)bs; (void)spans; (void)C; (void)scale; (void)out;
    (void)H; (void)kvh; (void)N; (void)hd; (void)threads;
    return -1;
#endif
}
