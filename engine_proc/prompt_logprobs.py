"""Prompt log-probabilities (vLLM's prompt_logprobs): for every prompt token after the
first, its log-probability under the model's raw distribution at the row before it, its
rank there (1: the most likely) and the k most likely tokens. Computed from the logits of
a prefill chunk's rows (the scheduler caps those rows per step), a slice of rows at a time
so that the log-softmax copy stays small; only requests that ask pay for it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine_proc.sequence import Sequence

SLICE_ROWS = 128  # rows per log-softmax: [SLICE_ROWS, vocab] floats at a time


@dataclass
class PromptRows:
    """A step's prompt rows: `rows` index the step's tokens (the row before each target),
    `targets` are the prompt tokens they score; `spans` say whose they are, in order."""

    rows: np.ndarray  # int64 [P]
    targets: np.ndarray  # int64 [P]
    spans: list[tuple[Sequence, int]]  # (sequence, number of its rows)

    @classmethod
    def of_chunks(cls, chunks: list[tuple[Sequence, int, int, int]]) -> PromptRows | None:
        """`chunks`: (sequence, first row of its chunk in the step, chunk start, chunk end)
        of the prefill chunks in the step; None when no sequence wants prompt rows."""
        rows, targets, spans = [], [], []
        for seq, row0, start, end in chunks:
            if not seq.wants_prompt_logprobs:
                continue
            first = max(start + 1, len(seq.prompt_logprobs) + 1)  # targets not yet scored
            last = min(end, seq.num_prompt_tokens - 1)  # the last target this chunk scores
            if first > last:
                continue
            positions = np.arange(first, last + 1)
            rows.append(row0 + positions - 1 - start)
            targets.append(np.asarray(seq.token_ids[first:last + 1], dtype=np.int64))
            spans.append((seq, len(positions)))
        if not spans:
            return None
        return cls(np.concatenate(rows).astype(np.int64), np.concatenate(targets), spans)


def score(logits: torch.Tensor, rows: PromptRows) -> None:
    """Append each sequence's entries ([logprob, rank, top ids, top logprobs]) to its
    prompt_logprobs; `logits` [P, vocab] are the rows' logits, in order."""
    k = max(seq.sampling.prompt_logprobs for seq, _ in rows.spans)
    targets = torch.from_numpy(rows.targets).to(logits.device)
    entries: list[list] = []
    for start in range(0, logits.shape[0], SLICE_ROWS):
        part = torch.log_softmax(logits[start:start + SLICE_ROWS].float(), dim=-1)
        target = targets[start:start + SLICE_ROWS].unsqueeze(1)
        chosen = part.gather(1, target)
        ranks = (part > chosen).sum(dim=1) + 1
        top = part.topk(k, dim=-1) if k else None
        top_ids = top.indices.tolist() if top is not None else [[] for _ in range(len(part))]
        top_values = top.values.tolist() if top is not None else [[] for _ in range(len(part))]
        entries += [[lp, rank, ids, values] for lp, rank, ids, values in zip(
            chosen.squeeze(1).tolist(), ranks.tolist(), top_ids, top_values, strict=True)]
        del part
    at = 0
    for seq, n in rows.spans:
        want = seq.sampling.prompt_logprobs
        seq.prompt_logprobs += [[lp, rank, ids[:want], values[:want]]
                                for lp, rank, ids, values in entries[at:at + n]]
        at += n
