"""The official openai client against a real `flatserve serve` gets the greedy tokens the
engine gives offline for the same request."""

from __future__ import annotations

import base64
import io

import numpy as np
import openai
import pytest
from PIL import Image

from api_proc.detokenizer import TokenDecoder
from api_proc.prompt_builder import PromptBuilder
from engine_proc.llm_engine import LLMEngine
from flatserve.sdk import AsyncClient, Client
from shared.image_resize import resize_image
from shared.messages import AddRequest, ImageInput
from shared.model_config import load_model_config
from shared.sampling_params import SamplingParams
from tests.e2e.video_reference import (
    FPS,
    ask,
    assert_data_url_matches_transformers,
    reference,
    video_clip,
)
from tests.video.clips import decoded_frames, frame_list_url, frame_pixels, jpeg

MODEL = "flatserve-tiny-qwen2.5-vl"
MAX_TOKENS = 12


def _image(seed: int, size: tuple[int, int]) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def _data_url(img: Image.Image) -> str:
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _offline_text(model_path, messages, images) -> tuple[str, int, int]:
    cfg = load_model_config(model_path)
    builder = PromptBuilder.from_pretrained(model_path)
    resized = [resize_image(img, cfg.image) for img in images]
    template_msgs = [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str)
                      else [{"type": "image"} if p["type"] == "image_url" else p for p in m["content"]]}
                     for m in messages]
    ids = builder.build_chat(template_msgs, [g for _, g in resized])
    engine = LLMEngine(str(model_path), max_num_seqs=4, kv_cache_memory_bytes=32 << 20,
                       max_model_len=4096)
    request = AddRequest("offline", ids, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0),
                              [ImageInput(p, g) for p, g in resized])
    tokens = engine.generate([request])["offline"]
    return TokenDecoder(builder.tokenizer).decode(tokens), len(ids), len(tokens)


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize("images", [[], [(0, (64, 48))], [(1, (120, 90)), (2, (56, 200))]])
def test_openai_client_matches_offline_engine(oai, tiny_model_path, images):
    pics = [_image(seed, size) for seed, size in images]
    content = [{"type": "image_url", "image_url": {"url": _data_url(p)}} for p in pics]
    content.append({"type": "text", "text": "Describe this image."})
    messages = [{"role": "user", "content": content}]
    want_text, want_prompt, want_completion = _offline_text(tiny_model_path, messages, pics)

    reply = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS,
                                        temperature=0)
    assert reply.choices[0].message.content == want_text
    assert reply.usage.prompt_tokens == want_prompt
    assert reply.usage.completion_tokens == want_completion

    stream = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS,
                                         temperature=0, stream=True,
                                         stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want_text
    assert chunks[-1].usage.completion_tokens == want_completion


def test_sdk_sync_and_async(server):
    with Client(server.url) as client:
        assert client.models() == [MODEL]
        reply = client.chat("Hello there", images=[np.zeros((40, 40, 3), np.uint8)], max_tokens=5,
                            temperature=0)
        assert reply.usage.completion_tokens == 5
        assert "".join(client.stream_chat("Hello there", images=[np.zeros((40, 40, 3), np.uint8)],
                                          max_tokens=5, temperature=0)) == reply.text

    async def run():
        async with AsyncClient(server.url) as client:
            again = await client.chat("Hello there", images=[np.zeros((40, 40, 3), np.uint8)],
                                      max_tokens=5, temperature=0)
            deltas = [d async for d in client.stream_chat("Hello there", max_tokens=3,
                                                         temperature=0)]
            return again, deltas

    import asyncio

    again, deltas = asyncio.run(run())
    assert again.text == reply.text
    assert deltas


def test_video_forms_match_transformers(server, tiny_model_path):
    """A video as a data URL (streamed and not), a file:// URL and vLLM's frame list gets
    transformers' own greedy answer (tests/e2e/video_reference.py)."""
    clip = video_clip()
    assert_data_url_matches_transformers(tiny_model_path, server, clip)
    path = server.media_dir / "clip.mp4"
    path.write_bytes(clip)
    want, _ = reference(tiny_model_path, decoded_frames(clip), FPS, "Once more.")
    assert ask(server, f"file://{path}", "Once more.")[0] == want

    jpegs = [jpeg(frame_pixels(i, 96, 64, seed=4)) for i in range(5)]
    decoded = [np.asarray(Image.open(io.BytesIO(j)).convert("RGB")) for j in jpegs]
    want, _ = reference(tiny_model_path, decoded, FPS, "And this?")
    text, _ = ask(server, frame_list_url(jpegs), "And this?",
                  media_io_kwargs={"video": {"fps": FPS}})
    assert text == want
