"""An engine process sees a new token count almost every step; with oneDNN's default kernel
caches each new shape of a bf16 matmul keeps ~0.5 MB for good. Spawned engines run with the
caches bounded (shared/memory.py KERNEL_CACHE_ENV), so the same loop stays flat."""

import os
import subprocess
import sys

import pytest
import torch

from api_proc.launcher import engine_env
from shared.memory import bound_kernel_caches

# RSS growth from the 200th to the 600th distinct shape, in MB.
NEW_SHAPES = """
import psutil, torch
torch.set_num_threads(1)
weight = torch.randn(512, 256, dtype=torch.bfloat16)
rss = []
for m in range(1, 601):
    torch.nn.functional.linear(torch.randn(m * 3, 256, dtype=torch.bfloat16), weight)
    if m in (200, 600):
        rss.append(psutil.Process().memory_info().rss)
print((rss[1] - rss[0]) / 2**20)
"""


def growth_mb(env: dict[str, str]) -> float:
    out = subprocess.run([sys.executable, "-c", NEW_SHAPES], env=env, capture_output=True,
                         text=True, check=True, timeout=120)
    return float(out.stdout)


def test_spawned_engines_get_bounded_kernel_caches(monkeypatch):
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    monkeypatch.delenv("LRU_CACHE_CAPACITY", raising=False)
    env = engine_env()
    assert env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "64" and env["LRU_CACHE_CAPACITY"] == "64"
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "512")  # an explicit setting wins
    assert engine_env()["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "512"


def test_an_engine_started_by_hand_bounds_its_own_caches(monkeypatch):
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "128")
    bound_kernel_caches()  # what engine_proc.main runs before it builds the model
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "64"
    assert os.environ["LRU_CACHE_CAPACITY"] == "128"


def test_bf16_matmuls_over_new_shapes_stay_flat_in_an_engine_environment(monkeypatch):
    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch build: no kernel cache to bound")
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    monkeypatch.delenv("LRU_CACHE_CAPACITY", raising=False)
    assert growth_mb(engine_env()) < 40  # ~320 MB with oneDNN's default caches
