"""Per-forward attention metadata, set by the model runner before a forward and cleared after.

Keeps model forward signatures at (input_ids, positions). One forward runs a flat batch of
tokens from several sequences, each a contiguous span: a prefill chunk (q_len >= 1 new
tokens after `context_len - q_len` cached ones) or a decode step (q_len == 1).

Contract between the model runner (writes it) and layers/attention.py (reads it):
- query_start_loc: int32 [num_seqs + 1], prefix sums of q_len over the flat token axis.
- seq_lens:        int32 [num_seqs], tokens in the KV cache for the sequence *after* this
                   forward writes its new keys (cached + q_len).
- slot_mapping:    int64 [num_tokens], flat cache slot (block_id * block_size + offset)
                   where each new token's K/V is written.
- block_tables:    int32 [num_seqs, max_blocks], padded with -1.
- max_q_len / max_seq_len: python ints, so layers need no device->host sync.
- num_decodes:     python int, the number of leading q_len == 1 sequences (decodes come
                   first in the flat batch), so attention can split them off the padded
                   prefill path without a host sync; None if unknown.
- q_lens_host / seq_lens_host: python lists, q_len and seq_len of every sequence, so
                   attention can run prefills one sequence at a time without a host sync;
                   None if unknown.
- state_slots:     int64 [num_seqs], hybrid models only: each sequence's slot in the
                   Gated DeltaNet layers' state (layers/gated_delta_net.py); None otherwise.
- state_slots_host: the same as a python list (None in an all-decode step, which needs
                   only the device tensor).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Context:
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    max_q_len: int
    max_seq_len: int
    all_decode: bool = False
    num_decodes: int | None = None
    q_lens_host: list[int] | None = None
    seq_lens_host: list[int] | None = None
    state_slots: torch.Tensor | None = None
    state_slots_host: list[int] | None = None


_CONTEXT: Context | None = None


def set_context(context: Context) -> None:
    global _CONTEXT
    _CONTEXT = context


def get_context() -> Context:
    if _CONTEXT is None:
        raise RuntimeError("attention called outside a model-runner forward")
    return _CONTEXT


def reset_context() -> None:
    global _CONTEXT
    _CONTEXT = None
