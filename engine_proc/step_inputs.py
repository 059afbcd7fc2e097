"""One forward's inputs on the host, as the model runner computes them from a scheduled
batch, the forward every rank runs on them, and their wire form to tensor-parallel workers.

Wire form: a fixed header of int64 fields, then one int64 payload whose length the header
gives, as raw bytes (all ranks are this project's processes; nothing is pickled). Image
rows do not travel here: they are tensors on the device, broadcast by torch.distributed
(tensor_parallel.py), and their layout in the batch is `image_rows` below.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from engine_proc.context import Context, reset_context, set_context

# header fields, in order
HEADER_FIELDS = ("op", "num_tokens", "num_seqs", "table_width", "num_samples", "all_decode",
                 "num_decodes", "num_pieces", "image_width", "has_state_slots",
                 "num_state_restores", "num_state_saves")
HEADER_BYTES = 8 * len(HEADER_FIELDS)
OP_STEP, OP_EXIT = 1, 2
NO_PAIRS = np.zeros((0, 2), dtype=np.int64)

# (first row in the flat batch, rows) of each image piece, and the pieces' rows stacked
ImagePieces = list[tuple[int, torch.Tensor]]
# (context, inputs_embeds, positions, deepstack) -> hidden states: a step's layers
Decoder = Callable[[Context, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


@dataclass
class StepInputs:
    input_ids: np.ndarray  # int64 [T]
    positions: np.ndarray  # int64 [3, T] (mRoPE; text rows repeat one position)
    query_start_loc: np.ndarray  # int32 [S + 1]
    seq_lens: np.ndarray  # int32 [S], KV length after this forward
    slot_mapping: np.ndarray  # int64 [T]
    block_tables: np.ndarray  # int32 [S, B], padded with -1
    sample_rows: np.ndarray  # int64 [N], rows whose hidden states become logits
    all_decode: bool
    num_decodes: int  # leading q_len == 1 sequences
    image_rows: np.ndarray  # int64 [P, 2]: (first row, number of rows) of each image piece
    image_width: int = 0  # columns of the image rows (hidden, or hidden * (1 + k) DeepStack)
    state_slots: np.ndarray | None = None  # int64 [S]: hybrid models' state slot per sequence
    # hybrid prefix caching: (from, to) state slot copies before and after the forward
    state_restores: np.ndarray = field(default_factory=lambda: NO_PAIRS)  # int64 [R, 2]
    state_saves: np.ndarray = field(default_factory=lambda: NO_PAIRS)  # int64 [W, 2]

    @classmethod
    def copies_only(cls, restores: np.ndarray) -> StepInputs:
        """A step of no tokens that only restores state snapshots (a prefix-cache hit
        admitted while its image is still being encoded, so no chunk of it runs yet)."""
        empty = np.zeros(0, dtype=np.int64)
        return cls(input_ids=empty, positions=np.zeros((3, 0), dtype=np.int64),
                   query_start_loc=np.zeros(1, dtype=np.int32),
                   seq_lens=np.zeros(0, dtype=np.int32), slot_mapping=empty,
                   block_tables=np.zeros((0, 0), dtype=np.int32), sample_rows=empty,
                   all_decode=False, num_decodes=0, image_rows=NO_PAIRS,
                   state_restores=restores)

    def context(self, to_device: Callable[[np.ndarray], torch.Tensor]) -> Context:
        q_lens = np.diff(self.query_start_loc)
        return Context(
            query_start_loc=to_device(self.query_start_loc),
            seq_lens=to_device(self.seq_lens),
            slot_mapping=to_device(self.slot_mapping),
            block_tables=to_device(self.block_tables),
            max_q_len=int(q_lens.max()),
            max_seq_len=int(self.seq_lens.max()),
            all_decode=self.all_decode,
            # hints for layers/attention.py: the leading q_len == 1 sequences, and every
            # sequence's lengths on the host (prefills then run one at a time)
            num_decodes=self.num_decodes,
            q_lens_host=None if self.all_decode else q_lens.tolist(),
            seq_lens_host=None if self.all_decode else self.seq_lens.tolist(),
            state_slots=None if self.state_slots is None else to_device(self.state_slots),
            state_slots_host=(None if self.state_slots is None or self.all_decode
                              else self.state_slots.tolist()),
        )

    # ---- wire form

    def encode(self) -> list[bytes | memoryview]:
        """The header and the payload, to be written in this order."""
        num_seqs, width = self.block_tables.shape
        has_slots = self.state_slots is not None
        header = np.array([OP_STEP, len(self.input_ids), num_seqs, width, len(self.sample_rows),
                           int(self.all_decode), self.num_decodes, len(self.image_rows),
                           self.image_width, int(has_slots), len(self.state_restores),
                           len(self.state_saves)], dtype=np.int64)
        slots = self.state_slots if has_slots else np.zeros(num_seqs, dtype=np.int64)
        payload = np.concatenate([
            self.input_ids, self.positions.reshape(-1), self.query_start_loc, self.seq_lens,
            self.slot_mapping, self.block_tables.reshape(-1), self.sample_rows,
            self.image_rows.reshape(-1), slots, self.state_restores.reshape(-1),
            self.state_saves.reshape(-1)], dtype=np.int64)
        return [header.data, payload.data]

    @staticmethod
    def payload_bytes(header: np.ndarray) -> int:
        _, t, s, b, n, _, _, p, _, _, r, w = header.tolist()
        return 8 * (t + 3 * t + (s + 1) + s + t + s * b + n + 2 * p + s + 2 * r + 2 * w)

    @classmethod
    def decode(cls, header: np.ndarray, payload: bytes | bytearray) -> StepInputs:
        _, t, s, b, n, all_decode, num_decodes, p, width, has_slots, r, w = header.tolist()
        flat = np.frombuffer(payload, dtype=np.int64)
        sizes = [t, 3 * t, s + 1, s, t, s * b, n, 2 * p, s, 2 * r, 2 * w]
        (ids, pos, qsl, seq_lens, slots, tables, samples, images, state_slots, restores,
         saves) = np.split(flat, np.cumsum(sizes)[:-1])
        return cls(
            input_ids=ids, positions=pos.reshape(3, t),
            query_start_loc=qsl.astype(np.int32), seq_lens=seq_lens.astype(np.int32),
            slot_mapping=slots, block_tables=tables.astype(np.int32).reshape(s, b),
            sample_rows=samples, all_decode=bool(all_decode), num_decodes=num_decodes,
            image_rows=images.reshape(p, 2), image_width=width,
            state_slots=state_slots if has_slots else None,
            state_restores=restores.reshape(r, 2), state_saves=saves.reshape(w, 2),
        )


def exit_header() -> bytes:
    header = np.zeros(len(HEADER_FIELDS), dtype=np.int64)
    header[0] = OP_EXIT
    return header.tobytes()


def split_image_rows(inputs: StepInputs, values: torch.Tensor) -> ImagePieces:
    """The stacked rows of every image piece -> (first row, rows) per piece (views)."""
    return list(zip(inputs.image_rows[:, 0].tolist(),
                    values.split(inputs.image_rows[:, 1].tolist()), strict=True))


@torch.inference_mode()
def forward_step(model: torch.nn.Module, inputs: StepInputs, pieces: ImagePieces,
                 to_device: Callable[[np.ndarray], torch.Tensor],
                 state_cache: tuple[torch.Tensor, ...] | None = None,
                 decoder: Decoder | None = None) -> torch.Tensor | None:
    """The decoder's forward over one step, on every rank alike: token embeddings with
    the image pieces' rows written over their placeholders, the layers, and the logits of
    the sampled rows ([N, vocab]; None on tensor-parallel ranks other than 0, or when no
    row is sampled). The pieces are the caller's; nothing here keeps them (R3).
    `state_cache`: a hybrid model's state tensors, whose snapshots are restored before the
    forward and saved after it (engine_proc/state_snapshots.py). `decoder`: what runs the
    layers in place of `model(embeds, positions, deepstack)` (the runner's mixed-step
    pieces, engine_proc/piecewise_graphs.py), given the step's Context too."""
    if not len(inputs.input_ids):  # StepInputs.copies_only
        copy_state_slots(state_cache, inputs.state_restores, to_device)
        return None
    context = inputs.context(to_device)
    set_context(context)
    try:
        if len(inputs.state_restores):
            copy_state_slots(state_cache, inputs.state_restores, to_device)
        inputs_embeds, deepstack = _embed(model, to_device(inputs.input_ids), pieces)
        positions = to_device(inputs.positions)
        if decoder is None:
            hidden = model(inputs_embeds, positions, deepstack)
        else:
            hidden = decoder(context, inputs_embeds, positions, deepstack)
        if len(inputs.state_saves):
            copy_state_slots(state_cache, inputs.state_saves, to_device)
    finally:
        reset_context()
    del inputs_embeds, deepstack
    if not len(inputs.sample_rows):
        return None
    rows = inputs.sample_rows
    if len(rows) < hidden.shape[0] or not np.array_equal(rows, np.arange(len(rows))):
        # the last token of each finished chunk (then prompt rows, prompt_logprobs.py)
        hidden = hidden[to_device(rows)]
    return model.compute_logits(hidden)


