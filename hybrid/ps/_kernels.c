/* hybrid's native kernels: the per-step loops of the trainer's id routing and of the
 * parameter server's row reads and SGD updates, each one call for every table at once.
 *
 * Plain C with no Python or torch API: hybrid.ps.native compiles it on first use and calls it
 * through ctypes on tensors' memory. Every function checks what it is given (row ids inside
 * their table, gradients finite) before it writes anything the caller keeps, and reports a
 * problem through its return value; the Python side turns that into the error message.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define HY_BAD_ID (-1)
#define HY_NO_MEMORY (-2)
#define HY_TOO_WIDE (-3)
#define HY_NOT_FINITE (-4)

#define RADIX_BITS 11
#define RADIX (1 << RADIX_BITS)
#define PREFETCH_AHEAD 8

static int bit_length(uint64_t x) {
    int n = 0;
    while (x) {
        n++;
        x >>= 1;
    }
    return n;
}

/* Stable LSD radix sort of n packed keys by bits [lo, hi): ties keep their order. */
static void radix_sort(uint64_t *a, uint64_t *tmp, int64_t n, int lo, int hi) {
    static const int64_t zero[RADIX] = {0};
    int64_t count[RADIX];
    for (int shift = lo; shift < hi; shift += RADIX_BITS) {
        memcpy(count, zero, sizeof(count));
        for (int64_t i = 0; i < n; i++) count[(a[i] >> shift) & (RADIX - 1)]++;
        int64_t sum = 0;
        for (int d = 0; d < RADIX; d++) {
            int64_t c = count[d];
            count[d] = sum;
            sum += c;
        }
        for (int64_t i = 0; i < n; i++) tmp[count[(a[i] >> shift) & (RADIX - 1)]++] = a[i];
        uint64_t *swap = a;
        a = tmp;
        tmp = swap;
        /* after an odd number of passes the result sits in the caller's tmp: copied below */
    }
    int passes = (hi - lo + RADIX_BITS - 1) / RADIX_BITS;
    if (hi > lo && (passes & 1)) memcpy(tmp, a, (size_t)n * sizeof(uint64_t));
}

/* The trainer's route of one batch (see hybrid/ps/fused.py for the meaning of each output).
 *
 * In: n ids feature-major (feature f's bags, sample by sample), the lengths of the nf * b bags
 * (feature-major), each feature's table, the tables' first rows in one global row space
 * (row_base, ntab + 1 entries), each table's shard count and the server rank of each shard
 * (server_rank[t * width + shard]), the number of servers, and optional per-id weights.
 *
 * Out (caller-allocated, n entries unless said): req -- the deduplicated local row ids, server
 * by server, table by table within a server, ascending within a table; per -- nsrv * ntab counts
 * of req; raw -- ids per server before deduplication (nsrv); idx -- for every id in sample-major
 * bag order, its row in req (the servers' replies concatenated); offsets -- sample-major bag
 * bounds (nf * b + 1); weights_sm -- the weights in idx's order; grad_bags, grad_offsets (n + 1),
 * grad_scale -- the backward's bags: for every row of req in order, the sample-major bags of its
 * ids and what each contributes (the id's weight; with weights NULL, 1 / len(bag), for mean
 * pooling; grad_scale NULL: 1, for sum).
 *
 * Returns the number of distinct rows, or HY_BAD_ID (*bad = the first offending position),
 * HY_NO_MEMORY, HY_TOO_WIDE (row space and batch too large to pack into 64 bits).
 */
