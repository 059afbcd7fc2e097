"""vLLM's thinking_token_budget: once a request has thought for its budget of tokens (the
tokens after the thinking start marker, or from the first one when the prompt leaves
thinking open), the end marker's tokens are forced, one per step, so that the reasoning
ends there. The markers are token id sequences (the reasoning parser's `<think>` and
`</think>`, or --reasoning-config's); the state follows the tokens as they are appended,
so preemption (which keeps them) needs nothing."""

from __future__ import annotations

from shared.sampling_params import SamplingParams


class ThinkingBudget:
    __slots__ = ("budget", "start_ids", "end_ids", "thinking", "num_thinking", "num_forced",
                 "_recent")

    def __init__(self, sampling: SamplingParams) -> None:
        self.budget = sampling.thinking_token_budget
        self.start_ids = sampling.think_start_ids
        self.end_ids = sampling.think_end_ids
        self.thinking = sampling.thinking_open  # the prompt leaves thinking open
        self.num_thinking = 0  # tokens thought since thinking (re)started
        self.num_forced = 0  # end marker tokens forced so far
        self._recent: list[int] = []  # the last tokens, to see a marker the model writes

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
