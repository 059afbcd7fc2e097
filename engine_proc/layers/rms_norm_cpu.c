/* RMSNorm with the residual add before it, float32 on a CPU. Built and loaded by
   rms_norm_cpu.py (its docstring says why) through native_build.py. */
#include "v8f.h"

#define PARALLEL_MIN 65536 /* elements below which one thread does the whole call */

/* out = w * h / sqrt(mean(h^2) + eps) per row of n floats, h = x, or with res (not NULL)
   h = x + res, written to sum_out. n % 8 == 0; rows contiguous. */
void rms_norm_f32(const float *x, const float *res, float *sum_out, float *out,
                  const float *w, int64_t rows, int64_t n, float eps) {
    #pragma omp parallel for schedule(static) if (rows * n >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const float *h = x + r * n;
        v8f ss = splat(0.0f);
        if (res) {
            const float *rr = res + r * n;
            float *sr = sum_out + r * n;
            for (int64_t j = 0; j < n; j += 8) {
                const v8f v = load8(h + j) + load8(rr + j);
                store8(sr + j, v);
                ss += v * v;
            }
            h = sr;
        } else {
            for (int64_t j = 0; j < n; j += 8) { const v8f v = load8(h + j); ss += v * v; }
        }
        float s = 0.0f;
        for (int k = 0; k < 8; k++) s += ss[k];
        const float inv = 1.0f / sqrtf(s / (float)n + eps);
        float *o = out + r * n;
        for (int64_t j = 0; j < n; j += 8) store8(o + j, load8(h + j) * inv * load8(w + j));
    }
}