int64_t hy_route(int64_t n, const int64_t *ids, int64_t nf, int64_t b, const int64_t *lengths,
                 const int64_t *feat_table, int64_t ntab, const int64_t *row_base,
                 const int64_t *shards, const int64_t *server_rank, int64_t width, int64_t nsrv,
                 const float *weights, int64_t *req, int64_t *per, int64_t *raw,
                 int64_t *idx, int64_t *offsets, float *weights_sm, int64_t *grad_bags,
                 int64_t *grad_offsets, float *grad_scale, int64_t *bad) {
    int pos_bits = bit_length((uint64_t)(n > 1 ? n - 1 : 1));
    int key_bits = bit_length((uint64_t)(row_base[ntab] > 0 ? row_base[ntab] - 1 : 0));
    if (pos_bits + key_bits > 63) return HY_TOO_WIDE;
    int64_t nbags = nf * b;
    size_t words = (size_t)n * 10 + (size_t)nbags + 1;
    int64_t *block = malloc(words * sizeof(int64_t));
    if (!block) return HY_NO_MEMORY;
    uint64_t *packed = (uint64_t *)block;    /* (global row << pos_bits) | position */
    uint64_t *tmp = (uint64_t *)(block + n); /* radix scratch, then sorted positions */
    int64_t *bag = block + 2 * n;            /* sample-major bag of each position */
    int64_t *rank = block + 3 * n;           /* distinct row of each position */
    int64_t *ustart = block + 4 * n;         /* first sorted position of each distinct row */
    int64_t *ucount = block + 5 * n;
    int64_t *ukey = block + 6 * n;           /* server * ntab + table */
    int64_t *ulocal = block + 7 * n;
    int64_t *place = block + 8 * n;          /* distinct row -> its row in req */
    int64_t *uop = block + 9 * n;            /* row in req -> distinct row */
    int64_t *fm_start = block + 10 * n;      /* first position of each feature-major bag */

    int64_t p = 0;
    for (int64_t f = 0; f < nf; f++) {
        int64_t t = feat_table[f];
        int64_t base = row_base[t], rows = row_base[t + 1] - base;
        for (int64_t s = 0; s < b; s++) {
            int64_t len = lengths[f * b + s], bg = s * nf + f;
            fm_start[f * b + s] = p;
            for (int64_t k = 0; k < len; k++, p++) {
                int64_t id = ids[p];
                if (id < 0 || id >= rows) {
                    *bad = p;
                    free(block);
                    return HY_BAD_ID;
                }
                packed[p] = ((uint64_t)(id + base) << pos_bits) | (uint64_t)p;
                bag[p] = bg;
            }
        }
    }
    radix_sort(packed, tmp, n, pos_bits, pos_bits + key_bits);

    uint64_t pos_mask = (pos_bits == 64) ? ~0ull : ((1ull << pos_bits) - 1);
    int64_t nu = 0;
    uint64_t prev = 0;
    for (int64_t i = 0; i < n; i++) {
        uint64_t g = packed[i] >> pos_bits;
        int64_t q = (int64_t)(packed[i] & pos_mask);
        if (i == 0 || g != prev) {
            ulocal[nu] = (int64_t)g; /* global row for now */
            ustart[nu++] = i;
            prev = g;
        }
        rank[q] = nu - 1;
        tmp[i] = (uint64_t)q;
    }
    for (int64_t u = 0; u < nu; u++) ucount[u] = (u + 1 < nu ? ustart[u + 1] : n) - ustart[u];

    memset(per, 0, (size_t)(nsrv * ntab) * sizeof(int64_t));
    memset(raw, 0, (size_t)nsrv * sizeof(int64_t));
    int64_t t = 0;
    for (int64_t u = 0; u < nu; u++) {
        int64_t g = ulocal[u];
        while (g >= row_base[t + 1]) t++; /* rows ascend, so tables do */
        int64_t local = g - row_base[t], sh = shards[t], sp = 0;
        if (sh > 1) {
            sp = local % sh;
            local /= sh;
        }
        int64_t srv = server_rank[t * width + sp];
        ukey[u] = srv * ntab + t;
        ulocal[u] = local;
        per[ukey[u]]++;
        raw[srv] += ucount[u];
    }
    /* Rows to their place in req: server-major, table-minor, ascending within (stable). */
    int64_t *start = malloc((size_t)(nsrv * ntab) * sizeof(int64_t));
    if (!start) {
        free(block);
        return HY_NO_MEMORY;
    }
    int64_t sum = 0;
    for (int64_t k = 0; k < nsrv * ntab; k++) {
        start[k] = sum;
        sum += per[k];
    }
    for (int64_t u = 0; u < nu; u++) {
        int64_t j = start[ukey[u]]++;
        place[u] = j;
        uop[j] = u;
        req[j] = ulocal[u];
    }
    free(start);

    /* Backward groups, in req's order: the bags of each row's ids. */
    int64_t go = 0;
    for (int64_t j = 0; j < nu; j++) {
        int64_t u = uop[j];
        grad_offsets[j] = go;
        for (int64_t k = 0; k < ucount[u]; k++, go++) {
            int64_t q = (int64_t)tmp[ustart[u] + k];
            int64_t bg = bag[q];
            grad_bags[go] = bg;
            if (grad_scale) {
                if (weights) {
                    grad_scale[go] = weights[q];
                } else { /* mean: the id's bag holds len ids; an id's bag is never empty */
                    int64_t f = bg % nf, s = bg / nf;
                    grad_scale[go] = 1.0f / (float)lengths[f * b + s];
                }
            }
        }
    }
    grad_offsets[nu] = go;

    /* Forward: every id's row, bags sample-major. */
    int64_t q = 0;
    offsets[0] = 0;
    for (int64_t s = 0; s < b; s++) {
        for (int64_t f = 0; f < nf; f++) {
            int64_t st = fm_start[f * b + s], len = lengths[f * b + s];
            for (int64_t k = 0; k < len; k++, q++) {
                idx[q] = place[rank[st + k]];
                if (weights_sm) weights_sm[q] = weights[st + k];
            }
            offsets[s * nf + f + 1] = q;
        }
    }
    free(block);
    return nu;
}

