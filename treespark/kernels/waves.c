/* A round's greedy draft trees grown in one call: every depth wave of
 * treespark.spec.forest.Forest for rows at T = 0, with the drafter's scoring of each
 * opened node (treespark.spec.drafting.score_parents) and its slots
 * (treespark.spec.select.slot_table) in between.
 *
 * At one to a few rows a wave's arithmetic is small (a [Vd, r] product, a top-k and a
 * sum of exponentials a parent: ~0.1 ms over 8,192 draft tokens), and the ~100 numpy and
 * torch operators around it cost ~1 ms a wave on a two-core Xeon. Here a wave is:
 *
 *   to_open: each row's candidates ranked by (score desc, index), the root and the top
 *            node_cap scoring >= theta kept; a kept node is opened if it was not, lies
 *            above the depth limit, and its bound min(score, survival) is >= theta and
 *            beats the kept floor when the row is full;
 *   score:   logits = W2 W1[parent token] + U[row, depth]; the k = branch_cap largest
 *            (ties to the lower index) and q = exp(logit - max - log sum exp(. - max));
 *   open:    slot j's realized p_hat_j(q_j) (the row's calibration, sibling rank j),
 *            score = running min of (min(score, survival), survival * p_hat_j), children
 *            appended in order.
 *
 * The forest's arrays are the Python Forest's, written in place; the trees are its (to
 * float rounding of the logits: the product and the sum run in another order than
 * torch's). A wave's product reads each span of W2^T once for all its parents, the spans
 * over the threads; then the parents' top-k and sums, a parent to a thread. Each logit is
 * the same chain of operations whoever shares the wave: a row's trees never depend on the
 * rows beside it.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

float ts_exp_shift(float *s, long n, float top);   /* blocks.c: s = e^(s - top), their sum */

#define MAX_K 64

typedef struct {
    int64_t *parent, *draft_id, *token, *depth, *size;
    double *q, *score, *survival;
    uint8_t *opened;
    long cap;                                 /* candidates a row can hold */
} forest;

static double p_hat(double q, long rank, double a, double b, const double *off, long noff, double eps) {
    if (q < eps) q = eps;
    if (q > 1.0 - eps) q = 1.0 - eps;
    const double z = a * (log(q) - log1p(-q)) + b + off[rank < noff - 1 ? rank : noff - 1];
    return z > -700.0 ? 1.0 / (1.0 + exp(-z)) : 0.0;
}

/* candidates ranked by (score desc, index asc) */
static _Thread_local const double *rank_scores;  /* qsort's comparison reads them */
static int by_score(const void *x, const void *y) {
    const long i = *(const long *)x, j = *(const long *)y;
    const double si = rank_scores[i], sj = rank_scores[j];
    if (si != sj) return si > sj ? -1 : 1;
    return (i > j) - (i < j);
}

/* row b's nodes to open this wave, in kept order, appended to out; returns how many */
static long to_open(const forest *f, long b, double theta, long node_cap, long depth_limit, long *order,
                    long *out) {
    const long c0 = b * f->cap, n = f->size[b];
    const double *score = f->score + c0, *surv = f->survival + c0;
    long m = 0;
    for (long c = 1; c < n; ++c)
        if (score[c] >= theta) order[m++] = c;
    rank_scores = score;
    qsort(order, (size_t)m, sizeof(long), by_score);
    const long top = m < node_cap ? m : node_cap;
    const int full = top >= node_cap;
    const double floor = full && top > 0 ? score[order[top - 1]] : -INFINITY;
    long p = 0;
    for (long j = 0; j <= top; ++j) {
        const long c = j == 0 ? 0 : order[j - 1];
        const double bound = score[c] < surv[c] ? score[c] : surv[c];
        if (!f->opened[c0 + c] && f->depth[c0 + c] < depth_limit && bound >= theta && (!full || bound > floor))
            out[p++] = c;
    }
    return p;
}

/* the logits of P parents, l[p] = W2 x_p + u_p, over a span [v0, v1) of the draft
 * vocabulary: each span of W2^T is read once for every parent while it sits in cache */
static void logits_span(const float *const *u, const float *const *x, const float *w2t, long vd, long r, long P,
                        long v0, long v1, float *l) {
    for (long p = 0; p < P; ++p) {
        float *lp = l + p * vd;
        const float *xp = x[p];
        for (long v = v0; v < v1; ++v) lp[v] = 0.0f;
        long i = 0;
        for (; i + 4 <= r; i += 4) {
            const float x0 = xp[i], x1 = xp[i + 1], x2 = xp[i + 2], x3 = xp[i + 3];
            const float *a = w2t + i * vd, *b = a + vd, *c = b + vd, *d = c + vd;
            for (long v = v0; v < v1; ++v) lp[v] += x0 * a[v] + x1 * b[v] + x2 * c[v] + x3 * d[v];
        }
        for (; i < r; ++i) {
            const float xi = xp[i], *a = w2t + i * vd;
            for (long v = v0; v < v1; ++v) lp[v] += xi * a[v];
        }
        const float *up = u[p];
        for (long v = v0; v < v1; ++v) lp[v] += up[v];
    }
}

/* one parent's k best draft indices (ties to the lower index) and their q, from its logits
 * (overwritten) */
