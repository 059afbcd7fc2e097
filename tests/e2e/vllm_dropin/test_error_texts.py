"""Error texts that vLLM's clients and tests match, through the official openai client
(issue 31, theme 9): seed bounds in pydantic's words, out-of-vocabulary ids named with the
vocabulary size, an empty prompt."""

from __future__ import annotations

import openai
import pytest

from shared.model_config import load_model_config
from tests.e2e.vllm_dropin.conftest import MODEL

LONG_MIN, LONG_MAX = -2**63, 2**63 - 1  # vLLM's seed bounds (a torch.long)


def refusal(oai, **kwargs) -> dict:
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=MODEL, max_tokens=2, **kwargs)
    return e.value.body


@pytest.mark.parametrize("seed, says", [
    (LONG_MAX + 1, f"Input should be less than or equal to {LONG_MAX} [type=less_than_equal]"),
    (LONG_MIN - 1,
     f"Input should be greater than or equal to {LONG_MIN} [type=greater_than_equal]"),
])
def test_seed_out_of_range_in_pydantics_words(oai, seed, says):
    body = refusal(oai, prompt="Hello", seed=seed)
    assert body["message"] == f"seed: {says}" and body["param"] == "seed"


def test_seeds_in_vllms_range_are_taken_negative_ones_too(oai):
    args = dict(model=MODEL, prompt="Hello", max_tokens=4, temperature=1.0)
    for seed in (LONG_MIN, -1, LONG_MAX):
        first = oai.completions.create(seed=seed, **args).choices[0].text
        assert oai.completions.create(seed=seed, **args).choices[0].text == first


def test_out_of_vocabulary_ids_are_named_with_the_vocabulary_size(oai, tiny_model_path):
    vocab = load_model_config(tiny_model_path).text.vocab_size
    body = refusal(oai, prompt=[1, 999999])
    assert body["message"] == f"Token id 999999 is out of vocabulary (vocabulary size {vocab})"
    body = refusal(oai, prompt="Hello", logit_bias={"5": 1, str(vocab): 2, "999999": -1})
    assert body["param"] == "logit_bias"
    assert f"out-of-vocab token ids [{vocab}, 999999]" in body["message"]
    assert f"vocabulary size is {vocab}" in body["message"]
    with pytest.raises(openai.BadRequestError, match="999999"):
        oai.chat.completions.create(model=MODEL, max_tokens=2, logit_bias={"999999": 5},
                                    messages=[{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("prompt", ["", [], [[]]])
def test_an_empty_prompt_is_refused_in_vllms_words(oai, prompt):
    assert "decoder prompt cannot be empty" in refusal(oai, prompt=prompt)["message"]
