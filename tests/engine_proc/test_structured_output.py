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


def big_choice(n: int = 300, length: int = 200) -> tuple[str, str]:
    """A choice constraint that takes the tiny model's compiler a second or more (one `n`
    per test: compiled grammars are kept for reuse)."""
    import random

    rng = random.Random(n)
    choices = ["".join(rng.choice("abcdefghij klmnop") for _ in range(length)) for _ in range(n)]
    return ("choice", json.dumps(choices))


def finish(engine) -> dict:
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


def gone(pid: int) -> bool:
    import psutil

    return not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def wait_until(predicate, what: str, timeout_s: float = 30.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_a_slow_grammar_holds_no_other_request_back(engine):
    engine.add_request(AddRequest("slow", [40, 41], SamplingParams(
        max_tokens=4, structured=big_choice())))
    engine.add_request(AddRequest("plain", [40, 41], SamplingParams(max_tokens=8,
                                                                     ignore_eos=True)))
    slow = engine.seqs["slow"]
    plain = []
    while not plain or plain[-1].finish_reason is None:
        plain += [o for o in engine.step() if o.request_id == "plain"]
    assert slow.grammar_future is not None and not slow.grammar_future.done()
    assert sum(len(o.new_token_ids) for o in plain) == 8
    stats = engine.stats()  # waiting, not for room: vLLM's reason "deferred"
    assert (stats.num_waiting, stats.num_waiting_deferred) == (1, 1)
    assert finish(engine)["slow"][-1].finish_reason in ("stop", "length")
    assert engine.stats().num_waiting_deferred == 0


def test_a_grammar_past_its_budget_fails_its_request_and_its_compile_stops(engine):
    structured = engine.structured
    warm = structured.compile("regex", "[a-z]+")  # a compiler process to watch
    warm.result(60)
    pid = structured.compiler_pid
    structured.timeout_s = 0.3
    try:
        engine.add_request(AddRequest("late", [40, 41], SamplingParams(
            max_tokens=4, structured=big_choice(n=302))))
        late = finish(engine)["late"][-1]
    finally:
        structured.timeout_s = 10.0
    assert late.finish_reason == "error" and late.error_code == ErrorCode.REJECTED
    assert "did not compile within 0.3 s" in late.error
    wait_until(lambda: gone(pid), "the compile past its time still runs")
    structured.max_spec_bytes, max_spec_bytes = 1000, structured.max_spec_bytes
    try:
        engine.add_request(AddRequest("huge", [40, 41], SamplingParams(
            max_tokens=4, structured=("regex", "a" * 1001))))
        huge = finish(engine)["huge"][-1]
    finally:
        structured.max_spec_bytes = max_spec_bytes
    assert huge.error_code == ErrorCode.REJECTED and "more than the 1000" in huge.error
    # the next grammar gets a fresh compiler
    assert finish_one(engine, ("regex", "[a-z]{3}")).finish_reason in ("stop", "length")


def finish_one(engine, structured):
    engine.add_request(AddRequest("next", [40, 41], SamplingParams(max_tokens=8,
                                                                    structured=structured)))
    return finish(engine)["next"][-1]


def test_an_aborted_request_stops_its_compile(engine):
    engine.add_request(AddRequest("gone", [40, 41], SamplingParams(
        max_tokens=4, structured=big_choice(n=301))))
    future = engine.seqs["gone"].grammar_future
    wait_until(lambda: future.running() and engine.structured.compiler_pid is not None,
               "the compile never started")
    pid = engine.structured.compiler_pid
    assert engine.abort_request("gone")
    wait_until(lambda: gone(pid), "the aborted request's compile still runs")
    assert finish(engine)["gone"][-1].finish_reason == "abort"
    assert finish_one(engine, ("regex", "[a-z]{3}")).finish_reason in ("stop", "length")


def test_a_compiler_process_that_died_is_replaced(engine):
    import os
    import signal

    structured = engine.structured
    structured.compile("regex", "[0-9]+").result(60)
    pid = structured.compiler_pid
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: gone(pid) or structured._compiler.process.poll() is not None,
               "the compiler did not die")
    # it is found dead (its pipe broken, or no answer): a fresh one takes the same job
    assert structured.compile("regex", "[0-9]{2}").result(60) is not None
    assert structured.compiler_pid not in (None, pid)
    assert finish_one(engine, ("regex", "[a-z]{4}")).finish_reason in ("stop", "length")
