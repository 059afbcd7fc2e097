"""The GPU kernels check themselves once per device at first use (a small run against their
torch forms): the paged decode attention, Qwen3.5's decode kernels, the norm and rotary.
One that fails to compile or computes wrong is off with a warning and the layers keep their
torch paths; one that agrees is used. Without a GPU the probes run in Triton's interpreter
in float16 (the interpreter's bfloat16 is not the card's); on a GPU in bfloat16."""

from __future__ import annotations

import pytest
import torch

from tests.triton_device import DEVICE, ON_CUDA, runs_triton

pytest.importorskip("triton")
from engine_proc.layers import (  # noqa: E402
    attention,
    gated_delta_net,
    gated_delta_rule_triton,
    kernel_check,
    paged_decode_attention_triton,
    rms_norm,
    rms_norm_triton,
    rotary_embedding,
    rotary_triton,
)
from tests.engine_proc.test_gated_delta_rule_fla import varlen_torch_rule  # noqa: E402

pytestmark = runs_triton

# (the module that picks the kernel, its probed lookup, the kernel module, an entry to break)
PROBES = {
    "paged decode attention": (attention, "_triton_decode_module",
                               paged_decode_attention_triton, "paged_decode_attention"),
    "gated delta rule": (gated_delta_net, "_triton_kernels", gated_delta_rule_triton,
                         "gated_delta_rule_decode_"),
    "rms norm": (rms_norm, "_triton_module", rms_norm_triton, "rms_norm"),
    "rotary": (rotary_embedding, "_triton_module", rotary_triton, "rotate_"),
}


@pytest.fixture
def probe(request, monkeypatch):
    owner, name, module, entry = PROBES[request.param]
    if not ON_CUDA:  # the interpreter's bfloat16 is not the card's
        monkeypatch.setattr(kernel_check, "PROBE_DTYPE", torch.float16)
    lookup = getattr(owner, name)
    lookup.cache_clear()
    yield lookup, module, entry
    lookup.cache_clear()


@pytest.mark.parametrize("probe", list(PROBES), indirect=True)
def test_a_kernel_that_agrees_with_its_torch_form_is_used(probe):
    lookup, module, _ = probe
    assert lookup(DEVICE) is module


@pytest.mark.parametrize("probe", list(PROBES), indirect=True)
def test_a_kernel_that_fails_its_probe_is_off_with_a_warning(probe, monkeypatch, caplog):
    lookup, module, entry = probe
    monkeypatch.setattr(module, entry, lambda *args, **kwargs: 1 / 0)
    assert lookup(DEVICE) is None
    assert "off (division by zero)" in caplog.text


@pytest.mark.parametrize("probe", ["rms norm"], indirect=True)
def test_a_kernel_that_computes_wrong_is_off(probe, monkeypatch, caplog):
    lookup, module, entry = probe
    kernel = getattr(module, entry)

    def off_by_a_percent(*args, **kwargs):
        out = kernel(*args, **kwargs)
        return out * 1.01 if isinstance(out, torch.Tensor) else (out[0] * 1.01, out[1])

    monkeypatch.setattr(module, entry, off_by_a_percent)
    assert lookup(DEVICE) is None
    assert "disagrees" in caplog.text


@pytest.mark.parametrize("rule,used", [(varlen_torch_rule, True), (lambda *a, **k: 1 / 0, False)])
def test_flash_linear_attention_is_used_only_where_its_probe_agrees(rule, used, monkeypatch,
                                                                      caplog):
    """The prefill rule's probe, through `prefill_` as a step calls it (slots out of order,
    one chunk from its state, one from zeros): a rule that agrees is used; one that raises
    is off with a warning. (FLA itself runs only on a GPU: gpu_checks' `tests`.)"""
    from engine_proc.layers import gated_delta_rule_fla as fla

    monkeypatch.setattr(fla, "chunk_rule", lambda: rule)
    fla._checked_rule.cache_clear()
    try:
        assert (fla._checked_rule(torch.device("cpu")) is rule) == used
        # at a layer's own dims (two value heads per key head, dk != dv) as well
        assert (fla._checked_rule(torch.device("cpu"), (2, 4, 16, 24)) is rule) == used
        assert used or "flash-linear-attention's is off (division by zero)" in caplog.text
    finally:
        fla._checked_rule.cache_clear()
