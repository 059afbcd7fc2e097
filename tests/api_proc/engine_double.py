"""TEST DOUBLE of an engine process: the real engine socket (rpc/engine_server.py) around a
synchronous busy loop, like engine_proc/engine_process.py, but no model.

Every request echoes its prompt's text tokens back (special and image tokens left out), one
token per engine step (a step every STEP_S while there is work), up to max_tokens (finish
"length"), else the echo ends with the first eos id (finish "stop"). Directives in the
prompt text change its behaviour:

    [[slow]]   0.05 s between outputs
    [[hang]]   the first output, then nothing until the request is aborted
    [[error]]  the first output, then an output with finish "error" (ErrorCode.INTERNAL)
    [[late-error]] the same after three outputs
    [[refuse]] at once an output with finish "error" (ErrorCode.REJECTED)
    [[gated]]  no output until the test opens the gate (a prefill that takes its time)

The test drives it through the process's stdin and stdout, one line each way:

    log        -> {"requests": [{"id", "num_prompt_tokens", "shapes", "grids", "video",
                                 "temporal_pos", "num_video_tokens",
                                 "max_tokens"}, ...],
                   "aborted": [ids named by an AbortRequests, in arrival order; those the
                               engine socket sends for an API process gone silent too],
                   "running": [ids the engine holds now, sorted]}
    open_gate  -> {"opened": n}: every [[gated]] request held now goes on; later ones wait
                  for the next open_gate

Nothing else is written to stdout; the double exits when its stdin closes.

    python -m tests.api_proc.engine_double ADDRESS MODEL_DIR [MAX_REQUESTS [PEER_TIMEOUT_S]]
"""

from __future__ import annotations

import json
import sys
import threading
import time
from dataclasses import dataclass

from tokenizers import Tokenizer

from rpc.engine_server import EngineServer
from shared.messages import AbortRequests, AddRequest, EngineStats, ErrorCode, RequestOutput
from shared.model_config import load_model_config

STEP_S = 0.002
SLOW_S = 0.05
IDLE_WAIT_S = 0.01  # also how soon an opened gate is noticed


@dataclass
class Running:
    request_id: str
    echo: list[int]  # the tokens it will output, one per step
    stop: bool  # ends with eos (finish "stop") rather than at max_tokens ("length")
    num_prompt_tokens: int
    delay: float
    hang: bool
    error: int  # outputs before an output with finish "error"; 0: none
    gated: bool
    sent: int = 0
    next_at: float = 0.0


