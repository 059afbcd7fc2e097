"""Decode graphs (engine_proc/cuda_graphs.py): capture sizes and buckets, the static buffers'
copy-in and padding, and capture/replay against direct eager calls on the unpadded steps,
through a stand-in decoder that has what a model's decode step has: a KV cache written by
slot and read through block tables, positions, and a recurrent state per slot. On a CPU the
eager stand-in replays; the `gpu` cases capture real CUDA graphs."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from engine_proc.context import Context
from engine_proc.cuda_graphs import (
    MAX_CAPTURE_SIZE,
    DecodeBuffers,
    DecodeGraphs,
    DecodePadding,
    StaticDecodeInputs,
    bucket_for,
    capture_sizes,
    default_capture_sizes,
)
from engine_proc.layers.attention import Attention, build_attention_metadata
from tests.tolerance import tolerance

HEADS, KV_HEADS, DIM, BLOCK, VOCAB = 4, 2, 32, 16, 50
NUM_BLOCKS, MAX_BLOCKS, NUM_SLOTS = 40, 8, 12
PAD = DecodePadding.reserved_block(NUM_BLOCKS - 1, BLOCK, state_slot=NUM_SLOTS - 1)


# ---- sizes and buckets ---------------------------------------------------------------------


def test_default_sizes_are_vllms_up_to_the_cap():
    sizes = default_capture_sizes(MAX_CAPTURE_SIZE)
    assert sizes == [1, 2, 4, *range(8, 256, 8), *range(256, 513, 16)]
    assert default_capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert default_capture_sizes(100)[-3:] == [88, 96, 100]  # every batch up to it has one
    assert default_capture_sizes(3) == [1, 2, 3]


@pytest.mark.parametrize("max_num_seqs, sizes, max_size, expected", [
    (64, (), None, (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)),
    (1024, (), None, tuple(default_capture_sizes(512))),  # capped at 512
    (1024, (), 300, (*default_capture_sizes(288), 300)),
    (128, (8, 1, 4, 200), None, (1, 4, 8)),  # given sizes, none above max_num_seqs
    (128, (8, 1, 4, 64), 4, (1, 4)),
    (2, (), None, (1, 2)),
])
def test_capture_sizes(max_num_seqs, sizes, max_size, expected):
    assert capture_sizes(max_num_seqs, sizes, max_size) == expected


@pytest.mark.parametrize("num_seqs, bucket", [(1, 1), (3, 4), (4, 4), (5, 8), (9, 16), (64, 64),
                                              (65, None), (0, None)])
def test_a_batch_runs_in_the_smallest_size_that_holds_it(num_seqs, bucket):
    assert bucket_for(num_seqs, capture_sizes(64)) == bucket


# ---- static buffers ---------------------------------------------------------------------


@dataclass
class Step:
    """A decode-only step's host inputs, as StepInputs carries them."""

    input_ids: np.ndarray
    positions: np.ndarray
    seq_lens: np.ndarray
    slot_mapping: np.ndarray
    block_tables: np.ndarray
    state_slots: np.ndarray | None


def test_copy_in_pads_each_step_to_its_bucket():
    inputs = StaticDecodeInputs(8, MAX_BLOCKS, PAD, state_slots=True, device=torch.device("cpu"))
    step = Step(np.array([5, 6, 7]), np.broadcast_to(np.array([20, 3, 40]), (3, 3)),
                np.array([21, 4, 41], dtype=np.int32), np.array([101, 33, 200]),
                np.array([[6, 0, 3], [2, -1, -1], [12, 13, 11]], dtype=np.int32),
                np.array([0, 3, 2]))
    buffers = inputs.load(step, 4)
    assert buffers.input_ids.tolist() == [5, 6, 7, 0]
    assert buffers.positions.tolist() == [[20, 3, 40, 0]] * 3
    assert buffers.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert buffers.seq_lens.tolist() == [21, 4, 41, 1]
    assert buffers.slot_mapping.tolist() == [101, 33, 200, PAD.slot]
    assert buffers.block_tables[:3, :3].tolist() == step.block_tables.tolist()
    assert buffers.block_tables[3, 0] == PAD.block
    assert buffers.state_slots.tolist() == [0, 3, 2, PAD.state_slot]
    assert buffers.block_tables.shape == (4, MAX_BLOCKS)
    # views of the buffers the graph reads, not copies
    assert buffers.input_ids.data_ptr() == inputs.buffers.input_ids.data_ptr()

    # a smaller step: the rows the last one used beyond it are padding now
    small = Step(np.array([9]), np.full((3, 1), 7), np.array([8], dtype=np.int32),
                 np.array([77]), np.array([[4]], dtype=np.int32), np.array([5]))
    buffers = inputs.load(small, 2)
    assert buffers.input_ids.tolist() == [9, 0] and buffers.seq_lens.tolist() == [8, 1]
    assert buffers.slot_mapping.tolist() == [77, PAD.slot]
    assert buffers.state_slots.tolist() == [5, PAD.state_slot]
    assert buffers.block_tables[:, 0].tolist() == [4, PAD.block]


