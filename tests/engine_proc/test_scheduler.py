import itertools
import random

import numpy as np
import pytest

from engine_proc.scheduler import RequestRejected, Scheduler
from engine_proc.sequence import ImageSpan, Sequence, SequenceStatus
from shared.sampling_params import SamplingParams

EOS = 2
TOKEN = 7  # what the fake model always samples


def make_scheduler(**kw) -> Scheduler:
    args = dict(
        num_kv_blocks=64,
        block_size=4,
        max_num_seqs=8,
        max_num_batched_tokens=32,
        max_model_len=256,
        max_waiting=100,
        eos_token_ids=(EOS,),
    )
    args.update(kw)
    return Scheduler(**args)


_PROMPT_TOKEN_IDS = itertools.count(100)


def make_seq(num_tokens=10, max_tokens=4, images=(), prompt=None, **sampling) -> Sequence:
    """A sequence whose prompt (unless given) shares no block with any other's."""
    spans = [ImageSpan(np.zeros((28, 28, 3), np.uint8), (1, 2, 2), off, n) for off, n in images]
    return Sequence(
        f"r{random.random()}",
        [next(_PROMPT_TOKEN_IDS)] * num_tokens if prompt is None else prompt,
        SamplingParams(max_tokens=max_tokens, **sampling),
        spans,
    )


def sampled_count(batch) -> int:
    return sum(
        s.num_computed_tokens + n == s.num_tokens
        for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True)
    )


def step(sched: Scheduler, token: int = TOKEN):
    batch = sched.schedule()
    assert batch.num_tokens <= sched.max_num_batched_tokens
    assert batch.num_seqs <= sched.max_num_seqs
    assert len({s.seq_id for s in batch.seqs}) == batch.num_seqs
    for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
        assert n >= 1
        # the cache holds a slot for every token this step writes
        assert len(seq.block_table) * sched.block_manager.block_size >= seq.num_computed_tokens + n
    if (image := batch.encoder_stage) is not None:  # what the model runner does
        assert image.embeds is None and not any(
            image.offset < s.num_computed_tokens + n and image.end > s.num_computed_tokens
            for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True)
            if any(i is image for i in s.images)
        ), "a chunk reaches an image still being encoded"
        image.pixels = None
        image.stages_done += 1
        if image.stages_done == sched.num_encoder_stages:
            image.hidden, image.embeds = None, np.zeros((image.length, 4))
        else:
            image.hidden = np.zeros(4)
    out = sched.postprocess(batch, [token] * sampled_count(batch))
    return batch, out


def run_all(sched: Scheduler, max_steps: int = 10_000) -> int:
    steps = 0
    while not sched.is_finished():
        batch, _ = step(sched)
        assert batch, "nothing scheduled while requests are unfinished (deadlock)"
        held = {b for s in sched.running for b in s.block_table}
        assert len(held) + sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
        steps += 1
        assert steps < max_steps
    return steps


def test_prefill_then_decode_until_max_tokens():
    sched = make_scheduler()
    seq = make_seq(10, max_tokens=3)
    sched.add(seq)
    batch, out = step(sched)
    assert batch.num_new_tokens == [10] and batch.num_decode_seqs == 0 and out == [seq]
    batch, out = step(sched)
    assert batch.num_new_tokens == [1] and batch.all_decode
    step(sched)
    assert seq.is_finished and seq.finish_reason == "length"
    assert seq.completion_token_ids == [TOKEN] * 3
    assert sched.block_manager.num_free_blocks == 64 and seq.block_table == []


def test_new_requests_join_running_ones_between_steps():
    sched = make_scheduler()
    a = make_seq(10, max_tokens=10)
    sched.add(a)
    step(sched)
    b = make_seq(6, max_tokens=10)
    sched.add(b)
    batch, _ = step(sched)
    assert batch.seqs == [a, b] and batch.num_new_tokens == [1, 6] and batch.num_decode_seqs == 1


