"""vLLM's use_beam_search, driven from the API process as vLLM drives it: each step asks the
engine for one token of every live beam with its 2 x width most likely tokens, keeps the
`width` best extensions by cumulative log-probability (a beam that ends with EOS is put
aside, finished), and after max_tokens steps returns the `n` best of the finished and live
beams by vLLM's score: cumulative log-probability / (prompt + beam length) ** length_penalty.
Prefix caching keeps a step's prefill to the new tokens. The state is the beams' token ids:
at most width x max_tokens ids (R2).

A beam never takes an image or video placeholder token: each step sends the beam's tokens
back as a prompt, and the engine takes a placeholder in a prompt only with its media (the
API refuses one typed without them, prompt_builder.py). vLLM would extend such a beam; a
model writes one only after vision tokens typed as text."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from api_proc.engine_client import RequestStream
from shared.messages import RequestOutput
from shared.sampling_params import SamplingParams

Submit = Callable[[str, list[int], SamplingParams], RequestStream]


@dataclass
class Beam:
    tokens: list[int] = field(default_factory=list)  # the completion's, EOS included
    logprob: float = 0.0  # cumulative
    finish_reason: str = "length"

    def score(self, num_prompt_tokens: int, length_penalty: float, eos: frozenset) -> float:
        length = num_prompt_tokens + len(self.tokens)
        if self.tokens and self.tokens[-1] in eos:
            length -= 1  # vLLM's: the EOS token does not count
        return self.logprob / (length ** length_penalty)


@dataclass(frozen=True)
class BeamSearch:
    width: int
    n: int
    max_tokens: int
    temperature: float
    length_penalty: float
    ignore_eos: bool
    eos_token_ids: frozenset
    num_logits: int  # the vocabulary: never more alternatives than that
    placeholder_ids: frozenset = frozenset()  # tokens no beam takes

    async def run(self, submit: Submit, request_id: str, prompt_ids: list[int]) -> list[Beam]:
        """The `n` best beams, best first."""
        live, done = [Beam()], []
        step_params = SamplingParams(max_tokens=1, temperature=self.temperature,
                                     ignore_eos=True,
                                     logprobs=min(2 * self.width + len(self.placeholder_ids),
                                                  self.num_logits))
        for step in range(self.max_tokens):
            streams = [submit(f"{request_id}-s{step}-b{i}", prompt_ids + beam.tokens,
                              step_params) for i, beam in enumerate(live)]
            try:
                outputs = await asyncio.gather(*(_first(s) for s in streams))
            finally:
                for s in streams:
                    s.abort()  # ended already, unless cancelled meanwhile
            candidates = []
            for beam, out in zip(live, outputs, strict=True):
                [(_, top_ids, top_values)] = out.logprobs
                candidates += [Beam(beam.tokens + [t], beam.logprob + v)
                               for t, v in zip(top_ids, top_values, strict=True)
                               if t not in self.placeholder_ids]
            candidates.sort(key=lambda b: b.logprob, reverse=True)
            live = []
            for beam in candidates[:self.width]:
                if not self.ignore_eos and beam.tokens[-1] in self.eos_token_ids:
                    beam.finish_reason = "stop"
                    done.append(beam)
                else:
                    live.append(beam)
            if not live:
                break
        beams = done + live
        beams.sort(key=lambda b: b.score(len(prompt_ids), self.length_penalty,
                                         self.eos_token_ids), reverse=True)
        return beams[:self.n]


async def _first(stream: RequestStream) -> RequestOutput:
    async for output in stream:
        if output.new_token_ids:
            return output
    raise RuntimeError("the engine ended a beam step without a token")


class FinishedStream:
    """A beam's whole completion, delivered as one engine output (what responses.py reads):
    the search ran before the response."""

    def __init__(self, beam: Beam) -> None:
        self._output = RequestOutput(request_id="", new_token_ids=beam.tokens,
                                     finish_reason=beam.finish_reason,
                                     num_completion_tokens=len(beam.tokens))

    def deliver(self, on_output, on_error) -> None:
        output, self._output = self._output, None
        if output is not None:
            on_output(output)

    def pause(self) -> None:
        pass

    def abort(self) -> None:
        self._output = None

    async def aclose(self) -> None:
        self.abort()
