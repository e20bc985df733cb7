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
 * torch's). A wave's scoring runs over spans of the draft vocabulary, the spans over the
 * threads: each span's logits for every parent (W2 read once a span for all of them), then
 * each parent's top-k, maximum and sum of exponentials there; then, a parent to a thread,
 * the spans' partials merged in span order. Each logit is the same chain of operations
 * whoever shares the wave, and the merge's order is fixed: a row's trees never depend on
 * the rows beside it, nor on the threads.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

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

/* row b's candidates scoring >= theta into order, best first (score desc, index asc);
 * returns how many of them a row of node_cap keeps (the first ones) */
static long ranked(const forest *f, long b, double theta, long node_cap, long *order) {
    const double *score = f->score + b * f->cap;
    long m = 0;
    for (long c = 1; c < f->size[b]; ++c)
        if (score[c] >= theta) order[m++] = c;
    rank_scores = score;
    qsort(order, (size_t)m, sizeof(long), by_score);
    return m < node_cap ? m : (node_cap > 0 ? node_cap : 0);
}

/* row b's nodes to open this wave, in kept order, appended to out; returns how many */
static long to_open(const forest *f, long b, double theta, long node_cap, long depth_limit, long *order,
                    long *out) {
    const long c0 = b * f->cap;
    const double *score = f->score + c0, *surv = f->survival + c0;
    const long top = ranked(f, b, theta, node_cap, order);
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

static int by_index(const void *x, const void *y) {
    const long i = *(const long *)x, j = *(const long *)y;
    return (i > j) - (i < j);
}

/* Each row's tree as Forest.finish makes it: the root and the top node_cap candidates
 * scoring >= theta (``ranked``, as to_open ranks them), in creation order; -3 where a kept
 * node's parent is not kept (the scores' running minimum rules it out). order and index
 * are scratch of cap entries each. */
static int finish(const forest *f, long R, const double *theta, const int64_t *node_cap, long *order, long *index,
                  int64_t *kept, int64_t *keep, int64_t *tree_parent) {
    for (long b = 0; b < R; ++b) {
        const long c0 = b * f->cap, n = f->size[b];
        const long top = ranked(f, b, theta[b], node_cap[b], order);
        qsort(order, (size_t)top, sizeof(long), by_index);
        for (long c = 0; c < n; ++c) index[c] = -1;
        keep[c0] = 0;
        tree_parent[c0] = -1;
        index[0] = 0;
        for (long j = 0; j < top; ++j) {
            const long c = order[j], p = f->parent[c0 + c];
            if (p < 0 || index[p] < 0) return -3;
            keep[c0 + j + 1] = c;
            tree_parent[c0 + j + 1] = index[p];
            index[c] = j + 1;
        }
        kept[b] = top + 1;
    }
    return 0;
}

/* The logits of P parents over a span [v0, v1) of the draft vocabulary (v0 a multiple
 * of VW), l[p * SPAN + v - v0] = W2 x_p + u_p. W2 comes in panels [ceil(Vd / VW), r, VW]
 * (VW draft tokens' weights at each rank, contiguous; the last panel padded with zeros): a
 * panel is read once for every parent while it sits in L1, into 4 parents x VW
 * accumulators held over the rank. Each logit is the same chain (fused multiply-adds
 * over the rank in order, then + u) whichever parents share its group. */
#define VW 32
#define SPAN 512   /* draft tokens a span takes (a multiple of VW): [P, SPAN] logits stay in cache */
static void logits_span(const float *const *u, const float *const *x, const float *w2p, long r, long P, long v0,
                        long v1, float *l) {
    for (long v = v0; v < v1; v += VW) {
        const float *panel = w2p + (v / VW) * r * VW;
        const int n = v1 - v < VW ? (int)(v1 - v) : VW;
        float *out = l + (v - v0);
        long p = 0;
        for (; p + 4 <= P; p += 4) {
            float acc[4][VW] = {{0.0f}};
            const float *x0 = x[p], *x1 = x[p + 1], *x2 = x[p + 2], *x3 = x[p + 3];
            for (long i = 0; i < r; ++i) {
                const float *w = panel + i * VW;
                const float a0 = x0[i], a1 = x1[i], a2 = x2[i], a3 = x3[i];
                for (int j = 0; j < VW; ++j) {
                    acc[0][j] = fmaf(a0, w[j], acc[0][j]);
                    acc[1][j] = fmaf(a1, w[j], acc[1][j]);
                    acc[2][j] = fmaf(a2, w[j], acc[2][j]);
                    acc[3][j] = fmaf(a3, w[j], acc[3][j]);
                }
            }
            for (int q = 0; q < 4; ++q)
                for (int j = 0; j < n; ++j) out[(p + q) * SPAN + j] = acc[q][j] + u[p + q][v + j];
        }
        for (; p < P; ++p) {
            float acc[VW] = {0.0f};
            const float *xp = x[p];
            for (long i = 0; i < r; ++i) {
                const float *w = panel + i * VW;
                const float a = xp[i];
                for (int j = 0; j < VW; ++j) acc[j] = fmaf(a, w[j], acc[j]);
            }
            for (int j = 0; j < n; ++j) out[p * SPAN + j] = acc[j] + u[p][v + j];
        }
    }
}

/* x into a descending top of at most k (values, ids; ties keep the earlier, so fed in
 * ascending id order the lower id wins); NaN never enters */
static inline void top_insert(float *top, int64_t *ids, long *n, long k, float x, int64_t id) {
    if ((*n == k && !(x > top[k - 1])) || x != x) return;
    long j = *n < k ? (*n)++ : k - 1;
    while (j > 0 && top[j - 1] < x) {
        top[j] = top[j - 1];
        ids[j] = ids[j - 1];
        --j;
    }
    top[j] = x;
    ids[j] = id;
}

/* A span's partial for one parent: its top k (ties to the lower id), the span's maximum
 * and its sum of e^(l - max) (l overwritten) */
typedef struct {
    float top[MAX_K];
    int64_t ids[MAX_K];
    long n;
    float max, sum;
} partial;

static void span_partial(float *l, long n, long v0, long k, partial *out) {
    out->n = 0;
    for (long v = 0; v < n; ++v) top_insert(out->top, out->ids, &out->n, k, l[v], v0 + v);
    out->max = out->n ? out->top[0] : -INFINITY;
    out->sum = out->n ? ts_exp_shift(l, n, out->max) : 0.0f;
}

/* A parent's k best draft indices and their q = e^(l - M) / S from its spans' partials,
 * merged in span order (the same numbers whatever the threads) */
static void merge_partials(const partial *parts, long spans, long stride, long k, int64_t *ids, double *qs) {
    float top[MAX_K], mx = -INFINITY;
    long n = 0;
    for (long s = 0; s < spans; ++s) {
        const partial *ps = parts + s * stride;
        if (ps->n && ps->max > mx) mx = ps->max;
        for (long j = 0; j < ps->n; ++j) top_insert(top, ids, &n, k, ps->top[j], ps->ids[j]);
    }
    double total = 0.0;
    for (long s = 0; s < spans; ++s) {
        const partial *ps = parts + s * stride;
        if (ps->n) total += (double)ps->sum * exp((double)ps->max - (double)mx);
    }
    const float lse = logf((float)total);
    for (long j = 0; j < k; ++j) qs[j] = j < n ? (double)expf((top[j] - mx) - lse) : 0.0;
}

/* Grow the forest of R rows at T = 0 to the end; returns the waves run (-1: a row
 * outgrew the arrays, -2: out of memory).
 * base [R, D, Vd]; w1 [V, r]; w2p W2's panels (logits_span); d2t [Vd] (NULL: identity);
 * per row: theta, node_cap, branch_cap, depth_limit (0: no drafting), the calibration's a
 * and b and its sibling offsets [R, noff] (rank j takes off[min(j, noff - 1)]); a node
 * offers at most top_m slots (the host's TOP_M). Then each row's tree (``Forest.finish``'s
 * rule): kept [R] its nodes, keep [R, cap] their candidates in creation order (the root and
 * the top node_cap scoring >= theta) and tree_parent [R, cap] each one's parent node. */
int ts_greedy_forest(const float *base, long D, long vd, const float *w1, long r, const float *w2p, const int64_t *d2t,
                     long R, const double *theta, const int64_t *node_cap, const int64_t *branch_cap,
                     const int64_t *depth_limit, const double *cal_a, const double *cal_b, const double *off,
                     long noff, double eps, long top_m, int64_t *parent, int64_t *draft_id, int64_t *token, double *q,
                     double *score, double *survival, int64_t *depth, uint8_t *opened, int64_t *size, long cap,
                     int64_t *kept, int64_t *keep, int64_t *tree_parent, int threads) {
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
        const long spans = (vd + SPAN - 1) / SPAN;
        partial *parts = malloc((size_t)spans * P * sizeof(partial));
        const float **u = malloc((size_t)P * sizeof(float *)), **x = malloc((size_t)P * sizeof(float *));
        if (!parts || !u || !x) {
            free(parts), free(u), free(x);
            err = -2;
            break;
        }
        for (long p = 0; p < P; ++p) {
            const long c = pair_row[p] * cap + pair_node[p];
            u[p] = base + (pair_row[p] * D + depth[c]) * vd;
            x[p] = w1 + token[c] * r;
        }
#pragma omp parallel num_threads(threads)
        {
            float *l = malloc((size_t)P * SPAN * sizeof(float));
#pragma omp for schedule(static)
            for (long t = 0; t < spans; ++t) {
                if (!l) continue;
                const long v0 = t * SPAN, v1 = v0 + SPAN < vd ? v0 + SPAN : vd;
                logits_span(u, x, w2p, r, P, v0, v1, l);
                for (long p = 0; p < P; ++p) {
                    const long k = branch_cap[pair_row[p]] < kmax ? branch_cap[pair_row[p]] : kmax;
                    span_partial(l + p * SPAN, v1 - v0, v0, k, parts + t * P + p);
                }
            }
            if (!l) {
#pragma omp atomic write
                err = -2;
            }
            free(l);
#pragma omp barrier
#pragma omp for schedule(static)
            for (long p = 0; p < P; ++p) {
                if (err) continue;
                const long k = branch_cap[pair_row[p]] < kmax ? branch_cap[pair_row[p]] : kmax;
                merge_partials(parts + p, spans, P, k, ids + p * MAX_K, qs + p * MAX_K);
            }
        }
        free(parts), free(u), free(x);
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
    if (!err) err = finish(&f, R, theta, node_cap, order, pair_row, kept, keep, tree_parent);
    free(order);
    free(pair_row);
    free(pair_node);
    free(ids);
    free(qs);
    return err ? err : waves;
}
