"""OpenAI's batch file format, as `vllm run-batch` reads and writes it (`flatserve run-batch`).

Input: JSONL, one request a line, `{"custom_id", "method": "POST", "url", "body"}`. Output:
JSONL, one line per request, `{"id", "custom_id", "response": {"status_code", "request_id",
"body"}, "error"}`: the body of a 200, or a null body and the error object (`{"message",
"type", "param", "code"}`) of any other answer. A line that cannot run (not JSON, a url with
no route here, `stream: true`) gets an error line too, status 400: nothing is dropped.

Either end may be a local file or an http(s) URL (GET to read, PUT to write). The input is
read in chunks and split into lines of bounded length; the output is written in input order
as each line's turn comes, and flushed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import stat
import tempfile
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import httpx

from api_proc.local_call import LocalResponse
from api_proc.request_body import RequestBody

logger = logging.getLogger(__name__)

URLS = ("/v1/chat/completions", "/v1/completions")
CHUNK_BYTES = 1 << 20
# What a line holds beside its body: its custom_id, method and url.
LINE_OVERHEAD_BYTES = 64 << 10
UPLOAD_ATTEMPTS = 3
UPLOAD_BACKOFF_S = 2.0
TRUE_TEXTS = frozenset({"1", "true", "t", "yes", "y", "on"})  # pydantic's lax booleans


class BatchFileError(Exception):
    """The input or the output cannot be read or written: the run stops."""


def is_url(path_or_url: str) -> bool:
    return path_or_url.startswith(("http://", "https://"))


@dataclass
class BatchRequest:
    """A line that runs: its body is taken by the call (R1)."""

    custom_id: str
    url: str
    body: RequestBody


@dataclass
class BatchRefusal:
    """A line that cannot run: its error line says why."""

    custom_id: str | None
    message: str
    code: str


def _error(message: str, code: str, custom_id=None) -> BatchRefusal:
    return BatchRefusal(custom_id if isinstance(custom_id, str) else None, message, code)


def _wants_stream(value) -> bool:
    if isinstance(value, bool | int):
        return bool(value)
    return isinstance(value, str) and value.strip().lower() in TRUE_TEXTS


def parse_line(line: bytes, lineno: int) -> BatchRequest | BatchRefusal:
    """The request on input line `lineno`, or why it cannot run."""
    try:
        item = json.loads(line)
    except json.JSONDecodeError as e:  # the reason and position, never the text (R1)
        return _error(f"line {lineno} is not JSON: {e.msg} at character {e.pos}",
                      "invalid_batch_line")
    except ValueError:
        return _error(f"line {lineno} is not UTF-8 text", "invalid_batch_line")
    if not isinstance(item, dict):
        return _error(f"line {lineno} is not a JSON object", "invalid_batch_line")
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str):
        return _error(f"line {lineno}: custom_id must be a string", "invalid_batch_line")
    method, url = item.get("method"), item.get("url")
    if not isinstance(method, str) or method.upper() != "POST":
        return _error(f"line {lineno}: method must be POST, got {method!r:.40}",
                      "unsupported_method", custom_id)
    if url not in URLS:
        shown = repr(url)[:200]
        return _error(f"line {lineno}: url {shown} is not supported by flatserve run-batch "
                      f"(supported: {', '.join(URLS)})", "unsupported_url", custom_id)
    body = item.pop("body", None)
    item = None
    if not isinstance(body, dict):
        return _error(f"line {lineno}: body must be a JSON object", "invalid_batch_line",
                      custom_id)
    if _wants_stream(body.get("stream")):
        return _error(f"line {lineno}: stream is not supported in a batch (each line gets one "
                      "response)", "stream_not_supported", custom_id)
    return BatchRequest(custom_id, url, RequestBody(json.dumps(body).encode()))


def output_line(custom_id: str | None, status: int, body: bytes | None,
                error: dict | None) -> bytes:
    """One output line. `body`: the response's JSON as the server wrote it, kept as is."""
    head = (f'{{"id": "batch_req_{uuid.uuid4().hex}", "custom_id": {json.dumps(custom_id)}, '
            f'"response": {{"status_code": {status}, "request_id": "batch-{uuid.uuid4().hex}", '
            '"body": ')
    tail = f'}}, "error": {json.dumps(error)}}}'
    return b"".join((head.encode(), body or b"null", tail.encode()))


