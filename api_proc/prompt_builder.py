"""Chat template, tokenization and image placeholder expansion.

Uses `tokenizers` and a sandboxed jinja2 environment configured like transformers' own
(`apply_chat_template`) instead of AutoTokenizer: importing transformers pulls in torch
(about 3.5 s and 300 MB of RSS in the API process) for the same result.

The template is the model's own, or --chat-template's. A conversation with tools (tool
definitions, assistant tool calls, tool results) needs one that renders them; Qwen2.5-VL's
own never does, so such a conversation goes through TOOL_TEMPLATE (Qwen2.5's hermes format
with image parts) when the template in use never mentions `tools`.
"""

from __future__ import annotations

import json
import logging
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from api_proc.detokenizer import TokenDecoder
from api_proc.errors import BadRequest
from api_proc.protocol import ChatMessage, ImageURLPart, TextPart
from shared.model_config import ModelConfig, load_model_config
from shared.video_layout import VideoLayout

logger = logging.getLogger(__name__)

LONG_TEXT_CHARS = 16_384  # longer prompts are templated and tokenized off the event loop
TOOL_TEMPLATE = Path(__file__).resolve().parents[1] / "shared" / "data" / "qwen_tool_chat_template.jinja"


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def compile_chat_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _read_chat_template(folder: Path, tokenizer_config: dict) -> str:
    file = folder / "chat_template.jinja"
    if file.exists():
        return file.read_text(encoding="utf-8")
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        by_name = {t["name"]: t["template"] for t in template}
        template = by_name.get("default") or next(iter(by_name.values()), None)
    if not template:
        raise ValueError(f"{folder} has no chat template")
    return template


