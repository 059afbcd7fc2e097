import json

import pytest

from flatserve.soak.config import SoakConfig
from flatserve.soak.images import ImagePool
from flatserve.soak.load import StreamFailure, _check_chunk, build_body, plan_request


def test_plans_are_deterministic_and_follow_the_shares():
    config = SoakConfig(requests=2000, disconnect_share=0.25, text_only_share=0.1,
                        images_per_request=3)
    plans = [plan_request(config, i) for i in range(2000)]
    assert plans == [plan_request(config, i) for i in range(2000)]
    disconnect = sum(p.disconnect for p in plans) / len(plans)
    text_only = sum(p.num_images == 0 for p in plans) / len(plans)
    assert disconnect == pytest.approx(0.25, abs=0.04)
    assert text_only == pytest.approx(0.1, abs=0.03)
    assert {p.num_images for p in plans} == {0, 3}
    assert all(1 <= p.disconnect_after_chunks <= 3 for p in plans)


def test_body_carries_data_url_images():
    config = SoakConfig(images_per_request=2, text_only_share=0.0, max_tokens=7,
                        extra_body={"temperature": 0})
    plan = plan_request(config, 3)
    body = json.loads(build_body(config, "m", ImagePool(32, count=2), plan))
    assert body["model"] == "m" and body["max_tokens"] == 7 and body["stream"] is True
    assert body["temperature"] == 0
    parts = body["messages"][0]["content"]
    images = [p["image_url"]["url"] for p in parts if p["type"] == "image_url"]
    assert len(images) == 2 and images[0] != images[1]
    assert all(u.startswith(("data:image/jpeg;base64,", "data:image/png;base64,"))
               for u in images)


def test_text_only_body():
    config = SoakConfig(text_only_share=1.0)
    body = json.loads(build_body(config, "m", ImagePool(16, count=2), plan_request(config, 0)))
    assert isinstance(body["messages"][0]["content"], str)


def test_sse_chunk_checks():
    _check_chunk('{"choices": []}')
    for bad, kind in [("nope", "malformed SSE"), ("[1]", "malformed SSE"),
                      ('{"id": 1}', "malformed SSE"),
                      ('{"error": {"message": "boom"}}', "stream error")]:
        with pytest.raises(StreamFailure) as err:
            _check_chunk(bad)
        assert err.value.kind == kind
