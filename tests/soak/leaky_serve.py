"""Test-only: `flatserve serve` with one wrapper layer that keeps its payload reference, as
the engines in ../shared/seeds did before their fixes. Production code has no such switch;
this module patches the engine client from outside.

    python -m tests.soak.leaky_serve serve [flatserve serve flags]
"""

from __future__ import annotations

import sys

from api_proc.engine_client import EngineClient
from flatserve import cli

_kept: list = []  # what the leaking layer never lets go of
_submit = EngineClient.submit


def _leaky_submit(self, request, *args, **kwargs):
    _kept.append(request)  # a wrapper that logs or retries by keeping its argument
    return _submit(self, request, *args, **kwargs)


EngineClient.submit = _leaky_submit

if __name__ == "__main__":
    sys.exit(cli.main())
