"""Python SDK for a flatserve server (or any OpenAI-compatible one): `Client`, `AsyncClient`.

    from flatserve import Client
    with Client("http://127.0.0.1:8000") as client:
        result = client.chat(prompt="What is in this picture?", images=["cat.jpg"])
        print(result.text, result.usage.total_tokens)
        for delta in client.stream_chat(prompt="Count to five."):
            print(delta, end="")

Images may be PIL images, uint8 numpy arrays (HxWx3, HxWx4 or HxW), file paths, encoded
image bytes, or URLs (http(s)://, data:, file://, passed through). Arrays and PIL images are
sent as PNG data URLs; files and bytes as data URLs of their own bytes. Videos (`videos=`)
may be file paths or bytes of a container (MP4, WebM, MKV...), URLs, or frames: a uint8
array [frames, H, W, 3] or a list of images, sent as vLLM's frame list of JPEGs (the server
takes them at 1 frame a second unless media_io_kwargs says otherwise). Server errors raise `APIError`
subclasses carrying `.status`, `.type`, `.code` and `.message`.
"""

from __future__ import annotations

import base64
import io
import json
import os
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

URL_SCHEMES = ("http://", "https://", "data:", "file://")


# ------------------------------------------------------------------ errors


class APIError(Exception):
    status: int | None = None

    def __init__(self, message: str, *, status: int | None = None, type: str | None = None,
                 code: str | None = None, param: str | None = None, body: Any = None):
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status
        self.type = type
        self.code = code
        self.param = param
        self.body = body

    def __str__(self) -> str:
        head = f"{self.status} {self.type}" if self.status else (self.type or "error")
        return f"{head}: {self.message}"


class BadRequestError(APIError):
    status = 400


class AuthenticationError(APIError):
    status = 401


class NotFoundError(APIError):
    status = 404


class PayloadTooLargeError(APIError):
    status = 413


class OverBudgetError(APIError):
    """429: the server's multimodal budget stayed full; retry later."""

    status = 429


class InternalServerError(APIError):
    status = 500


class ServiceUnavailableError(APIError):
    status = 503


class APIConnectionError(APIError):
    """The server could not be reached or the connection broke."""


_BY_STATUS: dict[int, type[APIError]] = {
    400: BadRequestError, 401: AuthenticationError, 404: NotFoundError,
    413: PayloadTooLargeError, 429: OverBudgetError, 500: InternalServerError,
    503: ServiceUnavailableError,
}


_BY_TYPE: dict[str, type[APIError]] = {
    "invalid_request_error": BadRequestError, "authentication_error": AuthenticationError,
    "not_found_error": NotFoundError, "request_too_large": PayloadTooLargeError,
    "rate_limit_error": OverBudgetError, "service_unavailable": ServiceUnavailableError,
    "engine_error": InternalServerError, "internal_error": InternalServerError,
}


def error_from_body(status: int | None, body: Any) -> APIError:
    """The typed error for an error body; `status` None for errors sent inside a stream."""
    info = body.get("error") if isinstance(body, dict) else None
    if not isinstance(info, dict):
        info = {"message": str(body) if body else f"HTTP {status}"}
    if status is None:
        cls = _BY_TYPE.get(str(info.get("type")), APIError)
        status = cls.status
    else:
        cls = _BY_STATUS.get(status, APIError)
        if cls is APIError and status >= 500:
            cls = InternalServerError
    return cls(str(info.get("message", "")), status=status, type=info.get("type"),
               code=info.get("code"), param=info.get("param"), body=body)


def _error_from_response(response: httpx.Response, content: bytes) -> APIError:
    try:
        body: Any = json.loads(content)
    except ValueError:
        body = content.decode(errors="replace")
    return error_from_body(response.status_code, body)


# ------------------------------------------------------------------ results


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


