"""vLLM's thinking_token_budget: once a request has thought for its budget of tokens, the
end marker's tokens are forced, one per step, so that the reasoning ends there. The markers
are token id sequences (the reasoning parser's `<think>` and `</think>`, or
--reasoning-config's).

What counts is vLLM's: the tokens after the last start marker, the prompt's included. A
prompt that opens thinking (Qwen3.5's `<think>\\n`) has spent one token of the budget on the
newline, so its completion thinks budget - 1 tokens; a model that writes `<think>` itself
thinks budget tokens after it. Beyond vLLM, which forces nothing without a start marker, a
prompt the reasoning parser reads as thinking without one (`thinking_open`) counts from
the completion's first token.

The state follows the tokens as they are appended, so preemption (which keeps them) needs
nothing."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from shared.sampling_params import SamplingParams


class ThinkingBudget:
    __slots__ = ("budget", "start_ids", "end_ids", "thinking", "num_thinking", "num_forced",
                 "_recent")

    def __init__(self, sampling: SamplingParams, prompt_ids: Sequence[int]) -> None:
        self.budget = sampling.thinking_token_budget
        self.start_ids = sampling.think_start_ids
        self.end_ids = sampling.think_end_ids
        self.num_forced = 0  # end marker tokens forced so far
        window = max(len(self.start_ids), len(self.end_ids))
        # the last tokens, to see a marker the model writes (one may begin in the prompt)
        self._recent: list[int] = list(prompt_ids[-window:])
        # thinking: whether it thinks now; num_thinking: tokens since thinking (re)started
        start = _last(prompt_ids, self.start_ids)
        if start >= 0 and _last(prompt_ids[start:], self.end_ids) < 0:
            # the prompt opens thinking: what follows its marker counts
            self.thinking, self.num_thinking = True, len(prompt_ids) - start - len(self.start_ids)
        else:
            self.thinking, self.num_thinking = sampling.thinking_open, 0

    def forced_token(self) -> int | None:
        """The token the next step must sample, or None when it is free."""
        if self.thinking and self.num_thinking >= self.budget:
            return self.end_ids[self.num_forced]
        return None

    def accept(self, token_id: int) -> None:
        if self.forced_token() is not None:
            self.num_forced += 1
            if self.num_forced == len(self.end_ids):
                self.thinking, self.num_forced, self._recent = False, 0, []
            return
        self._recent = (self._recent + [token_id])[-max(len(self.start_ids),
                                                        len(self.end_ids)):]
        if self._ends_with(self.start_ids):
            self.thinking, self.num_thinking = True, 0  # thinking (re)starts after it
        elif self.thinking and self._ends_with(self.end_ids):
            self.thinking = False
        elif self.thinking:
            self.num_thinking += 1

    def _ends_with(self, marker: tuple[int, ...]) -> bool:
        return len(self._recent) >= len(marker) and tuple(self._recent[-len(marker):]) == marker


def _last(ids: Sequence[int], marker: tuple[int, ...]) -> int:
    """Where `marker` last starts in `ids`; -1 when it is not there."""
    n = len(marker)
    for i in np.flatnonzero(np.asarray(ids[:len(ids) - n + 1]) == marker[0])[::-1]:
        if tuple(ids[i:i + n]) == marker:
            return int(i)
    return -1
