"""The engine process behind a real socket, driven by the API's engine client: no frame of the
I/O thread or the busy loop keeps an image after the prefill that consumed it (R1, R3),
aborts free everything, and a bad request fails alone with a typed error."""

from __future__ import annotations

import asyncio
import threading
import weakref

import numpy as np
import pytest

from api_proc.engine_client import EngineClient
from api_proc.errors import BadRequest
from engine_proc.engine_process import EngineProcess
from rpc.sockets import IpcDir
from shared.engine_config import EngineConfig
from shared.messages import AddRequest, ImageInput
from shared.model_config import load_model_config
from shared.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    with IpcDir() as ipc:
        config = EngineConfig(model=str(tiny_model_path), address=ipc.address("engine"),
                              kv_cache_memory_bytes=32 << 20, max_num_seqs=8)
        process = EngineProcess(config)
        arrived: list[weakref.ref] = []
        add_request = process.engine.add_request

        def observe(request: AddRequest) -> None:
            arrived.extend(weakref.ref(image.pixels) for image in request.images)
            add_request(request)

        process.engine.add_request = observe
        thread = threading.Thread(target=process.run, daemon=True)
        thread.start()
        yield process, arrived
        process.stop()
        thread.join(timeout=10)


async def _client(process: EngineProcess) -> EngineClient:
    client = EngineClient.connect([process.config.address])
    await client.start()
    return client


def _image_request(cfg, request_id: str, side: int, max_tokens: int) -> AddRequest:
    grid = (1, side // cfg.vision.patch_size, side // cfg.vision.patch_size)
    pixels = np.random.default_rng(0).integers(0, 256, (side, side, 3), dtype=np.uint8)
    n = grid[1] * grid[2] // cfg.vision.spatial_merge_size**2
    ids = [11, 12, cfg.vision_start_token_id] + [cfg.image_token_id] * n + [cfg.vision_end_token_id, 13]
    return AddRequest(request_id, ids, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                          ignore_eos=True), [ImageInput(pixels, grid)])


@pytest.mark.usefixtures("no_garbage_collector")
def test_images_are_gone_once_decoding(engine, tiny_model_path):
    process, arrived = engine
    cfg = load_model_config(tiny_model_path)

    async def run():
        client = await _client(process)
        streams = [client.submit(_image_request(cfg, f"r{i}", 112 + 28 * i, 40))
                   for i in range(4)]
        firsts = [await s.__anext__() for s in streams]
        for _ in range(3):  # a few decode steps later, every prefill has run
            for s in streams:
                await s.__anext__()
        alive = [ref for ref in arrived if ref() is not None]  # refcounting alone (gc is off)
        stats = client.engines[0].stats  # came with the last step
        rest = []
        for s in streams:
            rest.append([o async for o in s])
        await client.close()
        return firsts, alive, stats, rest

    firsts, alive, stats, rest = asyncio.run(run())
    assert len(arrived) == 4
    assert alive == [], "an image outlived the prefill that consumed it"
    assert stats.mm_bytes_held == 0 and stats.num_running == 4
    assert all(r[-1].finish_reason == "length" for r in rest)
    assert all(f.num_prompt_tokens > 0 for f in firsts)


def test_cancelled_stream_aborts_and_frees_everything(engine, tiny_model_path):
    process, _ = engine
    cfg = load_model_config(tiny_model_path)

    async def run():
        client = await _client(process)
        stream = client.submit(_image_request(cfg, "gone", 224, 10_000))
        await stream.__anext__()
        await stream.aclose()
        for _ in range(100):
            await asyncio.sleep(0.05)
            stats = client.engines[0].stats  # pings bring it every 0.2 s
            if stats.num_running == 0:
                break
        await client.close()
        return stats

    stats = asyncio.run(run())
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.num_kv_blocks_free == stats.num_kv_blocks_total
    assert stats.mm_bytes_held == 0


def test_bad_request_fails_alone_with_a_typed_error(engine, tiny_model_path):
    process, _ = engine
    cfg = load_model_config(tiny_model_path)

    async def run():
        client = await _client(process)
        bad = AddRequest("bad", [cfg.image_token_id] * 3, SamplingParams(max_tokens=2))
        with pytest.raises(BadRequest) as err:
            [o async for o in client.submit(bad)]
        good = _image_request(cfg, "good", 56, 3)
        outs = [o async for o in client.submit(good)]
        await client.close()
        return err.value, outs

    err, outs = asyncio.run(run())
    assert "image" in str(err).lower() and err.code == "engine_rejected"
    assert sum(len(o.new_token_ids) for o in outs) == 3
