"""The C kernels' sources: files beside their modules that build, a cache key that follows
the headers they include, and a build for another ISA (FLATSERVE_KERNEL_MARCH) that lives
beside the native one and computes the same bits."""

import os
import platform
import shutil
from pathlib import Path

import pytest
import torch

from engine_proc.layers import native_build, paged_attention_cpu, rms_norm_cpu, rotary_cpu

MODULES = [paged_attention_cpu, rms_norm_cpu, rotary_cpu]

pytestmark = pytest.mark.skipif(
    not (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")),
    reason="no C compiler to build the kernels")


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FLATSERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("FLATSERVE_KERNEL_MARCH", raising=False)


def _build(module):
    """The module's library, built now into the test's cache (not its cached `library()`)."""
    lib = native_build.load(module.SOURCE, "FLATSERVE_TEST_KERNELS_OFF", "the test fails",
                            module.SIGNATURES)
    assert lib is not None, "the build failed: see the logged warning"
    return lib


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__.rsplit(".", 1)[1])
def test_each_source_is_a_file_beside_its_module_and_builds(module):
    assert module.SOURCE == Path(module.__file__).with_suffix(".c")
    assert module.SOURCE.is_file()
    assert '#include "v8f.h"' in module.SOURCE.read_text()
    _build(module)
    assert native_build.library_path(module.SOURCE).exists()


def test_the_cache_key_follows_the_header(tmp_path):
    folder = tmp_path / "src"
    folder.mkdir()
    source = folder / "rotary_cpu.c"
    shutil.copy(rotary_cpu.SOURCE, source)
    shutil.copy(rotary_cpu.SOURCE.parent / "v8f.h", folder / "v8f.h")
    before = native_build.library_path(source)
    assert before == native_build.library_path(rotary_cpu.SOURCE)  # keyed on text, not place
    with open(folder / "v8f.h", "a") as f:
        f.write("/* edited */\n")
    assert native_build.library_path(source) != before


def _avx2_machine() -> bool:
    if platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        with open("/proc/cpuinfo") as f:
            cpu = set(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return False
    return {"avx2", "fma", "bmi2", "movbe"} <= cpu


def _rms_norm_call(lib):
    gen = torch.Generator().manual_seed(0)
    x, residual = torch.randn(300, 256, generator=gen), torch.randn(300, 256, generator=gen)
    weight = torch.randn(256, generator=gen)
    out, total = torch.empty_like(x), torch.empty_like(x)
    lib.rms_norm_f32(x.data_ptr(), residual.data_ptr(), total.data_ptr(), out.data_ptr(),
                     weight.data_ptr(), 300, 256, 1e-6)
    return out, total


def _rotary_call(lib):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(300, 4, 64, generator=gen) * 5
    angles = torch.randn(300, 32, generator=gen) * 20
    cos, sin = angles.cos(), angles.sin()
    lib.rotary_f32(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), 300, 4, 32, x.stride(0),
                   x.stride(1))
    return (x,)


@pytest.mark.skipif(not _avx2_machine(), reason="x86-64-v3 code needs an x86-64 with AVX2")
@pytest.mark.parametrize("module, call", [(rms_norm_cpu, _rms_norm_call),
                                          (rotary_cpu, _rotary_call)], ids=["rms_norm", "rotary"])
def test_an_avx2_build_beside_the_native_one_gives_the_same_bits(module, call, monkeypatch):
    native = _build(module)
    native_path = native_build.library_path(module.SOURCE)
    monkeypatch.setenv("FLATSERVE_KERNEL_MARCH", "x86-64-v3")
    assert "-march=x86-64-v3" in native_build.flags()
    avx2 = _build(module)
    avx2_path = native_build.library_path(module.SOURCE)
    assert avx2_path != native_path and native_path.exists() and avx2_path.exists()
    for ours, want in zip(call(avx2), call(native), strict=True):
        assert torch.equal(ours, want)
