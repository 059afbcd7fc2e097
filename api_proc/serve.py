"""`flatserve serve`: spawn the engines, wait until ready, serve HTTP, stop everything."""

from __future__ import annotations

import argparse
import logging
import os
import signal

from api_proc.cli import DEFAULT_MAX_MODEL_LEN, ENGINE_FLAGS
from api_proc.config import ApiConfig
from api_proc.launcher import EngineStartError, start_engines, stop_engines
from rpc.sockets import IpcDir
from shared.engine_config import EngineConfig
from shared.memory import API_MALLOC_ENV, apply_malloc_settings
from shared.model_config import load_model_config
from shared.process import set_process_title

logger = logging.getLogger(__name__)


def _resolve_model(args: argparse.Namespace) -> tuple[str, str]:
    """(checkpoint folder, served model name)."""
    if args.model:
        return args.model, args.served_model_name or args.model
    from shared.tiny_checkpoint import ensure_tiny_checkpoint

    path = str(ensure_tiny_checkpoint())
    return path, args.served_model_name or "flatserve-tiny-qwen2.5-vl"


class _Stop(Exception):
    pass


def _raise_stop(signum, frame) -> None:
    raise _Stop(signal.Signals(signum).name)


def run_server(args: argparse.Namespace) -> int:
    import uvicorn

    from api_proc.app import build_app

    set_process_title("flatserve: api")
    apply_malloc_settings(API_MALLOC_ENV)
    model, served_name = _resolve_model(args)
    # Unset, the context is the model's own capped at DEFAULT_MAX_MODEL_LEN: requests without
    # max_tokens get the rest of the context, and image requests reserve KV for all of it.
    own = load_model_config(model).text.max_position_embeddings
    max_model_len = args.max_model_len or min(own, DEFAULT_MAX_MODEL_LEN)
    # --engine-addresses: engines started elsewhere (`flatserve engine`), none spawned here.
    num_spawned = 0 if args.engine_addresses else args.engines
    if not args.engine_addresses and args.engines < 1:
        raise SystemExit("--engines must be at least 1")
    ipc_dir = IpcDir(prefix="flatserve-")
    engine_kwargs = {name: getattr(args, name) for name in ENGINE_FLAGS}
    if num_spawned > 1 and not engine_kwargs["torch_threads"] and "OMP_NUM_THREADS" not in os.environ:
        # engines on one host share its cores instead of each taking all of them
        engine_kwargs["torch_threads"] = max(1, len(os.sched_getaffinity(0)) // num_spawned)
    configs = [
        EngineConfig(model=model, address=ipc_dir.address(f"engine{rank}"), rank=rank,
                     max_model_len=max_model_len, log_level=args.log_level, **engine_kwargs)
        for rank in range(num_spawned)
    ]
    addresses = tuple(args.engine_addresses) or tuple(c.address for c in configs)
    handles = []
    # uvicorn re-raises the SIGINT/SIGTERM it caught once it has shut down; with these
    # handlers that lands in the `except` below, so engines and socket files are cleaned up.
    signal.signal(signal.SIGTERM, _raise_stop)
    signal.signal(signal.SIGINT, _raise_stop)
    try:
        try:
            handles = start_engines(configs, timeout_s=args.engine_start_timeout)
        except EngineStartError as exc:
            logger.error("%s", exc)
            return 1
        config = ApiConfig.from_cli_args(
            args, model=model, served_model_name=served_name, max_model_len=max_model_len,
            engine_addresses=addresses,
        )
        app = build_app(config, engine_processes=[h.process for h in handles])
        logger.info("serving %s on http://%s:%d (glibc: %s)", served_name, config.host, config.port,
                    ", ".join(f"{k}={v}" for k, v in API_MALLOC_ENV.items()))
        uvicorn.run(app, host=config.host, port=config.port, loop="uvloop",
                    log_level=args.log_level, timeout_graceful_shutdown=5)
        return 0
    except _Stop as stop:
        logger.info("stopped by %s", stop)
        return 0
    finally:
        stop_engines(handles)
        ipc_dir.close()

