"""The Python SDK (flatserve/sdk.py) and the official openai client against the app."""

from __future__ import annotations

import base64
import io

import numpy as np
import openai
import pytest
from PIL import Image

from flatserve import sdk
from shared.random_checkpoints import CHECKPOINT_VERSION
from tests.api_proc.conftest import encode_image

MODEL = f"tiny-qwen2.5-vl-{CHECKPOINT_VERSION}"  # the tiny checkpoint folder's name


@pytest.fixture
def server(start_app, engine_double):
    return start_app(engine_double, api_key="k")


def _decode_data_url(url: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))


def test_image_to_url_accepts_every_kind(tmp_path):
    arr = np.random.default_rng(0).integers(0, 256, (20, 30, 3), dtype=np.uint8)
    url = sdk.image_to_url(arr)
    assert url.startswith("data:image/png;base64,")
    np.testing.assert_array_equal(np.asarray(_decode_data_url(url)), arr)
    pil = Image.fromarray(arr)
    np.testing.assert_array_equal(np.asarray(_decode_data_url(sdk.image_to_url(pil))), arr)
    jpg = tmp_path / "photo.jpg"
    jpg.write_bytes(encode_image(16, 16, fmt="JPEG"))
    assert sdk.image_to_url(jpg).startswith("data:image/jpeg;base64,")
    assert sdk.image_to_url(str(jpg)) == sdk.image_to_url(jpg)
    for url in ("http://x/y.png", "https://x/y.png", "data:image/png;base64,AA", "file:///a.png"):
        assert sdk.image_to_url(url) == url
    with pytest.raises(TypeError):
        sdk.image_to_url(arr.astype(np.float32))
    with pytest.raises(ValueError):
        sdk.image_to_url(np.zeros((2, 2, 2), np.uint8))


def test_build_messages():
    assert sdk.build_messages(None, "hi", None) == [{"role": "user", "content": "hi"}]
    msgs = sdk.build_messages("hi", None, ["http://x/a.png"], system="be brief")
    assert msgs[0] == {"role": "system", "content": "be brief"}
    assert msgs[1]["content"] == [{"type": "image_url", "image_url": {"url": "http://x/a.png"}},
                                  {"type": "text", "text": "hi"}]
    with pytest.raises(ValueError):
        sdk.build_messages(None, None, None)


def test_sync_client(server):
    with sdk.Client(server.url, api_key="k") as client:
        assert client.models() == [MODEL]
        assert client.health()["status"] == "ok"
        arr = np.random.default_rng(1).integers(0, 256, (64, 80, 3), dtype=np.uint8)
        result = client.chat(prompt="look 👀", images=[arr, Image.fromarray(arr)], max_tokens=300)
        assert "look 👀" in result.text and result.finish_reason == "stop"
        assert result.usage.total_tokens == result.usage.prompt_tokens + result.usage.completion_tokens
        deltas = list(client.stream_chat("stream it", max_tokens=5))
        assert len(deltas) >= 2 and "".join(deltas) == "system\nYou"
        two = client.chat("pick", n=2, max_tokens=3, temperature=0.5)
        assert len(two.choices) == 2
        done = client.complete("plain completion", max_tokens=20)
        assert done.text == "plain completion"


def test_sync_client_errors(server, start_app):
    with sdk.Client(server.url, api_key="wrong") as client:
        with pytest.raises(sdk.AuthenticationError) as e:
            client.chat("x")
        assert e.value.status == 401 and e.value.type == "authentication_error"
    with sdk.Client(server.url, api_key="k") as client:
        with pytest.raises(sdk.NotFoundError):
            client.chat("x", model="nope")
        with pytest.raises(sdk.BadRequestError) as e:
            client.chat("x", max_tokens=10**6)
        assert e.value.code == "context_length_exceeded"
        with pytest.raises(sdk.InternalServerError) as e:
            list(client.stream_chat("[[error]]"))
        assert e.value.type == "engine_error"
    with sdk.Client("http://127.0.0.1:1") as client, pytest.raises(sdk.APIConnectionError):
        client.models()
    tight = start_app(None)
    with sdk.Client(tight.url) as client:
        with pytest.raises(sdk.ServiceUnavailableError):
            client.chat("x")
        assert client.health()["status"] == "unhealthy"


