"""OpenAI-compatible request and response bodies (chat completions, completions, models).

Requests refuse every field flatserve does not implement, by name (400), instead of
accepting and dropping it. Fields of the OpenAI API (and vLLM's extensions) that clients
send at their neutral value (`response_format: {type: text}`, `logprobs: false`, ...) are
accepted at that value only; `user` and `metadata` are accepted
and not used. Tools follow OpenAI's shapes; which tool choices a server honours is
decided in serving.py (`auto` needs --enable-auto-tool-choice, as in vLLM).
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    ValidationInfo,
    field_validator,
    model_validator,
)

from shared.sampling_params import MAX_LOGPROBS


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _MessageItem(BaseModel):
    """Inside a message: keys the server does not know are kept aside (model_extra) and
    ignored, as vLLM does (agent frameworks add their own); serving.py logs and counts
    their names (unknown_keys.py). Top-level request fields stay refused by name."""

    model_config = ConfigDict(extra="allow")


# ---------------------------------------------------------------- requests


class ImageURL(_MessageItem):
    url: str = Field(min_length=1)
    detail: Literal["auto", "low", "high"] | None = None


class TextPart(_MessageItem):
    type: Literal["text"]
    text: str


UUID_WITHOUT_MEDIA = (
    "uuid without the image it names is not supported: cached images are keyed by their "
    "content, and a key the client chooses would let one client read another's cached image; "
    "send the image with its uuid")


class ImageURLPart(_MessageItem):
    type: Literal["image_url"]
    image_url: ImageURL | None = None
    # vLLM's name for the media; accepted beside the image it names, never used as a cache
    # key (the content hash is: shared/image_key.py)
    uuid: str | None = Field(default=None, max_length=256)

    @field_validator("image_url", mode="before")
    @classmethod
    def _url_object(cls, v):
        if isinstance(v, str):
            raise ValueError('must be an object {"url": ...}, not a string (as in vLLM and '
                             "OpenAI)")
        return v

    @model_validator(mode="after")
    def _media_given(self):
        if self.image_url is None:
            raise ValueError(UUID_WITHOUT_MEDIA if self.uuid is not None
                             else "image_url is required")
        return self


class VideoURL(_Request):
    url: str = Field(min_length=1)


class VideoURLPart(_Request):
    """vLLM's video part: data:video/*;base64 (a container), data:video/jpeg;base64 with
    comma-separated JPEG frames (a frame list), http(s):// or file://. vLLM's `uuid` beside
    it (a client-chosen cache key, shared across users) is refused by name."""

    type: Literal["video_url"]
    video_url: VideoURL

    @field_validator("video_url", mode="before")
    @classmethod
    def _bare_url(cls, v):
        return {"url": v} if isinstance(v, str) else v


TokenId = Annotated[int, Field(ge=0, lt=2**31)]
ContentPart = Annotated[TextPart | ImageURLPart | VideoURLPart, Field(discriminator="type")]


class FunctionCall(_MessageItem):
    name: str = Field(min_length=1)
    arguments: str  # JSON text of an object, as OpenAI writes it


class ToolCall(_MessageItem):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_MessageItem):
    # system, developer, user, assistant, tool, or any other: vLLM passes the role to the
    # chat template, which renders it or refuses it (400)
    role: str = Field(min_length=1, max_length=64)
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant messages: the calls it made
    tool_call_id: str | None = None  # tool messages: the call this one answers

    @model_validator(mode="after")
    def _tool_fields_by_role(self):
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls goes with role assistant")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError("tool_call_id goes with role tool")
        for call in self.tool_calls or ():
            try:
                arguments = json.loads(call.function.arguments)
            except ValueError:
                arguments = None
            if not isinstance(arguments, dict):
                raise ValueError(f"tool call {call.id!r}: function.arguments must be the JSON "
                                 "text of an object")
        return self


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage in every chunk (with include_usage)


MAX_CONSTRAINT_CHARS = 65536  # of a schema, regex or grammar


def _schema_text(schema: dict | str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            raise ValueError("the JSON schema is not JSON") from None
    if not isinstance(schema, dict):
        raise ValueError("the JSON schema must be an object")
    text = json.dumps(schema)
    if len(text) > MAX_CONSTRAINT_CHARS:
        raise ValueError(f"the JSON schema is longer than {MAX_CONSTRAINT_CHARS} characters")
    return text


class JsonSchemaFormat(_Request):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and (self.json_schema is None
                                           or self.json_schema.schema_ is None):
            raise ValueError("type json_schema needs json_schema.schema")
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError(f"json_schema goes with type json_schema, not {self.type}")
        if self.json_schema is not None:
            _schema_text(self.json_schema.schema_)
        return self

    def constraint(self) -> tuple[str, str] | None:
        if self.type == "json_object":
            return ("json_object", "")
        if self.type == "json_schema":
            return ("json", _schema_text(self.json_schema.schema_))
        return None


class StructuredOutputsParams(_Request):
    """vLLM's `structured_outputs` (one of these)."""

    json_: dict | str | None = Field(default=None, alias="json")
    regex: str | None = Field(default=None, max_length=MAX_CONSTRAINT_CHARS)
    choice: list[Annotated[str, Field(min_length=1)]] | None = Field(
        default=None, min_length=1, max_length=1024)
    grammar: str | None = Field(default=None, max_length=MAX_CONSTRAINT_CHARS)
    json_object: bool | None = None

    @model_validator(mode="after")
    def _one(self):
        given = [k for k in ("json_", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError("structured_outputs takes exactly one of json, regex, choice, "
                             "grammar, json_object")
        if self.json_ is not None:
            _schema_text(self.json_)
        return self

    def constraint(self) -> tuple[str, str]:
        if self.json_ is not None:
            return ("json", _schema_text(self.json_))
        if self.regex is not None:
            return ("regex", self.regex)
        if self.choice is not None:
            return ("choice", json.dumps(self.choice))
        if self.grammar is not None:
            return ("grammar", self.grammar)
        return ("json_object", "")


class FunctionDefinition(_Request):
    # OpenAI's rule for function names; it also keeps them safe inside the grammar's tags
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of an object; None: no parameters
    strict: bool | None = None  # true with tool_choice auto: calls follow the schema too

    @field_validator("parameters")
    @classmethod
    def _parameters_schema(cls, v):
        if v is not None:
            _schema_text(v)
        return v

    @property
    def parameters_schema(self) -> dict:
        """What a call's arguments must match (no parameters: an empty object)."""
        if self.parameters is None:
            return {"type": "object", "properties": {}, "additionalProperties": False}
        return self.parameters


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: ToolChoiceFunction


MAX_TOOLS = 128
# what the chat template's render gets from the request and the tokenizer (prompt_builder.py),
# and vLLM's own render arguments: chat_template_kwargs may not replace them
TEMPLATE_OWN_NAMES = frozenset({
    "messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
    "chat_template", "tokenize", "bos_token", "eos_token", "raise_exception", "strftime_now"})
MAX_TEMPLATE_KWARGS_CHARS = 65536


def check_template_kwargs(kwargs: dict) -> dict:
    """chat_template_kwargs (a request's, or --default-chat-template-kwargs): extra variables
    of the chat template, as vLLM passes them; ValueError naming what cannot be set."""
    own = sorted(TEMPLATE_OWN_NAMES.intersection(kwargs))
    if own:
        raise ValueError(f"{', '.join(own)} cannot be set: the chat template gets "
                         f"{'it' if len(own) == 1 else 'them'} from the request itself")
    if len(json.dumps(kwargs)) > MAX_TEMPLATE_KWARGS_CHARS:
        raise ValueError(f"longer than {MAX_TEMPLATE_KWARGS_CHARS} characters as JSON")
    return kwargs


class _SamplingRequest(_Request):
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, lt=2**31)
    # vLLM's bounds (a torch.long); serving.py folds a negative seed into [0, 2**63)
    seed: int | None = Field(default=None, ge=-2**63, le=2**63 - 1)
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = Field(default=None, max_length=64)  # vLLM extension
    ignore_eos: bool = False  # extension
    skip_special_tokens: bool = True  # vLLM extension: leave special tokens out of the text
    include_stop_str_in_output: bool = False  # vLLM extension: keep the stop string matched
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=2.0)  # vLLM extension
    min_tokens: int | None = Field(default=None, ge=0)  # vLLM extension
    # token id (as a string, as JSON keys are) -> bias added to its logit
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = Field(
        default=None, max_length=1024)
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    # structured outputs: OpenAI's response_format, or vLLM's guided_* / structured_outputs
    response_format: ResponseFormat | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = Field(default=None, max_length=MAX_CONSTRAINT_CHARS)
    guided_choice: list[Annotated[str, Field(min_length=1)]] | None = Field(
        default=None, min_length=1, max_length=1024)
    guided_grammar: str | None = Field(default=None, max_length=MAX_CONSTRAINT_CHARS)
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's: log-probability tokens written "token_id:ID" (also --return-tokens-as-token-ids)
    return_tokens_as_token_ids: bool | None = None
    # vLLM's: the prompt's and each choice's token ids in the response
    return_token_ids: bool = False
    # vLLM's: the prompt tokens' log-probabilities and the k most likely there (-1: all)
    prompt_logprobs: int | None = Field(default=None, ge=-1, le=MAX_LOGPROBS)
    # vLLM's beam search (api_proc/beam_search.py): width max(n, best_of), the n best back
    use_beam_search: bool = False
    best_of: int | None = Field(default=None, ge=1)
    length_penalty: float = Field(default=1.0, ge=-10.0, le=10.0)

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v):
        if v is None:
            return None
        stops = [v] if isinstance(v, str) else list(v)
        if len(stops) > 16:
            raise ValueError("at most 16 stop strings")
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, v):
        if v is None:
            return None
        for key in v:
            if not key.isdigit() or int(key) >= 2**31:
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
        return v

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats

    @field_validator("guided_json")
    @classmethod
    def _guided_json(cls, v):
        if v is not None:
            _schema_text(v)
        return v

    @model_validator(mode="after")
    def _beam_search_fields(self):
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of ({self.best_of}) must be at least n ({self.n})")
        if not self.use_beam_search:
            if self.best_of not in (None, self.n):
                raise ValueError("best_of other than n needs use_beam_search: flatserve "
                                 "samples exactly n choices")
            if self.length_penalty != 1.0:
                raise ValueError("length_penalty applies with use_beam_search")
            return self
        given = [name for name, neutral in self._beam_incompatible() if not neutral]
        if given:
            raise ValueError(f"{', '.join(given)} cannot go with use_beam_search (not "
                             "supported)")
        return self

    def _beam_incompatible(self) -> list[tuple[str, bool]]:
        """Fields beam search does not honour, and whether each is at its neutral value."""
        return [("stream", not self.stream), ("stop", not self.stop),
                ("presence_penalty", not self.presence_penalty),
                ("frequency_penalty", not self.frequency_penalty),
                ("repetition_penalty", self.repetition_penalty in (None, 1.0)),
                ("logit_bias", not self.logit_bias), ("min_tokens", not self.min_tokens),
                ("prompt_logprobs", self.prompt_logprobs is None),
                ("top_p", self.top_p in (None, 1.0)), ("top_k", self.top_k in (None, 0, -1)),
                *((name, False) for name in self._constraints_given()),
                *self._beam_incompatible_own()]

    def _beam_incompatible_own(self) -> list[tuple[str, bool]]:
        return []

    @property
    def beam_width(self) -> int:
        return max(self.n, self.best_of or self.n)

    @model_validator(mode="after")
    def _prompt_logprobs_not_streamed(self):
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs is not available with stream: true (as in "
                             "vLLM)")
        return self

    @model_validator(mode="after")
    def _one_constraint(self):
        given = self._constraints_given()
        if len(given) > 1:
            raise ValueError(f"at most one output constraint, got {', '.join(given)}")
        return self

    def _constraints_given(self) -> list[str]:
        return [name for name, value in self._constraints() if value is not None]

    def _constraints(self) -> list[tuple[str, tuple[str, str] | None]]:
        fmt = self.response_format
        return [
            ("response_format", None if fmt is None else fmt.constraint()),
            ("guided_json", None if self.guided_json is None
             else ("json", _schema_text(self.guided_json))),
            ("guided_regex", None if self.guided_regex is None else ("regex", self.guided_regex)),
            ("guided_choice", None if self.guided_choice is None
             else ("choice", json.dumps(self.guided_choice))),
            ("guided_grammar", None if self.guided_grammar is None
             else ("grammar", self.guided_grammar)),
            ("structured_outputs", None if self.structured_outputs is None
             else self.structured_outputs.constraint()),
        ]

    @property
    def structured(self) -> tuple[str, str] | None:
        """(kind, spec) of shared.sampling_params.SamplingParams.structured, or None."""
        return next((value for _, value in self._constraints() if value is not None), None)


