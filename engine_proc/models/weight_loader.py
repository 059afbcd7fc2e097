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
}
# transformers 5 saves the inner model's children under model.*; published Qwen2.5-VL
# checkpoints (and these modules) use model.* for the decoder and visual.* for the tower.
PREFIXES = (("model.language_model.", "model."), ("model.visual.", "visual."))
INDEX_FILE = "model.safetensors.index.json"


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def local_name(name: str) -> tuple[str, int | None]:
    """Checkpoint tensor name -> (this module's parameter name, shard of a merged layer)."""
    for old, new in PREFIXES:
        if name.startswith(old):
            name = new + name[len(old) :]
            break
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
    for file in checkpoint_files(Path(path)):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():
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
    missing = needed - loaded
    if missing:
        names = sorted(f"{n}[{s}]" if s is not None else n for n, s in missing)
        raise KeyError(f"checkpoint lacks {len(names)} tensors, e.g. {names[:5]}")
    device = next(model.parameters()).device
    if device.type == "cpu":
        store_weights_transposed(model)
