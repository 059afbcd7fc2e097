"""Mixed steps in pieces (engine_proc/piecewise_graphs.py): the sizes, and engines whose
steps with prompt chunks go through the pieces (static buffers padded to a bucket, cuts
running attention and Gated DeltaNet's state update on the step's own layout) against the
same engines eager, under staggered arrivals so that chunks and decodes share steps. On a
CPU the eager stand-in runs the pieces; the `gpu` cases replay real CUDA graphs."""

from __future__ import annotations

import pytest
import torch

from engine_proc.layers.eager_op import eager_op, recording
from engine_proc.piecewise_graphs import MAX_MIXED_SIZE, PiecewiseGraphs, mixed_capture_sizes


@pytest.mark.parametrize("tokens, max_size, expected", [
    (2048, MAX_MIXED_SIZE, (8, 16, *range(32, 513, 32))),
    (100, MAX_MIXED_SIZE, (8, 16, 32, 64, 96, 100)),  # every step up to the budget has one
    (2048, 40, (8, 16, 32, 40)),
    (12, MAX_MIXED_SIZE, (8, 12)),
    (5, MAX_MIXED_SIZE, (5,)),
])
def test_mixed_capture_sizes(tokens, max_size, expected):
    assert mixed_capture_sizes(tokens, max_size) == expected


def _graphs(sizes, deepstack: bool = False, device: str = "cpu") -> PiecewiseGraphs:
    return PiecewiseGraphs(sizes, hidden=4, dtype=torch.float32,
                           deepstack_width=4 if deepstack else 0, device=device)


def test_a_step_runs_in_the_smallest_size_that_holds_its_tokens():
    graphs = _graphs((8, 16, 32))
    assert [graphs.bucket(n) for n in (1, 8, 9, 32, 33, 0)] == [8, 8, 16, 32, None, None]


class _Layout:
    def __init__(self, scale: float) -> None:
        self.scale = scale


def _toy_forward(weight: torch.Tensor, layout: _Layout):
    """Two row-wise pieces around a cut whose op depends on the layout and on the rows it
    is given (a prefix sum over the step's tokens: padding rows would change it)."""
    def op(x, step_layout):
        return torch.cumsum(x, 0) * step_layout.scale

    def forward(embeds, positions, deepstack=None, capture_layout=None):
        x = embeds @ weight + positions[0, :, None]
        if deepstack is not None:
            x = x + deepstack
        y = eager_op(op, (x,), layout)
        return torch.tanh(y) + x
    return forward


def _step(n: int, seed: int, device: str = "cpu"):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, 4, generator=gen).to(device),
            torch.arange(10, 10 + n).repeat(3, 1).to(device),
            torch.randn(n, 4, generator=gen).to(device))


def _layout_for(size: int) -> _Layout:
    """A capture layout, built outside any capture: one built inside a graph would only be
    recorded, never run (its tensors' contents undefined at the capture-time ops)."""
    import engine_proc.layers.eager_op as hook

    assert hook._recorder is None
    return _Layout(float(size))


@pytest.mark.parametrize("deepstack", [False, True])
def test_the_pieces_run_the_cuts_on_the_steps_rows_and_layout(deepstack):
    weight = torch.randn(4, 4, generator=torch.Generator().manual_seed(0))
    graphs = _graphs((4, 8), deepstack)
    graphs.capture(_toy_forward(weight, _Layout(1.0)), _layout_for)
    assert sorted(graphs.layouts) == [4, 8]
    for n, scale, seed in ((5, 0.5, 1), (2, 2.0, 2), (8, 1.5, 3)):  # later steps smaller too
        embeds, positions, features = _step(n, seed)
        features = features if deepstack else None
        got = graphs.replay(embeds, positions, features, {_Layout: _Layout(scale)})
        assert got.shape == (n, 4)
        torch.testing.assert_close(got, _toy_forward(weight, _Layout(scale))(
            embeds, positions, features))
    if deepstack:  # a step without image rows: no DeepStack features (zeros), not stale ones
        embeds, positions, _ = _step(3, 4)
        got = graphs.replay(embeds, positions, None, {_Layout: _Layout(1.0)})
        torch.testing.assert_close(got, _toy_forward(weight, _Layout(1.0))(embeds, positions))
    # R3: after a small step, nothing of the larger ones before it stays in the buffers
    graphs.replay(*_step(2, 5)[:2], None, {_Layout: _Layout(1.0)})
    assert graphs.embeds[:2].any() and not graphs.embeds[2:].any()
    assert graphs.deepstack is None or not graphs.deepstack.any()


