"""The requests of a run, planned from the seed and encoded to JSON bytes before any is sent,
so that neither prompt building nor image encoding runs while latency is measured.

A run is a list of units, each a list of bodies sent one after another: one request per unit,
or in the multi-turn workload one conversation of `turns` requests, each turn re-sending the
conversation's image and everything said before (flatserve/soak/conversation.py)."""

from __future__ import annotations

import json
import random
import sys
from dataclasses import dataclass

from flatserve.bench.config import BenchConfig
from flatserve.soak.conversation import conversation_messages, words
from flatserve.soak.images import ImagePool
from flatserve.soak.videos import VideoPool


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
    return words(f"{seed}/{index}", num_words)


def _body(config: BenchConfig, model: str, messages: list[dict], max_tokens: int) -> bytes:
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": config.temperature,
        "stream": True,
        "stream_options": {"include_usage": True,
                           **({"continuous_usage_stats": True} if config.token_usage else {})},
        **({"ignore_eos": True} if config.ignore_eos else {}),
        **(config.extra_body or {}),
    }
    return json.dumps(body).encode()


def _variant(config: BenchConfig, slot: int) -> int:
    return slot % config.distinct_images if config.distinct_images else slot


def build_body(config: BenchConfig, model: str, plan: RequestPlan,
               pool: ImagePool | VideoPool | None) -> bytes:
    if plan.num_images == 0:
        content: str | list = prompt_text(config.seed, plan.index, plan.prompt_len)
    else:
        assert pool is not None
        k = plan.num_images
        kind = "video" if isinstance(pool, VideoPool) else "image"
        # a distinct image (or clip) per request and slot, so that no cache on the server can
        # help, unless --distinct-images bounds the set
        content = [{"type": f"{kind}_url",
                    f"{kind}_url": {"url": pool.variant(_variant(config, plan.index * k + j))
                                    .data_url()}}
                   for j in range(k)]
        content.append({"type": "text", "text": f"Request {plan.index}: describe the {kind}."})
    return _body(config, model, [{"role": "user", "content": content}], plan.output_len)


def build_conversation(config: BenchConfig, model: str, unit: int, pool: ImagePool) -> list[bytes]:
    """The bodies of conversation `unit`, turn by turn: a distinct image per conversation,
    re-sent with the whole history at every turn."""
    turns = config.turns
    plans = [plan_request(config, unit * turns + t) for t in range(turns)]
    k = config.images_per_request
    urls = [pool.variant(_variant(config, unit * k + j)).data_url() for j in range(k)]
    bodies = []
    for t, plan in enumerate(plans):
        messages = conversation_messages(
            urls, t,
            user_text=lambda s: prompt_text(config.seed, plans[s].index, plans[s].prompt_len),
            reply_text=lambda s: words(f"{config.seed}/{unit}/reply/{s}", plans[s].output_len))
        bodies.append(_body(config, model, messages, plan.output_len))
    return bodies


def build_units(config: BenchConfig, model: str, units: range) -> list[list[bytes]]:
    """The JSON bodies of units `units`, with a progress bar (images take a while)."""
    from tqdm import tqdm

    multi_turn = config.workload == "multi-turn"
    plans = [] if multi_turn else [plan_request(config, i) for i in units]
    needs_images = multi_turn or any(p.num_images for p in plans)
    pool = ImagePool(config.image_size, seed=config.seed) if needs_images else None
    if config.workload == "video":
        pool = VideoPool(config.image_size, config.video_frames, seed=config.seed)
    bar = tqdm(units, desc="building requests", unit="unit", file=sys.stderr,
               disable=not config.progress, dynamic_ncols=True)
    if multi_turn:
        return [build_conversation(config, model, u, pool) for u in bar]
    return [[build_body(config, model, plan, pool)] for plan, _ in zip(plans, bar, strict=True)]
