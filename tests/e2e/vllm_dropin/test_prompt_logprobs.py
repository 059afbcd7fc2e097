"""vLLM's prompt_logprobs and echo with logprobs through the official openai client (issue
31, theme 1): the engine scores every prompt token during prefill (chunk by chunk), and
each entry equals what a one-token greedy completion of the prompt before it reports."""

from __future__ import annotations

import base64
import io
import math

import openai
import pytest
from PIL import Image

from api_proc.prompt_builder import PromptBuilder
from tests.e2e.vllm_dropin.conftest import MODEL

TEXT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def prompt(tiny_model_path) -> list[int]:
    return PromptBuilder.from_pretrained(tiny_model_path).encode(TEXT)


def test_prompt_logprobs_match_greedy_next_token_logprobs(oai, prompt):
    reply = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0,
                                   extra_body={"prompt_logprobs": 2})
    entries = reply.choices[0].model_extra["prompt_logprobs"]
    assert len(entries) == len(prompt) and entries[0] is None
    for j, entry in enumerate(entries[1:], start=1):
        own = entry[str(prompt[j])]
        assert own["rank"] >= 1 and own["decoded_token"]
        ranked = sorted((v["rank"], v["logprob"]) for v in entry.values())
        assert [r for r, _ in ranked[:2]] == [1, 2] and ranked[0][1] >= ranked[1][1]
        assert 2 <= len(entry) <= 3  # the top 2, and the prompt's token when it is not one
        assert own["logprob"] <= ranked[0][1]
    for j in (1, len(prompt) // 2, len(prompt) - 1):  # the best token there, asked directly
        head = oai.completions.create(model=MODEL, prompt=prompt[:j], max_tokens=1,
                                      temperature=0, logprobs=1).choices[0].logprobs
        best = next(v for v in entries[j].values() if v["rank"] == 1)
        assert math.isclose(best["logprob"], head.token_logprobs[0], abs_tol=1e-4)


def test_chat_prompt_logprobs_cover_the_image_prompt(oai):
    buf = io.BytesIO()
    Image.new("RGB", (56, 56), "red").save(buf, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    reply = oai.chat.completions.create(
        model=MODEL, max_tokens=1, extra_body={"prompt_logprobs": 0}, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "What?"}]}])
    entries = reply.model_extra["prompt_logprobs"]
    assert len(entries) == reply.usage.prompt_tokens and entries[0] is None
    assert all(len(e) == 1 for e in entries[1:])  # k = 0: the prompt's own token only


def test_echo_with_logprobs_puts_the_prompt_first(oai, prompt):
    plain = oai.completions.create(model=MODEL, prompt=TEXT, max_tokens=3, temperature=0,
                                   logprobs=1).choices[0]
    echoed = oai.completions.create(model=MODEL, prompt=TEXT, max_tokens=3, temperature=0,
                                    logprobs=1, echo=True).choices[0]
    lp = echoed.logprobs
    assert echoed.text == TEXT + plain.text
    assert len(lp.tokens) == len(prompt) + 3 and lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None and all(t for t in lp.top_logprobs[1:])
    assert lp.tokens[len(prompt):] == plain.logprobs.tokens
    assert lp.token_logprobs[len(prompt):] == pytest.approx(plain.logprobs.token_logprobs,
                                                           abs=1e-4)  # other batch shapes
    assert "".join(lp.tokens).replace("\u0120", " ") == echoed.text.replace("\u0120", " ")
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert lp.text_offset[len(prompt)] == len(TEXT)


@pytest.mark.parametrize("extra, says", [
    ({"prompt_logprobs": -1}, "max_logprobs=20"),
    ({"prompt_logprobs": 1, "stream": True}, "not available with stream"),
])
def test_prompt_logprobs_refusals_name_the_field(oai, extra, says):
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=MODEL, prompt="Hi", max_tokens=1, extra_body=extra)
    assert says in e.value.body["message"] and "prompt_logprobs" in e.value.body["message"]
