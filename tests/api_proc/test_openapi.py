"""GET /openapi.json declares every answer of every route (issue 46), as vLLM's schema-fuzzing
test requires: each route is sent what makes it refuse (no API key, a body not declared as
JSON, a bad or unknown-model body, a body too large or too slow, a head too large or too
slow, a large body while a stalled upload holds the budget, an engine that fails or is not
there) and what it answers, status and content type, must be what the served schema
declares for it: nothing undeclared, nothing declared that never comes."""

from __future__ import annotations

import socket
import time
from collections import defaultdict

import httpx
import pytest

from api_proc.protocol import ErrorResponse

KEY = {"Authorization": "Bearer sekrit"}
JSON = {"content-type": "application/json"}
ERROR_SCHEMA = {"$ref": "#/components/schemas/ErrorResponse"}
TIMEOUT_S = 0.5
MAX_BODY_BYTES = 100_000
MAX_HEADER_BYTES = 8192
BUDGET = 400_000
STREAMED = ("/v1/chat/completions", "/v1/completions", "/invocations")
ENGINE_ROUTES = (*STREAMED, "/v1/chat/completions/batch")


def body(path: str, text: str = "hi", **fields) -> dict:
    """A body `path` serves, with `text` as its prompt."""
    chat = [{"role": "user", "content": text}]
    forms = {"/v1/completions": {"prompt": text, "max_tokens": 2},
             "/v1/chat/completions/batch": {"messages": [chat], "max_tokens": 2},
             "/tokenize": {"prompt": text},
             "/detokenize": {"tokens": [1, 2]}}
    return {**forms.get(path, {"messages": chat, "max_tokens": 2}), **fields}


class Answers:
    """What each route answered: (METHOD, path) -> {(status, media type)}, and the errors'
    bodies."""

    def __init__(self) -> None:
        self.seen: dict[tuple[str, str], set[tuple[int, str]]] = defaultdict(set)
        self.errors: list[tuple[str, str, int, bytes]] = []

    def add(self, method: str, path: str, status: int, content_type: str, content: bytes):
        self.seen[(method, path)].add((status, media_type(content_type)))
        if status >= 400:
            self.errors.append((method, path, status, content))

    def request(self, server, method: str, path: str, *, headers=KEY, **kw) -> int:
        r = httpx.request(method, server.url + path, headers=headers, timeout=30, **kw)
        self.add(method, path, r.status_code, r.headers.get("content-type", ""), r.content)
        return r.status_code

    def stalled(self, server, head: bytes, sent_body: bytes = b"") -> socket.socket:
        """A connection that sends `head` (and `sent_body`) and then nothing."""
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        sock.sendall(head + sent_body)
        return sock

    def answer_of(self, sock: socket.socket, method: str, path: str) -> int:
        """Record the one answer the server sends before it closes `sock`."""
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
        sock.close()
        head, _, content = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = dict(line.lower().split(": ", 1) for line in lines[1:])
        status = int(lines[0].split()[1])
        self.add(method, path, status, headers.get("content-type", ""), content)
        return status


def media_type(content_type: str) -> str:
    return content_type.partition(";")[0].strip().lower()


def declared(spec: dict) -> dict[tuple[str, str], set[tuple[int, str]]]:
    return {(method.upper(), path): {(int(status), media_type(t))
                                     for status, answer in op["responses"].items()
                                     for t in answer.get("content", {})}
            for path, ops in spec["paths"].items() for method, op in ops.items()}


