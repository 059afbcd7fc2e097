/* Attention straight from the paged KV cache, float32 on a CPU. Built and loaded by
   paged_attention_cpu.py (its docstring says what the kernels do and why) through
   native_build.py. */
#include "v8f.h"

/* e^x for x <= 0 (scores less their maximum): 2^n * p(r), |r| <= ln2 / 2, Cephes' expf
   polynomial (~2 ulp). Below -80 it returns 0 (e^-80 is 1.8e-35): weights that small would
   only make subnormal products in the value sum, which x86 computes ~100x slower */
static inline v8f exp8(v8f x) {
    v8i low = x < splat(-80.0f);
    x = (v8f)(((v8i)splat(-80.0f) & low) | ((v8i)x & ~low));
    v8f y = x * 1.44269504088896341f + 0.5f;
    v8i ti = __builtin_convertvector(y, v8i);          /* toward zero */
    v8f tf = __builtin_convertvector(ti, v8f);
    v8i above = tf > y;                                /* -1 where trunc > floor */
    v8f n = tf + __builtin_convertvector(above, v8f);
    v8i ni = ti + above;
    v8f r = x - n * 0.693359375f + n * 2.12194440e-4f;
    v8f p = splat(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    return (v8f)((v8i)(p * (v8f)((ni + 127) << 23)) & ~low);
}

/* r[k] = the sum of a[k]'s lanes, for 8 vectors at once (a transpose-and-add tree) */
static inline v8f reduce8(const v8f a[8]) {
    v8f b[4], c[2];
    for (int j = 0; j < 4; j++)
        b[j] = __builtin_shufflevector(a[2 * j], a[2 * j + 1], 0, 8, 1, 9, 4, 12, 5, 13)
             + __builtin_shufflevector(a[2 * j], a[2 * j + 1], 2, 10, 3, 11, 6, 14, 7, 15);
    for (int j = 0; j < 2; j++)
        c[j] = __builtin_shufflevector(b[2 * j], b[2 * j + 1], 0, 1, 8, 9, 4, 5, 12, 13)
             + __builtin_shufflevector(b[2 * j], b[2 * j + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    return __builtin_shufflevector(c[0], c[1], 0, 1, 2, 3, 8, 9, 10, 11)
         + __builtin_shufflevector(c[0], c[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

/* the part-th of `parts` equal slices of the n floats at p (a block: contiguous), asked for
   ahead of use. Blocks lie anywhere in the cache, so the hardware prefetcher cannot guess
   them; asking for a whole 4 KB block at once stalls on the core's few outstanding misses
   (measured: no faster than not asking), so each step of a block's work asks for a slice
   of the next block's lines. */
static inline void prefetch_slice(const float *p, int64_t n, int64_t part, int64_t parts) {
    const int64_t lines = (n + 15) / 16, per = (lines + parts - 1) / parts;
    const int64_t end = (part + 1) * per < lines ? (part + 1) * per : lines;
    for (int64_t l = part * per; l < end; l++) __builtin_prefetch(p + l * 16, 0, 3);
}

/* o[0:8nv] += the sum over n rows t of p[t] * v[t * row + 0:8nv]; nv is a constant where it
   is inlined, so the accumulators live in registers */
static inline __attribute__((always_inline)) void pv_rows(float *o, const float *p,
                                                         const float *v, int64_t row,
                                                         int64_t n, const int nv) {
    v8f acc[8];
    for (int c = 0; c < nv; c++) acc[c] = load8(o + 8 * c);
    for (int64_t t = 0; t < n; t++) {
        const v8f pt = splat(p[t]);
        for (int c = 0; c < nv; c++) acc[c] += pt * load8(v + t * row + 8 * c);
    }
    for (int c = 0; c < nv; c++) store8(o + 8 * c, acc[c]);
}

/* q, out [B, kvh * g, D]; kc, vc [blocks, bs, kvh, D]; tables int64 [B, tstride];
   seq_lens int64 [B]. Query head i reads kv head i / g. D and bs must be multiples of 8.
   One sequence per task, all its heads: each block is read whole (bs rows of kvh * D floats,
   contiguous), the next one asked for while this one is worked on. */
void paged_decode_f32(const float *q, const float *kc, const float *vc,
                      const int64_t *tables, int64_t tstride, const int64_t *seq_lens,
                      float *out, int64_t B, int64_t kvh, int64_t g, int64_t D,
                      int64_t bs, float scale) {
    const int64_t row = kvh * D; /* floats between a block's consecutive tokens */
    const int64_t heads = kvh * g;
    #pragma omp parallel
    {
    float *s = NULL; /* this thread's scores [heads, len], grown as needed */
    size_t cap = 0;
    #pragma omp for schedule(dynamic, 1)
    for (int64_t b = 0; b < B; b++) {
        const int64_t len = seq_lens[b];
        const int64_t *table = tables + b * tstride;
        const float *qb = q + b * heads * D;
        float *ob = out + b * heads * D;
        for (int64_t i = 0; i < heads * D; i++) ob[i] = 0.0f;
        if (len <= 0) continue;
        if ((size_t)(heads * len + 8) > cap) {
            free(s);
            cap = (size_t)(heads * len + 8);
            s = malloc(sizeof(float) * cap);
        }
        if (s == NULL) { cap = 0; continue; }
        /* scores s[i * len + t]: 8 keys' dot products per query head, reduced together */
        for (int64_t t0 = 0; t0 < len; t0 += bs) {
            const int64_t n = len - t0 < bs ? len - t0 : bs;
            const float *kb = kc + table[t0 / bs] * bs * row;
            const float *knext = t0 + bs < len ? kc + table[t0 / bs + 1] * bs * row : NULL;
            const int64_t parts = kvh * ((n + 7) / 8);
            for (int64_t h = 0; h < kvh; h++) {
                for (int64_t t8 = 0; t8 < n; t8 += 8) {
                    const int64_t m = n - t8 < 8 ? n - t8 : 8;
                    if (knext) prefetch_slice(knext, bs * row, h * ((n + 7) / 8) + t8 / 8, parts);
                    for (int64_t i = h * g; i < (h + 1) * g; i++) {
                        v8f a[8] = {0};
                        for (int64_t e = 0; e < D; e += 8) {
                            const v8f qe = load8(qb + i * D + e);
                            /* all 8 rows (bs % 8 == 0 keeps them inside the block);
                               the lanes of rows past the sequence are not kept */
                            for (int k = 0; k < 8; k++)
                                a[k] += qe * load8(kb + (t8 + k) * row + h * D + e);
                        }
                        v8f r = reduce8(a) * scale;
                        float *dst = s + i * len + t0 + t8;
                        if (m == 8) store8(dst, r);
                        else for (int64_t k = 0; k < m; k++) dst[k] = r[k];
                    }
                }
            }
        }
        /* softmax numerators in place; the 1 / sum is applied to the output */
        float inv[heads];
        for (int64_t i = 0; i < heads; i++) {
            float *si = s + i * len;
            float mx = si[0];
            for (int64_t t = 1; t < len; t++) mx = si[t] > mx ? si[t] : mx;
            v8f sum8 = splat(0.0f);
            int64_t t = 0;
            for (; t + 8 <= len; t += 8) {
                v8f e = exp8(load8(si + t) - mx);
                store8(si + t, e);
                sum8 += e;
            }
            float sum = 0.0f;
            for (int k = 0; k < 8; k++) sum += sum8[k];
            if (t < len) {
                v8f tail = splat(0.0f); /* lanes past the end: computed, not kept */
                for (int64_t k = 0; t + k < len; k++) tail[k] = si[t + k] - mx;
                v8f e = exp8(tail);
                for (int64_t k = 0; t + k < len; k++) { si[t + k] = e[k]; sum += e[k]; }
            }
            inv[i] = 1.0f / sum;
        }
        /* out = sum_t p_t v_t, a block at a time: each head's output (8 vectors at most at
           a time) stays in registers over the block's rows */
        for (int64_t t0 = 0; t0 < len; t0 += bs) {
            const int64_t n = len - t0 < bs ? len - t0 : bs;
            const float *vb = vc + table[t0 / bs] * bs * row;
            const float *vnext = t0 + bs < len ? vc + table[t0 / bs + 1] * bs * row : NULL;
            for (int64_t i = 0; i < heads; i++) {
                if (vnext) prefetch_slice(vnext, bs * row, i, heads);
                const float *pi = s + i * len + t0;
                const float *vh = vb + (i / g) * D;
                float *oi = ob + i * D;
                for (int64_t e0 = 0; e0 < D; e0 += 64) {
                    switch (D - e0 >= 64 ? 8 : (D - e0) / 8) { /* constant widths, unrolled */
                    case 8: pv_rows(oi + e0, pi, vh + e0, row, n, 8); break;
                    case 7: pv_rows(oi + e0, pi, vh + e0, row, n, 7); break;
                    case 6: pv_rows(oi + e0, pi, vh + e0, row, n, 6); break;
                    case 5: pv_rows(oi + e0, pi, vh + e0, row, n, 5); break;
                    case 4: pv_rows(oi + e0, pi, vh + e0, row, n, 4); break;
                    case 3: pv_rows(oi + e0, pi, vh + e0, row, n, 3); break;
                    case 2: pv_rows(oi + e0, pi, vh + e0, row, n, 2); break;
                    default: pv_rows(oi + e0, pi, vh + e0, row, n, 1); break;
                    }
                }
            }
        }
        for (int64_t i = 0; i < heads; i++)
            for (int64_t e = 0; e < D; e++) ob[i * D + e] *= inv[i];
    }
    free(s);
    }
}

#include <omp.h>

/* ---- prefill: query spans of any length, causal, online softmax over chunks of keys ---- */
#define BQ 16 /* query tokens per task: with the kv head's query group, its rows */
#define KC 64 /* keys per chunk of the online softmax */

/* s[4 rows][16 keys] = q4[4][D] . kt[D][16 keys] (kt's rows KC apart) */
static inline void qk_4x16(const float *q4, int64_t D, const float *kt, float *s) {
    v8f a[4][2];
    for (int r = 0; r < 4; r++) a[r][0] = a[r][1] = splat(0.0f);
    for (int64_t e = 0; e < D; e++) {
        const v8f k0 = load8(kt + e * KC), k1 = load8(kt + e * KC + 8);
        for (int r = 0; r < 4; r++) {
            const v8f qe = splat(q4[r * D + e]);
            a[r][0] += qe * k0;
            a[r][1] += qe * k1;
        }
    }
    for (int r = 0; r < 4; r++) { store8(s + r * KC, a[r][0]); store8(s + r * KC + 8, a[r][1]); }
}

/* o[4 rows][8nv] += p[4][n] . v rows (vrow[t] + e0) */
static inline __attribute__((always_inline)) void pv_4(float *o, int64_t D, const float *p,
                                                      const float *const *vrow, int64_t e0,
                                                      int64_t n, const int nv) {
    v8f a[4][2];
    for (int r = 0; r < 4; r++) for (int c = 0; c < nv; c++) a[r][c] = load8(o + r * D + e0 + 8 * c);
    for (int64_t t = 0; t < n; t++) {
        v8f vv[2];
        for (int c = 0; c < nv; c++) vv[c] = load8(vrow[t] + e0 + 8 * c);
        for (int r = 0; r < 4; r++) {
            const v8f pr = splat(p[r * KC + t]);
            for (int c = 0; c < nv; c++) a[r][c] += pr * vv[c];
        }
    }
    for (int r = 0; r < 4; r++) for (int c = 0; c < nv; c++) store8(o + r * D + e0 + 8 * c, a[r][c]);
}

/* Causal attention of query spans over their sequences' paged keys. q [T, kvh * g, D] with
   qs floats between tokens; out [T, kvh * g, D] contiguous; kc, vc [blocks, bs, kvh, D].
   Span s: tokens qstart[s] .. + qlen[s] of q, seq_len slen[s] keys in block table row s;
   its query r sees keys 0 .. slen - qlen + r. D % 8 == 0. Returns 0, or -1 (nothing
   computed) when its scratch cannot be allocated. */
int paged_prefill_f32(const float *q, int64_t qs, const float *kc, const float *vc,
                       const int64_t *tables, int64_t tstride, const int64_t *qstart,
                       const int64_t *qlen, const int64_t *slen, int64_t S, float *out,
                       int64_t kvh, int64_t g, int64_t D, int64_t bs, float scale) {
    const int64_t row = kvh * D, heads = kvh * g;
    const int64_t M4 = (BQ * g + 3) & ~(int64_t)3; /* the most rows a task has, padded */
    const int threads = omp_get_max_threads();
    /* each thread's q rows, key tile, scores, output rows, maxima and sums */
    const size_t per = (size_t)(M4 * D + D * KC + M4 * KC + M4 * D + 2 * M4);
    float *pool = malloc(sizeof(float) * per * threads);
    int64_t *first = malloc(sizeof(int64_t) * (S + 1)); /* first task of each span */
    if (pool == NULL || first == NULL) { free(pool); free(first); return -1; }
    first[0] = 0;
    for (int64_t s = 0; s < S; s++) first[s + 1] = first[s] + kvh * ((qlen[s] + BQ - 1) / BQ);
    const int64_t ntask = first[S];
    #pragma omp parallel num_threads(threads)
    {
    float *qb = pool + per * omp_get_thread_num();
    float *kt = qb + M4 * D, *sc = kt + D * KC, *o = sc + M4 * KC;
    float *m = o + M4 * D, *l = m + M4;
    const float *vrow[KC];
    #pragma omp for schedule(dynamic, 1)
    for (int64_t t = ntask - 1; t >= 0; t--) { /* longest (last) query blocks first */
        int64_t s = 0;
        while (first[s + 1] <= t) s++;
        const int64_t local = t - first[s], h = local % kvh, r0 = (local / kvh) * BQ;
        const int64_t nq = qlen[s] - r0 < BQ ? qlen[s] - r0 : BQ;
        const int64_t ctx = slen[s] - qlen[s], M = nq * g;
        const int64_t MR = (M + 3) & ~(int64_t)3; /* this task's rows, padded to 4 */
        const int64_t *table = tables + s * tstride;
        /* rows: query r0 + i, head h * g + j at row i * g + j */
        for (int64_t i = 0; i < nq; i++)
            for (int64_t j = 0; j < g; j++) {
                const float *src = q + (qstart[s] + r0 + i) * qs + (h * g + j) * D;
                float *dst = qb + (i * g + j) * D;
                for (int64_t e = 0; e < D; e++) dst[e] = src[e] * scale;
            }
        memset(qb + M * D, 0, sizeof(float) * (MR - M) * D);
        memset(o, 0, sizeof(float) * MR * D);
        for (int64_t r = 0; r < MR; r++) { m[r] = -INFINITY; l[r] = 0.0f; }
        const int64_t kend = ctx + r0 + nq; /* keys the task's last query sees */
        for (int64_t j0 = 0; j0 < kend; j0 += KC) {
            const int64_t nk = kend - j0 < KC ? kend - j0 : KC;
            const int64_t nk16 = (nk + 15) & ~(int64_t)15;
            for (int64_t jj = 0; jj < nk; jj++) {
                const int64_t key = j0 + jj;
                const int64_t off = (table[key / bs] * bs + key % bs) * row + h * D;
                const float *kr = kc + off;
                vrow[jj] = vc + off;
                for (int64_t e = 0; e < D; e++) kt[e * KC + jj] = kr[e];
            }
            for (int64_t jj = nk; jj < nk16; jj++)
                for (int64_t e = 0; e < D; e++) kt[e * KC + jj] = 0.0f;
            for (int64_t r = 0; r < MR; r += 4)
                for (int64_t jj = 0; jj < nk16; jj += 16) qk_4x16(qb + r * D, D, kt + jj, sc + r * KC + jj);
            for (int64_t r = 0; r < M; r++) {
                float *sr = sc + r * KC;
                const int64_t see = ctx + r0 + r / g - j0 + 1; /* keys of the chunk it sees */
                if (see <= 0) { memset(sr, 0, sizeof(float) * nk16); continue; }
                const int64_t n = see < nk ? see : nk;
                for (int64_t jj = n; jj < nk16; jj++) sr[jj] = -INFINITY;
                v8f mx8 = splat(-INFINITY);
                for (int64_t jj = 0; jj < nk16; jj += 8) {
                    const v8f x = load8(sr + jj);
                    const v8i gt = x > mx8;
                    mx8 = (v8f)(((v8i)x & gt) | ((v8i)mx8 & ~gt));
                }
                float mx = mx8[0];
                for (int k = 1; k < 8; k++) mx = mx8[k] > mx ? mx8[k] : mx;
                const float mn = mx > m[r] ? mx : m[r];
                const float corr = expf(m[r] - mn);
                v8f sum8 = splat(0.0f);
                for (int64_t jj = 0; jj < nk16; jj += 8) {
                    const v8f e8 = exp8(load8(sr + jj) - mn);
                    store8(sr + jj, e8);
                    sum8 += e8;
                }
                float sum = 0.0f;
                for (int k = 0; k < 8; k++) sum += sum8[k];
                l[r] = l[r] * corr + sum;
                m[r] = mn;
                if (corr != 1.0f)
                    for (int64_t e = 0; e < D; e += 8) store8(o + r * D + e, load8(o + r * D + e) * corr);
            }
            for (int64_t r = M; r < MR; r++) memset(sc + r * KC, 0, sizeof(float) * KC);
            for (int64_t r = 0; r < MR; r += 4)
                for (int64_t e0 = 0; e0 < D; e0 += 16) {
                    if (D - e0 >= 16) pv_4(o + r * D, D, sc + r * KC, vrow, e0, nk, 2);
                    else pv_4(o + r * D, D, sc + r * KC, vrow, e0, nk, 1);
                }
        }
        for (int64_t i = 0; i < nq; i++)
            for (int64_t j = 0; j < g; j++) {
                const int64_t r = i * g + j;
                const float inv = 1.0f / l[r];
                float *dst = out + ((qstart[s] + r0 + i) * heads + h * g + j) * D;
                for (int64_t e = 0; e < D; e++) dst[e] = o[r * D + e] * inv;
            }
    }
    }
    free(pool);
    free(first);
    return 0;
}
