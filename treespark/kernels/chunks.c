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
#include <stdlib.h>
#include <string.h>

#include "tiles.h"
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

#if defined(QL) && QL == 16 && defined(__AMX_TILE__) && defined(__AMX_BF16__)
/* The tile form (AMX), for heads of a multiple of 64 where the process may use the tile
 * registers (gemv.c: ts_tiles). The same lanes (16 queries of one head), the same online
 * softmax in log2 units, but a block of AKB keys' scores and its values' products are
 * tile products: S^T = K Q^T (a key's scores of the 16 queries in a tile row, as the
 * vector form holds them) and O^T += V^T P^T. Every float32 operand is split exactly into
 * three bfloat16 parts, x = hi + mid + lo (gemv.c), and of the nine products of two split
 * operands the six at or above 2^-16 of the whole are taken (hi.hi, hi.mid, hi.lo,
 * mid.hi, mid.mid, lo.hi; the three left out are below 2^-24 of it, a float's rounding):
 * each sum the float32 one to float rounding, at about a third of the vector form's
 * time. A call splits each chunk's keys and values over each KV head once (the values
 * transposed, a tile's rows being dimensions), for every query tile that reads them. A
 * lane's floats depend on its query and on the keys at or before it in blocks from
 * position 0 (a key past a lane's position weighs exactly 0): whatever the chunking, the
 * tile-mates or the threads. */
int ts_tiles(void);

#define AKB 32   /* keys a block on the tile form: two score tiles */
/* how far (log2 units) a lane's maximum may pass the one its weights are taken against before
 * they are rescaled: its weights stay below 2^LAZY, and past the first blocks a rescale is rare */
#define LAZY 8.0f

static void full_tiles(void) {                      /* every tile 16 rows of 64 bytes */
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; ++t) {
        c.colsb[t] = 64;
        c.rows[t] = 16;
    }
    _tile_loadconfig(&c);
}

/* One chunk's keys 0 .. T - 1 over KV head g, split into three parts and laid out as whole
 * 1 KiB tiles (a tile read from L2 row by row at a wider stride is ~2.7x slower):
 * ks [tp / 16][3][hd / 32] tiles of 16 keys x 32 dimensions (A tiles of S^T = K Q^T), and
 * vt [tp / 32][3][hd / 16] tiles of 16 dimensions x 32 keys, the values transposed (A tiles
 * of O^T = V^T P^T), each block's tiles one after another (one stream for the prefetchers), written a key pair at a time (a 32-bit word a dimension); keys T ..
 * tp - 1 zero. */
static void split_chunk(const float *kc, const float *vc, const int64_t *table, long bs, long T, long tp, long g,
                        long kvh, long hd, uint16_t *ks, uint16_t *vt) {
    const __m512i top = _mm512_set1_epi32((int)0xFFFF0000u);
    const __m512i rows = _mm512_set_epi32(240, 224, 208, 192, 176, 160, 144, 128, 112, 96, 80, 64, 48, 32, 16, 0);
    for (long t = 0; t < tp; t += 2) {
        const float *kr[2], *vr[2];
        for (int e = 0; e < 2; ++e) {
            kr[e] = vr[e] = 0;
            if (t + e < T) {
                const long slot = table[(t + e) / bs] * bs + (t + e) % bs;
                kr[e] = kc + (slot * kvh + g) * hd;
                vr[e] = vc + (slot * kvh + g) * hd;
            }
        }
        for (long d0 = 0; d0 < hd; d0 += 16) {
            __m512 parts[3], a[3], b[3];
            for (int e = 0; e < 2; ++e) {
                split3v(kr[e] ? _mm512_loadu_ps(kr[e] + d0) : _mm512_setzero_ps(), parts);
                for (int p = 0; p < 3; ++p)
                    _mm256_storeu_si256((__m256i *)(ks + (((t + e) / 16 * 3 + p) * (hd / 32) + d0 / 32) * 512
                                                    + ((t + e) % 16) * 32 + d0 % 32), bf16_bits(parts[p]));
            }
            split3v(vr[0] ? _mm512_loadu_ps(vr[0] + d0) : _mm512_setzero_ps(), a);
            split3v(vr[1] ? _mm512_loadu_ps(vr[1] + d0) : _mm512_setzero_ps(), b);
            for (int p = 0; p < 3; ++p)
                _mm512_i32scatter_epi32((uint32_t *)(vt + ((t / 32 * 3 + p) * (hd / 16) + d0 / 16) * 512)
                                            + (t % 32) / 2, rows,
                                        _mm512_or_si512(_mm512_srli_epi32(_mm512_castps_si512(a[p]), 16),
                                                        _mm512_and_si512(_mm512_castps_si512(b[p]), top)), 4);
        }
    }
}