def test_payload_too_large_error(start_app, engine_double):
    server = start_app(engine_double, max_image_bytes=1000)
    with sdk.Client(server.url) as client, pytest.raises(sdk.PayloadTooLargeError) as e:
        client.chat("x", images=[np.zeros((64, 64, 3), np.uint8) + 7,
                                 np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)])
    assert "max_image_bytes=1000" in e.value.message


async def test_async_client(server):
    async with sdk.AsyncClient(server.url, api_key="k") as client:
        assert await client.models() == [MODEL]
        assert (await client.health())["status"] == "ok"
        result = await client.chat(prompt="async 你好", images=[encode_image()], max_tokens=300)
        assert "async 你好" in result.text
        deltas = [d async for d in client.stream_chat(prompt="stream", max_tokens=5)]
        assert "".join(deltas) == "system\nYou"
        with pytest.raises(sdk.BadRequestError):
            await client.chat("x", temperature=9)


def test_official_openai_client(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="k")
    assert [m.id for m in client.models.list()] == [MODEL]
    url = sdk.image_to_url(np.full((40, 40, 3), 200, np.uint8))
    reply = client.chat.completions.create(
        model=MODEL, max_tokens=300,
        messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url, "detail": "high"}},
            {"type": "text", "text": "what colour?"}]}])
    assert "what colour?" in reply.choices[0].message.content
    assert reply.usage.prompt_tokens > 20
    chunks = list(client.chat.completions.create(
        model=MODEL, max_tokens=5, stream=True,
        stream_options={"include_usage": True}, messages=[{"role": "user", "content": "hi"}]))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "system\nYou"
    assert chunks[-1].usage.completion_tokens == 5
    text = client.completions.create(model=MODEL, prompt="abc def", max_tokens=8)
    assert text.choices[0].text == "abc def"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, n=1000,
                                       messages=[{"role": "user", "content": "x"}])
    bad_key = openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.models.list()


def test_the_readme_sdk_example_runs_as_printed(start_app, engine_double, capsys):
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    quick_start = readme[:readme.index("## Using it")]
    example = re.search(r"with the Python SDK.*?```python\n(.*?)```", quick_start, re.S).group(1)
    server = start_app(engine_double)
    exec(example.replace("http://127.0.0.1:8000", server.url), {})  # noqa: S102
    printed = capsys.readouterr().out
    # the double echoes the prompt: 16 tokens of it, then the story's
    assert "completion_tokens=16" in printed and "Tell me a story" in printed
    assert "random weights" in quick_start and "--model" in quick_start


def test_videos_in_every_form(server, engine_double, tmp_path):
    from tests.video.clips import make_clip

    clip = make_clip(4, 96, 64)
    path = tmp_path / "clip.mp4"
    path.write_bytes(clip)
    frames = np.random.default_rng(2).integers(0, 256, (3, 64, 96, 3), dtype=np.uint8)
    assert sdk.video_to_url("file:///a.mp4") == "file:///a.mp4"
    assert sdk.video_to_url(clip) == sdk.video_to_url(path)
    assert sdk.video_to_url(clip).startswith("data:video/mp4;base64,")
    listed = sdk.video_to_url(frames)
    assert listed.startswith("data:video/jpeg;base64,") and listed.count(",") == 3
    assert sdk.video_to_url([Image.fromarray(f) for f in frames]).count(",") == 3
    with sdk.Client(server.url, api_key="k") as client:
        for video, groups in ((clip, 2), (path, 2), (frames, 2)):
            assert client.chat("watch", videos=[video], max_tokens=3).finish_reason
            assert engine_double.log()["requests"][-1]["video"] == [True] * groups
        assert "".join(client.stream_chat("watch", videos=[frames], max_tokens=3))