def test_chunked_prefill_respects_budget_and_decodes_go_first():
    sched = make_scheduler(max_num_batched_tokens=8)
    a = make_seq(20, max_tokens=5)
    b = make_seq(3, max_tokens=5)
    sched.add(a)
    sched.add(b)
    chunks = []
    while a.num_computed_tokens < 20:
        batch, _ = step(sched)
        chunks.append(list(zip([s is a for s in batch.seqs], batch.num_new_tokens, strict=True)))
    assert chunks[0] == [(True, 8)]
    assert chunks[1] == [(True, 8)]
    assert chunks[2] == [(True, 4), (False, 3)]  # b joins with the budget a left
    batch, _ = step(sched)
    assert batch.num_new_tokens == [1, 1] and batch.all_decode


def test_max_num_seqs_bounds_the_running_set():
    sched = make_scheduler(max_num_seqs=2, max_num_batched_tokens=64)
    seqs = [make_seq(4, max_tokens=3) for _ in range(5)]
    for s in seqs:
        sched.add(s)
    batch, _ = step(sched)
    assert batch.num_seqs == 2 and sched.num_waiting == 3
    run_all(sched)
    assert all(s.finish_reason == "length" for s in seqs)


def test_stop_conditions():
    sched = make_scheduler()
    eos = make_seq(4, max_tokens=10)
    ignore = make_seq(4, max_tokens=3, ignore_eos=True)
    stop_id = make_seq(4, max_tokens=10, stop_token_ids=(9,))
    for s in (eos, ignore, stop_id):
        sched.add(s)
    step(sched, token=EOS)
    assert eos.finish_reason == "stop" and eos.completion_token_ids == [EOS]
    assert not ignore.is_finished
    step(sched, token=9)
    assert stop_id.finish_reason == "stop"
    step(sched, token=EOS)
    assert ignore.finish_reason == "length" and ignore.completion_token_ids == [EOS, 9, EOS]


def test_max_model_len_ends_a_request():
    sched = make_scheduler(max_model_len=12)
    seq = make_seq(10, max_tokens=100)
    sched.add(seq)
    run_all(sched)
    assert seq.finish_reason == "length" and seq.num_tokens == 12


def test_rejections_are_clear():
    sched = make_scheduler(max_model_len=16, num_kv_blocks=4, max_waiting=2)
    with pytest.raises(RequestRejected, match="max_model_len"):
        sched.add(make_seq(16))
    sched = make_scheduler(num_kv_blocks=4, max_waiting=2)
    with pytest.raises(RequestRejected, match="KV cache blocks"):
        sched.add(make_seq(10, max_tokens=20))  # could outgrow the whole cache
    sched.add(make_seq(4))
    sched.add(make_seq(4))
    with pytest.raises(RequestRejected, match="queue is full"):
        sched.add(make_seq(4))


def test_preemption_recomputes_text_sequences_and_never_deadlocks():
    sched = make_scheduler(num_kv_blocks=10, block_size=4, max_num_batched_tokens=16)
    seqs = [make_seq(6, max_tokens=20) for _ in range(4)]  # each needs 7 blocks at its end
    for s in seqs:
        sched.add(s)
    run_all(sched)
    assert sched.num_preemptions > 0
    assert all(s.finish_reason == "length" and s.completion_token_ids == [TOKEN] * 20 for s in seqs)
    assert sched.block_manager.num_free_blocks == 10


def test_image_sequences_reserve_their_blocks_and_are_never_preempted():
    sched = make_scheduler(num_kv_blocks=12, block_size=4, max_num_batched_tokens=16)
    img = make_seq(10, max_tokens=20, images=[(2, 4)])
    texts = [make_seq(6, max_tokens=12) for _ in range(3)]
    sched.add(img)
    for s in texts:
        sched.add(s)
    step(sched)
    assert len(img.block_table) == sched.block_manager.num_blocks_for(10 + 20 - 1)
    run_all(sched)
    assert img.num_preemptions == 0 and sched.num_preemptions > 0
    assert img.completion_token_ids == [TOKEN] * 20
    assert all(s.completion_token_ids == [TOKEN] * 12 for s in texts)


