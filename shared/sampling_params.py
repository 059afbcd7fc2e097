"""Per-request sampling settings, validated once where they are built."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_LOGIT_BIAS_ENTRIES = 1024
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
MAX_JSON_WHITESPACE = 4  # runs of whitespace JSON may hold: a model cannot pad forever
MAX_LOGPROBS = 1 << 20  # most top alternatives per token a request can carry at all (a
# vocabulary's size); the server's --max-logprobs (default 20, as vLLM's) is the limit
# clients see, and the API never asks for more than the model's vocabulary


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k cut
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    # OpenAI's: subtract presence_penalty from the logit of every token the completion
    # holds, and frequency_penalty times the number of times it holds it
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM's (the CTRL paper's): divide a positive logit, multiply a negative one, of every
    # token in the prompt or the completion
    repetition_penalty: float = 1.0
    min_tokens: int = 0  # EOS and stop_token_ids cannot end the completion before this
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)  # (token, bias)
    # None: no log-probabilities; k: the sampled token's and the k most likely ones', from
    # the distribution sampled (engine_proc/sampler.py)
    logprobs: int | None = None
    # None: none; k: for every prompt token after the first, its log-probability, its rank
    # and the k most likely tokens there, from the model's raw distribution (vLLM's
    # prompt_logprobs; engine_proc/prompt_logprobs.py)
    prompt_logprobs: int | None = None
    # vLLM's thinking_token_budget: after this many tokens of thinking, the end marker's
    # tokens are forced (engine_proc/thinking_budget.py); the markers as token ids, and
    # whether the prompt leaves thinking open
    thinking_token_budget: int | None = None
    think_start_ids: tuple[int, ...] = field(default_factory=tuple)
    think_end_ids: tuple[int, ...] = field(default_factory=tuple)
    thinking_open: bool = False
    # (kind, spec): what the completion must match (engine_proc/structured_output.py):
    # ("json", schema text), ("json_object", ""), ("regex", pattern), ("choice", JSON list
    # of strings), ("grammar", EBNF) or ("structural_tag", xgrammar's structural tag JSON:
    # api_proc/tool_grammar.py)
    structured: tuple[str, str] | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 or positive, got {self.top_k}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2], got "
                             f"{self.repetition_penalty}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got "
                             f"{self.min_tokens}")
        bias = tuple((int(t), float(b)) for t, b in self.logit_bias)
        if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"logit_bias has {len(bias)} entries; at most "
                             f"{MAX_LOGIT_BIAS_ENTRIES}")
        if any(not -100.0 <= b <= 100.0 for _, b in bias):
            raise ValueError("logit_bias values must be in [-100, 100]")
        if any(t < 0 for t, _ in bias):
            raise ValueError("logit_bias token ids must not be negative")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not 0 <= k <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {k}")
        if self.thinking_token_budget is not None:
            if self.thinking_token_budget < 0:
                raise ValueError("thinking_token_budget must not be negative")
            if not self.think_start_ids or not self.think_end_ids:
                raise ValueError("thinking_token_budget needs the thinking markers' token ids")
        for name in ("think_start_ids", "think_end_ids"):  # lists off the wire
            object.__setattr__(self, name, tuple(int(t) for t in getattr(self, name)))
        if self.structured is not None:
            kind, spec = self.structured
            if kind not in STRUCTURED_KINDS or not isinstance(spec, str):
                raise ValueError(f"structured must be (kind, text) with kind one of "
                                 f"{', '.join(STRUCTURED_KINDS)}, got {self.structured!r}")
            object.__setattr__(self, "structured", (kind, spec))
        object.__setattr__(self, "logit_bias", bias)
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """Whether the logits need the request's token counts (presence, frequency or
        repetition penalty)."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)