def forward_decode_buffers(model: torch.nn.Module, buffers, block_size: int) -> torch.Tensor:
    """A decode-only step's hidden states [size, hidden] from the static buffers a CUDA
    graph records (engine_proc/cuda_graphs.py's DecodeBuffers): nothing here depends on the
    lengths on the host, so the recorded kernels replay for any step of that size. The
    logits are computed outside (eager): a row per sequence of the whole vocabulary."""
    size = buffers.input_ids.shape[0]
    set_context(Context(
        query_start_loc=buffers.query_start_loc, seq_lens=buffers.seq_lens,
        slot_mapping=buffers.slot_mapping, block_tables=buffers.block_tables, max_q_len=1,
        max_seq_len=buffers.block_tables.shape[1] * block_size, all_decode=True,
        num_decodes=size, state_slots=buffers.state_slots))
    try:
        return model(model.embed_tokens(buffers.input_ids), buffers.positions, None)
    finally:
        reset_context()


def capture_layout(num_tokens: int, padding, block_size: int,
                   device: torch.device) -> Context:
    """The layout mixed-step pieces are captured on (engine_proc/piecewise_graphs.py): one
    sequence of `num_tokens` fresh tokens whose keys all go to the padding slot (its block
    table the padding block throughout: paths that read keys from the cache stay in it),
    and no recurrent state kept (its layers start from zeros and write no slot)."""
    def tensor(values, dtype):
        return torch.tensor(values, dtype=dtype, device=device)

    num_blocks = -(-num_tokens // block_size)
    return Context(
        query_start_loc=tensor([0, num_tokens], torch.int32),
        seq_lens=tensor([num_tokens], torch.int32),
        slot_mapping=torch.full((num_tokens,), padding.slot, dtype=torch.int64, device=device),
        block_tables=tensor([[padding.block] * num_blocks], torch.int32),
        max_q_len=num_tokens,
        max_seq_len=num_tokens, num_decodes=0, q_lens_host=[num_tokens],
        seq_lens_host=[num_tokens])


def forward_capture_layout(model: torch.nn.Module, inputs_embeds: torch.Tensor,
                           positions: torch.Tensor, deepstack: torch.Tensor | None,
                           context: Context) -> torch.Tensor:
    """Hidden states [T, hidden] of a mixed step's pieces on the capture layout (built
    before the capture: `capture_layout`); the eager ops between them (attention, state
    updates) see the step's own layout at replay."""
    set_context(context)
    try:
        return model(inputs_embeds, positions, deepstack)
    finally:
        reset_context()


def copy_state_slots(state_cache: tuple[torch.Tensor, ...], pairs: np.ndarray,
                     to_device: Callable[[np.ndarray], torch.Tensor]) -> None:
    """Copy each pair's first slot over its second, in every state tensor (layers first)."""
    src, dst = to_device(np.ascontiguousarray(pairs[:, 0])), to_device(np.ascontiguousarray(pairs[:, 1]))
    for tensor in state_cache:
        tensor.index_copy_(1, dst, tensor.index_select(1, src))


def _embed(model: torch.nn.Module, input_ids: torch.Tensor,
           pieces: ImagePieces) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token embeddings with image rows written over the placeholder rows, and for
    DeepStack models (Qwen3-VL) the image rows' DeepStack features [T, k * hidden] (zero on
    text rows), or None. An image's rows carry its DeepStack features as extra columns."""
    inputs_embeds = model.embed_tokens(input_ids)
    if not pieces:
        return inputs_embeds, None  # text-only: no vision work at all
    width = inputs_embeds.shape[1]
    num_deepstack = len(model.config.vision.deepstack_visual_indexes)
    deepstack = None
    if num_deepstack:
        deepstack = inputs_embeds.new_zeros(inputs_embeds.shape[0], num_deepstack * width)
    for dst, rows in pieces:
        inputs_embeds[dst : dst + rows.shape[0]] = rows[:, :width]
        if deepstack is not None:
            deepstack[dst : dst + rows.shape[0]] = rows[:, width:]
    return inputs_embeds, deepstack