/* Every gradient finite? (An all-ones exponent is an infinity or a NaN.) */
static int all_finite(const float *x, int64_t n) {
    uint32_t bad = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, x + i, sizeof(u));
        bad |= ((u & 0x7f800000u) == 0x7f800000u);
    }
    return !bad;
}

/* Ids (one chunk per table, counts[t] long) inside their tables? Returns the first bad
 * position, or -1. */
static int64_t first_bad_id(int64_t ntab, const int64_t *nrows, const int64_t *counts,
                            const int64_t *ids) {
    int64_t p = 0;
    for (int64_t t = 0; t < ntab; t++) {
        int64_t rows = nrows[t];
        uint64_t bad = 0;
        for (int64_t k = 0; k < counts[t]; k++) bad |= ((uint64_t)ids[p + k] >= (uint64_t)rows);
        if (bad) {
            for (int64_t k = 0; k < counts[t]; k++)
                if ((uint64_t)ids[p + k] >= (uint64_t)rows) return p + k;
        }
        p += counts[t];
    }
    return -1;
}

/* The rows of several tables, one chunk per table, into one flat buffer (a lookup's reply).
 * tables[t] is the address of table t's rows (nrows[t] x dims[t] floats, contiguous). */
int64_t hy_gather(float *out, int64_t ntab, const int64_t *tables, const int64_t *dims,
                  const int64_t *nrows, const int64_t *counts, const int64_t *ids, int64_t *bad) {
    int64_t p = first_bad_id(ntab, nrows, counts, ids);
    if (p >= 0) {
        *bad = p;
        return HY_BAD_ID;
    }
    p = 0;
    for (int64_t t = 0; t < ntab; t++) {
        const float *w = (const float *)(intptr_t)tables[t];
        int64_t d = dims[t], n = counts[t];
        const int64_t *r = ids + p;
        for (int64_t k = 0; k < n; k++) {
            if (k + PREFETCH_AHEAD < n) __builtin_prefetch(w + r[k + PREFETCH_AHEAD] * d);
            memcpy(out, w + r[k] * d, (size_t)d * sizeof(float));
            out += d;
        }
        p += n;
    }
    return 0;
}

/* w[r] = fma(alpha, g, w[r]) row by row, in order (rows may repeat): torch's add_(g, alpha)
 * rounds once too, so the result is the same. */
#define SGD_BODY(FMA)                                                                     \
    for (int64_t t = 0; t < ntab; t++) {                                                  \
        float *w = (float *)(intptr_t)tables[t];                                           \
        int64_t d = dims[t], n = counts[t];                                                \
        const int64_t *r = ids + p;                                                        \
        for (int64_t k = 0; k < n; k++) {                                                  \
            if (k + PREFETCH_AHEAD < n) __builtin_prefetch(w + r[k + PREFETCH_AHEAD] * d, 1); \
            float *wr = w + r[k] * d;                                                      \
            for (int64_t j = 0; j < d; j++) wr[j] = FMA(alpha, grad[j], wr[j]);            \
            grad += d;                                                                     \
        }                                                                                  \
        p += n;                                                                            \
    }

#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("fma"))) static void sgd_fma(int64_t ntab, const int64_t *tables,
                                                   const int64_t *dims, const int64_t *counts,
                                                   const int64_t *ids, const float *grad,
                                                   float alpha) {
    int64_t p = 0;
    SGD_BODY(__builtin_fmaf)
}
#endif

static void sgd_libm(int64_t ntab, const int64_t *tables, const int64_t *dims,
                     const int64_t *counts, const int64_t *ids, const float *grad, float alpha) {
    int64_t p = 0;
    SGD_BODY(fmaf)
}

/* Plain SGD of one trainer's gradient: rows of several tables (one chunk per table), gradient
 * rows flat in the same order. Checks every id and every gradient before writing any row. */