def provoke_refusals(answers: Answers, server, operations) -> None:
    """Every route: no key, a head too large, a head too slow; every POST route: a body not
    JSON, not parsing, naming an unknown model, too large, too slow, failing in the engine;
    and what each serves (streamed, where it streams)."""
    stalled = []
    for method, path in operations:
        answers.request(server, method, path, headers=None)  # no API key
        answers.request(server, method, path, headers={**KEY, "x-pad": "a" * MAX_HEADER_BYTES})
        stalled.append((method, path, answers.stalled(
            server, f"{method} {path} HTTP/1.1\r\nHost: x\r\n".encode())))
        if method == "GET":
            answers.request(server, method, path)
            continue
        answers.request(server, method, path, json=body(path))
        answers.request(server, method, path, content=b"{}", headers={**KEY, "content-type":
                                                                        "text/plain"})
        answers.request(server, method, path, content=b"{not json", headers={**KEY, **JSON})
        answers.request(server, method, path, json=body(path, model="gpt-9"))
        answers.request(server, method, path, content=b" " * (MAX_BODY_BYTES + 1),
                        headers={**KEY, **JSON})
        if path in STREAMED:
            answers.request(server, method, path, json=body(path, stream=True))
        if path in ENGINE_ROUTES:
            answers.request(server, method, path, json=body(path, "[[error]]"))
        head = (f"{method} {path} HTTP/1.1\r\nHost: x\r\nAuthorization: {KEY['Authorization']}"
                f"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n").encode()
        stalled.append((method, path, answers.stalled(server, head, b"{")))
    for method, path, sock in stalled:  # all time out together
        assert answers.answer_of(sock, method, path) == 408


def provoke_unavailability(answers: Answers, server, operations) -> None:
    """A server with no engine: what every route answers; and every POST route given a
    large body while a stalled upload holds most of the budget."""
    for method, path in operations:
        answers.request(server, method, path, **({"json": body(path)} if method == "POST" else {}))
    head = (f"POST /tokenize HTTP/1.1\r\nHost: x\r\nAuthorization: {KEY['Authorization']}\r\n"
            f"Content-Type: application/json\r\nContent-Length: 200000\r\n\r\n").encode()
    holder = answers.stalled(server, head, b" " * 150_000)
    admission = server.app.state.admission
    deadline = time.monotonic() + 10
    while admission.in_flight_bytes < 300_000:
        assert time.monotonic() < deadline, "the stalled upload never held its bytes"
        time.sleep(0.01)
    for method, path in operations:
        if method == "POST":
            assert answers.request(server, method, path, content=b" " * 70_000,
                                   headers={**KEY, **JSON}) == 429
    holder.close()


@pytest.fixture
def servers(start_app, engine_double):
    options = dict(api_key="sekrit", enable_server_load_tracking=True)
    limited = start_app(engine_double, max_body_bytes=MAX_BODY_BYTES,
                        max_header_bytes=MAX_HEADER_BYTES, header_read_timeout_s=TIMEOUT_S,
                        body_read_timeout_s=TIMEOUT_S, **options)
    engineless = start_app(None, mm_inflight_budget=BUDGET, admission_timeout_s=0.2, **options)
    return limited, engineless


def test_every_answer_of_every_route_is_declared(servers):
    limited, engineless = servers
    spec = httpx.get(limited.url + "/openapi.json").json()
    assert httpx.get(engineless.url + "/openapi.json").json() == spec  # limits change no route
    expected = declared(spec)
    answers = Answers()
    provoke_refusals(answers, limited, sorted(expected))
    provoke_unavailability(answers, engineless, sorted(expected))

    for op in sorted(expected.keys() | answers.seen.keys()):
        seen, promised = answers.seen.get(op, set()), expected.get(op, set())
        assert seen == promised, (f"{op}: answered, not declared: {sorted(seen - promised)}; "
                                  f"declared, never answered: {sorted(promised - seen)}")
    for method, path, status, content in answers.errors:
        if (path, status) == ("/health", 503):
            continue  # the health report, not an error
        answer = spec["paths"][path][method.lower()]["responses"][str(status)]
        assert answer["content"]["application/json"]["schema"] == ERROR_SCHEMA
        ErrorResponse.model_validate_json(content)


def test_metrics_declares_the_content_type_it_answers(start_app, engine_double):
    server = start_app(engine_double)
    spec = httpx.get(server.url + "/openapi.json").json()
    answer = httpx.get(server.url + "/metrics")
    assert answer.status_code == 200
    assert set(spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {
        answer.headers["content-type"]}
