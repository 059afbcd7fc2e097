"""The recurrent state of hybrid models (Qwen3.5's Gated DeltaNet layers), beside the paged
KV cache: one fixed-size slot per running sequence, whatever its length.

A slot holds, for every linear layer, the conv state (the last K-1 inputs of its q/k/v
channels, model dtype) and the recurrent state (Hv matrices of dk x dv, fp32 unless set
otherwise). The tensors are allocated once, at start, inside the engine's memory budget
and before the KV blocks (`plan_state_slots`); the scheduler hands slots out
(`StateSlots`): one per admitted sequence, back on finish, abort, failure or preemption.
A slot is never cleared: a sequence's first chunk starts from zeros, not from its slot
(layers/gated_delta_net.py), so nothing of an earlier owner is read.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from shared.model_config import TextConfig

logger = logging.getLogger(__name__)


class StateSlots:
    """Free list of state slots (the scheduler's, as the block manager is the KV's)."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.free_slots = list(range(num_slots - 1, -1, -1))  # pop() takes the lowest first

    @property
    def num_free(self) -> int:
        return len(self.free_slots)

    def take(self) -> int:
        if not self.free_slots:
            raise RuntimeError(f"all {self.num_slots} state slots are taken")
        return self.free_slots.pop()

    def free(self, slot: int) -> None:
        self.free_slots.append(slot)


@dataclass(frozen=True)
class StateShape:
    """One rank's state tensors per slot and linear layer."""

    num_layers: int
    conv_channels: int
    conv_width: int  # K - 1 kept inputs
    num_heads: int  # value heads
    key_dim: int
    value_dim: int
    conv_dtype: torch.dtype
    ssm_dtype: torch.dtype

    @classmethod
    def of(cls, text: TextConfig, tp_size: int, dtype: torch.dtype,
           ssm_dtype: torch.dtype) -> StateShape:
        return cls(text.num_linear_layers, text.linear_conv_dim // tp_size,
                   text.linear_conv_kernel_dim - 1, text.linear_num_value_heads // tp_size,
                   text.linear_key_head_dim, text.linear_value_head_dim, dtype, ssm_dtype)

    @property
    def slot_bytes(self) -> int:
        conv = self.conv_channels * self.conv_width * self.conv_dtype.itemsize
        ssm = self.num_heads * self.key_dim * self.value_dim * self.ssm_dtype.itemsize
        return self.num_layers * (conv + ssm)


def plan_state_slots(max_num_seqs: int, slot_bytes: int, budget_bytes: int,
                     full_sequence_kv_bytes: int) -> int:
    """How many slots an explicit budget can give, keeping room for the KV of one
    sequence of max_model_len tokens: `max_num_seqs`, or fewer (logged), or none fits
    (ValueError, one line)."""
    room = budget_bytes - full_sequence_kv_bytes
    fits = room // slot_bytes if room > 0 else 0
    if fits < 1:
        raise ValueError(
            f"the KV cache budget of {budget_bytes:,} bytes cannot hold one sequence's "
            f"recurrent state ({slot_bytes:,} bytes) plus the KV cache of one max_model_len "
            f"sequence ({full_sequence_kv_bytes:,} bytes): raise --kv-cache-memory-bytes or "
            "lower --max-model-len")
    if fits < max_num_seqs:
        logger.warning("max_num_seqs lowered from %d to %d: each running sequence needs a "
                       "recurrent state slot of %.1f MiB and the KV cache budget holds %d "
                       "beside one max_model_len sequence", max_num_seqs, fits,
                       slot_bytes / 2**20, fits)
        return int(fits)
    return max_num_seqs


def allocate_state_cache(model: nn.Module, shape: StateShape, num_slots: int,
                         device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed conv [layers, slots, K-1, channels] (time-major: a step appends a row) and
    recurrent [layers, slots, Hv, dk, dv] tensors, each linear layer given its views."""
    layers = [m for m in model.modules() if hasattr(m, "conv_state") and hasattr(m, "ssm_state")]
    if len(layers) != shape.num_layers:
        raise RuntimeError(f"found {len(layers)} linear-attention layers, expected "
                           f"{shape.num_layers}")
    conv = torch.zeros((shape.num_layers, num_slots, shape.conv_width, shape.conv_channels),
                       dtype=shape.conv_dtype, device=device)
    ssm = torch.zeros((shape.num_layers, num_slots, shape.num_heads, shape.key_dim,
                       shape.value_dim), dtype=shape.ssm_dtype, device=device)
    for i, layer in enumerate(layers):
        layer.use_states(conv[i], ssm[i])
    return conv, ssm