@dataclass
class ChatResult:
    text: str
    usage: Usage
    finish_reason: str | None
    id: str = ""
    choices: list[str] = field(default_factory=list)  # every choice's text when n > 1
    raw: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_body(cls, body: dict, kind: str = "chat") -> ChatResult:
        choices = sorted(body.get("choices", []), key=lambda c: c.get("index", 0))
        if kind == "chat":
            texts = [(c.get("message") or {}).get("content") or "" for c in choices]
        else:
            texts = [c.get("text") or "" for c in choices]
        usage = Usage(**{k: int(v) for k, v in (body.get("usage") or {}).items()
                         if k in ("prompt_tokens", "completion_tokens", "total_tokens")})
        return cls(text=texts[0] if texts else "", usage=usage,
                   finish_reason=choices[0].get("finish_reason") if choices else None,
                   id=body.get("id", ""), choices=texts, raw=body)


# ------------------------------------------------------------------ request building


def image_to_url(image: Any) -> str:
    """An image_url value for `image` (see the module docstring for what is accepted)."""
    if isinstance(image, str) and image.startswith(URL_SCHEMES):
        return image
    if isinstance(image, (str, os.PathLike, bytes, bytearray)):
        data = bytes(image) if isinstance(image, (bytes, bytearray)) else Path(image).read_bytes()
        return f"data:{_sniff_mime(data)};base64," + base64.b64encode(data).decode("ascii")
    from PIL import Image

    if not isinstance(image, Image.Image):
        image = _array_to_pil(image)
    buf = io.BytesIO()
    image.save(buf, "PNG", compress_level=1)  # fast; the server decodes any level alike
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def video_to_url(video: Any) -> str:
    """A video_url value for `video` (see the module docstring for what is accepted)."""
    if isinstance(video, str) and video.startswith(URL_SCHEMES):
        return video
    if isinstance(video, (str, os.PathLike, bytes, bytearray)):
        data = bytes(video) if isinstance(video, (bytes, bytearray)) else Path(video).read_bytes()
        return "data:video/mp4;base64," + base64.b64encode(data).decode("ascii")
    from PIL import Image

    frames = []
    for frame in video:  # an array [F, H, W, 3] iterates over its frames
        image = frame if isinstance(frame, Image.Image) else _array_to_pil(frame)
        buf = io.BytesIO()
        image.convert("RGB").save(buf, "JPEG", quality=95)
        frames.append(base64.b64encode(buf.getvalue()).decode("ascii"))
    if not frames:
        raise ValueError("a video needs at least one frame")
    return "data:video/jpeg;base64," + ",".join(frames)


def _array_to_pil(array: Any):
    import numpy as np
    from PIL import Image

    if not isinstance(array, np.ndarray):
        raise TypeError(f"unsupported image type {type(array).__name__}: use a PIL image, a "
                        "uint8 numpy array, a file path or a URL")
    if array.dtype != np.uint8:
        raise TypeError(f"image arrays must be uint8, got {array.dtype}")
    if array.ndim == 2 or (array.ndim == 3 and array.shape[2] in (3, 4)):
        return Image.fromarray(np.ascontiguousarray(array))
    raise ValueError(f"image arrays must be HxW, HxWx3 or HxWx4, got shape {array.shape}")


def _sniff_mime(data: bytes) -> str:
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as img:
            fmt = (img.format or "").lower()
    except Exception:  # let the server say what is wrong with it
        return "application/octet-stream"
    return {"jpeg": "image/jpeg", "png": "image/png", "webp": "image/webp", "gif": "image/gif",
            "bmp": "image/bmp", "tiff": "image/tiff"}.get(fmt, "application/octet-stream")


def build_messages(messages: Sequence[dict] | str | None, prompt: str | None,
                   images: Sequence[Any] | None, system: str | None = None,
                   videos: Sequence[Any] | None = None) -> list[dict]:
    """OpenAI chat messages: `messages` as given (a str is one user message) or `prompt`;
    `images`, then `videos`, are added in front of the text of the last user message."""
    if messages is None and prompt is None:
        raise ValueError("give messages or prompt")
    if messages is not None and prompt is not None:
        raise ValueError("give messages or prompt, not both")
    if isinstance(messages, str):
        prompt, messages = messages, None
    out = [dict(m) for m in messages] if messages is not None else []
    if prompt is not None:
        out.append({"role": "user", "content": prompt})
    if system is not None:
        out.insert(0, {"role": "system", "content": system})
    parts = [{"type": "image_url", "image_url": {"url": image_to_url(im)}} for im in images or ()]
    parts += [{"type": "video_url", "video_url": {"url": video_to_url(v)}} for v in videos or ()]
    if parts:
        users = [i for i, m in enumerate(out) if m.get("role") == "user"]
        if not users:
            raise ValueError("images and videos need a user message to go with")
        last = out[users[-1]]
        content = last.get("content")
        text = [{"type": "text", "text": content}] if isinstance(content, str) else list(content or [])
        last["content"] = parts + text
    return out


