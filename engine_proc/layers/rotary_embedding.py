"""Rotary position embeddings with their cos/sin tables computed once at init.

Forward passes only gather rows of the tables (no cos/sin per step). Tables are computed
in fp32 on the CPU exactly as transformers does, then moved to the device; rotation uses
the half-split form x1*c - x2*s | x2*c + x1*s, which rounds exactly like HF's
x*cos + rotate_half(x)*sin.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from engine_proc.layers import kernel_check, rotary_cpu


def _inv_freq(dim: int, base: float) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float, device="cpu") / dim))


def apply_rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [N, heads, D] in place with half tables cos/sin [N, D/2] (broadcast over
    heads): no concatenations, two temporaries; in one pass on a CPU in float32
    (rotary_cpu.py) and on a GPU in 16 bits (rotary_triton.py), both bit-identical."""
    if rotary_cpu.applies(x, cos, sin):
        return rotary_cpu.rotate_(x, cos, sin)
    kernel = triton_rotary(x, cos, sin)
    if kernel is not None:
        return kernel.rotate_(x, cos, sin)
    return _rotate_torch_(x, cos, sin)


def _rotate_torch_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The torch form: the kernels' reference."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos = cos.unsqueeze(-2)
    sin = sin.unsqueeze(-2)
    x2_sin = x2 * sin
    x1_sin = x1 * sin
    x1.mul_(cos).sub_(x2_sin)
    x2.mul_(cos).add_(x1_sin)
    return x


def triton_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """rotary_triton's module for 16-bit tensors on a GPU with tables of their dtype (None
    elsewhere, without Triton, or where its first run on the device was not bit-identical
    to the torch form)."""
    if (not x.is_cuda or x.dtype not in (torch.float16, torch.bfloat16) or cos.dtype != x.dtype
            or sin.dtype != x.dtype or x.stride(-1) != 1 or cos.stride(-1) != 1
            or sin.stride(-1) != 1 or cos.shape[0] != x.shape[0] or sin.shape != cos.shape):
        return None
    return _triton_module(x.device)


@functools.cache
def _triton_module(device: torch.device):
    return kernel_check.checked(lambda: _probe(device), device, "rotary runs as torch ops",
                                "the Triton kernel is")


def _probe(device: torch.device):
    """The kernel module after one small run, bit-identical to the torch form."""
    from engine_proc.layers import rotary_triton

    gen = kernel_check.generator()
    x = torch.randn(4, 5, 64, generator=gen).to(device, kernel_check.PROBE_DTYPE)
    angles = torch.rand(4, 32, generator=gen).to(device) * 20
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    got = rotary_triton.rotate_(x.clone()[:, :3], cos, sin)
    want = _rotate_torch_(x.clone()[:, :3], cos, sin)
    kernel_check.agree(torch.equal(got, want), "its probe is not bit-identical to the torch form")
    return rotary_triton


def _axis_of_freq(mrope_section: tuple[int, int, int], interleaved: bool) -> torch.Tensor:
    """int64 [head_dim/2]: the position axis (0 t, 1 h, 2 w) of each rotary frequency."""
    if not interleaved:
        return torch.repeat_interleave(
            torch.arange(3, device="cpu"), torch.tensor(mrope_section, device="cpu"))
    freq = torch.arange(sum(mrope_section), device="cpu")
    axis = torch.zeros_like(freq)
    for a in (1, 2):
        axis[(freq % 3 == a) & (freq < 3 * mrope_section[a])] = a
    return axis


class MRotaryEmbedding(nn.Module):
    """Multimodal RoPE of the Qwen2-VL and Qwen3-VL decoders.

    Each frequency of the head takes its position from one of the three axes (temporal,
    height, width). Qwen2-VL: the first mrope_section[0] frequencies from axis 0, and so
    on. Qwen3-VL (`interleaved`): frequencies cycle t, h, w, h and w each stopping after
    their section, the rest from t.
    """

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        base: float,
        mrope_section: tuple[int, int, int],
        device: torch.device,
        dtype: torch.dtype,
        interleaved: bool = False,
    ) -> None:
        super().__init__()
        half = head_dim // 2
        if sum(mrope_section) != half:
            raise ValueError(f"mrope_section {mrope_section} does not cover {half} frequencies")
        freqs = torch.arange(max_position, dtype=torch.float, device="cpu")[:, None] * _inv_freq(
            head_dim, base
        )
        self.half = half
        self.max_position = max_position
        # Plain attributes, not buffers: they keep their dtype when the module is cast.
        self.cos_table = freqs.cos().to(device=device, dtype=dtype).reshape(-1)
        self.sin_table = freqs.sin().to(device=device, dtype=dtype).reshape(-1)
        self.axis_of_freq = _axis_of_freq(mrope_section, interleaved).to(device)
        self.freq_index = torch.arange(half, device=device)[:, None]

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions int64 [3, T] -> half tables (cos, sin), each [T, head_dim/2], contiguous
        (built in row order once a step, not copied by every layer that rotates)."""
        index = (positions[self.axis_of_freq] * self.half + self.freq_index).t().contiguous()
        return self.cos_table[index], self.sin_table[index]


class VisionRotaryEmbedding(nn.Module):
    """2-D rotary of the vision tower: half the frequencies follow the patch row, half the
    column. Tables cover `max_side` rows/columns and grow (rarely) for larger grids."""

    def __init__(self, head_dim: int, base: float, max_side: int, device: torch.device) -> None:
        super().__init__()
        self.quarter = head_dim // 4
        self.inv_freq = _inv_freq(head_dim // 2, base)
        self.device = device
        self.max_side = 0
        self._build(max_side)

    def _build(self, max_side: int) -> None:
        freqs = torch.arange(max_side, dtype=torch.float, device="cpu")[:, None] * self.inv_freq
        self.cos_table = freqs.cos().to(self.device)
        self.sin_table = freqs.sin().to(self.device)
        self.max_side = max_side

    def ensure_side(self, side: int) -> None:
        """Grow the tables to cover `side` (a host int: no device sync)."""
        if side > self.max_side:
            self._build(max(side, 2 * self.max_side))

    def forward(self, pos_hw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """pos_hw int64 [N, 2] (row, column) -> fp32 half tables (cos, sin) [N, head_dim/2]."""
        n = pos_hw.shape[0]
        return (
            self.cos_table[pos_hw].reshape(n, 2 * self.quarter),
            self.sin_table[pos_hw].reshape(n, 2 * self.quarter),
        )
