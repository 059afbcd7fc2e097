"""Continuous batching with chunked prefill under a per-step token budget.

Each step builds one flat batch: first a decode token for every running sequence that has
finished its prefill, then the next prefill chunk of running sequences still prefilling,
then new sequences from the waiting queue, until `max_num_batched_tokens` or
`max_num_seqs` is reached. A prefill chunk may end anywhere, also inside an image's
placeholder tokens.

Vision work per step is bounded too: the images a step encodes may hold at most
`max_num_encoder_patches` patches together. A chunk that would reach an image over what is
left of that budget ends just before the image's placeholder tokens, and the image is
encoded in a later step; a step's first image is encoded whatever its size. An image of
more than `encoder_stage_patches` patches is encoded in stages (the vision tower cut at its
full-attention blocks), one stage per step and alone, ahead of the chunk that consumes it:
its pixels go at the first stage, the hidden states between stages are all it holds. So a
burst of large images cannot freeze the running decodes: each step carries at most one
budget of vision work, one image, or one stage of one image, beside them. Images are
encoded in arrival order, one step's worth at a time, and every running decode gets its
token in each of those steps: a request's first token comes one or two vision steps after
its image reaches the head of the queue.

Preemption is by recompute (free the blocks, requeue at the front, prefill again) and only
ever hits text-only sequences. R3 frees an image's pixels and embeddings once its last
placeholder token is in the KV cache, after which the sequence could not be recomputed. So
a sequence with images reserves, at admission, blocks for its whole life (prompt +
max_tokens, capped at max_model_len): it never asks for a block later and is never
preempted. A text-only sequence that cannot grow preempts the newest text-only sequence not
yet scheduled this step, or itself. Image sequences always finish and free their blocks,
so the queue always drains. Requests that could never fit are rejected at `add`.

With prefix caching, a sequence admitted from the waiting queue starts after the longest
run of its full blocks already in the cache (see `BlockManager`), one token short of its
end at most. Its images wholly inside that run are never encoded (released at admission,
R3); an image the run ends inside is encoded whole and only its rows after the run used.
A preempted text sequence re-admitted this way finds its own blocks if they survived.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from engine_proc.block_manager import BlockManager
from engine_proc.sequence import ImageSpan, Sequence, SequenceStatus
from engine_proc.state_cache import StateSlots
from engine_proc.state_snapshots import StateSnapshots


class RequestRejected(ValueError):
    """The engine cannot take this request (too long, malformed, or the queue is full)."""


class QueueFull(RequestRejected):
    """The waiting queue is full: the request may succeed later or on another engine."""


MAX_PROMPT_LOGPROB_ROWS = 512  # prompt rows whose logits one step computes (prompt_logprobs)


@dataclass
class ScheduledBatch:
    """The sequences of one step and how many new tokens each computes. Sequence `i`
    computes tokens `[num_computed_tokens, num_computed_tokens + num_new_tokens[i])`;
    it samples a token when that range reaches its last token."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    num_decode_seqs: int = 0  # the first num_decode_seqs entries compute exactly one token
    encoder_stage: ImageSpan | None = None  # an image this step runs one vision stage of
    ran_vision: bool = False  # it encodes images or runs a vision stage
    # hybrid prefix caching (engine_proc/state_snapshots.py): (snapshot, slot) copied before
    # the forward; (sequence, snapshot, tokens) of the states saved after it
    state_restores: list[tuple[int, int]] = field(default_factory=list)
    state_saves: list[tuple[Sequence, int, int]] = field(default_factory=list)

    def add(self, seq: Sequence, num_new_tokens: int) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(num_new_tokens)

    @property
    def num_seqs(self) -> int:
        return len(self.seqs)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def all_decode(self) -> bool:
        return self.num_decode_seqs == len(self.seqs)

    def __bool__(self) -> bool:
        return bool(self.seqs) or self.encoder_stage is not None


