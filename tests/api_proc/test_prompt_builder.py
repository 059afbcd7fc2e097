from __future__ import annotations

import pytest

from api_proc.errors import BadRequest
from api_proc.prompt_builder import PromptBuilder, template_messages
from api_proc.protocol import ChatCompletionRequest


@pytest.fixture(scope="module")
def builder(tiny_model_path) -> PromptBuilder:
    return PromptBuilder.from_pretrained(tiny_model_path, max_model_len=512)


def _messages(*contents, role="user"):
    req = ChatCompletionRequest(messages=[{"role": role, "content": c} for c in contents])
    return template_messages(req.messages)


def _image_part(url="data:image/png;base64,AAAA"):
    return {"type": "image_url", "image_url": {"url": url}}


def test_template_matches_transformers(tiny_model_path, builder):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tiny_model_path))
    messages = [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it? 你好"}]},
        {"role": "assistant", "content": "A cat."},
        {"role": "user", "content": [{"type": "text", "text": "And these?"}, {"type": "image"},
                                     {"type": "image"}]},
    ]
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert builder.render_chat(messages) == expected
    assert builder.encode(expected) == hf.encode(expected, add_special_tokens=False)


def test_image_parts_reach_the_template_as_bare_markers():
    msgs = _messages([_image_part("data:image/png;base64,SECRET"), {"type": "text", "text": "hi"}])
    assert msgs == [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}]


@pytest.mark.parametrize("grids", [[(1, 4, 6)], [(1, 2, 2), (1, 8, 10)], [(1, 16, 16)] * 3])
def test_each_placeholder_expands_to_its_token_count(builder, grids):
    parts = [_image_part() for _ in grids] + [{"type": "text", "text": "describe"}]
    ids = builder.build_chat(_messages(parts), grids)
    want = sum(t * h * w // 4 for t, h, w in grids)
    assert ids.count(builder.image_token_id) == want
    text_ids = builder.encode(builder.render_chat(_messages(parts)))
    assert len(ids) == len(text_ids) - len(grids) + want
    # every run of image tokens sits between vision_start and vision_end
    start, end = builder.tokenizer.token_to_id("<|vision_start|>"), builder.tokenizer.token_to_id("<|vision_end|>")
    runs, i = [], 0
    while i < len(ids):
        if ids[i] == builder.image_token_id:
            j = i
            while j < len(ids) and ids[j] == builder.image_token_id:
                j += 1
            assert ids[i - 1] == start and ids[j] == end
            runs.append(j - i)
            i = j
        else:
            i += 1
    assert runs == [t * h * w // 4 for t, h, w in grids]


def test_text_only_has_no_image_tokens(builder):
    ids = builder.build_chat(_messages("hello"), [])
    assert builder.image_token_id not in ids


def test_placeholder_typed_in_text_is_refused(builder):
    with pytest.raises(BadRequest, match="placeholder"):
        builder.build_chat(_messages("sneaky <|image_pad|>"), [])
    with pytest.raises(BadRequest, match="placeholder"):
        builder.build_chat(_messages([_image_part(), {"type": "text", "text": "<|image_pad|>"}]),
                           [(1, 2, 2)])
    with pytest.raises(BadRequest, match="video"):
        builder.build_chat(_messages("<|video_pad|>"), [])


def test_completion_prompts(builder):
    assert builder.build_completion("hello world") == builder.encode("hello world")
    assert builder.build_completion([1, 2, 3]) == [1, 2, 3]
    with pytest.raises(BadRequest):
        builder.build_completion([10**9])


def test_max_model_len(builder):
    assert builder.resolve_max_tokens(100, None) == 412
    assert builder.resolve_max_tokens(100, 412) == 412
    with pytest.raises(BadRequest, match="max_model_len") as e:
        builder.resolve_max_tokens(100, 413)
    assert e.value.status == 400 and e.value.code == "context_length_exceeded"
    with pytest.raises(BadRequest, match="512"):
        builder.resolve_max_tokens(512, 1)


def test_template_errors_are_400(tiny_model_path):
    b = PromptBuilder.from_pretrained(tiny_model_path)
    from api_proc.prompt_builder import compile_chat_template

    b._template = compile_chat_template("{{ raise_exception('no system role') }}")
    with pytest.raises(BadRequest, match="no system role"):
        b.render_chat([{"role": "user", "content": "x"}])


def test_chat_template_kwargs_reach_the_template_beside_its_own_variables(tiny_model_path):
    from api_proc.prompt_builder import compile_chat_template

    b = PromptBuilder.from_pretrained(tiny_model_path)
    b._template = compile_chat_template(
        "{{ messages | length }}:{{ add_generation_prompt }}:"
        "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>"
        "{% else %}<think>{% endif %}{{ extra | default('') }}")
    messages = [{"role": "user", "content": "x"}]
    assert b.render_chat(messages) == "1:True:<think>"
    assert b.render_chat(messages, template_kwargs={"enable_thinking": False}) == \
        "1:True:<think>\n\n</think>"
    assert b.render_chat(messages, template_kwargs={"extra": [1, {"a": None}]}) == \
        "1:True:<think>[1, {'a': None}]"
    ids = b.build_chat(messages, [], template_kwargs={"enable_thinking": True})
    assert b.decoder.decode(ids) == "1:True:<think>"


def test_text_that_cannot_fit_is_refused_before_tokenizing(tiny_model_path, builder):
    vocab = builder.tokenizer.get_vocab(with_added_tokens=True)
    assert builder.max_prompt_chars == 2 * max(map(len, vocab)) * 512
    with pytest.raises(BadRequest, match="max_model_len") as e:
        builder.encode("x" * (builder.max_prompt_chars + 1))
    assert e.value.code == "context_length_exceeded"
    # the bound never refuses what fits: the densest text (longest tokens) of max_model_len
    longest = max(vocab, key=len)
    dense = builder.tokenizer.decode([vocab[longest]] * 511)
    assert len(dense) <= builder.max_prompt_chars and len(builder.encode(dense)) <= 512


async def test_a_long_prompt_is_tokenized_without_holding_the_event_loop(tiny_model_path):
    import asyncio

    builder = PromptBuilder.from_pretrained(tiny_model_path, max_model_len=32768)
    text = "hello world, some text to tokenize. " * 20_000  # 720 k characters
    assert len(text) <= builder.max_prompt_chars
    ticks = 0

    async def tick():
        nonlocal ticks
        while True:
            await asyncio.sleep(0.001)
            ticks += 1
    ticker = asyncio.ensure_future(tick())
    await asyncio.sleep(0.01)
    before = ticks
    ids = await asyncio.to_thread(builder.encode, text)
    ticker.cancel()
    assert len(ids) > 100_000
    # a tokenizer holding the GIL for the whole text lets the loop tick once or twice
    assert ticks - before >= 20