def _chat_body(messages, prompt, images, system, model, stream: bool, options: dict,
               videos=None) -> dict:
    body = {"messages": build_messages(messages, prompt, images, system, videos)}
    if model is not None:
        body["model"] = model
    body.update({k: v for k, v in options.items() if v is not None})
    if stream:
        body["stream"] = True
    return body


def _deltas(payload: str) -> tuple[list[str], bool]:
    """Text deltas of one SSE data payload and whether the stream is done."""
    if payload == "[DONE]":
        return [], True
    event = json.loads(payload)
    if "error" in event:
        raise error_from_body(None, event)
    out = []
    for choice in event.get("choices") or []:
        delta = choice.get("delta")
        text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
        if text:
            out.append(text)
    return out, False


class _Base:
    def __init__(self, base_url: str, api_key: str | None, model: str | None):
        self.base_url = base_url.rstrip("/")
        if self.base_url.endswith("/v1"):
            self.base_url = self.base_url[:-3]
        self.model = model
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}


# ------------------------------------------------------------------ sync


class Client(_Base):
    def __init__(self, base_url: str = "http://127.0.0.1:8000", *, api_key: str | None = None,
                 model: str | None = None, timeout: float = 600.0,
                 http_client: httpx.Client | None = None):
        super().__init__(base_url, api_key, model)
        self._http = http_client or httpx.Client(timeout=timeout)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _request(self, method: str, path: str, body: dict | None = None) -> httpx.Response:
        try:
            response = self._http.request(method, self.base_url + path, json=body,
                                          headers=self.headers)
        except httpx.HTTPError as e:
            raise APIConnectionError(f"{type(e).__name__}: {e}") from None
        return response

    def _json(self, method: str, path: str, body: dict | None = None) -> dict:
        response = self._request(method, path, body)
        if response.status_code != 200:
            raise _error_from_response(response, response.content)
        return response.json()

    def chat(self, messages: Sequence[dict] | str | None = None, *, prompt: str | None = None,
             images: Sequence[Any] | None = None, videos: Sequence[Any] | None = None,
             system: str | None = None,
             max_tokens: int | None = None, temperature: float | None = None,
             top_p: float | None = None, top_k: int | None = None, seed: int | None = None,
             stop: str | list[str] | None = None, n: int | None = None,
             model: str | None = None) -> ChatResult:
        body = _chat_body(messages, prompt, images, system, model or self.model, False, dict(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
            seed=seed, stop=stop, n=n), videos)
        return ChatResult.from_body(self._json("POST", "/v1/chat/completions", body))

    def stream_chat(self, messages: Sequence[dict] | str | None = None, *,
                    prompt: str | None = None, images: Sequence[Any] | None = None,
                    videos: Sequence[Any] | None = None, system: str | None = None,
                    max_tokens: int | None = None,
                    temperature: float | None = None, top_p: float | None = None,
                    top_k: int | None = None, seed: int | None = None,
                    stop: str | list[str] | None = None, model: str | None = None) -> Iterator[str]:
        """Yield the reply's text deltas as they arrive; closing the iterator early closes
        the connection, which aborts the request on the server."""
        body = _chat_body(messages, prompt, images, system, model or self.model, True, dict(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
            seed=seed, stop=stop), videos)
        try:
            with self._http.stream("POST", self.base_url + "/v1/chat/completions", json=body,
                                   headers=self.headers) as response:
                if response.status_code != 200:
                    raise _error_from_response(response, response.read())
                for line in response.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    texts, done = _deltas(line[5:].strip())
                    yield from texts
                    if done:
                        return
        except httpx.HTTPError as e:
            raise APIConnectionError(f"{type(e).__name__}: {e}") from None

    def complete(self, prompt: str | list[int], *, max_tokens: int | None = None,
                 temperature: float | None = None, top_p: float | None = None,
                 top_k: int | None = None, seed: int | None = None,
                 stop: str | list[str] | None = None, model: str | None = None) -> ChatResult:
        body = {"prompt": prompt, **{k: v for k, v in dict(
            model=model or self.model, max_tokens=max_tokens, temperature=temperature,
            top_p=top_p, top_k=top_k, seed=seed, stop=stop).items() if v is not None}}
        return ChatResult.from_body(self._json("POST", "/v1/completions", body), "completion")

    def health(self) -> dict:
        """The server's /health body (also when it answers 503: check ["status"])."""
        response = self._request("GET", "/health")
        return response.json()

    def models(self) -> list[str]:
        return [m["id"] for m in self._json("GET", "/v1/models")["data"]]


