"""Prompt log-probabilities from the engine (vLLM's prompt_logprobs): every prompt token
after the first is scored from the logits of the row before it, during prefill. They equal
transformers' log-softmax on the same weights, whatever the chunking, they skip a cached
prefix (which would leave rows uncomputed), and they come once, with the first token."""

import numpy as np
import pytest
import torch

from engine_proc.scheduler import MAX_PROMPT_LOGPROB_ROWS
from shared.messages import AddRequest
from shared.model_config import load_model_config
from shared.sampling_params import SamplingParams
from tests.engine_proc.engine_factory import make_engine
from tests.tolerance import decoder_terms, logprob_limit

pytestmark = pytest.mark.numeric

PROMPT = list(range(100, 140))


def run(engine, requests):
    outputs: dict[str, list] = {r.request_id: [] for r in requests}
    for r in requests:
        engine.add_request(r)
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id].append(out)
    return outputs


def prompt_entries(outputs) -> list:
    sent = [o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None]
    assert len(sent) == 1 and outputs[0].prompt_logprobs is sent[0]  # once, with the first
    return sent[0]


@pytest.fixture(scope="module")
def reference(tiny_model_path):
    from transformers import AutoModelForImageTextToText

    hf = AutoModelForImageTextToText.from_pretrained(str(tiny_model_path), dtype=torch.float32)
    with torch.no_grad():
        logits = hf(input_ids=torch.tensor([PROMPT])).logits[0].float()
    terms = decoder_terms(load_model_config(tiny_model_path).text, len(PROMPT))
    return torch.log_softmax(logits, dim=-1), logprob_limit(logits, terms)


@pytest.mark.parametrize("chunk", [512, 9])  # the whole prompt in one step, or in five
def test_prompt_logprobs_equal_transformers(tiny_model_path, reference, chunk):
    engine = make_engine(tiny_model_path, max_num_batched_tokens=chunk)
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3)
    entries = prompt_entries(run(engine, [AddRequest("p", PROMPT, params)])["p"])
    assert len(entries) == len(PROMPT) - 1
    logprobs, limit = reference
    for j, (lp, rank, ids, values) in enumerate(entries, start=1):
        row = logprobs[j - 1]
        assert lp == pytest.approx(row[PROMPT[j]].item(), abs=limit, rel=0)
        assert rank == int((row > row[PROMPT[j]]).sum()) + 1
        top = row.topk(3)
        assert ids == top.indices.tolist()
        np.testing.assert_allclose(values, top.values.tolist(), atol=limit, rtol=0)


def test_a_cached_prefix_is_computed_again_for_them(tiny_model_path):
    engine = make_engine(tiny_model_path, enable_prefix_caching=True)
    plain = SamplingParams(max_tokens=1, temperature=0.0)
    run(engine, [AddRequest("warm", PROMPT, plain)])  # its blocks are cached now
    hits = engine.scheduler.num_prefix_cache_hits
    wants = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    entries = prompt_entries(run(engine, [AddRequest("p", PROMPT, wants)])["p"])
    assert len(entries) == len(PROMPT) - 1 and all(ids == [] for _, _, ids, _ in entries)
    assert engine.scheduler.num_prefix_cache_hits == hits
    again = run(engine, [AddRequest("again", PROMPT, plain)])["again"]
    assert again[0].prompt_logprobs is None
    assert engine.scheduler.num_prefix_cache_hits > hits  # the others still hit


def test_prompt_rows_per_step_are_capped(tiny_model_path):
    engine = make_engine(tiny_model_path, max_num_batched_tokens=2048, max_model_len=2048,
                         num_kv_blocks=512)
    prompt = [100 + i % 500 for i in range(MAX_PROMPT_LOGPROB_ROWS + 100)]
    engine.add_request(AddRequest("p", prompt, SamplingParams(max_tokens=1, prompt_logprobs=0)))
    batch = engine.scheduler.schedule()
    assert batch.num_new_tokens == [MAX_PROMPT_LOGPROB_ROWS]
