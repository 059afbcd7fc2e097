"""vLLM's use_beam_search (with n and best_of) through the official openai client (issue 31,
theme 6): the n best beams come back best first, the best one scores at least as well as
greedy decoding (each beam's log-probability measured back with prompt_logprobs), and the
fields beam search does not honour are refused by name."""

from __future__ import annotations

import openai
import pytest

from api_proc.prompt_builder import PromptBuilder
from tests.e2e.vllm_dropin.conftest import MODEL

STEPS = 4


@pytest.fixture(scope="module")
def prompt(tiny_model_path) -> list[int]:
    return PromptBuilder.from_pretrained(tiny_model_path).encode("Once upon a time")


def logprob_of(oai, prompt: list[int], tokens: list[int]) -> float:
    """The completion `tokens`' log-probability after `prompt`, scored by the server."""
    entries = oai.completions.create(model=MODEL, prompt=prompt + tokens, max_tokens=1,
                                     extra_body={"prompt_logprobs": 0}
                                     ).choices[0].model_extra["prompt_logprobs"]
    return sum(entries[len(prompt) + j][str(t)]["logprob"] for j, t in enumerate(tokens))


def test_beams_come_back_best_first_and_beat_greedy(oai, prompt):
    reply = oai.completions.create(
        model=MODEL, prompt=prompt, max_tokens=STEPS, n=2, temperature=0,
        extra_body={"use_beam_search": True, "ignore_eos": True, "return_token_ids": True,
                    "length_penalty": 0.0})  # 0: the score is the plain log-probability
    beams = [c.model_extra["token_ids"] for c in sorted(reply.choices, key=lambda c: c.index)]
    assert len(beams) == 2 and beams[0] != beams[1] and all(len(b) == STEPS for b in beams)
    scores = [logprob_of(oai, prompt, b) for b in beams]
    assert scores[0] >= scores[1] - 1e-4
    greedy = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=STEPS,
                                    temperature=0, extra_body={"ignore_eos": True,
                                                               "return_token_ids": True})
    assert scores[0] >= logprob_of(oai, prompt, greedy.choices[0].model_extra["token_ids"]) - 1e-4
    assert reply.usage.completion_tokens == 2 * STEPS


def test_chat_beam_search_with_best_of(oai):
    reply = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, n=1,
        extra_body={"use_beam_search": True, "best_of": 3, "ignore_eos": True})
    [choice] = reply.choices
    assert choice.finish_reason == "length" and reply.usage.completion_tokens == 3


@pytest.mark.parametrize("extra, says", [
    ({"use_beam_search": True, "stream": True}, "stream cannot go with use_beam_search"),
    ({"use_beam_search": True, "logprobs": 1}, "logprobs cannot go with use_beam_search"),
    ({"use_beam_search": True, "stop": ["x"]}, "stop cannot go with use_beam_search"),
    ({"best_of": 3}, "best_of other than n needs use_beam_search"),
    ({"length_penalty": 0.5}, "length_penalty applies with use_beam_search"),
    ({"use_beam_search": True, "best_of": 99}, "max_n"),
])
def test_what_beam_search_does_not_honour_is_refused(oai, extra, says):
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_body=extra)
    assert says in e.value.body["message"]
