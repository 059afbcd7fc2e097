"""Runs one scheduled batch through the model: flat inputs, attention context, images,
forward, logits, sampling.

A batch is flat: the decode tokens of some sequences and prefill chunks of others, one
after another on a single token axis. Images are encoded when the first chunk covering
them is scheduled (every image of the step in one `encode_images` call); their pixels are
dropped right after encoding and their embeddings after the step whose chunk covered their
last placeholder token (R3, see `Scheduler.postprocess`). Nothing here keeps a reference to
either beyond the call that uses it.

With tensor parallelism this runner is rank 0: it runs the vision tower and samples, and
`TensorParallelWorkers` runs each step's forward on every rank (engine_proc/tensor_parallel.py).
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator

import numpy as np
import torch

from engine_proc.cuda_graphs import DecodeGraphs, DecodePadding
from engine_proc.distributed import all_reduce_min, tp_shard
from engine_proc.encoder_cache import EncoderCache
from engine_proc.layers import paged_attention_cpu, rms_norm_cpu, rotary_cpu
from engine_proc.layers.attention import (
    AttentionMetadata,
    build_attention_metadata,
    triton_decode,
)
from engine_proc.layers.gated_delta_net import StateMetadata, build_state_metadata
from engine_proc.layers.packed_linear import pack_linear_weights
from engine_proc.layers.rms_norm import triton_norm
from engine_proc.layers.rotary_embedding import triton_rotary
from engine_proc.layers.varlen_attention import varlen_kernel
from engine_proc.logits_adjustments import build_adjustments
from engine_proc.models.registry import model_class
from engine_proc.piecewise_graphs import PiecewiseGraphs
from engine_proc.prompt_logprobs import PromptRows, score
from engine_proc.sampler import GrammarMask, Sampler, SamplingBatch
from engine_proc.scheduler import ScheduledBatch
from engine_proc.sequence import ImageSpan, Sequence
from engine_proc.state_cache import StateShape, allocate_state_cache, plan_state_slots
from engine_proc.step_inputs import (
    ImagePieces,
    StepInputs,
    capture_layout,
    forward_capture_layout,
    forward_decode_buffers,
    forward_step,
)
from engine_proc.step_staging import StepStaging
from engine_proc.tensor_parallel import TensorParallelWorkers, rank_device
from shared.messages import TokenLogprobs
from shared.model_config import ModelConfig, tensor_parallel_problem

logger = logging.getLogger(__name__)

NO_IMAGE_ROWS = np.zeros((0, 2), dtype=np.int64)
CPU_KV_CACHE_BYTES = 256 << 20  # default KV budget on CPU; on CUDA a fraction of free memory

DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
}


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype | None, config: ModelConfig) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    name = (dtype or "auto").removeprefix("torch.")
    if name == "auto":
        name = config.torch_dtype.removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}")
    return DTYPES[name]


def warn_if_emulated(device: torch.device, dtype: torch.dtype) -> None:
    """CPUs without AVX-512 have no bf16/fp16 matmul units: torch emulates them, measured
    ~8x slower than float32 on an AVX2 machine (a 4000x256x768 linear: 270 vs 35 ms)."""
    if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float16):
        return
    capability = torch.backends.cpu.get_cpu_capability()
    if not capability.startswith("AVX512"):
        logger.warning("%s on a %s CPU runs emulated, several times slower than float32: "
                       "consider --dtype float32", str(dtype).removeprefix("torch."), capability)


def _pairs(pairs: list[tuple[int, int]]) -> np.ndarray:
    return np.asarray(pairs, dtype=np.int64).reshape(-1, 2)


class ModelRunner:
    def __init__(
        self,
        config: ModelConfig,
        *,
        block_size: int,
        num_kv_blocks: int | None = None,
        kv_cache_memory_bytes: int | None = None,
        kv_cache_memory_fraction: float = 0.8,
        gpu_memory_utilization: float | None = None,
        max_num_kv_blocks: int | None = None,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        tensor_parallel_size: int = 1,
        tp_label: str = "",
        vision: bool = True,
        max_num_seqs: int = 0,
        max_model_len: int = 0,
        ssm_state_dtype: str | None = None,
        state_snapshot_bytes: int = 0,
        pack_weights: bool = False,
        cuda_graph_sizes: tuple[int, ...] = (),
        mixed_graph_sizes: tuple[int, ...] = (),
        graph_stand_in: bool = False,
    ):
        """tensor_parallel_size > 1: this runner is rank 0 and starts the other ranks
        (engine_proc/tensor_parallel.py; `tp_label` names them); vision=False: a worker
        rank's runner, without the vision tower, in the group its process joined.

        Hybrid models (Qwen3.5) get a recurrent state slot for each of `max_num_seqs`
        sequences, carved from the budget before the KV blocks (engine_proc/state_cache.py;
        `num_state_slots` may come out lower); `ssm_state_dtype` overrides the checkpoint's
        recurrent state dtype (None or "auto": the checkpoint's, float32 as published).
        `state_snapshot_bytes`: states kept for prefix caching (engine_proc/state_snapshots.py),
        -1 for one per slot; from the budget after the slots, fewer if it is short.
        `pack_weights` (--pack-weights): on a CPU in float32, linear layers run through oneDNN
        on weights packed once (engine_proc/layers/packed_linear.py).
        `cuda_graph_sizes`: on CUDA (one rank), decode-only steps of up to the largest size
        replay CUDA graphs captured at start for these batch sizes (engine_proc/cuda_graphs.py;
        one KV block and one state slot are kept out of the pools for their padding rows).
        `mixed_graph_sizes`: the other steps of up to the largest of these token counts
        replay graphs in pieces around their attention and state updates
        (engine_proc/piecewise_graphs.py). `graph_stand_in` runs the same buffers, padding
        and pieces eagerly on any device (tests)."""
        self.config = config
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, config)
        warn_if_emulated(self.device, self.dtype)
        self.block_size = block_size
        self.on_cuda = self.device.type == "cuda"
        if self.on_cuda and self.device.index is not None:
            # kernels that launch on the current device (Triton's) and the streams copies and
            # events use must be this engine's card, not cuda:0 (data-parallel engines)
            torch.cuda.set_device(self.device)
        self.workers: TensorParallelWorkers | None = None
        if tensor_parallel_size > 1:
            problem = tensor_parallel_problem(config, tensor_parallel_size)
            if problem:
                raise ValueError(problem)
            self.device = rank_device(self.device, 0)  # "cuda" -> "cuda:0": ranks take the next
            self.workers = TensorParallelWorkers(tensor_parallel_size, dict(
                model=str(config.path), block_size=block_size, num_kv_blocks=num_kv_blocks,
                kv_cache_memory_bytes=kv_cache_memory_bytes,
                kv_cache_memory_fraction=kv_cache_memory_fraction,
                gpu_memory_utilization=gpu_memory_utilization,
                max_num_kv_blocks=max_num_kv_blocks, device=str(self.device),
                dtype=str(self.dtype).removeprefix("torch."), max_num_seqs=max_num_seqs,
                max_model_len=max_model_len, ssm_state_dtype=ssm_state_dtype,
                state_snapshot_bytes=state_snapshot_bytes, pack_weights=pack_weights),
                label=tp_label)
        try:
            self.model = model_class(config)(config, self.device, self.dtype, vision=vision)
            self.model.load_weights(config.path)
            self.model.eval()
            if pack_weights:
                pack_linear_weights(self.model)
            self.state_shape = self._state_shape(ssm_state_dtype)
            self.max_model_len = max_model_len or config.text.max_position_embeddings
            num_blocks, num_slots, num_snapshots = self._size_caches(
                num_kv_blocks, kv_cache_memory_bytes, kv_cache_memory_fraction,
                max_num_kv_blocks, gpu_memory_utilization, max_num_seqs, state_snapshot_bytes,
            )
            # every rank sized its own share of the caches: all take the smallest counts
            shard = tp_shard()
            self.num_kv_blocks = all_reduce_min(num_blocks, shard, self.device)
            self.num_state_slots = all_reduce_min(num_slots, shard, self.device)
            self.num_state_snapshots = all_reduce_min(num_snapshots, shard, self.device)
        except BaseException:
            self.close()
            raise
        # On a CPU the workers wait on their pipe while rank 0 runs the vision tower (before
        # it sends them the step): rank 0 borrows their threads for it. Measured, three
        # 1008px images with one thread per rank: 1.64 s against 2.58 s without (TP=1 on
        # both cores: 1.43 s).
        self.vision_threads = 0
        if self.workers is not None and not self.on_cuda:
            self.vision_threads = torch.get_num_threads() * tensor_parallel_size
        self.sampler = Sampler()
        # /metrics: forwards, and those that replayed a decode graph or mixed-step pieces
        self.num_forward_steps = self.num_graph_steps = self.num_piecewise_steps = 0
        # a step's small arrays reach the GPU through one pinned arena (not a block each)
        self.staging = StepStaging(self.device) if self.on_cuda else None
        self.structured = None  # StructuredOutputs, set by the engine
        if not self.on_cuda and self.dtype == torch.float32:
            paged_attention_cpu.library()  # built (or found) now, not in the first step
            rms_norm_cpu.library()
            rotary_cpu.library()
        wanted = bool(cuda_graph_sizes or mixed_graph_sizes)
        graphs = wanted and self.workers is None and (self.on_cuda or graph_stand_in)
        if wanted and not graphs:
            logger.info("steps run eagerly: CUDA graphs need a CUDA device and one rank "
                        "(this engine: %s, %d ranks)", self.device, tensor_parallel_size)
        # the padding rows' KV block and state slot: one past those the pools hand out
        self.kv_cache = self._allocate_kv_cache(self.num_kv_blocks + graphs)
        self.state_cache = None
        if self.state_shape is not None:
            self.state_cache = allocate_state_cache(
                self.model, self.state_shape,
                self.num_state_slots + self.num_state_snapshots + graphs, self.device)
        self.encoder_cache = EncoderCache(0)  # sized by the engine (default_encoder_cache_bytes)
        if self.on_cuda:
            self._check_gpu_kernels()
        self.decode_graphs = (self._capture_decode_graphs(cuda_graph_sizes, graph_stand_in)
                              if graphs and cuda_graph_sizes else None)
        self.mixed_graphs = (self._capture_mixed_graphs(mixed_graph_sizes, graph_stand_in)
                             if graphs and mixed_graph_sizes else None)

    def _capture_decode_graphs(self, sizes: tuple[int, ...], stand_in: bool
                               ) -> DecodeGraphs | None:
        if self.on_cuda and not stand_in and triton_decode(self.device) is None:
            # the gather path sizes its keys by a host length: a graph would gather them all
            logger.warning("decode steps run eagerly: CUDA graphs need the paged Triton "
                           "attention kernel (Triton did not import)")
            return None
        padding = self._graph_padding()
        graphs = DecodeGraphs(sizes, -(-self.max_model_len // self.block_size), padding,
                              state_slots=self.state_shape is not None, device=self.device,
                              use_graphs=self.on_cuda and not stand_in)
        try:
            graphs.capture(lambda buffers: forward_decode_buffers(self.model, buffers,
                                                                  self.block_size))
        except Exception:  # e.g. an op that waits on the host (the looped MoE path)
            logger.warning("decode steps run eagerly: capturing their CUDA graphs failed",
                           exc_info=True)
            return None
        return graphs

    def _graph_padding(self) -> DecodePadding:
        """The KV block and state slot one past those the pools hand out (kept for graphs)."""
        return DecodePadding.reserved_block(
            self.num_kv_blocks, self.block_size,
            self.num_state_slots + self.num_state_snapshots if self.state_shape else -1)

    def _capture_mixed_graphs(self, sizes: tuple[int, ...], stand_in: bool
                              ) -> PiecewiseGraphs | None:
        hidden = self.config.text.hidden_size
        num_deepstack = len(self.config.vision.deepstack_visual_indexes)
        graphs = PiecewiseGraphs(sizes, hidden=hidden, dtype=self.dtype,
                                 deepstack_width=num_deepstack * hidden, device=self.device,
                                 use_graphs=self.on_cuda and not stand_in)
        padding = self._graph_padding()
        try:
            graphs.capture(
                lambda *inputs: forward_capture_layout(self.model, *inputs),
                lambda size: capture_layout(size, padding, self.block_size, self.device))
        except Exception:  # an op in a piece that waits on the host
            logger.warning("steps with prompt chunks run eagerly: capturing their CUDA graphs "
                           "in pieces failed", exc_info=True)
            return None
        return graphs

    def _check_gpu_kernels(self) -> None:
        """Each GPU kernel's first-use check (a small run against its torch form, and its
        compile) at start rather than in the first requests' time; the log names any that
        turned itself off. Qwen3.5's kernels were checked when its states were assigned
        (GatedDeltaNet.use_states)."""
        x = torch.zeros(1, 1, 64, device=self.device, dtype=self.dtype)
        triton_norm(x)
        triton_rotary(x, x[:, 0, :32], x[:, 0, :32])
        triton_decode(self.device)
        varlen_kernel(self.device, self.dtype, self.config.text.head_dim)

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (the runner is unusable after)."""
        if self.workers is not None:
            self.workers.close()

    # ---- KV cache ---------------------------------------------------------------------

    @property
    def num_local_kv_heads(self) -> int:
        """The key/value heads this rank's KV cache holds (all of them without tensor
        parallelism)."""
        return self.config.text.num_key_value_heads // tp_shard().size

    @property
    def kv_block_bytes(self) -> int:
        """Bytes of one KV block on this rank."""
        text = self.config.text
        elem = torch.empty((), dtype=self.dtype).element_size()
        return (
            2
            * text.num_attention_layers
            * self.block_size
            * self.num_local_kv_heads
            * text.head_dim
            * elem
        )

    @property
    def kv_cache_bytes(self) -> int:
        return self.num_kv_blocks * self.kv_block_bytes

    @property
    def cuda_graph_bytes(self) -> int:
        """Device memory the graphs took when captured (decode and mixed steps)."""
        return sum(g.capture_bytes for g in (self.decode_graphs, self.mixed_graphs)
                   if g is not None)

    @property
    def state_cache_bytes(self) -> int:
        if self.state_shape is None:
            return 0
        return (self.num_state_slots + self.num_state_snapshots) * self.state_shape.slot_bytes

    def _state_shape(self, ssm_state_dtype: str | None) -> StateShape | None:
        text = self.config.text
        if not text.is_hybrid:
            return None
        name = ssm_state_dtype if ssm_state_dtype not in (None, "auto") else text.ssm_state_dtype
        if name not in DTYPES:
            raise ValueError(f"unsupported recurrent state dtype {name!r}")
        return StateShape.of(text, tp_shard().size, self.dtype, DTYPES[name])

    def _size_caches(self, num_kv_blocks, memory_bytes, memory_fraction, max_num_kv_blocks,
                     gpu_memory_utilization, max_num_seqs,
                     snapshot_bytes) -> tuple[int, int, int]:
        """(KV blocks, state slots, state snapshots). The slots, then the snapshots, come
        out of an explicit or device budget first; the CPU default is CPU_KV_CACHE_BYTES of
        KV plus the slots and snapshots."""
        if self.state_shape is None:
            return self._num_kv_blocks(num_kv_blocks, memory_bytes, memory_fraction,
                                       max_num_kv_blocks, gpu_memory_utilization), 0, 0
        if max_num_seqs < 1:
            raise ValueError("a hybrid model needs max_num_seqs to size its state slots")
        slot_bytes = self.state_shape.slot_bytes
        num_snapshots = max_num_seqs if snapshot_bytes < 0 else snapshot_bytes // slot_bytes
        if num_kv_blocks or (memory_bytes is None and not self.on_cuda):
            num_slots = max_num_seqs
        else:
            budget = memory_bytes if memory_bytes is not None else self._device_budget(
                memory_fraction, gpu_memory_utilization)
            full_sequence = -(-self.max_model_len // self.block_size) * self.kv_block_bytes
            num_slots = plan_state_slots(max_num_seqs, slot_bytes, budget, full_sequence)
            room = (budget - full_sequence) // slot_bytes - num_slots
            if room < num_snapshots:
                logger.warning("prefix caching keeps %d recurrent state snapshots, not %d: "
                               "the KV cache budget holds no more", max(room, 0), num_snapshots)
                num_snapshots = max(room, 0)
            memory_bytes = budget - (num_slots + num_snapshots) * slot_bytes
        num_blocks = self._num_kv_blocks(num_kv_blocks, memory_bytes, memory_fraction,
                                         max_num_kv_blocks, gpu_memory_utilization)
        return num_blocks, num_slots, num_snapshots

    def _device_budget(self, memory_fraction: float, gpu_memory_utilization: float | None) -> int:
        """The caches' bytes on CUDA when no budget is given: vLLM's meaning of
        gpu_memory_utilization (this share of the whole device, less what is in use now:
        weights, the CUDA context, other processes), else a share of what is free."""
        free, total = torch.cuda.mem_get_info(self.device)
        if gpu_memory_utilization is not None:
            return int(total * gpu_memory_utilization) - (total - free)
        return int(free * memory_fraction)

    def _num_kv_blocks(
        self,
        num_kv_blocks: int | None,
        memory_bytes: int | None,
        memory_fraction: float,
        max_num_kv_blocks: int | None,
        gpu_memory_utilization: float | None = None,
    ) -> int:
        if num_kv_blocks:
            return num_kv_blocks
        if gpu_memory_utilization is not None and not self.on_cuda:
            raise ValueError("gpu_memory_utilization applies to GPUs; on a CPU set "
                             "kv_cache_memory_bytes")
        if memory_bytes is None and self.on_cuda:
            memory_bytes = self._device_budget(memory_fraction, gpu_memory_utilization)
        elif memory_bytes is None:
            memory_bytes = CPU_KV_CACHE_BYTES
        num = memory_bytes // self.kv_block_bytes
        if max_num_kv_blocks:
            num = min(num, max_num_kv_blocks)  # more could never be used
        if num < 1:
            raise ValueError(f"KV cache budget of {memory_bytes} bytes is below one block")
        return int(num)

    def default_encoder_cache_bytes(self) -> int:
        """An eighth of the KV cache's bytes (see EngineConfig.encoder_cache_bytes); on CUDA
        at most a quarter of what is left free after the KV cache, so activations keep room."""
        budget = self.num_kv_blocks * self.kv_block_bytes // 8
        if self.on_cuda:
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = min(budget, free // 4)
        return budget

    def _allocate_kv_cache(self, num_blocks: int) -> torch.Tensor:
        text = self.config.text
        layers = [
            m for m in self.model.modules() if hasattr(m, "k_cache") and hasattr(m, "v_cache")
        ]
        if len(layers) != text.num_attention_layers:
            raise RuntimeError(
                f"found {len(layers)} attention layers, expected {text.num_attention_layers}"
            )
        shape = (
            2,
            len(layers),
            num_blocks,
            self.block_size,
            self.num_local_kv_heads,
            text.head_dim,
        )
        kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        for i, layer in enumerate(layers):
            layer.k_cache = kv_cache[0, i]
            layer.v_cache = kv_cache[1, i]
        return kv_cache

    # ---- one step ---------------------------------------------------------------------

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> tuple[list[int], list[TokenLogprobs | None] | None]:
        """Run one step; returns the sampled token of every sequence whose scheduled range
        reaches its last token, in batch order, and when some of them asked for them, each
        one's log-probabilities (None for those that did not ask)."""
        if self.staging is not None:
            self.staging.reset()  # the previous step's device inputs are dead by now
        if batch.encoder_stage is not None:
            with self._vision_threads():
                self._encode_stage(batch.encoder_stage)
        if not batch.seqs:
            if batch.state_restores:  # a hit admitted with its image still being encoded
                self._forward(StepInputs.copies_only(_pairs(batch.state_restores)), [])
            return [], None
        inputs, sample_seqs, prompt = self.prepare(batch)
        self.num_forward_steps += 1
        if self._replays(inputs, prompt):
            self.num_graph_steps += 1
            logits = self.model.compute_logits(self.decode_graphs.replay(inputs))
            return self._sample(logits, sample_seqs)
        pieces = self._image_rows(batch, inputs)  # vision work, on rank 0 only
        if self._runs_pieces(inputs):
            self.num_piecewise_steps += 1
            logits = self._forward_pieces(inputs, pieces)
        else:
            logits = self._forward(inputs, pieces)
        del pieces
        if logits is None:
            return [], None
        if prompt is not None:  # the prompt rows' logits come after the sampled rows'
            score(logits[len(sample_seqs):], prompt)
            logits = logits[:len(sample_seqs)]
            if not sample_seqs:
                return [], None
        return self._sample(logits, sample_seqs)

    def _replays(self, inputs: StepInputs, prompt: PromptRows | None) -> bool:
        """Whether the step replays a decode graph: decodes only, no state copies or prompt
        rows, at most the largest captured size."""
        graphs = self.decode_graphs
        return (graphs is not None and inputs.all_decode and prompt is None
                and not len(inputs.state_restores) and not len(inputs.state_saves)
                and graphs.bucket(len(inputs.input_ids)) is not None)

    def _runs_pieces(self, inputs: StepInputs) -> bool:
        """Whether a step replays mixed-step pieces: at most their largest size in tokens."""
        graphs = self.mixed_graphs
        return graphs is not None and graphs.bucket(len(inputs.input_ids)) is not None

    def _forward_pieces(self, inputs: StepInputs, pieces: ImagePieces) -> torch.Tensor | None:
        """forward_step with the layers replayed in pieces (the embeddings, image rows over
        their placeholders, eagerly before them)."""
        return forward_step(self.model, inputs, pieces, self._to_device, self.state_cache,
                            decoder=self._replay_pieces)

    def _replay_pieces(self, context, embeds: torch.Tensor, positions: torch.Tensor,
                       deepstack: torch.Tensor | None) -> torch.Tensor:
        """The pieces, their attention and state updates on the step's own layouts, built
        here once (the models build them in their forward)."""
        num_tokens = embeds.shape[0]
        layouts = {AttentionMetadata: build_attention_metadata(context, num_tokens,
                                                               self.block_size, self.dtype)}
        if self.state_shape is not None:
            layouts[StateMetadata] = build_state_metadata(context, num_tokens)
        return self.mixed_graphs.replay(embeds, positions, deepstack, layouts)

    def _sample(self, logits: torch.Tensor, sample_seqs: list[Sequence]
                ) -> tuple[list[int], list[TokenLogprobs | None] | None]:
        token_ids, logprobs = self.sampler(logits, self.prepare_sampling(sample_seqs))
        if logprobs is None:
            return token_ids.tolist(), None  # the step's one host sync
        # still one sync: everything in one float64 copy (exact for token ids < 2^53 and for
        # float32 values, which .tolist() would widen to the same Python floats)
        num, (num_rows, k) = len(token_ids), logprobs.top_ids.shape
        flat = torch.cat([token_ids.double(), logprobs.rows.double(), logprobs.sampled.double(),
                          logprobs.top_ids.double().view(-1),
                          logprobs.top_values.double().view(-1)]).tolist()
        token_ids = [int(t) for t in flat[:num]]
        rows = flat[num : num + num_rows]
        sampled = flat[num + num_rows : num + 2 * num_rows]
        top = num + 2 * num_rows
        per_row: list[TokenLogprobs | None] = [None] * num
        for i, (row, lp) in enumerate(zip(rows, sampled, strict=True)):
            want = sample_seqs[int(row)].sampling.logprobs
            ids = flat[top + i * k : top + i * k + want]
            values = flat[top + (num_rows + i) * k : top + (num_rows + i) * k + want]
            per_row[int(row)] = [lp, [int(t) for t in ids], values]
        return token_ids, per_row

    def _forward(self, inputs: StepInputs, pieces: ImagePieces) -> torch.Tensor | None:
        """The step's forward on every rank; the logits (rank 0)."""
        if self.workers is not None:
            return self.workers.forward(self.model, inputs, pieces, self._to_device,
                                        self.state_cache)
        return forward_step(self.model, inputs, pieces, self._to_device, self.state_cache)

    def prepare(self, batch: ScheduledBatch
                ) -> tuple[StepInputs, list[Sequence], PromptRows | None]:
        """The step's inputs on the host (image rows not filled in yet), the sequences
        sampled in it, and the prompt rows whose log-probabilities it computes."""
        decode = self.prepare_decode(batch.seqs[: batch.num_decode_seqs])
        prefill = self.prepare_prefill(
            batch.seqs[batch.num_decode_seqs :], batch.num_new_tokens[batch.num_decode_seqs :]
        )
        parts = [p for p in (decode, prefill) if p is not None]
        input_ids, positions, slots, q_lens, seq_lens, tables, samples = (
            [p[k] for p in parts] for k in range(7)
        )
        q_lens = np.concatenate(q_lens)
        tables = [row for t in tables for row in t]
        samples = np.concatenate(samples)

        query_start_loc = np.zeros(len(q_lens) + 1, dtype=np.int32)
        np.cumsum(q_lens, out=query_start_loc[1:])
        block_tables = np.full((len(tables), max(map(len, tables))), -1, dtype=np.int32)
        for i, row in enumerate(tables):
            block_tables[i, : len(row)] = row
        sample_rows = query_start_loc[1:][samples] - 1
        sample_seqs = [seq for seq, s in zip(batch.seqs, samples, strict=True) if s]
        prompt = None
        if any(s.prompt_logprobs is not None for s in batch.seqs[batch.num_decode_seqs:]):
            first = batch.num_decode_seqs
            prompt = PromptRows.of_chunks([
                (seq, int(query_start_loc[i]), seq.num_computed_tokens,
                 seq.num_computed_tokens + batch.num_new_tokens[i])
                for i, seq in enumerate(batch.seqs) if i >= first])
            if prompt is not None:
                sample_rows = np.concatenate([sample_rows, prompt.rows])
        inputs = StepInputs(
            input_ids=np.concatenate(input_ids),
            positions=np.concatenate(positions, axis=1),
            query_start_loc=query_start_loc,
            seq_lens=np.concatenate(seq_lens),
            slot_mapping=np.concatenate(slots),
            block_tables=block_tables,
            sample_rows=sample_rows.astype(np.int64),
            all_decode=batch.all_decode,
            num_decodes=batch.num_decode_seqs,
            image_rows=NO_IMAGE_ROWS,
            state_slots=None if self.state_shape is None else np.fromiter(
                (s.state_slot for s in batch.seqs), dtype=np.int64, count=len(batch.seqs)),
            state_restores=_pairs(batch.state_restores),
            state_saves=_pairs([(seq.state_slot, snapshot)
                                for seq, snapshot, _ in batch.state_saves]),
        )
        return inputs, sample_seqs, prompt

    def prepare_decode(self, seqs: list[Sequence]):
        """One token per sequence: its last one, at index num_tokens - 1."""
        if not seqs:
            return None
        bs = self.block_size
        pos = np.fromiter((len(s.token_ids) - 1 for s in seqs), dtype=np.int64, count=len(seqs))
        delta = np.fromiter((s.mrope_delta for s in seqs), dtype=np.int64, count=len(seqs))
        input_ids = np.fromiter((s.token_ids[-1] for s in seqs), dtype=np.int64, count=len(seqs))
        block_ids = np.fromiter(
            (s.block_table[p // bs] for s, p in zip(seqs, pos.tolist(), strict=True)),
            dtype=np.int64,
            count=len(seqs),
        )
        slots = block_ids * bs + pos % bs
        seq_lens = (pos + 1).astype(np.int32)
        tables = [
            s.block_table[: (n + bs - 1) // bs]
            for s, n in zip(seqs, seq_lens.tolist(), strict=True)
        ]
        positions = np.broadcast_to(pos + delta, (3, len(seqs)))
        q_lens = np.ones(len(seqs), dtype=np.int32)
        return input_ids, positions, slots, q_lens, seq_lens, tables, np.ones(len(seqs), dtype=bool)

    def prepare_prefill(self, seqs: list[Sequence], num_new_tokens: list[int]):
        """A chunk of `num_new` tokens per sequence, from its first uncomputed one."""
        if not seqs:
            return None
        bs = self.block_size
        input_ids, positions, slots, tables, samples = [], [], [], [], []
        seq_lens = np.empty(len(seqs), dtype=np.int32)
        for i, (seq, num_new) in enumerate(zip(seqs, num_new_tokens, strict=True)):
            start = seq.num_computed_tokens
            end = start + num_new
            input_ids.append(np.asarray(seq.token_ids[start:end], dtype=np.int64))
            positions.append(self._positions(seq, start, end))
            idx = np.arange(start, end)
            table = np.asarray(seq.block_table[: (end + bs - 1) // bs], dtype=np.int64)
            slots.append(table[idx // bs] * bs + idx % bs)
            tables.append(table)
            seq_lens[i] = end
            samples.append(end == len(seq.token_ids))
        q_lens = np.asarray(num_new_tokens, dtype=np.int32)
        return (
            np.concatenate(input_ids),
            np.concatenate(positions, axis=1),
            np.concatenate(slots),
            q_lens,
            seq_lens,
            tables,
            np.asarray(samples, dtype=bool),
        )

    @staticmethod
    def _positions(seq: Sequence, start: int, end: int) -> np.ndarray:
        if seq.mrope_positions is None:
            return np.broadcast_to(np.arange(start, end, dtype=np.int64), (3, end - start))
        num_prompt = seq.mrope_positions.shape[1]
        if end <= num_prompt:
            return seq.mrope_positions[:, start:end]
        # tokens after the prompt (recomputed after a preemption) continue text-like
        tail = np.arange(max(start, num_prompt), end, dtype=np.int64) + seq.mrope_delta
        head = seq.mrope_positions[:, start:num_prompt]
        return np.concatenate([head, np.broadcast_to(tail, (3, len(tail)))], axis=1)

    def prepare_sampling(self, seqs: list[Sequence]) -> SamplingBatch:
        params = [s.sampling for s in seqs]
        greedy = [p.temperature == 0.0 for p in params]
        all_greedy = all(greedy)
        vocab = self.config.text.vocab_size
        adjustments = build_adjustments(seqs, vocab, self.config.eos_token_ids, self._to_device)
        grammar_mask = self._grammar_mask(seqs)
        logprob_rows, max_logprobs = None, 0
        if any(p.logprobs is not None for p in params):
            rows = [i for i, p in enumerate(params) if p.logprobs is not None]
            logprob_rows = self._to_device(np.asarray(rows, dtype=np.int64))
            max_logprobs = max(params[i].logprobs for i in rows)
        if all_greedy:
            empty = torch.empty(0)
            return SamplingBatch(empty, empty, empty, empty, [], True, False, False, False,
                                 adjustments, logprob_rows, max_logprobs, grammar_mask)
        top_ks = [p.top_k if p.top_k > 0 else vocab for p in params]
        generators = [self._generator(s) if s.sampling.seed is not None else None for s in seqs]
        return SamplingBatch(
            temperatures=self._to_device(
                np.asarray(
                    [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)],
                    dtype=np.float32,
                )
            ),
            top_ps=self._to_device(np.asarray([p.top_p for p in params], dtype=np.float32)),
            top_ks=self._to_device(np.asarray(top_ks, dtype=np.int64)),
            greedy=self._to_device(np.asarray(greedy, dtype=bool)),
            generators=generators,
            all_greedy=False,
            any_top_p=any(p.top_p < 1.0 for p in params),
            any_top_k=any(k < vocab for k in top_ks),
            any_seeded=any(g is not None for g in generators),
            adjustments=adjustments,
            logprob_rows=logprob_rows,
            max_logprobs=max_logprobs,
            grammar_mask=grammar_mask,
        )

    def _grammar_mask(self, seqs: list[Sequence]) -> GrammarMask | None:
        if self.structured is None or not any(s.grammar is not None for s in seqs):
            return None
        rows = [i for i, s in enumerate(seqs) if s.grammar is not None]
        bitmask = self.structured.bitmask([seqs[i].grammar for i in rows], rows, len(seqs),
                                          self._to_device)
        return GrammarMask(self.structured.apply, bitmask, rows)

    def _generator(self, seq: Sequence) -> torch.Generator:
        if seq.generator is None:
            seq.generator = torch.Generator(device=self.device)
            seq.generator.manual_seed(seq.sampling.seed)
        return seq.generator

    # ---- images -----------------------------------------------------------------------

    @contextlib.contextmanager
    def _vision_threads(self) -> Iterator[None]:
        if not self.vision_threads:
            yield
            return
        threads = torch.get_num_threads()
        torch.set_num_threads(self.vision_threads)
        try:
            yield
        finally:
            torch.set_num_threads(threads)

    def _image_rows(self, batch: ScheduledBatch, inputs: StepInputs) -> ImagePieces:
        """Encode the images this step's chunks cover (those not encoded yet) and return
        the rows of their embeddings these chunks use, with where they go in the batch;
        their layout goes into `inputs` (image_rows, image_width) for the other ranks."""
        pieces = self._image_pieces(batch)
        if not pieces:
            return []
        to_encode = [image for image, *_ in pieces if image.embeds is None]
        if to_encode:
            with self._vision_threads():
                self._encode(to_encode)
        rows = [(dst, image.embeds[src_start:src_end]) for image, dst, src_start, src_end in pieces]
        inputs.image_rows = np.asarray([(dst, r.shape[0]) for dst, r in rows], dtype=np.int64)
        inputs.image_width = rows[0][1].shape[1]
        return rows

    @staticmethod
    def _image_pieces(batch: ScheduledBatch) -> list[tuple[ImageSpan, int, int, int]]:
        """(image, first row in the flat batch, first and end row of its embeddings) for
        every image placeholder range inside this step's chunks."""
        pieces = []
        row = 0
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens, strict=True):
            if seq.has_images:
                start = seq.num_computed_tokens
                end = start + num_new
                for image in seq.images:
                    if image.offset < end and image.end > start:
                        lo, hi = max(start, image.offset), min(end, image.end)
                        pieces.append(
                            (image, row + lo - start, lo - image.offset, hi - image.offset)
                        )
            row += num_new
        return pieces

    def _encode(self, images: list[ImageSpan]) -> None:
        """Encode `images`, except those the encoder cache holds by now (another request
        may have encoded the same image since this one was added) and all but one of the
        same image in this step, which share its embeddings."""
        cache = self.encoder_cache
        images = [image for image in images if not cache.fill(image)]
        if not images:
            return
        first: dict[bytes, ImageSpan] = {}
        unique, copies = [], []
        for image in images:
            # with every cache off images have no key (b""): none is a copy of another
            owner = first.setdefault(image.key, image) if image.key else image
            if owner is image:
                unique.append(image)
            else:
                copies.append((image, owner))
                image.pixels = None
        pixels = [self._pixels_to_device(image.pixels) for image in unique]
        for image in unique:
            image.pixels = None  # R3: the embeddings carry everything from here on
        embeds = self.model.encode_images(pixels, [image.grid_thw for image in unique])
        del pixels
        for image, emb in zip(unique, embeds, strict=True):
            self._store_embeds(image, emb)
        for image, owner in copies:
            image.embeds = owner.embeds

    def _store_embeds(self, image: ImageSpan, embeds: torch.Tensor) -> None:
        if embeds.shape[0] != image.length:
            raise RuntimeError(f"image encoded to {embeds.shape[0]} tokens, prompt has {image.length}")
        if embeds.untyped_storage().nbytes() > embeds.numel() * embeds.element_size():
            embeds = embeds.clone()  # a view would keep the whole batch's storage alive
        image.embeds = embeds
        self.encoder_cache.put(image.key, embeds, image.grid_thw)

    def _encode_stage(self, image: ImageSpan) -> None:
        """Run the next vision stage of an image encoded over several steps: the first one
        consumes its pixels (R3), the last one leaves its embeddings."""
        if image.stages_done == 0:
            if self.encoder_cache.fill(image):
                return  # another request encoded the same image since this one was added
            pixels = self._pixels_to_device(image.pixels)
            image.pixels = None
            hidden = self.model.embed_patches(pixels, image.grid_thw)
            del pixels
        else:
            hidden, image.hidden = image.hidden, None
        out = self.model.encode_stage(hidden, image.grid_thw, image.stages_done)
        del hidden
        image.stages_done += 1
        if image.stages_done < self.model.num_vision_stages:
            image.hidden = out
        else:
            self._store_embeds(image, out)

    def _pixels_to_device(self, pixels: np.ndarray) -> torch.Tensor:
        with warnings.catch_warnings():  # read-only arrays (zero-copy rpc frames) are fine
            warnings.simplefilter("ignore", UserWarning)
            host = torch.from_numpy(np.ascontiguousarray(pixels))
        # A plain (pageable) copy, not staged through pinned memory: torch caches every
        # pinned block it has made, rounded up to a power of two, for the life of the process
        # (a 2044px image takes a 16 MB block; mixed sizes keep one set per size class). On an
        # H100 the pageable copy of 12.5 MB takes ~1 ms, next to the vision tower's work. It
        # returns once the pixels are read, so the caller drops them at once (R3).
        return host.to(self.device) if self.on_cuda else host

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        """A step's array on the device (on a GPU: valid for this step, see StepStaging)."""
        if self.staging is not None:
            return self.staging(array)
        return torch.from_numpy(np.ascontiguousarray(array))
