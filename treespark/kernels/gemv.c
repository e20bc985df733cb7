/* Few-row matrix products for CPU decoding: y = x W^T (+ b), W streamed from memory once.
 *
 * x: [M, K] row-major, W: [N, K] row-major (an nn.Linear weight), b: [N] or NULL,
 * y: [M, N] row-major; float32. M is small (a decoding step's rows: 1 to a few), so the
 * product is bound by reading W: each block of 4 rows of W is loaded once and multiplied
 * by every row of x while it sits in L1, and the next block is prefetched a cache line at a
 * time while this one is read (the hardware prefetchers alone left a pass over the short
 * rows of a small model ~10 % slower). The N axis is split into contiguous halves (or
 * thirds, ...) over `threads` OpenMP threads: the same runtime as torch's own, whose
 * libgomp.so.1 is already loaded when this library is.
 *
 * Built on the machine that runs it (treespark/kernels/native.py: cc -O3 -march=native
 * -fopenmp); the AVX2 + FMA path where the compiler targets them, plain loops that the
 * compiler vectorises elsewhere. Sums run in another order than BLAS's: the same values
 * to float rounding.
 *
 * ts_gemv_bf16 takes W as bfloat16 (the upper halves of float32s): half the bytes to
 * read. Each weight widens to the float32 it stands for, exactly, and the sums run as in
 * ts_gemv, so for a float32 W whose values are bfloat16 values the two give the same y.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef uint16_t bf16;

/* weight i of row p as a float: float32 (half = 0) or bfloat16 (half = 1), exactly */
static inline float scalar_w(const void *p, long i, int half) {
    if (!half) return ((const float *)p)[i];
    uint32_t u = (uint32_t)((const bf16 *)p)[i] << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* weights i .. i+7 of row p as floats */
static inline __m256 load_w(const void *p, long i, int half) {
    if (!half) return _mm256_loadu_ps((const float *)p + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const bf16 *)p + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* the cache line at element k of each of the 4 rows (of K elements of es bytes) at p */
static inline void prefetch4(const char *p, long k, long K, size_t es) {
    _mm_prefetch(p + k * es, _MM_HINT_T0);
    _mm_prefetch(p + (K + k) * es, _MM_HINT_T0);
    _mm_prefetch(p + (2 * K + k) * es, _MM_HINT_T0);
    _mm_prefetch(p + (3 * K + k) * es, _MM_HINT_T0);
}

/* block4's pass over k, STEP at every 8 elements: while `ahead`, a cache line of each of the
 * next 4 rows prefetched before the line of these that STEP then reads; then the rest. */
#define K_LOOP(STEP)                                                                     \
    do {                                                                                 \
        while (ahead && k + line <= K) {                                                 \
            prefetch4(next, k, K, es);                                                   \
            for (const long e = k + line; k < e; k += 8) STEP                            \
        }                                                                                \
        for (; k + 8 <= K; k += 8) STEP                                                  \
    } while (0)

/* y[i, n + r] for r < 4 and i < g <= 2: rows n..n+3 of W against rows x[0..g); `ahead`:
 * prefetch the next 4 rows (the first pass over a block; past W's end a prefetch is a
 * no-op, it never faults). */
static inline void block4(const void *w, int half, const float *x, float *y, long n, long g, long K, long N,
                          int ahead) {
    const size_t es = half ? sizeof(bf16) : sizeof(float);
    const long line = 64 / es;  /* elements a cache line */
    const char *w0 = (const char *)w + (size_t)n * K * es, *w1 = w0 + K * es, *w2 = w1 + K * es, *w3 = w2 + K * es;
    const char *next = w0 + 4 * K * es;
    const float *x0 = x, *x1 = x + (g > 1 ? K : 0);
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a03 = a00;
    __m256 a10 = a00, a11 = a00, a12 = a00, a13 = a00;
    long k = 0;
    if (g > 1) {
#define STEP2                                                                            \
        {                                                                                \
            __m256 u = _mm256_loadu_ps(x0 + k), v = _mm256_loadu_ps(x1 + k);             \
            __m256 c0 = load_w(w0, k, half), c1 = load_w(w1, k, half);                   \
            __m256 c2 = load_w(w2, k, half), c3 = load_w(w3, k, half);                   \
            a00 = _mm256_fmadd_ps(c0, u, a00); a10 = _mm256_fmadd_ps(c0, v, a10);        \
            a01 = _mm256_fmadd_ps(c1, u, a01); a11 = _mm256_fmadd_ps(c1, v, a11);        \
            a02 = _mm256_fmadd_ps(c2, u, a02); a12 = _mm256_fmadd_ps(c2, v, a12);        \
            a03 = _mm256_fmadd_ps(c3, u, a03); a13 = _mm256_fmadd_ps(c3, v, a13);        \
        }
        K_LOOP(STEP2);
#undef STEP2
    } else {
#define STEP1                                                                            \
        {                                                                                \
            __m256 u = _mm256_loadu_ps(x0 + k);                                          \
            a00 = _mm256_fmadd_ps(load_w(w0, k, half), u, a00);                          \
            a01 = _mm256_fmadd_ps(load_w(w1, k, half), u, a01);                          \
            a02 = _mm256_fmadd_ps(load_w(w2, k, half), u, a02);                          \
            a03 = _mm256_fmadd_ps(load_w(w3, k, half), u, a03);                          \
        }
        K_LOOP(STEP1);
#undef STEP1
    }
#undef K_LOOP
    float s[2][4] = {{hsum(a00), hsum(a01), hsum(a02), hsum(a03)},
                     {hsum(a10), hsum(a11), hsum(a12), hsum(a13)}};
    for (; k < K; ++k) {
        const float c0 = scalar_w(w0, k, half), c1 = scalar_w(w1, k, half);
        const float c2 = scalar_w(w2, k, half), c3 = scalar_w(w3, k, half);
        for (long i = 0; i < g; ++i) {
            const float xi = x[i * K + k];
            s[i][0] += c0 * xi; s[i][1] += c1 * xi; s[i][2] += c2 * xi; s[i][3] += c3 * xi;
        }
    }
    for (long i = 0; i < g; ++i)
        for (long r = 0; r < 4; ++r) y[i * N + n + r] = s[i][r];
}

/* y[i, n] for i < g <= 2: one row of W. */
static inline void block1(const void *w, int half, const float *x, float *y, long n, long g, long K, long N) {
    const char *w0 = (const char *)w + (size_t)n * K * (half ? sizeof(bf16) : sizeof(float));
    for (long i = 0; i < g; ++i) {
        const float *xi = x + i * K;
        __m256 a = _mm256_setzero_ps();
        long k = 0;
        for (; k + 8 <= K; k += 8) a = _mm256_fmadd_ps(load_w(w0, k, half), _mm256_loadu_ps(xi + k), a);
        float s = hsum(a);
        for (; k < K; ++k) s += scalar_w(w0, k, half) * xi[k];
        y[i * N + n] = s;
    }
}

#else

static inline void block_rows(const void *w, int half, const float *x, float *y, long n, long rows, long g,
                              long K, long N) {
    for (long r = 0; r < rows; ++r) {
        const long row = (n + r) * K;
        for (long i = 0; i < g; ++i) {
            const float *xi = x + i * K;
            float s = 0.0f;
#pragma omp simd reduction(+ : s)
            for (long k = 0; k < K; ++k) s += scalar_w(w, row + k, half) * xi[k];
            y[i * N + n + r] = s;
        }
    }
}
static inline void block4(const void *w, int half, const float *x, float *y, long n, long g, long K, long N,
                          int ahead) {
    (void)ahead;
    block_rows(w, half, x, y, n, 4, g, K, N);
}
static inline void block1(const void *w, int half, const float *x, float *y, long n, long g, long K, long N) {
    block_rows(w, half, x, y, n, 1, g, K, N);
}

#endif

/* The whole product over W's 4-row blocks; HALF a literal 0 or 1, so that each entry
 * point's loop is compiled for its weight type alone. */
#define PRODUCT(HALF)                                                                     \
    do {                                                                                  \
        if (M < 1 || N < 1 || K < 1 || threads < 1) return -1;                            \
        const long blocks = (N + 3) / 4;                                                  \
        const int nt = (N * K >= (1L << 16)) ? threads : 1; /* small products: no fork */ \
        _Pragma("omp parallel for num_threads(nt) schedule(static)")                      \
        for (long j = 0; j < blocks; ++j) {                                               \
            const long n = 4 * j;                                                         \
            for (long i = 0; i < M; i += 2) {                                             \
                const long g = (M - i) < 2 ? (M - i) : 2;                                 \
                if (n + 4 <= N) {                                                         \
                    block4(w, HALF, x + i * K, y + i * N, n, g, K, N, i == 0);            \
                } else {                                                                  \
                    for (long r = n; r < N; ++r) block1(w, HALF, x + i * K, y + i * N, r, g, K, N); \
                }                                                                         \
            }                                                                             \
            if (b) {                                                                      \
                const long hi = n + 4 <= N ? n + 4 : N;                                   \
                for (long i = 0; i < M; ++i)                                              \
                    for (long r = n; r < hi; ++r) y[i * N + r] += b[r];                   \
            }                                                                             \
        }                                                                                 \
        return 0;                                                                         \
    } while (0)

/* y = x W^T (+ b), W float32; returns 0, or -1 for shapes it does not take. */
int ts_gemv(const float *x, const float *w, const float *b, float *y, long M, long N, long K, int threads) {
    PRODUCT(0);
}

/* y = x W^T (+ b), W bfloat16; returns 0, or -1 for shapes it does not take. */
int ts_gemv_bf16(const float *x, const bf16 *w, const float *b, float *y, long M, long N, long K, int threads) {
    PRODUCT(1);
}
