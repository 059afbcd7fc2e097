"""Decode attention straight from the paged KV cache, on a CPU in float32.

torch has no paged attention for the CPU: the portable path (engine_proc/layers/attention.py)
copies every decoding sequence's cached keys and values out of their blocks into one padded
tensor per layer (`index_select`), then runs SDPA over the copy. At image-sized contexts
that copy and the second read of it are most of a decode step: 32 sequences at 1,408 tokens
of context (a 1024px image), tiny model, 21 ms a step, 70% of it in the gather and SDPA.

This kernel reads each sequence's keys and values once, in place, through its block table:
per (sequence, kv head), in parallel over both (OpenMP: torch's own runtime, so torch's
thread count), the dot products of the head's query group with 8 keys at a time (summed
together by a transpose-and-add tree, not one horizontal sum per key), an exp over 8 scores
at a time, then the weighted sum of the values; the next block's rows are prefetched, as
blocks lie anywhere in the cache. Written in C with the compiler's vector extensions (8
floats per vector; no intrinsics, so one source for x86-64 and Arm), compiled with the
system's C compiler for this CPU on first use (~1 s, kept in the cache folder; the way
torch's inductor builds its CPU kernels) and loaded with ctypes. Without a compiler, or if
the build fails, `kernel()` is None and decodes keep the gather + SDPA path. Results differ
from SDPA's by float32 rounding (another summation order; an exp accurate to ~2 ulp).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from shared.random_checkpoints.writer import default_cache_dir

logger = logging.getLogger(__name__)

SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* 8 floats in one vector (GCC >= 12 and Clang vector extensions: AVX/AVX2 registers on
   x86-64, pairs of NEON registers on Arm) */
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

static inline v8f load8(const float *p) { v8f v; memcpy(&v, p, sizeof v); return v; }
static inline void store8(float *p, v8f v) { memcpy(p, &v, sizeof v); }
static inline v8f splat(float x) { v8f v = {x, x, x, x, x, x, x, x}; return v; }

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

/* ask for a block's rows of one head before they are needed: blocks lie anywhere in the
   cache, so the hardware prefetcher cannot guess them */
static inline void prefetch_block(const float *p, int64_t bs, int64_t row, int64_t width) {
    for (int64_t t = 0; t < bs; t++)
        for (int64_t e = 0; e < width; e += 16) __builtin_prefetch(p + t * row + e, 0, 3);
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
   contiguous), the next one prefetched while this one is worked on. */
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
            if (t0 + bs < len) prefetch_block(kc + table[t0 / bs + 1] * bs * row, bs, row, row);
            for (int64_t h = 0; h < kvh; h++) {
                for (int64_t t8 = 0; t8 < n; t8 += 8) {
                    const int64_t m = n - t8 < 8 ? n - t8 : 8;
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
            if (t0 + bs < len) prefetch_block(vc + table[t0 / bs + 1] * bs * row, bs, row, row);
            for (int64_t i = 0; i < heads; i++) {
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
"""

FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")


def _cpu_flags() -> str:
    """This CPU's feature flags (the build targets them: -march=native)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _library_path() -> Path:
    key = SOURCE + " ".join(FLAGS) + _cpu_flags()
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return default_cache_dir() / "kernels" / f"paged_decode_{digest}.so"


def _build(path: Path) -> None:
    """Compile SOURCE to `path` (atomically: engines starting together may race)."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler (cc or gcc) on PATH")
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        src = Path(tmp) / "paged_decode.c"
        src.write_text(SOURCE)
        out = Path(tmp) / path.name
        subprocess.run([compiler, *FLAGS, str(src), "-o", str(out)], check=True,
                       capture_output=True, timeout=120)
        os.replace(out, path)


@functools.cache
def kernel():
    """The compiled kernel's function, or None where it cannot be built or loaded here
    (FLATSERVE_PAGED_DECODE_KERNEL=0 turns it off, to measure what it changes)."""
    if os.environ.get("FLATSERVE_PAGED_DECODE_KERNEL", "1") == "0":
        return None
    path = _library_path()
    try:
        if not path.exists():
            _build(path)
        fn = ctypes.CDLL(str(path)).paged_decode_f32
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        logger.warning("paged decode kernel unavailable (%s%s); decodes gather their KV for SDPA",
                    e, f": {detail.decode(errors='replace')[:500]}" if detail else "")
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, ptr, ptr, ptr, i64, ptr, ptr, i64, i64, i64, i64, i64, ctypes.c_float]
    fn.restype = None
    return fn


def supports(head_dim: int, block_size: int) -> bool:
    """Whether the kernel runs these shapes (it works in vectors of 8 floats), and is built."""
    return head_dim % 8 == 0 and block_size % 8 == 0 and kernel() is not None


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, heads, D] (one query per sequence), caches [blocks, block_size, kv_heads, D],
    block_tables int64 [B, n] (valid ids for every block a sequence's seq_lens covers),
    seq_lens int64 [B] -> [B, heads, D]. float32 on the CPU, contiguous caches (as the
    model runner allocates them), and `supports(D, block_size)`."""
    b, heads, d = q.shape
    _, bs, kvh, _ = k_cache.shape
    q = q.contiguous()
    tables = block_tables if block_tables.stride(1) == 1 else block_tables.contiguous()
    lens = seq_lens.contiguous()
    out = torch.empty_like(q)
    kernel()(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
             tables.stride(0), lens.data_ptr(), out.data_ptr(), b, kvh, heads // kvh, d, bs,
             scale)
    return out