def test_random_workload_invariants():
    rng = random.Random(0)
    sched = make_scheduler(
        num_kv_blocks=24, block_size=4, max_num_batched_tokens=12, max_num_seqs=5
    )
    seqs = []
    for _ in range(200):
        if rng.random() < 0.3:
            n = rng.randint(1, 30)
            images = [(1, min(4, n - 1))] if n > 5 and rng.random() < 0.5 else []
            seq = make_seq(n, max_tokens=rng.randint(1, 40), images=images)
            try:
                sched.add(seq)
                seqs.append(seq)
            except RequestRejected:
                pass
        if rng.random() < 0.05 and sched.running:
            sched.finish(rng.choice(sched.running), "abort")
        if not sched.is_finished():
            batch, _ = step(sched)
            assert batch
    run_all(sched)
    assert all(s.is_finished for s in seqs)
    assert sched.block_manager.num_free_blocks == 24
    for s in seqs:
        if s.finish_reason == "length":
            assert s.num_completion_tokens == s.sampling.max_tokens


def test_images_are_released_after_the_chunk_covering_their_last_token():
    sched = make_scheduler(max_num_batched_tokens=8)
    seq = make_seq(20, images=[(3, 4), (9, 8)])
    first, second = seq.images
    sched.add(seq)
    step(sched)  # tokens 0..7: covers all of the first image, part of the second
    assert first.released and not second.released
    step(sched)  # 8..15: the second image ends at 17
    assert not second.released
    step(sched)
    assert second.released and seq.mm_bytes == 0


def test_finish_frees_blocks_and_images_of_waiting_and_running():
    sched = make_scheduler(max_num_seqs=1)
    a = make_seq(10, images=[(2, 4)])
    b = make_seq(10, images=[(2, 4)])
    sched.add(a)
    sched.add(b)
    step(sched)
    sched.finish(a, "abort")
    sched.finish(b, "abort")
    assert a.status == b.status == SequenceStatus.FINISHED
    assert a.images[0].released and b.images[0].released
    assert sched.is_finished() and sched.block_manager.num_free_blocks == 64


def test_encoder_budget_spreads_a_burst_of_images_over_steps():
    # each image: grid (1, 2, 2) = 4 patches, 1 placeholder token; budget 8 patches a step
    sched = make_scheduler(max_num_batched_tokens=64, max_num_encoder_patches=8)
    seqs = [make_seq(10, images=[(2, 1), (6, 1)]) for _ in range(3)]
    for seq in seqs:
        sched.add(seq)
    batch, _ = step(sched)
    # the first sequence's two images fill the budget; the others prefill up to theirs
    assert batch.seqs == seqs and batch.num_new_tokens == [10, 2, 2]
    batch, _ = step(sched)
    assert batch.seqs == seqs[:2] and batch.num_new_tokens == [1, 8]
    batch, _ = step(sched)
    # decodes always run beside the vision work
    assert batch.seqs == seqs and batch.num_new_tokens == [1, 1, 8]
    assert batch.num_decode_seqs == 2


def test_encoder_budget_cuts_a_chunk_before_the_image_it_cannot_encode():
    sched = make_scheduler(max_num_batched_tokens=64, max_num_encoder_patches=4)
    seq = make_seq(12, images=[(2, 1), (8, 1)])
    sched.add(seq)
    batch, _ = step(sched)
    assert batch.num_new_tokens == [8]  # up to the second image's placeholder
    batch, _ = step(sched)
    assert batch.num_new_tokens == [4]
    assert run_all(sched) >= 1 and seq.is_finished


def test_an_image_larger_than_the_encoder_budget_runs_alone():
    sched = make_scheduler(max_num_batched_tokens=64, max_num_encoder_patches=2)
    big = [make_seq(6, images=[(1, 1)]) for _ in range(2)]
    for seq in big:
        sched.add(seq)
    batch, _ = step(sched)
    assert batch.seqs == big and batch.num_new_tokens == [6, 1]
    batch, _ = step(sched)
    assert batch.seqs == big and batch.num_new_tokens == [1, 5]
    run_all(sched)
    assert all(seq.is_finished for seq in big)


