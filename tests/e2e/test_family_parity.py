"""Every served family through HTTP: the official openai client against `flatserve serve
--model FOLDER` gets the greedy tokens the engine gives offline, streamed and not, for text
and images (Qwen2.5-VL, the default model, is covered in test_openai_parity.py), and the
OpenAI features applications call work on each (n > 1, logprobs, structured outputs,
penalties, tools)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from engine_proc.state_cache import StateShape
from shared.model_config import load_model_config
from shared.random_checkpoints import ensure_checkpoint
from tests.e2e.server_process import ServerProcess
from tests.e2e.test_openai_parity import MAX_TOKENS, _data_url, _image, _offline_text
from tests.e2e.video_reference import assert_data_url_matches_transformers, video_clip
from tests.engine_proc.families import SERVED_FAMILIES

CASES = [[], [(0, (64, 48))], [(1, (120, 90)), (2, (56, 200))]]


@pytest.fixture(scope="module", params=SERVED_FAMILIES, ids=lambda p: p.name)
def family_server(request, tmp_path_factory):
    folder = ensure_checkpoint(request.param)
    proc = ServerProcess("--model", str(folder),
                         log_path=tmp_path_factory.mktemp("server") / "server.log")
    try:
        yield folder, proc.wait_ready()
    finally:
        proc.stop()


def test_openai_client_matches_offline_engine(family_server):
    folder, server = family_server
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    model = oai.models.list().data[0].id
    for images in CASES:
        pics = [_image(seed, size) for seed, size in images]
        content = [{"type": "image_url", "image_url": {"url": _data_url(p)}} for p in pics]
        content.append({"type": "text", "text": "Describe this image."})
        messages = [{"role": "user", "content": content}]
        want_text, want_prompt, want_completion = _offline_text(folder, messages, pics)

        reply = oai.chat.completions.create(model=model, messages=messages,
                                            max_tokens=MAX_TOKENS, temperature=0)
        assert reply.choices[0].message.content == want_text
        assert reply.usage.prompt_tokens == want_prompt
        assert reply.usage.completion_tokens == want_completion

        stream = oai.chat.completions.create(model=model, messages=messages,
                                             max_tokens=MAX_TOKENS, temperature=0, stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert text == want_text


def test_openai_features_on_every_family(family_server):
    folder, server = family_server
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    model = oai.models.list().data[0].id
    messages = [{"role": "user", "content": "Name a fruit."}]
    reply = oai.chat.completions.create(model=model, messages=messages, max_tokens=6, n=2,
                                        temperature=1.0, seed=1, logprobs=True, top_logprobs=2,
                                        presence_penalty=0.5, frequency_penalty=0.5)
    assert [c.index for c in reply.choices] == [0, 1]
    for choice in reply.choices:
        assert len(choice.logprobs.content) >= 1
        assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
    schema = {"type": "object", "properties": {"fruit": {"enum": ["apple", "pear"]}},
              "required": ["fruit"], "additionalProperties": False}
    reply = oai.chat.completions.create(
        model=model, messages=messages, max_tokens=200, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "f", "schema": schema}})
    assert json.loads(reply.choices[0].message.content)["fruit"] in ("apple", "pear")
    tool = {"type": "function", "function": {"name": "pick", "parameters": schema}}
    # random weights write whitespace the grammar allows: room for it
    reply = oai.chat.completions.create(model=model, messages=messages, max_tokens=200,
                                        temperature=0, tools=[tool], tool_choice="required")
    call = reply.choices[0].message.tool_calls[0]
    assert call.function.name == "pick"
    assert json.loads(call.function.arguments)["fruit"] in ("apple", "pear")
    metrics = {s.name: s.value for family in text_string_to_metric_families(
        httpx.get(server.url + "/metrics").text) for s in family.samples}
    assert metrics["flatserve_kv_cache_bytes"] > 0
    text = load_model_config(folder).text
    if text.is_hybrid:  # the slots, all free again
        slot = StateShape.of(text, 1, torch.float32, torch.float32).slot_bytes
        assert metrics["flatserve_state_cache_bytes"] > 0
        # every slot free, and as many prefix-cache snapshots as slots (the default)
        assert 2 * metrics["flatserve_state_slots_free"] * slot == metrics["flatserve_state_cache_bytes"]
    else:
        assert metrics["flatserve_state_cache_bytes"] == 0


def test_video_matches_transformers(family_server):
    """A video (data URL, streamed and not) gets transformers' own greedy answer on every
    family (tests/e2e/video_reference.py)."""
    folder, server = family_server
    assert_data_url_matches_transformers(folder, server, video_clip())
