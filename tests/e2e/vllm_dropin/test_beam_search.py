"""vLLM's use_beam_search (with n and best_of) through the official openai client (issue 31,
theme 6): the n best beams come back best first, the best one scores at least as well as
greedy decoding (each beam's log-probability measured back with prompt_logprobs), and the
fields beam search does not honour are refused by name. A beam never takes an image or
video placeholder (each step sends it back as a prompt, where one needs its media)."""

from __future__ import annotations

import shutil

import openai
import pytest
import torch
from safetensors.torch import load_file, save_file

from api_proc.prompt_builder import PromptBuilder
from tests.e2e.server_process import ServerProcess
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


@pytest.fixture(scope="module")
def placeholder_writer(tmp_path_factory, tiny_model_path):
    """A server on the tiny model changed to rank a placeholder first after any prompt, as
    a trained model ranks one after `<|vision_start|>`: the final norm keeps one dimension
    of the hidden state, which only the image and video placeholders' rows read (with
    opposite signs, so one of them wins whatever its sign)."""
    folder = tmp_path_factory.mktemp("placeholder-writer")
    shutil.copytree(tiny_model_path, folder, dirs_exist_ok=True)
    weights = load_file(folder / "model.safetensors")
    builder = PromptBuilder.from_pretrained(tiny_model_path)
    norm = torch.zeros_like(weights["model.norm.weight"])
    norm[0] = 1.0
    weights["model.norm.weight"] = norm
    weights["lm_head.weight"][builder.image_token_id, 0] = 100.0
    weights["lm_head.weight"][builder.video_token_id, 0] = -100.0
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    proc = ServerProcess("--model", str(folder), "--served-model-name", MODEL,
                         log_path=folder / "server.log")
    try:
        proc.wait_ready()
        yield openai.OpenAI(base_url=proc.url + "/v1", api_key="unused", max_retries=0)
    finally:
        proc.stop()


def test_beams_never_take_a_placeholder(placeholder_writer, tiny_model_path):
    placeholders = PromptBuilder.from_pretrained(tiny_model_path).placeholder_ids
    chat = placeholder_writer.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "<|vision_start|> hi"}],
        max_tokens=3, n=2, extra_body={"use_beam_search": True, "ignore_eos": True,
                                       "return_token_ids": True})
    completion = placeholder_writer.completions.create(
        model=MODEL, prompt="<|vision_start|> hi", max_tokens=3, n=2,
        extra_body={"use_beam_search": True, "ignore_eos": True, "return_token_ids": True})
    for choice in [*chat.choices, *completion.choices]:
        ids = choice.model_extra["token_ids"]
        assert len(ids) == 3 and not placeholders & set(ids)


@pytest.mark.parametrize("use_beam_search", [False, True])
def test_a_placeholder_without_its_media_is_refused_by_field(oai, tiny_model_path,
                                                             use_beam_search):
    video = PromptBuilder.from_pretrained(tiny_model_path).video_token_id
    extra = {"use_beam_search": use_beam_search}
    with pytest.raises(openai.BadRequestError, match="video placeholder") as e:
        oai.chat.completions.create(model=MODEL, max_tokens=2, extra_body=extra, messages=[
            {"role": "user", "content": "<|vision_start|><|video_pad|><|vision_end|> hi"}])
    assert e.value.body["param"] == "messages"
    for prompt in ("<|video_pad|> hi", [video, 11, 12]):
        with pytest.raises(openai.BadRequestError, match="video placeholder") as e:
            oai.completions.create(model=MODEL, prompt=prompt, max_tokens=2, extra_body=extra)
        assert e.value.body["param"] == "prompt"
