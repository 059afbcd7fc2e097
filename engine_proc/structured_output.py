"""Structured outputs: JSON (a schema, or any object), a regex, a choice of strings, an
EBNF grammar, or a structural tag (tool calls), enforced token by token with xgrammar.

Grammars compile one at a time, in arrival order, in a compiler process of their own
(grammar_worker.py; started on first use: requests without a grammar never pay for it);
the compiled grammars kept for reuse, here and there, are bounded in bytes. A thread here hands each one over and
reads the compiled grammar back. Each request has a budget: a spec of at most
`max_spec_bytes`, compiled within `timeout_s` into at most `max_compiled_bytes`; past it the
request fails with the reason (the API answers 400). A compile past its time, or whose
request is aborted, is stopped by ending the compiler process (a thread cannot stop one),
and the next grammar starts a fresh one. The engine admits a request once its grammar is
ready, so a slow one holds no other request back.

Each step, the sampled rows that have a grammar get their allowed-token bitmask, filled for
all of them in one call (xgrammar's batch matcher, threaded in C++), and the sampler masks
their logits before anything else touches them; after the step each matcher accepts its
sampled token. A matcher that has reached the end of its grammar ends its request ("stop").
A preempted request keeps its matcher: its generated tokens stay, only their KV is
recomputed.
"""

from __future__ import annotations

import json
import logging
import queue
import select
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import numpy as np
import torch

from engine_proc.grammar_worker import load_xgrammar

logger = logging.getLogger(__name__)

GRAMMAR_CACHE_BYTES = 64 << 20  # compiled grammars kept for reuse
COMPILE_TIMEOUT_S = 10.0  # one request's grammar
MAX_SPEC_BYTES = 128 << 10  # one request's schema, regex, choices or grammar
MAX_COMPILED_BYTES = 64 << 20  # one request's compiled grammar
_POLL_S = 0.05  # how often a running compile checks whether its request went away


class GrammarError(ValueError):
    """The grammar of a request cannot be compiled (bad schema, regex or EBNF), or not
    within its budget."""


class _Compile(Future):
    """A grammar to compile; cancel() stops it even while it runs."""

    def __init__(self, kind: str, spec: str) -> None:
        super().__init__()
        self.kind = kind
        self.spec = spec
        self.abandoned = threading.Event()

    def cancel(self) -> bool:
        self.abandoned.set()
        return super().cancel()


class _CompilerProcess:
    """grammar_worker.py in a child process."""

    def __init__(self, args: list[str]) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "engine_proc.grammar_worker", *args],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.stdout = self.process.stdout

    def readline(self, deadline: float, abandoned: threading.Event) -> bytes | None:
        """One line, or None when `deadline` passes or `abandoned` is set first."""
        while not abandoned.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([self.stdout], [], [], min(left, _POLL_S))
            if ready:
                line = self.stdout.readline()
                if not line:
                    raise GrammarError("the grammar compiler exited")
                return line
        return None

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout):
            try:
                pipe.close()
            except OSError:  # stdin's unsent bytes meet the closed pipe (BrokenPipeError)
                pass


