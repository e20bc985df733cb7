/* The per-step allocation's argmax over (kappa, B) in one call: treespark.pricing.allocate's
 * ``best_allocation`` (numpy), the same arithmetic in the same order, so the same doubles.
 *
 * The candidates (each row's first lens[r] scores, those >= floor) are ranked by score
 * descending, then row, then index (numpy's lexsort); a candidate's rank within its row
 * counts the row's candidates before it. For every pad kappa = 1 .. the most a row holds
 * and every prefix m of the ranking, the goodput of taking the prefix's candidates of
 * rank < kappa is
 *
 *     (bs + sum of their scores) / (((draft_s + fixed[kappa]) + t[pad]) + node_s * taken)
 *
 * with the sum accumulated from 0 in rank order (numpy's cumsum) and pad the prefix's
 * largest rank + 1, at most kappa; the first maximum in (kappa, m) order wins, as
 * np.argmax's does. ISO C (-std=c11): no contraction into FMAs. */
#include <stdint.h>
#include <stdlib.h>

static _Thread_local const double *key_s;
static _Thread_local const int64_t *key_row, *key_idx;

static int by_rank(const void *a, const void *b) {
    const long i = *(const long *)a, j = *(const long *)b;
    if (key_s[i] != key_s[j]) return key_s[i] > key_s[j] ? -1 : 1;
    if (key_row[i] != key_row[j]) return key_row[i] < key_row[j] ? -1 : 1;
    return (key_idx[i] > key_idx[j]) - (key_idx[i] < key_idx[j]);
}

/* scores: every row's first lens[r] scores, row after row; t: [max_nodes + 1] the verify
 * row; fixed: [max_nodes + 1] the drafting seconds of a plan of each pad (NULL: none, a
 * step already drafted). Out: rows_out, s_out [every candidate] the kept candidates
 * (score >= floor) in rank order; out[0] their count, out[1] and out[2] the argmax's pad
 * and prefix (0 and 0: plain decoding is best), out[3] its goodput, out[4] plain
 * decoding's. Returns 0, or -1 for what it does not take. */
static int best(const double *scores, const int64_t *lens, long bs, long max_nodes, double floor, const double *t,
                const double *fixed, double draft_s, double node_s, int64_t *rows_out, double *s_out, long *kept,
                long *pad, long *take, double *good, double *plain) {
    if (bs < 1 || max_nodes < 1) return -1;
    long total = 0;
    for (long r = 0; r < bs; ++r) {
        if (lens[r] < 0 || lens[r] > max_nodes) return -1;
        total += lens[r];
    }
    *plain = (double)bs / (draft_s + t[0]);
    *pad = *take = *kept = 0;
    *good = *plain;
    if (total == 0) return 0;
    double *s = malloc((size_t)total * sizeof(double));
    int64_t *row = malloc((size_t)total * sizeof(int64_t)), *idx = malloc((size_t)total * sizeof(int64_t));
    long *order = malloc((size_t)total * sizeof(long)), *rank = malloc((size_t)total * sizeof(long));
    long *count = calloc((size_t)bs, sizeof(long));
    if (!s || !row || !idx || !order || !rank || !count) {
        free(s); free(row); free(idx); free(order); free(rank); free(count);
        return -1;
    }
    long n = 0, at = 0;
    for (long r = 0; r < bs; ++r)
        for (long i = 0; i < lens[r]; ++i, ++at)
            if (scores[at] >= floor) {
                s[n] = scores[at]; row[n] = r; idx[n] = i; order[n] = n; ++n;
            }
    key_s = s; key_row = row; key_idx = idx;
    qsort(order, (size_t)n, sizeof(long), by_rank);
    long most = 0;
    for (long m = 0; m < n; ++m) {
        const long c = order[m];
        rows_out[m] = row[c];
        s_out[m] = s[c];
        rank[m] = count[row[c]]++;
        if (rank[m] + 1 > most) most = rank[m] + 1;
    }
    *kept = n;
    double best = 0.0;
    long best_k = -1, best_m = -1;
    for (long kappa = 1; kappa <= most; ++kappa) {
        const double base = draft_s + (fixed ? fixed[kappa] : 0.0);
        double sum = 0.0;
        long nodes = 0, reach = 0;
        for (long m = 0; m < n; ++m) {
            if (rank[m] < kappa) {
                sum += s_out[m];
                ++nodes;
            } else {
                sum += 0.0;
            }
            if (rank[m] + 1 > reach) reach = rank[m] + 1;
            const long p = reach < kappa ? reach : kappa;
            const double g = ((double)bs + sum) / ((base + t[p]) + node_s * (double)nodes);
            if (best_k < 0 || g > best) {
                best = g; best_k = kappa; best_m = m;
            }
        }
    }
    if (best_k > 0 && best > *plain) {
        *pad = best_k;
        *take = best_m + 1;
        *good = best;
    }
    free(s); free(row); free(idx); free(order); free(rank); free(count);
    return 0;
}

int ts_best(const double *scores, const int64_t *lens, long bs, long max_nodes, double floor, const double *t,
            const double *fixed, double draft_s, double node_s, int64_t *rows_out, double *s_out, double *out) {
    long kept = 0, pad = 0, take = 0;
    double good = 0.0, plain = 0.0;
    const int rc = best(scores, lens, bs, max_nodes, floor, t, fixed, draft_s, node_s, rows_out, s_out, &kept, &pad,
                        &take, &good, &plain);
    out[0] = (double)kept; out[1] = (double)pad; out[2] = (double)take; out[3] = good; out[4] = plain;
    return rc;
}
