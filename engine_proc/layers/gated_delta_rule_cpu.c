/* A decode step of Gated DeltaNet with each sequence's state read and written in place in
   its slot, float32 on a CPU. Built and loaded by gated_delta_rule_cpu.py (its docstring
   says why) through native_build.py. */
#include "v8f.h"

#define MAX_DIM 512   /* head dims up to this (Qwen3.5: 128) */
#define AHEAD 32      /* state rows fetched ahead (into L2) of those read: <= dk */
#define ROWS 4        /* state rows read per pass over the sums */
#define PARALLEL_MIN 8 /* (sequence, head) pairs below which one thread does the call */

static float dot(const float *a, const float *b, int64_t n) {
    v8f acc = splat(0.0f);
    for (int64_t j = 0; j < n; j += 8) acc += load8(a + j) * load8(b + j);
    float s = 0.0f;
    for (int i = 0; i < 8; i++) s += acc[i];
    return s;
}

/* x * scale / sqrt(sum(x^2) + eps) into out: the rule's l2norm of q and k. */
static void l2norm(const float *x, float *out, int64_t n, float scale) {
    const float r = scale / sqrtf(dot(x, x, n) + 1e-6f);
    for (int64_t j = 0; j < n; j += 8) store8(out + j, load8(x + j) * splat(r));
}

/* One token of the gated delta rule for N sequences:
     S' = d * S + k (x) u,  u = (v - d * S^T k) * beta,  o = S'^T q = d * S^T q + (k . q) u
   with d = exp(g), q and k l2-normalized (q also scaled by dk^-0.5). Each (sequence, head)
   reads its state [dk, dv] from memory once, for S^T k and S^T q, and rewrites it while it
   is still in cache (64 KiB at Qwen3.5's 128 x 128): the torch form's gather, decay, write,
   read and scatter went through memory five times. The read is what bounds it (one core
   streams ~12 GB/s): the rows ahead, then the next state, are fetched into L2 meanwhile.
   state: [slots, Hv, dk, dv] contiguous; slots[N]; q, k: rows of stride qk_rs, Hk heads of
   dk (contiguous); v: rows of stride v_rs, Hv heads of dv; g, beta: [N, Hv] contiguous;
   out: [N, Hv, dv] contiguous. Value head h reads key head h / (Hv / Hk). dk, dv % 32 == 0. */
void gdr_decode_f32(float *state, const int64_t *slots, const float *q, const float *k,
                    const float *v, const float *g, const float *beta, float *out,
                    int64_t n, int64_t hk, int64_t hv, int64_t dk, int64_t dv,
                    int64_t qk_rs, int64_t v_rs) {
    const int64_t group = hv / hk;
    const float scale = 1.0f / sqrtf((float)dk);
    #pragma omp parallel for schedule(static) if (n * hv >= PARALLEL_MIN)
    for (int64_t p = 0; p < n * hv; p++) {
        const int64_t i = p / hv, h = p % hv;
        float *s = state + (slots[i] * hv + h) * dk * dv;
        /* the next pair's state, fetched into L2 while this one is read */
        const float *next = p + 1 < n * hv
            ? state + (slots[(p + 1) / hv] * hv + (p + 1) % hv) * dk * dv : s;
        float qn[MAX_DIM], kn[MAX_DIM], u[MAX_DIM];
        l2norm(q + i * qk_rs + (h / group) * dk, qn, dk, scale);
        l2norm(k + i * qk_rs + (h / group) * dk, kn, dk, 1.0f);
        const float d = expf(g[p]), b = beta[p], kq = dot(kn, qn, dk);
        const float *vi = v + i * v_rs + h * dv;
        float *o = out + p * dv;
        float sk[MAX_DIM], sq[MAX_DIM];
        for (int64_t c = 0; c < dv; c += 8) {
            store8(sk + c, splat(0.0f));
            store8(sq + c, splat(0.0f));
        }
        for (int64_t j = 0; j < dk; j += ROWS) {  /* ROWS rows a pass: fewer sums stored */
            const float *row = s + j * dv;
            const float *ahead = j + AHEAD < dk ? row + AHEAD * dv
                                                : next + (j + AHEAD - dk) * dv;
            for (int64_t c = 0; c < ROWS * dv; c += 16) __builtin_prefetch(ahead + c, 0, 1);
            for (int64_t c = 0; c < dv; c += 8) {
                v8f ak = load8(sk + c), aq = load8(sq + c);
                for (int r = 0; r < ROWS; r++) {
                    const v8f sj = load8(row + r * dv + c);
                    ak += splat(kn[j + r]) * sj;
                    aq += splat(qn[j + r]) * sj;
                }
                store8(sk + c, ak);
                store8(sq + c, aq);
            }
        }
        for (int64_t c = 0; c < dv; c += 8) {
            const v8f uc = (load8(vi + c) - splat(d) * load8(sk + c)) * splat(b);
            store8(u + c, uc);
            store8(o + c, splat(d) * load8(sq + c) + splat(kq) * uc);
        }
        for (int64_t j = 0; j < dk; j++) {
            const v8f kj = splat(kn[j]);
            float *row = s + j * dv;
            for (int64_t c = 0; c < dv; c += 8)
                store8(row + c, splat(d) * load8(row + c) + kj * load8(u + c));
        }
    }
}

/* One step of the causal depthwise conv for N sequences, each state [K-1, C] read and
   shifted in place in its slot (the caller applies silu, torch's vectorized one):
     out[i, c] = sum_{j<K-1} state[j, c] * w[j, c] + x[i, c] * w[K-1, c]
   then state = state[1:] + [x[i]]. The sum runs in tap order, as the torch form's.
   conv_state: [slots, K-1, C] contiguous; x: rows of stride x_rs; wt: [K, C] (the conv
   weight transposed); out: [N, C] contiguous. C % 8 == 0. */
void conv_decode_f32(float *conv_state, const int64_t *slots, const float *x, const float *wt,
                     float *out, int64_t n, int64_t channels, int64_t width, int64_t x_rs) {
    #pragma omp parallel for schedule(static) if (n >= PARALLEL_MIN)
    for (int64_t i = 0; i < n; i++) {
        float *st = conv_state + slots[i] * (width - 1) * channels;
        const float *xi = x + i * x_rs;
        for (int64_t c = 0; c < channels; c += 8) {
            v8f acc = load8(st + c) * load8(wt + c);
            for (int64_t j = 1; j < width - 1; j++)
                acc += load8(st + j * channels + c) * load8(wt + j * channels + c);
            const v8f xc = load8(xi + c);
            acc += xc * load8(wt + (width - 1) * channels + c);
            for (int64_t j = 0; j + 1 < width - 1; j++)
                store8(st + j * channels + c, load8(st + (j + 1) * channels + c));
            store8(st + (width - 2) * channels + c, xc);
            store8(out + i * channels + c, acc);
        }
    }
}