class StructuredOutputs:
    """Compiles grammars off the engine loop and fills the step's token bitmasks."""

    def __init__(self, tokenizer_dir: str, vocab_size: int, eos_token_ids: tuple[int, ...],
                 cache_bytes: int = GRAMMAR_CACHE_BYTES, *,
                 timeout_s: float = COMPILE_TIMEOUT_S, max_spec_bytes: int = MAX_SPEC_BYTES,
                 max_compiled_bytes: int = MAX_COMPILED_BYTES) -> None:
        self.tokenizer_dir = tokenizer_dir
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.cache_bytes = cache_bytes
        self.timeout_s = timeout_s
        self.max_spec_bytes = max_spec_bytes
        self.max_compiled_bytes = max_compiled_bytes
        self._jobs: queue.SimpleQueue[_Compile] = queue.SimpleQueue()
        # compiled grammars by (kind, spec), least recently used first: a repeated schema
        # neither compiles nor crosses from the compiler process again
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._cache_size = 0
        self._thread: threading.Thread | None = None
        self._compiler: _CompilerProcess | None = None
        self._info: Any = None  # xgrammar's tokenizer info, made in the thread on first use
        self._batch: Any = None
        self._xgr: Any = None

    def compile(self, kind: str, spec: str) -> Future:
        """A future of the compiled grammar; its exception is a GrammarError."""
        job = _Compile(kind, spec)
        if len(spec.encode()) > self.max_spec_bytes:
            job.set_exception(GrammarError(
                f"the {kind} constraint is {len(spec.encode())} bytes, more than the "
                f"{self.max_spec_bytes} a request may use"))
            return job
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="flatserve-grammar",
                                            daemon=True)
            self._thread.start()
        self._jobs.put(job)
        return job

    @property
    def compiler_pid(self) -> int | None:
        """The compiler process's pid, while there is one."""
        return None if self._compiler is None else self._compiler.process.pid

    def matcher(self, compiled: Any) -> Any:
        return self._xgr.GrammarMatcher(compiled)

    def bitmask(self, matchers: list[Any], rows: list[int], num_rows: int,
                to_device: Callable[[np.ndarray], torch.Tensor]) -> torch.Tensor:
        """The allowed-token bitmask [num_rows, words] of a step, filled at `rows` (the
        other rows allow everything), through the runner's `to_device` (on a GPU its pinned
        staging: a copy from pageable memory would wait for the forward in flight)."""
        bitmask = self._xgr.allocate_token_bitmask(num_rows, self.vocab_size)
        self._batch.batch_fill_next_token_bitmask(matchers, bitmask, rows)
        return to_device(bitmask.numpy())

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        self._xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size,
                                              indices=rows)

    # ---- the worker thread -----------------------------------------------------------

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if not job.set_running_or_notify_cancel():
                continue  # its request went away while it waited
            try:
                if self._info is None:
                    self._xgr, self._info = load_xgrammar(self.tokenizer_dir, self.vocab_size,
                                                          self.eos_token_ids)
                    self._batch = self._xgr.BatchGrammarMatcher()
                compiled = self._cached(job)
                if compiled is None:
                    compiled = self._remember(job, self._compile(job))
                job.set_result(compiled)
                compiled = None
            except Exception as e:  # noqa: BLE001 - the job's error is its request's
                # (nothing in here may raise: the thread would die and every later
                # grammar wait forever)
                compiler = self._compiler
                if compiler is not None and (compiler.process.poll() is not None
                                             or not isinstance(e, GrammarError)):
                    self._stop_compiler()  # gone or out of step: the next grammar starts one
                error = e if isinstance(e, GrammarError) else GrammarError(
                    f"the grammar compiler failed: {type(e).__name__}: {e}")
                job.set_exception(error)

    def _compile(self, job: _Compile) -> Any:
        compiler, header = self._send(job)
        if header is None:
            self._stop_compiler()  # the only way to stop a compile that runs on
            if job.abandoned.is_set():
                raise GrammarError("the request was aborted while its grammar compiled")
            raise GrammarError(f"the {job.kind} constraint did not compile within "
                               f"{self.timeout_s:g} s")
        answer = json.loads(header)
        if "error" in answer:
            raise GrammarError(answer["error"])
        data = compiler.stdout.read(answer["size"])
        return self._xgr.CompiledGrammar.deserialize_json(data.decode(), self._info)

    def _send(self, job: _Compile, retry: bool = True
              ) -> tuple[_CompilerProcess, bytes | None]:
        """The compiler (started first if there is none) with the job written to it, and the
        header of its answer: None past the time limit or once the request went away. A
        compiler that turns out dead (its pipe broken, or gone before answering) is replaced
        and the job sent again, once: the job is not at fault."""
        compiler = self._start(job)
        try:
            compiler.process.stdin.write(
                json.dumps({"kind": job.kind, "spec": job.spec}).encode() + b"\n")
            compiler.process.stdin.flush()
            return compiler, compiler.readline(time.monotonic() + self.timeout_s, job.abandoned)
        except (OSError, GrammarError):
            self._stop_compiler()
            if not retry:
                raise GrammarError("the grammar compiler exited") from None
        return self._send(job, retry=False)

    def _start(self, job: _Compile) -> _CompilerProcess:
        if self._compiler is None:
            self._compiler = _CompilerProcess([
                self.tokenizer_dir, str(self.vocab_size), json.dumps(self.eos_token_ids),
                str(self.cache_bytes), str(self.max_compiled_bytes)])
            if self._compiler.readline(time.monotonic() + 300, job.abandoned) is None:
                self._stop_compiler()
                raise GrammarError("the grammar compiler did not start")
        return self._compiler

    def _cached(self, job: _Compile) -> Any:
        compiled = self._cache.get((job.kind, job.spec))
        if compiled is not None:
            self._cache.move_to_end((job.kind, job.spec))
        return compiled

    def _remember(self, job: _Compile, compiled: Any) -> Any:
        size = compiled.memory_size_bytes
        if size <= self.cache_bytes:
            self._cache[job.kind, job.spec] = compiled
            self._cache_size += size
            while self._cache_size > self.cache_bytes:
                _, old = self._cache.popitem(last=False)
                self._cache_size -= old.memory_size_bytes
        return compiled

    def _stop_compiler(self) -> None:
        compiler, self._compiler = self._compiler, None
        if compiler is not None:
            compiler.kill()
