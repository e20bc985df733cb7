/* Few-row matrix products for CPU decoding: y = x W^T (+ b), W streamed from memory once.
 *
 * x: [M, K] row-major, b: [N] or NULL, y: [M, N] row-major; float32. M is small (a
 * decoding step's rows: 1 to 16), so a product is bound by reading W, once. The N axis is
 * split into contiguous parts over `threads` OpenMP threads: the same runtime as torch's
 * own, whose libgomp.so.1 is already loaded when this library is.
 *
 * ts_gemv takes a float32 W [N, K] row-major (an nn.Linear weight): each block of 4 rows
 * of W is loaded once and multiplied by every row of x, two at a time, while it sits in
 * L1 (a dot product per output, its 8 lanes summed at the end), and the next block is
 * prefetched a cache line at a time while this one is read (the hardware prefetchers alone
 * left a pass over the short rows of a small model ~10 % slower).
 *
 * ts_gemv_panels takes W as bfloat16 (the upper halves of float32s: half the bytes) in
 * panels of 16 rows (treespark/kernels/native.py: to_panels). Panel j holds rows
 * 16j..16j+15, k-major: the 16 weights of one k are 8 32-bit words, word c holding row
 * 16j+c in its low half and row 16j+8+c in its high half, so one 32-byte load, a shift and
 * a mask give both rows' 8 weights as the floats they stand for, exactly, and a panel is
 * one sequential stream. Each weight vector multiplies x[i, k], broadcast, for 4 rows of x
 * at a time (8 accumulators), which keeps both FMA pipes busy where the dot-product form
 * above runs them at ~0.4: on a two-core Zen 3, a pass over 4 rows costs what one row's
 * does (the read of the weights), over 8 rows 1.6x and 16 rows 2.7x one row's, against
 * 1.3x, 2.1x and 3.7x for the dot-product form on the same bfloat16 weights. Where the
 * compiler targets AVX-512, the 16 weights are one vector (one FMA a row) and a pass takes
 * 8 rows: on a two-core AVX-512 Xeon a pass over the default target's layers at 6 / 8 / 16
 * rows took 0.58 / 0.64 / 0.62 of the AVX2 form's time, the same floats. Where the CPU has
 * AMX and the OS lets the process use it, the panels are laid out for its tiles instead
 * (ts_tiles, gemv_tiles below): any M, x split exactly into three bfloat16 parts.
 *
 * Built on the machine that runs it (treespark/kernels/native.py: cc -O3 -march=native
 * -fopenmp); the AVX2 + FMA path where the compiler targets them, plain loops that the
 * compiler vectorises elsewhere. Sums run in another order than BLAS's: the same values
 * to float rounding. Each output's sum runs over k in an order fixed by K alone, so a
 * row's values do not depend on the other rows.
 */
#define _GNU_SOURCE   /* syscall(), for the tile permission */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef uint16_t bf16;

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* the cache line at element k of each of the 4 rows (of K floats) at p */
static inline void prefetch4(const char *p, long k, long K) {
    _mm_prefetch(p + k * 4, _MM_HINT_T0);
    _mm_prefetch(p + (K + k) * 4, _MM_HINT_T0);
    _mm_prefetch(p + (2 * K + k) * 4, _MM_HINT_T0);
    _mm_prefetch(p + (3 * K + k) * 4, _MM_HINT_T0);
}

/* block4's pass over k, STEP at every 8 elements: while `ahead`, a cache line of each of the
 * next 4 rows prefetched before the line of these that STEP then reads; then the rest. */
#define K_LOOP(STEP)                                                                     \
    do {                                                                                 \
        while (ahead && k + 16 <= K) {                                                   \
            prefetch4(next, k, K);                                                       \
            for (const long e = k + 16; k < e; k += 8) STEP                              \
        }                                                                                \
        for (; k + 8 <= K; k += 8) STEP                                                  \
    } while (0)

/* y[i, n + r] for r < 4 and i < g <= 2: rows n..n+3 of W against rows x[0..g); `ahead`:
 * prefetch the next 4 rows (the first pass over a block; past W's end a prefetch is a
 * no-op, it never faults). */
