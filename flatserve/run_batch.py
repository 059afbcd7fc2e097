"""`flatserve run-batch -i INPUT.jsonl -o OUTPUT.jsonl [MODEL] [serve's flags]`: vLLM's
offline batch runner (batch_file.py has the format).

The engines start as `serve` starts them (launcher.launch_api) and each line is one POST to
the same API app, called in this process without HTTP (api_proc/local_call.py): validation,
media loading, admission, errors and metrics are the server's. No HTTP server runs; with
--enable-metrics, Prometheus metrics are served on --url:--port while the batch runs.

Memory (R4): a line is read only when a request slot and a window slot are free. At most
--max-in-flight requests run at once, and at most twice that many lines are read and not
yet written: the output is in input order, so a finished line may wait for an earlier one,
and reading waits meanwhile. A line's bytes are held until its request is parsed and handed
to the app (R1); nothing else grows with the input.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import signal
import time
from dataclasses import fields

from api_proc.config import ApiConfig
from api_proc.local_call import post
from api_proc.request_body import RequestBody
from flatserve.batch_file import (
    LINE_OVERHEAD_BYTES,
    BatchFileError,
    BatchRefusal,
    LineTooLong,
    OrderedWriter,
    Output,
    check_input,
    input_chunks,
    output_line,
    parse_line,
    read_lines,
    refusal_line,
    response_line,
)
from flatserve.launcher import StartFailed, Stopped, launch_api, raise_stopped
from shared.memory import API_MALLOC_ENV, apply_malloc_settings
from shared.process import set_process_title

logger = logging.getLogger(__name__)

# serve's flags for its HTTP server, which run-batch does not run: refused when given
SERVER_FLAGS = ("host", "uds", "ssl_keyfile", "ssl_certfile", "ssl_ca_certs", "ssl_cert_reqs",
                "api_key", "allow_unauthenticated_metrics", "root_path", "allowed_origins",
                "allowed_methods", "allowed_headers", "allow_credentials", "max_header_bytes",
                "header_read_timeout_s", "enable_server_load_tracking")
# how long an HTTP client may wait before a 429 / 408: run-batch has no client to answer
# "retry later", so its requests wait for budget and turns as long as it takes
WAIT_FLAGS = ("admission_timeout_s", "body_read_timeout_s")
PROGRESS_EVERY_S = 30.0


def _server_flags_given(args: argparse.Namespace, names: tuple[str, ...] = SERVER_FLAGS
                        ) -> list[str]:
    defaults = {f.name: f.default for f in fields(ApiConfig)}
    given = []
    for name in names:
        value = getattr(args, name)
        if (tuple(value) if isinstance(value, list) else value) != defaults[name]:
            given.append("--" + name.replace("_", "-"))
    if names is SERVER_FLAGS and args.uvicorn_log_level is not None:
        given.append("--uvicorn-log-level")
    if names is SERVER_FLAGS and args.disable_uvicorn_access_log:
        given.append("--disable-uvicorn-access-log")
    return given


def run_batch(args: argparse.Namespace) -> int:
    set_process_title("flatserve: run-batch")
    apply_malloc_settings(API_MALLOC_ENV)
    given = _server_flags_given(args)
    if given:
        raise SystemExit(f"flatserve run-batch: {', '.join(given)}: these set the HTTP server "
                         "of `flatserve serve`, and run-batch runs none (its metrics: "
                         "--enable-metrics, --url, --port)")
    given = _server_flags_given(args, WAIT_FLAGS)
    if given:
        raise SystemExit(f"flatserve run-batch: {', '.join(given)}: these bound how long an "
                         "HTTP client waits before a 429 or 408; run-batch's requests wait "
                         "for the image budget as long as it takes (--max-in-flight bounds "
                         "them)")
    if args.max_in_flight < 0:
        raise SystemExit("flatserve run-batch: --max-in-flight must not be negative")
    try:
        check_input(args.input_file)
        output = Output(args.output_file, args.output_tmp_dir)
    except BatchFileError as e:
        raise SystemExit(f"flatserve run-batch: {e}") from None
    runner = None
    signal.signal(signal.SIGTERM, raise_stopped)
    signal.signal(signal.SIGINT, raise_stopped)
    try:
        with launch_api(args, "run-batch", is_stopping=lambda: runner is None or runner.stopping,
                        give_up=lambda reason: runner.stop_from_thread(reason),
                        api_key=None, admission_timeout_s=math.inf,
                        body_read_timeout_s=math.inf) as launched:
            config, app = launched.config, launched.app
            max_in_flight = args.max_in_flight or 2 * args.max_num_seqs * len(
                config.engine_addresses)
            runner = BatchRunner(app, args.input_file, output, max_in_flight,
                                 config.max_body_bytes + LINE_OVERHEAD_BYTES,
                                 config.shutdown_timeout_s, config.mm_inflight_budget)
            metrics_server = None
            if args.enable_metrics:
                metrics_server = _serve_metrics(app, args.url, config.port)
            try:
                if launched.supervisor is not None:
                    launched.supervisor.start()
                import uvloop

                code = uvloop.run(runner.run())
            finally:
                # the loop's signal handlers are gone with it
                signal.signal(signal.SIGTERM, raise_stopped)
                signal.signal(signal.SIGINT, raise_stopped)
                if metrics_server is not None:
                    metrics_server.shutdown()
                    metrics_server.server_close()
            if launched.supervisor is not None and launched.supervisor.gave_up:
                return 1
            return code
    except StartFailed as failed:
        return failed.code
    except Stopped as stop:
        logger.info("stopped by %s", stop)
        return 1


def _serve_metrics(app, address: str, port: int):
    from prometheus_client import start_http_server

    try:
        server, _ = start_http_server(port, address, registry=app.state.metrics.registry)
    except OSError as e:
        raise SystemExit(f"flatserve run-batch: metrics on {address}:{port}: "
                         f"{e.strerror or e}") from None
    logger.info("Prometheus metrics on http://%s:%d/metrics", address, port)
    return server


class BatchRunner:
    """Runs a batch file through the app: reads a line when a slot frees up, runs its request
    as a task, writes its result line in input order. SIGINT/SIGTERM: no more lines are read,
    the requests running get --shutdown-timeout to finish, then the rest are cancelled (their
    lines say so); a second signal cancels them at once. The bodies of the requests running
    hold at most `body_budget` bytes (one line past it when a single line is larger): a line
    waits on disk, as an HTTP body waits in its client, until the running ones leave room."""

    def __init__(self, app, source: str, output: Output, max_in_flight: int, line_limit: int,
                 drain_s: float, body_budget: int) -> None:
        self.app = app
        self.source = source
        self.output = output
        self.max_in_flight = max_in_flight
        self.line_limit = line_limit
        self.drain_s = drain_s
        self.body_budget = body_budget
        self._body_bytes = 0  # of the requests running
        self.num_lines = self.num_ok = self.num_failed = 0
        self.stop_reason: str | None = None
        self.finished = False  # the supervisor restarts no engine once the batch is over
        self._tasks: set[asyncio.Task] = set()
        self._feeder: asyncio.Future | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def stopping(self) -> bool:
        return self.stop_reason is not None or self.finished

    async def run(self) -> int:
        """0 when every line of the input has its output line, else 1."""
        loop = self._loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.stop, sig.name)
        self._in_flight = asyncio.Semaphore(self.max_in_flight)
        self._window = asyncio.Semaphore(2 * self.max_in_flight)
        self._room = asyncio.Event()  # set when a running request ends
        started = time.monotonic()
        code = 0
        try:
            writer = OrderedWriter(self.output.open(), self._window.release)
            async with self.app.router.lifespan_context(self.app):
                if self.stop_reason is not None:  # stopped while the engines were connected
                    return 1
                self._feeder = asyncio.ensure_future(self._feed(writer))
                try:
                    await self._feeder
                except asyncio.CancelledError:
                    if self.stop_reason is None:
                        raise
                except BatchFileError as e:
                    logger.error("flatserve run-batch: %s", e)
                    code = 1
                while self._tasks:
                    await asyncio.wait(set(self._tasks))
        except BatchFileError as e:
            logger.error("flatserve run-batch: %s", e)
            code = 1
        finally:
            self.finished = True
            try:
                await self.output.close()
            except BatchFileError as e:
                logger.error("flatserve run-batch: %s", e)
                code = 1
        logger.info("run-batch: %d lines in %.1f s: %d answered 200, %d errors; written to %s",
                    self.num_lines, time.monotonic() - started, self.num_ok, self.num_failed,
                    self.output.target)
        if self.stop_reason is not None:
            logger.warning("run-batch stopped by %s after reading %d requests: the rest of "
                           "the input was not read", self.stop_reason, self.num_lines)
            return 1
        return code

    async def _feed(self, writer: OrderedWriter) -> None:
        last_progress = time.monotonic()
        async with input_chunks(self.source) as chunks:
            lines = read_lines(chunks, self.line_limit)
            try:
                while True:
                    await self._window.acquire()  # released when a line is written
                    await self._in_flight.acquire()  # released when a request ends
                    item = await anext(lines, None)
                    if item is None:
                        return
                    lineno, line = item
                    item = None
                    if isinstance(line, LineTooLong):
                        request = BatchRefusal(None, f"line {lineno} is longer than "
                                               f"{line.limit} bytes (--max-body-bytes and "
                                               "what a line holds beside its body)",
                                               "line_too_long")
                    elif not line or line.isspace():
                        self._window.release()
                        self._in_flight.release()
                        continue
                    else:
                        request = parse_line(line, lineno)
                    line = None
                    index = self.num_lines
                    self.num_lines += 1
                    if isinstance(request, BatchRefusal):
                        self._in_flight.release()
                        self.num_failed += 1
                        writer.put(index, refusal_line(request))
                    else:
                        nbytes = len(request.body.data)
                        await self._room_for(nbytes)
                        task = asyncio.ensure_future(self._run_one(
                            writer, index, request.custom_id, request.url, request.body,
                            nbytes))
                        self._tasks.add(task)
                        task.add_done_callback(self._tasks.discard)
                    request = None
                    if time.monotonic() - last_progress > PROGRESS_EVERY_S:
                        last_progress = time.monotonic()
                        logger.info("run-batch: %d lines read, %d written", self.num_lines,
                                    writer.num_written)
            finally:
                await lines.aclose()

    async def _room_for(self, nbytes: int) -> None:
        """Until the running requests' bodies leave room for `nbytes` more (or none runs)."""
        while self._body_bytes and self._body_bytes + nbytes > self.body_budget:
            self._room.clear()
            await self._room.wait()
        self._body_bytes += nbytes

    async def _run_one(self, writer: OrderedWriter, index: int, custom_id: str, url: str,
                       body: RequestBody, nbytes: int) -> None:
        try:
            response = await post(self.app, url, body)
        except asyncio.CancelledError:  # the batch was stopped
            response = None
        finally:
            self._in_flight.release()
            self._body_bytes -= nbytes
            self._room.set()
        # cancelled inside the app, the request ends as a client that left (499)
        if response is None or (response.status == 499 and self.stop_reason is not None):
            line = output_line(custom_id, 503, None, {
                "message": f"run-batch was stopped by {self.stop_reason} before this request "
                "finished", "type": "service_unavailable", "param": None,
                "code": "batch_stopped"})
            ok = False
        else:
            line = response_line(custom_id, response)
            ok = response.status == 200 and not response.streamed
        response = None
        if ok:
            self.num_ok += 1
        else:
            self.num_failed += 1
        writer.put(index, line)

    def stop(self, reason: str) -> None:
        """No more lines; the requests running get drain_s to finish (a second call: none)."""
        if self.stop_reason is not None:
            self._cancel_running()
            return
        self.stop_reason = reason
        logger.warning("%s: no more lines are read; the %d requests running get %g s "
                       "(--shutdown-timeout) to finish", reason, len(self._tasks), self.drain_s)
        if self._feeder is not None:
            self._feeder.cancel()
        self._loop.call_later(self.drain_s, self._cancel_running)

    def stop_from_thread(self, reason: str) -> None:
        """The engine supervisor gave up (its thread)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.stop, reason)

    def _cancel_running(self) -> None:
        if self._tasks:
            logger.warning("cancelling the %d requests still running", len(self._tasks))
        for task in list(self._tasks):
            task.cancel()
