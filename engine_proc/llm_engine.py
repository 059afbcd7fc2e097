"""The in-process engine: requests in, per-step token outputs out.

A step is three calls: schedule, run the model, post-process. The engine keeps no reference
to an AddRequest once `add_request` returns: the Sequence copies the token ids and
holds the image arrays itself, so freeing them there (R3) really frees them.

Images are looked up in the encoder cache (engine_proc/encoder_cache.py) when their request
is added: a hit takes the cached embeddings and drops the pixels at once. An image sent
without pixels must be a hit; otherwise the request is refused with ImageMissing
(ErrorCode.IMAGE_MISSING) and the API sends it again with the pixels.
"""

from __future__ import annotations

import logging
import time
import traceback
from concurrent.futures import FIRST_COMPLETED, wait

import numpy as np

from engine_proc.cuda_graphs import capture_sizes
from engine_proc.encoder_cache import EncoderCache, tensor_bytes
from engine_proc.iteration_tokens import IterationTokens
from engine_proc.memory_plan import engine_plan, measured_sizes
from engine_proc.model_runner import ModelRunner
from engine_proc.models.mrope import VisionSpan, vision_positions
from engine_proc.piecewise_graphs import MAX_MIXED_SIZE, mixed_capture_sizes
from engine_proc.scheduler import RequestRejected, ScheduledBatch, Scheduler
from engine_proc.sequence import ImageSpan, Sequence
from engine_proc.structured_output import StructuredOutputs
from engine_proc.tensor_parallel import TensorParallelBroken
from shared.engine_config import EngineConfig
from shared.image_key import pixels_key
from shared.memory_plan import MemoryPlan
from shared.messages import AddRequest, EngineStats, ErrorCode, ImageInput, RequestOutput
from shared.model_config import ModelConfig, load_model_config

logger = logging.getLogger(__name__)

__all__ = ["ImageMissing", "LLMEngine", "RequestRejected"]


class ImageMissing(RequestRejected):
    """An image came without pixels and its key is not in the encoder cache (evicted since
    the API process last heard): the API sends the request again with the pixels."""

GRAMMAR_POLL_S = 0.005  # an idle step waits this long for a grammar being compiled


