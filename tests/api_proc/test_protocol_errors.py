from __future__ import annotations

import pytest
from pydantic import ValidationError

from api_proc.errors import (
    BadRequest,
    EngineUnavailable,
    HTTPError,
    NotFound,
    OverBudget,
    PayloadTooLarge,
    Unauthorized,
    format_validation_errors,
)
from api_proc.protocol import ChatCompletionRequest, CompletionRequest, ErrorResponse


@pytest.mark.parametrize("cls, status, type_", [
    (BadRequest, 400, "invalid_request_error"),
    (Unauthorized, 401, "authentication_error"),
    (NotFound, 404, "not_found_error"),
    (PayloadTooLarge, 413, "request_too_large"),
    (OverBudget, 429, "rate_limit_error"),
    (EngineUnavailable, 503, "service_unavailable"),
    (HTTPError, 500, "internal_error"),
])
def test_error_shapes(cls, status, type_):
    err = cls("went wrong", param="messages")
    assert err.status == status
    body = ErrorResponse.model_validate(err.to_dict())
    assert (body.error.message, body.error.type, body.error.param) == ("went wrong", type_, "messages")
    assert set(err.to_dict()["error"]) == {"message", "type", "param", "code"}


def test_chat_request_accepts_openai_shapes():
    req = ChatCompletionRequest.model_validate({
        "model": "m", "messages": [
            {"role": "system", "content": "s"},
            {"role": "user", "content": [
                {"type": "text", "text": "hi"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA", "detail": "low"}},
                {"type": "image_url", "image_url": {"url": "http://x/y.png"}, "uuid": "u1"}]},
            {"role": "assistant", "content": None}],
        "max_completion_tokens": 7, "stop": "END", "stream": True,
        "stream_options": {"include_usage": True}, "frequency_penalty": 0.0, "user": "u"})
    assert req.requested_max_tokens == 7
    assert req.stop == ["END"] and req.include_usage
    assert req.messages[1].content[2].image_url.url == "http://x/y.png"


@pytest.mark.parametrize("body", [
    {"messages": []},
    {"messages": [{"role": "user", "content": "x"}], "stop": [""]},
    {"messages": [{"role": "user", "content": "x"}], "stop": ["s"] * 17},
    {"messages": [{"role": "user", "content": "x"}], "top_p": 0},
    {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": ""}}]}]},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "http://x"}]}]},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "uuid": "u1"}]}]},
])
def test_chat_request_refusals(body):
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate(body)


def test_completion_prompt_forms():
    for prompt in ("text", ["a", "b"], [1, 2, 3], [[1, 2], [3]]):
        assert CompletionRequest(prompt=prompt).prompt == prompt
    for prompt in ([], [[1], []]):
        with pytest.raises(ValidationError):
            CompletionRequest(prompt=prompt)
    assert CompletionRequest(prompt="x", echo=True).echo
    assert CompletionRequest(prompt="x", echo=True, logprobs=1).echo_logprobs
    with pytest.raises(ValidationError, match="echo with logprobs is not supported with stream"):
        CompletionRequest(prompt="x", echo=True, logprobs=1, stream=True)


def test_validation_messages_leave_the_input_out():
    secret = "data:image/png;base64," + "S3CR3T" * 100
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": secret, "detail": "ultra"}}]}]})
    message = format_validation_errors(e.value.errors(include_input=False))
    assert "detail" in message and "S3CR3T" not in message


@pytest.mark.parametrize("field, value", [
    ("seed", 2**63), ("seed", -2**63 - 1), ("top_k", 2**40), ("stop_token_ids", [2**40]),
    ("stop_token_ids", [-1]), ("presence_penalty", 2.5), ("frequency_penalty", -3),
    ("repetition_penalty", 0), ("repetition_penalty", 2.5), ("min_tokens", -1),
    ("logit_bias", {"x": 1}), ("logit_bias", {"-1": 1}), ("logit_bias", {"5": 101}),
])
def test_numbers_that_cannot_reach_the_engine_are_refused(field, value):
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}],
                                              field: value})


@pytest.mark.parametrize("field, value", [
    ("mm_processor_kwargs", {}), ("functions", []),
])
def test_a_field_the_server_does_not_honour_is_refused_by_name(field, value):
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": "x"}], field: value})
    message = format_validation_errors(e.value.errors(include_input=False))
    assert message.startswith(f"{field}: not supported by this server")


def test_chat_template_kwargs_take_json_values_but_not_the_templates_own_names():
    kwargs = {"enable_thinking": False, "n": 1.5, "list": [1, "a", None], "d": {"x": {}}}
    req = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": kwargs})
    assert req.chat_template_kwargs == kwargs
    for bad, says in [({"messages": []}, "messages cannot be set"),
                      ({"tools": 1, "add_generation_prompt": False},
                       "add_generation_prompt, tools cannot be set"),
                      ({"x": "y" * 70000}, "longer than 65536 characters"),
                      ([1], "Input should be a valid dictionary")]:
        with pytest.raises(ValidationError) as e:
            ChatCompletionRequest.model_validate(
                {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": bad})
        message = format_validation_errors(e.value.errors(include_input=False))
        assert message.startswith("chat_template_kwargs: ") and says in message, message
        assert "yyyy" not in message


def test_neutral_values_and_harmless_fields_are_accepted():
    ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "x"}], "presence_penalty": 0,
        "frequency_penalty": 0.0, "repetition_penalty": 1.0, "response_format": {"type": "text"},
        "logprobs": False, "tools": [], "tool_choice": "none", "logit_bias": {}, "min_tokens": 0,
        "user": "u", "metadata": {"k": "v"}})
    for nested in ({"stream_options": {"include_usage": True, "usage_every": 2}},
                   {"messages": [{"role": "user", "content": "x", "tool_call_id": "t"}]}):
        with pytest.raises(ValidationError):
            ChatCompletionRequest.model_validate(
                {"messages": [{"role": "user", "content": "x"}], **nested})


@pytest.mark.parametrize("extra, structured", [
    ({"response_format": {"type": "json_object"}}, ("json_object", "")),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object"}, "strict": True}}},
     ("json", '{"type": "object"}')),
    ({"guided_json": '{"type": "integer"}'}, ("json", '{"type": "integer"}')),
    ({"guided_regex": "[a-z]+"}, ("regex", "[a-z]+")),
    ({"guided_choice": ["a", "b c"]}, ("choice", '["a", "b c"]')),
    ({"guided_grammar": 'root ::= "x"'}, ("grammar", 'root ::= "x"')),
    ({"structured_outputs": {"choice": ["y"]}}, ("choice", '["y"]')),
    ({"structured_outputs": {"json_object": True}}, ("json_object", "")),
    ({"response_format": {"type": "text"}}, None),
])
def test_output_constraints_in_every_spelling(extra, structured):
    req = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], **extra})
    assert req.structured == structured


@pytest.mark.parametrize("extra, field", [
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"guided_json": "not json"}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "at most one output constraint"),
])
def test_bad_output_constraints_are_refused(extra, field):
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": "x"}], **extra})
    assert field in format_validation_errors(e.value.errors(include_input=False))


def test_completions_take_no_tools():
    for field, value in (("tools", []), ("tool_choice", "none")):
        with pytest.raises(ValidationError) as e:
            CompletionRequest.model_validate({"prompt": "x", field: value})
        message = format_validation_errors(e.value.errors(include_input=False))
        assert message == f"{field}: not supported by this server"
