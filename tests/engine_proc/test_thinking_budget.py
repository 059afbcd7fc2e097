"""thinking_token_budget counted as vLLM counts it: the tokens after the last start marker,
the prompt's included (tests/e2e/vllm_dropin/test_reasoning_controls.py holds it against a
real server)."""

from __future__ import annotations

import pytest

from engine_proc.thinking_budget import ThinkingBudget
from shared.sampling_params import SamplingParams

START, END = (7, 8), (9, 10)
FREE = 11  # what the model would write when nothing is forced


def generate(prompt: list[int], budget: int, written: list[int], thinking_open: bool
             ) -> list[int]:
    """The completion: what the model writes, unless the budget forces the end marker."""
    state = ThinkingBudget(SamplingParams(max_tokens=64, thinking_token_budget=budget,
                                          think_start_ids=START, think_end_ids=END,
                                          thinking_open=thinking_open), prompt)
    out = []
    for token in written:
        forced = state.forced_token()
        out.append(token if forced is None else forced)
        state.accept(out[-1])
    return out


@pytest.mark.parametrize("prompt, written, thinking_open, expected", [
    # Qwen3.5's prompt opens `<think>` and a newline: the newline is the first of 5
    ([1, *START, 2], [FREE] * 8, True, [FREE] * 4 + [*END, FREE, FREE]),
    # Qwen3's: the model opens the block itself, 5 tokens follow it
    ([1], [*START] + [FREE] * 8, False, [*START] + [FREE] * 5 + [*END, FREE]),
    # the marker split between the prompt and the completion
    ([1, START[0]], [START[1]] + [FREE] * 7, False, [START[1]] + [FREE] * 5 + [*END]),
    # a block the prompt closed again: nothing to count
    ([*START, 2, *END], [FREE] * 8, False, [FREE] * 8),
    # no marker, but the parser reads the completion as thinking: from its first token
    ([1], [FREE] * 8, True, [FREE] * 5 + [*END, FREE]),
])
def test_the_budget_counts_from_the_last_start_marker(prompt, written, thinking_open,
                                                      expected):
    assert generate(prompt, 5, written, thinking_open) == expected


def test_a_prompt_that_spent_the_budget_ends_thinking_at_once():
    assert generate([*START, 2, 3], 2, [FREE] * 3, True) == [*END, FREE]
    assert generate([*START], 0, [FREE] * 3, True) == [*END, FREE]