def refusal_line(refusal: BatchRefusal) -> bytes:
    error = {"message": refusal.message, "type": "invalid_request_error", "param": None,
             "code": refusal.code}
    return output_line(refusal.custom_id, 400, None, error)


def response_line(custom_id: str, response: LocalResponse) -> bytes:
    if response.status == 200 and not response.streamed:
        return output_line(custom_id, 200, response.body, None)
    if response.streamed:  # refused before it is sent; kept for a route that streams anyway
        error = {"message": "the response was streamed: not supported in a batch",
                 "type": "invalid_request_error", "param": None, "code": "stream_not_supported"}
        return output_line(custom_id, 400, None, error)
    return output_line(custom_id, response.status, None, _error_object(response))


def _error_object(response: LocalResponse) -> dict:
    """The `error` of the server's OpenAI-shaped error body."""
    try:
        error = json.loads(response.body).get("error")
    except (ValueError, AttributeError):
        error = None
    if isinstance(error, dict):
        return error
    return {"message": response.body.decode(errors="replace")[:1000] or f"HTTP {response.status}",
            "type": "internal_error", "param": None, "code": None}


class LineTooLong:
    """A line longer than the limit: its bytes were skipped, not held."""

    def __init__(self, limit: int) -> None:
        self.limit = limit


async def read_lines(chunks: AsyncIterator[bytes], limit: int
                     ) -> AsyncIterator[tuple[int, bytes | LineTooLong]]:
    """(line number, line) for each line of `chunks` (blank ones too). A line longer than
    `limit` bytes comes as LineTooLong: at most `limit` bytes of a line (plus one chunk) are
    held at any time (R4). A line is yielded without a local holding it: this generator
    keeps nothing of it while it waits to be asked for the next (R1)."""
    buf = bytearray()
    lineno = 0
    skipping = False  # inside a line already reported as too long
    async for chunk in chunks:
        scan = len(buf)  # the bytes before this chunk hold no newline
        buf += chunk
        chunk = None
        start = 0
        while (end := buf.find(b"\n", scan)) >= 0:
            lineno += 1
            if skipping:
                skipping = False
            elif end - start > limit:
                yield lineno, LineTooLong(limit)
            else:
                yield lineno, bytes(memoryview(buf)[start:end])
            start = scan = end + 1
        del buf[:start]
        if len(buf) > limit:
            if not skipping:
                yield lineno + 1, LineTooLong(limit)
                skipping = True
            buf.clear()
    if buf and not skipping:
        yield lineno + 1, bytes(buf)


@contextlib.asynccontextmanager
async def input_chunks(source: str) -> AsyncIterator[AsyncIterator[bytes]]:
    """The input's bytes as they arrive: a local file (a named pipe too) or an http(s) URL."""
    if is_url(source):
        async with httpx.AsyncClient(timeout=httpx.Timeout(60.0, read=None),
                                     follow_redirects=True) as client:
            try:
                async with client.stream("GET", source) as response:
                    if response.status_code != 200:
                        raise BatchFileError(f"input {source}: HTTP {response.status_code}")
                    yield response.aiter_bytes(CHUNK_BYTES)
            except httpx.HTTPError as e:
                raise BatchFileError(f"input {source}: {e}") from None
        return
    try:
        file = await asyncio.to_thread(open, source, "rb")  # a pipe: until a writer opens it
    except OSError as e:
        raise BatchFileError(f"input {source}: {e.strerror}") from None
    transport = None
    try:
        if stat.S_ISREG(os.fstat(file.fileno()).st_mode):
            yield _file_chunks(file, read=file.read1)
        else:  # a pipe waits for its writer on the loop, not in a thread a stop cannot end
            reader = asyncio.StreamReader(limit=CHUNK_BYTES)
            transport, _ = await asyncio.get_running_loop().connect_read_pipe(
                lambda: asyncio.StreamReaderProtocol(reader), file)
            yield _stream_chunks(reader)
    finally:
        if transport is not None:
            transport.close()
        file.close()