def test_models_without_recurrent_state_have_no_state_buffer():
    padding = DecodePadding.reserved_block(3, BLOCK)
    inputs = StaticDecodeInputs(2, 4, padding, state_slots=False, device=torch.device("cpu"))
    step = Step(np.array([1]), np.zeros((3, 1), dtype=np.int64), np.array([2], dtype=np.int32),
                np.array([17]), np.array([[1]], dtype=np.int32), None)
    buffers = inputs.load(step, 2)
    assert buffers.state_slots is None and buffers.slot_mapping.tolist() == [17, 3 * BLOCK]
    with pytest.raises(ValueError, match="a state slot of their own"):
        StaticDecodeInputs(2, 4, padding, state_slots=True, device=torch.device("cpu"))


def test_copy_in_refuses_what_does_not_fit():
    inputs = StaticDecodeInputs(4, 2, PAD, state_slots=False, device=torch.device("cpu"))
    one = Step(np.array([1]), np.zeros((3, 1), dtype=np.int64), np.array([1], dtype=np.int32),
               np.array([0]), np.zeros((1, 3), dtype=np.int32), None)
    with pytest.raises(ValueError, match="block tables of 3 blocks"):
        inputs.load(one, 1)
    one.block_tables = one.block_tables[:, :2]
    with pytest.raises(ValueError, match="do not fit a bucket"):
        inputs.load(one, 8)
    one.state_slots = np.array([0])
    with pytest.raises(ValueError, match="state slots"):
        inputs.load(one, 1)


# ---- capture and replay against direct calls ----------------------------------------------


class TinyDecoder:
    """What a decoder's decode step does to the engine's state: token and position inputs,
    one attention layer that writes its KV cache by slot and reads it through block tables
    (attention.py's path, or the Triton kernel), and a recurrent state advanced in place by
    slot (a hybrid's)."""

    def __init__(self, device: torch.device, triton_attention: bool = False) -> None:
        gen = torch.Generator().manual_seed(0)
        self.q_table = torch.randn(VOCAB, HEADS, DIM, generator=gen).to(device)
        self.kv_table = torch.randn(VOCAB, 2, KV_HEADS, DIM, generator=gen).to(device)
        self.layer = Attention(HEADS, KV_HEADS, DIM)
        self.layer.k_cache = torch.zeros(NUM_BLOCKS, BLOCK, KV_HEADS, DIM, device=device)
        self.layer.v_cache = torch.zeros(NUM_BLOCKS, BLOCK, KV_HEADS, DIM, device=device)
        self.state = torch.zeros(NUM_SLOTS, HEADS * DIM, device=device)
        self.triton_attention = triton_attention

    def __call__(self, ctx: Context, input_ids: torch.Tensor,
                 positions: torch.Tensor) -> torch.Tensor:
        n = input_ids.shape[0]
        q = self.q_table[input_ids] * (1 + positions[1, :, None, None] / 64)
        k, v = self.kv_table[input_ids].unbind(1)
        if self.triton_attention:
            from engine_proc.layers.paged_decode_attention_triton import paged_decode_attention

            layer = self.layer
            for cache, new in ((layer.k_cache, k), (layer.v_cache, v)):
                cache.view(-1, KV_HEADS * DIM).index_copy_(0, ctx.slot_mapping, new.reshape(n, -1))
            out = paged_decode_attention(q, layer.k_cache, layer.v_cache, ctx.block_tables,
                                         ctx.seq_lens, layer.scale).view(n, -1)
        else:
            meta = build_attention_metadata(ctx, n, BLOCK, q.dtype)
            out = self.layer(q, k, v, meta)
        slots = ctx.state_slots
        self.state.index_copy_(0, slots, self.state.index_select(0, slots) * 0.5 + out)
        return out + self.state.index_select(0, slots)

    def graph_forward(self, buffers: DecodeBuffers) -> torch.Tensor:
        """The step as the runner would record it: the Context made of the buffers, the
        longest sequence the tables can hold as max_seq_len (a host int the graph keeps)."""
        size = buffers.input_ids.shape[0]
        ctx = Context(buffers.query_start_loc, buffers.seq_lens, buffers.slot_mapping,
                      buffers.block_tables, max_q_len=1, max_seq_len=MAX_BLOCKS * BLOCK,
                      all_decode=True, num_decodes=size, state_slots=buffers.state_slots)
        return self(ctx, buffers.input_ids, buffers.positions)

    def direct(self, step: Step) -> torch.Tensor:
        """The same step called eagerly on its own (unpadded) tensors."""
        device = self.state.device
        n = len(step.input_ids)

        def t(a):
            return torch.from_numpy(np.ascontiguousarray(a)).to(device)

        ctx = Context(torch.arange(n + 1, dtype=torch.int32, device=device), t(step.seq_lens),
                      t(step.slot_mapping), t(step.block_tables), max_q_len=1,
                      max_seq_len=int(step.seq_lens.max()), all_decode=True, num_decodes=n,
                      state_slots=t(step.state_slots))
        return self(ctx, t(step.input_ids), t(step.positions))


