"""vllm:iteration_tokens_total as the engine counts it (engine_proc/iteration_tokens.py):
one observation per step that gave tokens, of its new tokens plus the uncached prompt of each
request whose first token it was; in the buckets vLLM uses."""

from __future__ import annotations

from bisect import bisect_left

from shared.messages import ITERATION_TOKENS_BUCKETS, AddRequest
from shared.sampling_params import SamplingParams
from tests.engine_proc.engine_factory import make_engine

MAX_TOKENS = 5


def request(rid: str, ids: list[int]) -> AddRequest:
    return AddRequest(rid, ids, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                               ignore_eos=True))


def observed(engine) -> dict[int, int]:
    """{bucket index: steps counted in it} of the engine's stats."""
    counts = engine.stats().iteration_tokens_counts
    return {i: n for i, n in enumerate(counts) if n}


def bucket(num_tokens: int) -> int:
    return bisect_left(ITERATION_TOKENS_BUCKETS, num_tokens)


def test_a_chunked_prompt_counts_whole_at_its_first_token_and_a_cached_prefix_not(
        tiny_model_path):
    engine = make_engine(tiny_model_path, max_num_batched_tokens=16, block_size=4,
                         enable_prefix_caching=True)
    prompt = list(range(40, 63))  # 23 tokens: chunks of 16 and 7
    engine.generate([request("a", prompt)])
    # the chunk of 16 gave no token: not a step vLLM counts; the next gave the first token
    assert observed(engine) == {bucket(1): MAX_TOKENS - 1, bucket(23 + 1): 1}
    engine.generate([request("b", prompt)])  # its first 20 tokens are cached
    stats = engine.stats()
    assert stats.prefix_cache_hits == 20
    assert observed(engine) == {bucket(1): 2 * (MAX_TOKENS - 1), bucket(3 + 1): 1,
                                bucket(23 + 1): 1}
    # vLLM's identity: prompt tokens, less those cached, plus generated tokens
    assert stats.iteration_tokens_sum == 2 * 23 - 20 + 2 * MAX_TOKENS


def test_a_step_counts_the_tokens_of_all_its_requests(tiny_model_path):
    engine = make_engine(tiny_model_path, enable_prefix_caching=False)
    engine.generate([request("a", list(range(40, 50))), request("b", list(range(60, 80)))])
    assert observed(engine) == {bucket(10 + 20 + 2): 1, bucket(2): MAX_TOKENS - 1}
    assert engine.stats().iteration_tokens_sum == 10 + 20 + 2 * MAX_TOKENS
