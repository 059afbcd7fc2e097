"""The requests of a run, planned from the seed and encoded to JSON bytes before any is sent,
so that neither prompt building nor image encoding runs while latency is measured."""

from __future__ import annotations

import json
import random
import sys
from dataclasses import dataclass

from flatserve.bench.config import BenchConfig
from flatserve.soak.images import ImagePool

# Short common words: most tokenizers give one token to each (with its leading space).
WORDS = tuple("""
the of and to in is it you that he was for on are as with his they at be this have from or
one had by word but not what all were we when your can said there use an each which she do
how their if will up other about out many then them these so some her would make like him
into time has look two more write go see number no way could people my than first water
been call who oil its now find long down day did get come made may part over new sound take
only little work know place year live me back give most very after thing our just name good
man think say great where help through much before line right too mean old any same tell
boy follow came want show also around form three small set put end does another well large
must big even such because turn here why ask went men read need land different home us move
try kind hand picture again change off play spell air away animal house point page letter
""".split())


@dataclass(frozen=True)
class RequestPlan:
    index: int
    prompt_len: int  # words
    output_len: int  # max_tokens
    num_images: int


def draw_length(rng: random.Random, length: int, ratio: float) -> int:
    """Uniform in [length*(1-ratio), length*(1+ratio)], at least 1 (vLLM's random-range-ratio)."""
    low, high = max(1, int(length * (1 - ratio))), max(1, int(length * (1 + ratio)))
    return rng.randint(low, high)


def plan_request(config: BenchConfig, index: int) -> RequestPlan:
    """What request `index` sends; a function of the seed and the index only."""
    rng = random.Random(config.seed * 1_000_003 + index)
    with_images = rng.random() < config.image_probability
    return RequestPlan(
        index=index,
        prompt_len=draw_length(rng, config.prompt_len, config.prompt_len_range),
        output_len=draw_length(rng, config.output_len, config.output_len_range),
        num_images=config.images_per_request if with_images else 0,
    )


def prompt_text(seed: int, index: int, num_words: int) -> str:
    rng = random.Random(f"{seed}/{index}")
    return " ".join(rng.choices(WORDS, k=num_words))


def build_body(config: BenchConfig, model: str, plan: RequestPlan, pool: ImagePool | None) -> bytes:
    if plan.num_images == 0:
        content: str | list = prompt_text(config.seed, plan.index, plan.prompt_len)
    else:
        assert pool is not None
        k = plan.num_images
        # a distinct image per request and slot: no cache on the server can help
        content = [{"type": "image_url",
                    "image_url": {"url": pool.variant(plan.index * k + j).data_url()}}
                   for j in range(k)]
        content.append({"type": "text", "text": f"Request {plan.index}: describe the image."})
    body = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": plan.output_len,
        "temperature": config.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
        **({"ignore_eos": True} if config.ignore_eos else {}),
        **(config.extra_body or {}),
    }
    return json.dumps(body).encode()


def build_bodies(config: BenchConfig, model: str, indices: range) -> list[bytes]:
    """The JSON bodies of requests `indices`, with a progress bar (images take a while)."""
    from tqdm import tqdm

    plans = [plan_request(config, i) for i in indices]
    pool = ImagePool(config.image_size, seed=config.seed) if any(p.num_images for p in plans) \
        else None
    bar = tqdm(plans, desc="building requests", unit="req", file=sys.stderr,
               disable=not config.progress, dynamic_ncols=True)
    return [build_body(config, model, plan, pool) for plan in bar]
