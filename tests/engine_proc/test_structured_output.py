"""Structured outputs on the tiny random model: whatever the weights prefer, the completion
matches its JSON schema, regex, choice or grammar every time."""

import json
import re

import pytest

from api_proc.detokenizer import TokenDecoder
from api_proc.prompt_builder import PromptBuilder
from shared.messages import AddRequest, ErrorCode
from shared.sampling_params import SamplingParams
from tests.engine_proc.engine_factory import make_engine

pytest.importorskip("xgrammar")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "count": {"type": "integer", "minimum": 0, "maximum": 999},
        "ok": {"type": "boolean"},
        "colour": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "count", "ok", "colour"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    return make_engine(tiny_model_path)


@pytest.fixture(scope="module")
def decode(tiny_model_path):
    builder = PromptBuilder.from_pretrained(tiny_model_path)
    return TokenDecoder(builder.tokenizer).decode


def run(engine, structured, n=1, max_tokens=200, **sampling):
    requests = [AddRequest(f"r{i}", list(range(40 + i, 60 + i)),
                           SamplingParams(max_tokens=max_tokens, structured=structured,
                                          seed=i, **sampling)) for i in range(n)]
    return engine.generate(requests)


def check_schema(value: dict) -> None:
    assert set(value) == {"name", "count", "ok", "colour"}
    assert isinstance(value["name"], str) and len(value["name"]) <= 12
    assert type(value["count"]) is int and 0 <= value["count"] <= 999
    assert type(value["ok"]) is bool and value["colour"] in ("red", "green", "blue")


def test_json_schema_holds_twenty_times_out_of_twenty(engine, decode):
    outs = run(engine, ("json", json.dumps(SCHEMA)), n=20, temperature=1.0)
    for tokens in outs.values():
        check_schema(json.loads(decode(tokens)))


def test_json_object_regex_choice_and_grammar(engine, decode, tiny_model_path):
    # any object: a random model would write one string forever, so logit_bias favours
    # closing quotes and braces (both apply: the grammar first, then the bias)
    ids = PromptBuilder.from_pretrained(tiny_model_path).tokenizer.encode('"}').ids
    bias = tuple((i, 6.0) for i in ids)
    ended = 0
    for seed in range(6):
        params = SamplingParams(max_tokens=120, temperature=1.0, seed=seed, logit_bias=bias,
                                structured=("json_object", ""))
        engine.add_request(AddRequest("o", list(range(40, 60)), params))
        tokens, reason = [], None
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens += out.new_token_ids
                reason = out.finish_reason or reason
        text = decode(tokens)
        assert text.startswith("{")
        if reason == "stop":
            assert isinstance(json.loads(text), dict)
            ended += 1
    assert ended >= 3
    text = decode(run(engine, ("regex", r"[a-z]{3}-[0-9]{2}"), n=4, temperature=1.0)["r3"])
    assert re.fullmatch(r"[a-z]{3}-[0-9]{2}", text)
    for tokens in run(engine, ("choice", json.dumps(["yes", "no", "maybe so"])), n=6,
                      temperature=1.0).values():
        assert decode(tokens) in ("yes", "no", "maybe so")
    text = decode(run(engine, ("grammar", 'root ::= "(" [0-9]{1,4} ")"'), temperature=0.0,
                      max_tokens=50)["r0"])
    assert re.fullmatch(r"\(\d{1,4}\)", text)


def test_structured_and_plain_requests_share_a_batch(engine, decode):
    plain = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    alone = engine.generate([AddRequest("p", list(range(40, 60)), plain)])["p"]
    outs = engine.generate([
        AddRequest("p", list(range(40, 60)), plain),
        AddRequest("s", list(range(41, 61)), SamplingParams(
            max_tokens=200, temperature=1.0, seed=5, structured=("json", json.dumps(SCHEMA)))),
    ])
    assert outs["p"] == alone
    check_schema(json.loads(decode(outs["s"])))


def test_a_bad_schema_fails_its_request_alone(engine):
    engine.add_request(AddRequest("bad", [40, 41], SamplingParams(
        max_tokens=4, structured=("regex", "(unclosed"))))
    engine.add_request(AddRequest("good", [40, 41], SamplingParams(max_tokens=4)))
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    bad = outputs["bad"][-1]
    assert bad.finish_reason == "error" and bad.error_code == ErrorCode.REJECTED
    assert "regex" in bad.error
    assert outputs["good"][-1].finish_reason in ("stop", "length")