class ChatPromptFields(_Request):
    """What makes a chat prompt (vLLM's extensions beside messages and tools)."""

    messages: list[ChatMessage] = Field(min_length=1)
    # vLLM's: the assistant turn's opening is written, or the last message is continued
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # vLLM extension: extra variables of the chat template (enable_thinking, ...)
    chat_template_kwargs: dict[str, JsonValue] | None = None
    # vLLM extension: {"video": {"num_frames": N, "fps": F}} over --media-io-kwargs
    media_io_kwargs: dict[str, JsonValue] | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, v):
        return None if v is None else check_template_kwargs(v)

    @model_validator(mode="after")
    def _continue_or_open(self):
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both "
                             "be true: the model either continues the final message or opens "
                             "a new one (set add_generation_prompt: false)")
        return self


class ChatCompletionRequest(ChatPromptFields, _SamplingRequest):
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=-1, le=MAX_LOGPROBS)  # -1: all
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    # None: "auto" when tools are given, "none" otherwise (OpenAI's defaults)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # None: true, OpenAI's default
    # vLLM's: the response starts with the final message's content when it is the
    # assistant's (with continue_final_message, the text being continued)
    echo: bool = False
    # vLLM's, with --reasoning-parser: false leaves the reasoning out of the response
    include_reasoning: bool = True
    # vLLM's: the most tokens the model may think before its thinking is ended for it
    thinking_token_budget: int | None = Field(default=None, ge=0, lt=2**31)

    @field_validator("tools")
    @classmethod
    def _unique_names(cls, v):
        names = [t.function.name for t in v or ()]
        if len(set(names)) != len(names):
            raise ValueError("function names must be unique")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _choice_among_tools(cls, choice, info: ValidationInfo):
        names = [t.function.name for t in info.data.get("tools") or ()]
        if choice in ("required", "auto") and not names:
            raise ValueError(f"{choice!r} needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"names function {choice.function.name!r}, which is not among "
                             "tools")
        return choice

    @model_validator(mode="after")
    def _tools_or_constraint(self):
        given = self._constraints_given()
        if self.tool_choice_mode in ("required", "named") and given == ["response_format"]:
            # vLLM's: the calls' grammar governs the output, whose content is "" then
            return self
        if self.tools_constrain_output and given:
            raise ValueError(f"tool_choice {self.tool_choice_mode!r} constrains the output "
                             "(tool_grammar.py); it cannot go with "
                             f"{', '.join(self._constraints_given())}")
        return self

    @property
    def tool_choice_mode(self) -> str:
        """none | auto | required | named."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        if self.tool_choice is None:
            return "auto" if self.tools else "none"
        return self.tool_choice

    @property
    def tools_constrain_output(self) -> bool:
        mode = self.tool_choice_mode
        return mode in ("required", "named") or (
            mode == "auto" and any(t.function.strict for t in self.tools or ()))

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def _beam_incompatible_own(self) -> list[tuple[str, bool]]:
        return [("logprobs", not self.logprobs), ("tools", self.tool_choice_mode == "none"),
                ("echo", not self.echo)]

    @property
    def requested_logprobs(self) -> int | None:
        """Top alternatives per token wanted (0: the token's own only), or None."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


EMPTY_PROMPT = "the decoder prompt cannot be empty"  # vLLM's words, which clients match


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=-1, le=MAX_LOGPROBS)  # -1: all (vLLM's)

    @property
    def requested_logprobs(self) -> int | None:
        return self.logprobs

    def _beam_incompatible_own(self) -> list[tuple[str, bool]]:
        return [("logprobs", self.logprobs is None), ("echo", not self.echo)]

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError(EMPTY_PROMPT)
        if isinstance(v, list) and isinstance(v[0], list) and any(not p for p in v):
            raise ValueError(EMPTY_PROMPT)
        return v

    @model_validator(mode="after")
    def _echo_with_logprobs_not_streamed(self):
        if self.echo and self.logprobs is not None and self.stream:
            raise ValueError("echo with logprobs is not supported with stream: true (the "
                             "prompt's log-probabilities come with the whole response)")
        return self

    @property
    def echo_logprobs(self) -> bool:
        """The echoed prompt carries log-probabilities too (vLLM's echo with logprobs)."""
        return self.echo and self.logprobs is not None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