def test_an_image_over_the_budget_is_encoded_in_stages_ahead_of_its_chunk():
    # 4-patch images, a 2-patch budget, a tower in 2 stages
    sched = make_scheduler(max_num_batched_tokens=64, max_num_encoder_patches=2,
                           num_encoder_stages=2)
    a, b = make_seq(6, images=[(1, 1)]), make_seq(6, images=[(1, 1)])
    sched.add(a)
    sched.add(b)
    batch, _ = step(sched)  # both prefill up to their image; a's first stage runs
    assert batch.num_new_tokens == [1, 1] and batch.encoder_stage is a.images[0]
    assert a.images[0].pixels is None and a.images[0].hidden is not None
    batch, _ = step(sched)  # a's last stage, alone: no chunk may reach the image yet
    assert not batch.seqs and batch.encoder_stage is a.images[0]
    assert a.images[0].embeds is not None
    batch, _ = step(sched)  # a consumes its embeddings; b's first stage
    assert batch.seqs == [a] and batch.num_new_tokens == [5]
    assert batch.encoder_stage is b.images[0] and a.images[0].released
    batch, _ = step(sched)  # a decodes beside b's last stage
    assert batch.seqs == [a] and batch.num_new_tokens == [1]
    assert batch.encoder_stage is b.images[0]
    run_all(sched)
    assert a.is_finished and b.is_finished and b.images[0].released


def test_an_image_under_the_stage_threshold_is_encoded_whole_one_per_step():
    # 4-patch images over a 2-patch budget, a tower in 2 stages, stages only over 4 patches:
    # each image is encoded whole, alone in its step, in arrival order, beside the decodes
    sched = make_scheduler(max_num_batched_tokens=64, max_num_encoder_patches=2,
                           encoder_stage_patches=4, num_encoder_stages=2)
    a, b = make_seq(6, images=[(1, 1)]), make_seq(6, images=[(1, 1)])
    sched.add(a)
    sched.add(b)
    batch, _ = step(sched)  # a whole, b up to its image
    assert batch.num_new_tokens == [6, 1] and batch.encoder_stage is None
    assert a.images[0].released
    batch, _ = step(sched)  # a decodes; b's image whole
    assert batch.seqs == [a, b] and batch.num_new_tokens == [1, 5]
    assert batch.encoder_stage is None and b.images[0].released
    over = make_seq(6, images=[(1, 1)])
    sched.encoder_stage_patches = 3
    sched.add(over)
    step(sched)
    assert over.images[0].hidden is not None  # over the threshold: its first stage ran


def test_finishing_a_request_mid_stages_frees_its_image_and_moves_on():
    sched = make_scheduler(max_num_batched_tokens=64, max_num_encoder_patches=2,
                           num_encoder_stages=3)
    a, b = make_seq(6, images=[(1, 1)]), make_seq(6, images=[(1, 1)])
    sched.add(a)
    sched.add(b)
    step(sched)
    assert a.images[0].hidden is not None
    sched.finish(a, "abort")
    assert a.images[0].released
    batch, _ = step(sched)
    assert batch.encoder_stage is b.images[0]
    run_all(sched)
    assert b.is_finished


# ---- prefix caching -----------------------------------------------------------------------


def image_seq(prompt: list[int], offset: int, length: int, key: bytes = b"k", **kw) -> Sequence:
    pixels = np.zeros((28, 28, 3), np.uint8)
    images = [ImageSpan(pixels, (1, 2, 2), offset, length, key)]
    return Sequence(f"r{random.random()}", prompt, SamplingParams(**kw), images)