def _token_text(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def template_messages(messages: list[ChatMessage]) -> list[dict]:
    """Protocol messages as the chat template sees them: image and video parts become bare
    `{"type": "image"}` / `{"type": "video"}` markers, so no URL or base64 data ever reaches
    the template; a tool
    call's arguments become the object they encode, as templates (and transformers) expect."""
    out = []
    for m in messages:
        if m.content is None or isinstance(m.content, str):
            content: str | list[dict] = m.content or ""
        else:
            content = [{"type": "text", "text": p.text} if isinstance(p, TextPart)
                       else {"type": "image"} if isinstance(p, ImageURLPart)
                       else {"type": "video"} for p in m.content]
        msg = {"role": m.role, "content": content}
        if m.name:
            msg["name"] = m.name
        if m.tool_calls:
            msg["tool_calls"] = [{"id": c.id, "type": c.type, "function": {
                "name": c.function.name, "arguments": json.loads(c.function.arguments)}}
                for c in m.tool_calls]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return out


def text_chars(messages: list[dict]) -> int:
    """Characters of text in template messages (what the prompt holds at least)."""
    total = 0
    for m in messages:
        content = m["content"]
        if isinstance(content, str):
            total += len(content)
        else:
            total += sum(len(part.get("text") or "") for part in content)
    return total


def _has_tool_turns(messages: list[dict]) -> bool:
    return any(m["role"] == "tool" or "tool_calls" in m for m in messages)


def _cut_after_final_message(text: str, messages: list[dict]) -> str:
    """`text` up to the end of the last message's text, as transformers cuts it for
    continue_final_message; 400 when the template did not write that text."""
    final = messages[-1]["content"] if messages else ""
    if isinstance(final, list):
        final = next((p["text"] for p in reversed(final) if p.get("type") == "text"), None)
        if final is None:
            raise BadRequest("continue_final_message: the final message has no text to "
                             "continue", param="continue_final_message")
    at = text.rfind(final.strip()) if final.strip() else -1
    if at < 0:
        raise BadRequest("continue_final_message: the chat template does not write the "
                         "final message's text", param="continue_final_message")
    if text[at:at + len(final.lstrip())] == final.lstrip():  # the template kept its spacing
        return text[:at + len(final.lstrip())]
    return text[:at + len(final.strip())]


class PromptBuilder:
    def __init__(self, folder: str | Path, model_config: ModelConfig, max_model_len: int = 0,
                 chat_template: str | Path | None = None):
        folder = Path(folder)
        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        config_file = folder / "tokenizer_config.json"
        tok_config = json.loads(config_file.read_text()) if config_file.exists() else {}
        if chat_template is not None:
            source = Path(chat_template).read_text(encoding="utf-8")
        else:
            source = _read_chat_template(folder, tok_config)
        self._template = compile_chat_template(source)
        self._tool_template = self._template if "tools" in source else None  # compiled on use
        self._special_names = {
            "bos_token": _token_text(tok_config.get("bos_token")) or "",
            "eos_token": _token_text(tok_config.get("eos_token")) or "",
        }
        self.decoder = TokenDecoder(self.tokenizer)
        self._decoder_with_specials: TokenDecoder | None = None
        self.image_token_id = model_config.image_token_id
        self.video_token_id = model_config.video_token_id
        self.vision_start_token_id = model_config.vision_start_token_id
        self.vision_end_token_id = model_config.vision_end_token_id
        self.merge_size = model_config.image.merge_size
        self.vocab_size = max(model_config.text.vocab_size, self.tokenizer.get_vocab_size())
        self.num_logits = model_config.text.vocab_size  # the ids a model can score
        self.eos_token_ids = frozenset(model_config.eos_token_ids)
        self.max_model_len = max_model_len or model_config.text.max_position_embeddings
        # No token covers more bytes than the longest vocabulary entry (byte-level BPE writes
        # one character per byte), and no character is less than a byte; twice that for what
        # Unicode normalization can merge. Text longer than this cannot fit max_model_len,
        # whatever it says: refused before the tokenizer spends time and memory on it.
        longest = max(len(t) for t in self.tokenizer.get_vocab(with_added_tokens=True))
        self.max_prompt_chars = 2 * longest * self.max_model_len

    @property
    def decoder_with_specials(self) -> TokenDecoder:
        """A decoder that writes special tokens out (skip_special_tokens: false)."""
        if self._decoder_with_specials is None:
            self._decoder_with_specials = TokenDecoder(self.tokenizer, skip_special_tokens=False)
        return self._decoder_with_specials

    @classmethod
    def from_pretrained(cls, folder: str | Path, max_model_len: int = 0,
                        chat_template: str | Path | None = None) -> PromptBuilder:
        return cls(folder, load_model_config(folder), max_model_len, chat_template)

    def _template_for_tools(self) -> jinja2.Template:
        if self._tool_template is None:
            logger.info("the chat template does not render tools; conversations with tools "
                        "use %s", TOOL_TEMPLATE)
            self._tool_template = compile_chat_template(TOOL_TEMPLATE.read_text(encoding="utf-8"))
        return self._tool_template

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None,
                    template_kwargs: dict | None = None,
                    continue_final_message: bool = False) -> str:
        """The conversation as text; `tools`: OpenAI tool definitions (as dicts);
        `template_kwargs`: extra template variables (chat_template_kwargs), never one of
        the template's own (protocol.TEMPLATE_OWN_NAMES: refused before this);
        `continue_final_message`: the text ends inside the last message, which the model
        goes on writing (vLLM's and transformers' meaning)."""
        text = self._render(messages, add_generation_prompt and not continue_final_message,
                            tools, template_kwargs)
        return _cut_after_final_message(text, messages) if continue_final_message else text

    def _render(self, messages: list[dict], add_generation_prompt: bool,
                tools: list[dict] | None, template_kwargs: dict | None) -> str:
        template = self._template
        variables = dict(template_kwargs or {})
        if tools or _has_tool_turns(messages):
            template = self._template_for_tools()
            variables["tools"] = tools or None
        variables.update(self._special_names, messages=messages,
                         add_generation_prompt=add_generation_prompt)
        try:
            return template.render(**variables)
        except jinja2.exceptions.TemplateError as e:
            message = f"chat template refused the messages: {e}"
        raise BadRequest(message, param="messages")

    def check_prompt_chars(self, num_chars: int, param: str) -> None:
        """400 at once for text that cannot fit max_model_len (see max_prompt_chars)."""
        if num_chars > self.max_prompt_chars:
            raise BadRequest(f"the prompt has {num_chars} characters, more than "
                             f"{self.max_model_len} tokens (max_model_len) can hold",
                             param=param, code="context_length_exceeded")

    def encode(self, text: str) -> list[int]:
        self.check_prompt_chars(len(text), "messages")
        try:
            if len(text) <= LONG_TEXT_CHARS:
                return self.tokenizer.encode(text, add_special_tokens=False).ids
            # encode() holds the GIL for the whole text; encode_batch lets it go, so the
            # event loop runs while a worker thread tokenizes a long prompt
            return self.tokenizer.encode_batch([text], add_special_tokens=False)[0].ids
        except Exception as e:  # the tokenizer refuses the text: bad input, not a bug
            message = f"prompt text cannot be tokenized: {type(e).__name__}"
        raise BadRequest(message, param="messages")

    def num_image_tokens(self, grid_thw: tuple[int, int, int]) -> int:
        t, h, w = grid_thw
        return t * h * w // (self.merge_size * self.merge_size)

    def build_chat(self, messages: list[dict], image_grids: list[tuple[int, int, int]],
                   tools: list[dict] | None = None,
                   template_kwargs: dict | None = None,
                   videos: list[VideoLayout] = ()) -> list[int]:
        """Token ids of the templated conversation with each image's and video's
        placeholder expanded."""
        text = self.render_chat(messages, tools=tools, template_kwargs=template_kwargs)
        return self.prompt_ids(text, image_grids, videos)

    def prompt_ids(self, text: str, image_grids: list[tuple[int, int, int]],
                   videos: list[VideoLayout] = ()) -> list[int]:
        """Token ids of a rendered conversation with each image's and video's placeholder
        expanded."""
        ids = self.expand_image_tokens(self.encode(text), image_grids, allow_video=bool(videos))
        return self.expand_video_tokens(ids, videos) if videos else ids

    def video_tokens(self, layout: VideoLayout) -> list[int]:
        """What one `<|video_pad|>` becomes: Qwen2/2.5-VL, a run of placeholders for all
        groups; with timestamps (Qwen3-VL, Qwen3.5), per group its `<t seconds>` text and
        its own vision_start, placeholders, vision_end (inside the template's own pair, as
        transformers 5 writes it). Timestamp text sits between special tokens, so it is
        tokenized alone exactly as in the whole text."""
        if not layout.timestamps:
            return [self.video_token_id] * layout.num_tokens
        out: list[int] = []
        run = [self.vision_start_token_id, *[self.video_token_id] * layout.group_tokens,
               self.vision_end_token_id]
        for stamp in layout.timestamps:
            out.extend(self.tokenizer.encode(stamp, add_special_tokens=False).ids)
            out.extend(run)
        return out

    def expand_video_tokens(self, ids: list[int], videos: list[VideoLayout]) -> list[int]:
        positions = [i for i, t in enumerate(ids) if t == self.video_token_id]
        if len(positions) != len(videos):
            raise BadRequest(f"the prompt has {len(positions)} video placeholders for "
                             f"{len(videos)} videos (is the placeholder token in the text?)",
                             param="messages")
        out: list[int] = []
        start = 0
        for pos, layout in zip(positions, videos, strict=True):
            out.extend(ids[start:pos])
            out.extend(self.video_tokens(layout))
            start = pos + 1
        out.extend(ids[start:])
        return out

    def build_completion(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.encode(prompt)
        else:
            ids = list(prompt)
            outside = next((t for t in ids if not 0 <= t < self.num_logits), None)
            if outside is not None:  # vLLM's words, which clients match
                raise BadRequest(f"Token id {outside} is out of vocabulary (vocabulary size "
                                 f"{self.num_logits})", param="prompt")
        return self.expand_image_tokens(ids, [], param="prompt")

    @property
    def placeholder_ids(self) -> frozenset[int]:
        """The tokens that stand for an image's or a video's embeddings: the engine takes
        them in a prompt only with their media."""
        return frozenset((self.image_token_id, self.video_token_id))

    def expand_image_tokens(self, ids: list[int], image_grids: list[tuple[int, int, int]],
                            allow_video: bool = False, param: str = "messages") -> list[int]:
        """`ids` with each image's placeholder expanded; a placeholder without its media
        (typed as text, or as an id) is refused here, naming `param`, on every path."""
        if not allow_video and self.video_token_id in ids:
            raise BadRequest(f"the prompt ({param}) contains the video placeholder token but the "
                             "request has no videos", param=param)
        if not image_grids:  # text-only fast path
            if self.image_token_id in ids:
                raise BadRequest(f"the prompt ({param}) contains the image placeholder token but "
                                 "the request has no images", param=param)
            return ids
        positions = [i for i, t in enumerate(ids) if t == self.image_token_id]
        if len(positions) != len(image_grids):
            raise BadRequest(f"the prompt has {len(positions)} image placeholders for "
                                  f"{len(image_grids)} images (is the placeholder token in the "
                                  "text?)", param="messages")
        out: list[int] = []
        start = 0
        for pos, grid in zip(positions, image_grids, strict=True):
            out.extend(ids[start:pos])
            out.extend([self.image_token_id] * self.num_image_tokens(grid))
            start = pos + 1
        out.extend(ids[start:])
        return out

    def resolve_max_tokens(self, num_prompt_tokens: int, requested: int | None) -> int:
        """The completion budget: `requested`, or all the room left when None; 400 when the
        prompt plus the request do not fit max_model_len."""
        limit = self.max_model_len
        if num_prompt_tokens >= limit:
            raise BadRequest(f"the prompt has {num_prompt_tokens} tokens; max_model_len "
                                  f"is {limit}", param="messages", code="context_length_exceeded")
        room = limit - num_prompt_tokens
        if requested is None:
            return room
        if requested > room:
            raise BadRequest(f"max_model_len is {limit} tokens; the prompt has "
                                  f"{num_prompt_tokens} and max_tokens asks for {requested}",
                                  param="max_tokens", code="context_length_exceeded")
        return requested
