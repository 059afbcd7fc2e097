"""C kernels built for this CPU on first use, the way torch's inductor builds its CPU
kernels: a `.c` file beside the module that loads it, compiled with the system's C compiler
(-O3 -march=native, OpenMP through torch's own runtime), kept in the cache folder under a
name keyed by the source and the headers beside it, the flags and the CPU's feature flags
(~1 s the first time on a machine, then a file), loaded with ctypes. The sources use the
compiler's vector extensions (v8f.h: 8 floats per vector, no intrinsics), so one source
serves x86-64 and Arm.

FLATSERVE_KERNEL_MARCH (default `native`) is the `-march` the kernels are built for:
`x86-64-v3` builds them for AVX2 and FMA only, so that a machine with AVX-512 can run the
numerical tests on the code a machine without it runs. The flags are in the cache key: each
value's library is a file of its own.

`-mtune=generic` on every build: GCC's tuning for some CPUs (AMD Zen 2-4, with
`-march=native`) leaves a multiply and an add unfused where generic tuning fuses them (an FMA,
one rounding instead of two), so the same source gave other bits on a Zen than the x86-64-v3
build the AVX2 tests run. With generic tuning the fused operations follow the source and the
ISA only: every x86-64 with AVX2 and FMA computes the same bits."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from shared.cache_dir import default_cache_dir

logger = logging.getLogger(__name__)


def flags() -> tuple[str, ...]:
    """The compiler's flags, for the -march FLATSERVE_KERNEL_MARCH names (default native)."""
    march = os.environ.get("FLATSERVE_KERNEL_MARCH") or "native"
    return ("-O3", f"-march={march}", "-mtune=generic", "-fopenmp", "-shared", "-fPIC")


def _cpu_flags() -> str:
    """This CPU's feature flags (a native build targets them)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def library_path(source: Path) -> Path:
    """Where the library of `source` built with the current flags is cached: its name keyed by
    the source, every header beside it (those it can include), the flags and the CPU."""
    texts = [source.read_text()] + [h.read_text() for h in sorted(source.parent.glob("*.h"))]
    key = "".join(texts) + " ".join(flags()) + _cpu_flags()
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return default_cache_dir() / "kernels" / f"{source.stem}_{digest}.so"


def _build(source: Path, path: Path) -> None:
    """Compile `source` to `path` (atomically: engines starting together may race)."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler (cc or gcc) on PATH")
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        out = Path(tmp) / path.name
        subprocess.run([compiler, *flags(), "-I", str(source.parent), str(source),
                        "-o", str(out)], check=True, capture_output=True, timeout=120)
        os.replace(out, path)


def load(source: Path, switch: str, fallback: str,
         signatures: dict[str, tuple[list, object]]) -> ctypes.CDLL | None:
    """The built library of the C file `source` with each function's (argtypes, restype)
    set, or None where the environment variable `switch` is "0" (to measure what the kernels
    change) or they cannot be built or loaded here (logged once, with `fallback`: what runs
    instead)."""
    if os.environ.get(switch, "1") == "0":
        return None
    try:
        path = library_path(source)
        if not path.exists():
            _build(source, path)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        logger.warning("%s kernels unavailable (%s%s); %s", source.stem, e,
                       f": {detail.decode(errors='replace')[:500]}" if detail else "", fallback)
        return None
    for function, (argtypes, restype) in signatures.items():
        getattr(lib, function).argtypes = argtypes
        getattr(lib, function).restype = restype
    return lib
