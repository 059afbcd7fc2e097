"""vLLM's reasoning controls beyond the parsers (issue 31, theme 3): thinking_token_budget
(the end marker forced after that many thinking tokens), --reasoning-config naming the
markers, and include_reasoning, against a server with --reasoning-parser qwen3. The tiny
model never ends its thinking by itself: whatever follows the budget is the forced marker.
Its default template opens no think block (the budget counts from the first token); a
template that opens one in the prompt, as Qwen3.5's, is counted as vLLM counts it."""

from __future__ import annotations

import json

import openai
import pytest

from api_proc.prompt_builder import PromptBuilder
from tests.e2e.server_process import ServerProcess, served_openai
from tests.e2e.vllm_dropin.conftest import MODEL

CHAT = [{"role": "user", "content": "What is 1+1?"}]
MARKERS = {"reasoning_start_str": "<think>", "reasoning_end_str": "</think>"}
# Qwen3.5's generation prompt: a think block opened, its newline in the prompt
OPENS_THINKING = r"""{%- for m in messages -%}
    {{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n<think>\n' -}}{%- endif -%}"""


@pytest.fixture(scope="module")
def thinker(tmp_path_factory, tiny_model_path):
    with served_openai(tmp_path_factory.mktemp("thinker"),
                       "--reasoning-parser", "qwen3", "--reasoning-config", json.dumps(MARKERS)) as client:
        yield client


@pytest.fixture(scope="module")
def builder(tiny_model_path):
    return PromptBuilder.from_pretrained(tiny_model_path)


@pytest.mark.parametrize("budget", [0, 5])
def test_thinking_ends_after_the_budget(thinker, builder, budget):
    end_ids = builder.encode("</think>")
    args = dict(model=MODEL, messages=CHAT, max_tokens=budget + len(end_ids) + 4,
                temperature=0, extra_body={"thinking_token_budget": budget,
                                           "return_token_ids": True, "ignore_eos": True})
    reply = thinker.chat.completions.create(**args)
    ids = reply.choices[0].model_extra["token_ids"]
    assert ids[budget:budget + len(end_ids)] == end_ids  # forced right after the budget
    message = reply.choices[0].message
    assert (message.model_extra["reasoning"] or "") == builder.decoder.decode(ids[:budget])
    assert message.content == builder.decoder.decode(ids[budget + len(end_ids):])
    reasoning, content = "", ""
    for chunk in thinker.chat.completions.create(stream=True, **args):
        if chunk.choices:
            reasoning += chunk.choices[0].delta.model_extra.get("reasoning") or ""
            content += chunk.choices[0].delta.content or ""
    assert (reasoning, content) == ((message.model_extra["reasoning"] or ""), message.content)


@pytest.fixture(scope="module", params=["--reasoning-config", "the parser's markers"])
def opener(request, tmp_path_factory, tiny_model_path):
    folder = tmp_path_factory.mktemp("opener")
    (folder / "opens_thinking.jinja").write_text(OPENS_THINKING)
    flags = ["--reasoning-parser", "qwen3", "--chat-template", str(folder / "opens_thinking.jinja")]
    if request.param == "--reasoning-config":
        flags += ["--reasoning-config", json.dumps(MARKERS)]
    proc = ServerProcess(*flags, log_path=folder / "server.log")
    try:
        proc.wait_ready()
        yield openai.OpenAI(base_url=proc.url + "/v1", api_key="unused", max_retries=0)
    finally:
        proc.stop()


def ids_between_markers(ids: list[int], start: list[int], end: list[int]) -> int:
    """vLLM's test's count: the token ids after the last start marker, up to the first end
    marker after it."""
    at = max(i for i in range(len(ids) - len(start) + 1) if ids[i:i + len(start)] == start)
    at += len(start)
    return next(j for j in range(at, len(ids)) if ids[j:j + len(end)] == end) - at


def test_a_budget_counts_the_thinking_the_prompt_opened(opener, builder):
    """vLLM's count: budget 5 is 5 tokens between the markers, the prompt's newline after
    `<think>` the first of them; the completion thinks the other 4."""
    start, end = builder.encode("<think>"), builder.encode("</think>")
    args = dict(model=MODEL, messages=CHAT, max_tokens=14, temperature=0,
                extra_body={"thinking_token_budget": 5, "return_token_ids": True,
                            "ignore_eos": True})
    reply = opener.chat.completions.create(**args)
    prompt, ids = reply.model_extra["prompt_token_ids"], reply.choices[0].model_extra["token_ids"]
    assert ids_between_markers(prompt + ids, start, end) == 5
    assert ids[4:4 + len(end)] == end
    message = reply.choices[0].message
    assert message.model_extra["reasoning"] == builder.decoder.decode(ids[:4])
    reasoning = "".join(c.choices[0].delta.model_extra.get("reasoning") or ""
                        for c in opener.chat.completions.create(stream=True, **args)
                        if c.choices)
    assert reasoning == message.model_extra["reasoning"]


def test_without_a_budget_the_tiny_model_keeps_thinking(thinker):
    reply = thinker.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8,
                                            temperature=0, extra_body={"ignore_eos": True})
    assert reply.choices[0].message.model_extra["reasoning"] and not reply.choices[0].message.content


def test_include_reasoning_false_leaves_the_reasoning_out(thinker):
    args = dict(model=MODEL, messages=CHAT, max_tokens=14, temperature=0,
                extra_body={"thinking_token_budget": 3, "ignore_eos": True})
    shown = thinker.chat.completions.create(**args).choices[0].message
    args["extra_body"]["include_reasoning"] = False
    hidden = thinker.chat.completions.create(**args).choices[0].message
    assert shown.model_extra["reasoning"] and hidden.model_extra["reasoning"] is None
    assert hidden.content == shown.content
    deltas = [c.choices[0].delta for c in thinker.chat.completions.create(stream=True, **args)
              if c.choices]
    assert not any(d.model_extra.get("reasoning") for d in deltas)
    assert "".join(d.content or "" for d in deltas) == shown.content


def test_a_budget_the_server_cannot_keep_is_refused_by_name(thinker, oai):
    with pytest.raises(openai.BadRequestError, match="needs --reasoning-parser") as e:
        oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2,
                                    extra_body={"thinking_token_budget": 3})
    assert e.value.body["param"] == "thinking_token_budget"
    with pytest.raises(openai.BadRequestError, match="output constraint"):
        thinker.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2,
                                        extra_body={"thinking_token_budget": 3,
                                                    "guided_regex": "a+"})