async def _stream_chunks(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    while chunk := await reader.read(CHUNK_BYTES):
        yield chunk


def check_input(source: str) -> None:
    """BatchFileError when a local input is missing, before anything starts."""
    if not is_url(source) and not os.path.exists(source):
        raise BatchFileError(f"input {source}: no such file")


class Output:
    """Where output lines go: the output file itself, or for an http(s) URL a temporary
    file in `tmp_dir` that is uploaded (PUT) when the run ends, then removed."""

    def __init__(self, target: str, tmp_dir: str | None) -> None:
        self.target = target
        self.tmp_dir = tmp_dir
        self.path = target
        if is_url(target):
            if tmp_dir is not None and not os.path.isdir(tmp_dir):
                raise BatchFileError(f"--output-tmp-dir {tmp_dir}: not a folder")
        elif not os.access(Path(target).resolve().parent, os.W_OK):
            raise BatchFileError(f"output {target}: its folder is not writable")
        self.file: IO[bytes] | None = None

    def open(self) -> IO[bytes]:
        try:
            if is_url(self.target):
                handle, self.path = tempfile.mkstemp(prefix="flatserve-batch-",
                                                     suffix=".jsonl", dir=self.tmp_dir)
                self.file = os.fdopen(handle, "wb")
            else:
                self.file = open(self.target, "wb")
        except OSError as e:
            raise BatchFileError(f"output {self.path}: {e.strerror}") from None
        return self.file

    async def close(self) -> None:
        """Close the file; upload it when the output is a URL."""
        if self.file is None:
            return
        self.file.close()
        if not is_url(self.target):
            return
        try:
            await upload(self.path, self.target)
        finally:
            os.unlink(self.path)


async def upload(path: str, url: str) -> None:
    """PUT the file at `path` to `url` (streamed from the file, with its length), retried."""
    size = os.path.getsize(path)
    for attempt in range(1, UPLOAD_ATTEMPTS + 1):
        try:
            async with httpx.AsyncClient(timeout=httpx.Timeout(60.0, write=None)) as client:
                with open(path, "rb") as file:
                    response = await client.put(url, content=_file_chunks(file),
                                                headers={"content-length": str(size)})
            if 200 <= response.status_code < 300:
                logger.info("output uploaded to %s (%d bytes)", url, size)
                return
            problem = f"HTTP {response.status_code}"
        except httpx.HTTPError as e:
            problem = str(e) or type(e).__name__
        if attempt == UPLOAD_ATTEMPTS:
            raise BatchFileError(f"output {url}: upload failed {attempt} times, last: {problem}")
        delay = UPLOAD_BACKOFF_S * 2 ** (attempt - 1)
        logger.warning("output %s: upload failed (%s); again in %g s", url, problem, delay)
        await asyncio.sleep(delay)


async def _file_chunks(file: IO[bytes], read: Callable[[int], bytes] | None = None
                       ) -> AsyncIterator[bytes]:
    read = read or file.read
    while chunk := await asyncio.to_thread(read, CHUNK_BYTES):
        yield chunk


class OrderedWriter:
    """Writes output lines in input order as soon as each one's turn comes: a finished line
    waits here only for the ones before it. `on_written` is called once per line written
    (run-batch reads a new line for each one: what waits here is bounded)."""

    def __init__(self, file: IO[bytes], on_written: Callable[[], None]) -> None:
        self.file = file
        self.on_written = on_written
        self.num_written = 0
        self._ready: dict[int, bytes] = {}

    def put(self, index: int, line: bytes) -> None:
        self._ready[index] = line
        if index != self.num_written:
            return
        while (line := self._ready.pop(self.num_written, None)) is not None:
            self.file.write(line)
            self.file.write(b"\n")
            self.num_written += 1
            self.on_written()
        self.file.flush()
