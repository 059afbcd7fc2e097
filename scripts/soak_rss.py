#!/usr/bin/env python
"""RSS soak test: send image requests at a set concurrency to a flatserve server (started here,
or attached with --url/--pid) and fail when any process's RSS keeps growing.

    python scripts/soak_rss.py --requests 2000 --concurrency 32 --image-size 1024 \\
        -- --model /path/to/qwen2.5-vl --mm-inflight-budget 1073741824
    python scripts/soak_rss.py --url http://127.0.0.1:8000 --pid 1234 1240 --duration-min 30

See `--help`; the work is done by flatserve.soak.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flatserve.soak import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(prog="soak_rss.py"))
