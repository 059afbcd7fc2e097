"""What requests change in their logits before sampling: presence, frequency and repetition
penalties, logit_bias, min_tokens (the stop tokens banned until then), and the token a
thinking_token_budget forces (engine_proc/thinking_budget.py).

Built once per step, only when some sampled request of the step asks for one of them, as a
few flat tensors on the logits' device; `apply` then works on the whole batch at once (the
penalised rows gathered, adjusted and written back; biases and bans as indexed writes), so
requests without any of these pay nothing and the cost does not grow with a loop over rows.
The token counts a penalty needs are rebuilt from the sequence's token ids each step: one
scatter over the rows' tokens, no state to keep in step with preemption or aborts.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import numpy as np
import torch

from engine_proc.sequence import Sequence


@dataclass
class LogitsAdjustments:
    # penalties, on the `rows` that have any
    rows: torch.Tensor | None  # int64 [P]
    output_counts: torch.Tensor | None  # float32 [P, V]: each token's count in the completion
    seen: torch.Tensor | None  # bool [P, V]: in the prompt or the completion (repetition)
    presence: torch.Tensor | None  # float32 [P, 1]
    frequency: torch.Tensor | None  # float32 [P, 1]
    repetition: torch.Tensor | None  # float32 [P, 1]
    # logit_bias: logits[bias_rows, bias_cols] += bias_values
    bias_rows: torch.Tensor | None
    bias_cols: torch.Tensor | None
    bias_values: torch.Tensor | None
    # min_tokens: logits[ban_rows, ban_cols] = -inf
    ban_rows: torch.Tensor | None
    ban_cols: torch.Tensor | None
    # thinking_token_budget: row force_rows[i] can only sample force_cols[i]
    force_rows: torch.Tensor | None = None
    force_cols: torch.Tensor | None = None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Adjust float32 logits [N, V] in place and return them."""
        if self.rows is not None:
            sub = logits[self.rows]
            if self.seen is not None:
                rep = self.repetition
                sub = torch.where(self.seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
            sub -= self.frequency * self.output_counts
            sub -= self.presence * (self.output_counts > 0)
            logits[self.rows] = sub
        if self.bias_rows is not None:
            logits.index_put_((self.bias_rows, self.bias_cols), self.bias_values, accumulate=True)
        if self.ban_rows is not None:
            logits[self.ban_rows, self.ban_cols] = -float("inf")
        if self.force_rows is not None:
            kept = logits[self.force_rows, self.force_cols]
            logits[self.force_rows] = -float("inf")
            logits[self.force_rows, self.force_cols] = kept
        return logits


def build_adjustments(seqs: Seq[Sequence], vocab: int, eos_token_ids: Seq[int],
                      to_device: Callable[[np.ndarray], torch.Tensor]
                      ) -> LogitsAdjustments | None:
    """The adjustments of the sampled sequences `seqs` (row i is seqs[i]); None when none
    of them asks for any."""
    if not any(s.adjusts_logits for s in seqs):
        return None
    penalised = [i for i, s in enumerate(seqs) if s.sampling.has_penalties]
    biased = [i for i, s in enumerate(seqs) if s.sampling.logit_bias]
    banned = [i for i, s in enumerate(seqs)
              if s.num_completion_tokens < s.sampling.min_tokens]
    forced = [(i, t) for i, s in enumerate(seqs) if s.thinking is not None
              and (t := s.thinking.forced_token()) is not None]
    if not (penalised or biased or banned or forced):
        return None
    out = LogitsAdjustments(*([None] * 11))
    if penalised:
        _penalties(out, [seqs[i] for i in penalised], penalised, vocab, to_device)
    if biased:
        pairs = [(i, t, b) for i in biased for t, b in seqs[i].sampling.logit_bias]
        rows, cols, values = zip(*pairs, strict=True)
        out.bias_rows = to_device(np.asarray(rows, dtype=np.int64))
        out.bias_cols = to_device(np.asarray(cols, dtype=np.int64))
        out.bias_values = to_device(np.asarray(values, dtype=np.float32))
    if banned:
        pairs = [(i, t) for i in banned for t in _stop_tokens(seqs[i], eos_token_ids)]
        if pairs:
            rows, cols = zip(*pairs, strict=True)
            out.ban_rows = to_device(np.asarray(rows, dtype=np.int64))
            out.ban_cols = to_device(np.asarray(cols, dtype=np.int64))
    if forced:
        rows, cols = zip(*forced, strict=True)
        out.force_rows = to_device(np.asarray(rows, dtype=np.int64))
        out.force_cols = to_device(np.asarray(cols, dtype=np.int64))
    return out


def _stop_tokens(seq: Sequence, eos_token_ids: Seq[int]) -> set[int]:
    stops = set(seq.sampling.stop_token_ids)
    if not seq.sampling.ignore_eos:
        stops.update(eos_token_ids)
    return stops


def _penalties(out: LogitsAdjustments, seqs: list[Sequence], rows: list[int], vocab: int,
               to_device: Callable[[np.ndarray], torch.Tensor]) -> None:
    params = [s.sampling for s in seqs]
    out.rows = to_device(np.asarray(rows, dtype=np.int64))
    out.presence = to_device(np.asarray([[p.presence_penalty] for p in params], np.float32))
    out.frequency = to_device(np.asarray([[p.frequency_penalty] for p in params], np.float32))
    # padded with `vocab`: a column past the vocabulary, cut off after the scatter
    outputs = to_device(_padded([s.completion_token_ids for s in seqs], vocab))
    counts = torch.zeros(len(seqs), vocab + 1, dtype=torch.float32, device=outputs.device)
    counts.scatter_add_(1, outputs, torch.ones_like(outputs, dtype=torch.float32))
    out.output_counts = counts[:, :vocab]
    if any(p.repetition_penalty != 1.0 for p in params):
        prompts = to_device(_padded([s.token_ids[:s.num_prompt_tokens] for s in seqs], vocab))
        seen = torch.zeros(len(seqs), vocab + 1, dtype=torch.bool, device=prompts.device)
        seen.scatter_(1, prompts, True)
        out.seen = seen[:, :vocab] | (out.output_counts > 0)
        out.repetition = to_device(np.asarray([[p.repetition_penalty] for p in params],
                                              np.float32))


def _padded(token_lists: list[list[int]], pad: int) -> np.ndarray:
    width = max(1, max(len(t) for t in token_lists))
    array = np.full((len(token_lists), width), pad, dtype=np.int64)
    for i, tokens in enumerate(token_lists):
        array[i, :len(tokens)] = tokens
    return array
