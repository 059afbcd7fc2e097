"""The HTTP app against the engine test double (a real engine socket in another process)."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tokenizers import Tokenizer

from api_proc.protocol import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionResponse,
    ErrorResponse,
)
from shared.random_checkpoints import CHECKPOINT_VERSION
from tests.api_proc.conftest import data_url, encode_image

MODEL = f"tiny-qwen2.5-vl-{CHECKPOINT_VERSION}"  # the tiny checkpoint folder's name


def chat(server, content, timeout=30, **body):
    body.setdefault("max_tokens", 8)
    return httpx.post(server.url + "/v1/chat/completions", timeout=timeout,
                      json={"messages": [{"role": "user", "content": content}], **body})


def sse_events(response) -> list:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def image_content(*images, text="describe"):
    return [*({"type": "image_url", "image_url": {"url": data_url(im)}} for im in images),
            {"type": "text", "text": text}]


def assert_error(response, status, type_=None, match=None):
    assert response.status_code == status, response.text
    body = ErrorResponse.model_validate(response.json())
    if type_:
        assert body.error.type == type_
    if match:
        assert match in body.error.message, body.error.message
    return body.error


@pytest.fixture
def server(start_app, engine_double):
    return start_app(engine_double)


def test_models_health_metrics(server):
    models = httpx.get(server.url + "/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == MODEL
    health = httpx.get(server.url + "/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    chat(server, "count me")
    text = httpx.get(server.url + "/metrics").text
    # it parses, and carries vLLM's names and model_name label beside flatserve's own
    samples = {s.name: s for family in text_string_to_metric_families(text)
               for s in family.samples}
    for name in ("vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:request_success_total", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_count", "vllm:inter_token_latency_seconds_sum",
                 "vllm:request_time_per_output_token_seconds_count",
                 "vllm:request_queue_time_seconds_count", "vllm:num_requests_running",
                 "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:num_preemptions_total", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total", "flatserve_requests_total",
                 "flatserve_requests_waiting_admission", "flatserve_requests_running",
                 "flatserve_mm_inflight_bytes", "flatserve_process_rss_bytes",
                 "flatserve_encoder_cache_bytes"):
        assert name in samples, name
    assert samples["vllm:prompt_tokens_total"].labels == {"model_name": MODEL}
    assert samples["vllm:request_success_total"].labels["finished_reason"] in ("stop", "length")
    assert samples["vllm:e2e_request_latency_seconds_count"].value == 1
    assert 'flatserve_requests_total{endpoint="chat",status="200"} 1.0' in text


def test_chat_text_only(server, engine_double):
    r = chat(server, "hello there 你好 😀", max_tokens=200)
    assert r.status_code == 200, r.text
    body = ChatCompletionResponse.model_validate(r.json())
    assert "hello there 你好 😀" in body.choices[0].message.content
    assert body.choices[0].finish_reason == "stop"
    assert body.usage.completion_tokens > 0
    assert body.usage.total_tokens == body.usage.prompt_tokens + body.usage.completion_tokens
    seen = [q for q in engine_double.log()["requests"] if q["id"].startswith(body.id)]
    assert len(seen) == 1 and seen[0]["shapes"] == [] and seen[0]["max_tokens"] == 200


def test_chat_stream_with_usage(server):
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "stream me"}], "stream": True,
            "max_tokens": 6, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = [ChatCompletionChunk.model_validate(e) for e in events[:-1]]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert chunks[-2].choices[0].finish_reason == "length"
    assert len({c.id for c in chunks}) == 1


def test_mm_processor_kwargs_bound_the_resize(start_app, engine_double):
    # vLLM's --mm-processor-kwargs: at most 56x56 pixels (the tiny model's factor is 28)
    bounded = start_app(engine_double, mm_processor_kwargs=(("max_pixels", 56 * 56),))
    r = chat(bounded, image_content(encode_image(200, 100)))
    assert r.status_code == 200, r.text
    seen = [q for q in engine_double.log()["requests"] if q["id"].startswith(r.json()["id"])][0]
    assert seen["shapes"] == [[28, 56, 3]] and seen["grids"] == [[1, 2, 4]]


def test_chat_with_images_expands_placeholders(server, engine_double):
    r = chat(server, image_content(encode_image(200, 100), encode_image(64, 64)))
    assert r.status_code == 200, r.text
    rid = r.json()["id"]
    seen = [q for q in engine_double.log()["requests"] if q["id"].startswith(rid)][0]
    assert seen["grids"] == [[1, 8, 14], [1, 4, 4]]  # 112x196 and 56x56 pixels
    assert seen["shapes"] == [[112, 196, 3], [56, 56, 3]]
    text_only = chat(server, "describe").json()["usage"]["prompt_tokens"]
    # each image adds vision_start + vision_end + h*w/4 image tokens
    assert r.json()["usage"]["prompt_tokens"] == text_only + (2 + 28) + (2 + 4)


def test_n_choices_share_one_image(server, engine_double):
    r = chat(server, image_content(encode_image(96, 96)), n=3, max_tokens=4, temperature=0.7, seed=5)
    assert r.status_code == 200, r.text
    body = ChatCompletionResponse.model_validate(r.json())
    assert [c.index for c in body.choices] == [0, 1, 2]
    assert body.usage.completion_tokens == 12
    seen = [q for q in engine_double.log()["requests"] if q["id"].startswith(body.id)]
    assert sorted(q["id"] for q in seen) == [f"{body.id}-{i}" for i in range(3)]
    assert all(q["shapes"] == [[84, 84, 3]] for q in seen)


def test_n_choices_stream(server):
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "two of us"}], "stream": True,
            "n": 2, "max_tokens": 3}) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    finished = [e["choices"][0]["index"] for e in events[:-1] if e["choices"][0]["finish_reason"]]
    assert sorted(finished) == [0, 1]


def test_stop_string_stops_the_engine(server, engine_double):
    r = chat(server, "alpha beta STOP gamma " + "more words " * 40 + "[[slow]]", max_tokens=200,
             stop=["STOP"])
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "stop"
    content = body["choices"][0]["message"]["content"]
    assert content.endswith("alpha beta ") and "STOP" not in content
    rid = f"{body['id']}-0"
    deadline = time.monotonic() + 3
    while rid not in engine_double.log()["aborted"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert rid in engine_double.log()["aborted"]


def test_completions(server, engine_double, tiny_model_path):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "once upon a time"})
    assert r.status_code == 200, r.text
    body = CompletionResponse.model_validate(r.json())
    assert body.choices[0].text == "once upon a time"
    assert body.choices[0].finish_reason == "stop"
    seen = [q for q in engine_double.log()["requests"] if q["id"].startswith(body.id)]
    assert seen[0]["max_tokens"] == 16  # OpenAI's default for completions
    r = httpx.post(server.url + "/v1/completions",
                   json={"prompt": ["one two", "three four"], "max_tokens": 8, "n": 2})
    body = CompletionResponse.model_validate(r.json())
    assert [c.index for c in body.choices] == [0, 1, 2, 3]
    assert body.choices[0].text == "one two" and body.choices[2].text == "three four"
    hi = Tokenizer.from_file(str(tiny_model_path / "tokenizer.json")).encode("Hi").ids
    ids = httpx.post(server.url + "/v1/completions", json={"prompt": hi, "max_tokens": 4})
    assert ids.json()["choices"][0]["text"] == "Hi"
    with httpx.stream("POST", server.url + "/v1/completions",
                      json={"prompt": "streamed words", "stream": True}) as r:
        events = sse_events(r)
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == "streamed words"


@pytest.mark.parametrize("body, status, match", [
    ({"messages": []}, 400, "messages"),
    ({}, 400, "messages: Field required"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": 5}, 400, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 100}, 400, "max_n"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "auto"}, 400, "tool_choice"),
    # tool_choice auto (the default with tools) needs --enable-auto-tool-choice, as in vLLM
    ({"messages": [{"role": "user", "content": "x"}], "tools": [
        {"type": "function", "function": {"name": "f"}}]}, 400, "--enable-auto-tool-choice"),
    ({"messages": [{"role": "", "content": "x"}]}, 400, "role"),
    ({"messages": [{"role": "user", "content": [{"type": "audio", "x": 1}]}]}, 400, "content"),
    ({"messages": [{"role": "user", "content": "x"}], "model": "gpt-9"}, 404, "gpt-9"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 40000}, 400, "max_model_len"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": "data:image/png;base64,aGVsbG8="}}]}]}, 400, "not a supported image"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": "http://127.0.0.1:1/x.png"}}]}]}, 400, "non-public"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": "http://0177.0.0.1:8499/x.png"}}]}]}, 400, "image URL host: '0177.0.0.1'"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": "http://[::1/x.png"}}]}]}, 400, "image URL host"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": "http://a\x00b/x.png"}}]}]}, 400, "image URL host: control character"),
])
def test_bad_requests_get_openai_errors(server, body, status, match):
    r = httpx.post(server.url + "/v1/chat/completions", json=body)
    assert_error(r, status, match=match)


def test_malformed_json_is_400(server):
    r = httpx.post(server.url + "/v1/chat/completions", content=b"{not json",
                   headers={"content-type": "application/json"})
    assert_error(r, 400, "invalid_request_error", "JSON")


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", "application/jsonx"])
def test_a_body_not_declared_as_json_is_415_and_runs_nothing(server, engine_double, path,
                                                             content_type):
    # what a foreign web page can send without a CORS preflight
    prompt = {"prompt": "csrf"} if path == "/v1/completions" else {
        "messages": [{"role": "user", "content": "csrf"}]}
    body = json.dumps({**prompt, "max_tokens": 2})
    headers = {"content-type": content_type} if content_type else {}
    before = len(engine_double.log()["requests"])
    r = httpx.post(server.url + path, content=body.encode(), headers=headers)
    error = assert_error(r, 415, "invalid_request_error", "Content-Type must be application/json")
    assert error.code == "unsupported_media_type"
    assert len(engine_double.log()["requests"]) == before
    ok = httpx.post(server.url + path, content=body.encode(),
                    headers={"content-type": "Application/JSON; charset=utf-8"})
    assert ok.status_code == 200, ok.text


def test_unknown_route_is_404(server):
    assert_error(httpx.get(server.url + "/v2/nothing"), 404, "not_found_error")
    assert httpx.get(server.url + "/v1/chat/completions").status_code == 405


def test_too_many_images(start_app, engine_double):
    server = start_app(engine_double, limit_mm_per_prompt=1)
    r = chat(server, image_content(encode_image(), encode_image()))
    assert_error(r, 400, match="limit_mm_per_prompt=1")


def test_body_and_image_size_limits(start_app, engine_double):
    server = start_app(engine_double, max_body_bytes=50_000, max_image_bytes=10_000)
    big = encode_image(256, 256)  # about 200 kB of noise
    assert_error(chat(server, image_content(big)), 413, "request_too_large", "max_body_bytes=50000")
    small = encode_image(80, 60)
    assert 10_000 < len(small) < 30_000
    assert_error(chat(server, image_content(small)), 413, match="max_image_bytes=10000")
    chunked = httpx.post(server.url + "/v1/chat/completions",
                         content=iter([b"{" + b" " * 40_000, b" " * 40_000 + b"}"]),
                         headers={"content-type": "application/json"})
    assert_error(chunked, 413, match="max_body_bytes")


def test_image_bigger_than_the_whole_budget_is_413(start_app, engine_double):
    server = start_app(engine_double, mm_inflight_budget=100_000)
    assert_error(chat(server, image_content(encode_image(400, 300))), 413, match="mm_inflight_budget")
    assert chat(server, image_content(encode_image(32, 32))).status_code == 200


def test_pixel_bomb_is_400(start_app, engine_double):
    server = start_app(engine_double, max_image_pixels=10_000)
    assert_error(chat(server, image_content(encode_image(200, 100))), 400,
                 match="max_image_pixels is 10000")


def test_api_key(start_app, engine_double):
    server = start_app(engine_double, api_key="sekrit")
    assert_error(chat(server, "x"), 401, "authentication_error")
    r = httpx.post(server.url + "/v1/chat/completions", headers={"Authorization": "Bearer nope"},
                   json={"messages": [{"role": "user", "content": "x"}]})
    assert_error(r, 401)
    r = httpx.post(server.url + "/v1/chat/completions", headers={"Authorization": "Bearer sekrit"},
                   json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2})
    assert r.status_code == 200
    assert httpx.get(server.url + "/v1/models").status_code == 401
    assert httpx.get(server.url + "/health").status_code == 200  # probes need no key


def test_api_key_guards_metrics_and_health_details(start_app, engine_double, fresh_engine_double):
    key = {"Authorization": "Bearer sekrit"}
    server = start_app(engine_double, api_key="sekrit")
    assert_error(httpx.get(server.url + "/metrics"), 401, "authentication_error")
    assert_error(httpx.get(server.url + "/metrics", headers={"Authorization": "Bearer no"}), 401)
    assert "vllm:num_requests_running" in httpx.get(server.url + "/metrics", headers=key).text
    terse = httpx.get(server.url + "/health")
    assert terse.status_code == 200 and terse.json() == {"status": "ok"}
    detailed = httpx.get(server.url + "/health", headers=key).json()
    assert detailed["engines"][0]["address"] == engine_double.address
    # a dead engine: the probe still sees 503, but not where the socket is nor why
    dying = start_app(fresh_engine_double, api_key="sekrit")
    fresh_engine_double.kill()
    terse = httpx.get(dying.url + "/health")
    assert terse.status_code == 503
    assert terse.json() == {"status": "unhealthy", "reason": "1 of 1 engines unavailable"}
    assert fresh_engine_double.address.removeprefix("ipc://") not in terse.text
    detailed = httpx.get(dying.url + "/health", headers=key)
    assert detailed.status_code == 503 and "exited" in detailed.json()["reason"]


def test_metrics_can_be_opened_beside_the_api_key(start_app, engine_double, make_config):
    server = start_app(engine_double, api_key="sekrit", allow_unauthenticated_metrics=True)
    assert httpx.get(server.url + "/metrics").status_code == 200
    assert_error(chat(server, "x"), 401)
    with pytest.raises(ValueError, match="allow_unauthenticated_metrics applies with api_key"):
        make_config(allow_unauthenticated_metrics=True)


def test_engine_error_mid_stream_and_non_stream(server):
    r = chat(server, "[[error]] please")
    assert_error(r, 500, "engine_error", "failed on purpose")
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "[[error]] please"}], "stream": True}) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["type"] == "engine_error"


def test_engine_refusal_is_400(server):
    assert_error(chat(server, "[[refuse]]"), 400, match="refused by the test double")


def test_client_disconnect_aborts_the_engine_request(server, engine_double):
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "[[hang]] wait for me"}],
            "stream": True, "max_tokens": 50}) as r:
        lines = r.iter_lines()
        first = json.loads(next(lines)[len("data: "):])
        next(line for line in lines if line.startswith("data: "))  # a token chunk
    rid = first["id"] + "-0"
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        log = engine_double.log()
        if rid in log["aborted"]:
            break
        time.sleep(0.05)
    assert rid in log["aborted"] and rid not in log["running"]
    assert server.app.state.engine_client.num_in_flight == 0


def test_non_stream_disconnect_aborts_too(server, engine_double):
    with pytest.raises(httpx.ReadTimeout):
        chat(server, "[[hang]] non-stream", timeout=0.5)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and engine_double.log()["running"]:
        time.sleep(0.05)
    assert engine_double.log()["running"] == []
    assert server.app.state.engine_client.num_in_flight == 0


def test_engine_death_is_503(start_app, fresh_engine_double):
    server = start_app(fresh_engine_double)
    assert chat(server, "alive").status_code == 200
    fresh_engine_double.kill()
    health = httpx.get(server.url + "/health")
    assert health.status_code == 503 and "exited" in health.json()["reason"]
    assert_error(chat(server, "anyone?"), 503, "service_unavailable")


def test_no_engine_is_503(start_app):
    server = start_app(None)
    assert httpx.get(server.url + "/health").status_code == 503
    assert_error(chat(server, "x"), 503, "service_unavailable", "no engine")


def test_no_bad_input_is_a_500(start_app, engine_double):
    """Random bodies built from the protocol's own field names never get a 5xx."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    server = start_app(engine_double)
    http = httpx.Client(timeout=30)
    scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                        st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20))
    part = st.one_of(
        st.fixed_dictionaries({"type": st.just("text"), "text": st.one_of(st.text(max_size=30), scalars)}),
        st.fixed_dictionaries({"type": st.just("image_url"), "image_url": st.one_of(
            scalars, st.fixed_dictionaries({"url": st.one_of(st.sampled_from([
                "data:image/png;base64,", "data:image/png;base64,AAAA", "http://[::1]/x",
                "file:///etc/passwd", "data:,x", "javascript:alert(1)"]), scalars)}))}),
        scalars)
    message = st.fixed_dictionaries({"role": st.one_of(st.sampled_from(["user", "system", "assistant"]), scalars),
                                     "content": st.one_of(st.text(max_size=30), st.lists(part, max_size=3), scalars)})
    body = st.fixed_dictionaries({}, optional={
        "messages": st.one_of(st.lists(message, max_size=3), scalars),
        "max_tokens": scalars, "temperature": scalars, "top_p": scalars, "top_k": scalars,
        "seed": scalars, "n": st.one_of(st.integers(-3, 20), scalars),
        "stop": st.one_of(st.lists(st.text(max_size=5), max_size=3), scalars),
        "stream": scalars, "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": scalars}), scalars),
        "prompt": st.one_of(st.lists(st.integers(-5, 10**10), max_size=4), scalars),
        "model": scalars, "stop_token_ids": st.one_of(st.lists(st.integers(-5, 10**12), max_size=3), scalars)})

    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
    @given(body=body, path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
    def check(body, path):
        r = http.post(server.url + path, json=body)
        assert r.status_code < 500, (body, r.text)
        if r.status_code != 200:
            ErrorResponse.model_validate(r.json())

    try:
        check()
    finally:
        http.close()


def test_slowly_uploaded_body_arrives_whole(server):
    body = json.dumps({"messages": [{"role": "user", "content": image_content(
        encode_image(300, 300), text="slow upload")}], "max_tokens": 300}).encode()

    def pieces():
        for i in range(0, len(body), 16_384):
            time.sleep(0.01)
            yield body[i:i + 16_384]
    r = httpx.post(server.url + "/v1/chat/completions", content=pieces(), timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    assert "slow upload" in r.json()["choices"][0]["message"]["content"]
