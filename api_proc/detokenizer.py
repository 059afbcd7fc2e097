"""Incremental detokenization with stop strings, constant state per request.

Byte-level BPE tokenizers (Qwen, GPT-2 family) get a fast path: each token id maps to its
raw bytes once per tokenizer, and an incremental UTF-8 decoder holds back a character split
across tokens (an emoji is often 2-4 byte tokens). Other tokenizers decode a short sliding
window of recent tokens and emit the text beyond what was already emitted. Stop strings are
matched on the decoded text; text that may still become a stop string is held back.
"""

from __future__ import annotations

import codecs
import json
from functools import lru_cache

from tokenizers import Tokenizer


@lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: printable stand-in character -> byte."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


class TokenDecoder:
    """Per-tokenizer tables shared by every request's IncrementalDetokenizer."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.byte_table: list[bytes] | None = None
        decoder = json.loads(tokenizer.to_str()).get("decoder") or {}
        if decoder.get("type") == "ByteLevel":
            self.byte_table = self._build_byte_table()

    def _build_byte_table(self) -> list[bytes]:
        inverse = _byte_level_decoder()
        added = self.tokenizer.get_added_tokens_decoder()
        size = max([self.tokenizer.get_vocab_size(), *(i + 1 for i in added)])
        table = [b""] * size
        for token, i in self.tokenizer.get_vocab(with_added_tokens=False).items():
            table[i] = bytes(inverse[c] for c in token if c in inverse)
        for i, tok in added.items():
            table[i] = b"" if (tok.special and self.skip_special_tokens) else tok.content.encode()
        return table

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """One token's own bytes, special tokens' text included (for log-probabilities)."""
        table = self.byte_table
        if table is not None and token_id < len(table) and table[token_id]:
            return table[token_id]
        token = self.tokenizer.id_to_token(token_id)
        if token is None:
            return b""
        return self.tokenizer.decode([token_id], skip_special_tokens=False).encode()


class _ByteLevelStream:
    __slots__ = ("_table", "_utf8")

    def __init__(self, table: list[bytes]):
        self._table = table
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def step(self, token_ids: list[int]) -> str:
        table, n = self._table, len(self._table)
        data = b"".join(table[t] for t in token_ids if 0 <= t < n)
        return self._utf8.decode(data)

    def finish(self) -> str:
        return self._utf8.decode(b"", final=True)


class _WindowStream:
    """Sliding-window decode (vLLM's prefix/read offsets), trimmed so state stays small."""

    __slots__ = ("_decoder", "_tokens", "_prefix", "_read")

    def __init__(self, decoder: TokenDecoder):
        self._decoder = decoder
        self._tokens: list[int] = []
        self._prefix = 0  # tokens[:_read] emitted; tokens[_prefix:_read] kept as context
        self._read = 0

    def step(self, token_ids: list[int]) -> str:
        self._tokens.extend(token_ids)
        before = self._decoder.decode(self._tokens[self._prefix:self._read])
        after = self._decoder.decode(self._tokens[self._prefix:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        del self._tokens[:self._prefix]
        self._prefix, self._read = self._read - self._prefix, len(self._tokens)
        return after[len(before):]

    def finish(self) -> str:
        before = self._decoder.decode(self._tokens[self._prefix:self._read])
        after = self._decoder.decode(self._tokens[self._prefix:])
        self._tokens.clear()
        self._prefix = self._read = 0
        return after[len(before):]


class NoDetokenizer:
    """--skip-tokenizer-init: token ids only, no text (vLLM's token-out)."""

    __slots__ = ()
    stopped = False

    def step(self, token_ids: list[int]) -> str:
        return ""

    def finish(self) -> str:
        return ""


class IncrementalDetokenizer:
    """Turns one request's token stream into text deltas; `stopped` once a stop string hit.

    State is the UTF-8 decoder's few pending bytes plus at most max(len(stop)) - 1 held
    characters: nothing grows with the completion length (R2)."""

    __slots__ = ("_stream", "_stops", "_max_hold", "_held", "_include_stop", "stopped")

    def __init__(self, decoder: TokenDecoder, stop: list[str] | None = None,
                 include_stop_str_in_output: bool = False):
        if decoder.byte_table is not None:
            self._stream: _ByteLevelStream | _WindowStream = _ByteLevelStream(decoder.byte_table)
        else:
            self._stream = _WindowStream(decoder)
        self._stops = tuple(s for s in (stop or ()) if s)
        self._max_hold = max((len(s) for s in self._stops), default=1) - 1
        self._held = ""
        self._include_stop = include_stop_str_in_output
        self.stopped = False

    def step(self, token_ids: list[int]) -> str:
        """New text that is safe to show for these tokens ('' while held back)."""
        if self.stopped:
            return ""
        return self._apply_stops(self._stream.step(token_ids))

    def finish(self) -> str:
        """The text still held back, at the end of the stream."""
        if self.stopped:
            return ""
        text = self._apply_stops(self._stream.finish())
        if self.stopped:
            return text
        text, self._held = text + self._held, ""
        return text

    def _apply_stops(self, text: str) -> str:
        if not self._stops:
            return text
        buf = self._held + text
        if not buf:
            return ""
        found = [(i, s) for s in self._stops if (i := buf.find(s)) >= 0]
        if found:
            cut, stop = min(found, key=lambda f: (f[0], -len(f[1])))
            self.stopped = True
            self._held = ""
            return buf[:cut + len(stop)] if self._include_stop else buf[:cut]
        hold = self._hold_length(buf)
        self._held = buf[len(buf) - hold:] if hold else ""
        return buf[:len(buf) - hold]

    def _hold_length(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of some stop string."""
        for k in range(min(len(buf), self._max_hold), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self._stops):
                return k
        return 0
