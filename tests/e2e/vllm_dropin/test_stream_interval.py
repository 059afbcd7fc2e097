"""`--stream-interval 3` (vLLM's), the real engine through the official openai client: the
first token in a chunk of its own, then three per chunk; joined, the chunks give the
non-streamed answer's text, log-probabilities and token ids."""

from __future__ import annotations

import pytest

from tests.e2e.server_process import served_openai
from tests.e2e.vllm_dropin.conftest import MODEL

ARGS = dict(model=MODEL, max_tokens=10, temperature=0, extra_body={"ignore_eos": True,
                                                                  "return_token_ids": True})
USAGE = {"include_usage": True, "continuous_usage_stats": True}


@pytest.fixture(scope="module")
def every_third(tmp_path_factory, tiny_model_path):
    with served_openai(tmp_path_factory.mktemp("interval"),
                       "--stream-interval", "3") as client:
        yield client


def tokens_per_chunk(chunks) -> list[int]:
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    return [b - a for a, b in zip(counts, counts[1:], strict=False)]


def test_chat_chunks_join_to_the_whole_answer(every_third):
    messages = [{"role": "user", "content": "Count with me"}]
    whole = every_third.chat.completions.create(messages=messages, logprobs=True,
                                                top_logprobs=2, **ARGS).choices[0]
    chunks = list(every_third.chat.completions.create(
        messages=messages, logprobs=True, top_logprobs=2, stream=True, stream_options=USAGE,
        **ARGS))
    assert tokens_per_chunk(chunks) == [1, 3, 3, 3]  # after the role chunk
    steps = [c.choices[0] for c in chunks if c.choices][1:]
    assert "".join(s.delta.content for s in steps) == whole.message.content
    assert [len(s.logprobs.content) for s in steps] == [1, 3, 3, 3]
    entries = [e for s in steps for e in s.logprobs.content]
    assert [e.token for e in entries] == [e.token for e in whole.logprobs.content]
    assert [e.logprob for e in entries] == pytest.approx(
        [e.logprob for e in whole.logprobs.content], abs=1e-4)
    assert [t for s in steps for t in s.model_extra["token_ids"]] == \
        whole.model_extra["token_ids"]
    assert steps[-1].finish_reason == "length"


def test_completion_logprobs_merge_across_a_chunk(every_third):
    args = {**ARGS, "max_tokens": 8}
    whole = every_third.completions.create(prompt="Once upon a time", logprobs=2,
                                           **args).choices[0]
    chunks = list(every_third.completions.create(prompt="Once upon a time", logprobs=2,
                                                 stream=True, stream_options=USAGE, **args))
    steps = [c.choices[0] for c in chunks if c.choices]
    assert [len(s.logprobs.tokens) for s in steps] == [1, 3, 3, 1]
    assert "".join(s.text for s in steps) == whole.text
    for field in ("tokens", "text_offset"):
        assert [v for s in steps for v in getattr(s.logprobs, field)] == \
            getattr(whole.logprobs, field)
    assert [v for s in steps for v in s.logprobs.token_logprobs] == pytest.approx(
        whole.logprobs.token_logprobs, abs=1e-4)