class BatchChatCompletionRequest(ChatCompletionRequest):
    """POST /v1/chat/completions/batch (vLLM's): `messages` is a list of conversations, each
    answered by one choice of one response (not streamed; n 1)."""

    messages: list[Annotated[list[ChatMessage], Field(min_length=1)]] = Field(min_length=1)
    stream: Literal[False] = False
    n: Literal[1] = 1


class TokenizeCompletionRequest(_Request):
    """POST /tokenize with a prompt (vLLM's)."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(ChatPromptFields):
    """POST /tokenize with messages (vLLM's): the chat prompt's ids, images expanded."""

    model: str | None = None
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    add_special_tokens: bool = False
    return_token_strs: bool = False


MAX_DETOKENIZE_IDS = 1 << 20


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[TokenId] = Field(max_length=MAX_DETOKENIZE_IDS)


# ---------------------------------------------------------------- responses


class UsageInfo(_Body):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class MadeFunctionCall(_Body):
    name: str  # "" when a forced call was cut before its name was written
    arguments: str


class MadeToolCall(_Body):
    """A call the model made (a request's ToolCall is one it made before)."""

    id: str
    type: Literal["function"] = "function"
    function: MadeFunctionCall


class ChatCompletionMessage(_Body):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[MadeToolCall] = Field(default_factory=list)  # vLLM's: [] without calls
    # --reasoning-parser: the text the model thought, under vLLM's new name and its old one
    reasoning: str | None = None
    reasoning_content: str | None = None


class DeltaFunctionCall(_Body):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_Body):
    """A streamed tool call: the first delta of a call has index, id, type and
    function.name (arguments ""); the ones after it, index and argument text."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class TopLogprob(_Body):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Body):
    content: list[ChatTokenLogprob] | None
    refusal: list[ChatTokenLogprob] | None = None


class CompletionLogprobs(_Body):
    tokens: list[str]
    token_logprobs: list[float | None]  # None: the prompt's first token (echo)
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(_Body):
    """vLLM's entry of a prompt position, keyed by token id: the prompt's own token and the
    top alternatives there."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class ChatCompletionChoice(_Body):
    index: int
    message: ChatCompletionMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None
    token_ids: list[int] | None = None  # return_token_ids (vLLM's); left out otherwise


class ChatCompletionResponse(_Body):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    prompt_token_ids: list[int] | None = None  # return_token_ids (vLLM's); left out otherwise
    # vLLM's: the prompt's log-probabilities (prompt_logprobs), null when not asked for
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class ChatDelta(_Body):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None


class ChatCompletionChunkChoice(_Body):
    index: int
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None
    token_ids: list[int] | None = None  # return_token_ids: this chunk's


class ChatCompletionChunk(_Body):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionChunkChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids: on the first chunk


class CompletionChoice(_Body):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None
    # return_token_ids (vLLM's): its prompt's ids (streamed: in its first chunk) and its own
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None
    # vLLM's: its prompt's log-probabilities (prompt_logprobs), null when not asked for
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class CompletionResponse(_Body):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionChunk(_Body):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(_Body):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "flatserve"
    root: str | None = None  # vLLM's: the model folder the name stands for
    parent: str | None = None  # vLLM's: a LoRA adapter's base model (none here)
    max_model_len: int | None = None


class ModelList(_Body):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(_Body):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Body):
    error: ErrorInfo
