"""Log-probabilities in OpenAI's shapes, from the engine's per-token [logprob, top ids, top
log-probs] (shared/messages.py TokenLogprobs).

A token's `bytes` are its own UTF-8 bytes (a byte-level BPE token may hold part of a
character); its `token` text is those bytes decoded, a partial character shown as U+FFFD as
vLLM does. A log-probability of -inf (a token top-k or top-p cut) is sent as -9999.0, as
vLLM does: JSON has no infinity.
"""

from __future__ import annotations

import math

from api_proc.detokenizer import TokenDecoder

NEG_INF_LOGPROB = -9999.0


def _finite(value: float) -> float:
    return value if math.isfinite(value) else NEG_INF_LOGPROB


class LogprobsFormatter:
    """Turns engine log-probabilities into chat or completion `logprobs` objects."""

    def __init__(self, decoder: TokenDecoder) -> None:
        self.decoder = decoder

    def _token(self, token_id: int, as_id: bool = False) -> tuple[str, list[int]]:
        raw = self.decoder.token_bytes(token_id)
        if as_id:  # vLLM's return_tokens_as_token_ids: the bytes stay the token's own
            return f"token_id:{token_id}", list(raw)
        return raw.decode("utf-8", errors="replace"), list(raw)

    def chat_content(self, token_ids: list[int], logprobs: list,
                     as_ids: bool = False) -> list[dict]:
        """Entries of `choices[].logprobs.content`, one per token; `as_ids`: tokens
        written "token_id:ID"."""
        entries = []
        for token_id, (lp, top_ids, top_values) in zip(token_ids, logprobs, strict=True):
            text, raw = self._token(token_id, as_ids)
            top = []
            for i, v in zip(top_ids, top_values, strict=True):
                t, b = self._token(i, as_ids)
                top.append({"token": t, "logprob": _finite(v), "bytes": b})
            entries.append({"token": text, "logprob": _finite(lp), "bytes": raw,
                            "top_logprobs": top})
        return entries

    def completion(self, token_ids: list[int], logprobs: list, offset: int,
                   as_ids: bool = False) -> dict:
        """A completion choice's `logprobs` for these tokens; `offset`: the completion's
        length in characters before them (text_offset counts from there)."""
        tokens, token_logprobs, tops, offsets = [], [], [], []
        for token_id, (lp, top_ids, top_values) in zip(token_ids, logprobs, strict=True):
            text, _ = self._token(token_id, as_ids)
            tokens.append(text)
            token_logprobs.append(_finite(lp))
            top = {self._token(i, as_ids)[0]: _finite(v)
                   for i, v in zip(top_ids, top_values, strict=True)}
            top.setdefault(text, _finite(lp))  # vLLM's: the sampled token's entry too
            tops.append(top)
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
                "text_offset": offsets}


    def prompt(self, prompt_ids: list[int], entries: list, as_ids: bool = False
               ) -> list[dict | None]:
        """vLLM's prompt_logprobs: None for the first prompt token, then for each one a
        dict keyed by token id of its own entry and the top ones', each with its logprob,
        rank and decoded_token."""
        out: list[dict | None] = [None]
        for target, (lp, rank, top_ids, top_values) in zip(prompt_ids[1:], entries,
                                                           strict=True):
            entry = {str(target): {"logprob": _finite(lp), "rank": rank,
                                   "decoded_token": self._token(target, as_ids)[0]}}
            for r, (i, v) in enumerate(zip(top_ids, top_values, strict=True), start=1):
                entry.setdefault(str(i), {"logprob": _finite(v), "rank": r,
                                          "decoded_token": self._token(i, as_ids)[0]})
            out.append(entry)
        return out

    def completion_prompt(self, prompt_ids: list[int], entries: list,
                          as_ids: bool = False) -> dict:
        """A completion's `logprobs` part for its echoed prompt (echo with logprobs): the
        first token has none (null), as in OpenAI's and vLLM's."""
        tokens = [self._token(t, as_ids)[0] for t in prompt_ids]
        token_logprobs: list[float | None] = [None]
        tops: list[dict | None] = [None]
        for text, (lp, _, top_ids, top_values) in zip(tokens[1:], entries, strict=True):
            token_logprobs.append(_finite(lp))
            top = {self._token(i, as_ids)[0]: _finite(v)
                   for i, v in zip(top_ids, top_values, strict=True)}
            top.setdefault(text, _finite(lp))
            tops.append(top)
        offsets, at = [], 0
        for text in tokens:
            offsets.append(at)
            at += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
                "text_offset": offsets}


def merge_completion(parts: list[dict]) -> dict:
    """One completion `logprobs` object from the objects of successive outputs."""
    return {key: [v for part in parts for v in part[key]]
            for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
