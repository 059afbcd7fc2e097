"""Structured outputs: JSON (a schema, or any object), a regex, a choice of strings, an
EBNF grammar, or a structural tag (tool calls), enforced token by token with xgrammar.

A request's grammar is compiled in a worker thread (xgrammar itself is imported there, on
first use: requests without a grammar never pay for it), in a compiler whose cache of
compiled grammars is bounded in bytes. The scheduler admits the request once its grammar is
ready. Each step, the sampled rows that have a grammar get their allowed-token bitmask,
filled for all of them in one call (xgrammar's batch matcher, threaded in C++), and the
sampler masks their logits before anything else touches them; after the step each matcher
accepts its sampled token. A matcher that has reached the end of its grammar ends its
request ("stop"). A preempted request keeps its matcher: its generated tokens stay, only
their KV is recomputed.
"""

from __future__ import annotations

import json
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from shared.sampling_params import MAX_JSON_WHITESPACE

logger = logging.getLogger(__name__)

GRAMMAR_CACHE_BYTES = 64 << 20  # compiled grammars kept for reuse


# xgrammar 0.2.8 writes a string with minLength/maxLength as a run of _LOOSE_CHARACTER, which
# lets a raw control character through: invalid JSON (json.loads refuses it). Its other
# string rules use _JSON_CHARACTER, which also leaves out \0-\x1f (\r and \n among them).
_LOOSE_CHARACTER = r'[^\"\\\r\n]'
_JSON_CHARACTER = r'[^\0-\x1f\"\\]'


def _json_strings_without_controls(ebnf: str) -> str:
    return ebnf.replace(_LOOSE_CHARACTER, _JSON_CHARACTER)


class GrammarError(ValueError):
    """The grammar of a request cannot be compiled (bad schema, regex or EBNF)."""


def _import_xgrammar():
    # xgrammar imports triton when it is installed; the bitmask is applied by its CPU
    # kernel or torch, so a CPU-only setup without triton works the same
    import xgrammar

    return xgrammar


class StructuredOutputs:
    """Compiles grammars off the engine loop and fills the step's token bitmasks."""

    def __init__(self, tokenizer_dir: str, vocab_size: int, eos_token_ids: tuple[int, ...],
                 cache_bytes: int = GRAMMAR_CACHE_BYTES) -> None:
        self.tokenizer_dir = tokenizer_dir
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.cache_bytes = cache_bytes
        self._executor: ThreadPoolExecutor | None = None
        self._compiler: Any = None  # made in the worker thread on first use
        self._batch: Any = None
        self._xgr: Any = None

    def compile(self, kind: str, spec: str) -> Future:
        """A future of the compiled grammar; its exception is a GrammarError."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="flatserve-grammar")
        return self._executor.submit(self._compile, kind, spec)

    def matcher(self, compiled: Any) -> Any:
        return self._xgr.GrammarMatcher(compiled)

    def bitmask(self, matchers: list[Any], rows: list[int], num_rows: int,
                device: torch.device) -> torch.Tensor:
        """The allowed-token bitmask [num_rows, words] of a step, filled at `rows` (the
        other rows allow everything), on `device`."""
        bitmask = self._xgr.allocate_token_bitmask(num_rows, self.vocab_size)
        self._batch.batch_fill_next_token_bitmask(matchers, bitmask, rows)
        return bitmask.to(device, non_blocking=True) if device.type != "cpu" else bitmask

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        self._xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size,
                                              indices=rows)

    # ---- the worker thread -----------------------------------------------------------

    def _setup(self) -> None:
        from transformers import PreTrainedTokenizerFast

        xgr = _import_xgrammar()
        tokenizer = PreTrainedTokenizerFast(tokenizer_file=f"{self.tokenizer_dir}/tokenizer.json")
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                  stop_token_ids=self.eos_token_ids)
        self._compiler = xgr.GrammarCompiler(info, max_threads=1,
                                             cache_limit_bytes=self.cache_bytes)
        self._batch = xgr.BatchGrammarMatcher()
        self._xgr = xgr

    def _compile(self, kind: str, spec: str) -> Any:
        if self._compiler is None:
            self._setup()
        compiler = self._compiler
        try:
            if kind in ("json", "json_object"):
                schema = spec if kind == "json" else '{"type": "object"}'
                grammar = self._xgr.Grammar.from_json_schema(
                    schema, any_whitespace=True, max_whitespace_cnt=MAX_JSON_WHITESPACE)
                return compiler.compile_grammar(_json_strings_without_controls(str(grammar)))
            if kind == "regex":
                return compiler.compile_regex(spec)
            if kind == "structural_tag":  # through EBNF text, for the same string fix
                grammar = self._xgr.Grammar.from_structural_tag(spec)
                return compiler.compile_grammar(_json_strings_without_controls(str(grammar)))
            if kind == "choice":
                choices = json.loads(spec)
                ebnf = "root ::= " + " | ".join(json.dumps(c) for c in choices)
                return compiler.compile_grammar(ebnf)
            return compiler.compile_grammar(spec)
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError with the reason
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            what = "tools' parameters" if kind == "structural_tag" else f"{kind} constraint"
            raise GrammarError(f"cannot compile the {what}: {message}") from None