/* One query tile on the tile form: 16 queries of one head (a tail tile repeats its last query
 * in the spare lanes) over its KV head's split keys ks and values vt (split_chunk, tp keys),
 * and its running softmax: O^T [hd][16], the lanes' maximum m and sum l. */
typedef struct {
    uint32_t qb[3 * (MAX_HD / 2) * 16];   /* Q^T's parts as B tiles: [3][hd / 2 pairs][16] */
    uint32_t pb[3 * (AKB / 2) * 16];      /* a block's P^T parts as B tiles: [3][AKB / 2 pairs][16] */
    float ot[MAX_HD * 16];                /* O^T: [hd][16] */
    float s[AKB * 16];                    /* a block's S^T: [AKB][16] */
    float pos[16];
    const uint16_t *ks, *vt;
    long tp, first;
    __m512 m, l;
} amx_tile;

static void amx_start(amx_tile *a, const float *q, const uint16_t *ks, const uint16_t *vt, long tp, long offset,
                      long start, long i0, long n, long h, float scale, long N, long hd) {
    const float scale2 = scale * 1.44269504088896341f;   /* scores in log2 units */
    const long hp = hd / 2;
    uint16_t *qh = (uint16_t *)a->qb;
    for (long x = 0; x < 16; ++x) {
        const long i = i0 + (x < n ? x : n - 1);
        const float *src = q + (h * N + offset + i) * hd;
        a->pos[x] = (float)(start + i);
        for (long d0 = 0; d0 < hd; d0 += 16) {
            __m512 parts[3];
            split3v(_mm512_mul_ps(_mm512_loadu_ps(src + d0), _mm512_set1_ps(scale2)), parts);
            for (int p = 0; p < 3; ++p) {
                uint16_t b[16];
                _mm256_storeu_si256((__m256i *)b, bf16_bits(parts[p]));
                for (long dd = 0; dd < 16; ++dd) {
                    const long d = d0 + dd;
                    qh[((p * hp + d / 2) * 16 + x) * 2 + (d & 1)] = b[dd];
                }
            }
        }
    }
    for (long x = 0; x < hd * 16; ++x) a->ot[x] = 0.0f;
    a->ks = ks;
    a->vt = vt;
    a->tp = tp;
    a->first = start + i0;
    a->m = _mm512_set1_ps(-INFINITY);
    a->l = _mm512_setzero_ps();
}

/* S^T of the block of keys t0 .. t0 + AKB - 1: tmm0, tmm1 its two key tiles' scores, tmm2-4
 * key parts, tmm5-7 the queries' parts */
static inline void amx_scores(amx_tile *a, long t0, long hd) {
    const long hp = hd / 2, kpart = (hd / 32) * 512;   /* bfloat16s a key part */
    _tile_zero(0);
    _tile_zero(1);
    for (long c0 = 0; c0 < hd; c0 += 32) {          /* 32 dimensions (16 pairs) a step */
        const uint16_t *k0 = a->ks + ((t0 / 16) * 3 * (hd / 32) + c0 / 32) * 512, *k1 = k0 + 3 * kpart;
        const uint32_t *qc = a->qb + (c0 / 2) * 16;
        _tile_loadd(5, qc, 64);                                       /* q hi, mid, lo */
        _tile_loadd(6, qc + hp * 16, 64);
        _tile_loadd(7, qc + 2 * hp * 16, 64);
        _tile_loadd(2, k0, 64);                                       /* k hi */
        _tile_loadd(3, k1, 64);
        _tile_dpbf16ps(0, 2, 5);
        _tile_dpbf16ps(1, 3, 5);
        _tile_dpbf16ps(0, 2, 6);
        _tile_dpbf16ps(1, 3, 6);
        _tile_dpbf16ps(0, 2, 7);
        _tile_dpbf16ps(1, 3, 7);
        _tile_loadd(4, k0 + kpart, 64);                               /* k mid */
        _tile_loadd(2, k1 + kpart, 64);
        _tile_dpbf16ps(0, 4, 5);
        _tile_dpbf16ps(1, 2, 5);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 2, 6);
        _tile_loadd(3, k0 + 2 * kpart, 64);                           /* k lo */
        _tile_loadd(4, k1 + 2 * kpart, 64);
        _tile_dpbf16ps(0, 3, 5);
        _tile_dpbf16ps(1, 4, 5);
    }
    _tile_stored(0, a->s, 64);
    _tile_stored(1, a->s + 256, 64);
}

