"""The Triton paged decode attention kernel against its torch reference and against
attention.py's decode path, on random caches: GQA groups of 1 to 8 (7 included), the head
dims of the project's decoders (32, 48, 64, 128, 256; 80 as another that is not a power of
two), ragged lengths from 1 to many blocks.

Without a CUDA device the kernels run in Triton's interpreter on CPU tensors (numpy,
program by program: the cases here stay small); with one they run natively, and the `gpu`
cases add serving-sized batches and the 16-bit dtypes' wider shapes."""

from __future__ import annotations

import pytest
import torch

from engine_proc.context import Context
from engine_proc.layers.attention import Attention, build_attention_metadata
from engine_proc.layers.paged_decode_attention_ref import paged_decode_attention_ref
from tests.tolerance import rms, tolerance
from tests.triton_device import DEVICE, runs_triton

pytest.importorskip("triton")
from engine_proc.layers import paged_decode_attention_triton as triton_op  # noqa: E402

pytestmark = [pytest.mark.numeric, runs_triton]
BLOCK = 16


def bound(dtype: torch.dtype, head_dim: int, max_seq_len: int, reference: torch.Tensor):
    """float32: q.k sums head_dim terms, the softmax's sum and p.v up to max_seq_len (scores
    and values N(0, 1)). 16-bit: both sides sum in float32 and round the output once; the
    kernel also rounds each probability to the values' dtype before p.v (the error of a
    p-weighted mean of roundings is one rounding at the output's size)."""
    if dtype == torch.float32:
        return tolerance(torch.float32, head_dim + 2 * max_seq_len, scale=1.0)
    return tolerance(dtype, 1, depth=2, scale=rms(reference.float()))


def paged_case(heads, kv_heads, head_dim, seq_lens, dtype=torch.float32, seed=0):
    """Caches with each sequence's blocks scattered at random, spare blocks, and tables two
    columns wider than the longest sequence needs (-1 there); q a view of a wider tensor,
    as the model hands it over."""
    gen = torch.Generator().manual_seed(seed)
    widths = [-(-n // BLOCK) for n in seq_lens]
    num_blocks = sum(widths) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.full((len(seq_lens), max(widths) + 2), -1, dtype=torch.int32)
    for i, width in enumerate(widths):
        tables[i, :width] = torch.tensor([order.pop() for _ in range(width)])
    k_cache = torch.randn(num_blocks, BLOCK, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, BLOCK, kv_heads, head_dim, generator=gen)
    qkv = torch.randn(len(seq_lens), heads + 2 * kv_heads, head_dim, generator=gen)
    q = qkv.to(DEVICE, dtype)[:, :heads]  # scores q.k * head_dim^-0.5 ~ N(0, 1)
    return (q, k_cache.to(DEVICE, dtype), v_cache.to(DEVICE, dtype), tables.to(DEVICE),
            torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE))


SMALL = [  # (heads, kv heads, head_dim, dtype): the interpreter's cases
    (8, 2, 32, torch.float32),  # the tiny presets
    (8, 2, 48, torch.float32),  # tiny Qwen3-VL: a head dim that is not a power of two
    (4, 2, 64, torch.float32),  # tiny Qwen3.5
    (16, 2, 128, torch.float32),  # Qwen2.5-VL-3B: a group of 8
    (14, 2, 80, torch.float32),  # a group of 7 (Qwen2.5-VL-7B's), head_dim 80
    (8, 8, 32, torch.float32),  # no GQA
    (8, 2, 256, torch.float32),  # Qwen3.5-0.8B
    # 16-bit: float16, as Triton's interpreter (3.9) multiplies bfloat16 tiles as their raw
    # bits in tl.dot; the gpu cases run bfloat16
    (16, 2, 128, torch.float16),
]
SMALL_LENS = [1, 15, 16, 17, 40, 300]  # within a block, at its edges, 19 blocks


@pytest.mark.parametrize("heads, kv_heads, head_dim, dtype", SMALL)
def test_matches_the_reference(heads, kv_heads, head_dim, dtype):
    q, k_cache, v_cache, tables, lens = paged_case(heads, kv_heads, head_dim, SMALL_LENS, dtype,
                                                   seed=heads * 1000 + head_dim)
    got = triton_op.paged_decode_attention(q, k_cache, v_cache, tables, lens, head_dim**-0.5)
    want = paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, head_dim**-0.5)
    assert got.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, **bound(dtype, head_dim, max(SMALL_LENS), want))


