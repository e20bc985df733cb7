/* Few-row matrix products for CPU decoding: y = x W^T (+ b), W streamed from memory once.
 *
 * x: [M, K] row-major, W: [N, K] row-major (an nn.Linear weight), b: [N] or NULL,
 * y: [M, N] row-major; float32. M is small (a decoding step's rows: 1 to a few), so the
 * product is bound by reading W: each block of 4 rows of W is loaded once and multiplied
 * by every row of x while it sits in L1. The N axis is split into contiguous halves (or
 * thirds, ...) over `threads` OpenMP threads: the same runtime as torch's own, whose
 * libgomp.so.1 is already loaded when this library is.
 *
 * Built on the machine that runs it (treespark/kernels/native.py: cc -O3 -march=native
 * -fopenmp); the AVX2 + FMA path where the compiler targets them, plain loops that the
 * compiler vectorises elsewhere. Sums run in another order than BLAS's: the same values
 * to float rounding.
 */
#include <stddef.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* y[i, n + r] for r < 4 and i < g <= 2: rows n..n+3 of W against rows x[0..g). */
static inline void block4(const float *w, const float *x, float *y, long n, long g, long K, long N) {
    const float *w0 = w + n * K, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
    const float *x0 = x, *x1 = x + (g > 1 ? K : 0);
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a03 = a00;
    __m256 a10 = a00, a11 = a00, a12 = a00, a13 = a00;
    long k = 0;
    if (g > 1) {
        for (; k + 8 <= K; k += 8) {
            __m256 u = _mm256_loadu_ps(x0 + k), v = _mm256_loadu_ps(x1 + k);
            __m256 c0 = _mm256_loadu_ps(w0 + k), c1 = _mm256_loadu_ps(w1 + k);
            __m256 c2 = _mm256_loadu_ps(w2 + k), c3 = _mm256_loadu_ps(w3 + k);
            a00 = _mm256_fmadd_ps(c0, u, a00); a10 = _mm256_fmadd_ps(c0, v, a10);
            a01 = _mm256_fmadd_ps(c1, u, a01); a11 = _mm256_fmadd_ps(c1, v, a11);
            a02 = _mm256_fmadd_ps(c2, u, a02); a12 = _mm256_fmadd_ps(c2, v, a12);
            a03 = _mm256_fmadd_ps(c3, u, a03); a13 = _mm256_fmadd_ps(c3, v, a13);
        }
    } else {
        for (; k + 8 <= K; k += 8) {
            __m256 u = _mm256_loadu_ps(x0 + k);
            a00 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + k), u, a00);
            a01 = _mm256_fmadd_ps(_mm256_loadu_ps(w1 + k), u, a01);
            a02 = _mm256_fmadd_ps(_mm256_loadu_ps(w2 + k), u, a02);
            a03 = _mm256_fmadd_ps(_mm256_loadu_ps(w3 + k), u, a03);
        }
    }
    float s[2][4] = {{hsum(a00), hsum(a01), hsum(a02), hsum(a03)},
                     {hsum(a10), hsum(a11), hsum(a12), hsum(a13)}};
    for (; k < K; ++k) {
        for (long i = 0; i < g; ++i) {
            const float xi = x[i * K + k];
            s[i][0] += w0[k] * xi; s[i][1] += w1[k] * xi; s[i][2] += w2[k] * xi; s[i][3] += w3[k] * xi;
        }
    }
    for (long i = 0; i < g; ++i)
        for (long r = 0; r < 4; ++r) y[i * N + n + r] = s[i][r];
}

/* y[i, n] for i < g <= 2: one row of W. */
static inline void block1(const float *w, const float *x, float *y, long n, long g, long K, long N) {
    const float *w0 = w + n * K;
    for (long i = 0; i < g; ++i) {
        const float *xi = x + i * K;
        __m256 a = _mm256_setzero_ps();
        long k = 0;
        for (; k + 8 <= K; k += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + k), _mm256_loadu_ps(xi + k), a);
        float s = hsum(a);
        for (; k < K; ++k) s += w0[k] * xi[k];
        y[i * N + n] = s;
    }
}

#else

static inline void block_rows(const float *w, const float *x, float *y, long n, long rows, long g,
                              long K, long N) {
    for (long r = 0; r < rows; ++r) {
        const float *wr = w + (n + r) * K;
        for (long i = 0; i < g; ++i) {
            const float *xi = x + i * K;
            float s = 0.0f;
#pragma omp simd reduction(+ : s)
            for (long k = 0; k < K; ++k) s += wr[k] * xi[k];
            y[i * N + n + r] = s;
        }
    }
}
static inline void block4(const float *w, const float *x, float *y, long n, long g, long K, long N) {
    block_rows(w, x, y, n, 4, g, K, N);
}
static inline void block1(const float *w, const float *x, float *y, long n, long g, long K, long N) {
    block_rows(w, x, y, n, 1, g, K, N);
}

#endif

/* The whole product; returns 0, or -1 for shapes it does not take. */
int ts_gemv(const float *x, const float *w, const float *b, float *y, long M, long N, long K, int threads) {
    if (M < 1 || N < 1 || K < 1 || threads < 1) return -1;
    const long blocks = (N + 3) / 4;
    const int nt = (N * K >= (1L << 16)) ? threads : 1;   /* small products: no fork */
#pragma omp parallel for num_threads(nt) schedule(static)
    for (long j = 0; j < blocks; ++j) {
        const long n = 4 * j;
        for (long i = 0; i < M; i += 2) {
            const long g = (M - i) < 2 ? (M - i) : 2;
            if (n + 4 <= N) {
                block4(w, x + i * K, y + i * N, n, g, K, N);
            } else {
                for (long r = n; r < N; ++r) block1(w, x + i * K, y + i * N, r, g, K, N);
            }
        }
        if (b) {
            const long hi = n + 4 <= N ? n + 4 : N;
            for (long i = 0; i < M; ++i)
                for (long r = n; r < hi; ++r) y[i * N + r] += b[r];
        }
    }
    return 0;
}