class LLMEngine:
    """Synchronous engine over one model on one device. Defaults are EngineConfig's.

    KV cache size: `num_kv_blocks` if given, else `kv_cache_memory_bytes`, else
    `kv_cache_memory_fraction` of free device memory on CUDA or 256 MiB on CPU; never more
    blocks than `max_num_seqs` sequences of `max_model_len` tokens could use. `device`
    defaults to cuda when available, `dtype` to the checkpoint's. `enable_prefix_caching`:
    reuse the KV blocks of earlier requests with the same leading tokens and images.
    `encoder_cache_bytes`: -1 sizes the encoder cache from the KV cache
    (ModelRunner.default_encoder_cache_bytes), 0 turns it off."""

    def __init__(
        self,
        model_path: str,
        *,
        max_num_seqs: int = EngineConfig.max_num_seqs,
        max_num_batched_tokens: int = EngineConfig.max_num_batched_tokens,
        max_num_encoder_patches: int = EngineConfig.max_num_encoder_patches,
        encoder_stage_patches: int = EngineConfig.encoder_stage_patches,
        max_model_len: int | None = None,
        num_kv_blocks: int | None = None,
        kv_cache_memory_bytes: int | None = None,
        kv_cache_memory_fraction: float = 0.8,
        gpu_memory_utilization: float | None = None,
        block_size: int = EngineConfig.block_size,
        enable_prefix_caching: bool = EngineConfig.enable_prefix_caching,
        max_waiting: int = EngineConfig.max_waiting,
        device: str | None = None,
        dtype: str | None = None,
        encoder_cache_bytes: int = EngineConfig.encoder_cache_bytes,
        decode_share: float = EngineConfig.decode_share,
        tensor_parallel_size: int = EngineConfig.tensor_parallel_size,
        tp_label: str = "",
        mamba_ssm_cache_dtype: str = EngineConfig.mamba_ssm_cache_dtype,
        mamba_cache_mode: str = EngineConfig.mamba_cache_mode,
        state_snapshot_bytes: int = EngineConfig.state_snapshot_bytes,
        pack_weights: bool = EngineConfig.pack_weights,
        enforce_eager: bool = EngineConfig.enforce_eager,
        cudagraph_capture_sizes: tuple[int, ...] = EngineConfig.cudagraph_capture_sizes,
        max_cudagraph_capture_size: int = EngineConfig.max_cudagraph_capture_size,
        cudagraph_mode: str = EngineConfig.cudagraph_mode,
        graph_stand_in: bool = False,
    ):
        self.config: ModelConfig = load_model_config(model_path)
        self.max_model_len = min(
            max_model_len or self.config.text.max_position_embeddings,
            self.config.text.max_position_embeddings,
        )
        self.model_runner = ModelRunner(
            self.config,
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            kv_cache_memory_fraction=kv_cache_memory_fraction,
            gpu_memory_utilization=gpu_memory_utilization,
            max_num_kv_blocks=max_num_seqs * -(-self.max_model_len // block_size),
            device=device,
            dtype=dtype,
            tensor_parallel_size=tensor_parallel_size,
            tp_label=tp_label,
            max_num_seqs=max_num_seqs,
            max_model_len=self.max_model_len,
            ssm_state_dtype=mamba_ssm_cache_dtype,
            state_snapshot_bytes=(state_snapshot_bytes if enable_prefix_caching
                                  and mamba_cache_mode == "align" else 0),
            pack_weights=pack_weights,
            cuda_graph_sizes=() if enforce_eager or cudagraph_mode == "piecewise" else
            capture_sizes(max_num_seqs, cudagraph_capture_sizes,
                          max_cudagraph_capture_size or None),
            mixed_graph_sizes=() if enforce_eager or cudagraph_mode == "full_decode_only" else
            mixed_capture_sizes(max_num_batched_tokens,
                                max_cudagraph_capture_size or MAX_MIXED_SIZE),
            graph_stand_in=graph_stand_in,
        )
        self._log_cache_sizes()
        if (self.config.text.is_hybrid and enable_prefix_caching
                and not self.model_runner.num_state_snapshots):
            # a KV block hit has no recurrent state at its boundary to resume from
            logger.info("prefix caching is off for %s: no recurrent state snapshots "
                        "(--mamba-cache-mode none or no room for them)",
                        self.config.architecture)
            enable_prefix_caching = False
        if encoder_cache_bytes < 0:
            encoder_cache_bytes = self.model_runner.default_encoder_cache_bytes()
        self.encoder_cache = self.model_runner.encoder_cache = EncoderCache(encoder_cache_bytes)
        self.scheduler = Scheduler(
            num_kv_blocks=self.model_runner.num_kv_blocks,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_encoder_patches=max_num_encoder_patches,
            encoder_stage_patches=encoder_stage_patches,
            num_encoder_stages=self.model_runner.model.num_vision_stages,
            max_model_len=self.max_model_len,
            max_waiting=max_waiting,
            eos_token_ids=self.config.eos_token_ids,
            enable_prefix_caching=enable_prefix_caching,
            decode_share=decode_share,
            num_state_slots=self.model_runner.num_state_slots,
            num_state_snapshots=self.model_runner.num_state_snapshots,
        )
        self.structured = self.model_runner.structured = StructuredOutputs(
            model_path, self.config.text.vocab_size, self.config.eos_token_ids)
        self.compiling: list[Sequence] = []  # waiting for their grammar
        self._caches_on = enable_prefix_caching or self.encoder_cache.enabled
        self.seqs: dict[str, Sequence] = {}  # unfinished, by request id
        self.mm_seqs: list[Sequence] = []  # unfinished and still holding image data
        self.pending_outputs: list[RequestOutput] = []  # aborts, reported by the next step
        self.iteration_tokens = IterationTokens()
        self.gpu_memory_utilization = gpu_memory_utilization

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLMEngine:
        return cls(
            config.model,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_encoder_patches=config.max_num_encoder_patches,
            encoder_stage_patches=config.encoder_stage_patches,
            max_model_len=config.max_model_len or None,
            num_kv_blocks=config.num_kv_blocks or None,
            kv_cache_memory_bytes=config.kv_cache_memory_bytes or None,
            gpu_memory_utilization=config.gpu_memory_utilization,
            block_size=config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            max_waiting=config.max_waiting,
            device=config.device,
            dtype=config.dtype,
            encoder_cache_bytes=config.encoder_cache_bytes,
            decode_share=config.decode_share,
            tensor_parallel_size=config.tensor_parallel_size,
            pack_weights=config.pack_weights,
            enforce_eager=config.enforce_eager,
            cudagraph_capture_sizes=config.cudagraph_capture_sizes,
            max_cudagraph_capture_size=config.max_cudagraph_capture_size,
            cudagraph_mode=config.cudagraph_mode,
            tp_label=f"engine {config.rank}",
            mamba_ssm_cache_dtype=config.mamba_ssm_cache_dtype,
            mamba_cache_mode=config.mamba_cache_mode,
            state_snapshot_bytes=config.state_snapshot_bytes,
        )

    def _log_cache_sizes(self) -> None:
        runner = self.model_runner
        text = self.config.text
        line = (f"KV cache: {runner.num_kv_blocks} blocks of {runner.block_size} tokens, "
                f"{runner.kv_cache_bytes / 2**20:.1f} MiB over {text.num_attention_layers} "
                "attention layers")
        if runner.state_shape is not None:
            line += (f"; recurrent state: {runner.num_state_slots} slots and "
                     f"{runner.num_state_snapshots} prefix-cache snapshots of "
                     f"{runner.state_shape.slot_bytes / 2**20:.2f} MiB, "
                     f"{runner.state_cache_bytes / 2**20:.1f} MiB over {text.num_linear_layers} "
                     f"linear layers ({str(runner.state_shape.ssm_dtype).removeprefix('torch.')})")
        logger.info(line)

    def memory_plan(self, process: str, config: EngineConfig, rss: int) -> MemoryPlan:
        """This engine's memory plan (engine_proc/memory_plan.py), `rss` its RSS now."""
        return engine_plan(process, config, self.config, measured_sizes(self), rss)

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any."""
        runner = self.model_runner
        steps = runner.num_forward_steps
        if (runner.decode_graphs or runner.mixed_graphs) is not None and steps:
            logger.info("%d forwards: %d replayed decode graphs (%.0f%%), %d mixed-step "
                        "pieces (%.0f%%)", steps, runner.num_graph_steps,
                        100 * runner.num_graph_steps / steps, runner.num_piecewise_steps,
                        100 * runner.num_piecewise_steps / steps)
        runner.close()

    @property
    def failure(self) -> str | None:
        """Why the engine cannot run any more (a tensor-parallel rank died), or None."""
        workers = self.model_runner.workers
        return None if workers is None else workers.failure

    # ---- requests ---------------------------------------------------------------------

    def add_request(self, request: AddRequest) -> None:
        """Queue a request; raises RequestRejected (a ValueError) with the reason if the
        engine cannot take it. The engine owns the request's images from here on."""
        if request.request_id in self.seqs:
            raise RequestRejected(f"request id {request.request_id!r} is already running")
        seq = self._make_sequence(request)
        self.scheduler.add(seq)
        self.seqs[seq.request_id] = seq
        if request.sampling.structured is not None:
            seq.grammar_future = self.structured.compile(*request.sampling.structured)
            self.compiling.append(seq)
        if seq.has_images:
            self.mm_seqs.append(seq)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request and free everything it holds; its final output (finish_reason
        "abort") comes with the next step. False if it is unknown or already finished."""
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.finish(seq, "abort")
        self.pending_outputs.append(self._output(seq, []))
        self._prune_mm_seqs()
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.seqs) or bool(self.pending_outputs)

    # ---- the loop ---------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns one output per request that gained a token or
        finished in it."""
        outputs, self.pending_outputs = self.pending_outputs, []
        if self.compiling:
            outputs.extend(self._take_grammars())
        batch = self.scheduler.schedule()
        if not batch:
            if self.compiling:  # nothing to run until a grammar is ready: do not spin
                wait([s.grammar_future for s in self.compiling], GRAMMAR_POLL_S,
                     FIRST_COMPLETED)
            return outputs
        logprobs = None
        started = time.perf_counter()
        try:
            token_ids, logprobs = self.model_runner.run(batch)
        except TensorParallelBroken:
            raise  # the engine's death: the caller fails every request
        except Exception as exc:  # fail this step's requests, keep serving the others
            token_ids = None
            error = f"{type(exc).__name__}: {exc}"
            # the traceback goes out as text: a LogRecord holding exc_info would keep the
            # frames alive, and with them the pixels and embeddings in their locals (R3)
            logger.error("step failed for %d requests: %s", batch.num_seqs, traceback.format_exc())
        if token_ids is None:
            self.scheduler.abandon(batch)
            outputs.extend(self._fail(batch, error))
            return outputs
        self.scheduler.decode_share.account(batch, time.perf_counter() - started)
        seqs = self.scheduler.postprocess(batch, token_ids)
        self.iteration_tokens.count_step(seqs)
        for i, seq in enumerate(seqs):
            output = self._output(seq, [seq.last_token_id])
            if seq.num_completion_tokens == 1 and seq.scheduled_at is not None:
                output.queued_s = seq.scheduled_at - seq.arrived_at
            if logprobs is not None and logprobs[i] is not None:
                output.logprobs = [logprobs[i]]
            if seq.prompt_logprobs is not None:  # complete with the first token: sent once
                output.prompt_logprobs, seq.prompt_logprobs = seq.prompt_logprobs, None
            outputs.append(output)
            if seq.is_finished:
                del self.seqs[seq.request_id]
        if self.mm_seqs:
            self._prune_mm_seqs()
        return outputs

    def generate(self, requests: list[AddRequest]) -> dict[str, list[int]]:
        """Run requests (and any already queued) to completion; returns the completion
        token ids of `requests` by request id."""
        results: dict[str, list[int]] = {}
        for request in requests:
            self.add_request(request)
            results[request.request_id] = []
        while self.has_unfinished_requests():
            for output in self.step():
                if output.request_id not in results:
                    continue  # added earlier through add_request
                if output.error is not None:
                    raise RuntimeError(f"request {output.request_id} failed: {output.error}")
                results[output.request_id].extend(output.new_token_ids)
        return results

    def stats(self) -> EngineStats:
        block_manager = self.scheduler.block_manager
        cache = self.encoder_cache
        return EngineStats(
            num_waiting=self.scheduler.num_waiting,
            num_waiting_deferred=sum(not seq.is_finished for seq in self.compiling),
            num_running=self.scheduler.num_running,
            num_kv_blocks_total=block_manager.num_blocks,
            num_kv_blocks_free=block_manager.num_free_blocks,
            mm_bytes_held=self._mm_bytes_held(),
            num_requests_finished=self.scheduler.num_finished,
            max_requests=self.max_requests,
            prefix_cache_queries=self.scheduler.num_prefix_cache_queries,
            prefix_cache_hits=self.scheduler.num_prefix_cache_hits,
            encoder_cache_bytes=cache.num_bytes,
            encoder_cache_entries=cache.num_entries,
            encoder_cache_queries=cache.num_queries,
            encoder_cache_hits=cache.num_hits,
            num_preemptions=self.scheduler.num_preemptions,
            kv_cache_bytes=self.model_runner.kv_cache_bytes,
            state_cache_bytes=self.model_runner.state_cache_bytes,
            num_state_slots_free=(0 if self.scheduler.state_slots is None
                                  else self.scheduler.state_slots.num_free),
            iteration_tokens_counts=list(self.iteration_tokens.counts),
            iteration_tokens_sum=self.iteration_tokens.sum,
            block_size=block_manager.block_size,
            enable_prefix_caching=block_manager.enable_prefix_caching,
            gpu_memory_utilization=self.gpu_memory_utilization or 0.0,
            cuda_graph_bytes=self.model_runner.cuda_graph_bytes,
            num_forward_steps=self.model_runner.num_forward_steps,
            num_graph_steps=self.model_runner.num_graph_steps,
            num_piecewise_steps=self.model_runner.num_piecewise_steps,
        )

    def take_encoder_key_changes(self) -> tuple[list[bytes], list[bytes]]:
        """The encoder cache's (added, removed) keys since the last call, for the API."""
        return self.encoder_cache.take_key_changes()

    def _mm_bytes_held(self) -> int:
        """Pixels, staged hidden states and embeddings the requests hold, each tensor once:
        embeddings the encoder cache holds count there (encoder_cache_bytes), and spans of
        the same image share one tensor."""
        cache = self.encoder_cache
        total = 0
        counted: set[int] = set()
        for seq in self.mm_seqs:
            for image in seq.images:
                if image.pixels is not None:
                    total += int(image.pixels.nbytes)
                if image.hidden is not None:
                    total += tensor_bytes(image.hidden)
                embeds = image.embeds
                if embeds is not None and id(embeds) not in counted:
                    counted.add(id(embeds))
                    if not cache.holds(image.key, embeds):
                        total += tensor_bytes(embeds)
        return total

    @property
    def max_requests(self) -> int:
        """Requests the engine holds at once: a full batch and a full waiting queue."""
        return self.scheduler.max_num_seqs + self.scheduler.max_waiting

    # ---- helpers ----------------------------------------------------------------------

    def _take_grammars(self) -> list[RequestOutput]:
        """Give sequences whose grammar compiled their matcher (the scheduler admits them
        from then on); fail those whose grammar could not compile."""
        outputs, still = [], []
        for seq in self.compiling:
            future = seq.grammar_future
            if future is None or seq.is_finished:
                continue  # aborted meanwhile
            if not future.done():
                still.append(seq)
                continue
            seq.grammar_future = None
            try:
                seq.grammar = self.structured.matcher(future.result())
            except Exception as exc:  # GrammarError: the request's constraint is bad
                self.scheduler.finish(seq, "error", error=str(exc))
                seq.error_code = ErrorCode.REJECTED
                self.seqs.pop(seq.request_id, None)
                outputs.append(self._output(seq, []))
        self.compiling = still
        return outputs

    def _fail(self, batch: ScheduledBatch, error: str) -> list[RequestOutput]:
        outputs = []
        seqs = list(batch.seqs)
        if batch.encoder_stage is not None:  # its sequence may have no tokens in the step
            seqs += [s for s in self.mm_seqs
                     if s not in seqs and any(i is batch.encoder_stage for i in s.images)]
        for seq in seqs:
            if seq.is_finished:
                continue
            self.scheduler.finish(seq, "error", error=error)
            self.seqs.pop(seq.request_id, None)
            outputs.append(self._output(seq, []))
        self._prune_mm_seqs()
        return outputs

    def _prune_mm_seqs(self) -> None:
        self.mm_seqs = [s for s in self.mm_seqs if not all(image.released for image in s.images)]

    @staticmethod
    def _output(seq: Sequence, new_token_ids: list[int]) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=new_token_ids,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_completion_tokens=seq.num_completion_tokens,
            error=seq.error,
            error_code=ErrorCode.NONE if seq.error is None else (seq.error_code or ErrorCode.INTERNAL),
        )

    def _make_sequence(self, request: AddRequest) -> Sequence:
        token_ids = np.asarray(request.prompt_token_ids, dtype=np.int64)
        if token_ids.ndim != 1 or len(token_ids) == 0:
            raise RequestRejected("prompt_token_ids must be a non-empty list of token ids")
        vocab = self.config.text.vocab_size
        if token_ids.min() < 0 or token_ids.max() >= vocab:
            raise RequestRejected(f"prompt has token ids outside the vocabulary [0, {vocab})")
        if any(t >= vocab for t, _ in request.sampling.logit_bias):
            raise RequestRejected(f"logit_bias names token ids outside the vocabulary [0, {vocab})")
        images = self._image_spans(token_ids, request.images)
        seq = Sequence(request.request_id, token_ids.tolist(), request.sampling, images)
        if images:
            # computed once per sequence; chunks and decodes slice it or add mrope_delta
            spans = [VisionSpan(image.offset, image.grid_thw, image.temporal_pos, image.video)
                     for image in images]
            try:
                positions, delta = vision_positions(
                    len(token_ids), spans, self.config.vision.spatial_merge_size)
            except ValueError as exc:
                raise RequestRejected(f"bad image placement in prompt: {exc}") from None
            if positions.max() >= self.config.text.max_position_embeddings:
                raise RequestRejected("the prompt's positions reach past the model's "
                                      f"{self.config.text.max_position_embeddings}")
            seq.mrope_positions = np.ascontiguousarray(positions, dtype=np.int64)
            seq.mrope_delta = int(delta)
        return seq

    def _image_spans(self, token_ids: np.ndarray, images: list[ImageInput]) -> list[ImageSpan]:
        """Match each image to its run of image placeholder tokens and each video group to
        its run of video placeholder tokens (each kind in order), checking the geometry;
        the spans in prompt order."""
        spans = []
        for video, token_id in ((False, self.config.image_token_id),
                                (True, self.config.video_token_id)):
            of_kind = [image for image in images if bool(image.video) == video]
            spans.extend(self._spans_of_kind(token_ids, of_kind, token_id, video))
        spans.sort(key=lambda span: span.offset)
        return spans

    def _spans_of_kind(self, token_ids: np.ndarray, images: list[ImageInput], token_id: int,
                       video: bool) -> list[ImageSpan]:
        what = "video group" if video else "image"
        placeholder = np.flatnonzero(token_ids == token_id)
        if not images:
            if len(placeholder):
                raise RequestRejected(f"prompt has {len(placeholder)} {what} tokens but no "
                                      f"{what}s")
            return []
        patch = self.config.vision.patch_size
        merge = self.config.vision.spatial_merge_size
        temporal = self.config.vision.temporal_patch_size
        spans = []
        cursor = 0
        for i, image in enumerate(images):
            pixels = image.pixels
            if pixels is None:
                spans.append(self._cached_span(i, image, placeholder, cursor, what))
                cursor += spans[-1].length
                continue
            if (
                not isinstance(pixels, np.ndarray)
                or pixels.dtype != np.uint8
                or pixels.ndim != (4 if video else 3)
                or (video and not 1 <= pixels.shape[0] <= temporal)
                or pixels.shape[-1] != 3
            ):
                shape = f"(1 to {temporal} frames, H, W, 3)" if video else "(H, W, 3)"
                raise RequestRejected(f"{what} {i}: pixels must be a uint8 array of shape {shape}")
            t, h, w = (int(x) for x in image.grid_thw)
            height, width = pixels.shape[-3:-1]
            if t != 1 or h * patch != height or w * patch != width or h % merge or w % merge:
                raise RequestRejected(
                    f"{what} {i}: grid_thw {tuple(image.grid_thw)} does not match pixels {pixels.shape} "
                    f"(patch {patch}, merge {merge})"
                )
            length = h * w // (merge * merge)
            run = placeholder[cursor : cursor + length]
            if len(run) != length or run[-1] - run[0] != length - 1:
                raise RequestRejected(
                    f"{what} {i}: prompt lacks a run of {length} {what} tokens for it"
                )
            # hashing the pixels costs ~1 ms per MB on the engine loop: only for the caches
            key = image.key or (pixels_key(pixels, (t, h, w)) if self._caches_on else b"")
            span = ImageSpan(pixels, (t, h, w), int(run[0]), length, key, video,
                             self._temporal_pos(i, image, video))
            self.encoder_cache.query(span)  # a hit drops the pixels at once
            spans.append(span)
            cursor += length
        if cursor != len(placeholder):
            raise RequestRejected(
                f"prompt has {len(placeholder)} {what} tokens, its {len(images)} {what}s need "
                f"{cursor}"
            )
        return spans

    def _temporal_pos(self, i: int, image: ImageInput, video: bool) -> int:
        try:
            pos = int(image.temporal_pos)
        except (TypeError, ValueError):
            pos = -1
        if pos < 0 or (pos and not video) or pos >= self.config.text.max_position_embeddings:
            raise RequestRejected(f"image {i}: bad temporal_pos {image.temporal_pos!r}")
        return pos

    def _cached_span(self, i: int, image: ImageInput, placeholder: np.ndarray,
                     cursor: int, what: str = "image") -> ImageSpan:
        """An image sent without pixels: it must name a cached key with the same grid; the
        span takes the cached embeddings (its own reference: eviction cannot hurt it)."""
        key = image.key
        if not isinstance(key, bytes) or not key:
            raise RequestRejected(f"image {i}: no pixels and no key")
        try:
            t, h, w = (int(x) for x in image.grid_thw)
        except (TypeError, ValueError):
            raise RequestRejected(f"image {i}: bad grid_thw {image.grid_thw!r}") from None
        merge = self.config.vision.spatial_merge_size
        if t != 1 or h < 1 or w < 1 or h % merge or w % merge:
            raise RequestRejected(f"image {i}: bad grid_thw {(t, h, w)} (merge {merge})")
        length = h * w // (merge * merge)
        run = placeholder[cursor : cursor + length]
        if len(run) != length or run[-1] - run[0] != length - 1:
            raise RequestRejected(f"image {i}: prompt lacks a run of {length} image tokens for it")
        span = ImageSpan(None, (t, h, w), int(run[0]), length, key, bool(image.video),
                         self._temporal_pos(i, image, bool(image.video)))
        if not self.encoder_cache.query(span):
            if key in self.encoder_cache:
                raise RequestRejected(f"image {i}: grid_thw {(t, h, w)} does not match the "
                                      "cached image of that key")
            raise ImageMissing(f"image {i}: sent without pixels and not in the encoder cache")
        if span.embeds.shape[0] != length:  # cannot happen: same grid, same token count
            raise RequestRejected(f"image {i}: cached embeddings have {span.embeds.shape[0]} "
                                  f"tokens, the grid needs {length}")
        return span