@pytest.mark.parametrize("num_splits", [1, 3, 16])
def test_any_number_of_splits_gives_the_same_attention(num_splits):
    """One split (no merge to speak of), a count that is not a power of two (the merge's
    padded lanes), more splits than a short sequence fills; long sequences over many."""
    lens = [1, 33, 700]
    q, k_cache, v_cache, tables, seq_lens = paged_case(8, 2, 32, lens, seed=num_splits)
    got = triton_op.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 32**-0.5,
                                           num_splits=num_splits)
    want = paged_decode_attention_ref(q, k_cache, v_cache, tables, seq_lens, 32**-0.5)
    torch.testing.assert_close(got, want, **bound(torch.float32, 32, max(lens), want))


def test_reads_only_the_keys_of_each_sequence():
    """Rows past a sequence's length, blocks no table names, and -1 table entries past the
    last block may hold anything; a sequence of no keys gets zeros; out and workspace given."""
    q, k_cache, v_cache, tables, lens = paged_case(8, 2, 32, [20, 5, 0, 1])
    scale = 32**-0.5
    workspace = torch.empty(triton_op.workspace_shape(4, 8, 32), device=DEVICE)
    out = torch.empty(4, 8, 32, device=DEVICE)
    before = triton_op.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale,
                                              out=out, workspace=workspace).clone()
    named = set(tables[tables >= 0].tolist())
    for row, n in enumerate(lens.tolist()):
        if n % BLOCK:
            last = int(tables[row, n // BLOCK])
            k_cache[last, n % BLOCK:] = float("nan")
            v_cache[last, n % BLOCK:] = float("inf")
    for block in set(range(k_cache.shape[0])) - named:
        k_cache[block] = float("nan")
        v_cache[block] = float("nan")
    after = triton_op.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale,
                                             out=out, workspace=workspace)
    assert after is out and torch.equal(before, after) and torch.isfinite(after).all()
    assert not after[2].any()


def attention_layer_decode(heads, kv_heads, head_dim, lens, seed=0):
    """attention.py's decode path over caches that hold each sequence's first n - 1 keys: it
    writes the new token's key and value at its slot, then attends. Returns its output
    [num_seqs, heads, head_dim] and what the kernel needs to compute the same."""
    q, k_cache, v_cache, tables, seq_lens = paged_case(heads, kv_heads, head_dim, lens,
                                                       seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    k = torch.randn(len(lens), kv_heads, head_dim, generator=gen).to(DEVICE)
    v = torch.randn(len(lens), kv_heads, head_dim, generator=gen).to(DEVICE)
    slots = torch.tensor([int(tables[i, (n - 1) // BLOCK]) * BLOCK + (n - 1) % BLOCK
                          for i, n in enumerate(lens)], device=DEVICE)
    layer = Attention(heads, kv_heads, head_dim)
    layer.k_cache, layer.v_cache = k_cache, v_cache
    ctx = Context(
        query_start_loc=torch.arange(len(lens) + 1, dtype=torch.int32, device=DEVICE),
        seq_lens=seq_lens, slot_mapping=slots, block_tables=tables, max_q_len=1,
        max_seq_len=max(lens), all_decode=True, num_decodes=len(lens))
    meta = build_attention_metadata(ctx, len(lens), BLOCK, q.dtype)
    out = layer(q, k, v, meta).view(len(lens), heads, head_dim)
    return out, (q, layer.k_cache, layer.v_cache, tables, seq_lens, layer.scale)


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(8, 2, 32), (14, 2, 80), (4, 2, 64)])
def test_matches_the_attention_layers_decodes(heads, kv_heads, head_dim):
    """The same decodes through attention.py (its CPU kernel or gather + SDPA) and through
    the Triton kernel reading the cache the layer wrote."""
    lens = [1, 2, 16, 17, 90]
    want, args = attention_layer_decode(heads, kv_heads, head_dim, lens, seed=head_dim)
    got = triton_op.paged_decode_attention(*args)
    torch.testing.assert_close(got, want, **bound(torch.float32, head_dim, max(lens), want))


# ---- natively on a GPU: serving-sized batches, 16-bit dtypes, a CUDA graph -----------------


@pytest.mark.gpu
@pytest.mark.parametrize("heads, kv_heads, head_dim, dtype", [
    (16, 2, 128, torch.bfloat16),  # Qwen2.5-VL-3B
    (28, 4, 128, torch.bfloat16),  # Qwen2.5-VL-7B
    (8, 2, 256, torch.bfloat16),  # Qwen3.5-0.8B
    (14, 2, 80, torch.bfloat16),
    (8, 2, 48, torch.bfloat16),
    (16, 2, 128, torch.float16),
    (16, 2, 128, torch.float32),
])
def test_serving_batches_on_a_gpu(heads, kv_heads, head_dim, dtype):
    gen = torch.Generator().manual_seed(head_dim)
    lens = [1, 16, 17, 4000, *torch.randint(1, 2500, (60,), generator=gen).tolist()]
    q, k_cache, v_cache, tables, seq_lens = paged_case(heads, kv_heads, head_dim, lens, dtype)
    got = triton_op.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens,
                                           head_dim**-0.5)
    want = paged_decode_attention_ref(q, k_cache, v_cache, tables, seq_lens, head_dim**-0.5)
    torch.testing.assert_close(got, want, **bound(dtype, head_dim, max(lens), want))


@pytest.mark.gpu
def test_the_attention_layers_decodes_on_a_gpu():
    want, args = attention_layer_decode(16, 2, 128, [1, 31, 700, 2049], seed=3)
    got = triton_op.paged_decode_attention(*args)
    torch.testing.assert_close(got, want, **bound(torch.float32, 128, 2049, want))


@pytest.mark.gpu
def test_replays_in_a_cuda_graph_with_new_lengths():
    """Captured once; the lengths and tables change in place between replays."""
    q, k_cache, v_cache, tables, lens = paged_case(16, 2, 128, [5, 300, 1000, 64],
                                                   torch.bfloat16)
    static_lens, static_tables = lens.clone(), tables.clone()
    out = torch.empty_like(q)
    workspace = torch.empty(triton_op.workspace_shape(4, 16, 128), device=DEVICE)

    def run():
        triton_op.paged_decode_attention(q, k_cache, v_cache, static_tables, static_lens,
                                         128**-0.5, out=out, workspace=workspace)

    run()  # compiled outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    # rows swap tables and take lengths within them
    for order, new_lens in (([0, 1, 2, 3], [1, 1, 1, 1]), ([3, 2, 1, 0], [64, 1000, 17, 5]),
                            ([2, 0, 3, 1], [999, 5, 1, 300])):
        static_tables.copy_(tables[order])
        static_lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        graph.replay()
        want = paged_decode_attention_ref(q, k_cache, v_cache, static_tables, static_lens,
                                          128**-0.5)
        torch.testing.assert_close(out, want, **bound(torch.bfloat16, 128, 1000, want))


def test_an_engine_decoding_through_the_kernel_gives_its_eager_tokens(monkeypatch):
    """The attention layers' decode branch wired to the kernel (in the interpreter on a CPU,
    float32): the tables as the runner builds them (-1 past each sequence) and int32
    lengths, several sequences of unlike lengths; greedy tokens are the eager path's."""
    from engine_proc.layers import attention
    from shared.model_config import load_model_config
    from shared.random_checkpoints import TINY, ensure_checkpoint
    from tests.engine_proc.engine_factory import make_engine
    from tests.engine_proc.test_engine import make_request

    path = ensure_checkpoint(TINY)
    config = load_model_config(path)
    prompts = [[30], [4, (2, 2), 9], [70]]

    def run() -> dict:
        engine = make_engine(path, max_num_seqs=4, device=DEVICE, dtype="float32")
        return engine.generate([make_request(config, f"r{i}", p, max_tokens=4)
                                for i, p in enumerate(prompts)])

    eager = run()
    calls = []
    monkeypatch.setattr(attention, "triton_decode",
                        lambda device: calls.append(1) or triton_op)
    assert run() == eager
    assert calls