static inline void block4(const float *w, const float *x, float *y, long n, long g, long K, long N, int ahead) {
    const float *w0 = w + (size_t)n * K, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
    const char *next = (const char *)(w0 + 4 * K);
    const float *x0 = x, *x1 = x + (g > 1 ? K : 0);
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a03 = a00;
    __m256 a10 = a00, a11 = a00, a12 = a00, a13 = a00;
    long k = 0;
    if (g > 1) {
#define STEP2                                                                            \
        {                                                                                \
            __m256 u = _mm256_loadu_ps(x0 + k), v = _mm256_loadu_ps(x1 + k);             \
            __m256 c0 = _mm256_loadu_ps(w0 + k), c1 = _mm256_loadu_ps(w1 + k);           \
            __m256 c2 = _mm256_loadu_ps(w2 + k), c3 = _mm256_loadu_ps(w3 + k);           \
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
            a00 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + k), u, a00);                      \
            a01 = _mm256_fmadd_ps(_mm256_loadu_ps(w1 + k), u, a01);                      \
            a02 = _mm256_fmadd_ps(_mm256_loadu_ps(w2 + k), u, a02);                      \
            a03 = _mm256_fmadd_ps(_mm256_loadu_ps(w3 + k), u, a03);                      \
        }
        K_LOOP(STEP1);
#undef STEP1
    }
#undef K_LOOP
    float s[2][4] = {{hsum(a00), hsum(a01), hsum(a02), hsum(a03)},
                     {hsum(a10), hsum(a11), hsum(a12), hsum(a13)}};
    for (; k < K; ++k) {
        const float c0 = w0[k], c1 = w1[k], c2 = w2[k], c3 = w3[k];
        for (long i = 0; i < g; ++i) {
            const float xi = x[i * K + k];
            s[i][0] += c0 * xi; s[i][1] += c1 * xi; s[i][2] += c2 * xi; s[i][3] += c3 * xi;
        }
    }
    for (long i = 0; i < g; ++i)
        for (long r = 0; r < 4; ++r) y[i * N + n + r] = s[i][r];
}

/* y[i, n] for i < g <= 2: one row of W. */
static inline void block1(const float *w, const float *x, float *y, long n, long g, long K, long N) {
    const float *w0 = w + (size_t)n * K;
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

/* y[i, 16j + c] for i < R, c < 16: panel p (16 K bfloat16s) against rows x[0..R); `ahead`:
 * prefetch the next panel a cache line (two k) at a time (past W's end: a no-op) */
#define PANEL(R)                                                                          \
    static inline void panel##R(const bf16 *p, const float *x, float *y, long K, long N, int ahead) { \
        const uint32_t *q = (const uint32_t *)p;                                          \
        const __m256i high = _mm256_set1_epi32((int)0xFFFF0000u);                         \
        __m256 lo[R], hi[R];                                                              \
        for (int i = 0; i < R; ++i) lo[i] = hi[i] = _mm256_setzero_ps();                  \
        for (long k = 0; k < K; ++k) {                                                    \
            if (ahead && !(k & 1)) _mm_prefetch((const char *)(q + 8 * (K + k)), _MM_HINT_T0); \
            const __m256i v = _mm256_loadu_si256((const __m256i *)(q + 8 * k));           \
            const __m256 wl = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));              \
            const __m256 wh = _mm256_castsi256_ps(_mm256_and_si256(v, high));             \
            _Pragma("GCC unroll 4")                                                       \
            for (int i = 0; i < R; ++i) {                                                 \
                const __m256 xb = _mm256_broadcast_ss(x + i * K + k);                     \
                lo[i] = _mm256_fmadd_ps(wl, xb, lo[i]);                                   \
                hi[i] = _mm256_fmadd_ps(wh, xb, hi[i]);                                   \
            }                                                                             \
        }                                                                                 \
        for (int i = 0; i < R; ++i) {                                                     \
            _mm256_storeu_ps(y + i * N, lo[i]);                                           \
            _mm256_storeu_ps(y + i * N + 8, hi[i]);                                       \
        }                                                                                 \
    }
#if defined(__AVX512F__)
/* AVX-512: the panel's 16 weights of one k as one 16-float vector (rows 0..7 from the low
 * halves, 8..15 from the high ones: the order they are stored out in), one FMA a row where
 * AVX2 takes two, and 8 rows a pass (8 accumulators). Each output's sum is the same chain
 * of FMAs over k as above, so the same floats. */
#define PANEL_ROWS 8
#define PANEL512(R)                                                                       \
    static inline void panel##R(const bf16 *p, const float *x, float *y, long K, long N, int ahead) { \
        const uint32_t *q = (const uint32_t *)p;                                          \
        const __m256i high = _mm256_set1_epi32((int)0xFFFF0000u);                         \
        __m512 acc[R];                                                                    \
        for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();                         \
        for (long k = 0; k < K; ++k) {                                                    \
            if (ahead && !(k & 1)) _mm_prefetch((const char *)(q + 8 * (K + k)), _MM_HINT_T0); \
            const __m256i v = _mm256_loadu_si256((const __m256i *)(q + 8 * k));           \
            const __m256d wl = _mm256_castsi256_pd(_mm256_slli_epi32(v, 16));             \
            const __m256d wh = _mm256_castsi256_pd(_mm256_and_si256(v, high));            \
            const __m512 w = _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(wl), wh, 1)); \
            _Pragma("GCC unroll 8")                                                       \
            for (int i = 0; i < R; ++i)                                                   \
                acc[i] = _mm512_fmadd_ps(w, _mm512_set1_ps(x[i * K + k]), acc[i]);        \
        }                                                                                 \
        for (int i = 0; i < R; ++i) _mm512_storeu_ps(y + i * N, acc[i]);                  \
    }
