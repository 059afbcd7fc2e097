/* 8 floats in one vector (GCC >= 12 and Clang vector extensions: AVX/AVX2 registers on
   x86-64, pairs of NEON registers on Arm), with loads and stores that need no alignment.
   Included by every kernel source in this folder. */
#ifndef FLATSERVE_V8F_H
#define FLATSERVE_V8F_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

static inline v8f load8(const float *p) { v8f v; memcpy(&v, p, sizeof v); return v; }
static inline void store8(float *p, v8f v) { memcpy(p, &v, sizeof v); }
static inline v8f splat(float x) { v8f v = {x, x, x, x, x, x, x, x}; return v; }

#endif