class _EncoderBudget:
    """The vision work one step may still do: patches of whole images, or one stage of
    one image over the budget (`staged`: the image being encoded in stages, if any)."""

    def __init__(self, max_patches: int, stage_patches: int, num_stages: int,
                 staged: ImageSpan | None) -> None:
        self.max_patches = max_patches
        self.stage_patches = stage_patches
        self.left = max_patches
        self.used = False
        self.num_stages = num_stages
        self.staged = staged
        self.stage: ImageSpan | None = None

    def fit(self, seq: Sequence, start: int, num_new: int) -> int:
        """How many of `num_new` tokens from `seq`'s token `start` (its first uncomputed
        one) the step can take: up to the first image it cannot encode within the budget
        (at least one image per step, however large, unless it is over the stage threshold
        and the model's tower has stages) or that is still being encoded in stages. Charges
        the images the returned chunk reaches. An image that starts before `start` but ends
        after it (a prefix cache hit ending inside it) is encoded whole unless that happened
        already."""
        for image in seq.images:
            if image.offset >= start + num_new:
                break
            if image.end <= start or image.embeds is not None:
                continue  # consumed already, or encoded by an earlier chunk or in stages
            patches = image.num_patches
            if patches > self.stage_patches and self.num_stages > 1:
                if not self.used and self.staged in (None, image):
                    self.take_stage(image)
                return max(image.offset - start, 0)
            if self.used and patches > self.left:
                return max(image.offset - start, 0)
            self.left -= patches
            self.used = True
        return num_new

    def take_stage(self, image: ImageSpan) -> None:
        self.stage = self.staged = image
        self.left = 0
        self.used = True


class DecodeShare:
    """Time owed to running decodes for a step that ran the vision tower.

    A step that runs vision work (an image encoded whole, or one stage of a large one) is
    long next to a decode step: on the tiny model on 2 CPU cores, ~250 ms against ~8 ms.
    Every running decode gets one token in it, so without more a request decodes at one
    token per vision step, and in a burst of images its decode takes as long as the
    burst. After such a step, decode-only steps (no prefill chunk, no admission, no
    vision) run until they have taken `share` of its time; then vision work resumes. The
    vision work loses at most that share of its time (less: the decodes run then are not
    run later); a running decode gets 1 + share * vision step / decode step tokens per
    vision step instead of 1."""

    def __init__(self, share: float) -> None:
        self.share = share
        self.owed_s = 0.0
        self.decode_step_s: float | None = None  # recent decode-only step time, measured

    def wants_decode_step(self) -> bool:
        if self.owed_s <= 0.0:
            return False
        return self.decode_step_s is None or self.owed_s >= 0.5 * self.decode_step_s

    def account(self, batch: ScheduledBatch, seconds: float) -> None:
        """Charge a step that ran for `seconds` (the engine's clock, model included)."""
        if batch.ran_vision:
            self.owed_s = self.share * seconds  # owed for this step alone: no backlog
        elif batch.seqs and batch.all_decode:
            self.owed_s -= seconds
            last = self.decode_step_s
            self.decode_step_s = seconds if last is None else 0.75 * last + 0.25 * seconds
        elif batch.seqs:
            self.owed_s = 0.0  # nothing was decoding when it was owed: it lapses


