"""vLLM's vllm:iteration_tokens_total, kept by the engine as bucket counts and a sum (a
fixed size however long it runs; EngineStats carries them, the API sums the engines').

Counted as vLLM counts it, not as the tokens a step's forward computes: one observation per
step that gave at least one request a token (a step of prefill chunks or vision work alone
gives none), of that step's new tokens plus the prompt tokens, less those found in the prefix
cache, of each request whose first token it was. So a chunked prompt counts whole at its
last chunk, and over a request's life the sum gains its uncached prompt and every generated
token.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable

from engine_proc.sequence import Sequence
from shared.messages import ITERATION_TOKENS_BUCKETS


class IterationTokens:
    def __init__(self) -> None:
        self.counts = [0] * (len(ITERATION_TOKENS_BUCKETS) + 1)  # the last: past every bucket
        self.sum = 0

    def count_step(self, seqs: Iterable[Sequence]) -> None:
        """A step that gave each of `seqs` one token."""
        num_tokens = 0
        for seq in seqs:
            num_tokens += 1
            if seq.num_completion_tokens == 1:
                num_tokens += seq.num_prompt_tokens - seq.num_cached_tokens
        if num_tokens:
            self.counts[bisect_left(ITERATION_TOKENS_BUCKETS, num_tokens)] += 1
            self.sum += num_tokens