int64_t hy_sgd(int64_t ntab, const int64_t *tables, const int64_t *dims, const int64_t *nrows,
               const int64_t *counts, const int64_t *ids, const float *grad, float alpha,
               int64_t *bad) {
    int64_t p = first_bad_id(ntab, nrows, counts, ids);
    if (p >= 0) {
        *bad = p;
        return HY_BAD_ID;
    }
    int64_t total = 0;
    for (int64_t t = 0; t < ntab; t++) total += counts[t] * dims[t];
    if (!all_finite(grad, total)) return HY_NOT_FINITE;
#if defined(__x86_64__) && defined(__GNUC__)
    if (__builtin_cpu_supports("fma")) {
        sgd_fma(ntab, tables, dims, counts, ids, grad, alpha);
        return 0;
    }
#endif
    sgd_libm(ntab, tables, dims, counts, ids, grad, alpha);
    return 0;
}

/* Sum the gradient rows of repeated ids (several trainers' contributions to one table): rows
 * ascending, each row's gradients added in their order of arrival, then times scale -- what
 * torch's zeros().index_add_(inverse, grads).mul_(scale) gives. Returns the number of rows. */
int64_t hy_sum_rows(int64_t n, const int64_t *ids, const float *grads, int64_t d, float scale,
                    int64_t nrows, int64_t *rows_out, float *sum_out, int64_t *bad) {
    int64_t p = first_bad_id(1, &nrows, &n, ids);
    if (p >= 0) {
        *bad = p;
        return HY_BAD_ID;
    }
    if (n == 0) return 0;
    int pos_bits = bit_length((uint64_t)(n > 1 ? n - 1 : 1));
    int key_bits = bit_length((uint64_t)(nrows > 0 ? nrows - 1 : 0));
    if (pos_bits + key_bits > 63) return HY_TOO_WIDE;
    uint64_t *packed = malloc((size_t)n * 2 * sizeof(uint64_t));
    if (!packed) return HY_NO_MEMORY;
    for (int64_t i = 0; i < n; i++) packed[i] = ((uint64_t)ids[i] << pos_bits) | (uint64_t)i;
    radix_sort(packed, packed + n, n, pos_bits, pos_bits + key_bits);
    uint64_t mask = (1ull << pos_bits) - 1;
    int64_t nu = -1;
    uint64_t prev = 0;
    for (int64_t i = 0; i < n; i++) {
        uint64_t r = packed[i] >> pos_bits;
        const float *g = grads + (int64_t)(packed[i] & mask) * d;
        if (i == 0 || r != prev) {
            nu++;
            rows_out[nu] = (int64_t)r;
            memcpy(sum_out + nu * d, g, (size_t)d * sizeof(float));
            prev = r;
        } else {
            float *s = sum_out + nu * d;
            for (int64_t j = 0; j < d; j++) s[j] += g[j];
        }
    }
    nu++;
    free(packed);
    if (scale != 1.0f)
        for (int64_t i = 0; i < nu * d; i++) sum_out[i] *= scale;
    return nu;
}

#define OPT_ADAGRAD 1
#define OPT_ROWWISE_ADAGRAD 2
#define OPT_ADAM 3
#define ADAM_CACHE 512

/* New values of n distinct rows of one table and of their optimizer state, into out_* (n rows
 * each); the table and state are only read. The arithmetic follows hybrid.ps.optim's torch code
 * step by step (to float32 rounding, not bit for bit: torch's reductions and fused kernels
 * round in their own order). g is the summed gradient, multiplied by gscale first. Returns 0,
 * HY_BAD_ID, or HY_NOT_FINITE when a new weight is not finite (the caller then writes nothing). */
