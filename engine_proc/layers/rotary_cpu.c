/* Rotary embedding in place, float32 on a CPU. Built and loaded by rotary_cpu.py (its
   docstring says why) through native_build.py. */
#include "v8f.h"

#define PARALLEL_MIN 65536 /* elements below which one thread does the whole call */

/* x: rows x heads heads of 2 * half floats (row stride rs, head stride hs, each head
   contiguous); cos, sin: rows x half, contiguous. Rotates each head in place:
   x1' = x1 * c - x2 * s, x2' = x2 * c + x1 * s, every product rounded before the sum as
   torch's separate ops do (fp-contract off: no FMA). half % 8 == 0. */
__attribute__((optimize("fp-contract=off")))
void rotary_f32(float *x, const float *cos, const float *sin, int64_t rows, int64_t heads,
                int64_t half, int64_t rs, int64_t hs) {
    #pragma omp parallel for schedule(static) if (rows * heads * half * 2 >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos + r * half, *s = sin + r * half;
        for (int64_t h = 0; h < heads; h++) {
            float *x1 = x + r * rs + h * hs, *x2 = x1 + half;
            for (int64_t j = 0; j < half; j += 8) {
                const v8f a = load8(x1 + j), b = load8(x2 + j);
                const v8f cj = load8(c + j), sj = load8(s + j);
                const v8f b_s = b * sj, a_s = a * sj, a_c = a * cj, b_c = b * cj;
                store8(x1 + j, a_c - b_s);
                store8(x2 + j, b_c + a_s);
            }
        }
    }
}
