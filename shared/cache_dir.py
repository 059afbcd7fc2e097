"""The folder flatserve caches what it makes into: generated checkpoints, built kernels."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """$FLATSERVE_CACHE, else $XDG_CACHE_HOME/flatserve, else ~/.cache/flatserve."""
    root = os.environ.get("FLATSERVE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "flatserve"
    )
    return Path(root)