int64_t hy_opt_compute(int64_t kind, int64_t n, int64_t d, int64_t nrows,
                       const int64_t *restrict rows, const float *restrict grads, float gscale,
                       const float *restrict w, const float *restrict s1,
                       const float *restrict s2, const float *restrict s3, double lr, double eps,
                       double wd, double beta1, double beta2, float *restrict out_w,
                       float *restrict out_s1, float *restrict out_s2, float *restrict out_s3,
                       int64_t *restrict bad) {
    int64_t p = first_bad_id(1, &nrows, &n, rows);
    if (p >= 0) {
        *bad = p;
        return HY_BAD_ID;
    }
    const float flr = (float)lr, feps = (float)eps, fwd = (float)wd;
    uint32_t nonfinite = 0;
    /* Adam's bias corrections depend on a row's step count only: each count's are computed once
     * per call (two pow() per row otherwise, most of the update's time). */
    float cache_k[ADAM_CACHE], cache_step[ADAM_CACHE], cache_bc2[ADAM_CACHE];
    if (kind == OPT_ADAM) memset(cache_k, 0, sizeof(cache_k));
    float g[1024];
    float *gbuf = d <= 1024 ? g : malloc((size_t)d * sizeof(float));
    if (!gbuf) return HY_NO_MEMORY;
    for (int64_t i = 0; i < n; i++) {
        int64_t r = rows[i];
        if (i + PREFETCH_AHEAD < n) {
            int64_t ahead = rows[i + PREFETCH_AHEAD];
            __builtin_prefetch(w + ahead * d);
            if (kind == OPT_ROWWISE_ADAGRAD) {
                __builtin_prefetch(s1 + ahead);
            } else {
                __builtin_prefetch(s1 + ahead * d);
                if (kind == OPT_ADAM) {
                    __builtin_prefetch(s2 + ahead * d);
                    __builtin_prefetch(s3 + ahead);
                }
            }
        }
        const float *wr = w + r * d;
        float *ow = out_w + i * d;
        for (int64_t j = 0; j < d; j++) {
            float gj = grads[i * d + j];
            if (gscale != 1.0f) gj *= gscale;
            if (wd != 0.0) gj = fmaf(fwd, wr[j], gj);
            gbuf[j] = gj;
        }
        if (kind == OPT_ADAGRAD) {
            const float *ar = s1 + r * d;
            float *oa = out_s1 + i * d;
            for (int64_t j = 0; j < d; j++) {
                float acc = ar[j] + gbuf[j] * gbuf[j];
                oa[j] = acc;
                ow[j] = wr[j] + (-flr) * (gbuf[j] / (sqrtf(acc) + feps));
            }
        } else if (kind == OPT_ROWWISE_ADAGRAD) {
            float sq = 0.0f;
            for (int64_t j = 0; j < d; j++) sq += gbuf[j] * gbuf[j];
            float acc = s1[r] + sq / (float)d;
            out_s1[i] = acc;
            float denom = sqrtf(acc) + feps;
            for (int64_t j = 0; j < d; j++) ow[j] = wr[j] + (-flr) * (gbuf[j] / denom);
        } else { /* OPT_ADAM, bias corrections in double as torch.optim.Adam */
            float k = s3[r] + 1.0f;
            out_s3[i] = k;
            float step_size, bc2;
            if (k >= 1.0f && k <= (float)ADAM_CACHE && cache_k[(int)k - 1] == k) {
                step_size = cache_step[(int)k - 1];
                bc2 = cache_bc2[(int)k - 1];
            } else {
                step_size = (float)(lr / (1.0 - pow(beta1, (double)k)));
                bc2 = (float)sqrt(1.0 - pow(beta2, (double)k));
                if (k >= 1.0f && k <= (float)ADAM_CACHE && k == (float)(int)k) {
                    cache_k[(int)k - 1] = k;
                    cache_step[(int)k - 1] = step_size;
                    cache_bc2[(int)k - 1] = bc2;
                }
            }
            const float *mr = s1 + r * d, *vr = s2 + r * d;
            float *om = out_s1 + i * d, *ov = out_s2 + i * d;
            float w1 = (float)(1.0 - beta1), fb2 = (float)beta2, w2 = (float)(1.0 - beta2);
            for (int64_t j = 0; j < d; j++) {
                float m = mr[j] + w1 * (gbuf[j] - mr[j]);
                float v = vr[j] * fb2 + w2 * gbuf[j] * gbuf[j];
                om[j] = m;
                ov[j] = v;
                ow[j] = wr[j] - step_size * (m / (sqrtf(v) / bc2 + feps));
            }
        }
        for (int64_t j = 0; j < d; j++) {
            uint32_t u;
            memcpy(&u, ow + j, sizeof(u));
            nonfinite |= ((u & 0x7f800000u) == 0x7f800000u);
        }
    }
    if (gbuf != g) free(gbuf);
    return nonfinite ? HY_NOT_FINITE : 0;
}

/* dst[rows[i]] = src[i] (rows of width d), rows already checked. */
void hy_scatter_rows(float *dst, int64_t d, const int64_t *rows, int64_t n, const float *src) {
    for (int64_t i = 0; i < n; i++) {
        if (i + PREFETCH_AHEAD < n) __builtin_prefetch(dst + rows[i + PREFETCH_AHEAD] * d, 1);
        memcpy(dst + rows[i] * d, src + i * d, (size_t)d * sizeof(float));
    }
}
