"""vLLM's `--stream-interval N`: a streamed choice writes a chunk when its first token comes,
then once N tokens have come since its last chunk, and when it ends (its finish, a stop
string, an error); the steps between are held here and written as one chunk.

Only the writing waits. Each step is still detokenized, checked for stop strings, counted
and timed in /metrics as it arrives (responses.py), so a stop string ends the choice at the
same token and every count is the same as with N = 1; the held steps' ids wait in
`Choice.step_ids` as they do for any step. A chunk (its JSON, its socket write) is most of
what a streamed token costs the API process at high concurrency: N tokens per chunk divide
that cost by about N (docs/performance.md, "The wire")."""

from __future__ import annotations

from api_proc.logprobs import merge_completion


class HeldSteps:
    """One choice's steps since its last chunk: their text and log-probabilities (chat:
    entries, one per token; completions: one logprobs object per step, merged on taking)."""

    __slots__ = ("chat", "text", "logprobs")

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        self.text = ""
        self.logprobs: list | None = None

    def hold(self, text: str, logprobs: list | dict | None) -> None:
        self.text += text
        if logprobs is None:
            return
        if self.logprobs is None:
            self.logprobs = []
        if self.chat:
            self.logprobs.extend(logprobs)
        else:
            self.logprobs.append(logprobs)

    def take(self, text: str, logprobs: list | dict | None) -> tuple[str, list | dict | None]:
        """The held steps and this one, as one step; nothing is held after."""
        if not self.text and self.logprobs is None:
            return text, logprobs
        self.hold(text, logprobs)
        text, held, self.text, self.logprobs = self.text, self.logprobs, "", None
        if held is not None and not self.chat:
            held = merge_completion(held)
        return text, held


def due(interval: int, num_tokens: int, num_streamed: int, finish: str | None) -> bool:
    """Whether a choice's step is written now: with its first token (nothing streamed yet),
    at its end, or once `interval` tokens wait."""
    return finish is not None or num_streamed == 0 or num_tokens - num_streamed >= interval
