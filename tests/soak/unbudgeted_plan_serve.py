"""Test-only: `flatserve serve` whose API process states a memory plan with every budget
shrunk to nothing (its RSS at start, no room for bodies, images or requests) while it admits
load by its real budgets: the soak must fail it for going above its plan. Production code has
no such switch; this module patches the API's plan (which the launcher imports when it
states the plans) from outside.

    python -m tests.soak.unbudgeted_plan_serve serve [flatserve serve flags]
"""

from __future__ import annotations

import sys

from api_proc import memory_plan
from flatserve import cli
from shared.memory_plan import MemoryPlan

_api_plan = memory_plan.api_plan


def _unbudgeted_api_plan(*args, **kwargs) -> MemoryPlan:
    plan = _api_plan(*args, **kwargs)
    return MemoryPlan(plan.process, tuple(p for p in plan.parts if p.name == "runtime"))


memory_plan.api_plan = _unbudgeted_api_plan

if __name__ == "__main__":
    sys.exit(cli.main())