class Sequences:
    """Sequences growing by a token per decode, each with blocks and a state slot of its own
    (the padding's block and slot are never handed out)."""

    def __init__(self, num: int, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)
        free = [b for b in range(NUM_BLOCKS) if b != PAD.block]
        self.rng.shuffle(free)
        self.free = free
        self.lens = self.rng.integers(0, 3 * BLOCK, num).tolist()
        self.tables = [[self.free.pop() for _ in range(-(-n // BLOCK))] for n in self.lens]
        self.slots = [s for s in range(NUM_SLOTS) if s != PAD.state_slot][:num]

    def step(self, which: list[int]) -> Step:
        pos = [self.lens[i] for i in which]
        for i, p in zip(which, pos, strict=True):
            if p == len(self.tables[i]) * BLOCK:
                self.tables[i].append(self.free.pop())
            self.lens[i] += 1
        width = max(len(self.tables[i]) for i in which)
        tables = np.full((len(which), width), -1, dtype=np.int32)
        for row, i in enumerate(which):
            tables[row, : len(self.tables[i])] = self.tables[i]
        pos = np.array(pos)
        return Step(
            input_ids=self.rng.integers(0, VOCAB, len(which)),
            positions=np.broadcast_to(pos + 3, (3, len(which))),
            seq_lens=(pos + 1).astype(np.int32),
            slot_mapping=np.array([self.tables[i][p // BLOCK] * BLOCK + p % BLOCK
                                   for i, p in zip(which, pos.tolist(), strict=True)]),
            block_tables=tables,
            state_slots=np.array([self.slots[i] for i in which]),
        )


def replay_against_direct_calls(device: torch.device, use_graphs: bool,
                                triton_attention: bool = False) -> DecodeGraphs:
    """Steps of several batch sizes, some at a bucket's size, most padded, replayed by one
    decoder and called directly by a copy of it; outputs, caches and states compared."""
    replayed = TinyDecoder(device, triton_attention)
    direct = copy.deepcopy(replayed)
    graphs = DecodeGraphs([1, 2, 4, 8], MAX_BLOCKS, PAD, state_slots=True, device=device,
                          use_graphs=use_graphs)
    graphs.capture(replayed.graph_forward)
    # capture ran the forward on padding only: it wrote the padding's block and slot, no other
    for cache in ("k_cache", "v_cache"):
        written = getattr(replayed.layer, cache).flatten(1).abs().sum(1).nonzero().flatten()
        assert written.tolist() in ([], [PAD.block])
    assert not replayed.state[: NUM_SLOTS - 1].any()
    seqs = Sequences(8)
    bound = tolerance(torch.float32, DIM + 2 * MAX_BLOCKS * BLOCK, scale=1.0)
    for which in ([0, 1, 2], [3], [7, 6, 5, 4, 3, 2, 1, 0], [4, 0], [1, 2, 3, 5, 6], [6, 5]):
        step = seqs.step(which)
        got = graphs.replay(step)
        want = direct.direct(step)
        assert got.shape == (len(which), HEADS * DIM)
        torch.testing.assert_close(got, want, **bound)
    keep = [b for b in range(NUM_BLOCKS) if b != PAD.block]
    for cache in ("k_cache", "v_cache"):
        assert torch.equal(getattr(replayed.layer, cache)[keep], getattr(direct.layer, cache)[keep])
    torch.testing.assert_close(replayed.state[: NUM_SLOTS - 1], direct.state[: NUM_SLOTS - 1],
                               **bound)
    return graphs


def test_the_eager_stand_in_matches_direct_calls():
    graphs = replay_against_direct_calls(torch.device("cpu"), use_graphs=False)
    assert not graphs.graphs and graphs.capture_bytes == 0


def test_replay_needs_a_capture_and_a_bucket():
    graphs = DecodeGraphs([1, 2], MAX_BLOCKS, PAD, state_slots=True, device="cpu")
    step = Sequences(3).step([0, 1, 2])
    with pytest.raises(RuntimeError, match="before capture"):
        graphs.replay(step)
    graphs.capture(TinyDecoder(torch.device("cpu")).graph_forward)
    with pytest.raises(ValueError, match="a step of 3 sequences has no graph"):
        graphs.replay(step)
    with pytest.raises(ValueError, match="need a CUDA device"):
        DecodeGraphs([1], MAX_BLOCKS, PAD, state_slots=False, device="cpu", use_graphs=True)


@pytest.mark.gpu
@pytest.mark.parametrize("triton_attention", [False, True])
def test_cuda_graphs_match_direct_calls(triton_attention):
    if triton_attention:
        pytest.importorskip("triton")
    graphs = replay_against_direct_calls(torch.device("cuda"), use_graphs=True,
                                         triton_attention=triton_attention)
    assert sorted(graphs.graphs) == [1, 2, 4, 8] and graphs.capture_bytes >= 0


@pytest.mark.gpu
def test_the_eager_stand_in_on_a_gpu():
    replay_against_direct_calls(torch.device("cuda"), use_graphs=False)


@pytest.mark.parametrize("preset", ["TINY", "TINY_QWEN3_5", "TINY_QWEN3_VL_MOE"])
def test_an_engine_decoding_through_the_graph_path_gives_its_eager_tokens(monkeypatch, preset):
    _graph_path_tokens(monkeypatch, preset, "cpu", stand_in=True)


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["TINY", "TINY_QWEN3_5"])
def test_an_engine_replaying_cuda_graphs_gives_its_eager_tokens(monkeypatch, preset):
    _graph_path_tokens(monkeypatch, preset, "cuda", stand_in=False)


def _graph_path_tokens(monkeypatch, preset: str, device: str, stand_in: bool) -> None:
    """The runner's graph path end to end (on a CPU the eager stand-in replays): decode-only
    steps go through the static buffers padded to their bucket (5 sequences run in the 8
    graph, the padding rows in the reserved KV block and state slot); prefills, mixed steps
    and prefix-cache state copies run eagerly. Greedy tokens are the eager engine's, across
    two waves whose second reuses the first's blocks and slots."""
    import shared.random_checkpoints as checkpoints
    from engine_proc.cuda_graphs import DecodeGraphs as Graphs
    from shared.model_config import load_model_config
    from tests.engine_proc.engine_factory import make_engine
    from tests.engine_proc.test_engine import make_request

    replays = []
    replay = Graphs.replay
    monkeypatch.setattr(Graphs, "replay",
                        lambda self, inputs: replays.append(len(inputs.input_ids))
                        or replay(self, inputs))
    path = checkpoints.ensure_checkpoint(getattr(checkpoints, preset))
    config = load_model_config(path)
    prompts = [[30], [4, (2, 2), 9], [70], [12], [41]]

    engines = []

    def run(**kw) -> list[dict]:
        engine = make_engine(path, max_num_seqs=8, device=device, **kw)
        engines.append(engine)
        return [engine.generate([make_request(config, f"r{i}", p, wave, max_tokens=12)
                                 for i, p in enumerate(prompts)]) for wave in range(2)]

    eager = run()
    assert not replays
    graphs = run(enforce_eager=False, cudagraph_capture_sizes=(1, 2, 4, 8),
                 graph_stand_in=stand_in)
    assert graphs == eager
    assert 5 in replays and max(replays) <= 8
    # /metrics' counts: every replay, and the eager forwards beside them
    eager_stats, graph_stats = (engine.stats() for engine in engines)
    assert eager_stats.num_graph_steps == 0 and eager_stats.num_forward_steps > 0
    assert graph_stats.num_graph_steps == len(replays) < graph_stats.num_forward_steps
