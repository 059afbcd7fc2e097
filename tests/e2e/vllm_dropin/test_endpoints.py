"""vLLM's other routes and server options against a real server (issue 31, theme 7):
/tokenize and /detokenize, /version, /load, /openapi.json, /invocations,
/v1/chat/completions/batch, `root` in /v1/models, return_tokens_as_token_ids, and
tool_choice required beside response_format."""

from __future__ import annotations

import base64
import io
import json

import httpx
import openai
import pytest
from PIL import Image

from api_proc.prompt_builder import PromptBuilder
from tests.e2e.vllm_dropin.conftest import MODEL

CHAT = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def builder(tiny_model_path):
    return PromptBuilder.from_pretrained(tiny_model_path)


def post(server, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60, **kw)


def png(size: int) -> str:
    buf = io.BytesIO()
    Image.new("RGB", (size, size), "teal").save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_tokenize_a_prompt_and_back(dropin_server, builder):
    r = post(dropin_server, "/tokenize", {"model": MODEL, "prompt": "Hello world",
                                          "return_token_strs": True}).json()
    ids = builder.encode("Hello world")
    assert r["tokens"] == ids and r["count"] == len(ids)
    assert r["max_model_len"] == 8192  # the default: the model's own, at most 8192
    assert "".join(r["token_strs"]).replace("\u0120", " ") == "Hello world"
    back = post(dropin_server, "/detokenize", {"model": MODEL, "tokens": ids}).json()
    assert back == {"prompt": "Hello world"}
    refused = post(dropin_server, "/detokenize", {"tokens": [builder.vocab_size]})
    assert refused.status_code == 400 and "out of vocabulary" in refused.json()["error"]["message"]


def test_tokenize_a_conversation_expands_its_images(dropin_server, builder, tiny_model_path):
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": png(56)}}, {"type": "text", "text": "What?"}]}]
    r = post(dropin_server, "/tokenize", {"model": MODEL, "messages": messages}).json()
    text = builder.render_chat([{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "What?"}]}])
    grid = (1, 4, 4)  # 56x56 pixels in 14-pixel patches
    assert r["tokens"] == builder.prompt_ids(text, [grid])
    assert r["tokens"].count(builder.image_token_id) == builder.num_image_tokens(grid)
    # the prompt a chat completion gets: usage counts the same tokens
    usage = post(dropin_server, "/v1/chat/completions", {
        "model": MODEL, "messages": messages, "max_tokens": 1}).json()["usage"]
    assert usage["prompt_tokens"] == r["count"]
    opened = post(dropin_server, "/tokenize", {"messages": CHAT}).json()["tokens"]
    closed = post(dropin_server, "/tokenize", {"messages": CHAT,
                                               "add_generation_prompt": False}).json()["tokens"]
    assert opened[:len(closed)] == closed and len(opened) > len(closed)


def test_version_models_root_and_openapi(dropin_server, oai, tiny_model_path):
    assert httpx.get(dropin_server.url + "/version").json()["version"]
    [card] = oai.models.list().data
    assert card.id == MODEL and card.model_extra["root"] == str(tiny_model_path)
    spec = httpx.get(dropin_server.url + "/openapi.json").json()
    chat = spec["paths"]["/v1/chat/completions"]["post"]["requestBody"]
    ref = chat["content"]["application/json"]["schema"]["$ref"]
    schema = spec["components"]["schemas"][ref.rsplit("/", 1)[1]]
    assert {"messages", "temperature", "tools"} <= set(schema["properties"])
    for path in ("/v1/completions", "/tokenize", "/detokenize", "/invocations",
                 "/v1/chat/completions/batch"):
        assert "requestBody" in spec["paths"][path]["post"], path


def test_invocations_serve_chat_and_completions(dropin_server, oai):
    chat = post(dropin_server, "/invocations", {"messages": CHAT, "max_tokens": 3,
                                                "temperature": 0}).json()
    direct = oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3,
                                         temperature=0)
    assert chat["object"] == "chat.completion"
    assert chat["choices"][0]["message"]["content"] == direct.choices[0].message.content
    text = post(dropin_server, "/invocations", {"prompt": "Hi", "max_tokens": 2}).json()
    assert text["object"] == "text_completion"
    neither = post(dropin_server, "/invocations", {"input": "x"})
    assert neither.status_code == 400 and "neither" in neither.json()["error"]["message"]


