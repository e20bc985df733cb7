/* Each row's argmax over the vocabulary in one call (treespark.kernels.vocab.argmax).
 *
 * torch's CPU argmax walks every logit with its index (1.5-2 ns a logit); here a row's
 * maximum is one vector pass (four independent maxima, and an unordered-compare for
 * NaNs), then the first logit equal to it is found by a vector scan that stops there:
 * the first maximal index, what torch.argmax returns. A NaN counts as the maximum, as
 * there: a row holding one returns its first NaN. Plain C loops where there is no
 * AVX-512. */
#include <math.h>
#include <stdint.h>

#if defined(__AVX512F__)
#include <immintrin.h>

/* the row's maximum; *nan set where it holds a NaN */
static float row_max(const float *r, long v, int *nan) {
    __m512 m0 = _mm512_set1_ps(-INFINITY), m1 = m0, m2 = m0, m3 = m0;
    __mmask16 un = 0;
    long j = 0;
    for (; j + 64 <= v; j += 64) {
        const __m512 a = _mm512_loadu_ps(r + j), b = _mm512_loadu_ps(r + j + 16);
        const __m512 c = _mm512_loadu_ps(r + j + 32), d = _mm512_loadu_ps(r + j + 48);
        un |= _mm512_cmp_ps_mask(a, b, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(c, d, _CMP_UNORD_Q);
        m0 = _mm512_max_ps(m0, a);
        m1 = _mm512_max_ps(m1, b);
        m2 = _mm512_max_ps(m2, c);
        m3 = _mm512_max_ps(m3, d);
    }
    float m = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(m0, m1), _mm512_max_ps(m2, m3)));
    int tail_nan = 0;
    for (; j < v; ++j) {
        if (r[j] != r[j]) tail_nan = 1;
        else if (r[j] > m) m = r[j];
    }
    *nan = un != 0 || tail_nan;
    return m;
}

/* the first index from which r[j] == m (or is a NaN, with nan): one exists */
static long first_at(const float *r, long v, float m, int nan) {
    const __m512 mv = _mm512_set1_ps(m);
    long j = 0;
    for (; j + 16 <= v; j += 16) {
        const __m512 a = _mm512_loadu_ps(r + j);
        const __mmask16 hit = nan ? _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q) : _mm512_cmp_ps_mask(a, mv, _CMP_EQ_OQ);
        if (hit) return j + __builtin_ctz(hit);
    }
    for (; j < v; ++j)
        if (nan ? r[j] != r[j] : r[j] == m) return j;
    return v - 1;
}
#else
static float row_max(const float *r, long v, int *nan) {
    float m = -INFINITY;
    *nan = 0;
    for (long j = 0; j < v; ++j) {
        if (r[j] != r[j]) *nan = 1;
        else if (r[j] > m) m = r[j];
    }
    return m;
}

static long first_at(const float *r, long v, float m, int nan) {
    for (long j = 0; j < v; ++j)
        if (nan ? r[j] != r[j] : r[j] == m) return j;
    return v - 1;
}
#endif

/* out[i] = the first maximal index of row i of x [n, v] (float32, rows contiguous). */
int ts_argmax_rows(const float *x, long n, long v, int64_t *out, int threads) {
    if (n < 0 || v < 1) return -1;
#pragma omp parallel for num_threads(n > 1 ? threads : 1) schedule(static)
    for (long i = 0; i < n; ++i) {
        const float *r = x + i * v;
        int nan;
        const float m = row_max(r, v, &nan);
        out[i] = first_at(r, v, m, nan);
    }
    return 0;
}
