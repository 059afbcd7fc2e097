"""transformers' own greedy answer to a video request, for the HTTP parity tests
(test_family_parity.py: every family, a data URL, streamed and not; test_openai_parity.py:
the default model, also as a file:// URL and as vLLM's frame list).

The reference decodes the clip itself (PyAV, every frame), samples the frames by vLLM's rule,
resizes them with PIL's bicubic (transformers' torch resize differs by a level at most:
shared/video_layout.py) and runs transformers' generate on its video patchify."""

from __future__ import annotations

import numpy as np
import openai
import torch
from PIL import Image
from tokenizers import Tokenizer

from api_proc.prompt_builder import PromptBuilder
from shared.model_config import load_model_config
from shared.video_layout import VideoSettings, sample_indices
from tests.engine_proc.conftest import hf_class
from tests.engine_proc.test_video_engine import hf_video_patches, video_ids
from tests.video.clips import (
    data_url,
    decoded_frames,
    make_clip,
)

MAX_TOKENS = 8
FPS = 8  # Qwen2.5-VL: one temporal position a group, where transformers' rule for text
#          after a video agrees with the original one (test_video_engine.py)


def reference(folder, frames: list[np.ndarray], fps: float, text: str) -> tuple[str, int]:
    """transformers' greedy completion text and the prompt's token count."""
    config = load_model_config(folder)
    settings = VideoSettings.of(config)
    height, width = settings.resized_size(*frames[0].shape[:2], len(frames))
    video = np.stack([np.asarray(Image.fromarray(f).resize((width, height),
                                                            Image.Resampling.BICUBIC))
                      for f in frames])
    n = len(frames)
    layout = settings.layout(list(range(n)), fps, n, height, width)
    builder = PromptBuilder.from_pretrained(folder)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    rendered = builder.render_chat([{"role": "user", "content": [
        {"type": "video"}, {"type": "text", "text": text}]}])
    head, tail = rendered.split("<|vision_start|><|video_pad|><|vision_end|>")
    ids = (tokenizer.encode(head, add_special_tokens=False).ids + video_ids(config, layout, tokenizer)
           + tokenizer.encode(tail, add_special_tokens=False).ids)
    hf = hf_class(config.architecture).from_pretrained(str(folder), dtype=torch.float32).eval()
    input_ids = torch.tensor([ids])
    kwargs = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                  mm_token_type_ids=(input_ids == config.video_token_id).int() * 2,
                  pixel_values_videos=hf_video_patches(config, video),
                  video_grid_thw=torch.tensor([list(layout.grid_thw)]))
    if config.model_type == "qwen2_5_vl":
        kwargs["second_per_grid_ts"] = torch.tensor([2 / fps])
    with torch.no_grad():
        out = hf.generate(**kwargs, max_new_tokens=MAX_TOKENS, do_sample=False)
    return builder.decoder.decode(out[0, len(ids):].tolist()), len(ids)


def video_clip() -> bytes:
    return make_clip(6, 96, 64, fps=FPS, seed=2)


def ask(server, url: str, text: str, stream: bool = False, **extra):
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                             {"type": "text", "text": text}]}]
    model = oai.models.list().data[0].id
    reply = oai.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS,
                                        temperature=0, stream=stream, extra_body=extra or None)
    if stream:
        return "".join(c.choices[0].delta.content or "" for c in reply if c.choices), None
    return reply.choices[0].message.content, reply.usage.prompt_tokens




def assert_data_url_matches_transformers(folder, server, clip: bytes) -> None:
    frames = decoded_frames(clip)
    indices = sample_indices(len(frames), FPS, 32)
    want, num_prompt = reference(folder, [frames[i] for i in indices], FPS, "What happens?")
    text, prompt_tokens = ask(server, data_url(clip), "What happens?")
    assert (text, prompt_tokens) == (want, num_prompt)
    assert ask(server, data_url(clip), "What happens?", stream=True)[0] == want
