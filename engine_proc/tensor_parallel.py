"""Rank 0's side of a tensor-parallel engine: it starts the worker ranks, sends them each
step's inputs, and notices at once when one of them dies.

    workers = TensorParallelWorkers(size, runner_kwargs)  # spawns ranks 1..size-1, joins
    logits = workers.forward(model, inputs, pieces, to_device)  # one step on every rank

Each worker is a child process (`python -m engine_proc.tp_worker`) that builds the same
ModelRunner without the vision tower, holding its shard of the decoder and of the KV cache.
Per step, rank 0 writes the step's inputs to every worker's stdin (StepInputs' wire form:
a header and an int64 payload, a few KB) and broadcasts the image rows of the step, when
there are any, through torch.distributed; then every rank runs the same forward, whose
row-parallel layers sum over the ranks and whose LM head gathers the logits on rank 0.

The vision tower runs on rank 0 only, whole: the workers need only its output rows, which
are the size of the step's image tokens, and never hold pixels (R3 holds on every rank:
a worker's image rows live for the one step that uses them).

A rank's death is the engine's death. A thread per worker waits on its process: when one
exits, `failure` says which and `on_failure` runs at once (the engine process then fails
its requests and exits; a collective stuck on the dead peer cannot hold it, see
engine_process.py). Every later `forward` raises TensorParallelBroken, and so does one
that fails after the workers got its inputs (the ranks would no longer agree on what runs
next). When rank 0 exits, its workers read end-of-file on stdin and exit, and Linux's
parent-death signal stops them even while inside a collective.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist

from engine_proc.distributed import broadcast_from_first, destroy_group, init_group, tp_shard
from engine_proc.step_inputs import ImagePieces, StepInputs, exit_header, forward_step

logger = logging.getLogger(__name__)

JOIN_POLL_S = 0.05
STORE_HOST = "127.0.0.1"


class TensorParallelBroken(RuntimeError):
    """A rank died or a step failed part-way on some rank: the engine cannot go on."""


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank `rank`'s device when rank 0 runs on `device`: the next GPUs, or the CPU."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


# What rank 0 does when a worker dies before anyone set `on_failure` (while the engine is
# being built: a collective then waits on the dead peer, for COLLECTIVE_TIMEOUT on NCCL).
# The engine process sets exit_on_early_failure (engine_proc/main.py): nothing it could do
# without the worker, so it exits with the worker's reason at once. In-process users (tests,
# offline engines) keep the failure to read and the collective's own error.
exit_on_early_failure = False


def _early_failure(reason: str) -> None:
    if exit_on_early_failure:
        logger.error("tensor parallelism: %s; the engine exits", reason)
        os._exit(1)


class TensorParallelWorkers:
    def __init__(self, size: int, runner_kwargs: dict, *, label: str = "",
                 start_timeout_s: float = 600.0) -> None:
        """Spawn ranks 1..size-1 of a group of `size` and join it as rank 0.
        `runner_kwargs`: the JSON-able ModelRunner arguments every rank builds its runner
        with (model path, device, dtype, KV cache sizing); `label` names the engine in
        the workers' process titles and logs."""
        self.size = size
        self.failure: str | None = None
        self.on_failure: Callable[[str], None] = _early_failure
        self._closing = False
        self._lock = threading.Lock()
        device = torch.device(runner_kwargs["device"])
        # the group's own sockets stay on this host (gloo and NCCL's bootstrap otherwise
        # listen on the address the host name resolves to); the workers inherit these
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
        store = dist.TCPStore(STORE_HOST, 0, size, is_master=True, wait_for_workers=False)
        log_level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
        spec = {"size": size, "store_port": store.port, "label": label, "log_level": log_level,
                "torch_threads": torch.get_num_threads(), "runner": runner_kwargs}
        self.processes = [self._spawn(rank, spec) for rank in range(1, size)]
        for rank, process in enumerate(self.processes, start=1):
            threading.Thread(target=self._watch, args=(rank, process), daemon=True,
                             name=f"tp-rank{rank}-watch").start()
        try:
            self._wait_joined(store, time.monotonic() + start_timeout_s)
            init_group(0, size, store, device)
        except BaseException:
            self.close()
            raise

    # ---- start

    @staticmethod
    def _spawn(rank: int, spec: dict) -> subprocess.Popen:
        command = [sys.executable, "-m", "engine_proc.tp_worker", "--rank", str(rank),
                   "--spec-json", json.dumps(spec)]
        return subprocess.Popen(command, stdin=subprocess.PIPE, bufsize=0)

    def _wait_joined(self, store: dist.Store, deadline: float) -> None:
        """Until every worker has reached the store (with a dead worker, init_process_group
        would wait out its whole timeout)."""
        keys = [f"joined/{rank}" for rank in range(1, self.size)]
        while not store.check(keys):
            if self.failure is not None:
                raise TensorParallelBroken(self.failure)
            if time.monotonic() > deadline:
                raise TensorParallelBroken("tensor-parallel workers did not start in time")
            time.sleep(JOIN_POLL_S)

    # ---- steps

    def forward(self, model: torch.nn.Module, inputs: StepInputs, pieces: ImagePieces,
                to_device: Callable[[np.ndarray], torch.Tensor],
                state_cache=None) -> torch.Tensor | None:
        """One step on every rank; the logits on this rank (see step_inputs.forward_step)."""
        if self.failure is not None:
            raise TensorParallelBroken(self.failure)
        try:
            self._send(inputs.encode())
        except OSError as exc:  # a worker's pipe closed: it died, its watcher says how
            raise self._broken(f"sending a step failed: {exc}") from None
        try:
            if pieces:
                values = torch.cat([rows for _, rows in pieces]).to(model.dtype)
                broadcast_from_first(values, tp_shard())
                del values
            return forward_step(model, inputs, pieces, to_device, state_cache)
        except Exception as exc:
            # after the workers took the inputs, a failure leaves the ranks out of step
            raise self._broken(f"a step failed part-way: {type(exc).__name__}: {exc}") from None

    def _send(self, chunks: list) -> None:
        for process in self.processes:
            fd = process.stdin.fileno()
            for chunk in chunks:
                view = memoryview(chunk).cast("B")
                while view:
                    view = view[os.write(fd, view):]

    # ---- failure and stop

    def _watch(self, rank: int, process: subprocess.Popen) -> None:
        code = process.wait()
        if not self._closing:
            self._broken(f"tensor-parallel rank {rank} (pid {process.pid}) exited with code "
                         f"{code}")

    def _broken(self, reason: str) -> TensorParallelBroken:
        with self._lock:
            first = self.failure is None
            if first:
                self.failure = reason
        if first:
            logger.error("%s: the engine stops", reason)
            self.on_failure(reason)
        return TensorParallelBroken(self.failure)

    def close(self, grace_s: float = 5.0) -> None:
        """Stop the workers (an exit header, then SIGKILL after `grace_s`) and leave the
        group."""
        if self._closing:
            return
        self._closing = True
        for process in self.processes:
            try:
                process.stdin.write(exit_header())
                process.stdin.close()
            except OSError:
                pass
        deadline = time.monotonic() + grace_s
        for process in self.processes:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        destroy_group()
