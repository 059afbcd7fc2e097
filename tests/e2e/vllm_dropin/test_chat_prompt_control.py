"""vLLM's chat prompt controls against a real server (issue 31, theme 2):
add_generation_prompt, continue_final_message, echo on chat completions, and roles beyond
OpenAI's passed to the chat template."""

from __future__ import annotations

import httpx
import openai
import pytest

from api_proc.prompt_builder import PromptBuilder
from tests.e2e.vllm_dropin.conftest import MODEL

PREFIX = "The answer is"
CONTINUED = [{"role": "user", "content": "What is it?"},
             {"role": "assistant", "content": PREFIX}]


def tokenize(server, **body) -> list[int]:
    return httpx.post(server.url + "/tokenize", json=body, timeout=30).json()["tokens"]


def test_continue_final_message_ends_the_prompt_inside_it(oai, dropin_server, tiny_model_path):
    builder = PromptBuilder.from_pretrained(tiny_model_path)
    ids = tokenize(dropin_server, messages=CONTINUED, add_generation_prompt=False,
                   continue_final_message=True)
    text = builder.decoder_with_specials.decode(ids)
    assert text.endswith("<|im_start|>assistant\n" + PREFIX)
    args = dict(model=MODEL, max_tokens=4, temperature=0)
    reply = oai.chat.completions.create(messages=CONTINUED, **args, extra_body={
        "add_generation_prompt": False, "continue_final_message": True})
    raw = oai.completions.create(prompt=ids, **args)  # the same prompt, as token ids
    assert reply.choices[0].message.content == raw.choices[0].text
    assert reply.usage.prompt_tokens == len(ids)
    with pytest.raises(openai.BadRequestError, match="cannot both be true"):
        oai.chat.completions.create(messages=CONTINUED, **args,
                                    extra_body={"continue_final_message": True})


def test_add_generation_prompt_false_leaves_the_turn_unopened(oai, dropin_server):
    messages = [{"role": "user", "content": "Hello"}]
    opened = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    closed = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=1,
                                         extra_body={"add_generation_prompt": False})
    assert closed.usage.prompt_tokens < opened.usage.prompt_tokens
    assert closed.usage.prompt_tokens == len(tokenize(
        dropin_server, messages=messages, add_generation_prompt=False))


def test_echo_puts_the_final_assistant_message_first(oai):
    args = dict(model=MODEL, max_tokens=3, temperature=0, messages=CONTINUED)
    extra = {"add_generation_prompt": False, "continue_final_message": True}
    plain = oai.chat.completions.create(**args, extra_body=extra).choices[0].message.content
    echoed = oai.chat.completions.create(**args, extra_body={**extra, "echo": True})
    assert echoed.choices[0].message.content == PREFIX + plain
    streamed = "".join(c.choices[0].delta.content or "" for c in oai.chat.completions.create(
        **args, stream=True, extra_body={**extra, "echo": True}) if c.choices)
    assert streamed == PREFIX + plain
    # the final message is the user's: nothing to echo
    user_last = oai.chat.completions.create(model=MODEL, max_tokens=3, temperature=0,
                                            messages=CONTINUED[:1])
    echo_user = oai.chat.completions.create(model=MODEL, max_tokens=3, temperature=0,
                                            messages=CONTINUED[:1], extra_body={"echo": True})
    assert echo_user.choices[0].message.content == user_last.choices[0].message.content


def test_any_role_reaches_the_chat_template(oai, dropin_server, tiny_model_path):
    messages = [{"role": "narrator", "content": "Once upon a time."},
                {"role": "user", "content": "Go on"}]
    reply = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    assert reply.choices[0].finish_reason == "length"
    builder = PromptBuilder.from_pretrained(tiny_model_path)
    text = builder.decoder_with_specials.decode(tokenize(dropin_server, messages=messages))
    assert "<|im_start|>narrator\nOnce upon a time.<|im_end|>" in text