class EngineDouble:
    def __init__(self, model_dir: str, server: EngineServer):
        self.tokenizer = Tokenizer.from_file(f"{model_dir}/tokenizer.json")
        self.eos = load_model_config(model_dir).eos_token_ids[0]
        self.video_token_id = self.tokenizer.token_to_id("<|video_pad|>")
        self.special = set(self.tokenizer.get_added_tokens_decoder())
        self.server = server
        self.lock = threading.Lock()  # the busy loop's state, read by the control thread
        self.requests: list[dict] = []
        self.aborted: list[str] = []
        self.running: dict[str, Running] = {}
        self.finished = 0
        self.stopping = False

    # ---- the busy loop

    def run(self) -> None:
        while not self.stopping:
            commands = self.server.take_commands()
            with self.lock:
                outputs = self._apply(commands)
                commands.clear()  # R1: nothing here keeps a request's payload
                outputs += self._step(time.monotonic())
                self.server.stats = self._stats()
                wait = self._wait_s(time.monotonic())
            if outputs:
                self.server.send_step(outputs)
            if wait > 0:
                self.server.wait_for_commands(wait)

    def _apply(self, commands: list[AddRequest | AbortRequests]) -> list[RequestOutput]:
        outputs = []
        for command in commands:
            if type(command) is AbortRequests:
                for request_id in command.request_ids:
                    self.aborted.append(request_id)
                    self.running.pop(request_id, None)
            else:
                output = self._add(command)
                if output is not None:
                    outputs.append(output)
        return outputs

    def _add(self, request: AddRequest) -> RequestOutput | None:
        rid, ids, max_tokens = request.request_id, request.prompt_token_ids, \
            request.sampling.max_tokens
        self.requests.append({"id": rid, "num_prompt_tokens": len(ids),
                              "shapes": [list(im.pixels.shape) for im in request.images],
                              "grids": [list(im.grid_thw) for im in request.images],
                              "video": [bool(im.video) for im in request.images],
                              "temporal_pos": [im.temporal_pos for im in request.images],
                              "num_video_tokens": ids.count(self.video_token_id),
                              "max_tokens": max_tokens})
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        if "[[refuse]]" in text:
            return RequestOutput(rid, [], "error", len(ids), 0,
                                 error="RequestRejected: refused by the test double",
                                 error_code=ErrorCode.REJECTED)
        echo = [t for t in ids if t not in self.special]
        self.running[rid] = Running(
            rid, echo[:max_tokens], len(echo) <= max_tokens, len(ids),
            SLOW_S if "[[slow]]" in text else STEP_S, "[[hang]]" in text,
            1 if "[[error]]" in text else 3 if "[[late-error]]" in text else 0,
            "[[gated]]" in text)
        return None

    def _step(self, now: float) -> list[RequestOutput]:
        outputs = []
        for r in list(self.running.values()):
            if r.gated or (r.hang and r.sent) or now < r.next_at:
                continue
            r.next_at = now + r.delay
            if r.error and r.sent >= r.error:
                outputs.append(RequestOutput(r.request_id, [], "error", r.num_prompt_tokens,
                                             r.sent, error="engine double failed on purpose",
                                             error_code=ErrorCode.INTERNAL))
                self._finish(r)
                continue
            new = r.echo[r.sent:r.sent + 1]
            r.sent += len(new)
            reason = None
            if r.sent == len(r.echo) and not (r.error or r.hang):
                reason = "stop" if r.stop else "length"
                if r.stop:
                    new.append(self.eos)
            outputs.append(RequestOutput(r.request_id, new, reason, r.num_prompt_tokens,
                                         len(new) if r.sent == 0 else r.sent))
            if reason is not None:
                self._finish(r)
        return outputs

    def _finish(self, r: Running) -> None:
        del self.running[r.request_id]
        self.finished += 1

    def _wait_s(self, now: float) -> float:
        due = [r.next_at for r in self.running.values()
               if not (r.gated or (r.hang and r.sent))]
        if not due:
            return IDLE_WAIT_S
        return min(max(min(due) - now, 0.0), IDLE_WAIT_S)

    def _stats(self) -> EngineStats:
        gated = sum(r.gated for r in self.running.values())
        return EngineStats(num_waiting=gated, num_running=len(self.running) - gated,
                           num_kv_blocks_total=0, num_kv_blocks_free=0, mm_bytes_held=0,
                           num_requests_finished=self.finished,
                           max_requests=self.server.max_requests)

    # ---- the test's commands

    def command(self, line: str) -> dict:
        with self.lock:
            if line == "log":
                return {"requests": list(self.requests), "aborted": list(self.aborted),
                        "running": sorted(self.running)}
            if line == "open_gate":
                gated = [r for r in self.running.values() if r.gated]
                for r in gated:
                    r.gated = False
                return {"opened": len(gated)}
        return {"error": f"unknown command {line!r}"}

    def serve_commands(self) -> None:
        for line in sys.stdin:
            answer = self.command(line.strip())
            sys.stdout.write(json.dumps(answer) + "\n")
            sys.stdout.flush()
        self.stopping = True  # stdin closed: the test is gone


def main(argv: list[str]) -> None:
    address, model_dir = argv[0], argv[1]
    max_requests = int(argv[2]) if len(argv) > 2 else 64
    peer_timeout_s = float(argv[3]) if len(argv) > 3 else 3.0
    server = EngineServer(address, max_requests, peer_timeout_s=peer_timeout_s)
    double = EngineDouble(model_dir, server)
    server.stats = double._stats()
    server.start()
    try:
        threading.Thread(target=double.serve_commands, name="test-commands", daemon=True).start()
        print("ready", flush=True)
        double.run()
    finally:
        server.stop()


if __name__ == "__main__":
    main(sys.argv[1:])
