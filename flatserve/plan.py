"""`flatserve plan [serve flags]`: the memory plan `flatserve serve` would state with the same
flags, without loading a model or starting a process: to size a machine or a container.

The budgets are the same; the weights come from the checkpoint's safetensors headers, the
caches are sized as an engine sizes them, and the runtime parts are measured in this process:
the API's once its app is built (the tokenizer loaded), the engines' once the engine code and
torch are imported as well, plus what building a model runner adds beyond its tensors
(ENGINE_START_BYTES).
"""

from __future__ import annotations

import argparse
import sys

import psutil

from shared.engine_config import EngineConfig
from shared.memory_plan import (
    MemoryPart,
    MemoryPlan,
    format_table,
    memory_limit,
    over_limit_message,
)

# What a model runner adds to RSS beyond its weights and caches, which a dry run cannot see:
# torch's kernel libraries paged in (RssFile +111 MB) and the heap its construction leaves
# (RssAnon beyond its tensors). Measured on the tiny model: 280 -> 756 MB for 280 MB of
# weights and KV cache.
ENGINE_START_BYTES = 196 << 20


def run_plan(args: argparse.Namespace) -> int:
    from api_proc.app import build_app
    from api_proc.config import ApiConfig
    from api_proc.memory_plan import EngineCapacity, api_plan
    from flatserve.launcher import DEFAULT_MAX_MODEL_LEN, ENGINE_FLAGS, _resolve_model
    from shared.model_config import load_model_config

    model, names = _resolve_model(args)
    try:
        model_config = load_model_config(model)
    except (OSError, ValueError, KeyError) as e:
        print(f"flatserve plan: {model}: {e}", file=sys.stderr)
        return 2
    max_model_len = args.max_model_len or min(model_config.text.max_position_embeddings,
                                              DEFAULT_MAX_MODEL_LEN)
    num_engines = max(args.data_parallel_size, args.engines)
    try:
        engines = [EngineConfig(model=model, rank=rank, max_model_len=max_model_len,
                                mm_inflight_budget=args.mm_inflight_budget,
                                **{name: getattr(args, name) for name in ENGINE_FLAGS})
                   for rank in range(num_engines)]
        config = ApiConfig.from_cli_args(
            args, model=model, served_model_name=names, max_model_len=max_model_len,
            engine_addresses=tuple(f"ipc:///nonexistent/plan{rank}" for rank in range(num_engines)))
    except ValueError as e:
        print(f"flatserve plan: {e}", file=sys.stderr)
        return 2
    build_app(config)  # the API's runtime: its code and the tokenizer
    capacities = [EngineCapacity.of(e) for e in engines]
    plans = [api_plan(config, capacities, _rss()), *_engine_plans(engines, model_config)]
    print(format_table(plans))
    limit = memory_limit(args.host_memory_limit)
    problem = limit and over_limit_message(plans, *limit)
    if problem:
        print(f"flatserve plan: {problem}", file=sys.stderr)
        return 1
    return 0


def _engine_plans(engines: list[EngineConfig], model_config) -> list[MemoryPlan]:
    import torch  # noqa: F401  (an engine's runtime holds it)

    from engine_proc.llm_engine import LLMEngine  # noqa: F401  (and the engine's code)
    from engine_proc.memory_plan import engine_plan, planned_sizes, resident_bytes

    runtime = _rss()
    plans = []
    for config in engines:
        sizes = planned_sizes(config, model_config)
        plan = engine_plan(f"engine {config.rank}", config, model_config, sizes,
                           runtime + resident_bytes(sizes))
        start = MemoryPart("start-up", ENGINE_START_BYTES, "a runner beyond its tensors (measured)")
        runtime_part = MemoryPart("runtime", plan.parts[0].nbytes, "this process, code imported")
        plans.append(MemoryPlan(plan.process, (runtime_part, start, *plan.parts[1:])))
    return plans


def _rss() -> int:
    return psutil.Process().memory_info().rss
