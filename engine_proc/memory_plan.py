"""An engine process's memory plan (shared/memory_plan.py): its RSS ceiling from its budgets.

Measured once, when the engine is loaded and before it reports ready: the RSS then holds the
runtime (interpreter, torch and its libraries), the weights and, on a CPU, the KV cache and
the recurrent state slots, which are written at start. Everything else is a budget the engine
keeps, or a workspace computed from the shapes of the largest step it can run. On CUDA the
weights, caches and activations live on the device and are not part of the host plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine_proc.piecewise_graphs import MAX_MIXED_SIZE
from engine_proc.step_staging import NUM_ARENAS
from rpc.engine_server import MAX_PENDING_PER_PEER
from shared.engine_config import EngineConfig
from shared.memory import ENGINE_MALLOC_ENV
from shared.memory_plan import MemoryPart, MemoryPlan
from shared.model_config import ModelConfig

if TYPE_CHECKING:
    from engine_proc.llm_engine import LLMEngine

# A Python list of token ids: an 8-byte pointer per entry and a 28-byte int object for each
# id above 256 (CPython caches the small ones). Prompts are held as such lists.
TOKEN_ID_BYTES = 36
# One request's output in a StepOutputs without log-probabilities: its id (a uuid), a few
# token ids and counters: under 128 bytes of msgpack (measured ~90).
OUTPUT_WIRE_BYTES = 128
# oneDNN's and ideep's kernel caches, bounded to 64 entries each (shared/memory.py
# KERNEL_CACHE_ENV): measured to hold ~100 MB on a CPU.
KERNEL_CACHES_BYTES = 100 * 10**6
# glibc: the dynamic mmap threshold rises to at most 32 MiB on 64-bit, and the trim threshold
# follows it at twice that, so each arena may keep up to 64 MiB freed at its top before
# giving it back; engines run with ENGINE_MALLOC_ENV's MALLOC_ARENA_MAX arenas.
ARENAS = int(ENGINE_MALLOC_ENV["MALLOC_ARENA_MAX"])
ALLOCATOR_SLACK_BYTES = ARENAS * 64 * 2**20


@dataclass(frozen=True)
class EngineSizes:
    """What the engine resolved at start (or what a dry run computes): the inputs of its plan."""

    weights_bytes: int
    kv_cache_bytes: int
    state_cache_bytes: int  # recurrent state slots and snapshots (hybrid models)
    encoder_cache_bytes: int
    max_num_seqs: int
    max_requests: int
    max_model_len: int
    dtype_bytes: int
    on_cuda: bool


def measured_sizes(engine: LLMEngine) -> EngineSizes:
    """The sizes a loaded engine resolved."""
    runner = engine.model_runner
    weights = sum(t.numel() * t.element_size()
                  for t in (*runner.model.parameters(), *runner.model.buffers()))
    return EngineSizes(
        weights_bytes=weights, kv_cache_bytes=runner.kv_cache_bytes,
        state_cache_bytes=runner.state_cache_bytes,
        encoder_cache_bytes=engine.encoder_cache.max_bytes,
        max_num_seqs=engine.scheduler.max_num_seqs, max_requests=engine.max_requests,
        max_model_len=engine.max_model_len, dtype_bytes=runner.dtype.itemsize,
        on_cuda=runner.on_cuda)


def planned_sizes(config: EngineConfig, model: ModelConfig) -> EngineSizes:
    """The sizes an engine with `config` would resolve, without loading it (`flatserve plan`):
    weights from the checkpoint's safetensors headers, the caches as ModelRunner sizes them
    on a CPU (on CUDA they are device memory, outside the host plan)."""
    from engine_proc.model_runner import CPU_KV_CACHE_BYTES, DTYPES, resolve_device, resolve_dtype
    from engine_proc.models.weight_loader import checkpoint_weight_bytes
    from engine_proc.state_cache import StateShape

    dtype = resolve_dtype(config.dtype, model)
    on_cuda = resolve_device(config.device).type == "cuda"
    text = model.text
    max_model_len = min(config.max_model_len or text.max_position_embeddings,
                        text.max_position_embeddings)
    block_bytes = (2 * text.num_attention_layers * config.block_size * text.num_key_value_heads
                   * text.head_dim * dtype.itemsize)
    state = 0
    if text.is_hybrid:
        name = config.mamba_ssm_cache_dtype
        ssm = DTYPES[text.ssm_state_dtype if name == "auto" else name]
        slot = StateShape.of(text, 1, dtype, ssm).slot_bytes
        snapshots = 0
        if config.enable_prefix_caching and config.mamba_cache_mode == "align":
            snapshots = (config.max_num_seqs if config.state_snapshot_bytes < 0
                         else config.state_snapshot_bytes // slot)
        state = (config.max_num_seqs + snapshots) * slot
    max_blocks = config.max_num_seqs * -(-max_model_len // config.block_size)
    if config.num_kv_blocks:
        blocks = config.num_kv_blocks
    else:
        budget = (config.kv_cache_memory_bytes - state if config.kv_cache_memory_bytes
                  else CPU_KV_CACHE_BYTES)
        blocks = min(budget // block_bytes, max_blocks)
    kv = 0 if on_cuda else blocks * block_bytes
    encoder = kv // 8 if config.encoder_cache_bytes < 0 else config.encoder_cache_bytes
    return EngineSizes(
        weights_bytes=checkpoint_weight_bytes(model.path, dtype.itemsize), kv_cache_bytes=kv,
        state_cache_bytes=state, encoder_cache_bytes=encoder, max_num_seqs=config.max_num_seqs,
        max_requests=config.max_num_seqs + config.max_waiting, max_model_len=max_model_len,
        dtype_bytes=dtype.itemsize, on_cuda=on_cuda)


def resident_bytes(sizes: EngineSizes) -> int:
    """The parts already in RSS when the engine is loaded (written at start), on a CPU."""
    if sizes.on_cuda:
        return 0
    return sizes.weights_bytes + sizes.kv_cache_bytes + sizes.state_cache_bytes


def engine_plan(process: str, config: EngineConfig, model: ModelConfig, sizes: EngineSizes,
                loaded_rss: int) -> MemoryPlan:
    """`loaded_rss`: the process's RSS once loaded (before any step); the runtime part is
    what it holds beyond the weights and caches already resident then."""
    runtime = max(0, loaded_rss - resident_bytes(sizes))
    parts = [MemoryPart("runtime", runtime, "RSS at start less weights and caches")]
    if not sizes.on_cuda:
        parts += [
            MemoryPart("weights", sizes.weights_bytes, "parameters"),
            MemoryPart("kv cache", sizes.kv_cache_bytes, "blocks x block bytes"),
        ]
        if sizes.state_cache_bytes:
            parts.append(MemoryPart("state slots", sizes.state_cache_bytes,
                                    "slots and snapshots x slot bytes"))
        parts += [
            MemoryPart("encoder cache", sizes.encoder_cache_bytes, "--encoder-cache-bytes"),
            MemoryPart("step workspace", decoder_workspace_bytes(config, model, sizes),
                       "largest decoder step, from the shapes"),
            MemoryPart("vision workspace", vision_workspace_bytes(model, sizes),
                       "largest image's vision tower, from the shapes"),
            MemoryPart("kernel caches", KERNEL_CACHES_BYTES, "oneDNN, 64 entries (measured)"),
        ]
    else:
        parts.append(MemoryPart("pinned staging", pinned_staging_bytes(config, model, sizes),
                                "2 arenas x a step's inputs at their largest, x 2 (growth)"))
    parts += [
        MemoryPart("pixels in flight", config.mm_inflight_budget, "the API's --mm-inflight-budget"),
        MemoryPart("admitted requests", sizes.max_requests * sizes.max_model_len * TOKEN_ID_BYTES,
                   "(max seqs + max waiting) x max len x 36 B"),
        MemoryPart("wire buffers", MAX_PENDING_PER_PEER * sizes.max_num_seqs * OUTPUT_WIRE_BYTES,
                   "steps queued to a slow API process"),
        MemoryPart("allocator slack", ALLOCATOR_SLACK_BYTES,
                   f"{ARENAS} arenas x 64 MiB trim threshold"),
    ]
    return MemoryPlan(process, tuple(parts))


def decoder_workspace_bytes(config: EngineConfig, model: ModelConfig, sizes: EngineSizes) -> int:
    """Tensors alive at once in the largest decoder step: `max_num_batched_tokens` rows
    through one layer (residual, normed input, attention output, q/k/v, and the MLP's gate,
    up and product: the larger of attention and MLP), the image embeddings merged into them,
    the keys and values the padded decode path gathers for a full batch of `max_model_len`
    sequences in one layer, and float32 logits of a full batch (with their softmax and the
    top-p sort) plus one slice of prompt log-probabilities (128 rows)."""
    text = model.text
    b = sizes.dtype_bytes
    rows = config.max_num_batched_tokens
    head_dim = text.head_dim or text.hidden_size // text.num_attention_heads
    q = text.num_attention_heads * head_dim
    kv = text.num_key_value_heads * head_dim
    mlp = (text.moe_intermediate_size * text.num_experts_per_tok
           + text.shared_expert_intermediate_size) if text.num_experts else text.intermediate_size
    per_row = 3 * text.hidden_size + max(q + 2 * kv, 3 * mlp) + text.hidden_size
    gathered_kv = sizes.max_num_seqs * sizes.max_model_len * 2 * kv * b
    logits = (3 * sizes.max_num_seqs + 2 * 128) * text.vocab_size * 4
    return rows * per_row * b + gathered_kv + logits


def pinned_staging_bytes(config: EngineConfig, model: ModelConfig, sizes: EngineSizes) -> int:
    """On CUDA, the pinned host arena a step's inputs cross through (engine_proc/step_staging.py)
    at the largest step, and the decode graphs' staging rows. The arena holds every array of
    one step: per token its id, three positions, KV slot and a sampled or prompt row (8 B
    each); per sequence its offsets, length, state slot and block table; the sampling
    settings; penalties' output and prompt ids padded to the longest (max_model_len each); a
    grammar bitmask (a bit per vocabulary entry). Two such arenas take turns; each grows to
    the power of two above what a step asked, and torch's pinned cache keeps the blocks it
    outgrew (as much again at most)."""
    tokens, seqs = config.max_num_batched_tokens, sizes.max_num_seqs
    blocks = -(-sizes.max_model_len // config.block_size)
    step = 6 * 8 * tokens + seqs * (4 + 4 + 8 + 4 * blocks)
    sampling = seqs * (4 + 4 + 8 + 1 + 8 + 3 * 4 + 8)
    penalties = 2 * 8 * seqs * sizes.max_model_len
    grammar = 4 * seqs * -(-model.text.vocab_size // 32)
    arena = 1 << (step + sampling + penalties + grammar + 32 * 64).bit_length()
    # graph staging: a row per sequence of the largest capture size (at most max_num_seqs),
    # and the mixed steps' ids and positions (a row per token of the largest piecewise size)
    graphs = 0 if config.enforce_eager else (seqs * (8 + 24 + 4 + 8 + 8 + 4 * blocks)
                                             + 32 * min(tokens, MAX_MIXED_SIZE))
    return NUM_ARENAS * 2 * arena + graphs


def vision_workspace_bytes(model: ModelConfig, sizes: EngineSizes) -> int:
    """The vision tower on the largest image the preprocessor allows (its max_pixels, in
    patches): float32 normalized patches, and per block the input, its norm, q/k/v, the
    attention output, a windowed block's gathered copy of q/k/v, and the MLP's gate, up and
    product. Attention itself runs through SDPA's flash kernel, which does not materialize
    the scores (measured: 4096 patches, 4 heads, 13 MB against 256 MB of scores)."""
    vision, image = model.vision, model.image
    patches = image.max_pixels // (image.patch_size ** 2)
    patch_dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
    h = vision.hidden_size
    per_patch = patch_dim * 4 + sizes.dtype_bytes * (3 * h + 3 * h + h + 3 * h + 3 * vision.intermediate_size)
    return patches * per_patch