def test_eager_ops_run_directly_outside_a_capture_and_captures_do_not_nest():
    assert eager_op(lambda x, layout: x + layout, (torch.ones(2),), 1.0).tolist() == [2, 2]
    graphs = _graphs((4,))
    with recording(object()), pytest.raises(RuntimeError, match="already recording"):
        with recording(object()):
            pass
    with pytest.raises(RuntimeError, match="before capture"):
        graphs.replay(*_step(1, 0)[:2], None, {})
    graphs.capture(_toy_forward(torch.ones(4, 4), _Layout(1.0)), _layout_for)
    with pytest.raises(ValueError, match="run it eagerly"):
        graphs.replay(*_step(5, 0)[:2], None, {_Layout: _Layout(1.0)})
    with pytest.raises(ValueError, match="captured without them"):
        graphs.replay(*_step(3, 0), {_Layout: _Layout(1.0)})


@pytest.mark.gpu
def test_cuda_graph_pieces_match_direct_calls():
    weight = torch.randn(4, 4, generator=torch.Generator().manual_seed(0)).cuda()
    graphs = _graphs((4, 8), deepstack=True, device="cuda")
    graphs.capture(_toy_forward(weight, _Layout(1.0)), _layout_for)
    assert sorted(graphs.pieces) == [4, 8] and len(graphs.pieces[8].graphs) == 2
    for n, scale, seed in ((5, 0.5, 1), (2, 2.0, 2), (8, 1.5, 3)):
        embeds, positions, features = _step(n, seed, "cuda")
        got = graphs.replay(embeds, positions, features, {_Layout: _Layout(scale)}).clone()
        want = _toy_forward(weight, _Layout(scale))(embeds, positions, features)
        torch.testing.assert_close(got, want)


# ---- engines ------------------------------------------------------------------------------

PROMPTS = [[30], [5], [61], [4, (2, 2), 9], [12], [3, (2, 3)], [45], [20]]


@pytest.mark.parametrize("preset", ["TINY", "TINY_QWEN3_5", "TINY_QWEN3_VL_MOE"])  # DeepStack
@pytest.mark.parametrize("mode", ["full_and_piecewise", "piecewise"])
def test_an_engine_running_mixed_steps_in_pieces_gives_its_eager_tokens(monkeypatch, preset,
                                                                        mode):
    _pieces_tokens(monkeypatch, preset, mode, "cpu", stand_in=True)


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["TINY", "TINY_QWEN3_5", "TINY_QWEN3_VL"])  # DeepStack
def test_an_engine_replaying_mixed_step_pieces_gives_its_eager_tokens(monkeypatch, preset):
    _pieces_tokens(monkeypatch, preset, "full_and_piecewise", "cuda", stand_in=False)


def _pieces_tokens(monkeypatch, preset: str, mode: str, device: str, stand_in: bool) -> None:
    """Requests arrive one per step with prompts longer than a step's token budget, so
    most steps carry a chunk beside decodes (and prefix-cache state saves in the hybrid),
    two of them with images (their rows, and Qwen3-VL's DeepStack features, through the
    pieces' static buffers). Greedy tokens are the eager engine's, over two waves whose
    second reuses the first's blocks, slots and cached prefixes. Every step replays: no
    step is past the largest size."""
    import shared.random_checkpoints as checkpoints
    from shared.model_config import load_model_config
    from tests.engine_proc.engine_factory import make_engine
    from tests.engine_proc.test_engine import make_request

    replays = []
    replay = PiecewiseGraphs.replay
    monkeypatch.setattr(PiecewiseGraphs, "replay",
                        lambda self, embeds, *rest: replays.append(embeds.shape[0])
                        or replay(self, embeds, *rest))
    path = checkpoints.ensure_checkpoint(getattr(checkpoints, preset))
    config = load_model_config(path)
    engines = []

    def run(**kw) -> list[dict]:
        engine = make_engine(path, max_num_seqs=8, max_num_batched_tokens=24, device=device,
                             **kw)
        engines.append(engine)
        waves = []
        for wave in range(2):
            pending = [make_request(config, f"r{i}", p, wave, max_tokens=10)
                       for i, p in enumerate(PROMPTS)]
            results = {r.request_id: [] for r in pending}
            while pending or engine.has_unfinished_requests():
                if pending:
                    engine.add_request(pending.pop(0))
                for output in engine.step():
                    assert output.error is None, output.error
                    results[output.request_id].extend(output.new_token_ids)
            waves.append(results)
        return waves

    eager = run()
    assert not replays
    pieces = run(enforce_eager=False, cudagraph_mode=mode, cudagraph_capture_sizes=(1, 2, 4, 8),
                 graph_stand_in=stand_in)
    assert pieces == eager
    eager_stats, stats = (engine.stats() for engine in engines)
    assert eager_stats.num_piecewise_steps == 0
    assert stats.num_piecewise_steps == len(replays) > 10
    sizes = mixed_capture_sizes(24)
    assert max(replays) <= 24 and any(n not in sizes for n in replays)  # padded steps
    assert len({min(s for s in sizes if s >= n) for n in replays}) >= 2  # in several sizes
    assert stats.num_piecewise_steps + stats.num_graph_steps == stats.num_forward_steps
    if mode == "piecewise":
        assert stats.num_graph_steps == 0
    else:
        assert stats.num_graph_steps > 0
