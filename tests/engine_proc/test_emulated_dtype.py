"""An engine asked for bf16/fp16 on a CPU without AVX-512 says that it will be slow."""

import logging

import pytest
import torch

from engine_proc.model_runner import warn_if_emulated


@pytest.mark.parametrize(("capability", "dtype", "warns"), [
    ("AVX2", torch.bfloat16, True),
    ("DEFAULT", torch.float16, True),
    ("AVX512", torch.bfloat16, False),
    ("AVX2", torch.float32, False),
])
def test_warns_only_for_emulated_half_precision(monkeypatch, caplog, capability, dtype, warns):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    with caplog.at_level(logging.WARNING, logger="engine_proc.model_runner"):
        warn_if_emulated(torch.device("cpu"), dtype)
    assert ("consider --dtype float32" in caplog.text) == warns


def test_no_warning_off_the_cpu(monkeypatch, caplog):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    with caplog.at_level(logging.WARNING, logger="engine_proc.model_runner"):
        warn_if_emulated(torch.device("cuda"), torch.bfloat16)
    assert not caplog.text
