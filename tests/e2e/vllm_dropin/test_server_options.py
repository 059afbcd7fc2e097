"""vLLM's server options (issue 31, themes 7 and 1): --uds, the VLLM_API_KEY environment
variable as the API key, --return-tokens-as-token-ids, --max-logprobs -1 (the whole
vocabulary); one server started with all four."""

from __future__ import annotations

import os
import time

import httpx
import openai
import pytest

from tests.e2e.server_process import ServerProcess
from tests.e2e.vllm_dropin.conftest import MODEL

KEY = "sk-from-the-environment"


@pytest.fixture(scope="module")
def uds_server(tmp_path_factory, tiny_model_path):
    folder = tmp_path_factory.mktemp("uds")
    socket_path = str(folder / "api.sock")
    proc = ServerProcess("--uds", socket_path, "--return-tokens-as-token-ids",
                         "--max-logprobs", "-1",
                         log_path=folder / "server.log", env={**os.environ, "VLLM_API_KEY": KEY})
    client = httpx.Client(transport=httpx.HTTPTransport(uds=socket_path),
                          base_url="http://localhost", timeout=60)
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server did not start:\n{proc.log_tail()}")
            try:
                if client.get("/health").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        yield client
    finally:
        client.close()
        proc.stop()


def test_served_on_the_socket_with_the_key_from_the_environment(uds_server):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "logprobs": True}
    assert uds_server.post("/v1/chat/completions", json=chat).status_code == 401
    oai = openai.OpenAI(base_url="http://localhost/v1", api_key=KEY, max_retries=0,
                        http_client=uds_server)
    reply = oai.chat.completions.create(**chat)
    # --return-tokens-as-token-ids: the server's default; a request may turn it off
    assert all(e.token.startswith("token_id:") for e in reply.choices[0].logprobs.content)
    plain = oai.chat.completions.create(**chat, extra_body={"return_tokens_as_token_ids": False})
    assert not any(e.token.startswith("token_id:") for e in plain.choices[0].logprobs.content)


def test_the_whole_vocabulary_of_log_probabilities(uds_server, tiny_model_path):
    from shared.model_config import load_model_config

    vocab = load_model_config(tiny_model_path).text.vocab_size
    oai = openai.OpenAI(base_url="http://localhost/v1", api_key=KEY, max_retries=0,
                        http_client=uds_server)
    reply = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
        logprobs=True, top_logprobs=-1, temperature=0,
        extra_body={"return_tokens_as_token_ids": False})
    for entry in reply.choices[0].logprobs.content:
        assert len(entry.top_logprobs) == vocab
        assert entry.top_logprobs[0].token == entry.token  # greedy: its token is the top one
    text = oai.completions.create(model=MODEL, prompt="Hi", max_tokens=1, logprobs=-1)
    assert len(text.choices[0].logprobs.top_logprobs[0]) >= vocab - 64  # texts may collide
