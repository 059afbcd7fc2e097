"""C kernels built for this CPU on first use, the way torch's inductor builds its CPU
kernels: a source compiled with the system's C compiler (-O3 -march=native, OpenMP through
torch's own runtime), kept in the cache folder under a name keyed by the source, the flags
and the CPU's feature flags (~1 s the first time on a machine, then a file), loaded with
ctypes. The sources use the compiler's vector extensions (`V8F_HELPERS`: 8 floats per
vector, no intrinsics), so one source serves x86-64 and Arm."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from shared.random_checkpoints.writer import default_cache_dir

logger = logging.getLogger(__name__)

FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")

# 8 floats in one vector (GCC >= 12 and Clang vector extensions: AVX/AVX2 registers on
# x86-64, pairs of NEON registers on Arm), with loads and stores that need no alignment.
V8F_HELPERS = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

static inline v8f load8(const float *p) { v8f v; memcpy(&v, p, sizeof v); return v; }
static inline void store8(float *p, v8f v) { memcpy(p, &v, sizeof v); }
static inline v8f splat(float x) { v8f v = {x, x, x, x, x, x, x, x}; return v; }
"""


def _cpu_flags() -> str:
    """This CPU's feature flags (the build targets them: -march=native)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def library_path(name: str, source: str) -> Path:
    key = source + " ".join(FLAGS) + _cpu_flags()
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return default_cache_dir() / "kernels" / f"{name}_{digest}.so"


def _build(source: str, path: Path) -> None:
    """Compile `source` to `path` (atomically: engines starting together may race)."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler (cc or gcc) on PATH")
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        src = Path(tmp) / (path.stem + ".c")
        src.write_text(source)
        out = Path(tmp) / path.name
        subprocess.run([compiler, *FLAGS, str(src), "-o", str(out)], check=True,
                       capture_output=True, timeout=120)
        os.replace(out, path)


def load(name: str, source: str, switch: str, fallback: str,
         signatures: dict[str, tuple[list, object]]) -> ctypes.CDLL | None:
    """The built library of `source` with each function's (argtypes, restype) set, or None
    where the environment variable `switch` is "0" (to measure what the kernels change) or
    they cannot be built or loaded here (logged once, with `fallback`: what runs instead)."""
    if os.environ.get(switch, "1") == "0":
        return None
    path = library_path(name, source)
    try:
        if not path.exists():
            _build(source, path)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        logger.warning("%s kernels unavailable (%s%s); %s", name, e,
                       f": {detail.decode(errors='replace')[:500]}" if detail else "", fallback)
        return None
    for function, (argtypes, restype) in signatures.items():
        getattr(lib, function).argtypes = argtypes
        getattr(lib, function).restype = restype
    return lib