/* The block's weights: keys past a lane's position masked, the running maximum and sum, and
 * P^T's parts as key pairs */
static inline void amx_weights(amx_tile *a, long t0, long hd) {
    const __m512 ninf = _mm512_set1_ps(-INFINITY), at = _mm512_loadu_ps(a->pos);
    const __m512i top16 = _mm512_set1_epi32((int)0xFFFF0000u);
    float *s = a->s;
    __m512 mx = a->m, m = a->m, l = a->l;
    for (long j = 0; j < AKB; ++j) {
        __m512 v = _mm512_load_ps(s + 16 * j);
        if (t0 + j > a->first) {                    /* near the diagonal: keys past a lane's position */
            v = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(at, _mm512_set1_ps((float)(t0 + j)), _CMP_LT_OQ), v, ninf);
            _mm512_store_ps(s + 16 * j, v);
        }
        mx = _mm512_max_ps(mx, v);
    }
    /* a lane's maximum moved more than LAZY past the one its weights are taken against:
     * that lane's sums rescaled by 2^(m - m') (0 from -inf), the others' by exactly 1 */
    const __mmask16 moved = _mm512_cmp_ps_mask(mx, _mm512_add_ps(m, _mm512_set1_ps(LAZY)), _CMP_GT_OQ);
    if (moved) {
        const __m512 m2 = _mm512_mask_blend_ps(moved, m, mx);
        const __m512 alpha = q_exp2(_mm512_sub_ps(m, m2));
        l = _mm512_mul_ps(l, alpha);
        for (long d = 0; d < hd; ++d)
            _mm512_store_ps(a->ot + 16 * d, _mm512_mul_ps(_mm512_load_ps(a->ot + 16 * d), alpha));
        m = m2;
    }
    for (long j = 0; j < AKB; j += 2) {
        __m512 x[3], y[3];
        const __m512 px = q_exp2(_mm512_sub_ps(_mm512_load_ps(s + 16 * j), m));
        const __m512 py = q_exp2(_mm512_sub_ps(_mm512_load_ps(s + 16 * j + 16), m));
        l = _mm512_add_ps(_mm512_add_ps(l, px), py);
        split3v(px, x);
        split3v(py, y);
        for (int p = 0; p < 3; ++p)
            _mm512_store_si512((__m512i *)(a->pb + (p * (AKB / 2) + j / 2) * 16),
                               _mm512_or_si512(_mm512_srli_epi32(_mm512_castps_si512(x[p]), 16),
                                               _mm512_and_si512(_mm512_castps_si512(y[p]), top16)));
    }
    a->m = m;
    a->l = l;
}

/* O^T += V^T P^T over the block: tmm0-3 O^T's tiles (64 dimensions a pass), tmm4-6 the
 * weights' parts, tmm7 a value part */
static inline void amx_values(amx_tile *a, long t0, long hd) {
    const long vpart = (hd / 16) * 512;            /* bfloat16s a value part */
    _tile_loadd(4, a->pb, 64);                                        /* p hi, mid, lo */
    _tile_loadd(5, a->pb + (AKB / 2) * 16, 64);
    _tile_loadd(6, a->pb + AKB * 16, 64);
    for (long e0 = 0; e0 < hd; e0 += 64) {
        float *o = a->ot + e0 * 16;
        const uint16_t *v0 = a->vt + ((t0 / 32) * 3 * (hd / 16) + e0 / 16) * 512;
        _tile_loadd(0, o, 64);
        _tile_loadd(1, o + 256, 64);
        _tile_loadd(2, o + 512, 64);
        _tile_loadd(3, o + 768, 64);
#define VALUE_PART(T, p, parts)                                                                   \
        _tile_loadd(7, v0 + (p) * vpart + (T) * 512, 64);                                       \
        _tile_dpbf16ps(T, 7, 4);                                                                \
        if ((parts) > 1) _tile_dpbf16ps(T, 7, 5);                                               \
        if ((parts) > 2) _tile_dpbf16ps(T, 7, 6);
        VALUE_PART(0, 0, 3) VALUE_PART(1, 0, 3) VALUE_PART(2, 0, 3) VALUE_PART(3, 0, 3)
        VALUE_PART(0, 1, 2) VALUE_PART(1, 1, 2) VALUE_PART(2, 1, 2) VALUE_PART(3, 1, 2)
        VALUE_PART(0, 2, 1) VALUE_PART(1, 2, 1) VALUE_PART(2, 2, 1) VALUE_PART(3, 2, 1)
#undef VALUE_PART
        _tile_stored(0, o, 64);
        _tile_stored(1, o + 256, 64);
        _tile_stored(2, o + 512, 64);
        _tile_stored(3, o + 768, 64);
    }
}