def test_batch_answers_each_conversation_in_order(dropin_server, oai):
    conversations = [CHAT, [{"role": "user", "content": "Another one"}]]
    r = post(dropin_server, "/v1/chat/completions/batch", {
        "model": MODEL, "messages": conversations, "max_tokens": 3, "temperature": 0}).json()
    assert [c["index"] for c in r["choices"]] == [0, 1]
    for conversation, choice in zip(conversations, r["choices"], strict=True):
        alone = oai.chat.completions.create(model=MODEL, messages=conversation, max_tokens=3,
                                            temperature=0)
        assert choice["message"]["content"] == alone.choices[0].message.content
    refused = post(dropin_server, "/v1/chat/completions/batch", {
        "messages": conversations, "stream": True})
    assert refused.status_code == 400 and "stream" in refused.json()["error"]["message"]


def test_load_counts_requests_being_served(dropin_server):
    assert httpx.get(dropin_server.url + "/load").json() == {"server_load": 0}
    seen = []
    with httpx.stream("POST", dropin_server.url + "/v1/chat/completions", timeout=60, json={
            "model": MODEL, "messages": CHAT, "max_tokens": 30, "stream": True,
            "ignore_eos": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and not seen:
                seen.append(httpx.get(dropin_server.url + "/load").json()["server_load"])
    assert seen == [1]
    assert httpx.get(dropin_server.url + "/load").json() == {"server_load": 0}


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_return_tokens_as_token_ids(oai, kind):
    if kind == "chat":
        reply = oai.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=3, logprobs=True, top_logprobs=2,
            extra_body={"return_tokens_as_token_ids": True})
        entries = reply.choices[0].logprobs.content
        assert entries and all(e.token.startswith("token_id:") for e in entries)
        assert all(t.token.startswith("token_id:") for e in entries for t in e.top_logprobs)
        assert int(entries[0].token.split(":")[1]) >= 0
    else:
        reply = oai.completions.create(model=MODEL, prompt="Hi", max_tokens=3, logprobs=2,
                                       extra_body={"return_tokens_as_token_ids": True})
        lp = reply.choices[0].logprobs
        assert all(t.startswith("token_id:") for t in lp.tokens)
        assert all(k.startswith("token_id:") for top in lp.top_logprobs for k in top)


def test_required_tool_choice_with_response_format(oai):
    pytest.importorskip("xgrammar")
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC"]}}, "required": ["zone"]}}}]
    reply = oai.chat.completions.create(
        model=MODEL, messages=CHAT, tools=tools, tool_choice="required", max_tokens=60,
        response_format={"type": "json_object"}, parallel_tool_calls=False).choices[0]
    [call] = reply.message.tool_calls
    assert call.function.name == "get_time" and json.loads(call.function.arguments) == {
        "zone": "UTC"}
    with pytest.raises(openai.BadRequestError, match="guided_regex"):
        oai.chat.completions.create(model=MODEL, messages=CHAT, tools=tools,
                                    tool_choice="required", extra_body={"guided_regex": "a"})


VLLM_FAMILIES = ("request_prompt_tokens", "request_generation_tokens", "request_params_n",
                 "request_params_max_tokens", "request_inference_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds",
                 "mm_cache_queries", "mm_cache_hits")


def test_vllm_metric_families(dropin_server, oai, builder):
    from prometheus_client.parser import text_string_to_metric_families

    def samples() -> dict[str, float]:
        text = httpx.get(dropin_server.url + "/metrics").text
        return {s.name: s.value for f in text_string_to_metric_families(text)
                for s in f.samples if not s.labels.get("le")}

    before = samples()
    prompt = builder.encode("Hello my name is Robert")
    for _ in range(2):
        oai.completions.create(model=MODEL, prompt=prompt, max_tokens=5,
                               extra_body={"ignore_eos": True})
    after = samples()
    for family in VLLM_FAMILIES:
        assert any(name.startswith("vllm:" + family) for name in after), family

    def grew(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert grew("vllm:request_prompt_tokens_sum") == 2 * len(prompt)
    assert grew("vllm:request_generation_tokens_sum") == 10
    assert grew("vllm:request_params_max_tokens_sum") == 10
    assert grew("vllm:request_params_n_count") == 2
    assert grew("vllm:request_decode_time_seconds_count") == 2
