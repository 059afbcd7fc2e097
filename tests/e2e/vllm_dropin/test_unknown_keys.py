"""Unknown keys inside messages and content parts are ignored as vLLM ignores them, and
counted in /metrics; a multimodal `uuid` goes with the media it names; a bare-string
image_url and a uuid without its image are refused with the reason (issue 31, theme 8)."""

from __future__ import annotations

import base64
import io
import re

import httpx
import openai
import pytest
from PIL import Image

from tests.e2e.vllm_dropin.conftest import MODEL


def image_url() -> str:
    buf = io.BytesIO()
    Image.new("RGB", (56, 56), "orange").save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def ignored(server, where: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    found = re.search(rf'^flatserve_unknown_keys_ignored_total{{where="{where}"}} (\S+)$', text,
                      re.M)
    return float(found.group(1)) if found else 0.0


def test_unknown_keys_inside_messages_are_ignored_and_counted(oai, dropin_server):
    before = {w: ignored(dropin_server, w) for w in ("message", "part", "tool_call")}
    plain = [{"role": "system", "content": "Be brief."},
             {"role": "user", "content": [{"type": "text", "text": "Hello"}]}]
    noisy = [{"role": "system", "content": "Be brief.", "id": "msg-1", "timestamp": 17},
             {"role": "user", "name": "ann", "content": [
                 {"type": "text", "text": "Hello", "cache_control": {"type": "ephemeral"}}]}]
    args = dict(model=MODEL, max_tokens=4, temperature=0)
    expected = oai.chat.completions.create(messages=plain, **args).choices[0].message.content
    got = oai.chat.completions.create(messages=noisy, **args).choices[0].message.content
    assert got == expected  # ignored: the prompt is the same
    after = {w: ignored(dropin_server, w) for w in before}
    assert after["message"] - before["message"] == 2
    assert after["part"] - before["part"] == 1
    # a tool call echoed back with the index key a streamed delta carried
    history = [{"role": "user", "content": "weather?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"index": 0, "id": "call-1", "type": "function",
                    "function": {"name": "f", "arguments": "{}"}}]},
               {"role": "tool", "tool_call_id": "call-1", "content": "sunny"}]
    oai.chat.completions.create(messages=history, **args)
    assert ignored(dropin_server, "tool_call") - after["tool_call"] == 1


def test_uuid_goes_with_the_image_it_names(oai):
    url = image_url()
    args = dict(model=MODEL, max_tokens=3, temperature=0)
    part = {"type": "image_url", "image_url": {"url": url}}
    plain = oai.chat.completions.create(messages=[{"role": "user", "content": [part]}], **args)
    named = oai.chat.completions.create(
        messages=[{"role": "user", "content": [{**part, "uuid": "my-image-1"}]}], **args)
    assert named.choices[0].message.content == plain.choices[0].message.content


@pytest.mark.parametrize("part, says", [
    ({"type": "image_url", "uuid": "my-image-1"}, "uuid without the image it names"),
    ({"type": "image_url", "image_url": None, "uuid": "x"}, "another's cached image"),
    ({"type": "image_url", "image_url": "data:image/png;base64,AAAA"},
     'must be an object {"url": ...}, not a string'),
    ({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}, "input_audio"),
])
def test_media_parts_that_cannot_be_served_are_refused_with_the_reason(oai, part, says):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, max_tokens=2,
                                    messages=[{"role": "user", "content": [part]}])
    assert says in e.value.body["message"] and e.value.body["param"] == "messages"


def test_unknown_top_level_fields_are_still_refused_by_name(oai):
    with pytest.raises(openai.BadRequestError, match="mirostat: not supported by this server"):
        oai.chat.completions.create(model=MODEL, max_tokens=2, extra_body={"mirostat": 2},
                                    messages=[{"role": "user", "content": "hi"}])