# ------------------------------------------------------------------ async


class AsyncClient(_Base):
    def __init__(self, base_url: str = "http://127.0.0.1:8000", *, api_key: str | None = None,
                 model: str | None = None, timeout: float = 600.0,
                 http_client: httpx.AsyncClient | None = None):
        super().__init__(base_url, api_key, model)
        self._http = http_client or httpx.AsyncClient(timeout=timeout)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def _request(self, method: str, path: str, body: dict | None = None) -> httpx.Response:
        try:
            return await self._http.request(method, self.base_url + path, json=body,
                                            headers=self.headers)
        except httpx.HTTPError as e:
            raise APIConnectionError(f"{type(e).__name__}: {e}") from None

    async def _json(self, method: str, path: str, body: dict | None = None) -> dict:
        response = await self._request(method, path, body)
        if response.status_code != 200:
            raise _error_from_response(response, response.content)
        return response.json()

    async def chat(self, messages: Sequence[dict] | str | None = None, *,
                   prompt: str | None = None, images: Sequence[Any] | None = None,
                   videos: Sequence[Any] | None = None, system: str | None = None,
                   max_tokens: int | None = None,
                   temperature: float | None = None, top_p: float | None = None,
                   top_k: int | None = None, seed: int | None = None,
                   stop: str | list[str] | None = None, n: int | None = None,
                   model: str | None = None) -> ChatResult:
        body = _chat_body(messages, prompt, images, system, model or self.model, False, dict(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
            seed=seed, stop=stop, n=n), videos)
        return ChatResult.from_body(await self._json("POST", "/v1/chat/completions", body))

    async def stream_chat(self, messages: Sequence[dict] | str | None = None, *,
                          prompt: str | None = None, images: Sequence[Any] | None = None,
                          videos: Sequence[Any] | None = None, system: str | None = None,
                    max_tokens: int | None = None,
                          temperature: float | None = None, top_p: float | None = None,
                          top_k: int | None = None, seed: int | None = None,
                          stop: str | list[str] | None = None,
                          model: str | None = None) -> AsyncIterator[str]:
        body = _chat_body(messages, prompt, images, system, model or self.model, True, dict(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
            seed=seed, stop=stop), videos)
        try:
            async with self._http.stream("POST", self.base_url + "/v1/chat/completions",
                                         json=body, headers=self.headers) as response:
                if response.status_code != 200:
                    raise _error_from_response(response, await response.aread())
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    texts, done = _deltas(line[5:].strip())
                    for text in texts:
                        yield text
                    if done:
                        return
        except httpx.HTTPError as e:
            raise APIConnectionError(f"{type(e).__name__}: {e}") from None

    async def complete(self, prompt: str | list[int], *, max_tokens: int | None = None,
                       temperature: float | None = None, top_p: float | None = None,
                       top_k: int | None = None, seed: int | None = None,
                       stop: str | list[str] | None = None,
                       model: str | None = None) -> ChatResult:
        body = {"prompt": prompt, **{k: v for k, v in dict(
            model=model or self.model, max_tokens=max_tokens, temperature=temperature,
            top_p=top_p, top_k=top_k, seed=seed, stop=stop).items() if v is not None}}
        return ChatResult.from_body(await self._json("POST", "/v1/completions", body),
                                    "completion")

    async def health(self) -> dict:
        return (await self._request("GET", "/health")).json()

    async def models(self) -> list[str]:
        return [m["id"] for m in (await self._json("GET", "/v1/models"))["data"]]
