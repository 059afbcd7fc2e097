from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from engine_proc.context import Context, reset_context, set_context
from engine_proc.image_processor import pixels_to_patches
from engine_proc.layers.attention import Attention
from shared.model_config import ModelConfig, load_model_config
from shared.random_checkpoints import ensure_checkpoint
from tests.engine_proc.families import MODEL_CASE_IDS, MODEL_CASES
from tests.tolerance import decoder_terms, rms, tolerance, tolerance_for, vision_terms

# ---- model tests (test_model_*.py), one run per family case (families.py) -----------------


class PagedKV:
    """A minimal stand-in for the block manager + runner: zeroed per-layer KV caches, block
    tables handed out from a shuffled free list, and the Context for a flat batch."""

    def __init__(
        self,
        model: torch.nn.Module,
        num_blocks: int = 256,
        block_size: int = 4,
        host_lens: bool = True,
    ):
        """host_lens: pass the per-sequence lengths on the host like the runner does (CPU
        prefills then run one sequence at a time); False leaves them padded."""
        text = model.config.text
        self.host_lens = host_lens
        param = next(model.parameters())
        self.device = param.device
        self.layers = [m for m in model.modules() if isinstance(m, Attention)]
        self.block_size = block_size
        self.cache = torch.zeros(
            2,
            len(self.layers),
            num_blocks,
            block_size,
            text.num_key_value_heads,
            text.head_dim,
            dtype=param.dtype,
            device=self.device,
        )
        self.activate()
        self.free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)).tolist()
        self.tables: dict[object, list[int]] = {}
        self.lens: dict[object, int] = {}

    def activate(self) -> None:
        """Point the model's attention layers at these caches."""
        for i, layer in enumerate(self.layers):
            layer.k_cache = self.cache[0, i]
            layer.v_cache = self.cache[1, i]

    def context(self, spans: list[tuple[object, int]], num_decodes: int | None = None) -> Context:
        """spans: (sequence key, number of new tokens) in batch order."""
        qsl, seq_lens, slots, tables = [0], [], [], []
        for key, q_len in spans:
            start = self.lens.get(key, 0)
            end = start + q_len
            table = self.tables.setdefault(key, [])
            while len(table) * self.block_size < end:
                table.append(self.free.pop())
            slots += [
                table[i // self.block_size] * self.block_size + i % self.block_size
                for i in range(start, end)
            ]
            self.lens[key] = end
            qsl.append(qsl[-1] + q_len)
            seq_lens.append(end)
            tables.append(list(table))
        width = max(map(len, tables)) + 1  # one spare -1 column, like a padded runner table
        block_tables = torch.full((len(tables), width), -1, dtype=torch.int32)
        for i, row in enumerate(tables):
            block_tables[i, : len(row)] = torch.tensor(row, dtype=torch.int32)
        q_lens = [q for _, q in spans]
        dev = self.device
        ctx = Context(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=block_tables.to(dev),
            max_q_len=max(q_lens),
            max_seq_len=max(seq_lens),
            all_decode=all(q == 1 for q in q_lens),
        )
        if num_decodes is not None:
            ctx.num_decodes = num_decodes
        if self.host_lens:
            ctx.q_lens_host = q_lens
            ctx.seq_lens_host = seq_lens
        return ctx

    def forward(
        self,
        model: torch.nn.Module,
        spans: list[tuple[object, torch.Tensor, torch.Tensor]],
        num_decodes: int | None = None,
    ) -> torch.Tensor:
        """spans: (sequence key, inputs_embeds [q, H], positions [3, q]) -> hidden [T, H]."""
        self.activate()
        set_context(self.context([(key, emb.shape[0]) for key, emb, _ in spans], num_decodes))
        try:
            return model(
                torch.cat([e for _, e, _ in spans]), torch.cat([p for _, _, p in spans], dim=1)
            )
        finally:
            reset_context()


class VLHarness:
    """Our model and transformers' on the same weights, plus prompt/image helpers.
    `source`: the unperturbed checkpoint the weights came from."""

    def __init__(self, path: Path, model, hf, source: Path | None = None):
        self.path = path
        self.cfg: ModelConfig = load_model_config(path)
        self.model = model
        self.hf = hf
        self.source = source

    def with_model(self, model, hf=None) -> VLHarness:
        """The same helpers around another model (another dtype, device or checkpoint)."""
        return VLHarness(Path(model.config.path), model, hf if hf is not None else self.hf,
                         self.source)

    def vision_tolerance(self, reference: torch.Tensor, grids) -> dict[str, float]:
        """The bound on the vision tower's outputs (tests/tolerance.py) for images of `grids`:
        against transformers', or against itself on other shapes (split per image, in stages,
        from one frame), which sums in other orders (other GEMM blockings)."""
        patches = max(t * h * w for t, h, w in grids)
        return tolerance_for(reference, vision_terms(self.cfg.vision, patches))

    def logits_tolerance(self, reference: torch.Tensor, ids: list[int], grids) -> dict[str, float]:
        """The bound on logits for the prompt `ids` against transformers': the vision tower's
        sums where it has images, then the decoder's."""
        terms = decoder_terms(self.cfg.text, len(ids))
        if grids:
            terms += vision_terms(self.cfg.vision, max(t * h * w for t, h, w in grids))
        return tolerance_for(reference, terms)

    def hidden_tolerance(self, reference: torch.Tensor, tokens: int) -> dict[str, float]:
        """The bound on the decoder's hidden states for the same embeddings run in another
        batch (other row counts: other GEMM blockings and attention paths)."""
        return tolerance_for(reference, decoder_terms(self.cfg.text, tokens, logits=False))

    def bf16_tolerance(self, reference: torch.Tensor, grids) -> dict[str, float]:
        """The bound on bfloat16 logits against transformers' in float32 or bfloat16. Sums
        accumulate in fp32; each op's output rounds to bf16 once: about 20 roundings a decoder
        layer or vision block (two norms' casts and scales, four projections and their rounded
        weights, rotary, attention, the activation and its product, two residual adds)."""
        blocks = self.cfg.text.num_hidden_layers + 1  # and the final norm with lm_head
        if grids:
            blocks += self.cfg.vision.depth + 1  # and the merger
        return tolerance(torch.bfloat16, 1, depth=20 * blocks, scale=rms(reference))

    def grid(self, rows: int, cols: int) -> tuple[int, int, int]:
        """The patch grid of an image `rows` x `cols` merge units big (one merged token
        each), whatever the family's patch and merge sizes."""
        m = self.cfg.vision.spatial_merge_size
        return (1, rows * m, cols * m)

    def prompt(self, *parts) -> tuple[list[int], list[tuple[int, int, int]]]:
        """parts: lists of text ids, (rows, cols) images in merge units and (t, h, w) patch
        grids -> (ids with vision_start, image placeholders and vision_end around each
        image, grids)."""
        ids, grids = [], []
        unit = self.cfg.vision.spatial_merge_size**2
        for part in parts:
            if isinstance(part, tuple):
                part = self.grid(*part) if len(part) == 2 else part
                t, h, w = part
                grids.append(part)
                ids += [self.cfg.vision_start_token_id] + [self.cfg.image_token_id] * (
                    t * h * w // unit
                )
                ids += [self.cfg.vision_end_token_id]
            else:
                ids += list(part)
        return ids, grids

    def pixels(self, grid: tuple[int, int, int], seed: int) -> torch.Tensor:
        _, h, w = grid
        p = self.cfg.vision.patch_size
        return torch.randint(
            0,
            256,
            (h * p, w * p, 3),
            dtype=torch.uint8,
            generator=torch.Generator().manual_seed(seed),
        )

    def hf_logits(self, ids: list[int], images: list[torch.Tensor], grids) -> torch.Tensor:
        input_ids = torch.tensor([ids])
        kwargs = {}
        if images:
            kwargs = dict(
                pixel_values=torch.cat(
                    [
                        pixels_to_patches(px, g, self.cfg.image)
                        for px, g in zip(images, grids, strict=True)
                    ]
                ),
                image_grid_thw=torch.tensor(grids),
                mm_token_type_ids=(input_ids == self.cfg.image_token_id).int(),
            )
        with torch.no_grad():
            return self.hf(input_ids=input_ids, **kwargs).logits[0]

    def embeds(self, ids: list[int], images: list[torch.Tensor], grids) -> torch.Tensor:
        ids = torch.tensor(ids, device=self.model.device)
        x = self.model.embed_tokens(ids)
        if images:
            image_rows = ids == self.cfg.image_token_id
            x[image_rows] = torch.cat(self.model.encode_images(images, grids))
        return x

    def positions(self, ids: list[int], grids) -> tuple[torch.Tensor, int]:
        from engine_proc.models.mrope import compute_mrope_positions

        pos, delta = compute_mrope_positions(
            ids,
            grids,
            self.cfg.image_token_id,
            self.cfg.vision_start_token_id,
            self.cfg.vision.spatial_merge_size,
        )
        return torch.from_numpy(pos).to(self.model.device), delta


def hf_class(architecture: str):
    """transformers' own implementation of an architecture (the reference)."""
    import transformers

    return getattr(transformers, architecture)


def _perturbed_checkpoint(src: Path, dst: Path) -> Path:
    """A tiny checkpoint with every tensor nudged, so norms and biases are not the
    trivial 1 / 0 of a fresh init and a mis-loaded tensor cannot go unnoticed."""
    hf = hf_class(load_model_config(src).architecture).from_pretrained(src, dtype=torch.float32)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    hf.save_pretrained(dst)
    for name in ("preprocessor_config.json", "generation_config.json"):
        if (src / name).exists():
            (dst / name).write_bytes((src / name).read_bytes())
    return dst


@pytest.fixture(scope="session", params=MODEL_CASES, ids=MODEL_CASE_IDS)
def family_checkpoint(request) -> Path:
    """The unperturbed tiny checkpoint of each family case (generated once into the cache)."""
    return ensure_checkpoint(request.param)


@pytest.fixture(scope="session")
def vl_checkpoint(family_checkpoint, tmp_path_factory) -> Path:
    return _perturbed_checkpoint(family_checkpoint, tmp_path_factory.mktemp("vl-checkpoint"))


@pytest.fixture(scope="session")
def vl(vl_checkpoint, family_checkpoint) -> VLHarness:
    from engine_proc.models.registry import model_class

    torch.manual_seed(0)
    cfg = load_model_config(vl_checkpoint)
    model = model_class(cfg)(cfg, torch.device("cpu"), torch.float32)
    model.load_weights(vl_checkpoint)
    hf = hf_class(cfg.architecture).from_pretrained(vl_checkpoint, dtype=torch.float32).eval()
    return VLHarness(vl_checkpoint, model, hf, family_checkpoint)


@pytest.fixture
def make_paged_kv(vl):
    """Factory of fresh paged caches on the session model (block size 4 by default, so
    spans cross blocks); the model's layers are left cache-less afterwards."""
    yield lambda model=None, **kwargs: PagedKV(model if model is not None else vl.model, **kwargs)
    for layer in vl.model.modules():
        if isinstance(layer, Attention):
            layer.k_cache = torch.tensor([])
            layer.v_cache = torch.tensor([])


@pytest.fixture
def paged_kv(make_paged_kv):
    return make_paged_kv()


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(0)
