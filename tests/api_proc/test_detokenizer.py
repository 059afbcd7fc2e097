from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from api_proc.detokenizer import IncrementalDetokenizer, TokenDecoder

TEXTS = [
    "plain ascii text, with punctuation!",
    "emoji 😀👍🏽 family 👨‍👩‍👧 flags 🇯🇵 end",
    "中文测试：你好，世界。日本語のテキスト、한국어 텍스트",
    "mixed é ñ ü ß Ω ∑ → ✓ 🚀 done",
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path) -> Tokenizer:
    return Tokenizer.from_file(str(tiny_model_path / "tokenizer.json"))


@pytest.fixture(scope="module")
def decoder(tokenizer) -> TokenDecoder:
    return TokenDecoder(tokenizer)


@pytest.fixture(scope="module")
def window_decoder(tokenizer) -> TokenDecoder:
    d = TokenDecoder(tokenizer)
    d.byte_table = None  # force the generic sliding-window path
    return d


def _stream(decoder, ids, stop=None, chunk=1):
    detok = IncrementalDetokenizer(decoder, stop)
    pieces = [detok.step(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    pieces.append(detok.finish())
    return pieces, detok


def test_byte_level_fast_path_is_used(decoder):
    assert decoder.byte_table is not None


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 2, 3])
@pytest.mark.parametrize("which", ["decoder", "window_decoder"])
def test_incremental_equals_full_decode(request, tokenizer, text, chunk, which):
    dec = request.getfixturevalue(which)
    ids = tokenizer.encode(text).ids
    pieces, _ = _stream(dec, ids, chunk=chunk)
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)


def test_multibyte_characters_are_split_across_tokens(tokenizer, decoder):
    # the tiny tokenizer has no merge for this emoji: its 4 bytes are separate tokens
    ids = tokenizer.encode("🦀").ids
    assert len(ids) > 1
    detok = IncrementalDetokenizer(decoder)
    assert [detok.step([t]) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.step([ids[-1]]) == "🦀"


def test_special_tokens_and_unknown_ids_are_skipped(tokenizer, decoder):
    eos = tokenizer.token_to_id("<|im_end|>")
    ids = tokenizer.encode("hi").ids + [eos, 99999, -1]
    pieces, _ = _stream(decoder, ids)
    assert "".join(pieces) == "hi"


def test_truncated_character_at_end_becomes_replacement(tokenizer, decoder):
    ids = tokenizer.encode("a🦀").ids[:-1]
    pieces, _ = _stream(decoder, ids)
    assert "".join(pieces) == "a\ufffd"


@pytest.mark.parametrize("chunk", [1, 4])
def test_stop_string_truncates_and_holds_back_prefixes(tokenizer, decoder, chunk):
    text = "The answer is 42. STOP here and more"
    ids = tokenizer.encode(text).ids
    pieces, detok = _stream(decoder, ids, stop=["STOP"], chunk=chunk)
    assert "".join(pieces) == "The answer is 42. "
    assert detok.stopped
    assert all("S" not in p for p in pieces)  # no partial stop string was ever emitted


def test_stop_string_prefix_that_does_not_complete_is_released(tokenizer, decoder):
    text = "a STO b ST"
    ids = tokenizer.encode(text).ids
    pieces, detok = _stream(decoder, ids, stop=["STOP"])
    assert "".join(pieces) == text
    assert not detok.stopped


def test_earliest_of_several_stop_strings_wins(tokenizer, decoder):
    ids = tokenizer.encode("one two three four").ids
    pieces, _ = _stream(decoder, ids, stop=["four", "two"])
    assert "".join(pieces) == "one "


def test_stop_string_with_multibyte_characters(tokenizer, decoder):
    ids = tokenizer.encode("你好😀世界").ids
    pieces, detok = _stream(decoder, ids, stop=["😀世"])
    assert "".join(pieces) == "你好"
    assert detok.stopped


def test_steps_after_stop_return_nothing(tokenizer, decoder):
    detok = IncrementalDetokenizer(decoder, ["x"])
    assert detok.step(tokenizer.encode("ax").ids) == "a"
    assert detok.step(tokenizer.encode("more").ids) == ""
    assert detok.finish() == ""


def test_state_stays_constant_with_length(tokenizer, decoder, window_decoder):
    ids = tokenizer.encode("a long text " * 200).ids
    for dec in (decoder, window_decoder):
        detok = IncrementalDetokenizer(dec, ["never-appears"])
        for t in ids:
            detok.step([t])
            assert len(detok._held) < len("never-appears")
            if dec is window_decoder:
                assert len(detok._stream._tokens) <= 8


def test_include_stop_str_in_output_keeps_the_earliest_stop():
    from api_proc.detokenizer import IncrementalDetokenizer

    class Bytes:
        byte_table = [bytes([i]) for i in range(256)]

    for include, want in ((False, "xx"), (True, "xxab")):
        d = IncrementalDetokenizer(Bytes(), ["abc", "ab"], include_stop_str_in_output=include)
        text = "".join(d.step([b]) for b in b"xxabcd")
        assert d.stopped and text == want