static void amx_finish(const amx_tile *a, float *out, long row, long n, long hd) {   /* row: the tile's first query's */
    float sums[16];
    _mm512_storeu_ps(sums, a->l);
    for (long i = 0; i < n; ++i) {
        float *dst = out + (row + i) * hd;
        const float inv = 1.0f / sums[i];
        for (long d = 0; d < hd; ++d) dst[d] = a->ot[d * 16 + i] * inv;
    }
}

/* ts_chunk_attention on the tile form (the caller checked the shapes): 0, or -1 where the
 * scratch cannot be had. */
static int chunks_amx(const float *q, const float *kc, const float *vc, const int64_t *tables, long nb, long bs,
                      const int64_t *spans, long C, float scale, float *out, long H, long kvh, long N, long hd,
                      int threads) {
    long total = 0, tiles = 0;
    for (long c = 0; c < C; ++c) {
        total += (spans[3 * c + 2] + spans[3 * c + 1] + AKB - 1) / AKB * AKB;
        tiles += (spans[3 * c + 1] + 15) / 16;
    }
    uint16_t *buf = (uint16_t *)malloc((size_t)(total * kvh * hd * 6) * sizeof(uint16_t));
    long *base = (long *)malloc((size_t)C * sizeof(long));
    if (!buf || !base) {
        free(buf);
        free(base);
        return -1;
    }
    for (long c = 0, at = 0; c < C; ++c) {
        base[c] = at;
        at += (spans[3 * c + 2] + spans[3 * c + 1] + AKB - 1) / AKB * AKB * kvh * hd * 6;
    }
    const long G = H / kvh, items = tiles * H, splits = C * kvh;
    const int nt = items > 1 ? threads : 1;
#pragma omp parallel num_threads(nt)
    {
#pragma omp for schedule(dynamic, 1)
        for (long it = 0; it < splits; ++it) {
            const long c = it / kvh, g = it % kvh, T = spans[3 * c + 2] + spans[3 * c + 1];
            const long tp = (T + AKB - 1) / AKB * AKB;
            uint16_t *ks = buf + base[c] + g * tp * hd * 6;
            split_chunk(kc, vc, tables + c * nb, bs, T, tp, g, kvh, hd, ks, ks + 3 * tp * hd);
        }
        full_tiles();
        amx_tile a __attribute__((aligned(64)));
#pragma omp for schedule(dynamic, 1)
        for (long it = 0; it < items; ++it) {
            long k = it % tiles, c = 0;              /* head by head, tile k of the chunks */
            const long h = it / tiles;
            for (;; ++c) {
                const long nt_c = (spans[3 * c + 1] + 15) / 16;
                if (k < nt_c) break;
                k -= nt_c;
            }
            const long offset = spans[3 * c], size = spans[3 * c + 1], start = spans[3 * c + 2];
            const long tp = (start + size + AKB - 1) / AKB * AKB, i0 = k * 16, n = size - i0 < 16 ? size - i0 : 16;
            const uint16_t *ks = buf + base[c] + (h / G) * tp * hd * 6;
            amx_start(&a, q, ks, ks + 3 * tp * hd, tp, offset, start, i0, n, h, scale, N, hd);
            for (long t0 = 0; t0 <= start + i0 + n - 1; t0 += AKB) {
                amx_scores(&a, t0, hd);
                amx_weights(&a, t0, hd);
                amx_values(&a, t0, hd);
            }
            amx_finish(&a, out + h * N * hd, offset + i0, n, hd);
        }
        _tile_release();
    }
    free(buf);
    free(base);
    return 0;
}
#define CHUNK_TILES 1
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
#if defined(CHUNK_TILES)
    if (hd % 64 == 0 && ts_tiles()
        && chunks_amx(q, kc, vc, tables, nb, bs, spans, C, scale, out, H, kvh, N, hd, threads) == 0)
        return 0;   /* (without room for the split keys: the vector form) */
#endif
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
