/* e^x for a vector of floats, the polynomial every kernel here uses: x = n ln2 + r,
 * |r| <= ln2/2, e^r by its degree-6 Taylor polynomial (relative error ~2e-7, about 2 float
 * ulps), times 2^n; 0 below -87 (and at -inf), inf above 89.
 *
 * TS_VEXP(name, V, SET1, MIN, MAX, MUL, FMA, FNMA, ROUND, POW2, ZERO_BELOW) defines
 * `static inline V name(V x)` over one vector width's operations: ROUND to the nearest
 * integer, POW2(n) = 2^n for integral n, ZERO_BELOW(x, lo, v) = v where x >= lo, else 0. */
#ifndef TS_VEXP_H
#define TS_VEXP_H

#define TS_VEXP(name, V, SET1, MIN, MAX, MUL, FMA, FNMA, ROUND, POW2, ZERO_BELOW)           \
    static inline V name(V x) {                                                            \
        const V lo = SET1(-87.0f);                                                         \
        const V y = MIN(MAX(x, lo), SET1(89.0f));                                          \
        const V n = ROUND(MUL(y, SET1(1.44269504088896341f)));                             \
        V r = FNMA(n, SET1(0.693359375f), y);                  /* ln2 in two parts */      \
        r = FNMA(n, SET1(-2.12194440e-4f), r);                                             \
        V p = SET1(1.0f / 720);                                                            \
        p = FMA(p, r, SET1(1.0f / 120));                                                   \
        p = FMA(p, r, SET1(1.0f / 24));                                                    \
        p = FMA(p, r, SET1(1.0f / 6));                                                     \
        p = FMA(p, r, SET1(0.5f));                                                         \
        p = FMA(p, r, SET1(1.0f));                                                         \
        p = FMA(p, r, SET1(1.0f));                                                         \
        return ZERO_BELOW(x, lo, MUL(p, POW2(n)));                                         \
    }

/* 2^x for a vector of floats x <= 0 (a softmax's scores less their maximum, in log2 units):
 * x = n + r, |r| <= 1/2, 2^r by a degree-6 polynomial fitted to it on [-1/2, 1/2] (Chebyshev
 * nodes; relative error ~1e-7, about 2 float ulps), times 2^n; 0 below -125 (and at -inf).
 * One multiply fewer than e^x (the caller folds log2 e into its scale), and an ISA with a
 * scale-by-2^n instruction does the rest in one.
 *
 * TS_VEXP2(name, V, SET1, SUB, FMA, ROUND, SCALE) defines `static inline V name(V x)`:
 * SCALE(p, n, x, lo) = p 2^n for integral n where x >= lo, else 0. */
#define TS_VEXP2(name, V, SET1, SUB, FMA, ROUND, SCALE)                                      \
    static inline V name(V x) {                                                            \
        const V n = ROUND(x);                                                              \
        const V r = SUB(x, n);                                                             \
        V p = SET1(1.5465312753804028e-4f);                                                \
        p = FMA(p, r, SET1(1.3395280111581087e-3f));                                       \
        p = FMA(p, r, SET1(9.618040174245834e-3f));                                        \
        p = FMA(p, r, SET1(5.550340563058853e-2f));                                        \
        p = FMA(p, r, SET1(2.4022650718688965e-1f));                                       \
        p = FMA(p, r, SET1(6.931471824645996e-1f));                                        \
        p = FMA(p, r, SET1(1.0f));                                                         \
        return SCALE(p, n, x, SET1(-125.0f));                                              \
    }

#endif