#undef PANEL
#define PANEL PANEL512
#else
#define PANEL_ROWS 4
#endif
PANEL(1)
PANEL(2)
PANEL(3)
PANEL(4)
#if PANEL_ROWS == 8
PANEL(5)
PANEL(6)
PANEL(7)
PANEL(8)
#endif
#undef PANEL

#else

#define PANEL_ROWS 4

static inline void block4(const float *w, const float *x, float *y, long n, long g, long K, long N, int ahead) {
    (void)ahead;
    for (long r = 0; r < 4; ++r)
        for (long i = 0; i < g; ++i) {
            const float *wr = w + (n + r) * K, *xi = x + i * K;
            float s = 0.0f;
#pragma omp simd reduction(+ : s)
            for (long k = 0; k < K; ++k) s += wr[k] * xi[k];
            y[i * N + n + r] = s;
        }
}
static inline void block1(const float *w, const float *x, float *y, long n, long g, long K, long N) {
    for (long i = 0; i < g; ++i) {
        const float *wr = w + n * K, *xi = x + i * K;
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (long k = 0; k < K; ++k) s += wr[k] * xi[k];
        y[i * N + n] = s;
    }
}

/* the float a bfloat16 stands for, exactly */
static inline float widen(bf16 h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* the AVX2 panels' sums in the same order: over k, one accumulator an output */
#define PANEL(R)                                                                          \
    static inline void panel##R(const bf16 *p, const float *x, float *y, long K, long N, int ahead) { \
        (void)ahead;                                                                      \
        float acc[R][16] = {{0}};                                                         \
        for (long k = 0; k < K; ++k)                                                      \
            for (int c = 0; c < 8; ++c) {                                                 \
                const float wl = widen(p[16 * k + 2 * c]), wh = widen(p[16 * k + 2 * c + 1]); \
                for (int i = 0; i < R; ++i) {                                             \
                    acc[i][c] += wl * x[i * K + k];                                       \
                    acc[i][8 + c] += wh * x[i * K + k];                                   \
                }                                                                         \
            }                                                                             \
        for (int i = 0; i < R; ++i) memcpy(y + i * N, acc[i], sizeof acc[i]);             \
    }
PANEL(1)
PANEL(2)
PANEL(3)
PANEL(4)
#undef PANEL

#endif

#define FORK(work) ((work) >= (1L << 16)) /* small products: no fork */