def test_admission_starts_after_the_cached_prefix_and_counts_it():
    sched = make_scheduler(block_size=4)
    a = make_seq(10, max_tokens=1)
    sched.add(a)
    run_all(sched)
    b = make_seq(prompt=a.token_ids[:9] + [1, 1, 1], max_tokens=1)
    sched.add(b)
    batch, _ = step(sched)
    assert batch.num_new_tokens == [4]  # tokens 8..11: the first two blocks were cached
    assert sched.num_prefix_cache_queries == 10 + 12 and sched.num_prefix_cache_hits == 8
    run_all(sched)
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_an_image_wholly_in_the_cached_prefix_is_released_at_admission():
    sched = make_scheduler(block_size=4)
    prompt = list(range(100, 112))
    first = image_seq(prompt, 2, 4, max_tokens=1)
    sched.add(first)
    run_all(sched)
    again = image_seq(prompt + [1, 2], 2, 4, max_tokens=1)
    sched.add(again)
    batch, _ = step(sched)
    assert again.images[0].released and batch.num_new_tokens == [2]


def test_an_image_the_cached_prefix_ends_inside_is_encoded_whole_even_in_stages():
    # the image covers tokens 2..9; the first request computed and cached blocks 0 and 1
    # (tokens 0..7) before it was aborted
    sched = make_scheduler(block_size=4, max_num_batched_tokens=8, max_num_encoder_patches=2,
                           num_encoder_stages=2)
    prompt = list(range(100, 116))
    first = image_seq(prompt, 2, 8)
    sched.add(first)
    while first.num_computed_tokens < 8:
        step(sched)
    sched.finish(first, "abort")
    second = image_seq(prompt, 2, 8)
    sched.add(second)
    batch, _ = step(sched)  # admitted at token 8 with no chunk: its image's first stage runs
    assert second.num_computed_tokens == 8 and second in sched.running
    assert not batch.seqs and batch.encoder_stage is second.images[0]
    batch, _ = step(sched)
    assert not batch.seqs and batch.encoder_stage is second.images[0]
    batch, _ = step(sched)  # the embeddings' rows 6..7 go into the chunk
    assert batch.seqs == [second] and batch.num_new_tokens == [8]
    assert second.images[0].released
    run_all(sched)
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_an_image_the_cached_prefix_ends_inside_is_charged_to_the_encoder_budget():
    sched = make_scheduler(block_size=4, max_num_batched_tokens=32, max_num_encoder_patches=4)
    prompt = list(range(100, 116))
    # the same image at the same place, then other tokens from token 10: blocks 0 and 1
    # (tokens 0..7, the image's rows 0..5) are shared
    first = image_seq(prompt[:10] + [1] * 6, 2, 8, max_tokens=1)
    sched.add(first)
    run_all(sched)
    other = image_seq(list(range(200, 216)), 2, 8)
    second = image_seq(prompt, 2, 8)
    sched.add(other)
    sched.add(second)
    batch, _ = step(sched)  # other's image takes the whole budget: second waits
    assert batch.seqs == [other] and second in sched.waiting
    batch, _ = step(sched)
    assert batch.seqs == [other, second] and batch.num_new_tokens == [1, 8]
    assert second.num_computed_tokens == 8 + 8
    run_all(sched)
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_random_workload_with_shared_prefixes_keeps_block_accounting():
    rng = random.Random(1)
    sched = make_scheduler(num_kv_blocks=24, block_size=4, max_num_batched_tokens=12,
                           max_num_seqs=5)
    stems = [list(range(1000 * i, 1000 * i + 30)) for i in range(3)]
    seqs = []
    for _ in range(300):
        if rng.random() < 0.3:
            n = rng.randint(1, 30)
            prompt = rng.choice(stems)[:n] + [rng.randint(1, 5) for _ in range(rng.randint(0, 3))]
            if len(prompt) > 8 and rng.random() < 0.5:
                seq = image_seq(prompt, 3, 4, max_tokens=rng.randint(1, 30))
            else:
                seq = make_seq(prompt=prompt, max_tokens=rng.randint(1, 30))
            try:
                sched.add(seq)
                seqs.append(seq)
            except RequestRejected:
                pass
        if rng.random() < 0.05 and sched.running:
            sched.finish(rng.choice(sched.running), "abort")
        if not sched.is_finished():
            batch, _ = step(sched)
            assert batch
        bm = sched.block_manager
        holders = [0] * bm.num_blocks
        for s in sched.running:
            for b in s.block_table:
                holders[b] += 1
        assert holders == bm.ref_counts
        assert all((b in bm.free_block_ids) == (n == 0) for b, n in enumerate(holders))
    run_all(sched)
    assert all(s.is_finished for s in seqs)
    assert sched.num_prefix_cache_hits > 0
    assert sched.block_manager.num_free_blocks == 24 and not any(sched.block_manager.ref_counts)


