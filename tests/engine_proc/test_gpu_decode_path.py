"""A GPU engine's decode path, all of it but the card: decode steps through the graphs'
static buffers (the eager stand-in replays them), attention through the paged Triton kernel
and Qwen3.5's states through the Triton kernels by slot, its prefill conv in two launches
(Triton's interpreter on a CPU, float32). What the kernels read is what a replay gives them:
int32 lengths, block tables whose columns past a sequence keep earlier steps' entries,
padding rows in the reserved block and state slot; prompts prefill in 17-token chunks (the
first from zeros, each later one from its slot's state) beside decodes. Greedy tokens are
transformers'."""

from __future__ import annotations

import pytest

from tests.triton_device import runs_triton

pytest.importorskip("triton")
from engine_proc.cuda_graphs import DecodeGraphs  # noqa: E402
from engine_proc.layers import attention, gated_delta_net  # noqa: E402
from engine_proc.layers import gated_delta_rule_triton as delta_kernels  # noqa: E402
from engine_proc.layers import paged_decode_attention_triton as attention_kernel  # noqa: E402
from shared.model_config import load_model_config  # noqa: E402
from shared.random_checkpoints import TINY_QWEN3_5, ensure_checkpoint  # noqa: E402
from tests.engine_proc.engine_factory import make_engine  # noqa: E402
from tests.engine_proc.test_engine import Reference, make_request  # noqa: E402

pytestmark = runs_triton


def test_graph_buffers_through_the_triton_kernels_give_transformers_tokens(monkeypatch):
    replays = []
    replay = DecodeGraphs.replay
    monkeypatch.setattr(DecodeGraphs, "replay", lambda self, inputs: replays.append(
        len(inputs.input_ids)) or replay(self, inputs))
    monkeypatch.setattr(attention, "triton_decode", lambda device: attention_kernel)
    monkeypatch.setattr(gated_delta_net, "decode_kernels", lambda *args: delta_kernels)
    path = ensure_checkpoint(TINY_QWEN3_5)
    config = load_model_config(path)
    engine = make_engine(path, max_num_seqs=4, max_num_batched_tokens=17, dtype="float32",
                         enforce_eager=False, cudagraph_capture_sizes=(1, 2, 4),
                         graph_stand_in=True)
    prompts = {"a": [20], "b": [4, (2, 2), 9], "c": [12]}  # 3 decode in the 4 graph
    reference = Reference(path)
    for wave in range(2):  # the second in the blocks and slots the first left
        out = engine.generate([make_request(config, f"{rid}{wave}", segments, wave,
                                            max_tokens=4) for rid, segments in prompts.items()])
        for rid, segments in prompts.items():
            assert out[f"{rid}{wave}"] == reference.greedy(config, segments, wave, max_tokens=4)
    assert 3 in replays