class Scheduler:
    def __init__(
        self,
        *,
        num_kv_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        max_waiting: int,
        max_num_encoder_patches: int = 4096,
        encoder_stage_patches: int | None = None,
        num_encoder_stages: int = 1,
        eos_token_ids: tuple[int, ...] = (),
        enable_prefix_caching: bool = True,
        decode_share: float = 0.0,
        num_state_slots: int = 0,
        num_state_snapshots: int = 0,
    ):
        """num_state_slots: hybrid models' recurrent state slots (engine_proc/state_cache.py),
        one per running sequence; 0 for models without. num_state_snapshots: with prefix
        caching, the states kept at block boundaries (engine_proc/state_snapshots.py), in
        the slots after the running ones. encoder_stage_patches: images over it are encoded
        in stages (None: over max_num_encoder_patches)."""
        if max_num_batched_tokens < max_num_seqs:
            # every running sequence must get its decode token each step, or some starve
            raise ValueError(
                f"max_num_batched_tokens ({max_num_batched_tokens}) must be at least "
                f"max_num_seqs ({max_num_seqs})"
            )
        self.block_manager = BlockManager(num_kv_blocks, block_size, enable_prefix_caching)
        self.state_slots = StateSlots(num_state_slots) if num_state_slots else None
        self.snapshots = None
        if num_state_slots and enable_prefix_caching and num_state_snapshots:
            self.snapshots = StateSnapshots(num_state_slots, num_state_snapshots)
        if num_state_slots:
            max_num_seqs = min(max_num_seqs, num_state_slots)  # a slot for every running one
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.max_waiting = max_waiting
        self.max_num_encoder_patches = max_num_encoder_patches
        self.encoder_stage_patches = (max_num_encoder_patches if encoder_stage_patches is None
                                      else encoder_stage_patches)
        self.num_encoder_stages = num_encoder_stages
        self.staged: ImageSpan | None = None  # the image being encoded in stages
        self.decode_share = DecodeShare(decode_share)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_finished = 0
        self.num_preemptions = 0
        # prefix caching, cumulative over admissions (vLLM's meaning): tokens looked up,
        # tokens found cached
        self.num_prefix_cache_queries = 0
        self.num_prefix_cache_hits = 0

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def max_num_cached_tokens(self, seq: Sequence) -> int:
        """The most tokens `seq` can ever hold in the KV cache (its last token is sampled
        but never written, hence the - 1)."""
        return min(seq.num_prompt_tokens + seq.sampling.max_tokens, self.max_model_len) - 1

    def num_tokens_to_reserve(self, seq: Sequence) -> int:
        return self.max_num_cached_tokens(seq) if seq.has_images else seq.num_tokens

    def add(self, seq: Sequence) -> None:
        if seq.num_prompt_tokens >= self.max_model_len:
            raise RequestRejected(
                f"prompt has {seq.num_prompt_tokens} tokens, which leaves no room for output "
                f"within max_model_len={self.max_model_len}"
            )
        # a sequence that outgrows the whole cache would preempt itself forever
        num_blocks = self.block_manager.num_blocks_for(self.max_num_cached_tokens(seq))
        if num_blocks > self.block_manager.num_blocks:
            raise RequestRejected(
                f"request needs up to {num_blocks} KV cache blocks (prompt + max_tokens) but "
                f"the whole cache has {self.block_manager.num_blocks}"
            )
        if len(self.waiting) >= self.max_waiting:
            raise QueueFull(f"engine queue is full ({self.max_waiting} waiting requests)")
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        # prompt_logprobs: logits of every prompt row, not only the last; the step holds
        # them all at once, so their number is capped (vLLM's prefills do the same)
        rows_left = MAX_PROMPT_LOGPROB_ROWS
        staged = self.staged
        if staged is not None and (staged.embeds is not None or staged.released):
            staged = None  # encoded, or its request is gone
        encoder = _EncoderBudget(self.max_num_encoder_patches, self.encoder_stage_patches,
                                 self.num_encoder_stages, staged)
        scheduled: set[int] = set()
        preempted = False
        # 1. one decode token for every sequence past its prefill
        block_size = self.block_manager.block_size
        prefilling: list[Sequence] = []
        for seq in list(self.running):
            if seq.status != SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_uncomputed = len(seq.token_ids) - seq.num_computed_tokens
            if num_uncomputed != 1:
                prefilling.append(seq)
                continue
            if len(seq.block_table) * block_size < len(seq.token_ids):  # needs a new block
                if not self._make_room(seq, scheduled):
                    preempted = True
                    continue
                self.block_manager.append(seq)
            batch.add(seq, 1)
            scheduled.add(seq.seq_id)
            if self.snapshots is not None:
                self._plan_save(batch, seq, seq.num_computed_tokens + 1)
        budget -= batch.num_seqs
        batch.num_decode_seqs = batch.num_seqs
        if batch.seqs and self.decode_share.wants_decode_step():
            return batch  # decode-only: time owed to the decodes by a vision step
        # 2. the next chunk of sequences still prefilling (all their blocks are allocated)
        for seq in prefilling:
            if budget == 0:
                break
            if seq.status != SequenceStatus.RUNNING:
                continue  # preempted to make room for a decode
            num_new = min(len(seq.token_ids) - seq.num_computed_tokens, budget)
            if seq.has_images:
                num_new = encoder.fit(seq, seq.num_computed_tokens, num_new)
            if seq.wants_prompt_logprobs:
                num_new = min(num_new, rows_left)
            if num_new:
                num_new = self._add_chunk(batch, seq, seq.num_computed_tokens, num_new)
                budget -= num_new
                rows_left -= num_new if seq.wants_prompt_logprobs else 0
        # 3. admit waiting sequences (not in a step that had to preempt: they would thrash)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            if preempted and self.running:
                break
            # FIFO, except that a request whose grammar is still compiling holds no one back
            seq = next((s for s in self.waiting if s.grammar_future is None), None)
            if seq is None:
                break
            # prompt_logprobs need every prompt row computed: no cached prefix
            cached = [] if seq.wants_prompt_logprobs else self.block_manager.find_cached_blocks(seq)
            snapshot = None
            if self.snapshots is not None:
                cached, snapshot = self._cut_to_snapshot(seq, cached)
            num_tokens = self.num_tokens_to_reserve(seq)
            if not self.block_manager.can_allocate(num_tokens, cached):
                break
            num_cached_tokens = len(cached) * block_size
            num_new = min(seq.num_tokens - num_cached_tokens, budget)
            if seq.has_images:
                num_new = encoder.fit(seq, num_cached_tokens, num_new)
                # a chunk of none may still be admitted: its image's first vision stage
                # runs in this step (an image that starts inside the cached prefix)
                if not num_new and not any(image is encoder.stage for image in seq.images):
                    break  # its first image waits for the next step's encoder budget (FIFO)
            if seq.wants_prompt_logprobs:
                if not rows_left:
                    break  # this step's prompt rows are taken (FIFO)
                num_new = min(num_new, rows_left)
                rows_left -= num_new
            self.waiting.remove(seq)
            self.block_manager.allocate(seq, num_tokens, cached)
            self._admit(seq, num_cached_tokens)
            if snapshot is not None:
                batch.state_restores.append((snapshot, seq.state_slot))
            if num_new:
                num_new = self._add_chunk(batch, seq, num_cached_tokens, num_new)
                budget -= num_new
        if encoder.stage is None and encoder.staged is not None and not encoder.used:
            encoder.take_stage(encoder.staged)  # its sequence was not reached this step
        batch.encoder_stage = encoder.stage
        batch.ran_vision = encoder.used
        self.staged = encoder.staged
        return batch

    def _cut_to_snapshot(self, seq: Sequence, cached: list[int]) -> tuple[list[int], int | None]:
        """Hybrid models: the cached run cut back to its last block with a state snapshot
        after it, and that snapshot (or no blocks and None)."""
        for i in range(len(cached) - 1, -1, -1):
            snapshot = self.snapshots.lookup(seq.block_hashes[i])
            if snapshot is not None:
                return cached[: i + 1], snapshot
        return [], None

    def _add_chunk(self, batch: ScheduledBatch, seq: Sequence, start: int, num_new: int) -> int:
        """Add `seq`'s prefill chunk of up to `num_new` tokens from `start`; returns its
        length. Hybrid prefix caching cuts it at the last block boundary of the prompt (so
        that state can be kept) and plans the save."""
        if self.snapshots is not None:
            boundary = self._prompt_boundary(seq)
            if start < boundary < start + num_new:
                num_new = boundary - start
            if start + num_new == boundary:
                self._plan_save(batch, seq, boundary)
        batch.add(seq, num_new)
        return num_new

    def _prompt_boundary(self, seq: Sequence) -> int:
        """The last block boundary before the prompt's last token (whose logits a hit
        must still compute): where a later request with this prompt and more resumes."""
        block_size = self.block_manager.block_size
        return (seq.num_prompt_tokens - 1) // block_size * block_size

    def _plan_save(self, batch: ScheduledBatch, seq: Sequence, num_tokens: int) -> None:
        """Save `seq`'s state after this step when its computed tokens then end a block."""
        if num_tokens == 0 or num_tokens % self.block_manager.block_size:
            return
        snapshot = self.snapshots.take()
        if snapshot is not None:
            batch.state_saves.append((seq, snapshot, num_tokens))

    def _register_saves(self, batch: ScheduledBatch) -> None:
        """The step ran: its saved snapshots become findable under their blocks' hashes.
        A sequence keeps one snapshot of its decoding (the latest) beside its prompt's."""
        block_size = self.block_manager.block_size
        for seq, snapshot, num_tokens in batch.state_saves:
            digest = seq.block_hashes[num_tokens // block_size - 1]
            if self.snapshots.register(snapshot, digest) and num_tokens > seq.num_prompt_tokens:
                if seq.decode_snapshot is not None:
                    self.snapshots.release_if_holds(*seq.decode_snapshot)
                seq.decode_snapshot = (snapshot, digest)

    def abandon(self, batch: ScheduledBatch) -> None:
        """A step that failed: the snapshots it was to save hold nothing."""
        if self.snapshots is not None:
            for _, snapshot, _ in batch.state_saves:
                self.snapshots.release(snapshot)

    def _admit(self, seq: Sequence, num_cached_tokens: int) -> None:
        """Start running `seq`, whose first `num_cached_tokens` tokens were found cached."""
        if self.block_manager.enable_prefix_caching:
            self.num_prefix_cache_queries += seq.num_tokens
            self.num_prefix_cache_hits += num_cached_tokens
        seq.num_computed_tokens = num_cached_tokens
        if self.state_slots is not None:
            seq.state_slot = self.state_slots.take()
        if seq.scheduled_at is None:
            seq.scheduled_at = time.monotonic()
            seq.num_cached_tokens = num_cached_tokens
        if num_cached_tokens and seq.has_images:
            seq.release_consumed_images()  # R3: wholly cached, they are never encoded
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def _make_room(self, seq: Sequence, scheduled: set[int]) -> bool:
        """Preempt until `seq` can take its next token; False if `seq` itself had to go."""
        while not self.block_manager.can_append(seq):
            victim = next(
                (
                    s
                    for s in reversed(self.running)
                    if s is not seq and not s.has_images and s.seq_id not in scheduled
                ),
                None,
            )
            if victim is not None:
                self.preempt(victim)
            elif not seq.has_images:
                self.preempt(seq)
                return False
            else:  # cannot happen (image sequences reserve their blocks); wait a step
                return False
        return True

    def preempt(self, seq: Sequence) -> None:
        assert not seq.has_images, "sequences with images are never preempted (R3)"
        self.running.remove(seq)
        self.block_manager.free(seq)
        self._free_state_slot(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _free_state_slot(self, seq: Sequence) -> None:
        """Its slot goes back; its snapshots stay (a later request may resume from them)."""
        if seq.state_slot >= 0:
            self.state_slots.free(seq.state_slot)
            seq.state_slot = -1

    def postprocess(self, batch: ScheduledBatch, sampled_token_ids: list[int]) -> list[Sequence]:
        """Account for a finished step; returns the sequences that got a token, in batch
        order (finished ones have status FINISHED and hold nothing any more)."""
        out: list[Sequence] = []
        it = iter(sampled_token_ids)
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens, strict=True):
            seq.num_computed_tokens += num_new
            self.block_manager.cache_computed_blocks(seq)
            if seq.has_images:
                seq.release_consumed_images()  # R3: the chunk that consumed them has run
            if seq.num_computed_tokens < seq.num_tokens:
                continue  # a prefill chunk that did not reach the end: nothing sampled
            token_id = next(it)
            seq.append_token(token_id)
            if seq.thinking is not None:
                seq.thinking.accept(token_id)
            if seq.grammar is not None:
                seq.grammar.accept_token(token_id)
            out.append(seq)
            reason = self._finish_reason(seq, token_id)
            if reason is not None:
                self.finish(seq, reason)
        if batch.state_saves:
            self._register_saves(batch)
        return out

    def _finish_reason(self, seq: Sequence, token_id: int) -> str | None:
        sampling = seq.sampling
        if not sampling.ignore_eos and token_id in self.eos_token_ids:
            return "stop"
        if token_id in sampling.stop_token_ids:
            return "stop"
        if seq.grammar is not None and seq.grammar.is_terminated():
            return "stop"  # the completion matches its grammar and cannot grow
        if seq.num_completion_tokens >= sampling.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        """Retire a sequence wherever it is and free everything it holds."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        else:
            return
        self.block_manager.free(seq)
        self._free_state_slot(seq)
        seq.release_multimodal()
        seq.generator = None
        seq.grammar = None
        if seq.grammar_future is not None:
            seq.grammar_future.cancel()
            seq.grammar_future = None
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.error = error
        self.num_finished += 1