# ---- decode share ---------------------------------------------------------------------------


def test_decodes_get_steps_of_their_own_for_a_share_of_a_vision_step():
    # a 2-stage tower; `b` decodes while `a`'s image is encoded
    sched = make_scheduler(max_num_batched_tokens=64, max_num_encoder_patches=2,
                           num_encoder_stages=2, decode_share=0.1)
    b = make_seq(6, max_tokens=20)
    sched.add(b)
    step(sched)  # b's prefill
    a = make_seq(6, images=[(1, 1)])
    sched.add(a)
    batch, _ = step(sched)  # a's first vision stage, b decodes beside it
    assert batch.ran_vision and batch.seqs == [b, a]
    sched.decode_share.account(batch, 0.200)  # 20 ms owed to the decodes
    kinds = []
    for _ in range(5):
        batch, _ = step(sched)
        kinds.append("decode" if not batch.ran_vision else "vision")
        sched.decode_share.account(batch, 0.008 if not batch.ran_vision else 0.200)
        if batch.ran_vision:
            break
    # 3 decode-only steps (20 ms at ~8 ms each, the last one starting with 4 ms owed), then
    # the vision work goes on
    assert kinds == ["decode", "decode", "decode", "vision"]
    assert a.images[0].embeds is not None


def test_decode_only_steps_neither_admit_nor_prefill():
    sched = make_scheduler(max_num_batched_tokens=64, decode_share=0.5)
    b = make_seq(6, max_tokens=20)
    sched.add(b)
    step(sched)
    sched.decode_share.owed_s = 1.0
    waiting = make_seq(6)
    sched.add(waiting)
    batch, _ = step(sched)
    assert batch.seqs == [b] and batch.all_decode and waiting.status == SequenceStatus.WAITING


def test_no_decode_share_and_no_decodes_leave_the_steps_alone():
    sched = make_scheduler(max_num_batched_tokens=64, decode_share=0.0)
    b = make_seq(6, max_tokens=20)
    sched.add(b)
    step(sched)
    sched.decode_share.account(type(step(sched)[0])(ran_vision=True), 1.0)
    waiting = make_seq(6)
    sched.add(waiting)
    batch, _ = step(sched)
    assert waiting in batch.seqs  # share 0: nothing is owed
    # nothing to decode: the owed time does not hold the queue back
    sched = make_scheduler(max_num_batched_tokens=64, decode_share=0.5)
    sched.decode_share.owed_s = 1.0
    first = make_seq(6)
    sched.add(first)
    batch, _ = step(sched)
    assert batch.seqs == [first]


def test_time_owed_to_decodes_lapses_when_none_were_running():
    # owed by a vision step while the only sequence was still prefilling: the steps after
    # it are not held back later, when a decode appears without any vision work
    sched = make_scheduler(max_num_batched_tokens=4, max_num_seqs=4, decode_share=0.5)
    seq = make_seq(10, max_tokens=20)
    sched.add(seq)
    batch, _ = step(sched)
    sched.decode_share.account(type(batch)(ran_vision=True), 1.0)  # owed 0.5 s
    batch, _ = step(sched)  # a prefill chunk: nothing decodes, so nothing is owed
    sched.decode_share.account(batch, 0.01)
    assert sched.decode_share.owed_s == 0.0
    waiting = make_seq(6)
    sched.add(waiting)
    step(sched)  # seq's last chunk
    batch, _ = step(sched)
    assert waiting in batch.seqs  # admitted beside the decode, not held back
