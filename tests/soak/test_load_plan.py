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


def test_multi_turn_plans_and_bodies_resend_the_conversation():
    config = SoakConfig(turns=3, images_per_request=1, text_only_share=0.3, requests=300)
    plans = [plan_request(config, i) for i in range(300)]
    assert [(p.conversation, p.turn) for p in plans[:4]] == [(0, 0), (0, 1), (0, 2), (1, 0)]
    for c in range(100):  # images are drawn per conversation
        assert len({p.num_images for p in plans[3 * c:3 * c + 3]}) == 1
    pool = ImagePool(16, count=2)
    c = next(p.conversation for p in plans if p.num_images)
    bodies = [json.loads(build_body(config, "m", pool, plans[3 * c + t])) for t in range(3)]
    assert [len(b["messages"]) for b in bodies] == [1, 3, 5]
    assert bodies[2]["messages"][:3] == bodies[1]["messages"]
    other = next(p for p in plans if p.num_images and p.conversation != c)
    url = bodies[0]["messages"][0]["content"][0]["image_url"]["url"]
    assert url == bodies[2]["messages"][0]["content"][0]["image_url"]["url"]
    assert url != json.loads(build_body(config, "m", pool, other))["messages"][0]["content"][0][
        "image_url"]["url"]
    # one turn per conversation is the plain soak: the same plans as ever
    single = SoakConfig(text_only_share=0.3, requests=10)
    assert [plan_request(single, i).turn for i in range(10)] == [0] * 10


def test_a_conversation_s_turns_go_one_after_another(monkeypatch):
    import asyncio

    from flatserve.soak.load import LoadGenerator

    events: list[tuple[str, int, int]] = []

    async def send(self, client, plan, body):
        events.append(("start", plan.conversation, plan.turn))
        await asyncio.sleep(0.002 * (3 - plan.turn))
        events.append(("end", plan.conversation, plan.turn))
        return "ok"

    monkeypatch.setattr(LoadGenerator, "_send", send)
    config = SoakConfig(turns=3, requests=14, concurrency=3, text_only_share=1.0)
    stats = asyncio.run(LoadGenerator(config, "http://127.0.0.1:1", "m",
                                      ImagePool(16, count=2)).run())
    assert stats.ok == 14
    ended: set[tuple[int, int]] = set()
    for kind, c, t in events:
        if kind == "start" and t:
            assert (c, t - 1) in ended  # turn t waits for turn t - 1's answer
        if kind == "end":
            ended.add((c, t))
    assert sorted(ended) == [(c, t) for c in range(5) for t in range(3)][:14]