/* y = x W^T (+ b), W float32 [N, K]; returns 0, or -1 for shapes it does not take. */
int ts_gemv(const float *x, const float *w, const float *b, float *y, long M, long N, long K, int threads) {
    if (M < 1 || N < 1 || K < 1 || threads < 1) return -1;
    const long blocks = (N + 3) / 4;
    const int nt = FORK(N * K) ? threads : 1;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (long j = 0; j < blocks; ++j) {
        const long n = 4 * j;
        for (long i = 0; i < M; i += 2) {
            const long g = (M - i) < 2 ? (M - i) : 2;
            if (n + 4 <= N) {
                block4(w, x + i * K, y + i * N, n, g, K, N, i == 0);
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

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
#include <sys/syscall.h>
#include "tiles.h"
#include <unistd.h>
#define TILES 1
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#endif

/* Whether the bfloat16 panels are AMX tiles here: 1 once the kernel lets this process use
 * the tile registers (Linux: one arch_prctl a process), 0 where it does not or this build has
 * no AMX. ts_tiles() asks the kernel on its first call (treespark/kernels/native.py makes it
 * when it loads the library, before any product); ts_panel_tiles(K): whether a weight of K
 * columns is laid out as tiles (native.py: to_panels), the one rule both sides follow. */
static int tiles_on = 0;

int ts_tiles(void) {
#if defined(TILES)
    static int asked = 0;
    if (!asked) {
        asked = 1;
        tiles_on = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    }
#endif
    return tiles_on;
}

int ts_panel_tiles(long K) { return tiles_on && K % 32 == 0; }

#if defined(TILES)
/* The tile form of the bfloat16 panels: panel j (rows 16j..16j+15) holds K/2 pairs of k,
 * each as 16 32-bit words, word c the weights of row 16j+c at k = 2p (low half) and 2p + 1
 * (high half): AMX's layout for a B tile, 16 pairs (32 k) of one panel being one 1 KiB load.
 * x is split exactly into three bfloat16 parts, x = hi + mid + lo (each the top 16 bits of
 * what the ones before leave: 8 + 8 + 8 significant bits hold a float's 24), and TDPBF16PS
 * multiplies each part by the weights exactly (8 by 8 bits) into float32 sums. So a row's
 * outputs are the float32 products of the panels' weights and x, summed in float32 in an
 * order fixed by K alone (gemv_tiles), the same at any M: a row's values never depend on
 * the other rows. The tile unit multiplies 16 rows in about the time of one, so a pass over
 * the weights costs about the read of them up to 16 rows (a two-core AMX Xeon, the default
 * target: 12.3-14.5 ms a pass at 1-16 rows, against 19.1-51.9 for the float32 weights on
 * ts_gemv); past 16 rows it is bound by the tile loads, ~2-2.6x oneDNN's packed float32
 * there (treespark bench linear). */
/* tmm0 .. tmm3: four panels' sums [M, 16]; tmm4 .. tmm6: x's hi, mid and lo parts, 32 k
 * of M rows; tmm7: a panel's 32 k */
static void configure(long M) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; ++t) {
        c.colsb[t] = 64;
        c.rows[t] = t < 7 ? (uint8_t)M : 16;
    }
    _tile_loadconfig(&c);
}

/* x's three bfloat16 parts (the upper halves of hi, mid and lo) as A tiles: xs[group][k / 32]
 * [part] is a G x 32 tile, its rows 64 bytes apart (one contiguous KiB at G = 16); rows past
 * M left as they are (zeros) */
static void split3(const float *x, bf16 *xs, long M, long K, long G) {
    for (long i = 0; i < M; ++i)
        for (long k = 0; k < K; k += 16) {
            __m512 parts[3];
            split3v(_mm512_loadu_ps(x + i * K + k), parts);
            bf16 *at = xs + (((i / G) * (K / 32) + k / 32) * 3 * G + i % G) * 32 + k % 32;
            for (int p = 0; p < 3; ++p) _mm256_storeu_si256((__m256i *)(at + p * G * 32), bf16_bits(parts[p]));
        }
}

/* panel t's 32 k at k (tile register T), times x's three parts into sum tile T */
#define PART_SUMS(T, t)                                                                       \
    do {                                                                                      \
        _tile_loadd(7, wp + (t) * 32 * K + 32 * k, 64);                                       \
        _tile_dpbf16ps(T, 4, 7);                                                              \
        _tile_dpbf16ps(T, 5, 7);                                                              \
        _tile_dpbf16ps(T, 6, 7);                                                              \
    } while (0)

/* y[r .. r + G, n .. n + 16) (+ b) from the sum tile s of rows r.., storing straight into y
 * where the group is whole and there is no bias */
#define PUT(T, t)                                                                             \
    do {                                                                                      \
        float *yt = y + r * N + n0 + 16 * (t);                                                \
        if (direct) {                                                                         \
            _tile_stored(T, yt, N * 4);                                                       \
        } else {                                                                              \
            _tile_stored(T, s, 64);                                                           \
            for (long i = 0; i < G && r + i < M; ++i)                                         \
                for (long c = 0; c < 16; ++c) yt[i * N + c] = s[16 * i + c] + (b ? b[n0 + 16 * (t) + c] : 0.0f); \
        }                                                                                     \
    } while (0)

/* y = x W^T (+ b) on the tile form, M rows: up to 16 in one group of exactly M rows; more
 * in groups of 16 (x padded with zero rows to a multiple of 16, their sums dropped). Four
 * panels (64 outputs) at a time, each group of rows in turn while their weights sit in L2:
 * a step of 32 k loads x's three parts once for the four panels (7 tile loads for 12
 * products, where two panels took 5 for 6). Each output is one float32 sum over k, 32 k a
 * step, x's hi, mid then lo parts in each: the same chain at any M. Past 16 rows the rows
 * go in blocks whose parts fit L2 (a prefill's 256 rows at K = 1536 take 2.4 MB: read from
 * L3 by every pass over the weights, the product ran at ~0.7 of its rate). Past 16 rows a
 * step's products run at about half the tile unit's rate: both operands come from L2
 * (neither a group's parts nor four panels' weights fit L1; slicing k so that the weights
 * do, or prefetching, did not help). */
static int gemv_tiles(const float *x, const bf16 *w, const float *b, float *y, long M, long N, long K, int nt) {
    const long G = M <= 16 ? M : 16, Mp = (M + G - 1) / G * G;   /* rows a group, rows padded */
    bf16 *xs = (bf16 *)calloc((size_t)(3 * Mp * K), sizeof(bf16));
    if (!xs) return -1;
    split3(x, xs, M, K, G);
    const long panels = N / 16, quads = (panels + 3) / 4, tile = G * 32;   /* bfloat16s an A tile */
    /* rows a block: their parts (6 bytes a k) within ~1 MiB */
    const long rows = Mp <= G ? Mp : (1L << 20) / (6 * K * G) > 1 ? (1L << 20) / (6 * K * G) * G : G;
#pragma omp parallel num_threads(nt)
    {
        configure(G);
        float s[256];
        for (long r0 = 0; r0 < Mp; r0 += rows) {
#pragma omp for schedule(static)
            for (long j = 0; j < quads; ++j) {
                const long n0 = 64 * j, np = panels - 4 * j < 4 ? panels - 4 * j : 4;
                const char *wp = (const char *)(w + (size_t)n0 * K);
                for (long r = r0; r < Mp && r < r0 + rows; r += G) {
                    const bf16 *a = xs + r * K * 3;   /* the group's tiles, 3 a step of k */
                    const int direct = !b && r + G <= M;
                    _tile_zero(0);
                    _tile_zero(1);
                    _tile_zero(2);
                    _tile_zero(3);
                    for (long k = 0; k < K; k += 32) {
                        const bf16 *ak = a + 3 * k / 32 * tile;
                        _tile_loadd(4, ak, 64);
                        _tile_loadd(5, ak + tile, 64);
                        _tile_loadd(6, ak + 2 * tile, 64);
                        PART_SUMS(0, 0);
                        if (np > 1) PART_SUMS(1, 1);
                        if (np > 2) PART_SUMS(2, 2);
                        if (np > 3) PART_SUMS(3, 3);
                    }
                    PUT(0, 0);
                    if (np > 1) PUT(1, 1);
                    if (np > 2) PUT(2, 2);
                    if (np > 3) PUT(3, 3);
                }
            }
        }
        _tile_release();
    }
    free(xs);
    return 0;
}
#undef PART_SUMS
#undef PUT
#endif

/* y = x W^T (+ b), W bfloat16 [N, K] in panels of 16 rows (N a multiple of 16; their tile
 * form where ts_panel_tiles(K)); returns 0, or -1 for shapes it does not take. */
int ts_gemv_panels(const float *x, const bf16 *w, const float *b, float *y, long M, long N, long K, int threads) {
    if (M < 1 || N < 16 || N % 16 || K < 1 || threads < 1) return -1;
#if defined(TILES)
    if (ts_panel_tiles(K)) return gemv_tiles(x, w, b, y, M, N, K, FORK(M * N * K) ? threads : 1);
#endif
    const long panels = N / 16;
    const int nt = FORK(N * K) ? threads : 1;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (long j = 0; j < panels; ++j) {
        const bf16 *p = w + (size_t)j * 16 * K;
        /* the rows in ceil(M / PANEL_ROWS) groups of as even sizes as can be (5 = 3 + 2, not
         * 4 + 1): a group's pass over the panel is a chain of FMAs per accumulator */
        const long groups = (M + PANEL_ROWS - 1) / PANEL_ROWS;
        for (long g = 0, i = 0; g < groups; ++g) {
            const long r = M / groups + (g < M % groups);
            const float *xi = x + i * K;
            float *yi = y + i * N + 16 * j;
            const int ahead = i == 0;   /* the first pass prefetches the next panel */
            i += r;
            switch (r) {
                case 1: panel1(p, xi, yi, K, N, ahead); break;
                case 2: panel2(p, xi, yi, K, N, ahead); break;
                case 3: panel3(p, xi, yi, K, N, ahead); break;
#if PANEL_ROWS == 8
                case 4: panel4(p, xi, yi, K, N, ahead); break;
                case 5: panel5(p, xi, yi, K, N, ahead); break;
                case 6: panel6(p, xi, yi, K, N, ahead); break;
                case 7: panel7(p, xi, yi, K, N, ahead); break;
                default: panel8(p, xi, yi, K, N, ahead);
#else
                default: panel4(p, xi, yi, K, N, ahead);
#endif
            }
        }
        if (b)
            for (long i = 0; i < M; ++i)
                for (long c = 0; c < 16; ++c) y[i * N + 16 * j + c] += b[16 * j + c];
    }
    return 0;
}
