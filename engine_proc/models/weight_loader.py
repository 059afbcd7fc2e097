"""Loading a Hugging Face safetensors checkpoint into a model by tensor name.

Shared by every model class: checkpoint tensor names are mapped to this project's
parameter names (prefix renames, q/k/v and gate/up shards merged into one layer), every
tensor must find a place and every parameter must be filled, or loading fails by name.
A layer split over tensor-parallel ranks names the part of a tensor it holds
(`checkpoint_slice`) and only that part is read from the file.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import re
import struct
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from engine_proc.layers.linear import MergedLinear, store_weights_transposed

# checkpoint projection name -> (merged module name, shard)
PACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    # Gated DeltaNet (Qwen3.5): q/k/v, the output gate z, and the b/a heads
    "in_proj_qkv": ("in_proj", 0),
    "in_proj_z": ("in_proj", 1),
    "in_proj_b": ("in_proj", 2),
    "in_proj_a": ("in_proj", 3),
}
# Qwen3.5-MoE saved by transformers 5.24: one tensor per expert and projection
PER_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
# multi-token-prediction heads (Qwen3.5's mtp.*): speculative decoding, not served here
SKIPPED_PREFIXES = ("mtp.",)
# transformers 5 saves the inner model's children under model.*; published Qwen2.5-VL
# checkpoints (and these modules) use model.* for the decoder and visual.* for the tower.
PREFIXES = (("model.language_model.", "model."), ("model.visual.", "visual."))
INDEX_FILE = "model.safetensors.index.json"

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _renamed(name: str) -> str:
    for old, new in PREFIXES:
        if name.startswith(old):
            return new + name[len(old) :]
    return name


def local_name(name: str) -> tuple[str, int | None]:
    """Checkpoint tensor name -> (this module's parameter name, shard of a merged layer)."""
    name = _renamed(name)
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in PACKED:
        merged, shard = PACKED[parts[-2]]
        parts[-2] = merged
        return ".".join(parts), shard
    return name, None


def checkpoint_files(folder: Path) -> list[Path]:
    """The shards model.safetensors.index.json names when it is there (as transformers
    does: other *.safetensors beside them, such as a consolidated copy, are not this
    checkpoint), else every *.safetensors file."""
    index = folder / INDEX_FILE
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [folder / name for name in names]
        absent = [name for name in names if not (folder / name).is_file()]
        if absent:
            raise FileNotFoundError(f"{index} names shards that are not there: {absent[:3]}")
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {folder}")
    return files


# safetensors' dtype names -> bytes per element
SAFETENSORS_DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4,
                           "F16": 2, "BF16": 2, "I16": 2, "U16": 2, "F8_E4M3": 1,
                           "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1}


def checkpoint_weight_bytes(folder: str | Path, float_bytes: int | None = None) -> int:
    """Bytes the weights of a checkpoint take once loaded, read from the safetensors headers
    alone (8 bytes of length, then a JSON header: nothing else of the file is read).
    `float_bytes`: the element size floating tensors are cast to (--dtype); None keeps the
    checkpoint's. Skipped tensors (mtp.*) are not counted."""
    total = 0
    for path in checkpoint_files(Path(folder)):
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        for name, info in header.items():
            if name == "__metadata__" or name.startswith(SKIPPED_PREFIXES):
                continue
            size = SAFETENSORS_DTYPE_BYTES[info["dtype"]]
            if float_bytes and info["dtype"].startswith(("F", "BF")):
                size = float_bytes
            total += math.prod(info["shape"]) * size
    return total


def _needed(model: nn.Module, tied: bool) -> set[tuple[str, int | None]]:
    needed: set[tuple[str, int | None]] = set()
    for module_name, module in model.named_modules():
        shards = range(len(module.offsets) - 1) if isinstance(module, MergedLinear) else [None]
        for leaf, _ in module.named_parameters(recurse=False):
            name = f"{module_name}.{leaf}" if module_name else leaf
            if not (tied and name == "lm_head.weight"):
                needed.update((name, shard) for shard in shards)
    return needed


def _read(f, key: str, owner: nn.Module, name: str, shard: int | None) -> torch.Tensor:
    """The checkpoint tensor `key`, or only the part of it that `owner` holds."""
    if not hasattr(owner, "checkpoint_slice"):
        return f.get_tensor(key)
    lazy = f.get_slice(key)
    index = owner.checkpoint_slice(name.rsplit(".", 1)[-1], shard, tuple(lazy.get_shape()))
    return f.get_tensor(key) if index is None else lazy[index]


def _owner(model: nn.Module, name: str) -> nn.Module:
    return model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model


def _copy(owner: nn.Module, key: str, shard: int | None, tensor: torch.Tensor,
          param: torch.Tensor) -> None:
    if shard is not None:
        owner.load_shard(param, tensor, shard)
    elif hasattr(owner, "load_tensor"):  # a layer whose layout differs from the file's
        owner.load_tensor(key, param, tensor)
    elif tensor.shape != param.shape:
        raise ValueError(f"{key}: shape {tuple(tensor.shape)} != {tuple(param.shape)}")
    else:
        param.copy_(tensor)


@torch.no_grad()
def load_checkpoint(model: nn.Module, path: str | Path, tied: bool,
                    skip_prefixes: tuple[str, ...] = ()) -> None:
    """Fill every parameter of `model` from the checkpoint in `path`; `tied`: lm_head
    shares the token embeddings (a saved lm_head.weight is skipped); tensors whose name
    (after renaming) starts with one of `skip_prefixes` belong to parts the model left out."""
    params = dict(model.named_parameters())
    needed = _needed(model, tied)
    loaded: set[tuple[str, int | None]] = set()
    experts = _ExpertTensors(model, params)
    num_skipped = 0
    for file in checkpoint_files(Path(path)):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():
                if key.startswith(SKIPPED_PREFIXES):
                    num_skipped += 1
                    continue
                if experts.load(f, key):
                    continue
                name, shard = local_name(key)
                if (tied and name == "lm_head.weight") or name.startswith(skip_prefixes):
                    continue
                if name not in params:
                    if key.endswith("rotary_emb.inv_freq"):
                        continue
                    raise KeyError(f"checkpoint tensor {key} has no place in the model")
                owner = _owner(model, name)
                _copy(owner, key, shard, _read(f, key, owner, name, shard), params[name])
                loaded.add((name, shard))
    if num_skipped:
        logger.info("skipped %d multi-token-prediction tensors (mtp.*): flatserve does not "
                    "run speculative decoding", num_skipped)
    loaded |= experts.complete()
    missing = needed - loaded
    if missing:
        names = sorted(f"{n}[{s}]" if s is not None else n for n, s in missing)
        raise KeyError(f"checkpoint lacks {len(names)} tensors, e.g. {names[:5]}")
    device = next(model.parameters()).device
    if device.type == "cpu":
        store_weights_transposed(model)


class _ExpertTensors:
    """Per-expert checkpoint tensors loaded into their fused parameter; a parameter counts
    as loaded once every expert's matrices are in it."""

    def __init__(self, model: nn.Module, params: dict[str, torch.Tensor]) -> None:
        self.model = model
        self.params = params
        self.seen: dict[str, set[tuple[int, str]]] = {}

    def load(self, f, key: str) -> bool:
        """Load `key` if it is one expert's matrix of a fused parameter; False otherwise."""
        match = PER_EXPERT.match(_renamed(key))
        if match is None:
            return False
        prefix, expert, projection = match.group(1), int(match.group(2)), match.group(3)
        name = f"{prefix}.{'down_proj' if projection == 'down_proj' else 'gate_up_proj'}"
        if name not in self.params:
            raise KeyError(f"checkpoint tensor {key} has no place in the model")
        owner = _owner(self.model, name)
        if expert >= owner.num_experts:
            raise KeyError(f"checkpoint tensor {key}: the model has {owner.num_experts} experts")
        owner.load_expert(key, self.params[name], expert, projection, f.get_tensor(key))
        self.seen.setdefault(name, set()).add((expert, projection))
        return True

    def complete(self) -> set[tuple[str, None]]:
        done = set()
        for name, seen in self.seen.items():
            per_expert = 1 if name.endswith("down_proj") else 2
            if len(seen) == _owner(self.model, name).num_experts * per_expert:
                done.add((name, None))
        return done