static void top_q(float *l, long vd, long k, int64_t *ids, double *qs) {
    float top[MAX_K];
    long n = 0;
    for (long v = 0; v < vd; ++v) {
        const float x = l[v];
        if (n == k && !(x > top[k - 1])) continue;
        if (x != x) continue;
        long j = n < k ? n++ : k - 1;
        while (j > 0 && top[j - 1] < x) {
            top[j] = top[j - 1];
            ids[j] = ids[j - 1];
            --j;
        }
        top[j] = x;
        ids[j] = v;
    }
    const float mx = top[0];
    const float lse = logf(ts_exp_shift(l, vd, mx));
    for (long j = 0; j < k; ++j) qs[j] = j < n ? (double)expf((top[j] - mx) - lse) : 0.0;
}

#define SPAN 512   /* draft tokens of W2^T a parent's logits take at a time (r x SPAN floats) */

/* Grow the forest of R rows at T = 0 to the end; returns the waves run (-1: a row
 * outgrew the arrays, -2: out of memory).
 * base [R, D, Vd]; w1 [V, r]; w2t [r, Vd] (W2 transposed); d2t [Vd] (NULL: identity);
 * per row: theta, node_cap, branch_cap, depth_limit (0: no drafting), the calibration's a
 * and b and its sibling offsets [R, noff] (rank j takes off[min(j, noff - 1)]); a node
 * offers at most top_m slots (the host's TOP_M). */
int ts_greedy_forest(const float *base, long D, long vd, const float *w1, long r, const float *w2t, const int64_t *d2t,
                     long R, const double *theta, const int64_t *node_cap, const int64_t *branch_cap,
                     const int64_t *depth_limit, const double *cal_a, const double *cal_b, const double *off,
                     long noff, double eps, long top_m, int64_t *parent, int64_t *draft_id, int64_t *token, double *q,
                     double *score, double *survival, int64_t *depth, uint8_t *opened, int64_t *size, long cap,
                     int threads) {
    forest f = {parent, draft_id, token, depth, size, q, score, survival, opened, cap};
    const long kmax = top_m < MAX_K ? (top_m < vd ? top_m : vd) : MAX_K;
    const size_t most = (size_t)(R * cap + 1);
    long *order = malloc((size_t)cap * sizeof(long));
    long *pair_row = malloc(most * sizeof(long));
    long *pair_node = malloc(most * sizeof(long));
    int64_t *ids = malloc(most * MAX_K * sizeof(int64_t));
    double *qs = malloc(most * MAX_K * sizeof(double));
    int waves = 0, err = (!order || !pair_row || !pair_node || !ids || !qs) ? -2 : 0;
    while (!err) {
        long P = 0;
        for (long b = 0; b < R; ++b) {
            if (node_cap[b] <= 0 || depth_limit[b] <= 0) continue;
            const long p = to_open(&f, b, theta[b], node_cap[b], depth_limit[b], order, pair_node + P);
            for (long i = 0; i < p; ++i) pair_row[P + i] = b;
            P += p;
        }
        if (P == 0) break;
        ++waves;
        float *l = malloc((size_t)P * vd * sizeof(float));
        const float **u = malloc((size_t)P * sizeof(float *)), **x = malloc((size_t)P * sizeof(float *));
        if (!l || !u || !x) {
            free(l), free(u), free(x);
            err = -2;
            break;
        }
        for (long p = 0; p < P; ++p) {
            const long c = pair_row[p] * cap + pair_node[p];
            u[p] = base + (pair_row[p] * D + depth[c]) * vd;
            x[p] = w1 + token[c] * r;
        }
        const long spans = (vd + SPAN - 1) / SPAN;
#pragma omp parallel num_threads(threads)
        {
#pragma omp for schedule(static)
            for (long t = 0; t < spans; ++t)
                logits_span(u, x, w2t, vd, r, P, t * SPAN, (t + 1) * SPAN < vd ? (t + 1) * SPAN : vd, l);
#pragma omp for schedule(static)
            for (long p = 0; p < P; ++p) {
                const long k = branch_cap[pair_row[p]] < kmax ? branch_cap[pair_row[p]] : kmax;
                top_q(l + p * vd, vd, k, ids + p * MAX_K, qs + p * MAX_K);
            }
        }
        free(l), free(u), free(x);
        for (long p = 0; p < P && !err; ++p) {
            const long b = pair_row[p], c0 = b * cap, c = c0 + pair_node[p];
            const long k = branch_cap[b] < kmax ? branch_cap[b] : kmax;
            long n = 0;
            while (n < k && qs[p * MAX_K + n] > 0) ++n;
            if (size[b] + n > cap) {
                err = -1;
                break;
            }
            opened[c] = 1;
            const double surv = survival[c];
            double run = score[c] < surv ? score[c] : surv;
            for (long j = 0; j < n; ++j) {
                const double qj = qs[p * MAX_K + j];
                const double ph = p_hat(qj, j, cal_a[b], cal_b[b], off + b * noff, noff, eps);
                const double s = surv * ph;
                if (s < run) run = s;
                const long at = c0 + size[b] + j;
                const int64_t id = ids[p * MAX_K + j];
                parent[at] = pair_node[p];
                draft_id[at] = id;
                token[at] = d2t ? d2t[id] : id;
                q[at] = qj;
                score[at] = run;
                survival[at] = surv * ph;
                depth[at] = depth[c] + 1;
            }
            size[b] += n;
        }
    }
    free(order);
    free(pair_row);
    free(pair_node);
    free(ids);
    free(qs);
    return err ? err : waves;
}
